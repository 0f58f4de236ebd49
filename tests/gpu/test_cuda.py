"""The CUDA paths: the embedded engine, the trainer, weight pushes and FSDP over NCCL on a GPU.

Skipped without CUDA (CI has no GPU). On a GPU machine that cannot fetch the default model, set
``AREAL_ENV_GPU_MODEL`` to a local Hugging Face folder, e.g. a random small Llama with the real
tokenizer (``python -m tests.gpu.make_tiny_model TOKENIZER_DIR OUT_DIR``): these tests check
devices, dtypes, attention and transport, not what the model knows.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from areal_env.api.config import ActorConfig, ModelConfig
from areal_env.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_env.engine.local import LocalEngine
from areal_env.trainer.actor import PPOActor
from tests.distributed.run import run_worker
from tests.unit.test_trainer_tree import _agent_batch

# AREAL_ENV_GPU_TEST_DEVICE=cpu rehearses these tests on a CPU (slowly, bf16 included).
DEVICE = os.environ.get("AREAL_ENV_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)

PROMPTS = [
    "What is 2+2?",
    "Name a colour.",
    "Write one sentence about the sea and the wind and the boats that sail on it.",
    "Hi",
    "List three fruits, then explain which one is the sweetest.",
    "What is the capital of France?",
    "Count from one to five.",
    "Say something nice about cats.",
]
SYSTEM = "You are a careful assistant with a calculator tool. Answer in one short line. " * 4


@pytest.fixture(scope="module")
def gpu_model(request) -> str:
    return os.environ.get("AREAL_ENV_GPU_MODEL") or request.getfixturevalue("model_path")


@pytest.fixture(scope="module")
def gpu_tokenizer(gpu_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gpu_model)


def _ids(tok, text: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def _teacher_forced(model, resp: ModelResponse, temperature: float) -> torch.Tensor:
    ids = torch.tensor([resp.input_tokens + resp.output_tokens], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    n_in = len(resp.input_tokens)
    scores = logits[n_in - 1 : n_in - 1 + len(resp.output_tokens)] / temperature
    out = torch.tensor(resp.output_tokens, device=scores.device)
    return torch.log_softmax(scores, -1).gather(1, out[:, None])[:, 0].cpu()


def _engine(path: str, dtype: str, **kw) -> LocalEngine:
    eng = LocalEngine(path, device=DEVICE, dtype=dtype, max_batch_size=16, **kw)
    eng.initialize()
    return eng


@pytest.mark.parametrize(
    "dtype,tol_max,tol_mean",
    [("float32", 1e-3, 1e-4), ("bfloat16", 0.25, 0.03)],
    ids=["fp32", "bf16"],
)
def test_engine_on_cuda_logprobs_match_a_teacher_forced_recompute(
    gpu_model, gpu_tokenizer, dtype, tol_max, tol_mean
):
    """Concurrent, staggered requests on the GPU: the reported logprobs are the model's own,
    within the dtype's rounding."""
    eng = _engine(gpu_model, dtype)
    try:
        assert eng.device.type == DEVICE
        want = torch.float32 if dtype == "float32" else torch.bfloat16
        assert next(eng.model.parameters()).dtype == want

        async def one(i: int) -> ModelResponse:
            await asyncio.sleep(0.02 * (i % 3))
            g = GenerationConfig(max_new_tokens=24, temperature=1.0, top_k=0, seed=i)
            return await eng.agenerate(
                ModelRequest(input_ids=_ids(gpu_tokenizer, PROMPTS[i]), gconfig=g)
            )

        async def all_of_them() -> list[ModelResponse]:
            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

        resps = asyncio.run(all_of_them())
        diffs = []
        for r in resps:
            assert r.output_tokens and len(r.output_logprobs) == len(r.output_tokens)
            got = torch.tensor(r.output_logprobs)
            assert torch.isfinite(got).all() and (got <= 1e-6).all()
            diffs.append((got - _teacher_forced(eng.model, r, 1.0)).abs())
        d = torch.cat(diffs)
        assert d.max() < tol_max and d.mean() < tol_mean, (float(d.max()), float(d.mean()))
    finally:
        eng.destroy()


