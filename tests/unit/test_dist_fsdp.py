"""FSDP2 data parallelism: a 2-rank step equals the 1-process step; sharded checkpoints resume
across world sizes. The ranks are real torchrun processes (gloo on CPU) on the real model."""

from __future__ import annotations

import pytest
import torch

from areal_env.api.config import ActorConfig
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.dist import DistContext, padded_micro_batches, split_rows
from tests.distributed.run import run_worker


def test_split_rows_balances_tokens_and_is_deterministic():
    lengths = [50, 10, 40, 30, 20, 5]
    shares = split_rows(list(range(6)), lengths, 2)
    assert sorted(r for s in shares for r in s) == list(range(6))
    loads = [sum(lengths[r] for r in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 5, loads
    assert shares == split_rows(list(range(6)), lengths, 2)
    # more ranks than rows: some ranks get nothing
    assert [len(s) for s in split_rows([0], lengths, 3)] == [1, 0, 0]


def test_padded_micro_batches_give_every_rank_the_same_count():
    lengths = [64, 64, 64, 8]
    counts = set()
    seen = []
    for rank in range(2):
        mbs = padded_micro_batches([0, 1, 2, 3], lengths, 64, DistContext(rank=rank, world_size=2))
        counts.add(len(mbs))
        seen += [r for mb in mbs if mb is not None for r in mb]
    assert len(counts) == 1  # same number of forward/backward passes on every rank
    assert sorted(seen) == [0, 1, 2, 3]  # every row on exactly one rank


def _planner(rank: int, world: int, mode: str) -> PPOActor:
    """An actor with only what micro-batch planning reads (no model: the plan is pure)."""
    actor = PPOActor.__new__(PPOActor)
    actor.cfg = ActorConfig(tree_training=mode, micro_batch_tokens=64)  # type: ignore[arg-type]
    actor.tree_unsupported = None
    actor.dist = DistContext(rank=rank, world_size=world)
    return actor


def test_tree_packing_under_fsdp_packs_each_ranks_share():
    prompt = list(range(100, 130))
    rows = [prompt + [i] * (4 + i) for i in range(6)] + [list(range(200, 240))]
    lengths = [len(r) for r in rows]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    order = list(range(len(rows)))
    shares = split_rows(order, lengths, 2)
    plans = [_planner(k, 2, "on").rank_micro_batches(ids, lengths, order) for k in range(2)]
    assert {len(p[0]) for p in plans} == {max(len(p[0]) for p in plans)}  # same passes
    assert all(p[1] for p in plans)  # both ranks pack
    for k, (groups, _, computed) in enumerate(plans):
        # each rank packs exactly its token-balanced share (the flat split's rows)
        assert sorted(r for g in groups if g is not None for r in g) == shares[k]
        assert computed == plans[0][2] < sum(lengths)  # the shared prompt computed once a rank
    # auto with nothing shared: the flat padded split on every rank
    plain = [list(range(10 * i, 10 * i + 30)) for i in range(4)]
    flat_ids = torch.tensor(plain)
    for k in range(2):
        groups, tree, computed = _planner(k, 2, "auto").rank_micro_batches(
            flat_ids, [30] * 4, [0, 1, 2, 3]
        )
        assert not tree and computed == 120
        assert groups == padded_micro_batches([0, 1, 2, 3], [30] * 4, 64, DistContext(k, 2))


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp_two_ranks_step_equals_single_process(tmp_path, model_path):
    common = ["--model", model_path, "--steps", "sgd,adamw"]
    (single,) = run_worker([*common, "--strategy", "single", "--out", str(tmp_path / "s")])
    ranks = run_worker([*common, "--strategy", "fsdp", "--out", str(tmp_path / "f")], nproc=2)
    assert [r["world_size"] for r in ranks] == [2, 2]
    initial = {k: v for k, v in _load_initial(model_path).items()}
    for i, name in enumerate(["sgd", "adamw"]):
        s_step, f_step = single["steps"][i], ranks[0]["steps"][i]
        # the loss is normalised by the global token count: same loss and gradient norm
        assert f_step["scored_tokens"] == s_step["scored_tokens"]
        assert f_step["loss"] == pytest.approx(s_step["loss"], rel=1e-4, abs=1e-7)
        assert f_step["grad_norm"] == pytest.approx(s_step["grad_norm"], rel=1e-4)
        a = _load(tmp_path / "s" / f"{i}_{name}.st")
        b = _load(tmp_path / "f" / f"{i}_{name}.st")
        assert _max_diff(a, b) < 1e-5, name
    # the SGD step moved the weights well beyond the tolerance (the test can fail)
    moved = _load(tmp_path / "s" / "0_sgd.st")
    assert _max_diff({k: moved[k] for k in initial}, initial) > 1e-3
    # each rank held about half of the parameter/gradient/optimizer bytes
    assert ranks[0]["state_bytes"] < 0.6 * single["state_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "lora", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["full", "lora"]
)
def test_fsdp_two_ranks_tree_step_equals_single_process_flat(tmp_path, model_path, lora):
    """Tree training under FSDP (and with LoRA adapters): each rank packs its token-balanced
    share of the rows into a trie; the step equals the 1-process flat (unpacked) step."""
    common = ["--model", model_path, "--steps", "sgd,adamw", "--shared-prefix", "16"]
    common += ["--lora"] if lora else []
    (flat,) = run_worker(
        [*common, "--strategy", "single", "--tree", "off", "--out", str(tmp_path / "s")]
    )
    ranks = run_worker(
        [*common, "--strategy", "fsdp", "--tree", "on", "--out", str(tmp_path / "f")], nproc=2
    )
    for i, name in enumerate(["sgd", "adamw"]):
        s_step, f_step = flat["steps"][i], ranks[0]["steps"][i]
        assert s_step["tree_packed"] == 0.0 and f_step["tree_packed"] == 1.0
        # the shared prefixes were computed once: fewer tokens than the rows hold
        assert f_step["computed_tokens"] < s_step["computed_tokens"]
        assert f_step["scored_tokens"] == s_step["scored_tokens"]
        assert f_step["loss"] == pytest.approx(s_step["loss"], rel=1e-4, abs=1e-7)
        assert f_step["grad_norm"] == pytest.approx(s_step["grad_norm"], rel=1e-4)
        a = _load(tmp_path / "s" / f"{i}_{name}.st")
        b = _load(tmp_path / "f" / f"{i}_{name}.st")
        assert set(a) == set(b), name  # the same names (no tied, frozen lm_head under FSDP)
        assert _max_diff(a, b) < 1e-5, name
    # the SGD step moved the weights far beyond the tolerance (the test can fail): LoRA's B
    # starts at zero, the full model at the checkpoint's weights
    moved = _load(tmp_path / "s" / "0_sgd.st")
    start = (
        {k: torch.zeros_like(v) for k, v in moved.items() if "lora_B" in k}
        if lora
        else _load_initial(model_path)
    )
    step = _max_diff({k: moved[k] for k in start}, start)
    assert step > 2e-4, step


def test_fsdp_one_rank_pushes_copies_not_live_parameters(tmp_path, model_path):
    """FSDP over one rank on the CPU (torchrun --nproc-per-node 1): the gathered state dict's
    tensors were the live parameters (and the tied embedding/head one tensor), so a push handed
    out weights the optimiser went on changing. Every pushed tensor is now a copy, and the step
    equals the single-process one."""
    from tests.gpu.make_tiny_model import make_tiny_model

    tiny = str(make_tiny_model(model_path, str(tmp_path / "tiny")))
    common = ["--model", tiny, "--steps", "sgd,adamw", "--shared-prefix", "16"]
    (single,) = run_worker([*common, "--strategy", "single", "--out", str(tmp_path / "s")])
    (rank0,) = run_worker([*common, "--strategy", "fsdp", "--out", str(tmp_path / "f")], nproc=1)
    assert rank0["world_size"] == 1
    for i, name in enumerate(["sgd", "adamw"]):
        assert single["steps"][i]["aliased"] == [] and rank0["steps"][i]["aliased"] == []
        a = _load(tmp_path / "s" / f"{i}_{name}.st")
        b = _load(tmp_path / "f" / f"{i}_{name}.st")  # tied names in separate memory: saves
        assert _max_diff(a, b) < 1e-5, name


def _load_initial(model_path):
    from pathlib import Path

    out = {}
    for f in Path(model_path).glob("*.safetensors"):
        out.update(_load(f))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("save_world,resume_world", [(2, 1), (1, 2)])
@pytest.mark.extended
def test_sharded_checkpoint_resumes_across_world_sizes(
    tmp_path, model_path, save_world, resume_world
):
    """Save after update 1 at one world size, resume at the other and run update 2: the weights
    equal those of the run that went on without stopping (Adam's moments were restored)."""

    def launch(world: int, extra: list[str]) -> list[dict]:
        strategy = "fsdp" if world == 2 else "single"
        args = ["--model", model_path, "--strategy", strategy, "--steps", "adamw,adamw"]
        return run_worker(args + extra, nproc=2 if world == 2 else None)

    root = tmp_path / "ckpt"
    launch(
        save_world, ["--ckpt-root", str(root), "--save-after", "1", "--out", str(tmp_path / "a")]
    )
    step_dir = root / "step_1"
    assert (step_dir / "state").is_dir() and (step_dir / "model" / "config.json").is_file()
    launch(resume_world, ["--ckpt-root", str(root), "--resume", "--out", str(tmp_path / "b")])
    straight = _load(tmp_path / "a" / "1_adamw.st")
    resumed = _load(tmp_path / "b" / "1_adamw.st")
    assert _max_diff(straight, resumed) < 1e-5
    # the exported HF folder is the full model after update 1 (servable as is)
    exported = _load(next((step_dir / "model").glob("*.safetensors")))
    first = _load(tmp_path / "a" / "0_adamw.st")
    shared = [k for k in first if k in exported]
    assert len(shared) >= len(first) - 1  # a tied lm_head is stored once
    assert max(float((first[k] - exported[k]).abs().max()) for k in shared) == 0.0
    assert torch.is_tensor(next(iter(resumed.values())))
