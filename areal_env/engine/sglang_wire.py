"""SGLang's native ``/generate`` wire format, both directions.

The client side (``SGLangEngine``) turns a ``GenerationConfig`` into ``sampling_params`` and
reads answers back; the server side (``areal-env serve``) parses requests into
``ModelRequest``s. Keeping both here keeps them in step.

Protocol used (SGLang's ``http_server.py``):

- ``POST /generate`` ``{"input_ids", "sampling_params", "return_logprob": true, "rid", "stream"}``
  → ``{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
  "output_token_logprobs": [[logprob, token_id, text|null], ...], "weight_version", ...}}``.
  ``meta_info.output_token_versions`` (one int per output token) is an ``areal-env serve``
  extension; without it every token gets the server's ``weight_version`` (or ours).
- ``POST /pause_generation`` ``{"mode": "abort"}`` / ``POST /continue_generation``: in-flight
  requests come back with ``finish_reason.type == "abort"`` and the tokens produced so far; we
  re-submit prompt + those tokens after the pause, so no completion is lost.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"}`` → ``{"success", "message"}``.
- ``POST /update_weight_version``, ``GET /health``, ``GET /get_model_info``.
- LoRA adapters (servers started with ``--enable-lora``): ``POST /load_lora_adapter``
  ``{"lora_name", "lora_path"}`` and ``POST /unload_lora_adapter`` ``{"lora_name"}`` →
  ``{"success", "error_message", "loaded_adapters"}`` (400 on failure; a name already loaded is
  refused, so a new version is unloaded first); a ``/generate`` body's ``lora_path`` names the
  loaded adapter that answers it.
"""

from __future__ import annotations

from typing import Any

from areal_env.api.engine import InferenceEngine
from areal_env.api.io import Constraint, ConstraintKind, GenerationConfig, ModelRequest

# GenerationConfig.constraint kinds <-> SGLang's structured-output sampling params. A ``grammar``
# (llguidance's Lark dialect) goes as ``ebnf`` prefixed with ``%llguidance {}``, the marker SGLang
# needs to hand it to llguidance: the SGLang server must run with ``--grammar-backend llguidance``.
_CONSTRAINT_PARAMS: dict[ConstraintKind, str] = {
    "json_schema": "json_schema",
    "regex": "regex",
    "grammar": "ebnf",
}
_LLGUIDANCE_MARK = "%llguidance {}"

# SGLang sampling params we honour, and those we accept only at their neutral value.
_NEUTRAL_PARAMS: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "n": 1,
    "structural_tag": None,
    "logit_bias": None,
    "stop_regex": None,
}
_IGNORED_PARAMS = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "custom_params",
}


class BadRequest(ValueError):
    """The request is malformed: answered with HTTP 400 in SGLang's error shape."""


def gconfig_from_sampling_params(sp: dict[str, Any] | None) -> GenerationConfig:
    """SGLang ``sampling_params`` → ``GenerationConfig`` (SGLang defaults; ``top_k=-1`` is off)."""
    sp = dict(sp or {})
    for key, neutral in _NEUTRAL_PARAMS.items():
        if key in sp:
            value = sp.pop(key)
            if value is not None and value != neutral:
                raise BadRequest(
                    f"sampling param {key}={value!r} is not supported by areal-env serve"
                )
    for key in _IGNORED_PARAMS:
        sp.pop(key, None)
    known = {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "sampling_seed",
        "json_schema",
        "regex",
        "ebnf",
    }
    unknown = sorted(set(sp) - known)
    if unknown:
        raise BadRequest(f"unknown sampling param(s) {unknown}")
    top_k = sp.get("top_k", -1)
    if top_k is None or top_k == -1:
        top_k = 0
    stop = sp.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    temperature = sp.get("temperature", 1.0)
    constraints = [
        Constraint(kind, sp[param])
        for kind, param in _CONSTRAINT_PARAMS.items()
        if sp.get(param) is not None
    ]
    if len(constraints) > 1:
        raise BadRequest("only one of json_schema, regex and ebnf may be given")
    try:
        return GenerationConfig(
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=float(temperature if temperature is not None else 1.0),
            top_p=float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0),
            top_k=int(top_k),
            greedy=temperature == 0,
            stop=stop or None,
            stop_token_ids=list(sp["stop_token_ids"]) if sp.get("stop_token_ids") else None,
            ignore_eos=bool(sp.get("ignore_eos", False)),
            seed=int(sp["sampling_seed"]) if sp.get("sampling_seed") is not None else None,
            constraint=constraints[0] if constraints else None,
        )
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from e


