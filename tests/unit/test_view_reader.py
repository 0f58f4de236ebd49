"""The viewer's readers (no server, no model): following JSONL files, the token record format,
conversation trees, a run's index while it trains, evaluations before vs after."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_env.trainer.stats import mask_secrets
from areal_env.trainer.token_record import (
    NOT_SCORED,
    CapturedUpdate,
    RowTokens,
    UpdatePart,
    UpdateTrace,
    decode_block,
    drop_parts_after,
    encode_block,
    links_of,
    write_part,
)
from areal_env.view.evals import EvalStore, compare
from areal_env.view.jsonl import JsonlFile
from areal_env.view.run import RunIndex
from areal_env.view.tokens import TokenRecords
from areal_env.view.tree import build_tree, rows_through
from tests.fixtures.view_runs import make_run

# ---- following a JSONL file ------------------------------------------------------------------


def test_jsonl_reads_whole_lines_only_and_follows_appends(tmp_path):
    path = tmp_path / "m.jsonl"
    jf = JsonlFile(path)
    assert jf.poll().records == []  # not written yet: nothing, no error
    path.write_text('{"step": 1}\n{"step": 2, "x": "cut in the mid')
    poll = jf.poll()
    assert [r["step"] for _, r in poll.records] == [1]
    assert jf.partial_bytes > 0
    with path.open("a") as f:
        f.write('dle"}\n{"step": 3}\n')
    poll = jf.poll()
    assert [r["step"] for _, r in poll.records] == [2, 3]
    assert poll.records[0][1]["x"] == "cut in the middle"
    assert jf.partial_bytes == 0 and jf.bad_lines == 0
    assert jf.poll().records == []


def test_jsonl_skips_a_line_a_crash_cut_and_counts_it(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "trunc')  # the run died mid-write
    jf = JsonlFile(path)
    jf.poll()
    with path.open("a") as f:  # the resumed run appends whole lines after it
        f.write('{"step": 2}\n')
    poll = jf.poll()
    assert poll.records == []  # the joined line is not JSON
    assert jf.bad_lines == 1


def test_jsonl_notices_a_rewritten_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    jf = JsonlFile(path)
    assert len(jf.poll().records) == 3
    path.write_text(json.dumps({"step": 1}) + "\n")  # a resume dropped steps 2 and 3
    poll = jf.poll()
    assert poll.reset and [r["step"] for _, r in poll.records] == [1]
    # rewritten in place to a longer content: noticed too (the byte before the offset moved)
    path.write_text(json.dumps({"step": 1, "pad": "x" * 40}) + "\n")
    poll = jf.poll()
    assert poll.reset and poll.records[0][1]["pad"]


# ---- the token record format -----------------------------------------------------------------


def _row(n: int, k0: int, seed: int = 0) -> RowTokens:
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, "u1")
    mask[k0:] = 1
    k = n - k0
    return RowTokens(
        input_ids=rng.integers(0, 50000, n).astype("<i4"),
        loss_mask=mask,
        versions=np.full(k, 3, "<i4"),
        rollout_logprob=-rng.random(k).astype("<f4"),
        trainer_logprob=np.where(rng.random(k) < 0.2, np.nan, -rng.random(k)).astype("<f4"),
        advantage=rng.normal(size=k).astype("<f4"),
        clipped=rng.choice([0, 1, NOT_SCORED], k).astype("u1"),
    )


def test_token_block_round_trip_and_damage():
    rows = [_row(30, 20, 1), _row(45, 40, 2), _row(5, 5, 3)]
    data = encode_block(rows)
    back = decode_block(data, [(30, 10), (45, 5), (5, 0)])
    for a, b in zip(rows, back, strict=True):
        for name in ("input_ids", "loss_mask", "versions", "advantage", "clipped"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert np.array_equal(a.trainer_logprob, b.trainer_logprob, equal_nan=True)
    with pytest.raises(ValueError, match="shorter"):
        decode_block(data, [(30, 10), (45, 5), (5000, 5000)])
    with pytest.raises(ValueError, match="longer"):
        decode_block(data, [(30, 10), (45, 5)])
    with pytest.raises(ValueError, match="decompress"):
        decode_block(data[: len(data) // 2], [(30, 10)])
    with pytest.raises(ValueError, match="loss mask"):
        decode_block(data, [(30, 11), (45, 5), (5, 0)])


def test_update_trace_places_flat_values_row_major():
    """The loss sees a micro-batch's scored tokens flat, row by row: the trace puts each value
    back at its (row, position)."""
    b, width = 3, 6
    loss_mask = torch.tensor(
        [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.int32
    )

    class PB:  # the PreparedBatch fields the trace reads
        input_ids = torch.arange(b * width).reshape(b, width)
        lengths = [4, 5, 6]
        adv = torch.ones(b, width)
        behav_logp = torch.full((b, width), -1.0)
        old_logp = behav_logp

    trace = UpdateTrace()
    batch = {"loss_mask": loss_mask, "versions": torch.zeros(b, width), "rewards": torch.ones(b)}
    trace.prepared(batch, PB())  # type: ignore[arg-type]
    rows = [2, 0]  # a micro-batch of rows 2 and 0, in that order
    m = loss_mask[rows, :6].bool()
    logp = torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5])  # row 2: 3 tokens, row 0: 2
    clipped = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    trace.scored(rows, m, logp, clipped)
    cap = trace.take()
    assert cap is not None and trace.take() is None
    assert cap.trainer_logprob[2, 3:6].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert cap.trainer_logprob[0, 2:4].tolist() == pytest.approx([-0.4, -0.5])
    assert cap.clipped[2, 3:6].tolist() == [1, 0, 0] and cap.clipped[0, 2:4].tolist() == [1, 0]
    assert all(math.isnan(x) for x in cap.trainer_logprob[1].tolist())  # never scored
    assert cap.clipped[1].tolist() == [NOT_SCORED] * width
    assert not cap.recomputed


def test_rows_link_to_their_sessions_in_batch_order():
    """Rows are linked as ``collate_groups`` orders them; each row names its completion (the
    export key ``rows_from_export`` keeps)."""
    from areal_env.api.episode import Episode
    from areal_env.api.rows import rows_from_export
    from areal_env.workflow.batch import collate_groups

    def row(n: int) -> dict:
        return {
            "input_ids": [1] * n,
            "loss_mask": [0] + [1] * (n - 1),
            "logprobs": [0.0] * n,
            "versions": [0] * n,
            "reward": 1.0,
        }

    def episode(sid: str, traj: int, ids: list[str]) -> Episode:
        export = {"trajectories": {i: row(3 + k) for k, i in enumerate(ids)}}
        return Episode.from_export(export, session_id=sid, task_id="t", traj_index=traj)

    groups = [[episode("a", 0, ["a1", "a2"]), episode("b", 1, ["b1"])], [episode("c", 1, ["c1"])]]
    links = links_of(groups)
    assert [(x.session_id, x.row_id, x.group, x.traj) for x in links] == [
        ("a", "a1", 0, 0),
        ("a", "a2", 0, 0),
        ("b", "b1", 0, 1),
        ("c", "c1", 1, 1),
    ]
    batch = collate_groups(groups)  # the same rows, in the same order
    assert batch["input_ids"].shape[0] == 4
    assert [int(n) for n in batch["attention_mask"].sum(dim=1)] == [3, 4, 3, 3]
    assert [r.row_id for r in rows_from_export([row(2)])] == [None]  # a list has no keys


def test_write_part_then_read_it_back(tmp_path):
    run = make_run(tmp_path / "run", steps=1, groups=2, group_size=2)
    recs = TokenRecords(run.path)
    recs.refresh()
    assert recs.steps() == [1]
    part = recs.parts_of(1)[0]
    assert part.index["rows"] == 16 and len(part.sessions) == 4
    assert len(part.index["blocks"]) == 2  # one block per GRPO group
    sid = run.sessions[1][1]
    ((got_part, entry),) = recs.session_entries(1, sid)
    rows = recs.read_block(got_part, entry)
    assert [r["row_id"] for r in entry["rows"]] == run.records[1][1]["row_ids"]
    first = run.records[1][1]["interactions"][0]
    assert len(rows[0].input_ids) == first["num_prompt_tokens"] + first["num_output_tokens"]
    assert len(rows[0].versions) == first["num_output_tokens"]
    # a .bin whose index was never written (a crash mid-update) is not read, and goes on resume
    (run.path / "tokens" / "step-000002-0.bin").write_bytes(b"half")
    recs.refresh()
    assert recs.steps() == [1]
    assert drop_parts_after(run.path / "tokens", 1) == 1
    assert drop_parts_after(run.path / "tokens", 0) == 2
    assert not list((run.path / "tokens").glob("step-*"))


def test_a_damaged_token_block_is_an_error_in_words(tmp_path):
    run = make_run(tmp_path / "run", steps=1, groups=1, group_size=1)
    recs = TokenRecords(run.path)
    recs.refresh()
    part = recs.parts_of(1)[0]
    entry = part.sessions[0]
    bin_path = run.path / "tokens" / f"{part.stem}.bin"
    bin_path.write_bytes(bin_path.read_bytes()[: part.index["blocks"][0]["size"] // 2])
    with pytest.raises(ValueError, match="cut short"):
        recs.read_block(part, entry)


def test_write_part_keeps_rows_it_cannot_link(tmp_path):
    cap = CapturedUpdate(
        input_ids=torch.tensor([[5, 6, 7]]),
        lengths=[3],
        loss_mask=torch.tensor([[0, 1, 1]]),
        versions=torch.tensor([[-1, 0, 0]]),
        rollout_logprob=torch.tensor([[0.0, -1.0, -2.0]]),
        advantage=torch.ones(1, 3),
        rewards=torch.tensor([1.0]),
        trainer_logprob=torch.full((1, 3), float("nan")),
        clipped=torch.full((1, 3), NOT_SCORED, dtype=torch.uint8),
        recomputed=False,
    )
    path = write_part(tmp_path, UpdatePart(1, 0, 0, cap, links=[]))
    index = json.loads(path.read_text())
    assert index["sessions"][0]["session_id"] is None
    assert index["sessions"][0]["rows"][0]["gap"] is None  # nothing scored


# ---- conversation trees ----------------------------------------------------------------------


def test_tree_of_a_session_with_a_branch_and_tool_calls():
    lines = [
        {
            "interaction_id": "a",
            "parent_id": None,
            "prompt": "P",
            "completion": '<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>',
            "tool_calls": ["add"],
            "valid_tool_calls": 1,
        },
        {
            "interaction_id": "b",
            "parent_id": "a",
            "prompt": 'P<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>RESULT',
            "completion": "two",
        },
        {
            "interaction_id": "c",
            "parent_id": "b",
            "prompt": "other",
            "completion": "x",
            "tool_calls": ["nope"],
            "valid_tool_calls": 0,
            "tool_parse_error": True,
        },
        {
            "interaction_id": "d",
            "parent_id": "b",
            "prompt": "whatever",
            "completion": "y",
            "spliced": True,
            "messages": [{"role": "tool", "content": "3"}],
            "output": {"tool_calls": [{"function": {"name": "mul", "arguments": "{}"}}]},
        },
        {"interaction_id": "e", "parent_id": "gone", "prompt": "Q", "completion": "z"},
    ]
    nodes = {n["id"]: n for n in build_tree(lines)}
    assert nodes["a"]["calls"] == [{"name": "add", "arguments": {"a": 1}}]
    assert nodes["a"]["spliced"] is None and nodes["a"]["depth"] == 0
    assert nodes["b"]["spliced"] is True and nodes["b"]["new_prompt"] == "RESULT"
    assert nodes["b"]["children"] == ["c", "d"]  # a branch
    assert nodes["c"]["spliced"] is False and nodes["c"]["failed_tool_calls"] == 2
    assert nodes["d"]["calls"] == [{"name": "mul", "arguments": "{}"}]
    assert nodes["d"]["messages"] == [{"role": "tool", "content": "3"}]
    assert nodes["e"]["parent_id"] is None and nodes["e"]["orphan_parent"] == "gone"
    # one row per completion: each node's own; one row per chain: the leaves' rows reach up
    assert rows_through(list(nodes.values()), ["a", "b", "c", "d", "e"])["a"] == ["a"]
    through = rows_through(list(nodes.values()), ["a", "c", "d", "e"])
    assert through["b"] == ["d"] and through["d"] == ["d"] and through["c"] == ["c"]


# ---- a run's index ---------------------------------------------------------------------------


def test_run_index_of_a_finished_run(synthetic_run):
    run = RunIndex("x", synthetic_run.path)
    run.refresh()
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert sorted(run.steps) == [1, 2]
    assert run.steps[1].sessions == synthetic_run.sessions[1]
    info = run.sessions[synthetic_run.sessions[2][0]]
    assert info.completions == 4 and info.step == 2 and info.version == 1
    assert len(run.steps[2].groups) == 2
    lines = run.session_lines(info)
    assert [x["interaction_id"] for x in lines] == synthetic_run.records[2][0]["row_ids"]
    assert run.warnings() == []
    assert run.status()["last_step"] == 2 and run.status()["total_steps"] == 2
    assert "secret-admin-key" not in (run.config_text() or "")


def test_run_index_follows_a_run_that_trains(tmp_path):
    """Files appear and grow while the viewer reads: each refresh reads only what is new; a
    resumed run that rewrites its dumps is indexed again."""
    path = tmp_path / "run"
    path.mkdir()
    run = RunIndex("x", path, refresh_interval=0.0)
    run.refresh()
    assert run.steps == {} and run.metrics == []
    assert "no run files" in run.warnings()[0]
    make_run(path, steps=1, evals=False)
    run.refresh()
    assert sorted(run.steps) == [1]
    more = make_run(tmp_path / "more", steps=2, evals=False)
    step2 = [f for f in (more.path / "rollout" / "1").glob("*.jsonl")]
    dest = path / "rollout" / "1"
    dest.mkdir(parents=True)
    for f in step2:  # half a line first, as a writer caught mid-write
        text = f.read_text()
        (dest / f.name).write_text(text[: len(text) // 2])
    run.refresh()
    assert 2 in run.steps
    half = len(run.steps[2].sessions)
    for f in step2:
        (dest / f.name).write_text(f.read_text())
    run.refresh()
    assert len(run.steps[2].sessions) >= half
    assert len(run.steps[2].sessions) == len(more.sessions[2])
    for f in step2:  # a resume drops step 2 again
        f2 = dest / f.name
        f2.write_text("")
    run.refresh()
    assert 2 not in run.steps and 1 in run.steps


def test_run_index_says_what_is_damaged(synthetic_run):
    with (synthetic_run.path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/mean": 0.')  # cut by a crash
    with (synthetic_run.path / "tokens" / "step-000009-0.json").open("w") as f:
        f.write("{not json")
    run = RunIndex("x", synthetic_run.path)
    run.refresh()
    text = " ".join(run.warnings())
    assert "metrics.jsonl: ends in a partial line" in text
    assert "step-000009-0.json: unreadable" in text
    assert [m["step"] for m in run.metrics] == [1, 2]


# ---- evaluations -----------------------------------------------------------------------------


def test_eval_before_and_after_with_filters(synthetic_run):
    store = EvalStore(synthetic_run.path / "eval-rollout")
    assert store.versions() == [0, 2]
    before, after = store.load(0), store.load(2)
    out = compare(before, after)
    assert out["total"] == 6 and out["counts"] == {"shared": 6, "gained": 2, "lost": 1}
    assert 0 < out["p_value"] <= 1
    row = out["items"][0]
    assert row["before"]["reply"] == "reply of v0 to valid-0"
    assert row["after"]["reply"] == "reply of v2 to valid-0"
    gained = compare(before, after, flt="gained")["items"]
    assert [r["task_id"] for r in gained] == ["valid-1", "valid-3"]
    assert [r["task_id"] for r in compare(before, after, flt="lost")["items"]] == ["valid-2"]
    failed = compare(before, after, flt="failed_tool_calls")["items"]
    assert [r["task_id"] for r in failed] == ["valid-4"]
    assert failed[0]["after"]["failed_tool_calls"] == 2
    assert compare(before, after, flt="changed")["total"] == 6
    one = compare(before, after, task="valid-3")
    assert one["total"] == 1 and len(one["items"][0]["after"]["nodes"]) == 1
    page = compare(before, after, offset=4, limit=10)
    assert [r["task_id"] for r in page["items"]] == ["valid-4", "valid-5"]
    with pytest.raises(ValueError, match="unknown filter"):
        compare(before, after, flt="bogus")


def test_secrets_are_masked_in_the_saved_config():
    cfg = {
        "proxy": {"admin_key": "k1", "max_new_tokens": 5},
        "service": {
            "api_keys": ["a", "b"],
            "key_file": "/etc/keys",
            "store": "postgresql://me:hunter2@db/x",
        },
        "hf_token": "t",
        "micro_batch_tokens": 4096,
    }
    out = mask_secrets(cfg)
    assert out["proxy"] == {"admin_key": "***", "max_new_tokens": 5}
    assert out["service"]["api_keys"] == ["***", "***"]
    assert out["service"]["key_file"] == "/etc/keys"
    assert out["service"]["store"] == "postgresql://me:***@db/x"
    assert out["hf_token"] == "***" and out["micro_batch_tokens"] == 4096


def test_token_pieces_join_to_the_text(tokenizer, tmp_path: Path):
    """Per-token pieces of the real tokenizer (SmolLM2's, byte-level BPE) join to its decoding,
    multi-byte characters split over tokens included."""
    from areal_env.trainer.token_record import save_tokenizer
    from areal_env.view.tokens import TokenText

    assert save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    text = TokenText.from_file(tmp_path / "tokenizer.json")
    s = "<|im_start|>user\nWhat is 7 × 8? Réponds: 五十六 🙂 ok\n  indented<|im_end|>"
    ids = tokenizer.encode(s, add_special_tokens=False)
    pieces = text.pieces(ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False)
    assert "\ufffd" not in "".join(pieces)
