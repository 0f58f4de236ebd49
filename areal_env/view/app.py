"""The viewer's web app: a JSON API over the run folders and the page that draws it.

Read-only (GET only) and local: it binds 127.0.0.1 unless told otherwise, and then it wants a
key (``?key=`` once in the browser, then a cookie; or ``Authorization: Bearer``). Without a key
it answers only requests addressed to a loopback host name, so a web page the browser visits
cannot reach it through DNS rebinding. The page is plain files shipped in the package
(``static/``: Preact + htm for the page, uPlot for the charts), nothing fetched from the
internet.

Lists are paged (``offset``/``limit``): a step of 10,000 sessions sends the 100 on screen.
Handlers are plain functions: FastAPI runs them on its thread pool, so file reads never block
the event loop.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from areal_env.http.body import request_key
from areal_env.http.codec import json_response
from areal_env.http.errors import HTTPError, error_response, install_error_handlers
from areal_env.http.net import is_loopback
from areal_env.view.catalog import Catalog
from areal_env.view.evals import FILTERS, compare
from areal_env.view.run import RunIndex, SessionInfo, StepInfo
from areal_env.view.tokens import row_payload
from areal_env.view.tree import build_tree, rows_through

STATIC = Path(__file__).parent / "static"
KEY_COOKIE = "areal_view_key"
MAX_LIMIT = 500
STEP_METRICS = (
    "reward/mean",
    "actor/clip_frac",
    "actor/approx_kl",
    "actor/entropy",
    "actor/update_skipped",
    "eval/success_rate",
)
"""Metrics shown beside each step in the step list."""


def _int(request: Request, name: str, default: int | None = None, lo: int = 0) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        if default is None:
            raise HTTPError(400, f"query parameter {name!r} is required", param=name)
        return default
    try:
        value = int(raw)
    except ValueError:
        raise HTTPError(400, f"{name}={raw!r} is not an integer", param=name) from None
    if value < lo:
        raise HTTPError(400, f"{name}={value} must be >= {lo}", param=name)
    return value


def _page(request: Request, default: int = 100) -> tuple[int, int]:
    return _int(request, "offset", 0), min(_int(request, "limit", default, lo=1), MAX_LIMIT)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class ViewerApp:
    """The routes over a :class:`Catalog`; ``key``: required on every request when set."""

    def __init__(self, catalog: Catalog, *, key: str | None = None) -> None:
        self.catalog = catalog
        self.key = key
        html = (STATIC / "index.html").read_text()
        self.index_html = html
        self.csp = _content_security_policy(html)

    # ---- lookups -----------------------------------------------------------------------------

    def run(self, request: Request) -> RunIndex:
        run_id = request.query_params.get("run") or "."
        run = self.catalog.run(run_id)
        if run is None:
            raise HTTPError(404, f"no run {run_id!r} under {self.catalog.root}", param="run")
        return run

    @staticmethod
    def step(run: RunIndex, step: int) -> StepInfo:
        info = run.steps.get(step)
        if info is None:
            if any(m.get("step") == step for m in run.metrics):
                return StepInfo(step)  # trained, but its episodes were not dumped
            raise HTTPError(404, f"run {run.id!r} has no step {step}", param="step")
        return info

    @staticmethod
    def session(run: RunIndex, session_id: str) -> SessionInfo:
        info = run.sessions.get(session_id)
        if info is None:
            raise HTTPError(404, f"run {run.id!r} has no session {session_id!r}", param="id")
        return info

    # ---- routes ------------------------------------------------------------------------------

    def runs(self, request: Request) -> Response:
        items = []
        for rid in self.catalog.ids():
            run = self.catalog.run(rid)
            if run is not None:
                items.append({"id": rid, "path": str(run.path), **run.status()})
        return json_response({"root": str(self.catalog.root), "runs": items})

    def overview(self, request: Request) -> Response:
        run = self.run(request)
        keys: list[str] = []
        for m in run.metrics:
            keys += [k for k, v in m.items() if k not in keys and _numeric(v)]
        parts = [p for s in run.tokens.steps() for p in run.tokens.parts_of(s)]
        return json_response(
            {
                "id": run.id,
                "path": str(run.path),
                "status": run.status(),
                "config": run.config_text(),
                "checkpoints": run.checkpoints(),
                "warnings": run.warnings(),
                "metric_keys": keys,
                "evals": run.evals,
                "steps": len(self._step_numbers(run)),
                "sessions": len(run.sessions),
                "token_record": {
                    "steps": len(run.tokens.steps()),
                    "bytes": sum(int(p.index.get("bytes") or 0) for p in parts),
                    "rows": sum(int(p.index.get("rows") or 0) for p in parts),
                },
            }
        )

    def metrics(self, request: Request) -> Response:
        run = self.run(request)
        since = _int(request, "since", -1, lo=-1)
        return json_response({"records": [m for m in run.metrics if m.get("step", 0) > since]})

    @staticmethod
    def _step_numbers(run: RunIndex) -> list[int]:
        return sorted(set(run.steps) | {int(m["step"]) for m in run.metrics if "step" in m})

    def _step_item(self, run: RunIndex, step: int, by_step: dict[int, dict]) -> dict[str, Any]:
        info = run.steps.get(step) or StepInfo(step)
        sess = [run.sessions[s] for s in info.sessions]
        rewards = [s.reward for s in sess if s.reward is not None and s.accepted]
        zero_var = 0
        for members in info.groups.values():
            rs = [run.sessions[m].reward for m in members if run.sessions[m].accepted]
            if len(rs) > 1 and len({r for r in rs}) == 1:
                zero_var += 1
        record = by_step.get(step, {})
        return {
            "step": step,
            "versions": sorted(info.versions),
            "sessions": len(sess),
            "accepted": sum(1 for s in sess if s.accepted),
            "rejected": sum(1 for s in sess if s.accepted is False),
            "groups": len(info.groups),
            "zero_variance_groups": zero_var,
            "reward_mean": _mean([r for r in rewards if r is not None]),
            "token_parts": len(run.tokens.parts_of(step)),
            "metrics": {k: record.get(k) for k in STEP_METRICS if k in record},
        }

    def steps(self, request: Request) -> Response:
        run = self.run(request)
        offset, limit = _page(request, 50)
        numbers = self._step_numbers(run)
        if request.query_params.get("order", "desc") != "asc":
            numbers.reverse()
        by_step = {int(m["step"]): m for m in run.metrics if "step" in m}
        page = numbers[offset : offset + limit]
        return json_response(
            {
                "total": len(numbers),
                "offset": offset,
                "items": [self._step_item(run, s, by_step) for s in page],
            }
        )

    def step_detail(self, request: Request) -> Response:
        run = self.run(request)
        step = _int(request, "step")
        self.step(run, step)
        by_step = {int(m["step"]): m for m in run.metrics if "step" in m}
        parts = [
            {
                "stem": p.stem,
                "part": p.part,
                **{
                    k: p.index.get(k)
                    for k in (
                        "version",
                        "rows",
                        "tokens",
                        "trained_tokens",
                        "bytes",
                        "ratio_against",
                        "eps_clip",
                        "eps_clip_high",
                    )
                },
            }
            for p in run.tokens.parts_of(step)
        ]
        return json_response(
            {
                **self._step_item(run, step, by_step),
                "record": by_step.get(step),
                "token_record": parts,
            }
        )

    def groups(self, request: Request) -> Response:
        run = self.run(request)
        info = self.step(run, _int(request, "step"))
        offset, limit = _page(request)
        names = info.ordered(run.sessions)[1]
        items = []
        for g in names[offset : offset + limit]:
            members = [run.sessions[s] for s in info.groups[g]]
            rs = [m.reward for m in members if m.reward is not None and m.accepted]
            items.append(
                {
                    "group": g,
                    "task_id": members[0].task_id,
                    "sessions": len(members),
                    "accepted": sum(1 for m in members if m.accepted),
                    "reward_mean": _mean([r for r in rs if r is not None]),
                    "reward_std": statistics.pstdev(rs) if len(rs) > 1 else None,
                    "zero_variance": len(rs) > 1 and len(set(rs)) == 1,
                }
            )
        return json_response({"total": len(names), "offset": offset, "items": items})

    def sessions(self, request: Request) -> Response:
        run = self.run(request)
        info = self.step(run, _int(request, "step"))
        offset, limit = _page(request)
        q = request.query_params
        ordered = info.ordered(run.sessions)[0]
        if q.get("group"):
            members = set(info.groups.get(q["group"], []))
            ordered = [s for s in ordered if s in members]
        sess = [run.sessions[s] for s in ordered]
        status = q.get("status", "all")
        if status == "accepted":
            sess = [s for s in sess if s.accepted]
        elif status == "rejected":
            sess = [s for s in sess if s.accepted is False]
        elif status == "failed_tool_calls":
            sess = [s for s in sess if s.failed_tool_calls]
        elif status != "all":
            raise HTTPError(
                400,
                f"status={status!r}: one of all, accepted, rejected, failed_tool_calls",
                param="status",
            )
        if q.get("q"):
            needle = q["q"].lower()
            sess = [s for s in sess if needle in s.task_id.lower() or needle in s.session_id]
        sort = q.get("sort", "order")
        if sort in ("reward", "-reward"):
            missing = -math.inf if sort == "-reward" else math.inf
            sess.sort(
                key=lambda s: s.reward if s.reward is not None else missing,
                reverse=sort == "-reward",
            )
        elif sort == "-tokens":
            sess.sort(key=lambda s: s.output_tokens, reverse=True)
        elif sort != "order":
            raise HTTPError(
                400, f"sort={sort!r}: one of order, reward, -reward, -tokens", param="sort"
            )
        with_tokens = run.tokens.sessions_with_tokens(info.step)
        items = [
            {**s.summary(), "has_tokens": s.session_id in with_tokens}
            for s in sess[offset : offset + limit]
        ]
        return json_response({"total": len(sess), "offset": offset, "items": items})

    def session_detail(self, request: Request) -> Response:
        run = self.run(request)
        sid = request.query_params.get("id") or ""
        info = self.session(run, sid)
        lines = run.session_lines(info)
        nodes = build_tree(lines)
        rows: list[dict[str, Any]] = []
        meta: dict[str, Any] = {}
        for part, entry in run.tokens.session_entries(info.step, sid):
            meta = {k: part.index.get(k) for k in ("eps_clip", "eps_clip_high", "ratio_against")}
            for i, r in enumerate(entry["rows"]):
                rows.append({**r, "key": f"{part.stem}/{i}", "version": part.index.get("version")})
        through = rows_through(nodes, [r["row_id"] for r in rows if r.get("row_id")])
        key_of = {r["row_id"]: r["key"] for r in rows if r.get("row_id")}
        for node in nodes:
            node["rows"] = [key_of[r] for r in through.get(node["id"], [])]
        episode = lines[0] if lines else {}
        return json_response(
            {
                "session": info.summary(),
                "episode_reward": episode.get("episode_reward", episode.get("final_reward")),
                "error": episode.get("error"),
                "nodes": nodes,
                "rows": rows,
                "token_meta": meta,
            }
        )

    def tokens(self, request: Request) -> Response:
        run = self.run(request)
        info = self.session(run, request.query_params.get("session") or "")
        key = request.query_params.get("row") or ""
        stem, _, index = key.rpartition("/")
        for part, entry in run.tokens.session_entries(info.step, info.session_id):
            if part.stem != stem or not index.isdigit() or int(index) >= len(entry["rows"]):
                continue
            try:
                rows = run.tokens.read_block(part, entry)
            except ValueError as e:
                raise HTTPError(500, f"token record {stem}: {e}") from None
            i = int(index)
            return json_response(
                {
                    "row": {**entry["rows"][i], "key": key},
                    "meta": {
                        k: part.index.get(k)
                        for k in ("version", "eps_clip", "eps_clip_high", "ratio_against")
                    },
                    "tokens": row_payload(rows[i], run.tokens.text(run.path)),
                }
            )
        raise HTTPError(404, f"session {info.session_id!r} has no token row {key!r}", param="row")

    def evals(self, request: Request) -> Response:
        run = self.run(request)
        store = self.catalog.evals(run.id)
        versions = store.versions() if store is not None else []
        return json_response({"evals": run.evals, "versions": versions})

    def eval_compare(self, request: Request) -> Response:
        run = self.run(request)
        store = self.catalog.evals(run.id)
        versions = store.versions() if store is not None else []
        if store is None or not versions:
            raise HTTPError(404, f"run {run.id!r} has no held-out evaluation (eval-rollout/)")
        after_v = _int(request, "after", versions[-1], lo=-1)
        before_v = _int(request, "before", versions[0], lo=-1)
        after = store.load(after_v)
        if after is None:
            raise HTTPError(404, f"no evaluation of version {after_v}", param="after")
        before = store.load(before_v) if before_v != after_v else None
        if before is None and before_v != after_v:
            raise HTTPError(404, f"no evaluation of version {before_v}", param="before")
        flt = request.query_params.get("filter", "all")
        if flt not in FILTERS:
            raise HTTPError(400, f"filter={flt!r}: one of {', '.join(FILTERS)}", param="filter")
        offset, limit = _page(request, 50)
        out = compare(
            before,
            after,
            flt=flt,
            offset=offset,
            limit=limit,
            task=request.query_params.get("task") or None,
        )
        return json_response({**out, "versions": versions})

    def index(self, request: Request) -> Response:
        return HTMLResponse(self.index_html)

    # ---- guard -------------------------------------------------------------------------------

    def guard(self, request: Request) -> tuple[bool, str | None]:
        """(allowed, the key to set as a cookie)."""
        if self.key is None:
            host = (request.headers.get("host") or "").rsplit(":", 1)[0].strip("[]")
            return is_loopback(host), None
        given = [
            request_key(request),
            request.cookies.get(KEY_COOKIE),
            request.query_params.get("key"),
        ]
        for i, value in enumerate(given):
            if value and hmac.compare_digest(value.encode(), self.key.encode()):
                return True, self.key if i == 2 else None
        return False, None


def _numeric(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _content_security_policy(html: str) -> str:
    """Scripts only from this server plus the page's inline import map (by its hash)."""
    hashes = []
    for body in re.findall(r"<script type=\"importmap\">(.*?)</script>", html, re.DOTALL):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        hashes.append(f"'sha256-{digest}'")
    return (
        "default-src 'self'; "
        f"script-src 'self' {' '.join(hashes)}; "
        "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    )


def create_app(catalog: Catalog, *, key: str | None = None) -> FastAPI:
    """The viewer's ASGI app over ``catalog``."""
    viewer = ViewerApp(catalog, key=key)
    app = FastAPI(title="areal-env view", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.state.viewer = viewer

    @app.middleware("http")
    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        allowed, cookie = viewer.guard(request)
        if not allowed:
            if key is None:
                err = HTTPError(403, "the viewer answers only requests to a loopback host name")
            else:
                err = HTTPError(
                    401,
                    "a key is required: open the address `areal-env view` "
                    "printed (it ends in ?key=...)",
                )
            return error_response(request.url.path, err)
        if request.method not in ("GET", "HEAD"):
            return error_response(request.url.path, HTTPError(405, "the viewer is read-only"))
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = viewer.csp
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        if request.url.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"
        if cookie is not None:
            response.set_cookie(KEY_COOKIE, cookie, httponly=True, samesite="strict", path="/")
        return response

    routes: dict[str, Callable[[Request], Response]] = {
        "/api/runs": viewer.runs,
        "/api/run": viewer.overview,
        "/api/metrics": viewer.metrics,
        "/api/steps": viewer.steps,
        "/api/step": viewer.step_detail,
        "/api/groups": viewer.groups,
        "/api/sessions": viewer.sessions,
        "/api/session": viewer.session_detail,
        "/api/tokens": viewer.tokens,
        "/api/evals": viewer.evals,
        "/api/eval": viewer.eval_compare,
        "/": viewer.index,
    }
    for path, handler in routes.items():
        app.add_api_route(path, _sync(handler), methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _sync(handler: Callable[[Request], Response]) -> Callable[[Request], Response]:
    """A plain function of the request (FastAPI runs it on its thread pool)."""

    def route(request: Request) -> Response:
        return handler(request)

    route.__name__ = handler.__name__
    return route
