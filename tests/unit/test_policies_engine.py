"""Issue 27, serving several policies with the real model: LoRA adapters decoded in one batch
(each row with its own) give exactly what each adapter gives alone and what its merged weights
give; one policy's update replaces only its own adapter (in the trainer and in the engine,
bitwise); ``areal-env serve`` loads adapters by name (SGLang's ``/load_lora_adapter``) and
answers ``lora_path`` per request; bad adapters and servers without LoRA are refused."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from areal_env.api.config import ExperimentConfig, load_config
from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.adapters import AdapterError, AdapterWeights
from areal_env.engine.lora import merge_lora_weights, save_adapter_folder

pytestmark = pytest.mark.slow

PROMPT = "Name three colours of the rainbow and explain why the sky is blue."
TARGETS = {"q_proj": (576, 576), "v_proj": (576, 192)}


def random_adapter(seed: int, r: int = 4, scale: float = 0.08, layers: int = 30) -> AdapterWeights:
    """A peft-named adapter on q/v of every layer, large enough to change greedy outputs."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, (n_in, n_out) in TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * scale
    return AdapterWeights(tensors, {"r": r, "lora_alpha": 2 * r, "target_modules": list(TARGETS)})


@pytest.fixture(scope="module")
def local(model_path):
    from areal_env.engine.local import LocalEngine

    eng = LocalEngine(model_path, prefix_cache_mb=64, num_threads=1)
    eng.initialize()
    yield eng
    eng.destroy()


def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text)


async def generate(engine, ids, adapters: list[str | None], n: int = 10) -> list[list[int]]:
    g = GenerationConfig(max_new_tokens=n, greedy=True)
    outs = await asyncio.gather(
        *(engine.agenerate(ModelRequest(list(ids), g, adapter=a)) for a in adapters)
    )
    return [o.output_tokens for o in outs]


def test_rows_of_different_adapters_share_a_batch(local, model_path):
    from transformers import AutoModelForCausalLM

    a, b = random_adapter(1), random_adapter(2)
    local.load_adapter("a", a)
    local.load_adapter("b", b)
    ids = prompt_ids(local.tokenizer)
    alone = {n: asyncio.run(generate(local, ids, [n]))[0] for n in ("a", "b", None)}
    assert len({tuple(v) for v in alone.values()}) == 3  # three different answers
    before = local.stats()["max_batch_size_seen"]
    # one batch, rows interleaved; the prefix cache holds each adapter's prompt KV apart
    mixed = asyncio.run(generate(local, ids, ["a", "b", None, "b", "a"]))
    assert mixed == [alone["a"], alone["b"], alone[None], alone["b"], alone["a"]]
    assert local.stats()["max_batch_size_seen"] >= max(before, 2)
    # adapter a, as served, is the merged model's answer
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    merged = merge_lora_weights({**ref.state_dict(), **a.tensors}, a.config)
    ref.load_state_dict(merged, strict=False)
    want = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=2)[
        0, len(ids) :
    ].tolist()
    assert want == alone["a"]

    with pytest.raises(ValueError, match="no LoRA adapter named 'c'.*a, b"):
        asyncio.run(generate(local, ids, ["c"]))
    served = {k: (x.clone(), y.clone()) for k, (x, y) in local.worker.adapters.tensors("a").items()}
    bad = dict(b.tensors)
    bad["base_model.model.model.layers.0.mlp.nowhere.lora_A.weight"] = torch.zeros(4, 8)
    bad["base_model.model.model.layers.0.mlp.nowhere.lora_B.weight"] = torch.zeros(8, 4)
    with pytest.raises(AdapterError, match="does not have"):
        local.load_adapter("a", AdapterWeights(bad, b.config))
    for k, (x, y) in local.worker.adapters.tensors("a").items():  # nothing half-loaded
        assert torch.equal(x, served[k][0]) and torch.equal(y, served[k][1])
    embed = AdapterWeights(
        {
            "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 49152),
            "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(576, 4),
        },
        {"r": 4, "lora_alpha": 8},
    )
    with pytest.raises(AdapterError, match="nn.Linear layers only"):
        local.load_adapter("e", embed)
    local.unload_adapter("a")
    local.unload_adapter("b")
    assert local.adapter_names == []


def _two_policy_config(tmp_path) -> ExperimentConfig:
    return load_config(
        ExperimentConfig,
        overrides=[
            f"fileroot={tmp_path}",
            "policies.planner.lr=1e-3",
            "policies.writer.lr=1e-3",
            "actor.lora.r=4",
            "actor.lora.alpha=8",
            "actor.ppo_n_minibatches=1",
            "model.device=cpu",
        ],
    )


