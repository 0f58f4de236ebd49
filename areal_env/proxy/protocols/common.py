"""Protocol-neutral pieces: the internal request, field validation, and streaming text.

Every protocol module converts its request into a :class:`CompletionRequest` (OpenAI chat
messages and function tools, the proxy's internal format) and converts the recorded result back.
Streaming text goes through :class:`TextStream`, which turns token ids into text deltas as they
arrive while holding back anything that might still become a tool-call tag or a stop string, so
a client never sees half a ``<tool_call>`` printed as prose.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from areal_env.http.errors import HTTPError, bad_request, openai_error_body
from areal_env.proxy.content import ContentError, content_text

# Tags that open a tool call in the families the parsers know. Text that could be the start of
# one is held back while streaming until it is resolved.
DEFAULT_TOOL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


@dataclass
class OutputFormat:
    """A structured-output request: the reply must be JSON (matching ``schema`` when given).

    ``param`` is where the request said so (``response_format``, ``text.format``,
    ``output_config.format``): errors about it name it. ``echo`` is the format as the client sent
    it (the Responses object repeats it)."""

    schema: dict[str, Any] | None
    param: str
    name: str | None = None
    strict: bool = False
    echo: dict[str, Any] = field(default_factory=dict)


def openai_output_format(raw: Any, param: str, nested: bool) -> OutputFormat | None:
    """OpenAI's ``response_format`` (``nested``: the schema under ``json_schema``) or the
    Responses API's ``text.format`` (flat): text, json_object or json_schema; 400 otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request(f"'{param}' must be an object with a 'type'", param)
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat({"type": "object"}, param, echo=raw)
    if kind != "json_schema":
        raise bad_request(
            f"'{param}.type' must be text, json_object or json_schema; got {kind!r}", param
        )
    spec = raw.get("json_schema") if nested else raw
    where = f"{param}.json_schema" if nested else param
    if not isinstance(spec, dict):
        raise bad_request(f"'{where}' must be an object with a 'schema'", param)
    schema = spec.get("schema", {"type": "object"} if nested else None)
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.schema' must be a JSON schema object", param)
    name = spec.get("name")
    return OutputFormat(
        schema,
        param,
        name=name if isinstance(name, str) else None,
        strict=bool(spec.get("strict")),
        echo=raw,
    )


