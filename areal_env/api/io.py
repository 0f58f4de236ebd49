"""Request/response types shared by every inference engine, the proxy and the trainer.

They are plain dataclasses (no torch) so that light clients can import them.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

StopReason = Literal["stop", "length", "tool_calls", "abort"]
ConstraintKind = Literal["json_schema", "regex", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """What a completion must match, enforced token by token (constrained decoding).

    ``kind``: ``json_schema`` (``value`` is the schema as JSON text), ``regex`` (a regular
    expression the whole output matches) or ``grammar`` (a Lark grammar in llguidance's dialect,
    which may inline JSON schemas with ``%json {...}``: the proxy writes a model family's
    tool-call wrapper around strict tool arguments this way). Hashable: engines cache compiled
    grammars by it. The embedded engine compiles it with llguidance; ``SGLangEngine`` passes it
    as SGLang's ``json_schema`` / ``regex`` / ``ebnf`` sampling parameter.
    """

    kind: ConstraintKind
    value: str

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "regex", "grammar"):
            raise ValueError(
                f"constraint kind must be json_schema, regex or grammar, got {self.kind!r}"
            )
        if not isinstance(self.value, str) or not self.value:
            raise ValueError("a constraint needs its schema, regex or grammar as a string")


@dataclass
class GenerationConfig:
    """Sampling options for one completion.

    ``top_k=0`` and ``top_p=1.0`` mean "off"; ``greedy=True`` (or ``temperature == 0``) picks the
    argmax. Logprobs are always those of the distribution actually sampled from.
    """

    max_new_tokens: int = 256
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    greedy: bool = False
    """Pick the most likely token."""
    stop: list[str] | None = None
    """Stop strings (the completion ends with the token that completes one)."""
    stop_token_ids: list[int] | None = None
    """Extra stop token ids (besides the model's eos)."""
    ignore_eos: bool = False
    """Keep generating past eos/stop tokens (benchmarks)."""
    seed: int | None = None
    """Per-request sampling seed (reproducible whatever else is batched)."""
    prefix_choices: list[list[int]] | None = None
    """Constrained start: the output begins with one of these token sequences, then runs free
    (the proxy uses it for ``tool_choice: required``: the call names an offered tool). Tokens are
    drawn from the distribution restricted to the allowed ones. A choice among several reports
    the model's own (unrestricted) logprob, which the trainer recomputes, so the importance
    ratio starts at 1; a forced token reports 0, so it carries no gradient (see
    ``engine.sampler.sample_rows``). Engines that cannot constrain (SGLang) ignore it."""
    choice_exploration: float = 0.0
    """Exploration of a constrained start (``prefix_choices``, the tool named by a
    ``tool_choice: required`` call): at each point where several tokens are allowed, with this
    probability the token is drawn uniformly among them instead of from the model. Its reported
    logprob stays the model's own one, so the trainer treats the draw as the policy's
    own: a deliberate, epsilon-greedy-style bias towards trying every offered tool, for a model
    that almost never picks some of them (0 = off; greedy requests ignore it). Engines that
    cannot constrain (SGLang) ignore it."""
    call_exploration: float = 0.0
    """Exploration of *whether* to call a tool, where the agent left it to the model
    (``tool_choice: auto``) right after a tool result: with this probability the proxy starts
    the reply with a call of one of the offered tools (``prefix_choices`` then hold whole call
    starts and ``prefix_decision`` is set), so an agent that has learned to answer after one
    call still tries a second one. Applied by the proxy in ``proxy.sampling: trainer`` mode to
    sampled completions; greedy ones (evaluation) never explore (0 = off). Engines that cannot
    constrain (SGLang) ignore it."""
    prefix_decision: bool = False
    """The first token of ``prefix_choices`` stands for a decision the proxy took on the
    policy's behalf (``call_exploration``): it reports the model's own logprob, so it is
    trained like a choice (a forced token otherwise reports 0 and is left out of the loss),
    and the row counts as explored (``GenerationResult.explored``)."""
    prefix_guided: bool = False
    """Every token of ``prefix_choices`` stands for the policy: the proxy writes a reference
    solution's step (a tool call, or the answer) into the reply (``/rl/start_session`` ``guide``). Each token, forced or
    not, reports the model's own logprob, so it is trained like a sampled one (a forced token
    otherwise reports 0 and is left out of the loss), and the row counts as explored
    (``GenerationResult.explored``): a guided reply that did not pay is not pushed down."""
    stop_at_json_end: str | None = None
    """The output continues this JSON text (e.g. ``'[{"name": "'``): stop with the token that
    closes the value it opened, as guided decoding ends a ``tool_choice: required`` call.
    Strings and escapes are respected. Engines that cannot (SGLang) ignore it."""
    json_end_depth: int = 0
    """With ``stop_at_json_end``: the bracket depth whose return ends the output. 0: the whole
    value; 1: its first element (one call of a call list, for ``parallel_tool_calls: false``)."""
    constraint: Constraint | None = None
    """The output must match this schema, regex or grammar (constrained decoding; see
    ``Constraint``). Each token is drawn from the distribution restricted to what the grammar
    allows next; as with ``prefix_choices``, a token among several allowed reports the model's own
    (unrestricted, tempered) logprob, and a token that was the only one allowed reports 0 (no
    choice of the policy: the proxy leaves it out of the loss mask)."""
    top_logprobs: int = 0
    """Also return, per output token, this many most likely tokens and their logprobs (under the
    distribution the logprobs are reported for; 0 = off, at most 20)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field; engines call this before queueing."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.choice_exploration, bool) or not (
            isinstance(self.choice_exploration, int | float) and 0 <= self.choice_exploration <= 1
        ):
            raise ValueError(
                f"choice_exploration must be in [0, 1] (0 = off), got {self.choice_exploration!r}"
            )
        if isinstance(self.call_exploration, bool) or not (
            isinstance(self.call_exploration, int | float) and 0 <= self.call_exploration <= 1
        ):
            raise ValueError(
                f"call_exploration must be in [0, 1] (0 = off), got {self.call_exploration!r}"
            )
        if self.prefix_decision and not self.prefix_choices:
            raise ValueError("prefix_decision needs prefix_choices (the call starts it decides)")
        if self.prefix_guided and not self.prefix_choices:
            raise ValueError("prefix_guided needs prefix_choices (the reference step's tokens)")
        if not isinstance(self.json_end_depth, int) or self.json_end_depth < 0:
            raise ValueError(f"json_end_depth must be an integer >= 0, got {self.json_end_depth!r}")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.prefix_choices is not None and not (
            all(isinstance(c, list) and c for c in self.prefix_choices)
            and all(isinstance(t, int) and t >= 0 for c in self.prefix_choices for t in c)
        ):
            raise ValueError("prefix_choices must be a list of non-empty lists of token ids")
        if self.constraint is not None:
            if isinstance(self.constraint, dict):
                self.constraint = Constraint(**self.constraint)
            if not isinstance(self.constraint, Constraint):
                raise ValueError(f"constraint must be a Constraint, got {self.constraint!r}")
            if self.prefix_choices is not None:
                raise ValueError("prefix_choices and constraint cannot be combined")
        if isinstance(self.top_logprobs, bool) or not (
            isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20
        ):
            raise ValueError(
                f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}"
            )
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    def new(self, **changes: Any) -> GenerationConfig:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> GenerationConfig:
        """Build from a dict, refusing unknown options with the list of valid ones."""
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"unknown sampling option(s) {unknown}; valid options: {sorted(valid)}"
            )
        return cls(**options)


@dataclass
class ModelRequest:
    """One generation request: token ids in, sampling options."""

    input_ids: list[int]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict[str, Any] = field(default_factory=dict)
    adapter: str | None = None
    """The LoRA adapter (a policy's, by name) that answers; None = the engine's own weights.
    Engines serve the adapters loaded with ``load_adapter`` (SGLang: ``lora_path``)."""


@dataclass
class ModelResponse:
    """The outcome of one request.

    ``output_logprobs[i]`` scores ``output_tokens[i]`` and ``output_versions[i]`` is the weight
    version that produced it, so a completion that spans a weight update shows the switch.
    """

    input_tokens: list[int]
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    latency: float = 0.0
    ttft: float = 0.0
    rid: str = ""
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``GenerationConfig.top_logprobs``: per output token, the most likely
    ``(token id, logprob)`` pairs, most likely first (None when not asked for)."""
    explored: int = 0
    """Output tokens picked by ``choice_exploration``'s uniform draw instead of the model's, plus
    one for a call the proxy started by ``call_exploration`` (0 when neither fired). The trainer needs to know: a failed episode whose tool was picked by
    exploration says nothing against the policy's own choice (``actor.punish_failed_exploration``)."""

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class StreamChunk:
    """Tokens produced since the previous chunk of a streaming request.

    The last chunk of a stream carries ``final``: the full ``ModelResponse``.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    final: ModelResponse | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token of ``token_ids`` (with ``GenerationConfig.top_logprobs``)."""
