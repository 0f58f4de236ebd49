"""One session's completions as a conversation tree: parent lookup, rewards, discount, export.

Every completion the proxy serves becomes an :class:`Interaction`. A later request whose
messages start with an earlier interaction's ``messages + [output_message]`` extends it: that
interaction is its parent. Parallel tool calls and sub-agents send several requests extending
the same parent at once, so a session is a tree (a forest, with several roots), not a list.

Parent lookup is O(1) per request: every interaction is indexed by a chained hash of a
canonical form of its ``messages + [output_message]``; ``find_parent`` hashes the incoming
messages once, prefix by prefix, and looks each assistant position up, longest first.

Canonical form (what clients may change when they echo history back without breaking the match):
``role`` (``developer`` counts as ``system``); ``content`` as text (None, ``""``, a string or a
list of text parts all compare by their joined text, leading/trailing whitespace ignored); for
assistant messages the tool calls' names and arguments compared as parsed JSON (key order and
spacing do not matter). Everything else (``refusal``, ``annotations``, ``audio``, ``name``,
reasoning fields, ...) is ignored. Tool-call ids and ``tool_call_id`` are not hashed (protocol
converters rewrite them) but are compared when present on both sides, to pick between
candidates with equal hashes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_env.proxy.content import content_summary

logger = logging.getLogger(__name__)

ExportStyle = Literal["individual", "concat"]
_RECENT_SIZE = 16  # hash states of new roots kept from find_parent for the add() that follows


class SessionLimitError(ValueError):
    """A session reached its memory bound (interactions or tokens); maps to HTTP 413/400."""


@dataclass
class Interaction:
    """One completion: what was asked, what the model produced (token-exact), and its reward.

    ``prompt_ids`` are the exact tokens the engine received (for a spliced child they start with
    the parent's ``prompt_ids + output_ids``); ``output_logprobs`` and ``output_versions`` align
    with ``output_ids``. ``spliced`` is set by :meth:`InteractionCache.add` from a token-prefix
    check against the parent.
    """

    id: str
    session_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    output_message: dict[str, Any]
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str
    parent_id: str | None = None
    policy: str | None = None
    """The policy that produced it (the request's ``model``, in a multi-agent run); ``None``
    for a proxy without policies."""
    reward: float | None = None
    trained: bool = True
    """False: the completion is left out of the loss (``set_reward(..., train=False)``): neither
    rewarded nor blamed, e.g. an answer that could not have been right after a wrong tool result.
    It stays in the history of later turns, and its reward still flows to earlier ones."""
    spliced: bool = False
    created_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def new_id() -> str:
        """A fresh completion id in OpenAI's style."""
        return f"chatcmpl-{uuid.uuid4().hex}"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def _trained(it: Interaction) -> list[int]:
    """The loss mask of an interaction's output tokens: all of them, except the forced tokens of
    a constrained start (``tool_choice: required``: the only token allowed there, reported with
    logprob exactly 0). They are no choice of the policy and must carry no gradient; trained,
    the PPO ratio of one is the model's probability of it, and a right episode pushed it up.
    A completion set ``trained=False`` has none of its tokens in the loss."""
    if not it.trained:
        return [0] * len(it.output_ids)
    if not it.extra.get("constrained"):
        return [1] * len(it.output_ids)
    return [0 if lp == 0.0 else 1 for lp in it.output_logprobs]


# ---- canonical form and hashing --------------------------------------------------------------


@functools.lru_cache(maxsize=8192)
def _canonical_arguments_str(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments.strip()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical_arguments(arguments: Any) -> str:
    """Arguments compared as parsed JSON (key order and spacing ignored); cached by text."""
    if isinstance(arguments, str):
        return _canonical_arguments_str(arguments)
    try:
        return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(arguments)


def _message_ids(message: dict[str, Any]) -> tuple[tuple[str | None, ...], str | None]:
    """The ids of a message that must agree across echoes: its tool-call ids, its tool_call_id."""
    calls = message.get("tool_calls")
    call_ids = tuple(c.get("id") for c in calls if isinstance(c, dict)) if calls else ()
    return call_ids, message.get("tool_call_id")


_NO_IDS: tuple[tuple[str | None, ...], str | None] = ((), None)


def _ids_compatible_sig(
    a: tuple[tuple[str | None, ...], str | None], b: tuple[tuple[str | None, ...], str | None]
) -> bool:
    (calls_a, tcid_a), (calls_b, tcid_b) = a, b
    if tcid_a and tcid_b and tcid_a != tcid_b:
        return False
    return all(not (x and y) or x == y for x, y in zip(calls_a, calls_b, strict=False))


def _message_bytes(message: dict[str, Any]) -> bytes:
    """Unambiguous bytes of the canonical message (length-prefixed fields)."""
    role = message.get("role")
    if role == "developer":
        role = "system"
    content = message.get("content")
    text = content_summary(content).strip()
    role = str(role)
    out = f"{len(role)}:{role}{len(text)}:{text}"
    calls = message.get("tool_calls")
    if calls:
        for call in calls:
            if isinstance(call, dict):
                fn = call.get("function") or {}
                name = str(fn.get("name"))
                args = _canonical_arguments(fn.get("arguments"))
                out += f"{len(name)}:{name}{len(args)}:{args}"
    return (out + ";").encode("utf-8", "surrogatepass")


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


class InteractionCache:
    """One session's interactions as a tree; thread-safe (one lock around every mutation).

    ``max_interactions`` / ``max_tokens`` bound its memory: ``add`` past a bound raises
    :class:`SessionLimitError` and leaves the cache unchanged.
    """

    def __init__(self, max_interactions: int | None = None, max_tokens: int | None = None):
        self.max_interactions = max_interactions
        self.max_tokens = max_tokens
        self._lock = threading.RLock()
        self._items: dict[str, Interaction] = {}
        self._children: dict[str, list[str]] = {}
        self._index: dict[bytes, list[str]] = {}
        self._last: str | None = None
        self._total_tokens = 0
        self._recent: dict[int, tuple[list[dict[str, Any]], int, Any, list[Any]]] = {}
        # per interaction: the hash state after messages + output, and their id signatures
        self._sigs: dict[str, tuple[Any, list[Any]]] = {}

    # ---- containers ----
    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, interaction_id: object) -> bool:
        return interaction_id in self._items

    def __iter__(self) -> Iterator[Interaction]:
        with self._lock:
            return iter(list(self._items.values()))

    @property
    def total_tokens(self) -> int:
        """Prompt + output tokens held (each interaction counted in full)."""
        return self._total_tokens

    def interactions(self) -> list[Interaction]:
        """All interactions in insertion order (parents always before their children)."""
        with self._lock:
            return list(self._items.values())

    def children(self, interaction_id: str) -> list[Interaction]:
        with self._lock:
            return [self._items[c] for c in self._children.get(interaction_id, [])]

    def leaves(self) -> list[Interaction]:
        """Interactions without children, in insertion order."""
        with self._lock:
            return [it for it in self._items.values() if not self._children.get(it.id)]

    def get(self, interaction_id: str) -> Interaction:
        """The interaction with this id; ``KeyError`` if unknown."""
        with self._lock:
            try:
                return self._items[interaction_id]
            except KeyError:
                raise KeyError(f"unknown interaction {interaction_id!r}") from None

    def last(self) -> Interaction | None:
        with self._lock:
            return self._items[self._last] if self._last else None

    # ---- tree building ----
    def find_parent(self, messages: list[dict[str, Any]]) -> Interaction | None:
        """The interaction that ``messages`` extend the most, or None (a new root).

        An interaction extends-matches when ``messages`` start with its ``messages +
        [output_message]`` in canonical form. Assistant positions are tried from the end, so the
        longest match wins. Among equal-hash candidates, ones whose tool-call ids disagree are
        skipped and the most recent is taken.
        """
        h = _hasher()
        keys: dict[int, bytes] = {}  # only assistant positions can end a match
        sigs: list[tuple[tuple[str | None, ...], str | None]] = []
        for pos, message in enumerate(messages):
            h.update(_message_bytes(message))
            if message.get("role") == "assistant":
                keys[pos] = h.digest()
            sigs.append(
                _message_ids(message)
                if "tool_calls" in message or "tool_call_id" in message
                else _NO_IDS
            )
        with self._lock:
            if self._index:
                for pos in reversed(keys):  # insertion order is ascending: longest first
                    candidates = self._index.get(keys[pos])
                    if not candidates:
                        continue
                    for cid in reversed(candidates):
                        if self._ids_match(cid, sigs, pos + 1):
                            # add() chains from the parent's state: nothing to keep here
                            return self._items[cid]
            # A new root: add() usually follows with these very messages; keep the hash state
            # for it (bounded; an entry whose add never comes is dropped oldest first).
            self._recent[id(messages)] = (messages, len(messages), h, sigs)
            while len(self._recent) > _RECENT_SIZE:
                self._recent.pop(next(iter(self._recent)))
        return None

    def _ids_match(
        self, cid: str, sigs: list[tuple[tuple[str | None, ...], str | None]], n: int
    ) -> bool:
        """Whether the first ``n`` request messages' ids (``sigs``) agree with ``cid``'s."""
        own = self._sigs[cid][1]
        if len(own) != n:
            return False
        head = sigs if len(sigs) == n else sigs[:n]
        return own == head or all(_ids_compatible_sig(a, b) for a, b in zip(own, head, strict=True))

    def _chain_state(
        self, it: Interaction, parent: Interaction | None
    ) -> tuple[Any, list[tuple[tuple[str | None, ...], str | None]]]:
        """Hash state and id signatures of ``it.messages``, hashing as few messages as possible.

        A spliced child shares its parent's message objects (the proxy passes them on), so only
        the messages after the parent's are hashed: the cost follows the new turns.
        """
        msgs = it.messages
        if parent is not None and parent.id in self._sigs:
            n = len(parent.messages)
            if len(msgs) > n and msgs[n] is parent.output_message:
                pmsgs = parent.messages
                if all(a is b for a, b in zip(msgs[:n], pmsgs, strict=True)):
                    state, psigs = self._sigs[parent.id]
                    h = state.copy()
                    sigs = list(psigs)
                    for message in msgs[n + 1 :]:
                        h.update(_message_bytes(message))
                        sigs.append(_message_ids(message))
                    return h, sigs
        recent = self._recent.pop(id(msgs), None)
        if recent is not None and recent[0] is msgs and recent[1] == len(msgs):
            return recent[2].copy(), list(recent[3])
        h = _hasher()
        sigs = []
        for message in msgs:
            h.update(_message_bytes(message))
            sigs.append(_message_ids(message))
        return h, sigs

    def add(self, it: Interaction) -> None:
        """Insert a finished interaction (its parent, if any, must be in the cache).

        Sets ``it.spliced`` from a token check (the prompt starts with the parent's prompt +
        output ids) and records, in ``it.extra["spans"]``, the ``(start, length, interaction_id)``
        of every ancestor's output inside ``it.prompt_ids`` along the spliced chain.
        """
        n_out = len(it.output_ids)
        if len(it.output_logprobs) != n_out or len(it.output_versions) != n_out:
            raise ValueError(
                f"interaction {it.id!r}: output_ids ({n_out}), output_logprobs "
                f"({len(it.output_logprobs)}) and output_versions ({len(it.output_versions)}) "
                "must have the same length"
            )
        with self._lock:
            if it.id in self._items:
                raise ValueError(f"interaction {it.id!r} already recorded")
            if self.max_interactions is not None and len(self._items) >= self.max_interactions:
                raise SessionLimitError(
                    f"session holds the maximum of {self.max_interactions} interactions"
                )
            if self.max_tokens is not None and self._total_tokens + it.num_tokens > self.max_tokens:
                raise SessionLimitError(
                    f"session would hold {self._total_tokens + it.num_tokens} tokens, "
                    f"over its maximum of {self.max_tokens}"
                )
            parent = None
            if it.parent_id is not None:
                parent = self._items.get(it.parent_id)
                if parent is None:
                    raise KeyError(f"unknown parent interaction {it.parent_id!r}")
            h, sigs = self._chain_state(it, parent)
            h.update(_message_bytes(it.output_message))
            sigs.append(_message_ids(it.output_message))
            key = h.digest()
            self._record_spans(it, parent)
            self._items[it.id] = it
            self._sigs[it.id] = (h, sigs)
            self._children.setdefault(it.id, [])
            if parent is not None:
                self._children[parent.id].append(it.id)
            self._index.setdefault(key, []).append(it.id)
            self._last = it.id
            self._total_tokens += it.num_tokens

    @staticmethod
    def _record_spans(it: Interaction, parent: Interaction | None) -> None:
        spans: list[tuple[int, int, str]] = []
        spliced = False
        if parent is not None:
            n_prompt, n_out = len(parent.prompt_ids), len(parent.output_ids)
            head = it.prompt_ids[: n_prompt + n_out]
            spliced = (
                len(head) == n_prompt + n_out
                and head[:n_prompt] == parent.prompt_ids
                and head[n_prompt:] == parent.output_ids
            )
            if spliced:
                spans = [*parent.extra.get("spans", []), (n_prompt, n_out, parent.id)]
            elif it.spliced:
                logger.warning(
                    "interaction %s marked spliced but its prompt does not start with parent %s's "
                    "tokens; treating it as rendered from scratch",
                    it.id,
                    parent.id,
                )
        it.spliced = spliced
        it.extra["spans"] = spans

    # ---- rewards ----
    def set_reward(
        self,
        reward: float,
        completion_id: str | None = None,
        *,
        train: bool = True,
    ) -> str:
        """Set a completion's reward (None = the last added); returns its id.

        Setting replaces: a client that retries ``set_reward`` after a timeout (the first call
        may have landed) gets the same reward, never twice the reward. ``KeyError`` for an
        unknown id or an empty session, ``ValueError`` for a non-finite reward.

        ``train=False`` leaves the completion's tokens out of the loss (their advantage would
        blame or credit a turn for what an earlier turn decided); ``reward`` still counts in the
        returns of the turns before it.
        """
        value = float(reward)
        if not math.isfinite(value):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        with self._lock:
            if completion_id is None:
                if self._last is None:
                    raise KeyError("no interaction to reward in this session")
                completion_id = self._last
            it = self.get(completion_id)
            it.reward = value
            it.trained = bool(train)
            return it.id

    def discounted_rewards(self, discount: float) -> dict[str, float]:
        """Every interaction's reward after discounting along the tree, leaves first.

        ``value(node) = own_reward(node) + discount * sum(value(child) for child in children)``.
        A child's value flows only to its own ancestors (parallel branches never see each
        other's rewards); with ``discount=1`` a node gets its own reward plus every reward in its
        subtree; with ``discount=0`` only explicit rewards remain. Missing rewards count as 0.
        """
        if not (0.0 <= discount <= 1.0) or math.isnan(discount):
            raise ValueError(f"discount must be in [0, 1], got {discount!r}")
        with self._lock:
            values = {i: (it.reward or 0.0) for i, it in self._items.items()}
            # Parents are inserted before children, so reverse insertion order is leaves first.
            for it in reversed(list(self._items.values())):
                if it.parent_id is not None and discount != 0.0:
                    values[it.parent_id] += discount * values[it.id]
            return values

    # ---- export ----
    def export(
        self, discount: float = 1.0, style: ExportStyle = "individual"
    ) -> dict[str, dict[str, Any]]:
        """Training rows, keyed by interaction id.

        ``individual``: one row per interaction — ``prompt_ids + output_ids`` with the loss mask,
        logprobs and versions on the output only. ``concat``: one row per interaction that no
        spliced child continues (the leaves, when every turn was spliced) — its full token
        sequence with every assistant output on its spliced chain in the loss mask and their
        logprobs/versions kept; prompt, tool and user tokens masked out. A child rendered from
        scratch (the agent edited history) does not continue its parent's tokens, so its parent
        ends a row of its own. Each row's reward is its end interaction's discounted reward.

        Every row names its ``policy`` (the end interaction's) and trains only that policy's
        tokens: in a conversation handed between policies, another policy's outputs are prompt
        to this row (masked out), and a ``concat`` row continues only through outputs of its own
        policy; an output that no later output of its policy continues ends a row of its own.
        """
        if style not in ("individual", "concat"):
            raise ValueError(f"export style must be 'individual' or 'concat', got {style!r}")
        rewards = self.discounted_rewards(discount)
        with self._lock:
            items = list(self._items.values())
            if style == "individual":
                return {it.id: self._row(it, [], rewards[it.id], discount) for it in items}
            continued = {
                ancestor
                for it in items
                for _, _, ancestor in it.extra.get("spans", [])
                if self._items[ancestor].policy == it.policy
            }
            return {
                it.id: self._row(it, it.extra.get("spans", []), rewards[it.id], discount)
                for it in items
                if it.id not in continued
            }

    def _row(
        self,
        it: Interaction,
        spans: list[tuple[int, int, str]],
        reward: float,
        discount: float,
    ) -> dict[str, Any]:
        n_prompt, n_out = len(it.prompt_ids), len(it.output_ids)
        loss_mask = [0] * n_prompt + _trained(it)
        logprobs = [0.0] * n_prompt + list(it.output_logprobs)
        versions = [-1] * n_prompt + list(it.output_versions)
        t_end = float(it.extra.get("logprob_temperature", 1.0))
        temps: list[float] | None = None
        explored = bool(it.extra.get("explored"))
        guided = [0] * n_prompt + [int(bool(it.extra.get("guided")))] * n_out
        for start, length, ancestor_id in spans:
            anc = self._items[ancestor_id]
            if anc.policy != it.policy:
                continue  # another policy's output: prompt to this row
            explored = explored or bool(anc.extra.get("explored"))
            guided[start : start + length] = [int(bool(anc.extra.get("guided")))] * length
            loss_mask[start : start + length] = _trained(anc)
            logprobs[start : start + length] = anc.output_logprobs
            versions[start : start + length] = anc.output_versions
            t_anc = float(anc.extra.get("logprob_temperature", 1.0))
            if t_anc != t_end and temps is None:
                temps = [t_end] * (n_prompt + n_out)
            if temps is not None:
                temps[start : start + length] = [t_anc] * length
        reward, returns = self._turn_returns(it, spans, reward, discount)
        return {
            "input_ids": [*it.prompt_ids, *it.output_ids],
            "loss_mask": loss_mask,
            "logprobs": [float(x) for x in logprobs],
            "versions": [int(v) for v in versions],
            "reward": float(reward),
            # per token, the return of its turn, when the row's turns earned different credit
            "returns": returns,
            # The temperature the logprobs were taken at (proxy.sampling): the trainer
            # recomputes at the same one. A list (per token) when the row's turns differ.
            "temperature": temps if temps is not None else t_end,
            # Some trained token was picked by gconfig.choice_exploration, not by the model.
            "explored": explored,
            # Per token, 1 where a guide wrote the turn (rollout.guided_samples); None: no turn.
            "guided": guided if any(guided) else None,
            "policy": it.policy,
        }

    def _turn_returns(
        self, it: Interaction, spans: list[tuple[int, int, str]], reward: float, discount: float
    ) -> tuple[float, list[float] | None]:
        """``(the row's reward, per-token returns or None)`` of a ``concat`` row.

        Each turn of the row (an output of the row's policy it continues, then its own output)
        earns ``G = own reward + discount * G(next turn)``; the last turn earns ``reward``, the
        end's discounted value. Only this chain counts: a sibling branch's rewards never flow
        into the row. The row's reward is its first turn's return (all the credit it earned);
        the per-token list is given only when the turns' returns differ (a reward set on an
        intermediate completion, a verifier's credit for a right tool call, or ``discount < 1``).
        """
        own = [
            (start, length, self._items[aid].reward or 0.0)
            for start, length, aid in spans
            if self._items[aid].policy == it.policy
        ]
        if not own:
            return reward, None
        returns_by_turn = [reward]
        for _, _, r in reversed(own):
            returns_by_turn.append(r + discount * returns_by_turn[-1])
        returns_by_turn.reverse()  # first turn first; the last entry is the end's output
        first = returns_by_turn[0]
        if all(g == first for g in returns_by_turn):
            return first, None
        n_prompt = len(it.prompt_ids)
        per_token = [first] * (n_prompt + len(it.output_ids))
        for (start, length, _), g in zip(own, returns_by_turn, strict=False):
            per_token[start : start + length] = [g] * length
        per_token[n_prompt:] = [returns_by_turn[-1]] * len(it.output_ids)
        return first, per_token
