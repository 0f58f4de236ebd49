"""The viewer's HTTP app on real servers (127.0.0.1, free ports) over synthetic run folders
(written by the trainer's own writers): the API, paging a 10,000-session step, following a
run, keys, the read-only and loopback guards, and the ``areal-env view`` command."""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from areal_env.http.runner import ServerThread
from areal_env.view.app import STATIC, create_app
from areal_env.view.catalog import Catalog
from areal_env.view.tokens import TokenRecords
from tests.fixtures.view_runs import make_run

REPO = Path(__file__).resolve().parents[2]
RUN = "exp/trial"


def _serve(root: Path, **kwargs) -> ServerThread:
    catalog = Catalog(root, refresh_interval=0.0, scan_interval=0.0)
    server = ServerThread(create_app(catalog, **kwargs), name="view")
    server.start()
    return server


@pytest.fixture
def viewer(synthetic_run):
    server = _serve(synthetic_run.path.parents[1])
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client, synthetic_run
    server.stop()


def test_api_walks_run_step_session_tokens(viewer):
    client, run = viewer
    runs = client.get("/api/runs").json()
    assert [r["id"] for r in runs["runs"]] == [RUN]
    assert runs["runs"][0]["last_step"] == 2 and runs["runs"][0]["live"] is False

    ov = client.get("/api/run", params={"run": RUN}).json()
    assert ov["steps"] == 2 and ov["sessions"] == 8 and ov["warnings"] == []
    assert "total_train_steps: 2" in ov["config"] and "secret-admin-key" not in ov["config"]
    assert "reward/mean" in ov["metric_keys"] and len(ov["evals"]) == 2
    assert ov["token_record"]["steps"] == 2 and ov["token_record"]["rows"] == 32
    metrics = client.get("/api/metrics", params={"run": RUN, "since": 1}).json()["records"]
    assert [m["step"] for m in metrics] == [2]

    steps = client.get("/api/steps", params={"run": RUN}).json()
    assert [s["step"] for s in steps["items"]] == [2, 1]  # newest first
    assert steps["items"][0]["sessions"] == 4 and steps["items"][0]["token_parts"] == 1
    detail = client.get("/api/step", params={"run": RUN, "step": 1}).json()
    assert detail["record"]["actor/clip_frac"] == 0.05
    assert detail["token_record"][0]["rows"] == 16

    groups = client.get("/api/groups", params={"run": RUN, "step": 1}).json()
    assert groups["total"] == 2 and groups["items"][0]["sessions"] == 2
    sessions = client.get("/api/sessions", params={"run": RUN, "step": 1}).json()
    assert [s["session_id"] for s in sessions["items"]] == run.sessions[1]
    assert all(s["has_tokens"] for s in sessions["items"])
    g = groups["items"][1]["group"]
    of_group = client.get("/api/sessions", params={"run": RUN, "step": 1, "group": g}).json()
    assert of_group["total"] == 2 and {s["group"] for s in of_group["items"]} == {g}
    by_reward = client.get("/api/sessions", params={"run": RUN, "step": 1, "sort": "-reward"})
    rewards = [s["reward"] for s in by_reward.json()["items"]]
    assert rewards == sorted(rewards, reverse=True)

    sid = run.sessions[1][0]
    sess = client.get("/api/session", params={"run": RUN, "id": sid}).json()
    nodes = sess["nodes"]
    record = run.records[1][0]
    assert [n["id"] for n in nodes] == record["row_ids"]
    assert nodes[1]["children"] == [nodes[2]["id"], nodes[3]["id"]]  # the branch
    assert nodes[1]["spliced"] is True and nodes[1]["messages"][0]["role"] == "user"
    assert all(len(n["rows"]) == 1 for n in nodes)

    # the tokens shown are the record's, value for value
    tok = client.get("/api/tokens", params={"run": RUN, "session": sid, "row": nodes[2]["rows"][0]})
    body = tok.json()
    recs = TokenRecords(run.path)
    recs.refresh()
    ((part, entry),) = recs.session_entries(1, sid)
    row = recs.read_block(part, entry)[2]
    t = body["tokens"]
    assert t["ids"] == row.input_ids.tolist() and t["pieces"] is None  # no tokenizer saved
    trained = [i for i, m in enumerate(t["loss_mask"]) if m]
    assert [t["rollout_logprob"][i] for i in trained] == pytest.approx(row.rollout_logprob.tolist())
    assert [t["advantage"][i] for i in trained] == pytest.approx(row.advantage.tolist())
    assert t["rollout_logprob"][0] is None  # a prompt token
    assert body["meta"]["eps_clip"] == 0.2

    ev = client.get("/api/eval", params={"run": RUN, "filter": "lost"}).json()
    assert ev["versions"] == [0, 2] and [i["task_id"] for i in ev["items"]] == ["valid-2"]
    assert ev["before"]["version"] == 0 and ev["after"]["version"] == 2


