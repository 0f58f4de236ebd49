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


def _project(root) -> None:
    """A user's project folder: data, agent, reward, an MCP server script in a venv of its own."""
    (root / "data.jsonl").write_text('{"question": "q"}\n')
    (root / "agent.py").write_text("class Agent:\n    pass\n")
    (root / "reward.py").write_text("def reward(final_answer):\n    return 1.0\n")
    server = root / ".venv-sqlite" / "bin" / "mcp-server-sqlite"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)


def test_every_path_in_a_config_file_is_relative_to_the_file(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    _project(project)
    (project / "config.yaml").write_text(
        "train_dataset: data.jsonl\nworkflow: agent.py:Agent\nfileroot: runs\n"
        "workflow_kwargs:\n  reward_fn: reward.py:reward\n  mcp_config:\n"
        "    command: .venv-sqlite/bin/mcp-server-sqlite\n    args: [--db-path, shop.db]\n"
        "service:\n  store: state/service.db\n"
        "valid_dataset: data.jsonl\nextra_valid_datasets:\n  new_phrasing: data.jsonl\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the command runs from another folder
    cfg = load_config(
        ExperimentConfig, project / "config.yaml", ["valid_dataset=../project/data.jsonl"]
    )
    assert cfg.train_dataset == str(project / "data.jsonl")
    assert cfg.workflow == f"{project / 'agent.py'}:Agent"
    assert cfg.fileroot == str(project / "runs")
    assert cfg.service.store == str(project / "state" / "service.db")
    kwargs = cfg.workflow_kwargs
    assert kwargs["reward_fn"] == f"{project / 'reward.py'}:reward"
    mcp = kwargs["mcp_config"]
    assert mcp["command"] == str(project / ".venv-sqlite" / "bin" / "mcp-server-sqlite")
    assert mcp["cwd"] == str(project)  # the server's own relative arguments resolve there too
    assert cfg.extra_valid_datasets == {"new_phrasing": str(project / "data.jsonl")}
    assert cfg.valid_dataset == "../project/data.jsonl"  # the command line: the working dir
    assert cfg.model.path == "smollm2-135m-instruct"  # a model name stays a name


@pytest.mark.parametrize(
    ("line", "key", "missing"),
    [
        (
            "workflow_kwargs:\n  reward_fn: rewards.py:reward\n",
            "workflow_kwargs.reward_fn",
            "rewards.py",
        ),
        ("train_dataset: train.jsonl\n", "train_dataset", "train.jsonl"),
        (
            "valid_dataset: data.jsonl\nextra_valid_datasets:\n  new: new.jsonl\n",
            "extra_valid_datasets.new",
            "new.jsonl",
        ),
        ("workflow: agents.py:Agent\n", "workflow", "agents.py"),
        (
            "workflow_kwargs:\n  mcp_config:\n    command: venv/bin/mcp-server-sqlite\n",
            "workflow_kwargs.mcp_config.command",
            "venv/bin/mcp-server-sqlite",
        ),
    ],
)
def test_a_wrong_path_is_reported_at_config_time(tmp_path, monkeypatch, line, key, missing):
    _project(tmp_path)
    (tmp_path / "config.yaml").write_text(line)
    monkeypatch.chdir("/")
    with pytest.raises(ConfigError) as e:
        load_config(ExperimentConfig, tmp_path / "config.yaml")
    assert str(e.value).startswith(key + "=")
    assert str(tmp_path / missing) in str(e.value) and "relative to the file's folder" in str(
        e.value
    )


def test_a_bare_mcp_command_is_looked_up_on_path(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "workflow_kwargs:\n  mcp_config:\n    command: no-such-mcp-server-anywhere\n"
    )
    with pytest.raises(ConfigError, match=r"no executable 'no-such-mcp-server-anywhere' on PATH"):
        load_config(ExperimentConfig, tmp_path / "config.yaml")
    (tmp_path / "config.yaml").write_text("workflow_kwargs:\n  mcp_config:\n    command: sh\n")
    cfg = load_config(ExperimentConfig, tmp_path / "config.yaml")
    assert cfg.workflow_kwargs["mcp_config"]["command"] == "sh"  # run as given, found on PATH


def test_the_train_command_fails_on_a_wrong_path_before_loading_a_model(tmp_path, capsys):
    from areal_env.trainer.cli import main

    _project(tmp_path)
    (tmp_path / "config.yaml").write_text(
        "train_dataset: data.jsonl\nworkflow: agent.py:Agent\n"
        "workflow_kwargs:\n  reward_fn: reward.py:missing_name\n  mcp_config:\n"
        "    command: python\n    cwd: no-such-folder\n"
    )
    assert main([str(tmp_path / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert "workflow_kwargs.mcp_config.cwd" in err and str(tmp_path / "no-such-folder") in err


def test_mmap_threshold_stays_within_glibcs_range():
    cfg = load_config(ExperimentConfig, overrides=["trainer.malloc_mmap_threshold_mb=32"])
    assert cfg.trainer.malloc_mmap_threshold_mb == 32
    for bad in ("0", "64"):
        with pytest.raises(ConfigError, match=r"trainer\.malloc_mmap_threshold_mb.*32 MB"):
            load_config(ExperimentConfig, overrides=[f"trainer.malloc_mmap_threshold_mb={bad}"])
