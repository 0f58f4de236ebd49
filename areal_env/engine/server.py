"""``areal-env serve``: the embedded ``LocalEngine`` behind SGLang's native HTTP protocol.

One engine client (``SGLangEngine``) then drives both real SGLang servers on GPUs and this
server on a CPU machine, so the whole multi-process topology (trainer, inference servers, proxy,
environment servers) runs anywhere.

Endpoints (SGLang's names and shapes): ``/generate`` (JSON or ``stream: true`` SSE),
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``,
``/update_weight_version``, ``/get_weight_version``, ``/abort_request``, ``/flush_cache``,
``/health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info``; with
``--enable-lora`` also ``/load_lora_adapter`` and ``/unload_lora_adapter`` (named adapters, each
request picks one with ``lora_path``; ``--lora-paths NAME=PATH`` loads some at start), served
unmerged in shared batches (``engine.adapters``).

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
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from areal_env.api.config import EngineConfig, ModelConfig
from areal_env.api.engine import EngineUnavailableError, InferenceEngine, PromptTooLongError
from areal_env.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_env.engine.adapters import AdapterHost
from areal_env.engine.sglang_wire import BadRequest, parse_generate
from areal_env.http import routes
from areal_env.http.body import read_body, read_json
from areal_env.http.codec import dumps, json_response, loads
from areal_env.http.errors import HTTPError, install_error_handlers, openai_error_body
from areal_env.http.net import bind_socket
from areal_env.http.runner import serve_forever

logger = logging.getLogger(__name__)


class ServableEngine(InferenceEngine, Protocol):
    """What ``areal-env serve`` needs beyond the engine protocol: aborting one request."""

    def abort(self, rid: str) -> bool: ...


def _error(status: int, message: str) -> Response:
    return json_response(openai_error_body(HTTPError(status, message)), status)


class ServeState:
    """Pause flag, in-flight requests and weight-version label of one server."""

    def __init__(
        self,
        engine: ServableEngine,
        *,
        model_name: str | None = None,
        adapters: AdapterHost | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        """The engine as an adapter host when LoRA serving is on (``--enable-lora``)."""
        self.adapter_paths: dict[str, str] = {}
        self.model_name = model_name or os.path.basename(str(engine.model_path).rstrip("/"))
        self.inflight: dict[str, asyncio.Future | None] = {}
        self.running = asyncio.Event()
        self.running.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.engine_paused = False
        self.version_label: str | None = None
        self.shutting_down = False
        self._eos = frozenset(engine.eos_token_ids)

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
            if resp.output_top_logprobs is not None:
                meta["output_top_logprobs"] = [
                    [[lp, t, None] for t, lp in entry] for entry in resp.output_top_logprobs
                ]
        if text is None:
            text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "output_ids": ids, "meta_info": meta}


def create_app(
    engine: ServableEngine,
    *,
    model_name: str | None = None,
    adapters: AdapterHost | None = None,
) -> FastAPI:
    """The FastAPI app around an initialized engine (LocalEngine or anything with its API).
    ``adapters``: the same engine as an adapter host, to serve named LoRA adapters (SGLang's
    ``--enable-lora``); ``None``: requests naming one are refused."""
    app = FastAPI(title="areal-env serve", openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    state = ServeState(engine, model_name=model_name, adapters=adapters)
    app.state.serve = state
    _generation_routes(app, state)
    _control_routes(app, state)
    _adapter_routes(app, state)
    _info_routes(app, state)
    return app


async def _run_one(state: ServeState, req: ModelRequest, return_logprob: bool) -> dict[str, Any]:
    """One request, held while generation is paused."""
    await state.running.wait()
    state._enter(req.rid)
    try:
        resp = await state.engine.agenerate(req)  # submits synchronously: no pause race
    finally:
        state._leave(req.rid)
    return state.answer(req, resp, return_logprob=return_logprob)


def _failure(e: Exception) -> Response:
    """An engine exception as SGLang answers it."""
    if isinstance(e, PromptTooLongError):
        return _error(400, f"The input is too long: {e}")
    if isinstance(e, ValueError):
        return _error(400, str(e))
    if isinstance(e, EngineUnavailableError):
        return _error(503, str(e))
    logger.exception("generation failed")
    return _error(500, f"{type(e).__name__}: {e}")


async def _stream(state: ServeState, req: ModelRequest, return_logprob: bool) -> Response:
    """A streamed ``/generate`` (SSE, deltas)."""
    engine = state.engine
    await state.running.wait()
    try:
        state._enter(req.rid)
        agen = engine.agenerate_stream(req).__aiter__()
        first = await agen.__anext__()  # validation errors surface here, before the 200
    except Exception as e:  # noqa: BLE001
        state._leave(req.rid)
        return _failure(e)

    def delta_event(resp: ModelResponse, sent: int, finished: bool) -> bytes:
        """Only the tokens after ``sent`` (like SGLang's --incremental-streaming-output);
        ``completion_tokens`` stays the running total, so clients know the offset."""
        out = state.answer(req, resp, return_logprob=return_logprob, finished=finished, text="")
        new_ids = out["output_ids"] = resp.output_tokens[sent:]
        meta = out["meta_info"]
        for key in ("output_token_logprobs", "output_token_versions", "output_top_logprobs"):
            if key in meta:
                meta[key] = meta[key][sent:]
        out["text"] = engine.tokenizer.decode(new_ids, skip_special_tokens=True)
        return b"data: " + dumps(out) + b"\n\n"

    async def events():
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        tops: list[list[tuple[int, float]]] | None = [] if req.gconfig.top_logprobs else None
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
                if tops is not None:
                    tops += chunk.top_logprobs or [[] for _ in chunk.token_ids]
                partial = ModelResponse(
                    input_tokens=req.input_ids,
                    output_tokens=ids,
                    output_logprobs=lps,
                    output_versions=vers,
                    output_top_logprobs=tops,
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


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        data = await read_json(request, empty_ok=True)
    except HTTPError as e:
        raise BadRequest(e.message) from None
    return data if isinstance(data, dict) else {}


async def _control_body(request: Request) -> tuple[dict[str, Any], Response | None]:
    """A weight-control body, or SGLang's ``{"success": false}`` 400 answer."""
    try:
        return await _json_body(request), None
    except BadRequest as e:
        return {}, json_response({"success": False, "message": str(e)}, 400)


def _generation_routes(app: FastAPI, state: ServeState) -> None:
    """``/generate`` (JSON, batched, or SSE)."""
    engine = state.engine

    @app.api_route(routes.GENERATE, methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        raw = await read_body(request)
        try:
            body = loads(raw)
            reqs, batched, return_logprob, stream = parse_generate(body, engine)
        except (ValueError, TypeError) as e:  # json errors are ValueErrors
            return _error(400, str(e))
        if state.adapters is None and any(r.adapter is not None for r in reqs):
            return _error(400, "LoRA serving is off: start the server with --enable-lora")
        if stream:
            return await _stream(state, reqs[0], return_logprob)
        try:
            if batched:
                outs = await asyncio.gather(*(_run_one(state, r, return_logprob) for r in reqs))
                return json_response(outs)
            return json_response(await _run_one(state, reqs[0], return_logprob))
        except Exception as e:  # noqa: BLE001 - mapped to SGLang's error answers
            return _failure(e)


def _control_routes(app: FastAPI, state: ServeState) -> None:
    """Pause/continue, weight updates and versions, aborts, cache flush."""
    engine = state.engine

    @app.post(routes.PAUSE_GENERATION)
    async def pause_generation(request: Request) -> Response:
        try:
            mode = (await _json_body(request)).get("mode", "abort")
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
        body, refused = await _control_body(request)
        if refused is not None:
            return refused
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
        body, refused = await _control_body(request)
        if refused is not None:
            return refused
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
        body = await _json_body(request)
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


def _adapter_routes(app: FastAPI, state: ServeState) -> None:
    """SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter`` (``LoRAUpdateOutput``
    answers: ``success``, ``error_message``, ``loaded_adapters``; 400 on failure)."""

    def answer(ok: bool, message: str | None = None) -> Response:
        return json_response(
            {
                "success": ok,
                "error_message": message,
                "loaded_adapters": dict(state.adapter_paths),
            },
            200 if ok else 400,
        )

    async def body_of(request: Request) -> dict[str, Any] | Response:
        if state.adapters is None:
            return answer(False, "LoRA serving is off: start the server with --enable-lora")
        body, refused = await _control_body(request)
        if refused is not None:
            return refused
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return answer(False, "'lora_name' must be a non-empty string")
        return body

    @app.post(routes.LOAD_LORA_ADAPTER)
    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        name, path = body["lora_name"], body.get("lora_path")
        if name in state.adapter_paths:
            return answer(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        if not isinstance(path, str) or not os.path.isdir(path):
            return answer(False, f"lora_path {path!r} is not an adapter folder")
        assert state.adapters is not None
        try:
            await asyncio.to_thread(state.adapters.load_adapter, name, path)
        except (ValueError, TypeError, OSError) as e:
            return answer(False, f"Failed to load LoRA adapter {name}: {e}")
        state.adapter_paths[name] = path
        return answer(True)

    @app.post(routes.UNLOAD_LORA_ADAPTER)
    async def unload_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        name = body["lora_name"]
        if name not in state.adapter_paths:
            return answer(False, f"LoRA adapter {name} is not loaded")
        assert state.adapters is not None
        await asyncio.to_thread(state.adapters.unload_adapter, name)
        del state.adapter_paths[name]
        return answer(True)


def _info_routes(app: FastAPI, state: ServeState) -> None:
    """Health and model/server info."""
    engine = state.engine

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
                "max_context_len": engine.max_context_len,
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
            "enable_lora": state.adapters is not None,
            "loaded_adapters": dict(state.adapter_paths),
        }
        info["engine_stats"] = engine.stats()
        return json_response(info)


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
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve named LoRA adapters (/load_lora_adapter; lora_path per request)",
    )
    p.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="adapters to load at start (implies --enable-lora)",
    )
    # SGLang's LoRA sizing flags: the embedded engine needs no pre-sized adapter memory.
    for flag in ("--max-lora-rank", "--max-loras-per-batch", "--max-loaded-loras"):
        p.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lora-target-modules", nargs="*", default=None, help=argparse.SUPPRESS)
    # Accepted for command-line compatibility with `python -m sglang.launch_server`.
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--log-level", default="info")
    return p