def test_errors_say_what_is_wrong(viewer):
    client, run = viewer
    cases = [
        ("/api/run", {"run": "nope"}, 404, "no run 'nope'"),
        ("/api/run", {"run": "../../.."}, 404, "no run"),
        ("/api/steps", {"run": RUN, "limit": "x"}, 400, "limit='x' is not an integer"),
        ("/api/step", {"run": RUN, "step": 99}, 404, "no step 99"),
        ("/api/sessions", {"run": RUN}, 400, "'step' is required"),
        ("/api/sessions", {"run": RUN, "step": 1, "sort": "x"}, 400, "sort='x'"),
        ("/api/session", {"run": RUN, "id": "sess-nope"}, 404, "no session"),
        ("/api/tokens", {"run": RUN, "session": run.sessions[1][0], "row": "x/9"}, 404, "no token"),
        ("/api/eval", {"run": RUN, "after": 7}, 404, "no evaluation of version 7"),
        ("/api/eval", {"run": RUN, "filter": "x"}, 400, "filter='x'"),
    ]
    for path, params, status, text in cases:
        r = client.get(path, params=params)
        assert r.status_code == status, (path, params, r.text)
        assert text in r.json()["error"]["message"], (path, r.text)
    r = client.post("/api/runs")
    assert r.status_code == 405 and "read-only" in r.text
    # DNS rebinding: a page of another site resolving its name to 127.0.0.1 is refused
    r = client.get("/api/runs", headers={"host": "attacker.example"})
    assert r.status_code == 403


def test_page_and_vendored_files_are_served_with_a_strict_policy(viewer):
    client, _ = viewer
    page = client.get("/")
    assert page.status_code == 200 and '<div id="app">' in page.text
    csp = page.headers["content-security-policy"]
    body = re.search(r'<script type="importmap">(.*?)</script>', page.text, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    for src in re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text):
        r = client.get(src)
        assert r.status_code == 200 and r.content, src
    for name in ("LICENSE.preact", "LICENSE.htm", "LICENSE.uplot", "README.md"):
        assert (STATIC / "vendor" / name).is_file()
    # nothing on the page is fetched from elsewhere
    for f in STATIC.rglob("*"):
        if f.suffix in (".html", ".js", ".css") and "vendor" not in f.parts:
            assert not re.search(r"https?://", f.read_text()), f


def test_a_key_guards_the_viewer(synthetic_run):
    server = _serve(synthetic_run.path.parents[1], key="s3cret-key")
    try:
        base = server.base_url
        assert httpx.get(base + "/api/runs").status_code == 401
        assert httpx.get(base + "/api/runs", params={"key": "wrong"}).status_code == 401
        r = httpx.get(base + "/", params={"key": "s3cret-key"})
        assert r.status_code == 200
        cookie = r.cookies.get("areal_view_key")
        assert cookie == "s3cret-key" and "httponly" in r.headers["set-cookie"].lower()
        assert httpx.get(base + "/api/runs", cookies={"areal_view_key": cookie}).status_code == 200
        auth = {"Authorization": "Bearer s3cret-key"}
        assert httpx.get(base + "/api/runs", headers=auth).status_code == 200
    finally:
        server.stop()