def sampling_params_from_gconfig(g: GenerationConfig, max_new_tokens: int | None = None) -> dict:
    """Our ``GenerationConfig`` → SGLang ``sampling_params`` (``top_k`` off is -1 there)."""
    params: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens if max_new_tokens is not None else g.max_new_tokens),
        "temperature": 0.0 if g.is_greedy else float(g.temperature),
        "top_p": float(g.top_p),
        "top_k": int(g.top_k) if g.top_k > 0 else -1,
        "ignore_eos": bool(g.ignore_eos),
        # Keep the stop text in `text`: the proxy re-parses output ids, never trimmed text.
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if g.stop:
        params["stop"] = list(g.stop)
    if g.stop_token_ids:
        params["stop_token_ids"] = list(g.stop_token_ids)
    if g.seed is not None:
        params["sampling_seed"] = int(g.seed)
    c = g.constraint
    if c is not None:
        value = c.value
        if c.kind == "grammar" and not value.lstrip().startswith(_LLGUIDANCE_MARK):
            value = f"{_LLGUIDANCE_MARK}\n{value}"
        params[_CONSTRAINT_PARAMS[c.kind]] = value
    return params


def generate_payload(req: ModelRequest, prefix: list[int], remaining: int, n: int) -> dict:
    """The ``/generate`` body for segment ``n`` of ``req`` (prompt + ``prefix`` already made,
    ``remaining`` tokens left)."""
    payload = {
        "input_ids": list(req.input_ids) + prefix,
        "sampling_params": sampling_params_from_gconfig(req.gconfig, remaining),
        "return_logprob": True,
        "stream": False,
        # SGLang refuses a rid that is still in flight; a re-submission gets its own.
        "rid": req.rid if n == 0 else f"{req.rid}-r{n}",
    }
    if req.gconfig.top_logprobs:
        payload["top_logprobs_num"] = int(req.gconfig.top_logprobs)
    if req.adapter is not None:
        payload["lora_path"] = req.adapter  # the name of a loaded adapter (/load_lora_adapter)
    return payload


def token_versions(default: int, meta: dict, n_tokens: int) -> list[int]:
    """The weight version of each output token: ``output_token_versions`` (``areal-env serve``),
    else the answer's ``weight_version``, else ``default``."""
    versions = meta.get("output_token_versions")
    if isinstance(versions, list) and len(versions) == n_tokens:
        return [int(v) for v in versions]
    v = parse_version(meta.get("weight_version"))
    return [default if v is None else v] * n_tokens


