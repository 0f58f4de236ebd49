"""``SGLangEngine``: an ``InferenceEngine`` that speaks SGLang's native HTTP protocol.

The same client drives real SGLang servers on GPU machines and ``areal-env serve`` (the embedded
engine behind the same protocol) on CPU machines, so the trainer never needs ``sglang`` itself.

The wire format (SGLang's ``/generate`` and control routes) is in :mod:`areal_env.engine.sglang_wire`;
routing (session affinity, failover) in :mod:`areal_env.engine.routing`; the server set the
engine owns (its router, and the HTTP to its servers: clients, retries, broadcasts, dropping dead
servers) in :mod:`areal_env.engine.sglang_servers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import httpx

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk
from areal_env.engine.adapters import AdapterEngine, AdapterError, AdapterWeights
from areal_env.engine.routing import normalize_address
from areal_env.engine.sglang_servers import RetryableHTTPError, ServerSet
from areal_env.engine.sglang_wire import (
    generate_payload,
    parse_generate_output,
    parse_version,
    stop_reason_of,
    stream_skip,
    token_versions,
    top_logprobs_of,
)
from areal_env.http import routes

logger = logging.getLogger(__name__)


class SGLangEngine:
    """HTTP client for one or more SGLang(-compatible) servers.

    New requests go to the least-loaded healthy server (fewest requests in flight; ties
    round-robin); a request whose ``metadata["session_id"]`` (or
    ``conversation_id``) or ``rid`` was seen before goes to the same server, so multi-turn agents
    reuse that server's prefix cache. Connection errors and 5xx answers are retried with
    exponential backoff; a server that stays down is reported by address as
    ``EngineUnavailableError`` and is skipped for new requests for ``down_cooldown`` seconds.
    """

    supports_state_dict_update = False
    """The trainer must save an HF folder and call ``update_weights(path)``."""
    supports_lora = False
    """True when the servers take a peft adapter folder on ``/update_weights_from_disk``
    (``areal-env serve`` does): the trainer then pushes only the adapter (merged there). Real
    SGLang servers serve adapters by name instead (``load_adapter``, one per policy of a
    multi-agent run): leave it False for them."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        request_timeout: float = 3600.0,
        connect_timeout: float = 10.0,
        control_timeout: float = 600.0,
        max_retries: int = 3,
        retry_backoff: float = 0.2,
        retry_max_wait: float = 5.0,
        startup_timeout: float = 300.0,
        down_cooldown: float = 30.0,
        max_abort_resubmits: int = 50,
        owned: Any = None,
        launch: Callable[[], Any] | None = None,
        model_path: str | None = None,
    ) -> None:
        if not addresses and launch is None:
            raise ValueError("SGLangEngine needs at least one server address (host:port)")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.servers = ServerSet(
            [normalize_address(a) for a in addresses],
            request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            control_timeout=control_timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
            retry_max_wait=retry_max_wait,
            down_cooldown=down_cooldown,
        )
        self.startup_timeout = startup_timeout
        self.down_cooldown = down_cooldown
        self.max_abort_resubmits = max_abort_resubmits
        self.model_path = model_path
        self.max_context_len: int | None = None
        """Prompt + completion limit reported by the servers (None until ``initialize()``)."""
        self.tokenizer = None  # servers tokenize; callers load their own from ``model_path``
        self.eos_token_ids: list[int] = []  # the servers stop on eos themselves
        self.owned = owned  # e.g. a launcher.ServerGroup: stopped by destroy()
        self._launch = launch  # called by initialize() when there is no server yet
        self._version = 0
        self._adapters: dict[str, str] = {}  # name -> the folder every server loaded it from
        self._resumed = threading.Event()
        self._resumed.set()
        self._destroyed = False

    @property
    def addresses(self) -> list[str]:
        """The servers in rotation (``host:port``)."""
        return self.servers.addresses

    @property
    def dropped(self) -> list[str]:
        """Servers taken out for good: they missed a weight update."""
        return self.servers.dropped

    # ------------------------------------------------------------------ lifecycle

    def initialize(self) -> None:
        """Launch servers if asked to, wait until every server answers ``/health``, and adopt
        their weight version when all report the same integer."""
        self._destroyed = False
        if self._launch is not None and self.owned is None:
            self.owned = self._launch()
            self.servers.addresses = [normalize_address(a) for a in self.owned.addresses]
        deadline = time.monotonic() + self.startup_timeout
        versions = []
        for addr in self.addresses:
            while True:
                try:
                    r = self.servers.client_sync().get(f"http://{addr}{routes.HEALTH}", timeout=5.0)
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineUnavailableError(
                        f"server {addr} not healthy after {self.startup_timeout:.0f} s"
                    )
                time.sleep(0.2)
            try:
                info = self.servers.client_sync().get(f"http://{addr}/get_model_info", timeout=10.0)
                if info.status_code == 200:
                    data = info.json()
                    versions.append(parse_version(data.get("weight_version")))
                    self.model_path = self.model_path or data.get("model_path")
                    if not self.max_context_len:
                        self.max_context_len = self._context_len(addr, data)
                else:
                    versions.append(None)
            except (httpx.TransportError, ValueError):
                versions.append(None)
        if versions and all(v is not None for v in versions) and len(set(versions)) == 1:
            self._version = versions[0]  # type: ignore[assignment]
        logger.info("SGLangEngine ready: %d server(s) %s", len(self.addresses), self.addresses)

    def _context_len(self, addr: str, model_info: dict) -> int | None:
        """``areal-env serve`` reports it in /get_model_info; SGLang in /v1/models."""
        value = model_info.get("max_context_len")
        if not value:
            try:
                models = (
                    self.servers.client_sync().get(f"http://{addr}/v1/models", timeout=10.0).json()
                )
                value = models["data"][0].get("max_model_len")
            except (httpx.TransportError, ValueError, KeyError, IndexError, TypeError):
                value = None
        return int(value) if value else None

    def destroy(self) -> None:
        """Close HTTP clients (on their own loops) and stop servers this engine launched."""
        self._destroyed = True
        self._resumed.set()
        self.servers.close()
        owned, self.owned = self.owned, None
        if owned is not None:
            owned.stop()

    def __enter__(self) -> SGLangEngine:
        self.initialize()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ------------------------------------------------------------------ routing

    def route(self, req: ModelRequest) -> tuple[str, bool]:
        """Pick the server for ``req``: (address, sticky). Sticky = seen this session/rid before."""
        return self.servers.router.route(req)

    # ------------------------------------------------------------------ generation

    async def _wait_resumed(self) -> None:
        while not self._resumed.is_set():
            if self._destroyed:
                raise EngineUnavailableError("SGLangEngine was destroyed")
            await asyncio.sleep(0.02)

    async def _post_generate(self, req: ModelRequest, payload: dict) -> tuple[str, dict]:
        """Send one /generate to the request's server, failing over only before it is bound."""
        addr, sticky = self.route(req)
        tried: set[str] = set()
        while True:
            try:
                with self.servers.router.in_flight(addr):
                    out = await self.servers.apost(addr, routes.GENERATE, payload)
                self.servers.router.mark_up(addr)
                return addr, out
            except EngineUnavailableError:
                self.servers.router.mark_down(addr)
                tried.add(addr)
                # A fresh request may move to another server; a sticky one names its server.
                if sticky or len(tried) >= len(self.addresses):
                    raise
                addr = self.servers.router.next_healthy(exclude=tried)
                if addr in tried:
                    raise
                logger.warning("failing over request %s to %s", req.rid, addr)
                self.servers.router.rebind(req, addr)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion; aborted segments (pause / weight update) are continued."""
        final: ModelResponse | None = None
        async for chunk in self._generate_segments(req, stream=False):
            final = chunk.final
        assert final is not None  # the segment loop always ends with the final chunk
        return final

    async def agenerate_stream(self, req: ModelRequest) -> AsyncGenerator[StreamChunk, None]:
        """Stream tokens via SGLang's SSE (``stream: true``), continuing aborted segments."""
        async with contextlib.aclosing(self._generate_segments(req, stream=True)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _generate_segments(
        self, req: ModelRequest, *, stream: bool
    ) -> AsyncGenerator[StreamChunk, None]:
        """The abort/resubmit loop shared by ``agenerate`` and ``agenerate_stream``.

        Each segment is one /generate (SSE when ``stream``); a segment aborted by a pause or a
        weight update is re-submitted with the tokens so far, after the pause. Yields a chunk
        per batch of new tokens, then one chunk with ``final`` set.
        """
        if self._destroyed:
            raise EngineUnavailableError("SGLangEngine was destroyed")
        req.gconfig.validate()
        start = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        tops: list[list[tuple[int, float]]] | None = [] if req.gconfig.top_logprobs else None
        ttft = 0.0
        stop_reason = "length"
        empty_aborts = 0
        n = 0
        while True:
            remaining = req.gconfig.max_new_tokens - len(tokens)
            if remaining <= 0:
                stop_reason = "length"
                break
            await self._wait_resumed()
            payload = generate_payload(req, tokens, remaining, n)
            n += 1
            seg_start = len(tokens)
            meta: dict = {}
            async for delta in self._segment_deltas(req, payload, stream):
                new_ids, new_lps, new_versions, meta = delta
                if not new_ids:
                    continue
                if not tokens:
                    ttft = time.perf_counter() - start
                tokens += new_ids
                logprobs += new_lps
                versions += new_versions
                new_tops = None
                if tops is not None:
                    # the event's entries end with the new tokens' (answers and cumulative
                    # events also cover the tokens before them)
                    have = top_logprobs_of(meta)
                    enough = len(have) >= len(new_ids)
                    new_tops = have[-len(new_ids) :] if enough else [[] for _ in new_ids]
                    tops += new_tops
                yield StreamChunk(
                    token_ids=new_ids,
                    logprobs=new_lps,
                    versions=new_versions,
                    top_logprobs=new_tops,
                )
            stop_reason = stop_reason_of(meta.get("finish_reason"))
            if stop_reason != "abort":
                break
            # Aborted (pause / weight update): continue from the tokens so far after the pause.
            empty_aborts = 0 if len(tokens) > seg_start else empty_aborts + 1
            if empty_aborts > self.max_abort_resubmits:
                logger.warning("request %s aborted %d times without progress", req.rid, n)
                break
            if self._resumed.is_set():
                await asyncio.sleep(min(0.05 * empty_aborts, 1.0))
        final = ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=stop_reason,  # type: ignore[arg-type]
            latency=time.perf_counter() - start,
            ttft=ttft,
            rid=req.rid,
            output_top_logprobs=tops,
        )
        yield StreamChunk(token_ids=[], logprobs=[], versions=[], final=final)

    async def _segment_deltas(
        self, req: ModelRequest, payload: dict, stream: bool
    ) -> AsyncIterator[tuple[list[int], list[float], list[int], dict]]:
        """One segment's new (ids, logprobs, versions, meta_info): a single answer, or the SSE
        events with the tokens already received (cumulative events) dropped."""
        if not stream:
            _, out = await self._post_generate(req, payload)
            ids, lps, meta = parse_generate_output(out)
            yield ids, lps, token_versions(self._version, meta, len(ids)), meta
            return
        payload["stream"] = True
        have = 0
        async for out in self._stream_segment(req, payload):
            seg_ids, seg_lps, meta = parse_generate_output(out)
            skip = stream_skip(have, len(seg_ids), meta)
            if skip < 0:
                raise EngineUnavailableError(f"stream for {req.rid} skipped tokens")
            new_versions = (
                token_versions(self._version, meta, len(seg_ids))[skip:]
                if len(seg_ids) > skip
                else []
            )
            new_ids = seg_ids[skip:]
            have += len(new_ids)
            yield new_ids, seg_lps[skip:], new_versions, meta

    async def _stream_segment(self, req: ModelRequest, payload: dict) -> AsyncIterator[dict]:
        """One SSE /generate. Opening the stream is retried (with failover for a fresh request);
        once events flow, a broken stream is an error (re-sending would duplicate work)."""
        addr, sticky = self.route(req)
        client = self.servers.client()
        tried: set[str] = set()
        while True:
            last: BaseException | None = None
            for i in range(self.servers.attempts):
                if i:
                    await asyncio.sleep(
                        min(self.servers.retry_backoff * 2**i, self.servers.retry_max_wait)
                    )
                try:
                    resp = await client.send(
                        client.build_request(
                            "POST", f"http://{addr}{routes.GENERATE}", json=payload
                        ),
                        stream=True,
                    )
                except httpx.TransportError as e:
                    last = e
                    continue
                if resp.status_code >= 500:
                    await resp.aread()
                    await resp.aclose()
                    last = RetryableHTTPError(resp.status_code, resp.text)
                    continue
                break
            else:
                self.servers.router.mark_down(addr)
                tried.add(addr)
                error = self.servers.unavailable(addr, last or RuntimeError("no answer"))
                if sticky or len(tried) >= len(self.addresses):
                    raise error
                nxt = self.servers.router.next_healthy(exclude=tried)
                if nxt in tried:
                    raise error
                addr = nxt
                self.servers.router.rebind(req, addr)
                continue
            break
        self.servers.router.mark_up(addr)
        counted = self.servers.router.in_flight(addr)
        counted.__enter__()
        try:
            if resp.status_code >= 400:
                await resp.aread()
                self.servers.check(resp, addr, routes.GENERATE)
            try:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        message = str(event["error"].get("message", event["error"]))
                        if "context length" in message or "too long" in message:
                            raise PromptTooLongError(message)
                        raise ValueError(f"server {addr}: {message}")
                    yield event
            except httpx.TransportError as e:
                raise EngineUnavailableError(f"server {addr} broke the stream: {e}") from None
        finally:
            counted.__exit__(None, None, None)
            await resp.aclose()

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        """Pause every server; in-flight requests are aborted and continued after ``resume()``."""
        self._resumed.clear()
        # pause/continue frame every weight update: a dead server is dropped here already
        self.servers.broadcast(routes.PAUSE_GENERATION, {"mode": "abort"}, drop_unreachable=True)

    def resume(self) -> None:
        """Continue every server; held requests proceed even if one server cannot be reached."""
        try:
            self.servers.broadcast(routes.CONTINUE_GENERATION, {}, drop_unreachable=True)
        finally:
            self._resumed.set()

    def update_weights(self, weights: dict[str, Any] | str | os.PathLike[str]) -> None:
        """Load an HF folder on every server (``/update_weights_from_disk``), then bump the version.

        In-flight requests are aborted by the pause and continued on the new weights, so their
        per-token versions show the switch.
        """
        if not isinstance(weights, (str, os.PathLike)):
            raise TypeError(
                "SGLangEngine.update_weights takes a path to a saved HF model folder: SGLang "
                "servers load weights from disk (supports_state_dict_update is False). Save the "
                "state dict with model.save_pretrained(dir) and pass dir."
            )
        path = os.fspath(weights)
        new_version = self._version + 1
        was_paused = not self._resumed.is_set()
        if not was_paused:
            self.pause()
        try:
            results = self.servers.broadcast(
                routes.UPDATE_WEIGHTS_FROM_DISK,
                {"model_path": path, "weight_version": str(new_version), "flush_cache": True},
                drop_unreachable=True,
            )
            for addr, res in zip(self.addresses, results, strict=True):
                if isinstance(res, dict) and res.get("success") is False:
                    raise RuntimeError(f"server {addr} failed to load {path}: {res.get('message')}")
            self._version = new_version
            logger.info("weights from %s loaded on %d server(s)", path, len(self.addresses))
        finally:
            if not was_paused:
                try:
                    self.resume()
                except EngineUnavailableError:
                    if sys.exc_info()[0] is None:
                        raise
                    logger.exception("resume after the weight update failed")

    # ------------------------------------------------------------------ named LoRA adapters

    @property
    def adapter_names(self) -> list[str]:
        return sorted(self._adapters)

    def adapter(self, name: str) -> AdapterEngine:
        """Adapter ``name`` as an ``InferenceEngine`` of its own (its requests carry
        ``lora_path``; its ``update_weights`` replaces the adapter on every server)."""
        return AdapterEngine(self, name)

    def check_lora_serving(self) -> None:
        """``AdapterError`` naming every server that was not started with LoRA serving on
        (SGLang's ``--enable-lora``: its ``/get_server_info`` reports ``enable_lora``)."""
        off = []
        for addr in self.addresses:
            try:
                info = self.servers.client_sync().get(f"http://{addr}{routes.GET_SERVER_INFO}")
                enabled = bool(info.json().get("enable_lora")) if info.is_success else False
            except (httpx.TransportError, ValueError, AttributeError):
                enabled = False
            if not enabled:
                off.append(addr)
        if off:
            raise AdapterError(
                f"inference server(s) {', '.join(off)} do not serve LoRA adapters: start them "
                "with --enable-lora --max-lora-rank R --lora-target-modules M... (engine."
                "backend=sglang launches them so for adapter policies), or give the policies "
                "models of their own"
            )

    def load_adapter(self, name: str, weights: AdapterWeights | str | os.PathLike[str]) -> None:
        """Load (or replace) adapter ``name`` on every server from a peft adapter folder they
        can read (``/load_lora_adapter``; a loaded name is unloaded first, since SGLang refuses
        to load a name twice). Generation is paused meanwhile: requests of the adapter are
        aborted and continued on the new weights, as for a full weight update; the weight
        version is the caller's to move."""
        if not isinstance(weights, (str, os.PathLike)):
            raise TypeError(
                "SGLang servers load adapters from disk: pass the adapter folder "
                "(adapter_config.json + adapter_model.safetensors)"
            )
        path = os.fspath(weights)
        was_paused = not self._resumed.is_set()
        if not was_paused:
            self.pause()
        try:
            if name in self._adapters:
                try:
                    self.servers.broadcast(
                        routes.UNLOAD_LORA_ADAPTER, {"lora_name": name}, drop_unreachable=True
                    )
                except ValueError as e:  # e.g. a restarted server that never had it
                    logger.info("unloading adapter %r before its new version: %s", name, e)
            results = self.servers.broadcast(
                routes.LOAD_LORA_ADAPTER,
                {"lora_name": name, "lora_path": path},
                drop_unreachable=True,
            )
            for addr, res in zip(self.addresses, results, strict=True):
                if isinstance(res, dict) and res.get("success") is False:
                    raise RuntimeError(
                        f"server {addr} failed to load adapter {name!r} from {path}: "
                        f"{res.get('error_message') or res.get('message')}"
                    )
            self._adapters[name] = path
            logger.info("adapter %r from %s loaded on %d server(s)", name, path, len(results))
        finally:
            if not was_paused:
                self.resume()

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded")
        self.servers.broadcast(routes.UNLOAD_LORA_ADAPTER, {"lora_name": name})
        del self._adapters[name]

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Set our version and every server's ``weight_version`` (tokens report it)."""
        self.servers.broadcast(routes.UPDATE_WEIGHT_VERSION, {"new_version": str(int(version))})
        self._version = int(version)

    def stats(self) -> dict[str, float]:
        """Server counts (per-server engine stats live behind ``/get_server_info``)."""
        return {
            "servers": float(len(self.addresses)),
            "servers_up": float(self.servers.router.up()),
            "servers_dropped": float(len(self.dropped)),
        }

    def health(self) -> dict[str, bool]:
        """``{address: healthy}`` from one ``GET /health`` each (no retries)."""
        out = {}
        for addr in self.addresses:
            try:
                out[addr] = (
                    self.servers.client_sync()
                    .get(f"http://{addr}{routes.HEALTH}", timeout=5)
                    .is_success
                )
            except httpx.TransportError:
                out[addr] = False
        return out
