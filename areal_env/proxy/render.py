"""Chat-template rendering, token-exact multi-turn splicing and output parsing.

The proxy must train on exactly the tokens the model saw and produced. Re-rendering a whole
conversation each turn would re-tokenize earlier model outputs, and a BPE tokenizer often
splits the same text differently from how the model generated it. So a turn that extends an
earlier completion (its parent) is built as::

    parent.prompt_ids + parent.output_ids + end-of-turn glue + tokens(new messages) + gen prompt

where only the glue and the new messages' text are tokenized. The new messages' text is the
template's own rendering of them in context: the full conversation is rendered, the rendering of
the parent's part is cut off, and only the rest is tokenized.

Templates that ignore ``tools`` (plain ChatML, as SmolLM2's) get the tool definitions, the call
format and a worked example in the system prompt, written by the tool-parser family; earlier
assistant calls and tool results are rendered in that same format (results as
``<tool_response>`` blocks in a user turn).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson

from areal_env.proxy.content import ContentError, content_text
from areal_env.proxy.output import ParsedOutput, parse_completion, recover_calls
from areal_env.proxy.tool_json import normalize_arguments, normalize_arguments_text
from areal_env.proxy.tool_parsers import (
    ToolParser,
    detect_tool_parser,
    function_specs,
    get_tool_parser,
    tool_choice_name,
)

if TYPE_CHECKING:
    from areal_env.proxy.cache import Interaction

logger = logging.getLogger(__name__)

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_SENTINEL = "\u2063SPLICE-SENTINEL\u2063"
_PREFIX_CACHE_SIZE = 256  # siblings and retries of recent parents
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_tool_zq",
            "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]


@dataclass(frozen=True)
class RequiredCall:
    """The constraints of a ``tool_choice: required`` reply (after the prefill)."""

    choices: list[list[int]] | None  # token sequences it may start with: a tool name + "{"
    stop: list[str]  # the end of the call block, so that nothing follows the call
    json_start: str | None  # the JSON the prefill opens; the engine stops where it closes
    json_depth: int = 0  # 1: stop where the list's first element (one call) closes
    close: str = ""  # what closes the list the engine stopped inside (history, parsing)


class RenderError(ValueError):
    """Messages the template cannot render (bad roles/parts, template errors); HTTP 400."""


def _text_of(content: Any, where: str) -> str:
    """Content as text (tool results may nest parts); RenderError for non-text parts."""
    try:
        return content_text(content, where, nested=True)
    except ContentError as e:
        raise RenderError(str(e)) from None


class ChatRenderer:
    """Renders OpenAI-format messages to token ids with the tokenizer's chat template.

    ``tool_parser``: a family name (``hermes``, ``qwen``, ``llama3``, ``mistral``, ``none``) or
    ``auto`` (detected from the template). ``worked_example``: for templates that ignore tools,
    also put one example exchange (a request and its call) after the system prompt. The
    instance keeps only bounded caches after construction and is safe to share between threads
    and sessions.
    """

    def __init__(self, tokenizer: Any, tool_parser: str = "auto", *, worked_example: bool = True):
        self.tokenizer = tokenizer
        self.worked_example = worked_example
        self._tool_prompt_cache: dict[bytes, tuple[str, list[dict[str, str]]]] = {}
        # glue ids per final output token (None: the output did not end on a stop token)
        self._glue_cache: dict[tuple[int | None, str], list[int]] = {}
        # parent id -> (its context message objects, tools, tool_choice, their rendering)
        self._prefix_cache: dict[str, tuple[tuple[dict[str, Any], ...], Any, Any, str]] = {}
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template; the proxy needs one")
        if isinstance(template, dict):  # named templates: the tool-use one renders plain chats too
            template = (
                template.get("tool_use") or template.get("default") or next(iter(template.values()))
            )
        self.chat_template: str = template
        self.tool_parser_name = (
            detect_tool_parser(template) if tool_parser == "auto" else tool_parser.lower()
        )
        self.parser: ToolParser = get_tool_parser(self.tool_parser_name)
        self._fast_render = None
        self._fast_render = self._make_fast_render()
        self.native_tools = self._template_renders_tools()
        # A template with native <tool_call> support expects one object per tag.
        self._format: ToolParser = (
            get_tool_parser("qwen")
            if self.native_tools and self.tool_parser_name == "hermes"
            else self.parser
        )
        self.end_of_turn = self._detect_end_of_turn()
        self.stop_token_ids: list[int] = self._detect_stop_ids()
        self.local_suffix = self._check_local_suffix()
        self._strip_texts = [
            t for t in getattr(tokenizer, "all_special_tokens", []) if t and t.strip()
        ]
        logger.info(
            "chat renderer: tool parser %s, tools %s, end of turn %r, stop ids %s, "
            "suffix rendering %s, fast jinja path %s",
            self.tool_parser_name,
            "rendered by the template" if self.native_tools else "injected into the system prompt",
            self.end_of_turn,
            self.stop_token_ids,
            "local" if self.local_suffix else "over the whole history",
            self._fast_render is not None,
        )

    # ---- template probing ------------------------------------------------------------------
    def _apply(
        self, messages: list[dict[str, Any]], tools: Any, gen: bool, fast: bool = True
    ) -> str:
        """Render with the chat template (transformers' own renderer, minus per-call overhead)."""
        try:
            if fast and self._fast_render is not None:
                text = self._fast_render(messages, tools, gen)
            else:
                kwargs: dict[str, Any] = {
                    "tokenize": False,
                    "add_generation_prompt": gen,
                    "chat_template": self.chat_template,
                }
                if tools:
                    kwargs["tools"] = tools
                text = self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # jinja TemplateError, TypeError on None content, ...
            raise RenderError(f"chat template failed to render the messages: {exc}") from exc
        if not isinstance(text, str):
            raise RenderError("chat template did not return text")
        return text

    def _make_fast_render(self) -> Any:
        """``render_jinja_template`` called directly, if it renders exactly like
        ``apply_chat_template`` on probe conversations; else None (always use the latter)."""
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            return None
        template = self.chat_template
        special = dict(getattr(self.tokenizer, "special_tokens_map", {}) or {})

        def render(messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
            chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
            out = render_jinja_template(
                [chat],
                tools=tools or None,
                chat_template=template,
                add_generation_prompt=gen,
                **special,
            )
            return out[0][0]

        try:
            for msgs, tools, gen in self._probes():
                if render(msgs, tools, gen) != self._apply(msgs, tools, gen, fast=False):
                    return None
        except Exception:  # noqa: BLE001 - any doubt: use the public path
            return None
        return render

    @staticmethod
    def _probes() -> list[tuple[list[dict[str, Any]], Any, bool]]:
        user = {"role": "user", "content": "hi"}
        asst = {"role": "assistant", "content": "hello"}
        system = {"role": "system", "content": "sys"}
        return [
            ([user], None, True),
            ([system, user, asst], None, False),
            ([system, user, asst, user], _PROBE_TOOLS, True),
        ]

    def _check_local_suffix(self) -> bool:
        """Whether new turns render the same after a short context as after the whole history.

        Then ``render_extension`` renders only the first message, the parent's last two and the
        new ones: its cost follows the new turns, not the history. Probed at start-up on
        conversations with and without a system prompt, tools, tool calls and tool results.
        """
        call = {
            "id": "call_p",
            "type": "function",
            "function": {"name": "probe_tool_zq", "arguments": '{"x": "1"}'},
        }
        history: list[dict[str, Any]] = [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_p", "content": "r1"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question"},
            {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "call_q"}]},
        ]
        news = [
            [{"role": "tool", "tool_call_id": "call_p", "content": "a"}],
            [
                {"role": "tool", "tool_call_id": "call_p", "content": "a"},
                {"role": "tool", "tool_call_id": "call_q", "content": "b"},
            ],
            [{"role": "user", "content": "third"}],
        ]
        text_end = [*history[:-1], {"role": "assistant", "content": "plain"}]
        try:
            systems: list[list[dict[str, Any]]] = [[], [{"role": "system", "content": "be good"}]]
            for system in systems:
                for hist in (history, text_end):
                    prefix = [*system, *hist]
                    for new in news:
                        for tools in (None, _PROBE_TOOLS):
                            full = self._suffix(prefix, new, tools, None, local=False)
                            short = self._suffix(prefix, new, tools, None, local=True)
                            if full is None or full != short:
                                return False
        except RenderError:
            return False
        return True

    def _suffix(
        self,
        prefix_msgs: list[dict[str, Any]],
        new_messages: list[dict[str, Any]],
        tools: Any,
        tool_choice: Any,
        local: bool,
        prefix: str | None = None,
    ) -> str | None:
        """Template text of ``new_messages`` (+ generation prompt) after ``prefix_msgs``.

        ``local``: render after a short context (first message + the last two) instead of the
        whole history. ``prefix``: that context's rendering, if already known. None if the
        rendering of the prefix is not a prefix of the whole.
        """
        if local and len(prefix_msgs) > 3:
            prefix_msgs = [prefix_msgs[0], *prefix_msgs[-2:]]
        if prefix is None:
            prefix = self.render_text(prefix_msgs, tools, tool_choice, add_generation_prompt=False)
        full = self.render_text(
            [*prefix_msgs, *new_messages], tools, tool_choice, add_generation_prompt=True
        )
        return full[len(prefix) :] if full.startswith(prefix) else None

    def _template_renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "hi"}]
        try:
            return self._apply(probe, _PROBE_TOOLS, True) != self._apply(probe, None, True)
        except RenderError:
            return False

    def _detect_end_of_turn(self) -> str:
        eos = getattr(self.tokenizer, "eos_token", None) or ""
        try:
            text = self._apply(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}],
                None,
                False,
            )
        except RenderError:
            return eos
        idx = text.rfind(_SENTINEL)
        return text[idx + len(_SENTINEL) :] if idx >= 0 else eos

    def _detect_stop_ids(self) -> list[int]:
        ids: list[int] = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            ids.extend(int(i) for i in eos)
        if self.end_of_turn.strip():
            first = self._encode(self.end_of_turn.strip())[:1]
            special = set(getattr(self.tokenizer, "all_special_ids", []))
            added = set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})
            if first and (first[0] in special or first[0] in added) and first[0] not in ids:
                ids.append(first[0])
        return ids

    # ---- message preparation ---------------------------------------------------------------
    def _offered_tools(self, tools: Any, tool_choice: Any) -> list[dict[str, Any]]:
        if tool_choice == "none" or self.tool_parser_name == "none":
            return []
        specs = function_specs(tools)
        return [{"type": "function", "function": s} for s in specs]

    def _prepare(
        self, messages: list[dict[str, Any]], tools: Any, tool_choice: Any
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and tools as the template should see them."""
        if not isinstance(messages, list) or not messages:
            raise RenderError("messages must be a non-empty list")
        offered = self._offered_tools(tools, tool_choice)
        out: list[dict[str, Any]] = []
        pending_results: list[str] = []

        def flush_results() -> None:
            if pending_results:
                out.append(
                    {"role": "user", "content": self._format.format_tool_results(pending_results)}
                )
                pending_results.clear()

        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
                role = msg.get("role") if isinstance(msg, dict) else None
                raise RenderError(f"messages[{i}]: unsupported role {role!r}")
            role = "system" if msg["role"] == "developer" else msg["role"]
            text = _text_of(msg.get("content"), f"messages[{i}]")
            calls = [self._call_of(c, i) for c in msg.get("tool_calls") or []]
            if self.native_tools:
                prepared: dict[str, Any] = {"role": role, "content": text}
                if role == "assistant" and calls:
                    prepared["tool_calls"] = [
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["object"]},
                        }
                        for c in calls
                    ]
                if role == "tool" and msg.get("tool_call_id"):
                    prepared["tool_call_id"] = msg["tool_call_id"]
                if msg.get("name") and role == "tool":
                    prepared["name"] = msg["name"]
                out.append(prepared)
                continue
            if role == "tool":
                pending_results.append(text)
                continue
            flush_results()
            if role == "assistant" and calls:
                formatted = self._format.format_calls(calls)
                text = f"{text}\n{formatted}" if text.strip() else formatted
            out.append({"role": role, "content": text})
        flush_results()

        if self.native_tools:
            return out, offered or None
        instructions, example = self._tool_prompt(offered, tool_choice) if offered else ("", [])
        if instructions:
            if out[0]["role"] == "system":
                base = out[0]["content"]
                out[0] = {
                    "role": "system",
                    "content": f"{base}\n\n{instructions}" if base.strip() else instructions,
                }
            else:
                out.insert(0, {"role": "system", "content": instructions})
            if example:
                out[1:1] = [dict(m) for m in example]
        return out, None

    def _tool_prompt(
        self, offered: list[dict[str, Any]], tool_choice: Any
    ) -> tuple[str, list[dict[str, str]]]:
        """Tool instructions and worked example for these tools, cached by their content.

        Every request of an agent offers the same tools; this text is built once, not on every
        render (twice per spliced turn).
        """
        try:
            key: bytes | None = orjson.dumps([offered, tool_choice], option=orjson.OPT_SORT_KEYS)
        except (TypeError, orjson.JSONEncodeError):
            key = None
        hit = self._tool_prompt_cache.get(key) if key is not None else None
        if hit is not None:
            return hit
        instructions = self._format.instructions(offered, tool_choice)
        example = (
            self._format.worked_example(offered, tool_choice)
            if instructions and self.worked_example
            else []
        )
        if key is not None:
            if len(self._tool_prompt_cache) >= 256:
                self._tool_prompt_cache.clear()
            self._tool_prompt_cache[key] = (instructions, example)
        return instructions, example

    def _call_of(self, call: Any, i: int) -> dict[str, Any]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RenderError(f"messages[{i}]: tool_calls entries need function.name")
        raw = fn.get("arguments")
        out = {"id": call.get("id") or "", "name": fn["name"], "arguments": raw}
        if self.native_tools:  # only templates that render calls themselves need the object
            normalized = (
                normalize_arguments_text(raw) if isinstance(raw, str) else normalize_arguments(raw)
            )
            out["object"] = json.loads(normalized) if normalized is not None else raw
        return out

    # ---- public rendering ------------------------------------------------------------------
    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: Any = None,
        tool_choice: Any = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text (without any prefill) for ``messages``."""
        prepared, template_tools = self._prepare(messages, tools, tool_choice)
        return self._apply(prepared, template_tools, add_generation_prompt)

    def prefill_text(self, tools: Any = None, tool_choice: Any = None) -> str:
        """The start of a tool call forced into the prompt for ``required``/named tool_choice.

        Deterministic, so ``parse_output`` recomputes it instead of keeping per-request state.
        """
        offered = self._offered_tools(tools, tool_choice)
        if not offered:
            return ""
        forced = tool_choice_name(tool_choice)
        if forced and forced in {t["function"]["name"] for t in offered}:
            return self._format.prefill(forced)
        if tool_choice == "required":
            return self._format.prefill(None)
        return ""

    def call_grammar(
        self,
        tools: Any,
        tool_choice: Any,
        answer_schema: dict[str, Any] | None,
        parallel: bool = True,
    ) -> str | None:
        """The grammar of a reply that calls ``tools`` in this model family's format (strict
        tools' arguments matching their schemas) or answers with ``answer_schema``'s JSON; it
        continues ``prefill_text`` (see ``ToolParser.call_grammar``). ``parallel`` False: one
        call at most."""
        offered = self._offered_tools(tools, tool_choice)
        return self._format.call_grammar(offered, tool_choice, answer_schema, parallel)

    def required_call(
        self, tools: Any, tool_choice: Any, parallel: bool = True
    ) -> RequiredCall | None:
        """How to hold a ``tool_choice: required`` reply to one call of an offered tool, as
        OpenAI's API and vLLM/SGLang's guided decoding guarantee; None for other choices.

        ``parallel`` False (``parallel_tool_calls: false``): the reply ends where its first call
        closes, even inside a list that could hold more."""
        if tool_choice != "required":
            return None
        offered = self._offered_tools(tools, tool_choice)
        if not offered:
            return None
        choices = [c for c in map(self._encode, self._format.required_call_starts(offered)) if c]
        end = self._format.calls_end
        opening = self._format.json_opening(None)
        if not parallel and opening:
            return self._one_call(choices or None, [end] if end else [], opening, opening)
        # one block holds every call (hermes list form): stop where its JSON closes
        json_start = (opening or None) if end else None
        return RequiredCall(choices or None, [end] if end else [], json_start)

    @staticmethod
    def _one_call(
        choices: list[list[int]] | None, stop: list[str], opening: str, json_start: str
    ) -> RequiredCall:
        """A call constraint that ends with the first call: where a list of calls opens, at its
        first element (``close`` then finishes the list), else where the value closes."""
        listed = opening.startswith("[")
        return RequiredCall(choices, stop, json_start, 1 if listed else 0, "]" if listed else "")

    def explored_call(self, tools: Any, parallel: bool = True) -> RequiredCall | None:
        """A reply that starts a call of one of ``tools`` from its first token, for a reply the
        model was free to give (``tool_choice: auto``): the proxy's ``call_exploration``. The
        prompt stays the one the agent asked for (no prefill, no "must call" instruction), so
        what the trained call is learned against is the prompt the model meets unexplored.
        None when this model family has no name slot to start a call with. ``parallel`` False:
        the reply ends with its first call, where the family's wrapper holds no brackets of its
        own (the scan runs over the whole reply)."""
        offered = self._offered_tools(tools, "auto")
        starts = self._format.required_call_starts(offered) if offered else []
        if not starts:
            return None
        opening = self._format.prefill(None)
        choices = [self._encode(opening + start) for start in starts]
        end = self._format.calls_end
        json_opening = self._format.json_opening(None)
        wrapper = opening[: len(opening) - len(json_opening)]
        if not parallel and json_opening and not any(c in wrapper for c in "[]{}"):
            return self._one_call(choices, [end] if end else [], json_opening, "")
        return RequiredCall(choices, [end] if end else [], None)

    def guided_call(
        self, tools: Any, tool_choice: Any, call: dict[str, Any], parallel: bool = True
    ) -> RequiredCall | None:
        """A reply that starts with ``call`` (``{"name", "arguments"}``, a reference solution's
        next call): the constraints of the reply the request allows (``required``: after the
        prefill; ``auto``: from the first token), with the whole call up to the end of its
        object as the one start allowed. None when the request cannot carry it: another
        ``tool_choice``, ``call`` names no offered tool, or the family has no name slot."""
        if tool_choice == "required":
            start = self.required_call(tools, tool_choice, parallel)
            opening = ""
        elif tool_choice in (None, "auto"):
            start = self.explored_call(tools, parallel)
            opening = self._format.prefill(None)
        else:
            return None
        offered = {t["function"]["name"] for t in self._offered_tools(tools, tool_choice)}
        text = self._format.guided_call_text(call["name"], call["arguments"])
        if start is None or text is None or call["name"] not in offered:
            return None
        return replace(start, choices=[self._encode(opening + text)])

    def guided_answer(self, tool_choice: Any, content: str) -> RequiredCall | None:
        """A reply that starts with the text ``content`` (a reference solution's final answer);
        None where the request forces a call (``required`` or a named tool)."""
        if tool_choice not in (None, "auto", "none"):
            return None
        return RequiredCall([self._encode(content)], [], None)

    def render_prompt(
        self, messages: list[dict[str, Any]], tools: Any = None, tool_choice: Any = None
    ) -> list[int]:
        """Token ids of the whole conversation rendered from scratch, with generation prompt."""
        text = self.render_text(messages, tools, tool_choice) + self.prefill_text(
            tools, tool_choice
        )
        return self._encode(text)

    def render_extension(
        self,
        parent: Interaction,
        new_messages: list[dict[str, Any]],
        tools: Any = None,
        tool_choice: Any = None,
    ) -> list[int]:
        """Token ids for a turn extending ``parent``, reusing its exact prompt and output ids.

        ``new_messages`` are the request's messages after ``parent.messages +
        [parent.output_message]``. The system prompt (and tool instructions) stay those of the
        parent's prompt. If the template renders earlier turns differently once more messages
        follow (so no clean suffix exists), this logs a warning and renders from scratch; the
        cache then records the child as not spliced.
        """
        prefix_msgs = [*parent.messages, parent.output_message]
        suffix = None
        if self.local_suffix:
            suffix = self._local_suffix(parent, prefix_msgs, new_messages, tools, tool_choice)
        if suffix is None:
            suffix = self._suffix(prefix_msgs, new_messages, tools, tool_choice, False)
        if suffix is None:
            logger.warning(
                "chat template re-renders earlier turns when the conversation grows; "
                "rendering the turn after %s from scratch",
                parent.id,
            )
            return self.render_prompt([*prefix_msgs, *new_messages], tools, tool_choice)
        suffix += self.prefill_text(tools, tool_choice)
        return [
            *parent.prompt_ids,
            *parent.output_ids,
            *self.glue_ids(parent.output_ids, parent.extra.get("call_close", "")),
            *self._encode(suffix),
        ]

    def _local_suffix(
        self,
        parent: Interaction,
        prefix_msgs: list[dict[str, Any]],
        new_messages: list[dict[str, Any]],
        tools: Any,
        tool_choice: Any,
    ) -> str | None:
        """``_suffix(local=True)`` with the parent's short-context rendering cached.

        The next turn's request comes back with the same tools: the context is rendered once per
        parent. Entries are checked against the very message objects they were rendered from
        (the proxy shares a parent's message objects with its children) and are bounded
        (oldest dropped first).
        """
        ctx = [prefix_msgs[0], *prefix_msgs[-2:]] if len(prefix_msgs) > 3 else prefix_msgs
        cached = self._prefix_cache.get(parent.id)
        prefix = None
        if (
            cached is not None
            and len(cached[0]) == len(ctx)
            and all(a is b for a, b in zip(cached[0], ctx, strict=True))
            and cached[1] == tools
            and cached[2] == tool_choice
        ):
            prefix = cached[3]
        if prefix is None:
            prefix = self.render_text(ctx, tools, tool_choice, add_generation_prompt=False)
            self._prefix_cache[parent.id] = (tuple(ctx), tools, tool_choice, prefix)
            while len(self._prefix_cache) > _PREFIX_CACHE_SIZE:
                try:
                    self._prefix_cache.pop(next(iter(self._prefix_cache)))
                except (StopIteration, KeyError, RuntimeError):  # another thread got there
                    break
        return self._suffix(prefix_msgs, new_messages, tools, tool_choice, True, prefix)

    def glue_ids(self, output_ids: list[int], closing: str = "") -> list[int]:
        """Tokens that close the assistant turn after ``output_ids``.

        If the output ended on a stop token that starts the template's end-of-turn text
        (``<|im_end|>`` of ``<|im_end|>\\n``), only the rest (``\\n``) is added; otherwise (cut by
        length, a stop string, ...) the whole end-of-turn text is. ``closing`` comes first: the
        ``]`` of a call list the engine stopped inside after one call (``parallel_tool_calls:
        false``), so the history shows a well-formed call. Cached per final token.
        """
        last = output_ids[-1] if output_ids and output_ids[-1] in self.stop_token_ids else None
        cached = self._glue_cache.get((last, closing))
        if cached is None:
            glue = self.end_of_turn
            if last is not None:
                tail = self.tokenizer.decode([last], skip_special_tokens=False)
                if tail and glue.startswith(tail):
                    glue = glue[len(tail) :]
            glue = closing + glue if last is None else glue
            cached = self._encode(glue) if glue else []
            self._glue_cache[(last, closing)] = cached
        return list(cached)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- output parsing --------------------------------------------------------------------
    def parse_output(
        self,
        output_ids: list[int],
        stop_reason: str,
        tools: Any = None,
        tool_choice: Any = None,
        closing: str = "",
        cut: int = 0,
    ) -> ParsedOutput:
        """Decode a completion and parse its tool calls; never raises on model output.

        Pass the request's ``tool_choice`` when it was ``required``/named so the prefilled call
        start is parsed with the output, and ``closing`` after it (the ``]`` of a call list the
        engine stopped inside, without the output's last ``cut`` characters: the ``,`` of a
        ``},`` token after the call). Calls are parsed only when tools were offered (see
        :func:`~areal_env.proxy.output.parse_completion`).
        """
        ids = list(output_ids)
        while ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        output = self.tokenizer.decode(ids, skip_special_tokens=False)
        if cut:
            output = output[:-cut]
        text = self.prefill_text(tools, tool_choice) + output + closing
        parser = self.parser if self._offered_tools(tools, tool_choice) else None
        return parse_completion(
            text,
            stop_reason,
            parser,
            self._clean,
            recover=lambda body: recover_calls(self.parser, body, tools, tool_choice),
        )

    def _clean(self, text: str) -> str:
        for tok in self._strip_texts:
            if tok in text:
                text = text.replace(tok, "")
        return text
