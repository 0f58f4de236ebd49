"""Routing of the SGLang client across servers: new sessions to the least-loaded healthy server,
every turn of a session to its server, dead servers skipped; weight-push failures by address."""

from __future__ import annotations

import pytest

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.sglang import SGLangEngine


def _req(rid: str, session: str | None = None) -> ModelRequest:
    return ModelRequest(
        rid=rid,
        input_ids=[1, 2],
        gconfig=GenerationConfig(max_new_tokens=4),
        metadata={"session_id": session} if session else {},
    )


def test_new_sessions_go_to_the_least_loaded_server_and_stay_there():
    eng = SGLangEngine(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    eng.servers.router.inflight = {"127.0.0.1:1": 5, "127.0.0.1:2": 0, "127.0.0.1:3": 2}
    addr, sticky = eng.route(_req("r1", "s1"))
    assert (addr, sticky) == ("127.0.0.1:2", False)
    eng.servers.router.inflight["127.0.0.1:2"] = 9  # now busy: a new session goes elsewhere ...
    assert eng.route(_req("r2", "s2"))[0] == "127.0.0.1:3"
    # ... but every later turn of s1 (a new rid each turn) goes back to its server
    assert eng.route(_req("r3", "s1")) == ("127.0.0.1:2", True)


def test_dead_server_is_avoided_by_new_sessions():
    eng = SGLangEngine(["127.0.0.1:1", "127.0.0.1:2"])
    eng.servers.router.mark_down("127.0.0.1:1")
    assert {eng.route(_req(f"r{i}", f"s{i}"))[0] for i in range(4)} == {"127.0.0.1:2"}


def test_weight_push_failure_names_every_failed_server(tmp_path):
    # nothing listens on these ports: every server fails, and the error names both
    eng = SGLangEngine(["127.0.0.1:9", "127.0.0.1:10"], max_retries=1, connect_timeout=1)
    with pytest.raises(Exception) as info:
        eng.update_weights(str(tmp_path))
    msg = str(info.value)
    assert "127.0.0.1:9" in msg and "127.0.0.1:10" in msg