def _named_path(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` (or a bare PATH, named after its folder) of ``--lora-paths``."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = os.path.basename(spec.rstrip("/")), spec
    if not name or not os.path.isdir(path):
        raise ValueError(f"--lora-paths {spec!r}: expected NAME=PATH of an adapter folder")
    return name, path


def main(argv: list[str] | None = None) -> int:
    """``areal-env serve``: load the model, bind, print one readiness line, serve until killed."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    from areal_env.engine.local import LocalEngine
    from areal_env.engine.models import DEFAULT_MODEL

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
    model = ModelConfig(
        path=args.model or DEFAULT_MODEL,
        **{k: getattr(args, k) for k in ("device", "dtype", "cache_dir", "max_context_len")},
        num_threads=args.num_threads,
    )
    try:
        start_adapters = dict(_named_path(p) for p in args.lora_paths)
    except ValueError as e:
        print(f"areal-env serve: {e}", file=sys.stderr)
        return 2
    engine = LocalEngine.from_config(model, EngineConfig(max_batch_size=args.max_batch_size))
    path = engine.model_path
    engine.initialize()
    lora = args.enable_lora or bool(start_adapters)
    app = create_app(engine, model_name=args.served_model_name, adapters=engine if lora else None)
    app.state.serve.set_weight_version(args.weight_version)
    for name, folder in start_adapters.items():
        engine.load_adapter(name, folder)
        app.state.serve.adapter_paths[name] = folder
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
