"""Hardening figures: fuzzing every HTTP surface and a soak of the proxy (issue 15).

    python bench/hardening.py            # full: >= 5,000 fuzzed requests, 256-session soak
    python bench/hardening.py --quick    # CI size (tests/unit/test_hardening_bench.py runs it)

**Fuzz.** Three real servers on 127.0.0.1, each on a ``ScriptedEngine`` (the real tokenizer,
scripted replies; the HTTP layer and the proxy pipeline are the real ones): the proxy, ``areal-env
serve`` (SGLang's protocol) and the service gateway over two proxies. Requests come from
hypothesis strategies built from each route's fields (every field valid, missing, or replaced by
an arbitrary JSON value; random keys; the whole body replaced) plus a hand-made hostile corpus
(wrong types, huge and deeply nested bodies, invalid UTF-8, unknown roles and content parts,
invalid tool-call arguments, unknown tool_call ids, ``n > 1``, extreme ``max_tokens``/
``top_logprobs``, prompts past the context, streams cut by the client, half-sent requests, slow
clients). Each answer must be a 2xx, or a 4xx in the route's own error format (OpenAI's, or
Anthropic's on ``/v1/messages``), never a 5xx, a dropped connection or a hang; after the run
every server answers its health route and a good request.

**Soak.** The proxy runs in a child process (so its memory, descriptors and tasks are its own).
256 concurrent sessions of two-turn tool-calling traffic (a call, the tool's result, a final
answer) end as in training: most set a reward, end and export; some end without a reward; some
are abandoned and expire by TTL. Figures: resident memory growth over the second half of the
run, descriptors and asyncio tasks before vs after, and p99/p50 of the proxy's own work per
request: the server thread's CPU time from the last body byte received to the response's first
byte. The scripted engine answers without suspending, so that span runs only the proxy's code,
and CPU time (not wall time) leaves out the load generator and other processes sharing the cores.

**Faults.** ``set_reward``/``end_session`` retried three times (the reward counts once); an
``areal-env serve`` process SIGKILLed mid-generation and restarted on its port (the SGLang client's
request completes once); a checkpoint written to a full tmpfs (the previous one stays the latest
and loads bit-exact; skipped where no tmpfs can be mounted); a real aenvironment server SIGKILLed,
and one frozen with SIGSTOP (it never answers), at an episode's first tool call while a batch of 6
episodes rolls out through the proxy, ``AenvAgent`` and the ``RolloutExecutor`` (the doomed group's
2 episodes are rejected with a reason within the tool-call timeout, the other 4 are accepted, the
batch returns). ``faults_lost_data`` counts the ones that lost or doubled anything.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

USER_KEY = "user-hardening-key-0123456789"
# a second user, untouched by the fuzz: the fuzz fills USER_KEY's session quota (a 429 then is
# the quota holding), so "healthy after" is checked with a key that still has room
HEALTH_KEY = "user-health-check-key-0123456789"
TOOL_CALL = '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>'
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(DEFAULT_MODEL)))


def agent_like_engine(tokenizer: Any, max_context_len: int = 2048) -> Any:
    """A ScriptedEngine that behaves like a tool-calling agent's model: a call first, then an
    answer once a tool result is in the prompt."""
    from areal_env.engine.testing import ScriptedEngine

    marker = tokenizer.encode("</tool_response>", add_special_tokens=False)

    def reply(req: Any) -> str:
        tail = list(req.input_ids[-64:])
        n = len(marker)
        seen = any(tail[i : i + n] == marker for i in range(len(tail) - n + 1))
        return "The answer is 5." if seen else TOOL_CALL

    return ScriptedEngine(tokenizer, default=reply, max_context_len=max_context_len)


# ================================================================================================
# fuzz
# ================================================================================================


@dataclass
class Outcome:
    requests: int = 0
    ok_2xx: int = 0
    client_4xx: int = 0
    server_5xx: int = 0
    dropped: int = 0
    hangs: int = 0
    bad_error_format: int = 0
    expected_4xx_but_2xx: int = 0
    failures: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.failures) < 40:
            self.failures.append(what)


def error_format_ok(path: str, body: Any) -> bool:
    """The route's own error shape: Anthropic's on /v1/messages*, else OpenAI's."""
    if not isinstance(body, dict):
        return False
    if path.startswith("/v1/messages"):
        err = body.get("error")
        return (
            body.get("type") == "error"
            and isinstance(err, dict)
            and isinstance(err.get("type"), str)
            and isinstance(err.get("message"), str)
        )
    err = body.get("error")
    if isinstance(err, dict):
        return isinstance(err.get("message"), str) and "type" in err
    # SGLang's weight routes answer {"success": false, "message": ...} like SGLang itself
    return body.get("success") is False and isinstance(body.get("message"), str)


def judge(
    out: Outcome,
    label: str,
    path: str,
    resp: httpx.Response | None,
    exc: Exception | None,
    expect_4xx: bool = False,
) -> None:
    out.requests += 1
    if exc is not None:
        if isinstance(exc, httpx.TimeoutException):
            out.hangs += 1
            out.note(f"HANG {label}")
        else:
            out.dropped += 1
            out.note(f"DROPPED {label}: {type(exc).__name__}: {exc}")
        return
    assert resp is not None
    code = resp.status_code
    if code >= 500:
        out.server_5xx += 1
        out.note(f"{code} {label}: {resp.text[:200]}")
    elif code >= 400:
        out.client_4xx += 1
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not error_format_ok(path, body):
            out.bad_error_format += 1
            out.note(f"FORMAT {code} {label}: {resp.text[:200]}")
    else:
        out.ok_2xx += 1
        if expect_4xx:
            out.expected_4xx_but_2xx += 1
            out.note(f"EXPECTED 4xx, got {code} {label}")


@dataclass
class Route:
    target: str
    method: str
    path: str
    auth: str  # session | admin | user | none
    fields: dict[str, Any]  # name -> hypothesis strategy of valid values


def json_values() -> Any:
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=40)
        | st.sampled_from(
            [
                "",
                "user",
                "assistant",
                "tool",
                "system",
                "function",
                "../../x",
                "\u0000",
                "\ud7ff",
                "<tool_call>",
                "NaN",
            ]
        )
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


