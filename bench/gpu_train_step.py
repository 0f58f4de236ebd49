"""PPO update speed, chip use and learning at lr 1e-6 on a real architecture, against TRL 1.16.

    python bench/gpu_train_step.py --config Qwen2.5-1.5B/config.json --tokenizer TOK --device cuda
    python bench/gpu_train_step.py --device cpu          # a tiny Llama, seconds (CI runs this)

Builds a model of the given ``config.json`` architecture with random weights (speed does not
depend on their values; ``tests/gpu/make_tiny_model.py``, drawn on the GPU when there is one),
and the agent-shaped batch of ``bench/train_step.py --case agent`` (default 4 problems x 8
samples behind a 500-token system prompt: 32 rows, ~19.8k tokens, a trie of ~3.3k). Then, per
strategy (``single``; ``fsdp``: FSDP2 over one rank; ``lossy``: single with
``actor.lossy_low_precision_weights``, the pure-bf16 training that loses small updates) and per
path (``tree``: trie-packed; ``flat``: padded rows), after one warm-up update of each:

- ``update_s``: the median of ``--iters`` ``PPOActor.update`` calls (one optimiser step);
- ``logical_tok_s`` (the rows' tokens / s) and ``computed_tok_s`` (the tokens the model ran
  over: trie nodes for tree) and ``mfu``: ``6 x params x computed tokens / s`` over the device's
  dense peak in the compute dtype (a table by device name; on the CPU a matmul measured here),
  and ``mfu_measured`` over a large matmul timed in this run;
- ``peak_gb``: peak GPU memory allocated (``torch.cuda.max_memory_allocated``; CPU: resident);
- ``changed_fraction``: of the parameter elements an update can move (AdamW's second moment is
  non-zero: the element has had a gradient), the fraction one more update at lr 1e-6 changed
  (``changed_fraction_all``: over every element).

TRL 1.16's ``GRPOTrainer`` takes one optimisation step on the same batch in the same run and the
same precision (an fp32 model; on a GPU ``bf16=True``, the autocast TRL trains with; fp32 on the
CPU), as ``bench/train_step.py`` drives it (compute_loss + backward + clip + step, no
generation). ``--profile`` runs one more tree update of the first strategy under
``torch.profiler``: the top operators by device and by CPU time, the actor's phases
(``actor/*``, ``tree/*`` ranges) and the fraction of the update the GPU was busy, and writes a
Chrome trace to ``--profile-dir``.

Last line: one JSON object (``results``, ``trl``, ``ratios``: e.g. ``single_tree_vs_trl`` = TRL's
step time / our tree update time).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areal_env.api.config import ActorConfig, ModelConfig  # noqa: E402
from areal_env.trainer import memory  # noqa: E402
from areal_env.trainer.actor import PPOActor  # noqa: E402
from bench.train_step import build_trl, make_agent_batch, trl_agent_inputs, trl_step  # noqa: E402

log = logging.getLogger("gpu_train_step")

# Dense (no sparsity) peak FLOP/s by device-name substring: bf16/fp16 tensor cores, and fp32
# (tf32 is off by default in PyTorch matmuls). Vendors' datasheets, SXM parts.
PEAKS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H800": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "A800": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    memory.reset_peak()


def _peak_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return memory.peak_rss_gb()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measured_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in ``dtype`` on ``device`` (random data, after a
    warm-up): the ceiling this machine reaches, next to the datasheet's."""
    n = 8192 if device.type == "cuda" else 1024
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(2):
        a @ b
    _sync(device)
    reps = 10 if device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    kind = "fp32" if dtype == torch.float32 else "bf16"
    for key, peaks in PEAKS.items():
        if key in name:
            return name, peaks[kind]
    return name, None


def make_model(args: argparse.Namespace, device: torch.device) -> str:
    """A folder with the architecture's random weights and the tokenizer (made once per
    config under ``--work-dir``)."""
    from tests.gpu.make_tiny_model import make_tiny_model

    tag = "tiny" if args.config is None else Path(args.config).resolve().as_posix().strip("/")
    out = Path(args.work_dir) / tag.replace("/", "_")
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return str(out)
    t0 = time.perf_counter()
    # bf16 on disk (half the bytes to write and read); the actor loads fp32 master weights
    make_tiny_model(
        args.tokenizer,
        str(out),
        like=args.config,
        device=str(device),
        dtype="bfloat16" if device.type == "cuda" else None,
    )
    _free(device)
    _say(f"random weights written to {out} in {time.perf_counter() - t0:.1f} s")
    return str(out)


