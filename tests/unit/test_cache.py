"""InteractionCache: parent lookup tolerance, tree rewards/discount, export, concurrency, limits."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_env.api.rows import rows_from_export
from areal_env.proxy.cache import (
    Interaction,
    InteractionCache,
    SessionLimitError,
)
from areal_env.workflow.batch import collate

GLUE = [7]
_counter = itertools.count()


def make(
    messages,
    output_message,
    *,
    parent: Interaction | None = None,
    new_ids=(11, 12),
    n_out=3,
    splice=True,
    version=0,
    reward=None,
) -> Interaction:
    """An interaction with synthetic token ids; a spliced child's prompt extends its parent's."""
    k = next(_counter)
    if parent is not None and splice:
        prompt = [*parent.prompt_ids, *parent.output_ids, *GLUE, *new_ids]
    else:
        prompt = [1, 2, *new_ids]
    out = [1000 + 10 * k + j for j in range(n_out)]
    return Interaction(
        id=f"it{k}",
        session_id="s",
        messages=messages,
        tools=None,
        output_message=output_message,
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-0.01 * (k + 1) - j for j in range(n_out)],
        output_versions=[version] * n_out,
        stop_reason="stop",
        parent_id=parent.id if parent else None,
        reward=reward,
    )


def user(text):
    return {"role": "user", "content": text}


def asst(text):
    return {"role": "assistant", "content": text}


# ---- find_parent -------------------------------------------------------------------------------
def test_find_parent_longest_and_none():
    c = InteractionCache()
    m0 = [{"role": "system", "content": "sys"}, user("hi")]
    a = make(m0, asst("hello"))
    c.add(a)
    assert c.find_parent(m0) is None  # no assistant turn yet: a new root
    m1 = [*m0, asst("hello"), user("more")]
    assert c.find_parent(m1) is a
    b = make(m1, asst("sure"), parent=a)
    c.add(b)
    m2 = [*m1, asst("sure"), user("again")]
    assert c.find_parent(m2) is b  # longest wins
    assert c.find_parent([*m0, asst("hello!"), user("x")]) is None  # edited output
    assert c.find_parent([*m0[:1], user("HI"), asst("hello"), user("x")]) is None
    # a request that ends on the parent's own output (no new messages) also extends it
    assert c.find_parent([*m0, asst("hello")]) is a


def test_find_parent_tolerates_echo_variants():
    c = InteractionCache()
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    out = {"role": "assistant", "content": None, "tool_calls": [call]}
    m0 = [{"role": "developer", "content": "sys"}, user("add 1 and 2")]
    a = make(m0, out)
    c.add(a)
    echoed_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"b": 2, "a": 1}, indent=2)},
    }
    echoed = [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "add 1 and 2"}], "name": "bob"},
        {
            "role": "assistant",
            "content": "",
            "refusal": None,
            "annotations": [],
            "audio": None,
            "tool_calls": [echoed_call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    assert c.find_parent(echoed) is a
    # ids missing on the echo are fine ...
    no_id = {**echoed[2], "tool_calls": [{"function": echoed_call["function"]}]}
    assert c.find_parent([*echoed[:2], no_id, echoed[3]]) is a
    # ... but ids present on both sides must agree
    other_id = {**echoed[2], "tool_calls": [{**echoed_call, "id": "call_2"}]}
    assert c.find_parent([*echoed[:2], other_id, echoed[3]]) is None
    # different arguments are a different conversation
    changed = {**echoed_call, "function": {"name": "add", "arguments": '{"a": 1, "b": 3}'}}
    assert c.find_parent([*echoed[:2], {**echoed[2], "tool_calls": [changed]}]) is None


def test_find_parent_content_none_vs_empty_and_whitespace():
    c = InteractionCache()
    a = make([user("q")], {"role": "assistant", "content": "answer  "})
    c.add(a)
    assert c.find_parent([user("q"), asst("answer"), user("next")]) is a
    b = make([user("r")], {"role": "assistant", "content": None})
    c.add(b)
    assert c.find_parent([user("r"), asst(""), user("next")]) is b
    assert c.find_parent([user("r"), {"role": "assistant"}, user("next")]) is b


# ---- add / spliced detection / limits / rewards ------------------------------------------------
def test_add_detects_splicing_and_validates():
    c = InteractionCache()
    a = make([user("q")], asst("a"))
    c.add(a)
    b = make([user("q"), asst("a"), user("r")], asst("b"), parent=a)
    b.spliced = False  # the cache decides from the tokens
    c.add(b)
    assert b.spliced and b.extra["spans"] == [(len(a.prompt_ids), 3, a.id)]
    d = make([user("q"), asst("a"), user("s")], asst("d"), parent=a, splice=False)
    d.spliced = True  # claimed, but the tokens say otherwise
    c.add(d)
    assert not d.spliced and d.extra["spans"] == []
    with pytest.raises(ValueError, match="already recorded"):
        c.add(a)
    orphan = make([user("z")], asst("z"))
    orphan.parent_id = "missing"
    with pytest.raises(KeyError):
        c.add(orphan)
    bad = make([user("z")], asst("z"))
    bad.output_logprobs = bad.output_logprobs[:-1]
    with pytest.raises(ValueError, match="same length"):
        c.add(bad)
    assert len(c) == 3 and [x.id for x in c.children(a.id)] == [b.id, d.id]
    assert c.leaves() == [b, d]


def test_limits_raise_and_leave_cache_unchanged():
    c = InteractionCache(max_interactions=2)
    c.add(make([user("1")], asst("1")))
    c.add(make([user("2")], asst("2")))
    with pytest.raises(SessionLimitError, match="maximum of 2 interactions"):
        c.add(make([user("3")], asst("3")))
    assert len(c) == 2
    c = InteractionCache(max_tokens=10)
    first = make([user("1")], asst("1"))  # 4 prompt + 3 output tokens
    c.add(first)
    with pytest.raises(SessionLimitError, match="tokens"):
        c.add(make([user("2")], asst("2")))
    assert len(c) == 1 and c.total_tokens == first.num_tokens
    assert issubclass(SessionLimitError, ValueError)


def test_set_reward_last_replaces_and_errors():
    c = InteractionCache()
    with pytest.raises(KeyError):
        c.set_reward(1.0)
    a = make([user("1")], asst("1"))
    b = make([user("2")], asst("2"))
    c.add(a)
    c.add(b)
    assert c.set_reward(1.0) == b.id
    c.set_reward(0.5, b.id)
    c.set_reward(0.5, b.id)  # a retried call: set, never added
    assert b.reward == 0.5 and a.reward is None
    assert c.set_reward(0.75, completion_id=a.id) == a.id and a.reward == 0.75
    with pytest.raises(KeyError):
        c.set_reward(1.0, "unknown")
    with pytest.raises(ValueError):
        c.set_reward(float("nan"))
    with pytest.raises(ValueError):
        c.discounted_rewards(1.5)


def test_discount_chain_hand_computed():
    c = InteractionCache()
    a = make([user("q")], asst("a"))
    c.add(a)
    b = make([user("q"), asst("a"), user("r")], asst("b"), parent=a)
    c.add(b)
    d = make([user("q"), asst("a"), user("r"), asst("b"), user("s")], asst("d"), parent=b)
    c.add(d)
    c.set_reward(1.0, d.id)
    c.set_reward(0.25, a.id)
    assert c.discounted_rewards(0.5) == pytest.approx({a.id: 0.5, b.id: 0.5, d.id: 1.0})
    assert c.discounted_rewards(1.0) == pytest.approx({a.id: 1.25, b.id: 1.0, d.id: 1.0})
    assert c.discounted_rewards(0.0) == {a.id: 0.25, b.id: 0.0, d.id: 1.0}


def test_a_completion_left_out_of_the_loss_keeps_its_place_in_the_returns():
    """``set_reward(r, id, train=False)``: the completion's tokens leave the loss mask (in its
    own row and in the concat row that continues it), its reward still flows to the turns
    before it, and setting it again without ``train=False`` trains it again."""
    c = InteractionCache()
    a = make([user("q")], asst("a"))
    c.add(a)
    b = make([user("q"), asst("a"), user("r")], asst("b"), parent=a)
    c.add(b)
    c.set_reward(0.25, a.id)
    c.set_reward(0.5, b.id, train=False)
    assert not b.trained and a.trained
    (row,) = c.export(1.0, "concat").values()
    n_b = len(b.output_ids)
    assert row["loss_mask"][-n_b:] == [0] * n_b
    assert sum(row["loss_mask"]) == len(a.output_ids)
    assert row["reward"] == pytest.approx(0.75)  # the first turn's return counts b's reward
    rows = c.export(1.0, "individual")
    assert sum(rows[b.id]["loss_mask"]) == 0 and sum(rows[a.id]["loss_mask"]) == len(a.output_ids)
    c.set_reward(0.5, b.id)
    assert b.trained and sum(c.export(1.0, "individual")[b.id]["loss_mask"]) == n_b


def test_concat_starts_new_row_at_non_spliced_child():
    c = InteractionCache()
    a = make([user("q")], asst("a"))
    c.add(a)
    edited = make([user("q"), asst("A"), user("r")], asst("b"), parent=a, splice=False)
    c.add(edited)
    rows = c.export(1.0, "concat")
    assert set(rows) == {a.id, edited.id}
    assert sum(rows[edited.id]["loss_mask"]) == len(edited.output_ids)


# ---- random trees (hypothesis) -----------------------------------------------------------------
@st.composite
def trees(draw):
    n = draw(st.integers(1, 14))
    parents = [None] + [draw(st.one_of(st.none(), st.integers(0, i - 1))) for i in range(1, n)]
    rewards = [draw(st.one_of(st.none(), st.integers(-3, 3))) for _ in range(n)]
    n_outs = [draw(st.integers(1, 4)) for _ in range(n)]
    return parents, rewards, n_outs


def build(parents, rewards, n_outs):
    c = InteractionCache()
    nodes: list[Interaction] = []
    for i, (p, r, n_out) in enumerate(zip(parents, rewards, n_outs, strict=True)):
        parent = nodes[p] if p is not None else None
        msgs = (
            [*parent.messages, parent.output_message, user(f"u{i}")] if parent else [user(f"u{i}")]
        )
        it = make(msgs, asst(f"a{i}"), parent=parent, n_out=n_out, version=i)
        c.add(it)
        if r is not None:
            c.set_reward(float(r), it.id)
        nodes.append(it)
    return c, nodes


def subtree(parents, i):
    out = [i]
    for j, p in enumerate(parents):
        if p is not None and p in out:  # parents precede children
            out.append(j)
    return out


def depth(parents, i):
    d = 0
    while parents[i] is not None:
        i, d = parents[i], d + 1
    return d


@settings(max_examples=60, deadline=None)
@given(tree=trees(), discount=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_tree_discount_properties(tree, discount):
    parents, rewards, n_outs = tree
    c, nodes = build(parents, rewards, n_outs)
    values = c.discounted_rewards(discount)
    for i, node in enumerate(nodes):
        expected = sum(
            (rewards[j] or 0) * discount ** (depth(parents, j) - depth(parents, i))
            for j in subtree(parents, i)
        )
        assert values[node.id] == pytest.approx(expected)
        if discount == 0.0:
            assert values[node.id] == (rewards[i] or 0)
    # branches do not leak: bumping one leaf's reward changes only its own ancestors
    leaf = len(nodes) - 1  # the last node is always a leaf
    ancestors = {leaf}
    j = leaf
    while parents[j] is not None:
        j = parents[j]
        ancestors.add(j)
    bump = 10.0 - (rewards[leaf] or 0)  # setting replaces the leaf's own reward
    c.set_reward(10.0, nodes[leaf].id)
    after = c.discounted_rewards(discount)
    for i, node in enumerate(nodes):
        if i not in ancestors:
            assert after[node.id] == pytest.approx(values[node.id])
    if discount == 1.0:
        for i in ancestors:
            assert after[nodes[i].id] == pytest.approx(values[nodes[i].id] + bump)


@settings(max_examples=60, deadline=None)
@given(tree=trees())
def test_tree_export_properties(tree):
    parents, rewards, n_outs = tree
    c, nodes = build(parents, rewards, n_outs)
    values = c.discounted_rewards(0.9)
    indiv = c.export(0.9, "individual")
    assert len(indiv) == len(nodes)
    for it in nodes:
        row = indiv[it.id]
        assert row["input_ids"] == it.prompt_ids + it.output_ids
        assert sum(row["loss_mask"]) == len(it.output_ids)
        assert row["reward"] == pytest.approx(values[it.id])
    concat = c.export(0.9, "concat")
    leaves = [i for i in range(len(nodes)) if i not in {p for p in parents if p is not None}]
    assert sorted(concat) == sorted(nodes[i].id for i in leaves)
    for i in leaves:
        row, leaf = concat[nodes[i].id], nodes[i]
        path = [i]
        while parents[path[-1]] is not None:
            path.append(parents[path[-1]])
        assert row["input_ids"] == leaf.prompt_ids + leaf.output_ids
        assert sum(row["loss_mask"]) == sum(n_outs[j] for j in path)
        # each turn on the row's own chain earns its own reward + 0.9 x the next turn's return
        # (no sibling branch flows in); the row's reward is its first turn's return
        turn_return = {i: values[leaf.id]}
        for child, parent in zip(path, path[1:], strict=False):
            turn_return[parent] = (rewards[parent] or 0) + 0.9 * turn_return[child]
        assert row["reward"] == pytest.approx(turn_return[path[-1]])
        expected_returns = [turn_return[j] for j in reversed(path) for _ in nodes[j].output_ids]
        got_returns = row["returns"] or [row["reward"]] * len(row["input_ids"])
        assert [got_returns[k] for k in masked_positions(row)] == pytest.approx(expected_returns)
        # every masked token carries its own interaction's output id, logprob and version
        masked = [k for k, m in enumerate(row["loss_mask"]) if m]
        expected_ids = [t for j in reversed(path) for t in nodes[j].output_ids]
        expected_lp = [x for j in reversed(path) for x in nodes[j].output_logprobs]
        expected_v = [v for j in reversed(path) for v in nodes[j].output_versions]
        assert [row["input_ids"][k] for k in masked] == expected_ids
        assert [row["logprobs"][k] for k in masked] == pytest.approx(expected_lp)
        assert [row["versions"][k] for k in masked] == expected_v
        unmasked = [k for k, m in enumerate(row["loss_mask"]) if not m]
        assert all(row["versions"][k] == -1 and row["logprobs"][k] == 0.0 for k in unmasked)
    batch = collate(rows_from_export(concat))
    assert batch["input_ids"].shape[0] == len(leaves)
    assert int(batch["loss_mask"].sum()) == sum(sum(r["loss_mask"]) for r in concat.values())


def masked_positions(row):
    return [k for k, m in enumerate(row["loss_mask"]) if m]


def test_collate_dtypes_and_padding():
    rows = {
        "a": {
            "input_ids": [5, 6, 7],
            "loss_mask": [0, 1, 1],
            "logprobs": [0.0, -0.5, -0.25],
            "versions": [-1, 3, 3],
            "reward": 1.0,
        },
        "b": {
            "input_ids": [9],
            "loss_mask": [1],
            "logprobs": [-1.0],
            "versions": [2],
            "reward": -1,
        },
    }
    t = collate(rows_from_export(rows))
    assert t["input_ids"].dtype == torch.int64 and t["input_ids"].shape == (2, 3)
    assert t["attention_mask"].dtype == torch.bool
    assert t["loss_mask"].dtype == torch.int32 and t["versions"].dtype == torch.int32
    assert t["logprobs"].dtype == torch.float32 and t["rewards"].dtype == torch.float32
    assert t["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert t["versions"].tolist() == [[-1, 3, 3], [2, -1, -1]]
    assert t["rewards"].tolist() == [1.0, -1.0]
    with pytest.raises(ValueError):
        collate(rows_from_export({}))
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        rows_from_export({"x": {**rows["a"], "loss_mask": [1]}})


# ---- concurrency -------------------------------------------------------------------------------
def test_sixteen_threads_adding_children_keep_a_consistent_tree():
    c = InteractionCache()
    root_msgs = [user("task")]
    root = make(root_msgs, asst("plan"))
    c.add(root)
    n_threads, depth_per_thread = 16, 8
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            barrier.wait()
            msgs = [*root_msgs, asst("plan")]
            for d in range(depth_per_thread):
                msgs = [*msgs, user(f"t{t}-d{d}")]
                parent = c.find_parent(msgs)
                it = make(msgs, asst(f"r{t}-{d}"), parent=parent)
                c.add(it)
                c.set_reward(1.0, it.id)
                msgs = [*msgs, asst(f"r{t}-{d}")]
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(c) == 1 + n_threads * depth_per_thread
    assert len(c.children(root.id)) == n_threads  # sixteen branches of one parent
    for it in c.interactions():
        if it.id != root.id:
            assert it.parent_id is not None and it.spliced
            assert len(c.children(it.id)) <= 1
    assert len(c.leaves()) == n_threads
    values = c.discounted_rewards(1.0)
    assert values[root.id] == pytest.approx(n_threads * depth_per_thread)
    assert len(c.export(1.0, "concat")) == n_threads


# ---- echo tolerance as a property --------------------------------------------------------------
_words = st.text(alphabet="abcxyz 123", min_size=1, max_size=12).map(lambda s: s.strip() or "w")


@st.composite
def conversations(draw):
    """A session's first request plus the assistant output (possibly with tool calls)."""
    msgs = [user(draw(_words))]
    n_calls = draw(st.integers(0, 2))
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {
                "name": draw(st.sampled_from(["add", "lookup"])),
                "arguments": json.dumps(
                    draw(st.dictionaries(st.sampled_from("abcd"), st.integers(0, 9), max_size=3))
                ),
            },
        }
        for i in range(n_calls)
    ]
    out = {"role": "assistant", "content": draw(_words) if not calls else None}
    if calls:
        out["tool_calls"] = calls
    return msgs, out