@dataclass
class CompletionRequest:
    """A generation request in internal (OpenAI chat) form, whatever protocol it came in."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    model: str | None = None
    n: int = 1
    """Choices to generate (OpenAI's ``n``): each its own branch of the session's tree."""
    output_format: OutputFormat | None = None
    """The reply must be JSON (matching a schema): constrained decoding."""
    parallel_tool_calls: bool = True
    """False: one tool call at most (OpenAI's ``parallel_tool_calls: false``, Anthropic's
    ``tool_choice.disable_parallel_tool_use: true``)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def parse_tools(self) -> list[dict[str, Any]] | None:
        """Tools the output parser may match (none when the client forbade tool calls)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tools


@dataclass
class Answer:
    """A finished completion as every protocol answers it (the pipeline's output)."""

    id: str
    model: str
    creq: CompletionRequest
    message: dict[str, Any]
    """Assistant message in internal form: ``content`` and/or ``tool_calls``."""
    finish_reason: str
    stop_hit: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None
    """OpenAI logprob entries, when the request asked for them."""
    interaction: Any = None
    """The recorded :class:`~areal_env.proxy.cache.Interaction`."""
    alternatives: list[Answer] = field(default_factory=list)
    """The other choices of a request with ``n > 1`` (choice 1, 2, ...)."""


class StreamWriter(Protocol):
    """One stream's events in a protocol's own format (the pipeline calls these in order)."""

    def start(self) -> bytes: ...

    def text(self, text: str, logprobs: list[dict[str, Any]]) -> bytes: ...

    def tool_calls(self, calls: list[dict[str, Any]]) -> bytes: ...

    def finish(self, answer: Answer, logprobs: list[dict[str, Any]]) -> bytes: ...

    def error(self, err: HTTPError) -> bytes: ...


@runtime_checkable
class ChoicesWriter(StreamWriter, Protocol):
    """A stream writer for several choices (``n > 1``): ``choice(i)`` writes choice ``i``'s
    events (with no trailer), ``end`` the trailer once every choice has finished."""

    def choice(self, index: int) -> StreamWriter: ...

    def end(self, answers: list[Answer]) -> bytes: ...


@dataclass(frozen=True)
class WireProtocol:
    """One wire protocol: request conversion, response building, stream events, errors.

    ``name`` is recorded with each interaction; ``route`` is where the proxy serves it;
    ``id_prefix`` starts the ids it hands out (``chatcmpl-``, ``msg_``, ``resp_``).
    ``stream(answer_id, model, request, prompt_tokens)`` makes the writer of one stream.
    """

    name: str
    route: str
    id_prefix: str
    parse: Callable[[Any], CompletionRequest]
    response: Callable[[Answer], dict[str, Any]]
    stream: Callable[[str, str, CompletionRequest, int], StreamWriter]
    error_body: Callable[[HTTPError], dict[str, Any]] = openai_error_body


# ---- field validation (never let a wrong type reach the engine as a 500) ----------------------


def request_text(content: Any, param: str | Callable[[], str]) -> str:
    """Request content as text (see :mod:`areal_env.proxy.content`); 400 naming ``param``
    otherwise. ``param`` may be a callable: only error paths build the name."""
    if isinstance(content, str):  # the common case first
        return content
    name = param() if callable(param) else param
    try:
        return content_text(content, name)
    except ContentError as e:
        raise bad_request(str(e), e.where) from None


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _check_bounds(name: str, v: float, lo: float | None, hi: float | None) -> None:
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {bound}, got {v!r}", name)


def opt_number(
    body: dict[str, Any], name: str, lo: float | None = None, hi: float | None = None
) -> float | None:
    v = body.get(name)
    if v is not None:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise bad_request(f"'{name}' must be a number, got {v!r}", name)
        _check_bounds(name, v, lo, hi)
    return None if v is None else float(v)


def opt_int(
    body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None
) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer, got {v!r}", name)
    _check_bounds(name, v, lo, hi)
    return v


def opt_bool(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {v!r}", name)
    return v


def opt_str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {type(v).__name__}", name)
    return v


def stop_list(v: Any, name: str) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request(f"'{name}' must be a string or a list of strings", name)
    v = [s for s in v if s]
    return v or None


def arguments_string(args: Any, param: str) -> str:
    """Tool-call arguments as the JSON string OpenAI uses (clients sometimes send objects)."""
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    raise bad_request(f"'{param}' must be a JSON string or object", param)


def validate_function_tool(
    name: Any, description: Any, parameters: Any, param: str, strict: Any = None
) -> dict:
    """A function tool in the internal form; ``strict``: its arguments must match
    ``parameters`` (constrained decoding)."""
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{param}.name' must be a non-empty string", f"{param}.name")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"'{param}.parameters' must be a JSON schema object", param)
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{param}.strict' must be a boolean", f"{param}.strict")
    fn: dict[str, Any] = {"name": name}
    if isinstance(description, str) and description:
        fn["description"] = description
    fn["parameters"] = (
        parameters if parameters is not None else {"type": "object", "properties": {}}
    )
    if strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def check_tool_choice(tool_choice: Any, tools: list[dict] | None, param: str) -> None:
    """A named tool_choice must name an offered tool."""
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names tool {name!r}, which is not in 'tools'", param)
    elif tool_choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs at least one tool in 'tools'", param)


def openai_tool_list(
    raw: Any, convert_one: Callable[[Any, str], dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """An OpenAI-style ``tools`` list (Chat Completions, Responses) in the internal form:
    ``convert_one(tool, "tools[i]")`` per entry; None for a missing or empty list."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", "tools")
    return [convert_one(t, f"tools[{i}]") for i, t in enumerate(raw)] or None


def openai_tool_choice(
    raw: Any, tools: list[dict] | None, named: bool, name: Any, named_shape: str
) -> Any:
    """An OpenAI-style ``tool_choice`` (Chat Completions and Responses) in the internal form.

    The two APIs differ only in where a named choice keeps its name, so the caller says whether
    ``raw`` has the named shape (``named``, ``name``) and how to spell it in the error.
    """
    if raw is None:
        return None
    if raw in ("auto", "none", "required"):
        choice: Any = raw
    elif named:
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise bad_request(
            f"'tool_choice' must be auto, none, required or {named_shape}", "tool_choice"
        )
    check_tool_choice(choice, tools, "tool_choice")
    return choice


# ---- streaming text ---------------------------------------------------------------------------


class TokenTexts:
    """Per-token strings for logprob reports, cached per tokenizer (ids repeat a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = s
        return s

    def logprob_entries(
        self,
        ids: list[int],
        logprobs: list[float],
        tops: list[list[tuple[int, float]]] | None = None,
    ) -> list[dict[str, Any]]:
        """OpenAI's logprob entries; ``tops[i]``: token ``i``'s most likely alternatives."""
        out = []
        for i, (tid, lp) in enumerate(zip(ids, logprobs, strict=False)):
            s = self(tid)
            top = []
            for alt, alt_lp in tops[i] if tops is not None else ():
                a = self(alt)
                top.append({"token": a, "logprob": float(alt_lp), "bytes": list(a.encode())})
            out.append(
                {
                    "token": s,
                    "logprob": float(lp),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": top,
                }
            )
        return out


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class TextStream:
    """Incremental detokenizer with hold-back of possible tool tags and stop strings.

    Decoding uses a sliding window (prefix/read offsets), so each step costs O(new tokens), and
    a multi-byte character split over tokens is emitted only once complete.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_ids: set[int] | frozenset[int] = frozenset(),
        tool_markers: tuple[str, ...] = (),
        stop: list[str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_ids
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # all decoded text so far
        self._emitted = 0  # chars of self.text already handed out
        self._tool_markers = tool_markers
        self._stop = tuple(stop or ())
        self._markers = tuple(tool_markers) + self._stop
        self.in_tool_call = False
        self.stopped_at: str | None = None

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that is now safe to show."""
        ids = [t for t in token_ids if t not in self._skip]
        if ids:
            self._ids.extend(ids)
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            new_text = self._decode(self._ids[self._prefix :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                self.text += new_text[len(prefix_text) :]
                self._prefix = self._read
                self._read = len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: flush what was held back unless it became a tool call / stop."""
        if self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            new_text = self._decode(self._ids[self._prefix :])
            self.text += new_text[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.in_tool_call or self.stopped_at is not None:
            return ""
        pending = self.text[self._emitted :]
        if not pending:
            return ""
        # Held-back text is part of ``pending``, so a marker split across steps is found here.
        cut = None
        for m in self._markers:
            i = pending.find(m)
            if i >= 0 and (cut is None or i < cut[0]):
                cut = (i, m)
        if cut is not None:
            pos, m = cut
            out = pending[:pos]
            self._emitted += pos
            if m in self._stop:
                self.stopped_at = m
            else:
                self.in_tool_call = True
            return out
        hold = 0 if final else _held_suffix(pending, self._markers)
        end = len(self.text) - hold
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


def truncate_at_stop(text: str | None, stop: list[str] | None) -> tuple[str | None, str | None]:
    """Cut ``text`` at the earliest stop string (OpenAI/Anthropic exclude it). Returns (text, hit)."""
    if not text or not stop:
        return text, None
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return text, None
    return text[: best[0]], best[1]


def content_remainder(final_content: str | None, emitted: str) -> str:
    """What of the final (parsed) content has not been streamed yet."""
    final_content = final_content or ""
    if final_content.startswith(emitted):
        return final_content[len(emitted) :]
    return ""


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event."""
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    if event:
        return f"event: {event}\ndata: {payload}\n\n".encode()
    return f"data: {payload}\n\n".encode()