def snapshot(actor: PPOActor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, CPU copy of its local shard) of each trained parameter (a 7B model's copy
    is 28 GB of host memory, none of the GPU's)."""
    return [
        (p, _local(p).detach().to("cpu", copy=True))
        for p in actor.model.parameters()
        if p.requires_grad
    ]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def changed_fractions(
    actor: PPOActor, before: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, float]:
    """(changed / elements AdamW can move, changed / all elements) since ``before``."""
    changed = total = can_move = changed_movable = 0
    for p, old in before:
        live = _local(p).detach()
        diff = live != old.to(live.device)
        changed += int(diff.sum())
        total += old.numel()
        v = actor.optimizer.state.get(p, {}).get("exp_avg_sq")
        if isinstance(v, torch.Tensor):
            mask = _local(v) != 0
            can_move += int(mask.sum())
            changed_movable += int((diff & mask).sum())
    return changed_movable / max(can_move, 1), changed / max(total, 1)


def _use_path(actor: PPOActor, path: str, kernel: str) -> None:
    """Set the actor up for ``path``: tree (its own kernel), tree_sdpa (the trunk/segment sdpa
    kernel, for comparison with FlexAttention) or flat."""
    actor.cfg.tree_training = "off" if path == "flat" else "on"
    actor.tree_kernel = "sdpa" if path == "tree_sdpa" else kernel


def run_strategy(
    name: str,
    args: argparse.Namespace,
    model_path: str,
    device: torch.device,
    batch: dict[str, torch.Tensor],
    flops_per_token: float,
    peak: float | None,
    measured_peak: float,
) -> dict[str, Any]:
    strategy = "fsdp" if name == "fsdp" else "single"
    actor_cfg = ActorConfig(
        strategy=strategy,
        lr=1e-6,
        ppo_n_minibatches=1,
        micro_batch_tokens=args.micro_batch_tokens,
        lossy_low_precision_weights=name == "lossy",
        tree_attention=args.tree_attention,
    )
    model_cfg = ModelConfig(
        device=str(device), dtype=args.dtype, gradient_checkpointing=not args.no_grad_ckpt
    )
    t0 = time.perf_counter()
    actor = PPOActor(model_path, actor_cfg, model_cfg, seed=1)
    _say(
        f"[{name}] actor ready in {time.perf_counter() - t0:.1f} s "
        f"(compute {actor.precision.compute}, weights {actor.precision.master}, "
        f"tree kernel {actor.tree_kernel})"
    )
    paths = [p for p in args.paths.split(",") if p]
    kernel = actor.tree_kernel

    def use(path: str) -> None:
        _use_path(actor, path, kernel)

    out: dict[str, Any] = {"strategy": strategy, "tree_kernel": actor.tree_kernel, "paths": {}}
    logical = int(batch["attention_mask"].sum())
    for path in paths:  # warm-up: kernels, compilation (FlexAttention), optimiser state
        use(path)
        t0 = time.perf_counter()
        actor.update(batch, step=0)
        _sync(device)
        _say(f"[{name}] warm-up {path}: {time.perf_counter() - t0:.2f} s")
    times: dict[str, list[float]] = {p: [] for p in paths}
    stats_of: dict[str, dict[str, float]] = {}
    peaks: dict[str, float] = {}
    for it in range(1, args.iters + 1):
        for path in paths:  # alternate, so both see the same machine state
            use(path)
            _reset_peak(device)
            _sync(device)
            t0 = time.perf_counter()
            stats = actor.update(batch, step=it)
            _sync(device)
            dt = time.perf_counter() - t0
            assert stats["actor/update_skipped"] == 0.0, stats
            times[path].append(dt)
            stats_of[path] = stats
            peaks[path] = max(peaks.get(path, 0.0), _peak_gb(device))
            _say(f"[{name}] iter {it} {path}: {dt:.3f} s (peak {peaks[path]:.1f} GB)")
    for path in paths:
        med = statistics.median(times[path])
        computed = stats_of[path]["actor/computed_tokens"]
        rate = flops_per_token * computed / med
        out["paths"][path] = {
            "update_s": round(med, 4),
            "logical_tok_s": round(logical / med, 1),
            "computed_tokens": int(computed),
            "computed_tok_s": round(computed / med, 1),
            "mfu": round(rate / peak, 4) if peak else None,
            "mfu_measured": round(rate / measured_peak, 4),
            "peak_gb": round(peaks[path], 2),
        }
    # learning at lr 1e-6: one more (untimed) update, every parameter compared before/after
    use(paths[0])
    before = snapshot(actor)
    actor.update(batch, step=args.iters + 1)
    _sync(device)
    movable, everything = changed_fractions(actor, before)
    del before
    out["changed_fraction"] = round(movable, 4)
    out["changed_fraction_all"] = round(everything, 4)
    _say(f"[{name}] lr 1e-6 update changed {movable:.2%} of the movable weights")
    if args.profile and not args.profiled:
        args.profiled = True
        use("tree")
        out["profile"] = profile_update(actor, batch, device, args)
    if strategy == "fsdp":
        from areal_env.trainer.dist import destroy

        destroy()
    actor = None  # type: ignore[assignment]
    _free(device)
    return out


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start_us, end_us)`` intervals, in seconds: time the device
    had at least one kernel or copy running (overlapping streams count once)."""
    total = 0.0
    end_of_run = float("-inf")
    start_of_run = 0.0
    for start, end in sorted(intervals):
        if start > end_of_run:
            if end_of_run > float("-inf"):
                total += end_of_run - start_of_run
            start_of_run, end_of_run = start, end
        else:
            end_of_run = max(end_of_run, end)
    if end_of_run > float("-inf"):
        total += end_of_run - start_of_run
    return total / 1e6


def device_busy_seconds(events: Any) -> float:
    """Busy time of the GPU from the profiler's device events: kernels and copies only. The
    operator table's self-CUDA column cannot be summed for this: it lists a kernel under its
    launching operator and again on its own, and a ``record_function`` range spans kernels it
    contains, so its sum ran past the wall time (1.14 of it, 2026-11-27)."""
    from torch.autograd import DeviceType

    ranges = {e.name for e in events if e.is_user_annotation}  # their GPU copies too
    return busy_seconds(
        [
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == DeviceType.CUDA
            and not e.is_user_annotation
            and e.name not in ranges
        ]
    )


def profile_update(
    actor: PPOActor, batch: dict[str, torch.Tensor], device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """One tree update under torch.profiler: where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        actor.update(batch, step=10_000)
        _sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    on_device = device.type == "cuda"

    if on_device:
        _say(events.table(sort_by="self_cuda_time_total", row_limit=25))
    _say(events.table(sort_by="self_cpu_time_total", row_limit=25))
    phases = {
        e.key: {
            "cpu_ms": round(e.cpu_time_total / 1e3, 2),
            "device_ms": round(float(getattr(e, "device_time_total", 0) or 0) / 1e3, 2),
            "calls": e.count,
        }
        for e in events
        if e.key.startswith(("actor/", "tree/"))
    }
    _say("phases (record_function ranges): " + json.dumps(phases, indent=1))
    busy = device_busy_seconds(prof.events()) if on_device else None
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.profile_dir) / "tree_update_trace.json"))
    return {
        "wall_s": round(wall, 4),
        "device_busy_fraction": round(busy / wall, 3) if busy is not None else None,
        "phases": phases,
    }