def _echo(draw, message):
    """What a client might send back for ``message``: same meaning, different shape."""
    m = dict(message)
    content = m.get("content")
    form = draw(st.sampled_from(["same", "parts", "padded", "empty"]))
    if form == "parts" and content:
        m["content"] = [{"type": "text", "text": content}]
    elif form == "padded" and content:
        m["content"] = f"  {content}\n"
    elif form == "empty" and not content:
        m["content"] = draw(st.sampled_from([None, "", []]))
    if draw(st.booleans()):
        m.update(refusal=None, annotations=[], audio=None)
    if m.get("tool_calls"):
        echoed = []
        for c in m["tool_calls"]:
            args = json.loads(c["function"]["arguments"])
            text = json.dumps(
                dict(reversed(list(args.items()))), indent=draw(st.sampled_from([None, 2]))
            )
            call = {
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": text},
            }
            if draw(st.booleans()):
                call["id"] = c["id"]
            echoed.append(call)
        m["tool_calls"] = echoed
    return m


@settings(max_examples=100, deadline=None)
@given(convo=conversations(), data=st.data())
def test_find_parent_matches_any_tolerated_echo_and_nothing_else(convo, data):
    msgs, out = convo
    c = InteractionCache()
    parent = make(msgs, out)
    c.add(parent)
    follow = (
        [{"role": "tool", "tool_call_id": tc["id"], "content": "r"} for tc in out["tool_calls"]]
        if out.get("tool_calls")
        else [user("next")]
    )
    echoed = [_echo(data.draw, m) for m in [*msgs, out]]
    assert c.find_parent([*echoed, *follow]) is parent
    # changing the meaning of any message breaks the match
    k = data.draw(st.integers(0, len(echoed) - 1))
    broken = dict(echoed[k])
    if broken.get("tool_calls"):
        broken["tool_calls"] = [
            {**tc, "function": {**tc["function"], "name": tc["function"]["name"] + "_x"}}
            for tc in broken["tool_calls"]
        ]
    else:
        broken["content"] = "changed " + str(broken.get("content"))
    assert c.find_parent([*echoed[:k], broken, *echoed[k + 1 :], *follow]) is None