def message_strategy() -> Any:
    from hypothesis import strategies as st

    role = st.sampled_from(["user", "assistant", "system", "tool", "developer", "wizard", ""])
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_audio", "tool_result", "weird"])},
        optional={"text": st.text(max_size=20) | json_values()},
    )
    content = st.text(max_size=60) | st.lists(part, max_size=3) | json_values()
    call = st.fixed_dictionaries(
        {
            "id": st.sampled_from(["call_1", "", "x" * 200]) | json_values(),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["add", "", "nope"]),
                    "arguments": st.sampled_from(['{"a": 1}', "{bad", "", "[]", "null"])
                    | json_values(),
                }
            ),
        }
    )
    return st.fixed_dictionaries(
        {"role": role},
        optional={
            "content": content,
            "tool_calls": st.lists(call, max_size=2),
            "tool_call_id": st.sampled_from(["call_1", "unknown", ""]) | json_values(),
            "name": st.text(max_size=10),
        },
    )


def routes() -> list[Route]:
    from hypothesis import strategies as st

    msgs = st.lists(message_strategy(), min_size=0, max_size=4)
    good_msgs = st.just([{"role": "user", "content": "Add 2 and 3."}])
    small = st.integers(min_value=-3, max_value=40)
    sampling = {
        "temperature": st.floats(min_value=-1, max_value=3),
        "top_p": st.floats(min_value=-0.5, max_value=1.5),
        "max_tokens": small | st.integers(min_value=10**6, max_value=10**12),
        "seed": st.integers(),
        "stop": st.lists(st.text(max_size=4), max_size=3) | st.text(max_size=4),
        "stream": st.booleans(),
    }
    chat = {
        "model": st.text(max_size=10),
        "messages": good_msgs | msgs,
        "tools": st.just([ADD_TOOL]) | st.lists(json_values(), max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"])
        | st.just({"type": "function", "function": {"name": "add"}}),
        "n": st.integers(min_value=-1, max_value=3),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(min_value=-2, max_value=25),
        "max_completion_tokens": small,
        "stream_options": st.just({"include_usage": True}) | json_values(),
        **sampling,
    }
    anth = {
        "model": st.text(max_size=10),
        "max_tokens": small,
        "messages": good_msgs | msgs,
        "system": st.text(max_size=20) | st.lists(json_values(), max_size=2),
        "tools": st.just([{"name": "add", "input_schema": ADD_TOOL["function"]["parameters"]}])
        | st.lists(json_values(), max_size=2),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}])
        | json_values(),
        "stop_sequences": st.lists(st.text(max_size=4), max_size=3),
        "temperature": st.floats(min_value=-1, max_value=2),
        "stream": st.booleans(),
        "thinking": json_values(),
    }
    resp = {
        "model": st.text(max_size=10),
        "input": st.text(max_size=30) | msgs | st.lists(json_values(), max_size=3),
        "instructions": st.text(max_size=20),
        "tools": st.just([{"type": "function", "name": "add"}])
        | st.lists(json_values(), max_size=2),
        "tool_choice": st.sampled_from(["auto", "required"]) | json_values(),
        "max_output_tokens": small,
        "previous_response_id": st.sampled_from(["resp_nope", ""]) | json_values(),
        "stream": st.booleans(),
        "temperature": st.floats(min_value=-1, max_value=3),
    }
    generate = {
        "input_ids": st.lists(st.integers(min_value=-5, max_value=60_000), max_size=8)
        | st.lists(st.lists(st.integers(min_value=0, max_value=100), max_size=3), max_size=3),
        "text": st.text(max_size=20) | st.lists(st.text(max_size=5), max_size=3),
        "sampling_params": st.fixed_dictionaries(
            {},
            optional={
                "max_new_tokens": small,
                "temperature": st.floats(min_value=-1, max_value=3),
                "top_p": st.floats(min_value=-1, max_value=2),
                "top_k": st.integers(min_value=-2, max_value=100),
                "stop": st.lists(st.text(max_size=3), max_size=2),
                "stop_token_ids": st.lists(st.integers(min_value=-1, max_value=60_000), max_size=2),
            },
        )
        | json_values(),
        "return_logprob": st.booleans() | json_values(),
        "stream": st.booleans(),
        "rid": st.text(max_size=8) | json_values(),
    }
    rl = {
        "task_id": st.text(max_size=10) | st.just("../../etc/passwd"),
        "group_id": st.text(max_size=10),
        "metadata": json_values(),
        "reward": st.floats(allow_nan=False) | json_values(),
        "interaction_id": st.text(max_size=10) | json_values(),
        "completion_id": st.text(max_size=10) | json_values(),
        "session_id": st.text(max_size=10),
        "capacity": st.integers(min_value=-3, max_value=10),
        "discount": st.floats(min_value=-1, max_value=2),
        "style": st.sampled_from(["individual", "concat", "zigzag"]),
        "final_reward": st.floats(allow_nan=False) | json_values(),
        "status": st.sampled_from(["ok", "failed", "weird"]),
        "name": st.text(max_size=10),
    }
    return [
        Route("proxy", "POST", "/v1/chat/completions", "session", chat),
        Route("proxy", "POST", "/v1/messages", "session", anth),
        Route("proxy", "POST", "/v1/messages/count_tokens", "session", anth),
        Route("proxy", "POST", "/v1/responses", "session", resp),
        Route("proxy", "POST", "/rl/start_session", "admin", rl),
        Route("proxy", "POST", "/rl/set_reward", "session", rl),
        Route("proxy", "POST", "/rl/end_session", "session", rl),
        Route("proxy", "POST", "/export_trajectories", "admin", rl),
        Route("proxy", "POST", "/grant_capacity", "admin", rl),
        Route("proxy", "GET", "/v1/models", "session", {}),
        Route("serve", "POST", "/generate", "none", generate),
        Route("serve", "POST", "/update_weight_version", "none", {"new_version": json_values()}),
        Route(
            "serve",
            "POST",
            "/abort_request",
            "none",
            {"rid": json_values(), "abort_all": st.booleans()},
        ),
        Route(
            "serve",
            "POST",
            "/update_weights_from_disk",
            "none",
            {"model_path": st.text(max_size=10) | json_values()},
        ),
        Route("gateway", "POST", "/rl/v1/sessions", "user", rl),
        Route("gateway", "POST", "/rl/v1/set_reward", "session", rl),
        Route("gateway", "POST", "/rl/v1/finalize", "session", rl),
        Route("gateway", "POST", "/v1/chat/completions", "session", chat),
        Route("gateway", "POST", "/v1/messages", "session", anth),
        Route("gateway", "POST", "/admin/keys", "admin", rl),
    ]


