"""resolve_workflow: every accepted form, wrapping, and the error messages of the rejected ones."""

from __future__ import annotations

import sys
import textwrap

import pytest

from areal_env.api.config import RolloutConfig
from areal_env.api.imports import import_string
from areal_env.api.workflow import RolloutWorkflow
from areal_env.workflow.grouped import GroupedRolloutWorkflow
from areal_env.workflow.proxy_workflow import OpenAIProxyWorkflow
from areal_env.workflow.resolve import resolve_workflow

PROXY = {"proxy_base_url": "http://127.0.0.1:9", "admin_key": "admin"}


class EchoWorkflow(RolloutWorkflow):
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    async def arun_episode(self, engine, data):
        return None


class AsyncAgent:
    def __init__(self, greeting: str = "hi") -> None:
        self.greeting = greeting

    async def run(self, data, **extra_kwargs):
        return 1.0


class SyncAgent:
    def run(self, data):
        return 1.0


module_level_agent = AsyncAgent("module")


def one(**kw):
    return RolloutConfig(n_samples=1, **kw)


def test_instance_passes_through_and_refuses_kwargs():
    wf = EchoWorkflow()
    assert resolve_workflow(wf, rollout=one()) is wf
    assert resolve_workflow(wf, {}, rollout=one()) is wf
    with pytest.raises(TypeError, match="instance"):
        resolve_workflow(wf, {"scale": 2.0}, rollout=one())


def test_class_is_instantiated_with_kwargs():
    wf = resolve_workflow(EchoWorkflow, {"scale": 3.0}, rollout=one())
    assert isinstance(wf, EchoWorkflow) and wf.scale == 3.0
    with pytest.raises(TypeError):
        resolve_workflow(EchoWorkflow, {"nope": 1}, rollout=one())


@pytest.mark.parametrize(
    "spec",
    [
        f"{__name__}.EchoWorkflow",
        f"{__name__}:EchoWorkflow",
    ],
)
def test_module_strings(spec):
    wf = resolve_workflow(spec, {"scale": 2.0}, rollout=one())
    assert isinstance(wf, EchoWorkflow) and wf.scale == 2.0


def test_agent_class_instance_and_string_are_wrapped():
    wf = resolve_workflow(AsyncAgent, {"greeting": "yo"}, rollout=one(), **PROXY)
    assert isinstance(wf, OpenAIProxyWorkflow)
    assert wf.agent.greeting == "yo" and wf.agent_import is None
    agent = AsyncAgent()
    wf = resolve_workflow(agent, rollout=one(), **PROXY)
    assert wf.agent is agent
    with pytest.raises(TypeError, match="agent instance"):
        resolve_workflow(agent, {"greeting": "x"}, rollout=one(), **PROXY)
    wf = resolve_workflow(f"{__name__}:module_level_agent", rollout=one(), **PROXY)
    assert wf.agent is module_level_agent and wf.agent_import == f"{__name__}:module_level_agent"
    assert wf.proxy_base_url == PROXY["proxy_base_url"] and wf.admin_key == "admin"


def test_agent_needs_proxy_address():
    with pytest.raises(ValueError, match="proxy_base_url"):
        resolve_workflow(AsyncAgent, rollout=one())


def test_sync_agent_only_in_subproc_mode():
    with pytest.raises(TypeError, match="subproc"):
        resolve_workflow(SyncAgent, rollout=one(), **PROXY)
    wf = resolve_workflow(SyncAgent, rollout=one(mode="subproc"), **PROXY)
    assert isinstance(wf, OpenAIProxyWorkflow)


def test_n_samples_wraps_in_group():
    wf = resolve_workflow(EchoWorkflow, rollout=RolloutConfig(n_samples=3))
    assert isinstance(wf, GroupedRolloutWorkflow) and wf.n_samples == 3
    assert isinstance(wf.inner, EchoWorkflow)
    agent_wf = resolve_workflow(AsyncAgent, rollout=RolloutConfig(n_samples=2), **PROXY)
    assert isinstance(agent_wf.inner, OpenAIProxyWorkflow)
    assert agent_wf.sessions_per_episode == 2
    # an already grouped workflow is not wrapped twice
    assert resolve_workflow(wf, rollout=RolloutConfig(n_samples=3)) is wf


