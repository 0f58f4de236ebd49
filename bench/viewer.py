"""``areal-env view`` on a huge run: how long its pages take, against a small run's.

Two synthetic runs are written by the trainer's own writers (tests/fixtures/view_runs.py:
episode records shaped like the real ones, 4 completions each, token records included): a
baseline of 100 sessions and a big one of 10,000 sessions in ONE step (the step page's worst
case). For each, the viewer's server runs on 127.0.0.1 and every API call behind a page is
timed (median of ``--repeat`` after a first, cold call); with Debian's Chromium present, the
pages are also loaded in a real browser and timed until their content is on screen.

Run: ``.venv/bin/python bench/viewer.py [--sessions 10000] [--repeat 5] [--no-browser]``.
The last line is one JSON object: seconds per page on the big run, big/small ratios, and the
token record's size per 1,000 episodes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from areal_env.http.runner import ServerThread  # noqa: E402
from areal_env.view.app import create_app  # noqa: E402
from areal_env.view.catalog import Catalog  # noqa: E402
from tests.fixtures.view_runs import make_run  # noqa: E402

GROUP = 4


def _make(root: Path, sessions: int) -> tuple[Path, list[str], float]:
    t0 = time.perf_counter()
    run = make_run(
        root / "runs" / "r",
        steps=1,
        groups=sessions // GROUP,
        group_size=GROUP,
        prompt_tokens=200,
        completion_tokens=24,
        evals=False,
        seed=1,
    )
    return run.path, run.sessions[1], time.perf_counter() - t0


def _time(client: httpx.Client, path: str, params: dict, repeat: int) -> tuple[float, float]:
    """(cold seconds, median warm seconds) of one API call."""
    t0 = time.perf_counter()
    r = client.get(path, params=params)
    cold = time.perf_counter() - t0
    r.raise_for_status()
    warm = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        client.get(path, params=params).raise_for_status()
        warm.append(time.perf_counter() - t0)
    return cold, statistics.median(warm)


def _pages(sid: str, row: str) -> dict[str, list[tuple[str, dict]]]:
    """The API calls each page makes when it opens."""
    run = {"run": "r"}
    return {
        "runs": [("/api/runs", {})],
        "overview": [
            ("/api/run", run),
            ("/api/metrics", {**run, "since": -1}),
            ("/api/steps", {**run, "offset": 0, "limit": 25}),
        ],
        "step": [
            ("/api/step", {**run, "step": 1}),
            ("/api/groups", {**run, "step": 1, "offset": 0, "limit": 20}),
            ("/api/sessions", {**run, "step": 1, "offset": 0, "limit": 50}),
        ],
        "step, last page sorted by reward": [
            ("/api/sessions", {**run, "step": 1, "offset": 9950, "limit": 50, "sort": "-reward"}),
        ],
        "session": [("/api/session", {**run, "id": sid})],
        "tokens": [("/api/tokens", {**run, "session": sid, "row": row})],
    }


def _measure(path: Path, sessions: list[str], repeat: int) -> dict[str, dict[str, float]]:
    catalog = Catalog(path.parent)
    server = ServerThread(create_app(catalog), name="view-bench")
    server.start()
    out: dict[str, dict[str, float]] = {}
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            t0 = time.perf_counter()
            client.get("/api/run", params={"run": "r"}).raise_for_status()
            # the first read of the run indexes it (the command does it at start-up)
            out["index (first request)"] = {"cold": time.perf_counter() - t0, "warm": 0.0}
            sid = sessions[len(sessions) // 2]
            detail = client.get("/api/session", params={"run": "r", "id": sid}).json()
            row = detail["nodes"][0]["rows"][0]
            for page, calls in _pages(sid, row).items():
                cold = warm = 0.0
                for api, params in calls:
                    c, w = _time(client, api, params, repeat)
                    cold += c
                    warm += w
                out[page] = {"cold": cold, "warm": warm}
            out["_browser"] = _browser(server.base_url, sid)
    finally:
        server.stop()
    return out


def _browser(base: str, sid: str) -> dict[str, float]:
    """Seconds from navigation to the content on screen, in headless Chromium (if present)."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path) or ARGS.no_browser:
        return {}
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(driver_path), options=opts)
    out = {}
    try:
        pages = {
            "overview": ("#/r/r", '[data-testid="step-row"]'),
            "step": ("#/r/r/step/1", '[data-testid="session-row"]'),
            "session": (f"#/r/r/session/{sid}", '[data-testid="token"]'),
        }
        d.get(base + "/")  # the scripts cached, as when one clicks through
        WebDriverWait(d, 60).until(lambda x: x.find_elements("css selector", "h1"))
        for name, (frag, selector) in pages.items():
            times = []
            for _ in range(3):
                d.get("about:blank")
                t0 = time.perf_counter()
                d.get(base + "/" + frag)
                WebDriverWait(d, 60, poll_frequency=0.01).until(
                    lambda x, s=selector: x.find_elements("css selector", s)
                )
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times)
    finally:
        d.quit()
    return out