def test_follows_a_run_that_is_still_training(tmp_path):
    root = tmp_path / "out"
    live = root / "exp" / "live"
    server = _serve(root)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            assert client.get("/api/runs").json()["runs"] == []  # nothing yet: no error
            make_run(live, steps=1, evals=False)
            ov = client.get("/api/run", params={"run": "exp/live"}).json()
            assert ov["steps"] == 1 and ov["status"]["live"] is False  # total 1 of 1
            # the run goes on: a later step's files appear
            more = make_run(tmp_path / "next", steps=2, evals=False)
            for f in (more.path / "rollout" / "1").glob("*.jsonl"):
                (live / "rollout" / "1").mkdir(exist_ok=True)
                shutil.copy(f, live / "rollout" / "1" / f.name)
            with (live / "metrics.jsonl").open("a") as f:
                f.write((more.path / "metrics.jsonl").read_text().splitlines()[1] + "\n")
            steps = client.get("/api/steps", params={"run": "exp/live"}).json()
            assert [s["step"] for s in steps["items"]] == [2, 1]
            assert steps["items"][0]["sessions"] == 4
    finally:
        server.stop()


def test_a_step_of_10000_sessions_is_paged(tmp_path):
    """10,000 sessions (2,500 groups of 4) in one step: every list comes a page at a time; the
    timings are in bench/viewer.py."""
    run = make_run(
        tmp_path / "out" / "big" / "t",
        steps=1,
        groups=2500,
        group_size=4,
        prompt_tokens=20,
        completion_tokens=4,
        evals=False,
    )
    server = _serve(tmp_path / "out")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            p = {"run": "big/t", "step": 1}
            page = client.get("/api/sessions", params={**p, "limit": 100, "offset": 9950}).json()
            assert page["total"] == 10000 and len(page["items"]) == 50
            # the same order as in the dump: by task, group, member
            assert [s["session_id"] for s in page["items"]] == run.sessions[1][9950:]
            big = client.get("/api/sessions", params={**p, "limit": 100000}).json()
            assert len(big["items"]) == 500  # the cap
            groups = client.get("/api/groups", params={**p, "offset": 2490}).json()
            assert groups["total"] == 2500 and len(groups["items"]) == 10
            sid = run.sessions[1][7777]
            sess = client.get("/api/session", params={"run": "big/t", "id": sid}).json()
            assert len(sess["nodes"]) == 4 and all(n["rows"] for n in sess["nodes"])
            row = sess["nodes"][0]["rows"][0]
            tok = client.get("/api/tokens", params={"run": "big/t", "session": sid, "row": row})
            assert len(tok.json()["tokens"]["ids"]) == 24
            steps = client.get("/api/steps", params={"run": "big/t"}).json()
            assert steps["items"][0]["sessions"] == 10000
    finally:
        server.stop()


def test_view_command(tmp_path, synthetic_run):
    cmd = [sys.executable, "-m", "areal_env.cli", "view"]
    missing = subprocess.run(cmd + [str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    assert "is a file" in subprocess.run(cmd + [str(a_file)], capture_output=True, text=True).stderr

    p = subprocess.Popen(
        cmd + [str(synthetic_run.path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line or p.poll() is None, "the viewer exited"
            if line.startswith("open "):
                url = line.split()[1]
        assert url is not None and url.startswith("http://127.0.0.1:")
        runs = httpx.get(url + "api/runs", timeout=10).json()["runs"]
        assert [r["id"] for r in runs] == ["."]  # the folder given is the run
    finally:
        p.terminate()
        p.wait(30)


def test_bound_off_loopback_it_makes_a_key(tmp_path, synthetic_run):
    """``--host`` other than loopback without ``--key``: a key is generated and printed."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_env.cli",
            "view",
            str(synthetic_run.path),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        line = ""
        deadline = time.monotonic() + 60
        while not line.startswith("open ") and time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line or p.poll() is None, "the viewer exited"
        url = line.split()[1]
        assert "?key=" in url and "key generated" in line
        base = url.split("?")[0]
        assert httpx.get(base + "api/runs", timeout=10).status_code == 401
        assert httpx.get(url, timeout=10).status_code == 200
    finally:
        p.terminate()
        p.wait(30)
