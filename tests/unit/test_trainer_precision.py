"""Mixed precision: bf16/fp16 compute over fp32 master weights learns at RL learning rates.

AdamW on bf16 weights rounds an lr 1e-6 update away for nearly every weight (a bf16 ulp is
0.4-0.8 % of the weight); with fp32 master weights nearly every weight moves. Checked for both
strategies (FSDP2 with one rank in this process), against the explicit pure-bf16 opt-in that
shows the failure, and along the push path (the engine gets weights in its own dtype).
"""

from __future__ import annotations

import json
import logging
import socket

import pytest
import torch
from safetensors.torch import load_file

from areal_env.api.config import ActorConfig, ModelConfig
from areal_env.trainer.actor import PPOActor
from tests.unit.test_trainer_tree import _agent_batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank_group(monkeypatch):
    """torchrun's environment for one rank; the process group is torn down afterwards."""
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(key, value)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _actor(path: str, dtype: str, strategy: str = "single", **actor_kw) -> PPOActor:
    cfg = ActorConfig(strategy=strategy, lr=1e-6, ppo_n_minibatches=1, **actor_kw)
    return PPOActor(path, cfg, ModelConfig(dtype=dtype, device="cpu"), seed=3)


def _changed_fraction(actor: PPOActor, batch: dict) -> float:
    """The fraction of parameter elements one update moves (any change counts)."""
    params = [p for p in actor.model.parameters() if p.requires_grad]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    before = [p.detach().clone() for p in local]
    stats = actor.update(batch, step=1)
    assert stats["actor/update_skipped"] == 0.0 and stats["actor/optimizer_steps"] == 1.0
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(local, before, strict=True))
    return changed / sum(b.numel() for b in before)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_compute_moves_the_weights_at_lr_1e_6(
    tiny_model_path, tokenizer, strategy, dtype, request
):
    if strategy == "fsdp":
        request.getfixturevalue("one_rank_group")
    if strategy == "fsdp" and dtype == "float16":
        pytest.skip("fp16 loss scaling is checked with strategy single")
    actor = _actor(tiny_model_path, dtype, strategy)
    params = list(actor.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}  # master weights
    assert actor.precision.compute == getattr(torch, dtype)
    assert actor.precision.autocast == (strategy == "single")
    fraction = _changed_fraction(actor, _agent_batch(tokenizer))
    assert fraction >= 0.95, fraction
    states = [v for st in actor.optimizer.state.values() for v in st.values()]
    assert {t.dtype for t in states if t.is_floating_point() and t.dim() > 0} == {torch.float32}
    if dtype == "float16":
        assert actor.precision.scaler is not None and actor.precision.scaler.get_scale() > 1


def test_pure_bf16_opt_in_names_its_cost_and_loses_the_update(tiny_model_path, tokenizer, caplog):
    """The opt-in keeps the weights in bf16: an lr 1e-6 update moves almost none of them (so
    the mixed-precision test above can fail), and the log says so when it is turned on."""
    with caplog.at_level(logging.WARNING, logger="areal_env.trainer.precision"):
        actor = _actor(tiny_model_path, "bfloat16", lossy_low_precision_weights=True)
    assert "rounded away" in caplog.text and "lossy_low_precision_weights" in caplog.text
    assert {p.dtype for p in actor.model.parameters()} == {torch.bfloat16}
    assert _changed_fraction(actor, _agent_batch(tokenizer)) < 0.05


def test_fp32_compute_is_the_cpu_default(tiny_model_path):
    actor = _actor(tiny_model_path, "auto")
    assert actor.precision.compute == torch.float32 and not actor.precision.autocast
    assert actor.tree_kernel == "sdpa"


def _assert_exported_in(actor: PPOActor, folder, dtype: torch.dtype) -> None:
    """``export_hf`` writes its tensors in ``dtype`` and its config says so (a server with
    dtype auto then serves in it)."""
    actor.export_hf(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    written = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in written.values()} == {dtype}


def _assert_serves_exactly(eng, pushed: dict, dtype: torch.dtype) -> None:
    """Start ``eng``: it loads the model in ``dtype`` and, once ``pushed`` is loaded, serves
    exactly those tensors."""
    eng.initialize()
    try:
        assert eng.model.dtype == dtype
        eng.update_weights(pushed)
        served = eng.model.state_dict()
        for name, t in pushed.items():
            assert torch.equal(served[name], t), name
    finally:
        eng.destroy()


def test_the_engine_gets_weights_in_its_own_dtype(tiny_model_path, tokenizer, tmp_path):
    """bf16 compute: the pushed state dict and the HF export are bf16 (half the bytes; the
    exported config says bf16, so a server with dtype auto serves bf16), a bf16 engine loads
    the push, and the trainer's own weights stay fp32."""
    from areal_env.engine.local import LocalEngine

    actor = _actor(tiny_model_path, "bfloat16")
    _changed_fraction(actor, _agent_batch(tokenizer))
    pushed = actor.state_dict_for_engine()
    assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
    master = dict(actor.model.named_parameters())
    for name, t in pushed.items():
        if name in master:
            assert torch.equal(t, master[name].detach().to(torch.bfloat16)), name
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    _assert_exported_in(actor, tmp_path / "hf", torch.bfloat16)
    eng = LocalEngine(tiny_model_path, device="cpu", dtype="bfloat16", max_batch_size=2)
    _assert_serves_exactly(eng, pushed, torch.bfloat16)


