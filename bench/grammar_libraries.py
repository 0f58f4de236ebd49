"""Which grammar library constrains the embedded engine: xgrammar, llguidance or outlines-core.

Measured with the default model's tokenizer (SmolLM2, 49,152 tokens), in one process, on the same
schemas, so the libraries are compared side by side on the same (noisy, shared) machine:

- **coverage**: for each schema of ``SCHEMAS`` (the shapes the SDKs send: pydantic models with
  ``$defs``/``$ref`` and ``anyOf`` nulls, strict OpenAI schemas, plus the JSON Schema keywords users
  write), does the library compile it, accept a valid instance token by token, and refuse an
  instance that breaks the keyword under test? A library that compiles a schema but accepts the
  invalid instance ignores the keyword silently: the worst outcome (a 200 with a wrong reply).
- **mask time per token**: computing the allowed-token mask at every step of walking the valid
  instances (mean, p99 and max over all steps), and the same walk for a hermes tool-call wrapper
  (``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`` around a strict schema) where the
  library can express it;
- **compile time** per schema (cold: each schema once), and the tokenizer set-up time.

Run: ``.venv/bin/python bench/grammar_libraries.py`` (libraries that are not installed are
skipped; to compare all three without installing them into the project,
``pip install --target DIR xgrammar llguidance outlines-core`` and put DIR on ``PYTHONPATH``).
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# (name, schema, valid instance, invalid instance or None)
SCHEMAS: list[tuple[str, dict[str, Any], Any, Any]] = [
    ("strict_object", PERSON, {"name": "Ada", "age": 36, "tags": ["math"]}, {"name": "Ada"}),
    (
        "pydantic_defs_ref_optional",
        {
            "$defs": {
                "City": {
                    "properties": {
                        "name": {"title": "Name", "type": "string"},
                        "country": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    },
                    "required": ["name", "country"],
                    "title": "City",
                    "type": "object",
                    "additionalProperties": False,
                }
            },
            "properties": {
                "capital": {"$ref": "#/$defs/City"},
                "others": {"items": {"$ref": "#/$defs/City"}, "type": "array"},
            },
            "required": ["capital", "others"],
            "title": "Answer",
            "type": "object",
            "additionalProperties": False,
        },
        {"capital": {"name": "Paris", "country": None}, "others": []},
        {"capital": {"name": "Paris"}, "others": []},
    ),
    (
        "enum_const",
        {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "kind": {"const": "paint"},
            },
            "required": ["colour", "kind"],
        },
        {"colour": "green", "kind": "paint"},
        {"colour": "pink", "kind": "paint"},
    ),
    (
        "array_min_max_items",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [1, 2],
        [1, 2, 3, 4],
    ),
    (
        "string_min_max_length",
        {"type": "string", "minLength": 3, "maxLength": 5},
        "abcd",
        "abcdefgh",
    ),
    ("string_pattern", {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "AB123", "ab123"),
    ("format_date", {"type": "string", "format": "date"}, "2026-11-27", "27/11/2026"),
    ("format_email", {"type": "string", "format": "email"}, "ada@example.com", "not an email"),
    (
        "integer_bounds",
        {"type": "integer", "minimum": 1, "maximum": 10},
        7,
        42,
    ),
    (
        "number_exclusive_bounds",
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        0.5,
        1.5,
    ),
    (
        "recursive_tree",
        {
            "$defs": {
                "Node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                    },
                    "required": ["value", "children"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/Node",
        },
        {"value": 1, "children": [{"value": 2, "children": []}]},
        {"value": 1, "children": [{"value": "two", "children": []}]},
    ),
    (
        "one_of",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"circle": {"type": "number"}},
                    "required": ["circle"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"square": {"type": "number"}},
                    "required": ["square"],
                    "additionalProperties": False,
                },
            ]
        },
        {"square": 2},
        {"triangle": 2},
    ),
    (
        "all_of",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        {"a": 1, "b": "x"},
        {"a": 1},
    ),
    (
        "additional_properties_schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"x": 1, "y": 2},
        {"x": "one"},
    ),
    (
        "type_list_nullable",
        {
            "type": "object",
            "properties": {"note": {"type": ["string", "null"]}},
            "required": ["note"],
        },
        {"note": None},
        {"note": 3},
    ),
    (
        "prefix_items_tuple",
        {
            "type": "array",
            "prefixItems": [{"type": "string"}, {"type": "integer"}],
            "items": False,
        },
        ["a", 1],
        [1, "a"],
    ),
    (
        "min_max_properties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        {"a": 1},
        {},
    ),
    ("any_json", {}, {"free": ["form", 1, None, {"x": True}]}, None),
    (
        "unique_items",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 2],
        [1, 1],
    ),
    (
        "if_then_else",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]},
        },
        {"a": 1, "b": "x"},
        {"a": 1},
    ),
]

TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL_TEXT = (
    '<tool_call>[{"name": "forecast", "arguments": {"city": "Paris", "days": 3}}]</tool_call>'
)


@dataclass
class Result:
    library: str
    setup_s: float = 0.0
    compile_ms: list[float] = field(default_factory=list)
    mask_ms: list[float] = field(default_factory=list)
    tool_mask_ms: list[float] = field(default_factory=list)
    coverage: dict[str, str] = field(default_factory=dict)


class Lib:
    """One library behind the same four operations."""

    name = ""

    def setup(self, tok: Any, vocab: int) -> None: ...

    def compile(self, schema: dict[str, Any]) -> Any: ...

    def compile_tool_wrapper(self) -> Any:
        return None

    def matcher(self, compiled: Any) -> Any: ...

    def fill(self, m: Any, mask: torch.Tensor) -> None: ...

    def accept(self, m: Any, token: int) -> bool: ...


class LLGuidance(Lib):
    name = "llguidance"

    def setup(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema,
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def compile_tool_wrapper(self) -> Any:
        schema = json.dumps(TOOL_SCHEMA)
        lark = (
            'start: "<tool_call>[{\\"name\\": \\"forecast\\", \\"arguments\\": " args "}]</tool_call>"\n'
            f"args: %json {schema}\n"
        )
        grammar = self.llg.LLMatcher.grammar_from_lark(lark)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.tok, compiled)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))


class XGrammar(Lib):
    name = "xgrammar"

    def setup(self, tok: Any, vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True
        )

    def compile_tool_wrapper(self) -> Any:
        tag = self.xgr.StructuralTagItem(
            begin='<tool_call>[{"name": "forecast", "arguments": ',
            schema=json.dumps(TOOL_SCHEMA),
            end="}]</tool_call>",
        )
        return self.compiler.compile_structural_tag([tag], ["<tool_call>"])

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(mask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))


class OutlinesCore(Lib):
    name = "outlines-core"

    def setup(self, tok: Any, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        b2u = _bytes_to_unicode()
        u2b = {v: k for k, v in b2u.items()}
        special = set(tok.all_special_ids)
        vocab_map: dict[bytes, list[int]] = {}
        for tid in range(len(tok)):
            if tid in special:
                continue
            text = tok.convert_ids_to_tokens(tid)
            try:
                raw = bytes(u2b[c] for c in text)
            except KeyError:
                raw = text.encode()
            vocab_map.setdefault(raw, []).append(tid)
        self.vocab = outlines_core.Vocabulary(tok.eos_token_id, vocab_map)

    def compile(self, schema: dict[str, Any]) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.write_mask_into(mask.data_ptr(), mask.numel(), 4)

    def accept(self, m: Any, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (how byte-level BPE vocabularies spell raw bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def _walk(lib: Lib, m: Any, ids: list[int], mask: torch.Tensor, times: list[float]) -> bool:
    """Feed ``ids`` one by one, timing the mask before each; False when one is refused."""
    for t in ids:
        t0 = time.perf_counter()
        lib.fill(m, mask)
        times.append((time.perf_counter() - t0) * 1e3)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1:
            return False
        if not lib.accept(m, t):
            return False
    return True


def _instance_ids(tok: Any, value: Any) -> list[int]:
    return tok.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)


def measure(lib: Lib, tok: Any, vocab: int) -> Result:
    res = Result(lib.name)
    t0 = time.perf_counter()
    lib.setup(tok, vocab)
    res.setup_s = time.perf_counter() - t0
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for name, schema, valid, invalid in SCHEMAS:
        try:
            t0 = time.perf_counter()
            compiled = lib.compile(schema)
            res.compile_ms.append((time.perf_counter() - t0) * 1e3)
            ok = _walk(lib, lib.matcher(compiled), _instance_ids(tok, valid), mask, res.mask_ms)
        except Exception as e:  # noqa: BLE001 - a refused schema is a coverage figure
            res.coverage[name] = f"refused: {type(e).__name__}: {str(e)[:80]}"
            continue
        if not ok:
            res.coverage[name] = "rejects a valid instance"
            continue
        if invalid is not None:
            bad = _walk(lib, lib.matcher(compiled), _instance_ids(tok, invalid), mask, [])
            if bad:
                # the whole invalid text went through: ignored unless it cannot end there
                res.coverage[name] = "ignores the keyword (accepts the invalid instance)"
                continue
        res.coverage[name] = "ok"
    try:
        compiled = lib.compile_tool_wrapper()
        if compiled is None:
            res.coverage["tool_call_wrapper"] = "cannot express"
        else:
            ids = tok.encode(TOOL_TEXT, add_special_tokens=False)
            ok = _walk(lib, lib.matcher(compiled), ids, mask, res.tool_mask_ms)
            res.coverage["tool_call_wrapper"] = "ok" if ok else "rejects a valid call"
    except Exception as e:  # noqa: BLE001
        res.coverage["tool_call_wrapper"] = f"refused: {type(e).__name__}: {str(e)[:80]}"
    return res


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (mask application)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(DEFAULT_MODEL)))
    vocab = len(tok)
    libs: list[Callable[[], Lib]] = [XGrammar, LLGuidance, OutlinesCore]
    summary: dict[str, Any] = {"vocab": vocab, "schemas": len(SCHEMAS)}
    for make in libs:
        lib = make()
        try:
            res = measure(lib, tok, vocab)
        except ImportError as e:
            print(f"{lib.name}: not installed ({e})")
            continue
        ok = sum(v == "ok" for k, v in res.coverage.items() if k != "tool_call_wrapper")
        silent = sum("ignores" in v for v in res.coverage.values())
        row = {
            "setup_s": round(res.setup_s, 3),
            "compile_ms_median": round(statistics.median(res.compile_ms), 2)
            if res.compile_ms
            else None,
            "compile_ms_max": round(max(res.compile_ms), 2) if res.compile_ms else None,
            "mask_ms_mean": round(statistics.fmean(res.mask_ms), 4),
            "mask_ms_p99": round(_p(res.mask_ms, 0.99), 4),
            "mask_ms_max": round(max(res.mask_ms), 4),
            "tool_wrapper_mask_ms_mean": round(statistics.fmean(res.tool_mask_ms), 4)
            if res.tool_mask_ms
            else None,
            "schemas_ok": ok,
            "schemas_silently_ignored": silent,
            "coverage": res.coverage,
        }
        summary[lib.name] = row
        print(f"\n== {lib.name}: {ok}/{len(SCHEMAS)} schemas honoured, {silent} silently ignored")
        for k, v in row.items():
            if k != "coverage":
                print(f"  {k}: {v}")
        for k, v in res.coverage.items():
            print(f"  {k:32s} {v}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
