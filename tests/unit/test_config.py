"""Configuration: YAML + dotted overrides, conversion, validation errors that name the key."""

from __future__ import annotations

import pytest

from areal_env.api.config import ConfigError, ExperimentConfig, load_config
from areal_env.api.config_load import config_from_dict, parse_overrides
from areal_env.api.io import GenerationConfig


def test_defaults_validate():
    cfg = load_config(ExperimentConfig)
    assert cfg.rollout.n_samples == 4
    assert cfg.model.path == "smollm2-135m-instruct"
    assert isinstance(cfg.gconfig, GenerationConfig)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "experiment_name: exp\nrollout:\n  n_samples: 2\n  discount: 0.9\n"
        "gconfig:\n  max_new_tokens: 32\nworkflow_kwargs:\n  a: 1\n"
    )
    cfg = load_config(
        ExperimentConfig,
        path,
        [
            "rollout.n_samples=8",
            "actor.lr=3e-5",
            "engine.addresses=[a:1,b:2]",
            "workflow_kwargs.b=x",
        ],
    )
    assert cfg.experiment_name == "exp"
    assert cfg.rollout.n_samples == 8
    assert cfg.rollout.discount == 0.9
    assert cfg.actor.lr == pytest.approx(3e-5)
    assert cfg.gconfig.max_new_tokens == 32
    assert cfg.engine.addresses == ["a:1", "b:2"]
    assert cfg.workflow_kwargs == {"a": 1, "b": "x"}
    assert str(cfg.run_dir).endswith("exp/trial0")


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_config(ExperimentConfig, overrides=["rollout.n_sample=8"])
    msg = str(e.value)
    assert "rollout.n_sample" in msg and "n_samples" in msg and "batch_size" in msg


def test_bad_value_names_key_and_value():
    with pytest.raises(ConfigError, match=r"rollout\.n_samples='many'"):
        load_config(ExperimentConfig, overrides=["rollout.n_samples=many"])
    with pytest.raises(ConfigError, match=r"rollout\.n_samples=0"):
        load_config(ExperimentConfig, overrides=["rollout.n_samples=0"])
    with pytest.raises(ConfigError, match=r"engine\.backend='gpu'.*local, sglang, remote"):
        load_config(ExperimentConfig, overrides=["engine.backend=gpu"])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(ExperimentConfig, overrides=["gconfig.max_new_tokens=0"])
    with pytest.raises(ConfigError, match=r"model\.gradient_checkpointing"):
        load_config(ExperimentConfig, overrides=["model.gradient_checkpointing=maybe"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["rollout.n_samples"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(ExperimentConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(ExperimentConfig, bad)


def test_optional_and_bool_conversion():
    cfg = config_from_dict(
        ExperimentConfig,
        {
            "trainer": {"total_train_steps": "null", "tensorboard": "false"},
            "model": {"max_context_len": 512},
        },
    )
    assert cfg.trainer.total_train_steps is None
    assert cfg.trainer.tensorboard is False
    assert cfg.model.max_context_len == 512


def test_generation_config_unknown_option():
    with pytest.raises(ValueError, match="unknown sampling option.*frequency_penalty"):
        GenerationConfig.from_dict({"frequency_penalty": 1.0})
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0)


def test_yaml_booleans_map_back_to_literal_words(tmp_path):
    cfg = load_config(ExperimentConfig, overrides=["trainer.recover=off"])
    assert cfg.trainer.recover == "off"
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  recover: off\n")
    assert load_config(ExperimentConfig, path).trainer.recover == "off"
    with pytest.raises(ConfigError, match=r"trainer\.recover=True"):
        load_config(ExperimentConfig, overrides=["trainer.recover=yes"])


def test_readme_config_reference_is_current():
    """README's reference is generated: `python -m areal_env.api.config_doc --update README.md`."""
    from pathlib import Path

    from areal_env.api.config_doc import END, START, render_reference

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == render_reference().strip()