def _record_size(path: Path, episodes: int) -> dict[str, float]:
    tokens = path / "tokens"
    binary = sum(f.stat().st_size for f in tokens.glob("*.bin"))
    index = sum(f.stat().st_size for f in tokens.glob("*.json") if f.name.startswith("step-"))
    dumps = sum(f.stat().st_size for f in (path / "rollout").rglob("*.jsonl"))
    per = 1000 / episodes / 1e6
    return {
        "token_record_mb_per_1000_episodes": (binary + index) * per,
        "token_blocks_mb_per_1000_episodes": binary * per,
        "jsonl_dumps_mb_per_1000_episodes": dumps * per,
    }


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=10000)
    p.add_argument("--baseline", type=int, default=100)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-browser", action="store_true")
    ARGS = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, n in (("small", ARGS.baseline), ("big", ARGS.sessions)):
            path, sessions, made = _make(Path(tmp) / label, n)
            print(f"{label}: {n} sessions written in {made:.1f} s", flush=True)
            results[label] = _measure(path, sessions, ARGS.repeat)
            results[label]["_size"] = _record_size(path, n)  # type: ignore[assignment]
    small, big = results["small"], results["big"]
    print(
        f"\n{'page (API calls it makes)':<36}{'small':>10}{'big':>10}{'big cold':>10}{'ratio':>8}"
    )
    summary: dict[str, object] = {"sessions": ARGS.sessions}
    for page in big:
        if page.startswith("_"):
            continue
        warm = big[page]["warm"] > 0  # the first request is only ever cold
        s, b = (
            (small[page]["warm"], big[page]["warm"])
            if warm
            else (
                small[page]["cold"],
                big[page]["cold"],
            )
        )
        ratio = b / s if s else float("nan")
        print(f"{page:<36}{s:>10.4f}{b:>10.4f}{big[page]['cold']:>10.4f}{ratio:>8.2f}")
        summary[f"{page} s"] = round(b, 4)
        summary[f"{page} ratio"] = round(ratio, 2) if ratio == ratio else None
    if big["_browser"]:
        print(f"\n{'in Chromium, navigation -> content':<36}{'small':>10}{'big':>10}{'ratio':>8}")
        for page, b in big["_browser"].items():
            s = small["_browser"][page]
            print(f"{page:<36}{s:>10.3f}{b:>10.3f}{b / s:>8.2f}")
            summary[f"browser {page} s"] = round(b, 3)
    size = big["_size"]
    print("\nper 1,000 episodes (4 completions each, 200-token prompts, 24-token completions):")
    for k, v in size.items():  # type: ignore[union-attr]
        print(f"  {k}: {v:.2f}")
        summary[k] = round(v, 2)
    print(json.dumps(summary))


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
