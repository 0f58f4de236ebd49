"""``bench/chain_probe.py`` on the default model: the probe's whole path on two problems.

Holds what is not a measurement: each probed state is the solution's second step, the
probabilities are probabilities and the summary's ``p_right_second_step`` is the mean of the
per-problem products; the probe's prompt is the one the proxy splices (the first call without a
closing tag, then the tool result)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chain_probe_on_two_problems():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'client'}"}
    cmd = [sys.executable, str(ROOT / "bench" / "chain_probe.py"), "--limit=2", "-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["problems"] == 2 and len(out["rows"]) == 2
    multi = [
        json.loads(line)
        for line in (ROOT / "examples" / "aenv" / "valid.jsonl").read_text().splitlines()
        if json.loads(line)["calls"] > 1
    ][:2]
    for row, task in zip(out["rows"], multi, strict=True):
        name, a, b, _ = task["steps"][1]
        assert (row["task_id"], row["want"]) == (task["task_id"], f"{name}({a}, {b})")
        for key in ("p_call_again", "p_right_tool", "p_right_arguments"):
            assert 0.0 < row[key] <= 1.0, (key, row[key])
        product = row["p_call_again"] * row["p_right_tool"] * row["p_right_arguments"]
        assert math.isclose(row["p_right_second_step"], product, rel_tol=1e-9)
    mean = sum(r["p_right_second_step"] for r in out["rows"]) / 2
    assert math.isclose(out["p_right_second_step"], mean, rel_tol=1e-2)
    for key in ("calls_again", "right_tool", "right_arguments"):
        assert out[f"greedy_{key}"] == sum(r[key] for r in out["rows"])


def test_second_turn_prompt_is_the_spliced_one():
    sys.path.insert(0, str(ROOT / "bench"))
    import chain_probe
    from transformers import AutoTokenizer

    from areal_env.engine.models import resolve_model_path
    from areal_env.proxy.render import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path("smollm2-135m-instruct")))
    renderer = ChatRenderer(tokenizer, worked_example=False)
    tools = chain_probe.calculator_tools()
    assert [t["function"]["name"] for t in tools] == ["add", "subtract", "multiply", "divide"]
    step = ["multiply", 12, 30, 360]
    call_text = 'multiply", "arguments": {"a": 12, "b": 30}}]'
    ids = chain_probe.second_turn_prompt(
        renderer, tools, "Q?", call_text, chain_probe.call_message(step, "c1"), "360"
    )
    text = tokenizer.decode(ids)
    # the first turn's prompt and prefill, the model's call as written, the result, the reply
    assert "In this reply you must call at least one tool." in text
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>[{"name": "multiply", "arguments": {"a": 12, "b": 30}}]'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n360\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
