"""bench/learning.py's figures against the issue's targets (the summary logic, no training)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "bench" / "learning.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ITEMS = {
    "valid-0": {"calls": 1},
    "valid-1": {"calls": 2},
    "valid-2": {"calls": 3},
    "valid-3": {"calls": 2},
    "new-0": {"calls": 2},
}


def test_share_solved_counts_only_problems_of_enough_calls():
    bench = _bench()
    outcomes = {"valid-0": True, "valid-1": True, "valid-2": False, "valid-3": True}
    assert bench._share_solved(outcomes, ITEMS, min_calls=2) == round(2 / 3, 4)
    assert bench._share_solved({"valid-0": True}, ITEMS, min_calls=2) is None


def _run(seed: int, *, gain: float, p: float, new_p: float, multi: float, wall: float):
    return {
        "seed": seed,
        "heldout": {"gain_points": gain, "p_value": p},
        "new_phrasing": {"gain_points": 10.0, "p_value": new_p},
        "multi_call_after": multi,
        "multi_call_after_by_set": {"heldout": multi, "new_phrasing": 0.0},
        "wall_s": wall,
        "peak_rss_gb": 5.0,
        "machine_fp32_gflops": {"before": 150.0 + seed, "after": 140.0 + seed},
    }


def test_summary_names_the_worst_run_and_each_missed_target():
    bench = _bench()
    good = _run(1, gain=40.0, p=1e-6, new_p=1e-3, multi=0.5, wall=800.0)
    slow = _run(2, gain=25.0, p=1e-4, new_p=0.2, multi=0.2, wall=1000.0)
    out = bench.summarize([good, slow])
    assert out["worst_run"]["seed"] == 2
    assert out["met_per_run"][0] == dict.fromkeys(out["met_per_run"][0], True)
    assert out["met_per_run"][1] == {
        "heldout": True,
        "new_phrasing": False,
        "multi_call": False,
        "wall": False,
        "memory": True,
    }
    assert out["all_met"] is False
    assert out["multi_call_after_new_phrasing"] == [0.0, 0.0]
    assert bench.summarize([good])["all_met"] is True


def test_summary_lists_each_runs_machine_rate():
    bench = _bench()
    runs = [_run(s, gain=40.0, p=1e-6, new_p=1e-3, multi=0.5, wall=800.0) for s in (1, 2)]
    rates = bench.summarize(runs)["machine_fp32_gflops"]
    assert rates == [{"before": 151.0, "after": 141.0}, {"before": 152.0, "after": 142.0}]


def test_matrix_rate_is_measured_not_assumed():
    """Two measurements of a product the machine really runs: positive, finite and within a
    factor of a few of each other (the same machine, seconds apart)."""
    bench = _bench()
    first = bench.matrix_rate_gflops(rounds=2, products=2)
    second = bench.matrix_rate_gflops(rounds=2, products=2)
    assert 0.5 < first < 1e5 and 0.5 < second < 1e5
    assert max(first, second) / min(first, second) < 5
