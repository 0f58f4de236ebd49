"""``load_causal_lm``: the model loads without transformers' "Loading weights" bar on the
console, and the process-wide progress-bar switch is left as it was."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from areal_env.engine.models import DEFAULT_MODEL, load_causal_lm, resolve_model_path


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(resolve_model_path(DEFAULT_MODEL))


def test_no_loading_bar_and_switch_restored(model_path: str, capfd: pytest.CaptureFixture) -> None:
    hf_logging.enable_progress_bar()
    AutoModelForCausalLM.from_pretrained(model_path)  # the control: transformers' own bar
    control = capfd.readouterr().err
    if "Loading weights" not in control:
        pytest.skip("this transformers version prints no loading bar")
    model = load_causal_lm(model_path)
    assert "Loading weights" not in capfd.readouterr().err
    assert model.config.vocab_size > 0
    assert hf_logging.is_progress_bar_enabled()  # turned back on


def test_a_disabled_switch_stays_disabled(model_path: str) -> None:
    hf_logging.disable_progress_bar()
    try:
        load_causal_lm(model_path)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
