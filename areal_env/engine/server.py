"""``areal-env serve``: the embedded ``LocalEngine`` behind SGLang's native HTTP protocol.

One engine client (``SGLangEngine``) then drives both real SGLang servers on GPUs and this
server on a CPU machine, so the whole multi-process topology (trainer, inference servers, proxy,
environment servers) runs anywhere.

Endpoints (SGLang's names and shapes): ``/generate`` (JSON or ``stream: true`` SSE),
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``,
``/update_weight_version``, ``/get_weight_version``, ``/abort_request``, ``/flush_cache``,
``/health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info``.

Extension: ``meta_info.output_token_versions`` gives the weight version of every output token
(SGLang itself reports one ``weight_version`` per answer).

A non-streaming ``/generate`` awaits the engine's whole result: there is no per-token work here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_env.http import routes
from areal_env.http.body import read_body, read_json
from areal_env.http.codec import dumps, json_response, loads
from areal_env.http.errors import HTTPError, install_error_handlers, openai_error_body
from areal_env.http.net import bind_socket
from areal_env.http.runner import serve_forever

logger = logging.getLogger(__name__)

# SGLang sampling params we honour, and those we accept only at their neutral value.
_NEUTRAL_PARAMS: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "n": 1,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
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
        )
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from e


def _error(status: int, message: str) -> Response:
    return json_response(openai_error_body(HTTPError(status, message)), status)


class ServeState:
    """Pause flag, in-flight requests and weight-version label of one server."""

    def __init__(self, engine: Any, *, model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or os.path.basename(str(engine.model_path).rstrip("/"))
        self.inflight: dict[str, asyncio.Future | None] = {}
        self.running = asyncio.Event()
        self.running.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.engine_paused = False
        self.version_label: str | None = None
        self.shutting_down = False
        self._eos = frozenset(getattr(engine, "eos_token_ids", []) or [])

    # -- versions
    def weight_version(self) -> str:
        if self.version_label is not None:
            return self.version_label
        return str(self.engine.get_version())

    def set_weight_version(self, label: str) -> None:
        try:
            self.engine.set_version(int(label))
            self.version_label = None
        except (TypeError, ValueError):
            self.version_label = str(label)

    # -- in-flight bookkeeping
    def _enter(self, rid: str) -> None:
        if rid in self.inflight:
            raise BadRequest(f"Duplicate request ID {rid!r}: a request with this rid is running")
        self.inflight[rid] = None
        self.idle.clear()

    def _leave(self, rid: str) -> None:
        self.inflight.pop(rid, None)
        if not self.inflight:
            self.idle.set()

    def abort_all(self) -> int:
        n = 0
        for rid in list(self.inflight):
            if self.engine.abort(rid):
                n += 1
        return n

    # -- answers
    def finish_reason(self, resp: ModelResponse, req: ModelRequest) -> dict[str, Any]:
        if resp.stop_reason == "length":
            return {"type": "length", "length": len(resp.output_tokens)}
        if resp.stop_reason == "abort":
            return {"type": "abort", "message": "Abort before generation finished (paused)."}
        matched: Any = None
        if resp.output_tokens:
            last = resp.output_tokens[-1]
            if last in self._eos or last in (req.gconfig.stop_token_ids or []):
                matched = last
            elif req.gconfig.stop:
                tail = self.engine.tokenizer.decode(
                    resp.output_tokens[-16:], skip_special_tokens=False
                )
                matched = next((s for s in req.gconfig.stop if s in tail), None)
        return {"type": "stop", "matched": matched}

    def answer(
        self,
        req: ModelRequest,
        resp: ModelResponse,
        *,
        return_logprob: bool,
        finished: bool = True,
        text: str | None = None,
    ) -> dict[str, Any]:
        ids = resp.output_tokens
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": self.finish_reason(resp, req) if finished else None,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version(),
            "e2e_latency": resp.latency,
            "output_token_versions": resp.output_versions,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(resp.output_logprobs, ids, strict=True)
            ]
            meta["input_token_logprobs"] = []
        if text is None:
            text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "output_ids": ids, "meta_info": meta}


def _vocab_size(engine: Any) -> int | None:
    tok = getattr(engine, "tokenizer", None)
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
        raise BadRequest(f"input_ids must be token ids in [0, {vocab})")


def _parse_generate(body: Any, engine: Any) -> tuple[list[ModelRequest], bool, bool, bool]:
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
    vocab = _vocab_size(engine)
    reqs = []
    for ids, p, rid in zip(input_ids, sps, rids, strict=True):
        _check_ids(ids, vocab)
        kwargs: dict[str, Any] = {
            "input_ids": list(ids),
            "gconfig": gconfig_from_sampling_params(p),
        }
        if rid:
            kwargs["rid"] = str(rid)
        reqs.append(ModelRequest(**kwargs))
    stream = bool(body.get("stream", False))
    if stream and batched:
        raise BadRequest("stream is supported for one prompt at a time")
    if body.get("top_logprobs_num"):
        raise BadRequest("top_logprobs_num is not supported by areal-env serve")
    return reqs, batched, bool(body.get("return_logprob", False)), stream


def create_app(engine: Any, *, model_name: str | None = None) -> FastAPI:
    """The FastAPI app around an initialized engine (LocalEngine or anything with its API)."""
    app = FastAPI(title="areal-env serve", openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    state = ServeState(engine, model_name=model_name)
    app.state.serve = state

    async def run_one(req: ModelRequest, return_logprob: bool) -> dict[str, Any]:
        await state.running.wait()
        state._enter(req.rid)
        try:
            resp = await engine.agenerate(req)  # submits synchronously: no pause race
        finally:
            state._leave(req.rid)
        return state.answer(req, resp, return_logprob=return_logprob)

    def failure(e: Exception) -> Response:
        if isinstance(e, PromptTooLongError):
            return _error(400, f"The input is too long: {e}")
        if isinstance(e, ValueError):
            return _error(400, str(e))
        if isinstance(e, EngineUnavailableError):
            return _error(503, str(e))
        logger.exception("generation failed")
        return _error(500, f"{type(e).__name__}: {e}")

    @app.api_route(routes.GENERATE, methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        raw = await read_body(request)
        try:
            body = loads(raw)
            reqs, batched, return_logprob, stream = _parse_generate(body, engine)
        except (ValueError, TypeError) as e:  # json errors are ValueErrors
            return _error(400, str(e))
        if stream:
            return await _stream(reqs[0], return_logprob)
        try:
            if batched:
                outs = await asyncio.gather(*(run_one(r, return_logprob) for r in reqs))
                return json_response(outs)
            return json_response(await run_one(reqs[0], return_logprob))
        except Exception as e:  # noqa: BLE001 - mapped to SGLang's error answers
            return failure(e)

    async def _stream(req: ModelRequest, return_logprob: bool) -> Response:
        await state.running.wait()
        try:
            state._enter(req.rid)
            agen = engine.agenerate_stream(req).__aiter__()
            first = await agen.__anext__()  # validation errors surface here, before the 200
        except Exception as e:  # noqa: BLE001
            state._leave(req.rid)
            return failure(e)

        def delta_event(resp: ModelResponse, sent: int, finished: bool) -> bytes:
            """Only the tokens after ``sent`` (like SGLang's --incremental-streaming-output);
            ``completion_tokens`` stays the running total, so clients know the offset."""
            out = state.answer(req, resp, return_logprob=return_logprob, finished=finished, text="")
            new_ids = out["output_ids"] = resp.output_tokens[sent:]
            meta = out["meta_info"]
            for key in ("output_token_logprobs", "output_token_versions"):
                if key in meta:
                    meta[key] = meta[key][sent:]
            out["text"] = engine.tokenizer.decode(new_ids, skip_special_tokens=True)
            return b"data: " + dumps(out) + b"\n\n"

        async def events():
            ids: list[int] = []
            lps: list[float] = []
            vers: list[int] = []
            sent = 0
            chunk = first
            try:
                while True:
                    if chunk.final is not None:
                        yield delta_event(chunk.final, sent, True)
                        break
                    ids += chunk.token_ids
                    lps += chunk.logprobs
                    vers += chunk.versions
                    partial = ModelResponse(
                        input_tokens=req.input_ids,
                        output_tokens=ids,
                        output_logprobs=lps,
                        output_versions=vers,
                    )
                    yield delta_event(partial, sent, False)
                    sent = len(ids)
                    chunk = await agen.__anext__()
            except Exception as e:  # noqa: BLE001 - SGLang reports stream errors in-band
                err = openai_error_body(HTTPError(500, str(e)))
                yield b"data: " + dumps(err) + b"\n\n"
            finally:
                state._leave(req.rid)
                await agen.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            data = await read_json(request, empty_ok=True)
        except HTTPError as e:
            raise BadRequest(e.message) from None
        return data if isinstance(data, dict) else {}

    @app.post(routes.PAUSE_GENERATION)
    async def pause_generation(request: Request) -> Response:
        try:
            mode = (await json_body(request)).get("mode", "abort")
        except BadRequest as e:
            return _error(400, str(e))
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"Invalid mode: {mode!r}. Expected one of abort, retract, in_place.")
        state.running.clear()
        if mode == "abort":
            n = state.abort_all()
            try:  # answer once the aborted requests have returned their partial output
                await asyncio.wait_for(state.idle.wait(), timeout=60)
            except TimeoutError:
                logger.warning("pause: %d requests still running after 60 s", len(state.inflight))
            logger.info("generation paused (%d in-flight requests aborted)", n)
        else:
            await asyncio.to_thread(engine.pause)
            state.engine_paused = True
            logger.info("generation paused in place")
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @app.post(routes.CONTINUE_GENERATION)
    async def continue_generation() -> Response:
        if state.engine_paused:
            engine.resume()
            state.engine_paused = False
        state.running.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    @app.post(routes.UPDATE_WEIGHTS_FROM_DISK)
    async def update_weights_from_disk(request: Request) -> Response:
        try:
            body = await json_body(request)
        except BadRequest as e:
            return json_response({"success": False, "message": str(e)}, 400)
        path = body.get("model_path")
        if not isinstance(path, str) or not path or not os.path.isdir(path):
            return json_response(
                {"success": False, "message": f"model_path {path!r} is not a model folder"},
                400,
            )
        if body.get("abort_all_requests"):
            state.abort_all()
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(engine.update_weights, path)
        except Exception as e:  # noqa: BLE001 - reported as SGLang does
            logger.exception("weight update from %s failed", path)
            return json_response(
                {"success": False, "message": f"Failed to update weights: {e}"}, 400
            )
        message = f"Succeeded to update model weights in {time.perf_counter() - t0:.2f} s."
        if body.get("weight_version") is not None:
            state.set_weight_version(str(body["weight_version"]))
            message += f" Weight version updated to {body['weight_version']}."
        return json_response({"success": True, "message": message, "num_paused_requests": 0})

    @app.post(routes.UPDATE_WEIGHT_VERSION)
    async def update_weight_version(request: Request) -> Response:
        try:
            body = await json_body(request)
        except BadRequest as e:
            return json_response({"success": False, "message": str(e)}, 400)
        if body.get("abort_all_requests"):
            state.abort_all()
        new = str(body.get("new_version", ""))
        state.set_weight_version(new)
        return json_response(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

    @app.get(routes.GET_WEIGHT_VERSION)
    async def get_weight_version() -> Response:
        return json_response({"weight_version": state.weight_version()})

    @app.post(routes.ABORT_REQUEST)
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        if body.get("abort_all"):
            state.abort_all()
        elif body.get("rid"):
            if not isinstance(body["rid"], str):
                return _error(400, "'rid' must be a string")
            engine.abort(body["rid"])
        return Response(status_code=200)

    @app.api_route(routes.FLUSH_CACHE, methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # The embedded engine keeps no prefix cache across requests: nothing to flush.
        return Response("Cache flushed.\n", status_code=200)

    @app.get(routes.HEALTH)
    async def health() -> Response:
        return Response(status_code=503 if state.shutting_down else 200)

    @app.get(routes.HEALTH_GENERATE)
    async def health_generate() -> Response:
        if state.shutting_down:
            return Response(status_code=503)
        if not state.running.is_set() or state.inflight:
            return Response(status_code=200)  # busy or paused: it is alive
        req = ModelRequest(input_ids=[0], gconfig=GenerationConfig(max_new_tokens=1, greedy=True))
        try:
            await asyncio.wait_for(engine.agenerate(req), timeout=20)
        except Exception:  # noqa: BLE001
            logger.exception("health_generate failed")
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get(routes.GET_MODEL_INFO)
    async def get_model_info() -> Response:
        return json_response(
            {
                "model_path": engine.model_path,
                "tokenizer_path": engine.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": state.weight_version(),
                "served_model_name": state.model_name,
                "max_context_len": getattr(engine, "max_context_len", None),
            }
        )

    @app.get(routes.GET_SERVER_INFO)
    async def get_server_info() -> Response:
        info: dict[str, Any] = {
            "model_path": engine.model_path,
            "served_model_name": state.model_name,
            "weight_version": state.weight_version(),
            "backend": "areal-env-local",
            "paused": not state.running.is_set(),
            "inflight": len(state.inflight),
        }
        stats = getattr(engine, "stats", None)
        if callable(stats):
            info["engine_stats"] = stats()
        return json_response(info)

    return app


# ---------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-env serve",
        description="Serve a model with the embedded engine over SGLang's HTTP protocol. With --experiment NAME --trial TRIAL (or --checkpoint PATH) it serves a trained checkpoint through the OpenAI/Anthropic API instead (see `areal-env serve --experiment X --help`).",
    )
    p.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="known model name or HF folder (default: smollm2-135m-instruct)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 = pick a free port")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-context-len", "--context-length", dest="max_context_len", type=int)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--weight-version",
        default="0",
        help="initial weight version (an integer keeps per-token versions numeric)",
    )
    p.add_argument("--cache-dir", default=None)
    # Accepted for command-line compatibility with `python -m sglang.launch_server`.
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    """``areal-env serve``: load the model, bind, print one readiness line, serve until killed."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    from areal_env.engine.local import LocalEngine
    from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

    # Unknown flags are SGLang's (a config written for sglang.launch_server): ignore, but say so.
    args, unknown = build_parser().parse_known_args(args_list)
    if unknown:
        logger.warning("ignoring options areal-env serve does not use: %s", " ".join(unknown))
    if args.tp_size != 1:
        logger.warning("--tp-size %d ignored: the embedded engine runs on one device", args.tp_size)
    try:
        sock = bind_socket(args.host, args.port, inheritable=True)
    except OSError as e:
        print(f"areal-env serve: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    path = resolve_model_path(args.model or DEFAULT_MODEL, args.cache_dir)
    engine = LocalEngine(
        str(path),
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_context_len=args.max_context_len,
        num_threads=args.num_threads,
    )
    engine.initialize()
    app = create_app(engine, model_name=args.served_model_name)
    app.state.serve.set_weight_version(args.weight_version)
    host, port = sock.getsockname()[:2]

    def announce() -> None:
        print(f"areal-env serve ready on http://{host}:{port} (model {path})", flush=True)

    try:
        serve_forever(
            app,
            sock,
            on_ready=announce,
            log_level=args.log_level.lower(),
            timeout_keep_alive=600,
        )
    finally:
        app.state.serve.shutting_down = True
        engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