def test_engine_on_cuda_prefix_cache_keeps_greedy_outputs(gpu_model, gpu_tokenizer):
    """Requests behind one shared system prompt reuse its KV on the GPU; greedy outputs and their
    logprobs equal those of an engine without the cache (fp32)."""

    async def run(eng: LocalEngine) -> list[ModelResponse]:
        out = []
        for i in range(4):  # one after another: later ones find the prefix cached
            g = GenerationConfig(max_new_tokens=12, greedy=True)
            req = ModelRequest(input_ids=_ids(gpu_tokenizer, PROMPTS[i], SYSTEM), gconfig=g)
            out.append(await eng.agenerate(req))
        return out

    cached = _engine(gpu_model, "float32")
    try:
        with_cache = asyncio.run(run(cached))
        hits = cached.stats()["prefix_cache_hit_tokens"]
    finally:
        cached.destroy()
    plain = _engine(gpu_model, "float32", prefix_cache_mb=0)
    try:
        without = asyncio.run(run(plain))
    finally:
        plain.destroy()
    assert hits > 0
    for a, b in zip(with_cache, without, strict=True):
        assert a.output_tokens == b.output_tokens
        assert (
            max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True))
            < 1e-3
        )


@pytest.fixture(scope="module")
def cuda_actor(gpu_model):
    cfg = ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=4096, lr=1e-5)
    model_cfg = ModelConfig(
        path=gpu_model, device=DEVICE, dtype="float32", gradient_checkpointing=True
    )
    return PPOActor(gpu_model, cfg, model_cfg, temperature=0.8, seed=2)


def test_tree_training_on_cuda_equals_flat(cuda_actor, gpu_tokenizer):
    """Tree-packed logprobs and gradients equal the row-by-row ones on the GPU (fp32)."""
    from tests.unit.test_trainer_tree import _grads, _logprobs

    actor = cuda_actor
    assert actor.device.type == DEVICE
    batch = _agent_batch(gpu_tokenizer)
    mask = batch["loss_mask"].bool()
    flat = _logprobs(actor, batch, "off", 4096)
    tree = _logprobs(actor, batch, "on", 4096)
    small = _logprobs(actor, batch, "on", 120)
    assert (flat[mask] != 0).all()
    assert (tree - flat).abs().max() < 1e-4 and (small - flat).abs().max() < 1e-4
    batch["logprobs"] = torch.where(mask, flat + 0.1, 0)
    actor.model.train()
    loss_f, grad_f, _ = _grads(actor, batch, "off", 4096)
    loss_t, grad_t, _ = _grads(actor, batch, "on", 4096)
    assert loss_t == pytest.approx(loss_f, rel=1e-4, abs=1e-6)
    assert float((grad_t - grad_f).norm() / grad_f.norm()) < 1e-4