def test_each_update_changes_only_its_own_adapter(local, tmp_path):
    """Two LoRA policies share the trainer's model; updating one leaves the other's adapter
    and the base weights bitwise equal, in the trainer and in the engine it is pushed to."""
    from areal_env.engine.adapters import AdapterEngine
    from areal_env.trainer.dist import SINGLE
    from areal_env.trainer.policies import build_policies
    from areal_env.trainer.push import WeightPusher
    from areal_env.trainer.ranks import RankChannel
    from tests.distributed.step_worker import fixed_batch

    cfg = _two_policy_config(tmp_path)
    policies = build_policies(cfg, RankChannel(SINGLE), None)
    planner, writer = policies["planner"].actor, policies["writer"].actor
    assert planner.model is writer.model  # one copy of the base weights
    pushers = {
        name: WeightPusher(
            cfg,
            p.actor,
            RankChannel(SINGLE),
            engine=AdapterEngine(local, name),
            policy=name,
            adapter=True,
        )
        for name, p in policies.items()
    }
    for pusher in pushers.values():
        pusher.push(0)
    assert local.adapter_names == ["planner", "writer"]

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in planner.model.named_parameters()}

    def served(name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            k: (a.clone(), b.clone()) for k, (a, b) in local.worker.adapters.tensors(name).items()
        }

    batch = fixed_batch(planner.model.config.vocab_size)
    for actor, other in (("planner", "writer"), ("writer", "planner")):
        before, other_served = snapshot(), served(other)
        stats = policies[actor].actor.update(batch, step=0)
        assert stats["actor/optimizer_steps"] == 1.0
        after = snapshot()
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        assert changed and all(f".{actor}." in n and "lora_" in n for n in changed)
        assert all(torch.equal(before[n], after[n]) for n in before if f".{other}." in n)
        pushers[actor].push(1)
        assert pushers[actor].last_push_bytes > 0
        for k, (a, b) in served(other).items():  # the other adapter, as served: untouched
            assert torch.equal(a, other_served[k][0]) and torch.equal(b, other_served[k][1])
    # the pushed adapter is the trainer's: served outputs equal the trainer's merged weights
    ids = prompt_ids(local.tokenizer)
    got = asyncio.run(generate(local, ids, ["writer"], n=6))[0]
    writer.activate()
    writer.model.eval()
    with torch.no_grad():
        want = writer.model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=2,
            use_cache=False,
        )[0, len(ids) :].tolist()
    assert got == want
    local.unload_adapter("planner")
    local.unload_adapter("writer")


def test_serve_loads_adapters_by_name(local, model_path, tmp_path):
    """``areal-env serve --enable-lora`` speaks SGLang's adapter routes; ``SGLangEngine``
    serves each policy by name and replaces an adapter with a new version."""
    from areal_env.engine.launcher import launch_servers
    from areal_env.engine.sglang import SGLangEngine
    from tests.fixtures.sglang import SERVE_ARGS, SERVE_COMMAND

    folders = {}
    for i, name in enumerate(("planner", "writer", "planner-v2")):
        w = random_adapter(10 + i)
        folders[name] = tmp_path / name
        save_adapter_folder(folders[name], w.tensors, w.config)
    group = launch_servers(
        model_path,
        num_servers=2,
        base_port=0,
        command=SERVE_COMMAND,
        extra_args=[*SERVE_ARGS, "--enable-lora", "--max-lora-rank", "16"],
        log_dir=tmp_path / "logs",
        startup_timeout=180,
    )
    plain = launch_servers(
        model_path,
        num_servers=1,
        base_port=0,
        command=SERVE_COMMAND,
        extra_args=SERVE_ARGS,
        log_dir=tmp_path / "logs-plain",
        startup_timeout=180,
    )
    eng = SGLangEngine(group.addresses, max_retries=1, retry_backoff=0.05)
    off = SGLangEngine(plain.addresses, max_retries=1, retry_backoff=0.05)
    try:
        eng.initialize()
        off.initialize()
        eng.check_lora_serving()
        with pytest.raises(AdapterError, match="--enable-lora"):
            off.check_lora_serving()
        eng.load_adapter("planner", folders["planner"])
        eng.adapter("writer").update_weights(str(folders["writer"]))
        assert eng.adapter_names == ["planner", "writer"]
        local.load_adapter("planner", folders["planner"])
        local.load_adapter("writer", folders["writer"])
        ids = prompt_ids(local.tokenizer)
        want = asyncio.run(generate(local, ids, ["planner", "writer", None]))
        got = asyncio.run(
            generate(eng, ids, ["planner", "writer", None])
        )  # lora_path per request, both servers
        assert got == want and len({tuple(x) for x in got}) == 3
        # a new version of one adapter: unloaded and loaded again on every server
        eng.adapter("planner").update_weights(str(folders["planner-v2"]))
        local.load_adapter("planner", folders["planner-v2"])
        want2 = asyncio.run(generate(local, ids, ["planner", "writer"]))
        assert asyncio.run(generate(eng, ids, ["planner", "writer"])) == want2
        assert want2[0] != want[0] and want2[1] == want[1]
        with pytest.raises(ValueError, match="--enable-lora"):
            asyncio.run(generate(off, ids, ["planner"]))
    finally:
        eng.destroy()
        off.destroy()
        group.stop()
        plain.stop()
        for name in local.adapter_names:
            local.unload_adapter(name)
    assert sys.executable  # the servers ran this interpreter