def test_fp16_overflow_skips_the_step_and_lowers_the_loss_scale(tiny_model_path, tokenizer):
    """A loss scale far too large overflows fp16 gradients: the step is skipped (the weights
    stay, no warning: it is how loss scaling finds its scale), the scale halves, and an update
    at the default scale (2^16) steps."""
    actor = _actor(tiny_model_path, "float16")
    actor.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    before = [p.detach().clone() for p in actor.model.parameters()]
    batch = _agent_batch(tokenizer)
    stats = actor.update(batch, step=1)
    assert stats["actor/nonfinite_skipped"] == 1.0 and stats["actor/optimizer_steps"] == 0.0
    assert all(torch.equal(p, b) for p, b in zip(actor.model.parameters(), before, strict=True))
    assert actor.precision.scaler.get_scale() == 2.0**99
    actor.precision.scaler = torch.amp.GradScaler("cpu")
    assert _changed_fraction(actor, batch) >= 0.95


def test_bf16_compute_with_an_fp32_engine(tiny_model_path, tokenizer, tmp_path):
    """``engine.dtype`` apart from ``model.dtype``: the update runs under bf16 autocast, and
    the engine built from the same config loads fp32 and gets the fp32 master weights
    bit-exactly (no bf16 rounding in between); the export stays marked fp32."""
    from areal_env.api.config import EngineConfig
    from areal_env.engine.local import LocalEngine

    model_cfg = ModelConfig(dtype="bfloat16", device="cpu")
    engine_cfg = EngineConfig(dtype="float32", max_batch_size=2)
    cfg = ActorConfig(lr=1e-6, ppo_n_minibatches=1)
    actor = PPOActor(
        tiny_model_path, cfg, model_cfg, seed=3, engine_dtype=engine_cfg.served_dtype(model_cfg)
    )
    assert actor.precision.autocast and actor.precision.compute == torch.bfloat16
    assert actor.precision.engine == torch.float32
    assert _changed_fraction(actor, _agent_batch(tokenizer)) >= 0.95
    pushed = actor.state_dict_for_engine()
    assert {t.dtype for t in pushed.values()} == {torch.float32}
    master = dict(actor.model.named_parameters())
    for name, t in pushed.items():
        if name in master:
            assert torch.equal(t, master[name].detach()), name
    _assert_exported_in(actor, tmp_path / "hf", torch.float32)
    eng = LocalEngine.from_config(
        ModelConfig(path=tiny_model_path, dtype="bfloat16", device="cpu"), engine_cfg
    )
    _assert_serves_exactly(eng, pushed, torch.float32)


def test_pure_bf16_weights_exported_for_an_fp32_engine_say_fp32(tiny_model_path, tmp_path):
    """Under ``lossy_low_precision_weights`` the live weights are bf16, so ``save_pretrained``
    writes bf16 into the config: an fp32 engine's export must say fp32, as its tensors are."""
    cfg = ActorConfig(lossy_low_precision_weights=True)
    model_cfg = ModelConfig(dtype="bfloat16", device="cpu")
    actor = PPOActor(tiny_model_path, cfg, model_cfg, seed=3, engine_dtype="float32")
    assert {p.dtype for p in actor.model.parameters()} == {torch.bfloat16}
    _assert_exported_in(actor, tmp_path / "hf", torch.float32)


def test_engine_dtype_follows_model_dtype_and_reaches_sglang(monkeypatch, tmp_path):
    """``engine.dtype: auto`` serves in ``model.dtype``; set, it wins, and SGLang's servers get
    it as ``--dtype``; a wrong name says which ones are valid."""
    from areal_env.api.config import ConfigError, EngineConfig, ExperimentConfig
    from areal_env.engine import launcher

    assert EngineConfig().served_dtype(ModelConfig(dtype="bfloat16")) == "bfloat16"
    assert EngineConfig(dtype="float32").served_dtype(ModelConfig(dtype="bfloat16")) == "float32"
    with pytest.raises(ConfigError, match="engine.dtype='fp32'.*float32.*follows model.dtype"):
        EngineConfig(dtype="fp32").validate()

    seen: dict = {}
    monkeypatch.setattr(launcher, "launch_servers", lambda path, **kw: seen.update(kw))
    cfg = ExperimentConfig(fileroot=str(tmp_path))
    cfg.model = ModelConfig(path=str(tmp_path), dtype="bfloat16")
    launcher.launch_from_config(cfg)
    assert seen["extra_args"][:2] == ["--dtype", "bfloat16"]
    cfg.engine = EngineConfig(dtype="float32")
    launcher.launch_from_config(cfg)
    assert seen["extra_args"][:2] == ["--dtype", "float32"]
    cfg.model = ModelConfig(path=str(tmp_path))
    cfg.engine = EngineConfig()
    launcher.launch_from_config(cfg)
    assert "--dtype" not in seen["extra_args"]