def test_bf16_update_then_push_to_a_cuda_engine(gpu_model, gpu_tokenizer):
    """A bf16-compute actor update on the GPU (fp32 master weights: an lr 1e-6 step moves
    nearly every weight), its weights pushed to a bf16 engine on the GPU: the engine serves the
    new weights (the master weights cast to bf16) at the new version."""
    cfg = ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=4096, lr=1e-6)
    model_cfg = ModelConfig(path=gpu_model, device=DEVICE, dtype="bfloat16")
    actor = PPOActor(gpu_model, cfg, model_cfg, temperature=1.0, seed=0)
    assert actor.device.type == DEVICE
    assert next(actor.model.parameters()).dtype == torch.float32  # master weights
    assert actor.precision.compute == torch.bfloat16 and actor.precision.autocast
    batch = _agent_batch(gpu_tokenizer, seed=3)
    mask = batch["loss_mask"].bool()
    batch["logprobs"] = torch.where(mask, actor.compute_logprobs(batch), 0)
    before = [p.detach().clone() for p in actor.model.parameters()]
    stats = actor.update(batch, step=1)
    assert stats["actor/update_skipped"] == 0.0
    assert all(v == v for v in stats.values()), stats  # no NaN
    changed = sum(
        int((p.detach() != b).sum()) for p, b in zip(actor.model.parameters(), before, strict=True)
    )
    assert changed / sum(b.numel() for b in before) >= 0.95
    eng = _engine(gpu_model, "bfloat16")
    try:
        before_eng = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
        pushed = actor.state_dict_for_engine()
        assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
        eng.update_weights(pushed)
        eng.set_version(1)
        after = eng.model.state_dict()
        moved = 0
        for name, t in pushed.items():
            if name not in after:
                continue
            assert after[name].device.type == DEVICE
            assert torch.equal(after[name], t.to(after[name].device)), name
            moved += int(not torch.equal(after[name], before_eng[name]))
        assert moved > 0
        g = GenerationConfig(max_new_tokens=8, greedy=True)
        resp = asyncio.run(
            eng.agenerate(ModelRequest(input_ids=_ids(gpu_tokenizer, PROMPTS[0]), gconfig=g))
        )
        assert set(resp.output_versions) == {1}
    finally:
        eng.destroy()


def test_bf16_compute_pushes_fp32_to_an_fp32_cuda_engine(gpu_model, gpu_tokenizer):
    """``engine.dtype`` apart from ``model.dtype``: a bf16-autocast update on the GPU, and the
    engine built from the same config serves fp32 with the master weights bit-exactly."""
    from areal_env.api.config import EngineConfig

    model_cfg = ModelConfig(path=gpu_model, device=DEVICE, dtype="bfloat16")
    engine_cfg = EngineConfig(dtype="float32", max_batch_size=4)
    cfg = ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=4096, lr=1e-6)
    actor = PPOActor(
        gpu_model, cfg, model_cfg, seed=3, engine_dtype=engine_cfg.served_dtype(model_cfg)
    )
    assert actor.precision.autocast and actor.precision.engine == torch.float32
    before = [p.detach().clone() for p in actor.model.parameters()]
    assert actor.update(_agent_batch(gpu_tokenizer), step=1)["actor/update_skipped"] == 0.0
    changed = sum(
        int((p.detach() != b).sum()) for p, b in zip(actor.model.parameters(), before, strict=True)
    )
    assert changed / sum(b.numel() for b in before) >= 0.95
    pushed = actor.state_dict_for_engine()
    assert {t.dtype for t in pushed.values()} == {torch.float32}
    eng = LocalEngine.from_config(model_cfg, engine_cfg)
    eng.initialize()
    try:
        assert eng.model.dtype == torch.float32 and eng.device.type == DEVICE
        eng.update_weights(pushed)
        served = eng.model.state_dict()
        for name, t in pushed.items():
            assert torch.equal(served[name].cpu(), t.cpu()), name
    finally:
        eng.destroy()