@pytest.mark.parametrize(
    "bad", [42, None, 3.5, object(), [EchoWorkflow], lambda data: 1.0, AsyncAgent.run]
)
def test_anything_else_is_a_type_error_listing_accepted_forms(bad):
    with pytest.raises(TypeError) as e:
        resolve_workflow(bad, rollout=one(), **PROXY)
    msg = str(e.value)
    assert "RolloutWorkflow" in msg and "import string" in msg and "async def run" in msg


def test_bad_strings_name_the_string():
    with pytest.raises(ImportError, match="no_such_pkg_xyz.mod.Attr"):
        resolve_workflow("no_such_pkg_xyz.mod.Attr", rollout=one())
    with pytest.raises(ImportError, match="no_such_pkg_xyz:Attr"):
        resolve_workflow("no_such_pkg_xyz:Attr", rollout=one())
    with pytest.raises(AttributeError, match="NoSuchAttr"):
        resolve_workflow(f"{__name__}.NoSuchAttr", rollout=one())
    with pytest.raises(AttributeError, match=f"{__name__}:NoSuchAttr"):
        resolve_workflow(f"{__name__}:NoSuchAttr", rollout=one())
    with pytest.raises(ImportError, match="does not exist"):
        resolve_workflow("missing/dir/agent.py:Agent", rollout=one())
    with pytest.raises(ImportError, match="name the attribute"):
        resolve_workflow("agent.py", rollout=one())
    with pytest.raises(ImportError, match="expected"):
        resolve_workflow("justaname", rollout=one())


def test_missing_dependency_inside_module_is_not_masked(tmp_path, monkeypatch):
    pkg = tmp_path / "wfpkg_broken"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import definitely_missing_dependency_abc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="definitely_missing_dependency_abc"):
        import_string("wfpkg_broken.mod.Agent")


def _write_agent(dir_, name="my_agent.py", cls="FileAgent"):
    dir_.mkdir(parents=True, exist_ok=True)
    path = dir_ / name
    path.write_text(
        textwrap.dedent(
            f"""
            from areal_env.api.workflow import RolloutWorkflow

            class {cls}:
                def __init__(self, tag="default"):
                    self.tag = tag

                async def run(self, data, **extra_kwargs):
                    return 0.5

            class FileWorkflow(RolloutWorkflow):
                async def arun_episode(self, engine, data):
                    return None

            agent_instance = {cls}("instance")
            """
        )
    )
    return path


def test_file_path_strings(tmp_path, monkeypatch):
    path = _write_agent(tmp_path / "agents")
    wf = resolve_workflow(f"{path}:FileAgent", {"tag": "t"}, rollout=one(), **PROXY)
    assert isinstance(wf, OpenAIProxyWorkflow) and wf.agent.tag == "t"
    wf2 = resolve_workflow(f"{path}:agent_instance", rollout=one(), **PROXY)
    assert wf2.agent.tag == "instance"
    assert type(wf2.agent) is type(wf.agent)  # the file is imported once
    assert type(resolve_workflow(f"{path}:FileWorkflow", rollout=one())).__name__ == "FileWorkflow"
    # relative to the working directory, like a YAML config would name it
    monkeypatch.chdir(tmp_path)
    wf3 = resolve_workflow("agents/my_agent.py:FileAgent", rollout=one(), **PROXY)
    assert type(wf3.agent) is type(wf.agent)
    with pytest.raises(AttributeError, match="Nope"):
        resolve_workflow("agents/my_agent.py:Nope", rollout=one())


def test_file_in_agents_folder_does_not_shadow_the_agents_sdk(tmp_path, monkeypatch):
    path = _write_agent(tmp_path / "agents", name="runner.py")
    monkeypatch.chdir(tmp_path)
    resolve_workflow("agents/runner.py:FileAgent", rollout=one(), **PROXY)
    import agents  # the OpenAI Agents SDK

    assert hasattr(agents, "Runner"), "the 'agents' SDK package was shadowed"
    assert not any(
        getattr(m, "__file__", None) == str(path)
        for name, m in list(sys.modules.items())
        if name == "agents" or name.startswith("agents.")
    )