def run_trl(
    args: argparse.Namespace,
    model_path: str,
    device: torch.device,
    batch: dict[str, torch.Tensor],
    prompt_lens: list[int],
    flops_per_token: float,
    peak: float | None,
    measured_peak: float,
) -> dict[str, Any]:
    lengths = batch["attention_mask"].sum(1).tolist()
    logical = int(sum(lengths))
    bf16 = args.compute_dtype != torch.float32
    trainer = build_trl(
        model_path,
        len(lengths),
        max(lengths),
        not args.no_grad_ckpt,
        bf16=bf16,
        use_cpu=device.type == "cpu",
        lr=1e-6,
    )
    if bf16:
        # Trainer.train() hands the model to accelerate, whose prepare wraps its forward in
        # bf16 autocast; the step is driven here without train(), so prepare it the same way.
        trainer.model = trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)
    inputs = trl_agent_inputs(batch, prompt_lens, trainer.model.device)
    padded = int(inputs["prompt_ids"].numel() + inputs["completion_ids"].numel())
    trl_step(trainer, inputs)  # warm-up
    _sync(device)
    times: list[float] = []
    peak_gb = 0.0
    for it in range(args.iters):
        _reset_peak(device)
        _sync(device)
        t0 = time.perf_counter()
        trl_step(trainer, inputs)
        _sync(device)
        times.append(time.perf_counter() - t0)
        peak_gb = max(peak_gb, _peak_gb(device))
        _say(f"[trl] iter {it + 1}: {times[-1]:.3f} s (peak {peak_gb:.1f} GB)")
    med = statistics.median(times)
    rate = flops_per_token * padded / med
    del trainer
    _free(device)
    return {
        "step_s": round(med, 4),
        "logical_tok_s": round(logical / med, 1),
        "computed_tokens": padded,
        "computed_tok_s": round(padded / med, 1),
        "mfu": round(rate / peak, 4) if peak else None,
        "mfu_measured": round(rate / measured_peak, 4),
        "peak_gb": round(peak_gb, 2),
        "bf16": bf16,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a config.json (or model folder); default tiny")
    ap.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the default model)"
    )
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dtype", default="auto", help="model.dtype: the compute dtype")
    ap.add_argument("--strategies", default="single,fsdp", help="of single, fsdp, lossy")
    ap.add_argument("--paths", default="tree,flat", help="of tree, tree_sdpa, flat")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=500)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--tree-attention", default="auto", help="actor.tree_attention")
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile one tree update")
    ap.add_argument("--profile-dir", default=None, help="write the Chrome trace here")
    ap.add_argument("--work-dir", default=None, help="random-weight folders (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokenizer is None:
        from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

        args.tokenizer = str(resolve_model_path(DEFAULT_MODEL))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    from areal_env.trainer.actor_math import resolve_dtype

    args.compute_dtype = resolve_dtype(args.dtype, device)
    args.profiled = False
    tmp = None
    if args.work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="gpu_train_step_")
        args.work_dir = tmp.name
    model_path = make_model(args, device)

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    flops_per_token = 6.0 * n_params
    batch, prompt_lens = make_agent_batch(
        int(cfg.vocab_size), args.problems, args.samples, args.system_len
    )
    logical = int(batch["attention_mask"].sum())
    name, peak = datasheet_peak(device, args.compute_dtype)
    measured = measured_matmul_flops(device, args.compute_dtype)
    _say(
        f"{name}: {type(cfg).__name__} {n_params / 1e9:.3f}B params, compute "
        f"{args.compute_dtype}; batch {len(prompt_lens)} rows, {logical} tokens; matmul "
        f"{measured / 1e12:.1f} TFLOP/s measured, datasheet {peak and peak / 1e12} TFLOP/s"
    )
    summary: dict[str, Any] = {
        "device": name,
        "architecture": type(cfg).__name__,
        "params": n_params,
        "compute_dtype": str(args.compute_dtype).removeprefix("torch."),
        "rows": len(prompt_lens),
        "logical_tokens": logical,
        "peak_tflops": peak / 1e12 if peak else None,
        "measured_matmul_tflops": round(measured / 1e12, 2),
        "torch": torch.__version__,
        "results": {},
    }
    common = (flops_per_token, peak, measured)
    for strategy in [s for s in args.strategies.split(",") if s]:
        try:
            summary["results"][strategy] = run_strategy(
                strategy, args, model_path, device, batch, *common
            )
        except torch.cuda.OutOfMemoryError as e:  # say so and go on with the others
            summary["results"][strategy] = {"error": f"out of GPU memory: {str(e)[:200]}"}
            _say(f"[{strategy}] out of GPU memory")
            _free(device)
    if not args.no_trl:
        try:
            summary["trl"] = run_trl(args, model_path, device, batch, prompt_lens, *common)
        except ImportError as e:  # the [bench] extra is not installed: say so, keep ours
            summary["trl"] = {"error": f"{type(e).__name__}: {e} (pip install areal-env[bench])"}
        except torch.cuda.OutOfMemoryError as e:
            summary["trl"] = {"error": f"out of GPU memory: {str(e)[:200]}"}
    ratios: dict[str, float] = {}
    trl_s = summary.get("trl", {}).get("step_s")
    for strategy, res in summary["results"].items():
        tree = res.get("paths", {}).get("tree")
        flat = res.get("paths", {}).get("flat")
        if tree and trl_s:
            ratios[f"{strategy}_tree_vs_trl"] = round(trl_s / tree["update_s"], 3)
        if flat and trl_s:
            ratios[f"{strategy}_flat_vs_trl"] = round(trl_s / flat["update_s"], 3)
        if tree and flat:
            ratios[f"{strategy}_tree_vs_flat"] = round(flat["update_s"] / tree["update_s"], 3)
    summary["ratios"] = ratios
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