def test_flex_tree_attention_on_cuda_equals_the_segment_path(gpu_model, gpu_tokenizer):
    """The GPU's tree kernel (compiled FlexAttention over the trie's block mask) gives the
    logprobs and gradients of the trunk/segment sdpa path, in bf16 compute."""
    if DEVICE != "cuda":
        pytest.skip("FlexAttention's backward runs on CUDA only")
    from tests.unit.test_trainer_tree import _grads, _logprobs

    cfg = ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=4096, lr=1e-5)
    model_cfg = ModelConfig(path=gpu_model, device=DEVICE, dtype="bfloat16")
    actor = PPOActor(gpu_model, cfg, model_cfg, temperature=0.8, seed=2)
    assert actor.tree_kernel == "flex"
    batch = _agent_batch(gpu_tokenizer)
    mask = batch["loss_mask"].bool()
    flex = _logprobs(actor, batch, "on", 4096)
    flat = _logprobs(actor, batch, "off", 4096)
    actor.tree_kernel = "sdpa"
    seg = _logprobs(actor, batch, "on", 4096)
    assert (flex[mask] != 0).all()
    # bf16 compute: the kernels round differently; the flat path is the reference
    assert (flex - seg)[mask].abs().mean() < 0.02 and (flex - flat)[mask].abs().mean() < 0.02
    batch["logprobs"] = torch.where(mask, flat + 0.1, 0)
    actor.model.train()
    _, grad_s, _ = _grads(actor, batch, "on", 4096)
    actor.tree_kernel = "flex"
    _, grad_f, _ = _grads(actor, batch, "on", 4096)
    assert float((grad_f - grad_s).norm() / grad_s.norm()) < 0.05


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_fsdp_over_nccl_equals_the_single_process_step(tmp_path, gpu_model):
    """FSDP2 with NCCL on one GPU (torchrun, world size 1): the tree-packed step equals the plain
    single-process flat step on the same GPU."""
    common = ["--model", gpu_model, "--steps", "sgd,adamw", "--device", DEVICE]
    common += ["--shared-prefix", "16"]
    (flat,) = run_worker(
        [*common, "--strategy", "single", "--tree", "off", "--out", str(tmp_path / "s")]
    )
    (rank0,) = run_worker(
        [*common, "--strategy", "fsdp", "--tree", "on", "--out", str(tmp_path / "f")], nproc=1
    )
    assert rank0["world_size"] == 1
    for i, name in enumerate(["sgd", "adamw"]):
        s, f = flat["steps"][i], rank0["steps"][i]
        assert f["tree_packed"] == 1.0 and s["tree_packed"] == 0.0
        assert f["loss"] == pytest.approx(s["loss"], rel=1e-4, abs=1e-7)
        assert f["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-3)
        a, b = _load(tmp_path / "s" / f"{i}_{name}.st"), _load(tmp_path / "f" / f"{i}_{name}.st")
        assert set(a) == set(b)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4, name


class ParityAgent:
    """Reward 1 for a reply of even length, else 0: any model's samples differ in it, so every
    group carries an advantage and every update runs."""

    async def run(self, data, *, base_url, api_key, http_client=None, **_):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": data["prompt"]}], max_tokens=12
        )
        return float(len(reply.choices[0].message.content or "") % 2 == 0)


def test_ppo_trainer_two_steps_on_cuda(tmp_path, gpu_model):
    """The whole loop on the GPU: embedded engine (bf16) behind the proxy, an OpenAI SDK agent,
    two PPO updates (bf16), weights pushed: the engine serves version 2."""
    from areal_env.api.config import ExperimentConfig, load_config
    from areal_env.trainer.ppo import PPOTrainer

    cfg = load_config(
        ExperimentConfig,
        None,
        [
            f"fileroot={tmp_path}",
            "experiment_name=gpu",
            f"model.path={gpu_model}",
            f"model.device={DEVICE}",
            "rollout.batch_size=4",
            "rollout.n_samples=4",
            "gconfig.max_new_tokens=12",
            "trainer.total_train_steps=2",
            "trainer.tensorboard=false",
            "trainer.recover='off'",
        ],
    )
    data = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    with PPOTrainer(cfg, data) as trainer:
        final = trainer.train(workflow=ParityAgent)
        assert trainer.engine.get_version() == 2
        assert next(trainer.engine.model.parameters()).device.type == DEVICE  # type: ignore[union-attr]
    rows = [json.loads(x) for x in Path(final["metrics_file"]).read_text().splitlines()]
    assert len(rows) == 2
    assert rows[-1]["version"] == 2
    for r in rows:
        assert r["episodes/accepted"] == 16
        assert all(v == v for v in r.values() if isinstance(v, float)), r