class Stack:
    """The three servers under fuzz, each on a scripted engine."""

    def __init__(self, tokenizer: Any) -> None:
        from areal_env.api.config import ProxyConfig
        from areal_env.api.service_config import ServiceConfig
        from areal_env.engine.server import create_app
        from areal_env.http.runner import ServerThread
        from areal_env.proxy.server import ProxyServer
        from areal_env.service.gateway import GatewayServer
        from areal_env.service.source import ExternalTrajectorySource

        cfg = ProxyConfig(default_max_tokens=16, max_sessions=100_000)
        self.proxy = ProxyServer(agent_like_engine(tokenizer, 1024), tokenizer, cfg).start()
        self.serve = ServerThread(
            create_app(agent_like_engine(tokenizer, 1024)),
            "127.0.0.1",
            0,
            name="serve",
            health_path="/health",
        )
        self.serve.start()
        self.backends = [
            ProxyServer(
                agent_like_engine(tokenizer, 1024),
                tokenizer,
                ProxyConfig(default_max_tokens=16, max_sessions=100_000),
            ).start()
            for _ in range(2)
        ]
        self.source = ExternalTrajectorySource(n_samples=1, batch_size=1)
        self.gateway = GatewayServer(
            ServiceConfig(api_keys=[USER_KEY, HEALTH_KEY], health_interval=0.5),
            backends=[(p.base_url, p.admin_key) for p in self.backends],
            source=self.source,
        ).start()
        self.urls = {
            "proxy": self.proxy.base_url,
            "serve": f"http://127.0.0.1:{self.serve.port}",
            "gateway": self.gateway.base_url,
        }

    def admin_key(self, target: str) -> str | None:
        if target == "proxy":
            return self.proxy.admin_key
        if target == "gateway":
            return self.gateway.admin_key
        return None

    def stop(self) -> None:
        for fn in (
            self.gateway.stop,
            *(p.stop for p in self.backends),
            self.serve.stop,
            self.proxy.stop,
        ):
            with contextlib.suppress(Exception):
                fn()


def new_proxy_key(stack: Stack) -> str:
    r = httpx.post(
        stack.urls["proxy"] + "/rl/start_session",
        json={},
        headers={"Authorization": f"Bearer {stack.proxy.admin_key}"},
        timeout=10,
    )
    r.raise_for_status()
    return r.json()["api_key"]


def new_gateway_key(stack: Stack, user: str = USER_KEY) -> str | None:
    r = httpx.post(
        stack.urls["gateway"] + "/rl/v1/sessions",
        json={},
        headers={"Authorization": f"Bearer {user}"},
        timeout=10,
    )
    if r.status_code != 200:
        return None
    return f"{user}:{r.json()['session_id']}"  # the session travels inside the key


def headers_for(stack: Stack, route: Route, choice: int, keys: dict[str, str | None]) -> dict:
    """Mostly the right credential; sometimes none, a wrong one or another role's key."""
    if choice == 0:
        return {}
    if choice == 1:
        return {"Authorization": "Bearer sk-areal-wrong"}
    key: str | None
    if route.auth == "session":
        key = keys[f"{route.target}_session"]
    elif route.auth == "admin":
        key = stack.admin_key(route.target)
    elif route.auth == "user":
        key = USER_KEY
    else:
        key = None
    if choice == 2:  # the other role's key on this route
        key = (
            keys[f"{route.target}_session"]
            if route.auth != "session"
            else stack.admin_key(route.target)
        )
    if not key:
        return {}
    if route.path.startswith("/v1/messages"):
        return {"x-api-key": key}
    return {"Authorization": f"Bearer {key}"}


def fuzz_generated(stack: Stack, n: int, out: Outcome, timeout: float) -> None:
    """``n`` hypothesis-generated requests spread over every route."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    all_routes = routes()
    keys = {
        "proxy_session": new_proxy_key(stack),
        "gateway_session": new_gateway_key(stack),
        "serve_session": None,
    }
    clients = {t: httpx.Client(base_url=u, timeout=timeout) for t, u in stack.urls.items()}
    counter = {"n": 0}

    def body_for(route: Route) -> Any:
        field_strats = {name: s | json_values() | st.just(None) for name, s in route.fields.items()}
        body = st.fixed_dictionaries({}, optional=field_strats)
        extra = st.dictionaries(st.text(max_size=6), json_values(), max_size=2)
        whole = body.flatmap(lambda b: extra.map(lambda e: {**e, **b}))
        return st.one_of(whole, whole, whole, json_values())

    case = st.integers(min_value=0, max_value=len(all_routes) - 1).flatmap(
        lambda i: st.tuples(
            st.just(i), body_for(all_routes[i]), st.sampled_from([0, 1, 2, 3, 3, 3, 3, 3, 3, 3])
        )
    )

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case)
    def one(c: tuple[int, Any, int]) -> None:
        i, body, auth = c
        route = all_routes[i]
        counter["n"] += 1
        if counter["n"] % 1000 == 0:
            log(f"  fuzz: {counter['n']}/{n} generated requests")
        if counter["n"] % 97 == 0:  # fresh session keys now and then (ended sessions linger)
            keys["proxy_session"] = new_proxy_key(stack)
            keys["gateway_session"] = new_gateway_key(stack) or keys["gateway_session"]
        hdrs = headers_for(stack, route, auth, keys)
        client = clients[route.target]
        resp, exc = None, None
        try:
            if route.method == "GET":
                resp = client.get(route.path, headers=hdrs)
            else:  # the stdlib writes inf/nan as Infinity/NaN: non-standard input, kept on purpose
                raw = json.dumps(body).encode("utf-8", "surrogatepass")
                resp = client.post(
                    route.path, content=raw, headers={**hdrs, "content-type": "application/json"}
                )
        except (httpx.HTTPError, OSError) as e:
            exc = e
        judge(out, f"{route.target} {route.path} {json.dumps(body)[:160]}", route.path, resp, exc)

    one()
    for c in clients.values():
        c.close()


def raw_http(
    port: int, data: bytes, *, read: bool = True, timeout: float = 10.0, pace: float = 0.0
) -> bytes:
    """Send raw bytes (optionally a byte at a time every ``pace`` s); the raw answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        if pace:
            for i in range(len(data)):
                s.sendall(data[i : i + 1])
                time.sleep(pace)
        else:
            s.sendall(data)
        if not read:
            return b""
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except TimeoutError:
                break
            if not b:
                break
            chunks.append(b)
            if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                break
        return b"".join(chunks)


