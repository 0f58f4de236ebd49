"""``areal-env view`` in a real browser (Debian's Chromium, driven by Selenium) on a run made
by a real short training (the default model, the proxy, an agent that calls a tool and
branches), which the viewer follows while it trains. It walks run -> step -> session ->
tokens, checks what the page shows against the dumps and the token record, and takes
screenshots (``AREAL_ENV_VIEW_SCREENSHOTS=DIR`` also keeps them there: the README's come
from this test).

The token record itself is checked against the run too: one row per completion, linked to its
session, the trainer's logprobs equal to the rollout's (same weights, fp32), no token clipped
in the first pass, and its tokens decoding to the dumped completion text.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from areal_env.http.runner import ServerThread
from areal_env.view.app import create_app
from areal_env.view.catalog import Catalog
from areal_env.view.tokens import TokenRecords, TokenText

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
SHOTS = os.environ.get("AREAL_ENV_VIEW_SCREENSHOTS")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


class TreeAgent:
    """Turn 1 offers the add tool; a call gets its result, otherwise a user nudge (a spliced
    turn 2); then two follow-ups continue turn 2 at once (a branch). A reward per completion:
    the right number in turn 2, and a parity reward on each branch (so groups differ)."""

    async def run(self, data, *, base_url, api_key, http_client=None, **_):
        from openai import AsyncOpenAI

        c = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        msgs = [{"role": "user", "content": f"What is {data['a']} + {data['b']}? Use add."}]
        r1 = await c.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, max_tokens=10, temperature=1.0
        )
        m1 = r1.choices[0].message
        msgs.append(m1.model_dump(exclude_none=True))
        if m1.tool_calls:
            for tc in m1.tool_calls:
                try:
                    args = json.loads(tc.function.arguments)
                    out = str(int(args["a"]) + int(args["b"]))
                except Exception as e:  # the model's arguments: anything
                    out = f"error: {e}"
                msgs.append({"role": "tool", "tool_call_id": tc.id, "content": out})
        else:
            msgs.append({"role": "user", "content": "Please just give the number."})
        r2 = await c.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, max_tokens=8, temperature=1.0
        )
        base = [*msgs, r2.choices[0].message.model_dump(exclude_none=True)]
        branches = await asyncio.gather(
            *(
                c.chat.completions.create(
                    model="m",
                    messages=[*base, {"role": "user", "content": q}],
                    tools=TOOLS,
                    max_tokens=6,
                    temperature=1.0,
                )
                for q in ("Are you sure?", "Say it in words.")
            )
        )
        answer = str(data["a"] + data["b"])
        rewards = {r1.id: 0.0, r2.id: float(answer in (r2.choices[0].message.content or ""))}
        for b in branches:
            rewards[b.id] = float(len(b.choices[0].message.content or "") % 2)
        return rewards


TRAIN = [{"id": f"t{i}", "a": i, "b": i + 3} for i in range(4)]
VALID = [{"id": f"v{i}", "a": 10 + i, "b": 2 * i} for i in range(2)]


def _driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--force-device-scale-factor=1",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=opts)


def _shot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    if SHOTS:  # the README's pictures: palette PNGs, a fraction of the size
        from PIL import Image

        out = Path(SHOTS) / f"viewer-{name}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        Image.open(path).convert("RGB").quantize(colors=128).save(out, optimize=True)
    return path


def _wait(driver, condition, timeout=60.0, what="condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(
        condition, message=f"timed out waiting for {what}"
    )


def _by(testid: str) -> tuple[str, str]:
    return ("css selector", f'[data-testid="{testid}"]')


def _dump_lines(run_dir: Path) -> list[dict]:
    return [
        json.loads(x)
        for f in sorted((run_dir / "rollout").rglob("*.jsonl"))
        for x in f.read_text().splitlines()
    ]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_view_a_real_run_in_a_browser(tmp_path):
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are missing: .ci/run installs them")
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y ...)")
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    from areal_env.api.config import ExperimentConfig, load_config
    from areal_env.trainer.ppo import PPOTrainer

    root = tmp_path / "out"
    root.mkdir()
    run_dir = root / "view" / "t"
    cfg = load_config(
        ExperimentConfig,
        None,
        [
            f"fileroot={root}",
            "experiment_name=view",
            "trial_name=t",
            "seed=5",
            "rollout.batch_size=2",
            "rollout.n_samples=2",
            "gconfig.max_new_tokens=10",
            "actor.ppo_n_minibatches=1",
            "trainer.total_train_steps=2",
            "trainer.save_freq_steps=2",
            "trainer.recover='off'",
            "trainer.progress=false",
        ],
    )
    server = ServerThread(create_app(Catalog(root, scan_interval=0.5)), name="view")
    server.start()
    driver = _driver()
    result: dict = {}

    def train() -> None:
        try:
            with PPOTrainer(cfg, TRAIN, VALID) as trainer:
                result["final"] = trainer.train(workflow=TreeAgent())
        except BaseException as e:  # re-raised below
            result["error"] = e

    trainer_thread = threading.Thread(target=train, name="train")
    try:
        # the viewer is up before the run exists: it says so, then follows the run
        driver.get(server.base_url + "/")
        _wait(driver, lambda d: d.find_elements(*_by("no-runs")), what="the empty runs page")
        trainer_thread.start()
        link = _wait(driver, lambda d: d.find_elements(*_by("run-link")), 300, "the run to appear")
        assert link[0].text == "view/t"
        link[0].click()
        _wait(driver, lambda d: d.find_elements(*_by("run-status")), what="the overview")
        seen_steps = set()
        deadline = time.monotonic() + 1200
        while trainer_thread.is_alive() and time.monotonic() < deadline:
            for el in driver.find_elements(*_by("last-step")):
                seen_steps.add(el.text)
            time.sleep(1.0)
        trainer_thread.join(5)
        if "error" in result:
            raise result["error"]
        assert "final" in result, "training did not finish in time"
        # the page followed the run while it trained (it showed a step before the last)
        assert seen_steps & {"0", "1"}, seen_steps
        _wait(driver, lambda d: d.find_element(*_by("last-step")).text == "2", 30, "step 2")
        _wait(driver, lambda d: len(d.find_elements(*_by("step-row"))) == 2, 30, "2 steps")
        lines = _dump_lines(run_dir)
        _check_token_record(run_dir, lines)

        # ---- overview: curves, eval table, config
        _wait(driver, lambda d: d.find_elements("css selector", ".chart canvas"), what="charts")
        keys = {c.get_attribute("data-key") for c in driver.find_elements(*_by("chart"))}
        assert {"reward/mean", "eval/success_rate", "actor/entropy"} <= keys
        evals = driver.find_element(*_by("eval-table")).find_elements("css selector", "tbody tr")
        assert len(evals) == 2
        assert "total_train_steps: 2" in driver.find_element(*_by("config")).get_attribute(
            "textContent"
        )
        _shot(driver, tmp_path, "overview")

        # ---- a trained step: its episodes (a step whose groups all scored alike skips its
        # update, and its tokens carry no trainer logprob; sampling at T=1 decides which)
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        trained = [int(m["step"]) for m in metrics if not m.get("actor/update_skipped")]
        assert trained, "neither step updated: the agent's rewards did not vary"
        step = trained[0]
        driver.find_element("css selector", f'[data-testid="step-row"][data-step="{step}"]').click()
        rows = _wait(driver, lambda d: d.find_elements(*_by("session-row")), what="sessions")
        in_step = [x for x in lines if x["step"] == step]
        sessions = sorted({x["session_id"] for x in in_step})
        assert sorted(r.get_attribute("data-session") for r in rows) == sessions
        assert len(driver.find_elements(*_by("group-row"))) == 2

        # ---- a session: its tree, against the dump
        sid = rows[0].get_attribute("data-session")
        rows[0].click()
        nodes = _wait(driver, lambda d: d.find_elements(*_by("node")), what="the tree")
        dumped = [x for x in in_step if x["session_id"] == sid]
        assert [n.get_attribute("data-node") for n in nodes] == [
            x["interaction_id"] for x in dumped
        ]
        shown = [
            n.find_element(*_by("completion")).find_element("css selector", "pre") for n in nodes
        ]
        assert [p.get_attribute("textContent") for p in shown] == [x["completion"] for x in dumped]
        assert "2 branches" in driver.find_element(*_by("tree")).text
        assert "spliced" in driver.find_element(*_by("tree")).text

        # ---- its tokens: the record's values, shaded by each quantity
        _wait(driver, lambda d: d.find_elements(*_by("token")), what="tokens")
        first = dumped[0]
        driver.find_element(*_by("whole-prompt")).click()
        toks = _wait(
            driver,
            lambda d: (
                (t := d.find_elements(*_by("token")))
                and len(t) == first["prompt_len"] + first["completion_len"]
                and t
            ),
            what="the whole row",
        )
        records = TokenRecords(run_dir)
        records.refresh()
        ((part, entry),) = records.session_entries(step, sid)
        row = records.read_block(part, entry)[
            [r["row_id"] for r in entry["rows"]].index(first["interaction_id"])
        ]
        i = first["prompt_len"] + 1  # the second generated token
        ActionChains(driver).move_to_element(toks[i]).click().perform()
        _wait(driver, lambda d: d.find_element(*_by("insp-index")).text == str(i), what="pin")
        k = i - first["prompt_len"]
        assert driver.find_element(*_by("insp-id")).text == str(int(row.input_ids[i]))
        assert float(driver.find_element(*_by("insp-rollout")).text) == pytest.approx(
            float(row.rollout_logprob[k]), abs=1e-5
        )
        assert float(driver.find_element(*_by("insp-trainer")).text) == pytest.approx(
            float(row.trainer_logprob[k]), abs=1e-5
        )
        assert float(driver.find_element(*_by("insp-adv")).text) == pytest.approx(
            float(row.advantage[k]), abs=1e-4
        )
        assert driver.find_element(*_by("insp-clipped")).text == "no"
        select = Select(driver.find_element(*_by("quantity")))

        def choose(q: str) -> None:
            # by the option's value property (Preact sets no attribute when it equals the text)
            (opt,) = [o for o in select.options if o.get_attribute("value") == q]
            opt.click()

        for q in ("rollout_logprob", "trainer_logprob", "gap", "advantage", "loss_mask", "clipped"):
            choose(q)
            toks = driver.find_elements(*_by("token"))
            bg = [t.value_of_css_property("background-color") for t in toks]
            trained = bg[first["prompt_len"] :]
            if q != "gap":  # a gap of exactly 0 is shaded by nothing
                assert all(c != "rgba(0, 0, 0, 0)" for c in trained), q
            if q in ("loss_mask", "clipped", "advantage", "gap"):
                assert all(c == "rgba(0, 0, 0, 0)" for c in bg[: first["prompt_len"]]), q
        choose("rollout_logprob")
        driver.find_element(*_by("insp-index"))
        ActionChains(driver).move_to_element(nodes[0]).perform()
        driver.execute_script("window.scrollTo(0, 0)")
        _shot(driver, tmp_path, "session")

        # ---- held-out evaluation, before vs after
        driver.get(server.base_url + "/#/r/view%2Ft/eval")
        rows = _wait(driver, lambda d: d.find_elements(*_by("eval-row")), what="eval rows")
        assert sorted(r.get_attribute("data-task") for r in rows) == ["v0", "v1"]
        summary = driver.find_element(*_by("eval-summary")).text
        assert "gained" in summary and "lost" in summary
        driver.find_element("css selector", '[data-filter="failed_tool_calls"]').click()
        _wait(driver, lambda d: "filter=failed_tool_calls" in d.current_url, what="filter")
        driver.find_element("css selector", '[data-filter="all"]').click()
        rows = _wait(driver, lambda d: d.find_elements(*_by("eval-row")), what="eval rows")
        rows[0].click()
        _wait(driver, lambda d: d.find_elements(*_by("eval-detail")), what="side by side")
        _shot(driver, tmp_path, "eval")

        errors = [
            e
            for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and "favicon" not in e["message"]
        ]
        assert errors == [], errors
    finally:
        driver.quit()
        server.stop()
        if trainer_thread.is_alive():  # a failure mid-training: let it finish cleanly
            trainer_thread.join(600)


def _check_token_record(run_dir: Path, lines: list[dict]) -> None:
    """The record of a real run: every completion a row, linked to its session, values that
    agree with the run."""
    records = TokenRecords(run_dir)
    records.refresh()
    assert records.steps() == [1, 2]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = {int(m["step"]): bool(m.get("actor/update_skipped")) for m in metrics}
    text = records.text(run_dir)
    assert isinstance(text, TokenText)  # the run saved its tokenizer
    for step in (1, 2):
        (part,) = records.parts_of(step)
        dumped = {x["interaction_id"]: x for x in lines if x["step"] == step}
        rows = {r["row_id"]: (s, r) for s in part.sessions for r in s["rows"]}
        assert set(rows) == set(dumped)  # one row per completion, each linked
        for rid, (sess, r) in rows.items():
            d = dumped[rid]
            assert sess["session_id"] == d["session_id"] and sess["task_id"] == d["task_id"]
            assert r["n"] == d["prompt_len"] + d["completion_len"]
            assert r["k"] == d["completion_len"]
        for sess in part.sessions:
            for r, tok in zip(sess["rows"], records.read_block(part, sess), strict=True):
                d = dumped[r["row_id"]]
                out_ids = tok.input_ids[d["prompt_len"] :].tolist()
                assert "".join(text.pieces(out_ids)) == d["completion"]
                assert set(tok.versions.tolist()) == {part.index["version"]}
                scored = tok.clipped != 255
                if skipped[step]:  # every group scored alike: advantages 0, the update skipped
                    assert not scored.any()
                    continue
                assert scored.all()  # one minibatch: every trained token got a gradient
                gap = abs(tok.trainer_logprob - tok.rollout_logprob).max()
                # same weights, fp32: the engine's and the trainer's logprobs agree
                assert gap < 2e-3, gap
                assert not tok.clipped.any()  # ratio 1: nothing clipped in the first pass
                adv = set(tok.advantage.tolist())
                assert len(adv) == 1 and all(math.isfinite(a) for a in adv)
