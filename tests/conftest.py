"""Shared fixtures: one converted model folder and one loaded engine per pytest session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Shared fixtures live in tests/fixtures/<area>.py, one module per area, loaded as plugins.
pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if p.stem != "__init__"
)


@pytest.fixture(scope="session")
def model_path() -> str:
    """The default model as a local HF folder (converted once into the cache)."""
    from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

    return str(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RUN_AENV_INTEGRATION") == "1":
        return
    skip = pytest.mark.skip(reason="set RUN_AENV_INTEGRATION=1 to run integration tests")
    for item in items:
        if "integration" in item.keywords or "tests/integration" in str(item.fspath):
            item.add_marker(skip)