def _complete(raw: bytes) -> bool:
    head, _, body = raw.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def http_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Content-Length: {len(body)}",
        "Content-Type: application/json",
        "Connection: close",
    ]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def hostile_corpus(stack: Stack, out: Outcome, timeout: float) -> None:
    """Hand-made hostile inputs, each with what it must get."""
    from areal_env.engine.testing import Reply

    pkey = new_proxy_key(stack)
    gkey = new_gateway_key(stack)
    P = {"Authorization": f"Bearer {pkey}"}
    A = {"x-api-key": pkey}
    G = {"Authorization": f"Bearer {gkey}"} if gkey else {}
    M = [{"role": "user", "content": "Add 2 and 3."}]
    big_text = "word " * 3000  # past the 1024-token context of the scripted engines
    huge = b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * (33 * 2**20) + b'"}]}'
    nested = b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    bad_utf8 = b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe\xc3"}]}'
    call_hist = [
        *M,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{bad"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    cases: list[tuple[str, str, dict, Any, bool]] = [
        # (target, path, headers, json body or raw bytes, must be 4xx)
        ("proxy", "/v1/chat/completions", P, {"model": "m", "messages": M, "n": 2}, False),
        ("proxy", "/v1/chat/completions", P, {"model": "m", "messages": M, "n": 0}, True),
        ("proxy", "/v1/chat/completions", P, {"model": "m", "messages": M, "n": 10**6}, True),
        # streamed n > 1 is served (every choice's chunks name their index), as OpenAI does
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": M, "n": 2, "stream": True},
            False,
        ),
        ("proxy", "/v1/chat/completions", P, {"model": "m", "messages": M, "max_tokens": 0}, True),
        ("proxy", "/v1/chat/completions", P, {"model": "m", "messages": M, "max_tokens": -5}, True),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": M, "max_tokens": 10**15},
            False,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": [{"role": "user", "content": big_text}]},
            True,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": M, "logprobs": True, "top_logprobs": 21},
            True,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": M, "logprobs": False, "top_logprobs": 2},
            True,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": M, "logprobs": True, "top_logprobs": 0},
            False,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": M, "logprobs": True, "top_logprobs": 20},
            False,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            True,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
            True,
        ),
        ("proxy", "/v1/chat/completions", P, {"model": "m", "messages": call_hist}, False),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {
                "model": "m",
                "messages": [*M, {"role": "tool", "tool_call_id": "ghost", "content": "1"}],
            },
            False,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": "m", "messages": [{"role": "user", "content": None}]},
            True,
        ),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            {"model": 5, "messages": M, "temperature": "hot"},
            True,
        ),
        ("proxy", "/v1/chat/completions", P, huge, True),
        ("proxy", "/v1/chat/completions", P, nested, True),
        ("proxy", "/v1/chat/completions", P, bad_utf8, True),
        ("proxy", "/v1/chat/completions", P, b"\x00\x01\x02", True),
        (
            "proxy",
            "/v1/chat/completions",
            P,
            b'{"model": "m", "messages": [' + b"1," * 200_000 + b"1]}",
            True,
        ),
        ("proxy", "/v1/messages", A, {"model": "m", "max_tokens": 0, "messages": M}, True),
        (
            "proxy",
            "/v1/messages",
            A,
            {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": big_text}]},
            True,
        ),
        (
            "proxy",
            "/v1/messages",
            A,
            {
                "model": "m",
                "max_tokens": 10,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "ghost"}]}
                ],
            },
            False,
        ),
        (
            "proxy",
            "/v1/messages",
            A,
            {
                "model": "m",
                "max_tokens": 10,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t", "name": "add", "input": "not an object"}
                        ],
                    }
                ],
            },
            True,
        ),
        ("proxy", "/v1/messages", A, nested, True),
        ("proxy", "/v1/messages", A, bad_utf8, True),
        ("proxy", "/v1/responses", P, {"model": "m", "input": [{"type": "mystery"}]}, True),
        (
            "proxy",
            "/v1/responses",
            P,
            {"model": "m", "input": "x", "previous_response_id": "resp_nope"},
            True,
        ),
        (
            "proxy",
            "/v1/responses",
            P,
            {
                "model": "m",
                "input": [{"type": "function_call_output", "call_id": "ghost", "output": "1"}],
            },
            False,
        ),
        (
            "proxy",
            "/rl/set_reward",
            P,
            {"reward": float("inf")} if False else b'{"reward": Infinity}',
            True,
        ),
        ("proxy", "/rl/set_reward", P, {"reward": True}, True),
        (
            "proxy",
            "/rl/start_session",
            {"Authorization": f"Bearer {stack.proxy.admin_key}"},
            {"metadata": [1, 2]},
            True,
        ),
        ("serve", "/generate", {}, {"input_ids": ["a", None]}, True),
        ("serve", "/generate", {}, {"input_ids": [-1, 10**20]}, True),
        ("serve", "/generate", {}, {"input_ids": [1] * 5000}, True),
        ("serve", "/generate", {}, {"text": 5}, True),
        (
            "serve",
            "/generate",
            {},
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
            True,
        ),
        ("serve", "/generate", {}, nested, True),
        ("serve", "/generate", {}, bad_utf8, True),
        ("serve", "/abort_request", {}, {"rid": [1, 2]}, True),
        ("gateway", "/rl/v1/sessions", {"Authorization": f"Bearer {USER_KEY}"}, nested, True),
        ("gateway", "/rl/v1/set_reward", G, {"reward": "high"}, True),
        ("gateway", "/rl/v1/finalize", G, {"final_reward": [1]}, True),
        ("gateway", "/v1/chat/completions", G, {"model": "m", "messages": M, "n": 3}, False),
        ("gateway", "/v1/chat/completions", G, {"model": "m", "messages": M, "n": -1}, True),
        (
            "gateway",
            "/v1/messages",
            {"x-api-key": gkey or ""},
            {"model": "m", "max_tokens": -1, "messages": M},
            True,
        ),
        ("gateway", "/v1/chat/completions", G, huge, True),
    ]
    with contextlib.ExitStack() as es:
        clients = {
            t: es.enter_context(httpx.Client(base_url=u, timeout=timeout))
            for t, u in stack.urls.items()
        }
        for target, path, hdrs, body, must_4xx in cases:
            resp, exc = None, None
            try:
                if isinstance(body, bytes):
                    resp = clients[target].post(
                        path, content=body, headers={**hdrs, "content-type": "application/json"}
                    )
                else:
                    resp = clients[target].post(path, json=body, headers=hdrs)
            except (httpx.HTTPError, OSError) as e:
                exc = e
            label = f"corpus {target} {path} {str(body)[:100]}"
            judge(out, label, path, resp, exc, expect_4xx=must_4xx)

    # ---- streams cut by the client mid-response (the engine keeps producing) ----------------
    engine = stack.proxy.state.engine
    for proto in ("chat", "anthropic", "responses"):
        engine.push(
            Reply(text="one two three four five six seven eight nine ten " * 3, delay=0.005)
        )
        path, body, hdrs = {
            "chat": ("/v1/chat/completions", {"model": "m", "messages": M, "stream": True}, P),
            "anthropic": (
                "/v1/messages",
                {"model": "m", "messages": M, "max_tokens": 200, "stream": True},
                A,
            ),
            "responses": ("/v1/responses", {"model": "m", "input": "hi", "stream": True}, P),
        }[proto]
        out.requests += 1
        try:
            with httpx.stream(
                "POST", stack.urls["proxy"] + path, json=body, headers=hdrs, timeout=timeout
            ) as r:
                for _ in r.iter_raw(64):
                    break  # hang up after the first bytes
            out.ok_2xx += 1
        except (httpx.HTTPError, OSError) as e:
            out.dropped += 1
            out.note(f"stream-cut {proto}: {e}")
    # ---- half-sent requests: closed early, and one left open during good traffic ------------
    port = stack.proxy.port
    for target_port in (port, stack.serve.port):
        raw_http(
            target_port,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b'Content-Length: 1000\r\n\r\n{"model"',
            read=False,
        )
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{")
    try:
        out.requests += 1
        t0 = time.perf_counter()
        r = httpx.post(
            stack.urls["proxy"] + "/v1/chat/completions",
            json={"model": "m", "messages": M},
            headers=P,
            timeout=timeout,
        )
        if r.status_code != 200 or time.perf_counter() - t0 > 2:
            out.note(f"good request beside a half-sent one: {r.status_code}")
            out.server_5xx += r.status_code >= 500
        else:
            out.ok_2xx += 1
    finally:
        half.close()
    # ---- a slow client: the body a byte every 2 ms --------------------------------------------
    body = json.dumps({"model": "m", "messages": M, "max_tokens": 4}).encode()
    out.requests += 1
    raw = raw_http(port, http_request("/v1/chat/completions", body, P), pace=0.002, timeout=timeout)
    if raw.startswith(b"HTTP/1.1 200"):
        out.ok_2xx += 1
    else:
        out.hangs += not raw
        out.note(f"slow client: {raw[:120]!r}")


def healthy_after(stack: Stack) -> bool:
    """Every server answers its health route and one good request."""
    M = [{"role": "user", "content": "Add 2 and 3."}]
    checks: dict[str, bool] = {}
    for target, url in stack.urls.items():
        checks[f"{target} /health"] = httpx.get(url + "/health", timeout=10).status_code == 200
    pkey = new_proxy_key(stack)
    r = httpx.post(
        stack.urls["proxy"] + "/v1/chat/completions",
        json={"model": "m", "messages": M},
        headers={"Authorization": f"Bearer {pkey}"},
        timeout=10,
    )
    checks["proxy chat"] = r.status_code == 200
    r = httpx.post(stack.urls["serve"] + "/generate", json={"text": "hi"}, timeout=10)
    checks["serve generate"] = r.status_code == 200
    gkey = new_gateway_key(stack, HEALTH_KEY)
    checks["gateway session"] = gkey is not None
    if gkey:
        r = httpx.post(
            stack.urls["gateway"] + "/v1/chat/completions",
            json={"model": "m", "messages": M},
            headers={"Authorization": f"Bearer {gkey}"},
            timeout=10,
        )
        checks["gateway chat"] = r.status_code == 200
    for name, ok in checks.items():
        if not ok:
            log(f"  NOT HEALTHY after the fuzz: {name}")
    return all(checks.values())


def run_fuzz(tokenizer: Any, n_generated: int, timeout: float) -> dict[str, Any]:
    stack = Stack(tokenizer)
    out = Outcome()
    t0 = time.perf_counter()
    try:
        log(f"fuzz: hostile corpus on {sorted(stack.urls)}")
        hostile_corpus(stack, out, timeout)
        log(f"fuzz: {n_generated} generated requests")
        fuzz_generated(stack, n_generated, out, timeout)
        healthy = healthy_after(stack)
    finally:
        stack.stop()
    for f in out.failures:
        log("  " + f)
    return {
        "fuzz_requests": out.requests,
        "fuzz_2xx": out.ok_2xx,
        "fuzz_4xx": out.client_4xx,
        "fuzz_5xx": out.server_5xx,
        "fuzz_dropped": out.dropped,
        "fuzz_hangs": out.hangs,
        "fuzz_bad_error_format": out.bad_error_format,
        "fuzz_expected_4xx_got_2xx": out.expected_4xx_but_2xx,
        "fuzz_healthy_after": healthy,
        "fuzz_s": round(time.perf_counter() - t0, 1),
    }


# ================================================================================================
# soak
# ================================================================================================


def serve_proxy_child(session_ttl: float) -> None:
    """Child mode: a proxy on the agent-like scripted engine, with a timing middleware and a
    ``/_bench/state`` route; prints its address as one JSON line and serves until stdin closes."""
    from areal_env.api.config import ProxyConfig
    from areal_env.proxy.server import ProxyServer

    tok = load_tokenizer()
    cfg = ProxyConfig(default_max_tokens=32, session_ttl=session_ttl, max_sessions=100_000)
    server = ProxyServer(agent_like_engine(tok), tok, cfg)
    work: list[float] = []
    inner = server.app

    async def timed(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await inner(scope, receive, send)
            return
        mark: dict[str, float] = {}

        async def recv() -> dict:
            msg = await receive()
            if msg.get("type") == "http.request" and not msg.get("more_body"):
                mark["body"] = time.thread_time()
            return msg

        async def snd(msg: dict) -> None:
            if msg["type"] == "http.response.start" and "body" in mark:
                work.append(time.thread_time() - mark["body"])
            await send(msg)

        await inner(scope, recv, snd)

    async def state(request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(
            {
                "tasks": len(asyncio.all_tasks()),
                "work": work[:],
                "sessions": len(server.state.registry),
            }
        )

    server.app.add_route("/_bench/state", state, methods=["GET"])
    server._runner.app = timed  # serve through the timing layer
    server.start()
    print(
        json.dumps(
            {"base_url": server.base_url, "admin_key": server.admin_key, "pid": os.getpid()}
        ),
        flush=True,
    )
    sys.stdin.read()
    server.stop()


async def soak_session(client: httpx.AsyncClient, admin: dict, plan: str, lat: list[float]) -> int:
    """One episode as an agent runs it; returns the number of requests made."""
    n = 0
    r = await client.post("/rl/start_session", json={"task_id": "soak"}, headers=admin)
    n += 1
    r.raise_for_status()
    data = r.json()
    key = {"Authorization": f"Bearer {data['api_key']}"}
    msgs: list[dict] = [{"role": "user", "content": "Add 2 and 3."}]
    for _turn in range(2):
        t0 = time.perf_counter()
        r = await client.post(
            "/v1/chat/completions",
            headers=key,
            json={"model": "m", "messages": msgs, "tools": [ADD_TOOL]},
        )
        lat.append(time.perf_counter() - t0)
        n += 1
        if r.status_code != 200:
            raise RuntimeError(
                f"turn {_turn}: {r.status_code} {r.text[:200]} "
                f"after {time.perf_counter() - t0:.2f} s"
            )
        msg = r.json()["choices"][0]["message"]
        msgs.append(msg)
        if not msg.get("tool_calls"):
            break
        for call in msg["tool_calls"]:
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "5"})
    if plan == "abandon":  # never ended: the proxy's TTL must reclaim it
        return n
    if plan == "train":
        r = await client.post("/rl/set_reward", json={"reward": 1.0}, headers=key)
        n += 1
        r.raise_for_status()
    r = await client.post("/rl/end_session", json={}, headers=key)
    n += 1
    r.raise_for_status()
    r = await client.post(
        "/export_trajectories", json={"session_id": data["session_id"]}, headers=admin
    )
    n += 1
    r.raise_for_status()
    if not r.json()["trajectories"]:
        raise RuntimeError("export returned no trajectories")
    return n


def run_soak(sessions: int, total_requests: int, session_ttl: float) -> dict[str, Any]:
    import psutil

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve-proxy",
            "--session-ttl",
            str(session_ttl),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        info = json.loads(child.stdout.readline())
        proc = psutil.Process(info["pid"])
        return asyncio.run(_soak(info, proc, sessions, total_requests, session_ttl))
    finally:
        with contextlib.suppress(Exception):
            child.stdin.close()
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()


async def _soak(info: dict, proc: Any, sessions: int, total: int, ttl: float) -> dict[str, Any]:
    admin = {"Authorization": f"Bearer {info['admin_key']}"}
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    done = {"requests": 0, "episodes": 0, "errors": 0}
    samples: list[tuple[int, int]] = []  # (requests done, rss)
    lat: list[float] = []
    rng = random.Random(0)
    base_url = info["base_url"]

    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        # warm-up: one episode per worker, then the baseline
        await asyncio.gather(*(soak_session(client, admin, "train", []) for _ in range(sessions)))
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c2:  # one connection
        st0 = (await c2.get("/_bench/state")).json()
        fds0, rss0 = proc.num_fds(), proc.memory_info().rss
    n_work0 = len(st0["work"])
    samples.append((0, rss0))
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:

        async def worker() -> None:
            while done["requests"] < total:
                plan = rng.choices(["train", "no_reward", "abandon"], [0.8, 0.1, 0.1])[0]
                try:
                    n = await soak_session(client, admin, plan, lat)
                    done["requests"] += n  # (not `+= await ...`: that reads before awaiting)
                    done["episodes"] += 1
                except Exception as e:  # noqa: BLE001 - counted and reported
                    done["errors"] += 1
                    if done["errors"] <= 5:
                        log(f"  soak error: {type(e).__name__}: {e}")

        async def sampler() -> None:
            last = 0
            while done["requests"] < total:
                await asyncio.sleep(0.25)
                samples.append((done["requests"], proc.memory_info().rss))
                if done["requests"] - last >= total // 10:
                    last = done["requests"]
                    log(
                        f"  soak: {done['requests']}/{total} requests, "
                        f"rss {samples[-1][1] / 2**20:.0f} MiB"
                    )

        t0 = time.perf_counter()
        await asyncio.gather(sampler(), *(worker() for _ in range(sessions)))
        wall = time.perf_counter() - t0
        samples.append((done["requests"], proc.memory_info().rss))
        st1 = (await client.get("/_bench/state")).json()
    # clients closed: the proxy's descriptors and tasks must come back to the baseline
    await asyncio.sleep(ttl * 1.3 + 2.0)  # TTL plus one janitor period (TTL/4)
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c2:
        st2 = (await c2.get("/_bench/state")).json()
        fds1 = proc.num_fds()
    half = done["requests"] / 2
    mid_rss = next(rss for n, rss in samples if n >= half)
    end_rss = samples[-1][1]
    work = st1["work"][n_work0:]
    p50 = statistics.median(work)
    p99 = sorted(work)[int(0.99 * (len(work) - 1))]
    return {
        "soak_sessions": sessions,
        "soak_requests": done["requests"],
        "soak_episodes": done["episodes"],
        "soak_errors": done["errors"],
        "soak_wall_s": round(wall, 1),
        "soak_requests_per_s": round(done["requests"] / wall, 1),
        "soak_rss_start_mib": round(rss0 / 2**20, 1),
        "soak_rss_mid_mib": round(mid_rss / 2**20, 1),
        "soak_rss_end_mib": round(end_rss / 2**20, 1),
        "soak_rss_growth": round((end_rss - mid_rss) / mid_rss, 4),
        "soak_fd_leak": fds1 - fds0,
        "soak_task_leak": st2["tasks"] - st0["tasks"],
        "soak_sessions_left": st2["sessions"],
        "soak_proxy_work_p50_ms": round(p50 * 1e3, 3),
        "soak_proxy_work_p99_ms": round(p99 * 1e3, 3),
        "soak_p99_over_p50": round(p99 / p50, 2),
        "soak_client_p50_ms": round(statistics.median(lat) * 1e3, 2),
    }


# ================================================================================================
# faults
# ================================================================================================

SERVE_CHILD = """
import sys
from transformers import AutoTokenizer
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path
from areal_env.engine.server import create_app
from areal_env.engine.testing import Reply, ScriptedEngine
from areal_env.http.net import bind_socket
from areal_env.http.runner import serve_forever

port, delay = int(sys.argv[1]), float(sys.argv[2])
tok = AutoTokenizer.from_pretrained(str(resolve_model_path(DEFAULT_MODEL)))
engine = ScriptedEngine(tok, default=Reply(text="The answer is 5.", delay=delay))
serve_forever(create_app(engine), bind_socket("127.0.0.1", port),
              on_ready=lambda: print("READY", flush=True), log_level="error")
"""


def _start_serve(port: int, delay: float) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_CHILD, str(port), str(delay)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert "READY" in proc.stdout.readline()
    return proc


def fault_reward_retries(tokenizer: Any) -> int:
    """set_reward and end_session retried 3 times each: the reward counts once."""
    from areal_env.proxy.server import ProxyServer

    with ProxyServer(agent_like_engine(tokenizer), tokenizer) as p:
        admin = {"Authorization": f"Bearer {p.admin_key}"}
        r = httpx.post(p.base_url + "/rl/start_session", json={}, headers=admin).json()
        key = {"Authorization": f"Bearer {r['api_key']}"}
        httpx.post(
            p.base_url + "/v1/chat/completions",
            headers=key,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        for _ in range(3):
            httpx.post(p.base_url + "/rl/set_reward", json={"reward": 1.0}, headers=key)
        for _ in range(3):
            httpx.post(p.base_url + "/rl/end_session", json={}, headers=key)
        exp = httpx.post(
            p.base_url + "/export_trajectories", json={"session_id": r["session_id"]}, headers=admin
        ).json()
        rewards = [t["reward"] for t in exp["trajectories"].values()]
        return 0 if rewards == [1.0] else 1


def fault_serve_killed(tokenizer: Any) -> int:
    """``areal-env serve`` SIGKILLed mid-generation and restarted: the request completes once."""
    from areal_env.api.io import GenerationConfig, ModelRequest
    from areal_env.engine.sglang import SGLangEngine
    from areal_env.http.net import bind_socket

    s = bind_socket("127.0.0.1", 0)
    port = s.getsockname()[1]
    s.close()
    procs = [_start_serve(port, 1.0)]
    eng = SGLangEngine([f"127.0.0.1:{port}"], max_retries=8, retry_backoff=0.25)
    try:
        eng.initialize()

        async def scenario() -> Any:
            req = ModelRequest(
                rid="f1", input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=16)
            )
            task = asyncio.create_task(eng.agenerate(req))
            await asyncio.sleep(0.4)
            procs[0].kill()
            await asyncio.to_thread(procs[0].wait)
            procs.append(await asyncio.to_thread(_start_serve, port, 0.0))
            return await task

        resp = asyncio.run(scenario())
        want = tokenizer.encode("The answer is 5.", add_special_tokens=False)
        return 0 if resp.output_tokens[:-1] == want else 1
    finally:
        eng.destroy()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def fault_disk_full(tmp: Path) -> int | None:
    """A checkpoint written to a full tmpfs: the previous one stays the latest and loads.
    None when no tmpfs can be mounted here."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_env.trainer import checkpoint as ckpt

    mnt = tmp / "disk"
    mnt.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        return None
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
        root = mnt / "ckpts"
        kw = {"tokenizer": None, "optimizer": None, "trainer_state": {}}
        first = ckpt.save_checkpoint(root, 1, model=model, **kw)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        st = os.statvfs(mnt)
        used = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
        (mnt / "filler").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - used // 2))
        try:
            ckpt.save_checkpoint(root, 2, model=model, **kw)
            return 1  # it cannot have fitted
        except ckpt.CheckpointWriteError:
            pass
        latest = ckpt.latest_checkpoint(root)
        fresh = LlamaForCausalLM(model.config)
        ckpt.restore_checkpoint(latest, model=fresh, optimizer=None)
        same = all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
        return 0 if latest.name == "step_1" and same else 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fault_env_server(tokenizer: Any, how: str) -> int:
    """A real aenvironment server killed (``how="kill"``: SIGKILL) or frozen (``"hang"``: SIGSTOP,
    so it accepts connections and never answers) as one group's episodes make their tool call.

    A batch of 3 items x 2 samples runs through the real proxy, ``AenvAgent`` and the
    ``RolloutExecutor`` (the engine is scripted: a tool call, then an answer); the doomed item's
    episodes use their own server. Nothing lost: the batch returns within the configured tool-call
    timeout plus margin, the 2 doomed episodes are rejected with a reason, the other 4 are
    accepted with their tool result."""
    import signal

    from areal_env.api.config import RolloutConfig
    from areal_env.envs.aenv.launcher import AenvServerLauncher
    from areal_env.envs.agent import AenvAgent
    from areal_env.envs.episode import EnvironmentPool
    from areal_env.proxy.server import ProxyServer
    from areal_env.workflow.executor import RolloutExecutor
    from areal_env.workflow.resolve import resolve_workflow

    tools = ROOT / "examples" / "aenv" / "env_tools.py"
    tool_timeout = 4.0
    aenv_cfg = {"env_name": "calculator@1.0.0", "retry_delay": 0.05, "max_retries": 1}

    class DoomedAgent(AenvAgent):
        """Items marked ``doomed`` run on their own server, which fails at the first tool call."""

        def __init__(self, doomed: Any, **kw: Any) -> None:
            super().__init__(**kw)
            self.doomed = doomed

        def open_environment(self, data: dict[str, Any]) -> Any:
            if data.get("doomed"):
                cfg = self.config.new(aenv_url=self.doomed.urls[0])
                return EnvironmentPool(cfg).adapter()
            return super().open_environment(data)

        async def _run_tool(self, env: Any, name_map: Any, call: Any, log_: Any) -> Any:
            # the episode is under way (tools listed, the model asked for a call): fail now
            proc = self.doomed.servers[0].process
            if env.config.aenv_url == self.doomed.urls[0] and proc.poll() is None:
                if how == "kill":
                    self.doomed.stop_server(0, kill=True)
                else:
                    os.kill(proc.pid, signal.SIGSTOP)
            return await super()._run_tool(env, name_map, call, log_)

    engine = agent_like_engine(tokenizer)
    with (
        AenvServerLauncher(tools, num_servers=1, first_host=120) as healthy,
        AenvServerLauncher(tools, num_servers=1, first_host=130) as doomed,
        ProxyServer(engine, tokenizer) as proxy,
    ):
        try:
            agent = DoomedAgent(
                doomed,
                aenv_config={
                    **aenv_cfg,
                    "aenv_url": healthy.urls[0],
                    "tool_call_timeout": tool_timeout,
                },
                max_turns=2,
            )
            rollout = RolloutConfig(n_samples=2, batch_size=3, episode_timeout=120.0)
            wf = resolve_workflow(
                agent,
                rollout=rollout,
                proxy_base_url=proxy.base_url,
                admin_key=proxy.admin_key,
            )
            ex = RolloutExecutor(
                engine,
                wf,
                rollout,
                proxy_base_url=proxy.base_url,
                admin_key=proxy.admin_key,
                show_progress=False,
            )
            items = [{"task_id": f"t{i}", "question": "2 + 3?", "answer": 5} for i in range(3)]
            items[1]["doomed"] = True

            async def batch() -> Any:
                try:
                    # the tool call fails at tool_timeout; closing the MCP session of a frozen
                    # server takes up to 10 s more (McpSession.close: 5 s graceful, 5 s cancel)
                    return await asyncio.wait_for(
                        ex.rollout_batch(items, trainer_version=0), tool_timeout + 60
                    )
                finally:
                    await ex.aclose()

            t0 = time.monotonic()
            try:
                result = asyncio.run(batch())
            except TimeoutError:
                log(f"fault env_server_{how}: the batch hung")
                return 1
            stats = result.stats
            episodes = [e.to_dict() for e in result.episodes]
            rejected = [e for e in episodes if not e.get("accepted")]
            accepted = [e for e in episodes if e.get("accepted")]
            ok = (
                stats["episodes/accepted"] == 4
                and stats["episodes/rejected"] == 2
                and {e.get("task_id") for e in rejected} == {"t1"}
                and all(e.get("reason") for e in rejected)
                and {e.get("task_id") for e in accepted} == {"t0", "t2"}
            )
            log(
                f"fault env_server_{how}: batch in {time.monotonic() - t0:.1f}s, "
                f"accepted {stats['episodes/accepted']:.0f}, rejected "
                f"{stats['episodes/rejected']:.0f} "
                f"({sorted({str(e.get('reason')) for e in rejected})})"
            )
            return 0 if ok else 1
        finally:
            proc = doomed.servers[0].process
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)


def run_faults(tokenizer: Any) -> dict[str, Any]:
    import tempfile

    def attempt(fn: Any, *args: Any) -> int | None:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a fault that broke the harness counts as lost
            log(f"fault {fn.__name__} raised {type(e).__name__}: {e}")
            return 1

    lost: dict[str, int] = {}
    for name, fn in (
        ("reward_retries", fault_reward_retries),
        ("serve_killed_mid_generation", fault_serve_killed),
    ):
        lost[name] = attempt(fn, tokenizer) or 0
    for how in ("kill", "hang"):
        lost[f"env_server_{how}_mid_episode"] = attempt(fault_env_server, tokenizer, how) or 0
    with tempfile.TemporaryDirectory() as tmp:
        disk = attempt(fault_disk_full, Path(tmp))
    if disk is not None:
        lost["checkpoint_disk_full"] = disk
    for name, n in lost.items():
        log(f"fault {name}: {'ok' if n == 0 else 'DATA LOST'}")
    return {
        "faults_injected": len(lost),
        "faults_lost_data": sum(lost.values()),
        "faults": sorted(lost),
    }


# ================================================================================================


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI size")
    p.add_argument("--fuzz-requests", type=int, default=None, help="generated requests")
    p.add_argument("--soak-sessions", type=int, default=256)
    p.add_argument("--soak-requests", type=int, default=None)
    p.add_argument(
        "--session-ttl",
        type=float,
        default=None,
        help="idle TTL of soak sessions (30 quick, 60 full)",
    )
    p.add_argument("--timeout", type=float, default=15.0, help="seconds before a request hangs")
    p.add_argument("--skip-fuzz", action="store_true")
    p.add_argument("--skip-soak", action="store_true")
    p.add_argument("--skip-faults", action="store_true")
    p.add_argument("--serve-proxy", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_proxy:
        serve_proxy_child(args.session_ttl or 60.0)
        return 0
    import logging

    logging.basicConfig(level=logging.ERROR)
    n_fuzz = args.fuzz_requests or (600 if args.quick else 5000)
    n_soak = args.soak_requests or (1500 if args.quick else 30000)
    ttl = args.session_ttl or (30.0 if args.quick else 60.0)
    result: dict[str, Any] = {"mode": "quick" if args.quick else "full"}
    tok = load_tokenizer()
    if not args.skip_fuzz:
        result.update(run_fuzz(tok, n_fuzz, args.timeout))
    if not args.skip_faults:
        result.update(run_faults(tok))
    if not args.skip_soak:
        log(f"soak: {args.soak_sessions} concurrent sessions, {n_soak} requests")
        result.update(run_soak(args.soak_sessions, n_soak, ttl))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