def test_a_model_of_its_own_gets_its_own_engine(model_path, tmp_path):
    """A full-model policy is served by an engine of its own next to the base engine's
    adapters, through one proxy; an adapter policy starts as a no-op adapter (the service
    serves it before the first push); adapters LoRA cannot put on the model are refused."""
    import openai

    from areal_env.api.config import ConfigError
    from areal_env.engine.local import LocalEngine
    from areal_env.engine.policies import PolicyEngines
    from areal_env.proxy.policies import PolicyEndpoint
    from areal_env.proxy.server import ProxyServer
    from areal_env.trainer.actor_lora import apply_lora
    from tests.fixtures.proxy import open_session

    cfg = load_config(
        ExperimentConfig,
        overrides=[
            f"fileroot={tmp_path}",
            f"model.path={model_path}",
            "model.num_threads=1",
            "policies.planner={}",
            f"policies.critic.model={model_path}",
        ],
    )
    engines = PolicyEngines.from_config(cfg)
    engines.initialize()
    try:
        critic, planner = engines.routes["critic"], engines.routes["planner"]
        assert isinstance(critic, LocalEngine) and critic is not engines.base
        assert engines.engines == [engines.base, critic]
        engines.load_untrained_adapters()
        server = ProxyServer(
            engines.base,
            engines.base.tokenizer,
            policies={
                n: PolicyEndpoint(e, engines.tokenizer(n)) for n, e in engines.routes.items()
            },
        ).start()
        try:
            _, key = open_session(server)
            client = openai.OpenAI(base_url=server.openai_base_url, api_key=key, max_retries=0)
            msgs = [{"role": "user", "content": PROMPT}]
            answers = {
                name: client.chat.completions.create(
                    model=name, messages=msgs, max_tokens=8, temperature=0
                )
                .choices[0]
                .message.content
                for name in ("planner", "critic")
            }
        finally:
            server.stop()
        # both untrained: the base model's greedy answer, from two engines
        assert answers["planner"] == answers["critic"]
        assert critic.stats()["requests"] == 1 and engines.base.stats()["requests"] == 1
        engines.set_version(3)
        assert critic.get_version() == 3 == planner.get_version()
    finally:
        engines.destroy()

    from transformers import AutoModelForCausalLM

    from areal_env.api.config import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(model_path)
    with pytest.raises(ConfigError, match="LoRA adapters cannot be put on"):
        apply_lora(model, {"p": LoraConfig(target_modules=["c_attn"])})


@pytest.mark.extended
def test_two_policies_under_fsdp_step_equals_single_process(tmp_path, model_path):
    """Two LoRA policies on one sharded model (2 gloo ranks): policy a's step equals the
    1-process step, and policy b's adapter is bitwise what it was, on both."""
    from safetensors.torch import load_file

    from tests.distributed.run import run_worker

    def _load(path):
        return load_file(str(path))

    def _max_diff(a: dict, b: dict) -> float:
        assert set(a) == set(b)
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    common = ["--model", model_path, "--steps", "sgd,adamw", "--policies"]
    (single,) = run_worker([*common, "--strategy", "single", "--out", str(tmp_path / "s")])
    ranks = run_worker([*common, "--strategy", "fsdp", "--out", str(tmp_path / "f")], nproc=2)
    assert single["other_unchanged"] is True
    assert [r["other_unchanged"] for r in ranks] == [True, True]
    for i, name in enumerate(["sgd", "adamw"]):
        s_step, f_step = single["steps"][i], ranks[0]["steps"][i]
        assert f_step["loss"] == pytest.approx(s_step["loss"], rel=1e-4, abs=1e-7)
        a = _load(tmp_path / "s" / f"{i}_{name}.st")
        b = _load(tmp_path / "f" / f"{i}_{name}.st")
        assert a and all(".lora_A.a." in k or ".lora_B.a." in k for k in a)
        assert _max_diff(a, b) < 1e-5, name
    moved = _load(tmp_path / "s" / "0_sgd.st")
    assert max(float(v.abs().max()) for k, v in moved.items() if "lora_B" in k) > 2e-4
