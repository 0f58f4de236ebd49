"""The ``engine.backend`` switch: local | sglang (addresses or launched) | remote."""

from __future__ import annotations

import os

import pytest

from areal_env.api.config import ConfigError, ExperimentConfig, load_config
from areal_env.api.config_load import config_from_dict
from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.factory import create_engine
from areal_env.engine.sglang import SGLangEngine
from tests.fixtures.sglang import SERVE_ARGS, SERVE_COMMAND


def cfg(**engine) -> ExperimentConfig:
    return config_from_dict(ExperimentConfig, {"engine": engine})


def test_local_backend():
    from areal_env.engine.local import LocalEngine

    eng = create_engine(cfg(backend="local", max_batch_size=4))
    assert isinstance(eng, LocalEngine) and eng.max_batch_size == 4


def test_sglang_backend_with_addresses():
    eng = create_engine(
        cfg(backend="sglang", max_retries=5, sglang={"addresses": ["http://10.0.0.1:30000/"]})
    )
    assert isinstance(eng, SGLangEngine)
    assert eng.addresses == ["10.0.0.1:30000"] and eng.servers.attempts == 6  # 1 try + 5 retries
    assert eng.supports_state_dict_update is False


def test_config_errors():
    with pytest.raises(ConfigError, match="addresses"):
        cfg(backend="remote")
    with pytest.raises(ConfigError, match="backend"):
        cfg(backend="vllm")
    with pytest.raises(ConfigError, match="host:port"):
        create_engine(cfg(backend="remote", addresses=["localhost"]))
    with pytest.raises(ConfigError, match="num_servers"):
        cfg(backend="sglang", sglang={"num_servers": 0})
    # Dotted overrides reach the SGLang section.
    c = load_config(
        ExperimentConfig,
        overrides=[
            "engine.backend=sglang",
            "engine.sglang.tp_size=2",
            "engine.sglang.num_servers=4",
        ],
    )
    assert c.engine.sglang.tp_size == 2 and c.engine.sglang.num_servers == 4


async def test_remote_backend_generates(sglang_servers, tokenizer):
    eng = create_engine(cfg(backend="remote", addresses=sglang_servers.addresses))
    eng.initialize()
    try:
        resp = await eng.agenerate(
            ModelRequest(tokenizer.encode("Hello"), GenerationConfig(3, greedy=True))
        )
        assert len(resp.output_tokens) == 3 and resp.stop_reason == "length"
    finally:
        eng.destroy()
    assert all(p.alive() for p in sglang_servers.servers)  # not ours to stop


async def test_sglang_backend_launches_and_tears_down(tmp_path, tokenizer):
    """engine.backend=sglang without addresses launches servers at initialize() (here
    `areal-env serve` through launch_command) and destroy() stops them."""
    eng = create_engine(
        cfg(
            backend="sglang",
            sglang={
                "launch_command": SERVE_COMMAND,
                "extra_args": [*SERVE_ARGS, "--enable-metrics"],  # an SGLang-only flag: ignored
                "base_port": 0,
                "log_dir": str(tmp_path),
                "startup_timeout": 180,
            },
        )
    )
    assert eng.addresses == []
    eng.initialize()
    try:
        pids = [s.pid for s in eng.owned.servers]
        assert len(eng.addresses) == 1 and list(tmp_path.glob("server-0-*.log"))
        resp = await eng.agenerate(
            ModelRequest(tokenizer.encode("Hi"), GenerationConfig(2, greedy=True))
        )
        assert len(resp.output_tokens) == 2
    finally:
        eng.destroy()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