def parse_version(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def stop_reason_of(finish_reason: Any) -> str:
    """SGLang ``finish_reason`` (dict, or None while streaming) → our stop reason."""
    if isinstance(finish_reason, dict):
        kind = finish_reason.get("type")
    else:
        kind = finish_reason
    if kind in ("stop", "length", "abort"):
        return kind
    return "stop"


def stream_skip(have: int, n_ids: int, meta: dict) -> int:
    """How many of an SSE event's ``n_ids`` output ids we already hold (``have`` so far).

    Events are cumulative (SGLang's default) or deltas (``--incremental-streaming-output``, and
    ``areal-env serve``); ``completion_tokens`` (the running total) tells where the ids start.
    A negative answer means tokens were skipped.
    """
    total = int(meta.get("completion_tokens") or n_ids)
    return have - max(0, total - n_ids)


def top_logprobs_of(meta: dict) -> list[list[tuple[int, float]]]:
    """``meta_info.output_top_logprobs`` (per token ``[[logprob, id, text], ...]``) as
    ``(id, logprob)`` pairs, one list per token it covers (empty when absent)."""
    tops = meta.get("output_top_logprobs")
    if not isinstance(tops, list):
        return []
    return [
        [(int(e[1]), float(e[0])) for e in entry if e and e[0] is not None]
        for entry in tops
        if isinstance(entry, list)
    ]


def parse_generate_output(out: Any) -> tuple[list[int], list[float], dict]:
    """``/generate`` answer → (output ids, their logprobs, meta_info)."""
    if isinstance(out, list):  # a batch answer; we always send one prompt
        out = out[0]
    if not isinstance(out, dict) or "meta_info" not in out:
        raise ValueError(f"unexpected /generate answer: {str(out)[:300]}")
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    logprobs = [float(e[0]) if e[0] is not None else 0.0 for e in entries]
    ids = out.get("output_ids")
    if ids is None:
        ids = [int(e[1]) for e in entries]
    ids = [int(t) for t in ids]
    if len(logprobs) != len(ids):
        raise ValueError(
            f"/generate returned {len(ids)} output ids but {len(logprobs)} logprobs "
            "(was return_logprob honoured?)"
        )
    return ids, logprobs, meta


def _vocab_size(engine: InferenceEngine) -> int | None:
    tok = engine.tokenizer
    try:
        return len(tok) if tok is not None else None
    except TypeError:
        return None


def _check_ids(ids: Any, vocab: int | None) -> None:
    """Token ids must be a list of ints in ``[0, vocab)``: anything else is a 400, not an index
    error deep in the model."""
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise BadRequest("input_ids must be a list of integers (or a list of such lists)")
    if ids and (min(ids) < 0 or (vocab is not None and max(ids) >= vocab)):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise BadRequest(
            f"input_ids must be token ids in [0, {vocab}): {bad} is outside the vocabulary"
        )


def _lora_paths(value: Any, n: int, batched: bool) -> list[str | None]:
    """``lora_path`` of a ``/generate`` body, one per prompt: a loaded adapter's name (or a
    list of them, one per prompt of a batch); ``None``/absent = the base model."""
    if value is None:
        return [None] * n
    if isinstance(value, str):
        return [value or None] * n
    if batched and isinstance(value, list) and len(value) == n:
        if all(v is None or isinstance(v, str) for v in value):
            return [v or None for v in value]
    raise BadRequest("lora_path must be an adapter name (or, batched, one name or null per prompt)")


def parse_generate(
    body: Any, engine: InferenceEngine
) -> tuple[list[ModelRequest], bool, bool, bool]:
    """Body of ``/generate`` → (requests, batched, return_logprob, stream)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    input_ids = body.get("input_ids")
    text = body.get("text")
    if input_ids is None and text is None:
        raise BadRequest("Either text or input_ids should be provided.")
    if input_ids is None:
        if not isinstance(text, str) and not (
            isinstance(text, list) and all(isinstance(t, str) for t in text)
        ):
            raise BadRequest("text must be a string or a list of strings")
        texts = [text] if isinstance(text, str) else list(text)
        input_ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        batched = not isinstance(text, str)
    else:
        if not isinstance(input_ids, list):
            raise BadRequest("input_ids must be a list of integers (or a list of such lists)")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        if not batched:
            input_ids = [input_ids]
    sp = body.get("sampling_params") or {}
    rids = body.get("rid")
    if batched:
        sps = sp if isinstance(sp, list) else [sp] * len(input_ids)
        rids = rids if isinstance(rids, list) else [None] * len(input_ids)
        if len(sps) != len(input_ids) or len(rids) != len(input_ids):
            raise BadRequest("batched sampling_params / rid must match the number of prompts")
    else:
        sps, rids = [sp], [rids]
    loras = _lora_paths(body.get("lora_path"), len(input_ids), batched)
    vocab = _vocab_size(engine)
    reqs = []
    for ids, p, rid, lora in zip(input_ids, sps, rids, loras, strict=True):
        _check_ids(ids, vocab)
        kwargs: dict[str, Any] = {
            "input_ids": list(ids),
            "gconfig": gconfig_from_sampling_params(p),
            "adapter": lora,
        }
        if rid:
            kwargs["rid"] = str(rid)
        reqs.append(ModelRequest(**kwargs))
    stream = bool(body.get("stream", False))
    if stream and batched:
        raise BadRequest("stream is supported for one prompt at a time")
    top = body.get("top_logprobs_num") or 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise BadRequest("top_logprobs_num must be an integer in [0, 20]")
    if top:
        for r in reqs:
            r.gconfig = r.gconfig.new(top_logprobs=top)
    return reqs, batched, bool(body.get("return_logprob", False)), stream
