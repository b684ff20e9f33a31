"""Device benchmark: step time, peak device memory, and the largest batch under a memory cap.

    python benchmarks/gpu.py                      # on a GPU: GPT-2 sizes that fill one
    python benchmarks/gpu.py --size tiny --cap 64MiB   # a CPU smoke run (minutes)

For a GPT-2 decoder (Hugging Face Flax, byte-level text) and each policy (no remat, JAX's
built-ins per layer, `jremat.auto` at fractions of the unrematerialized temp) it reports:

* compiled temp and footprint bytes and FLOPs (XLA's deterministic figures);
* median wall seconds of one executed training step (`jit(value_and_grad)`), after a warm-up;
* peak device memory: the growth of `memory_stats()["peak_bytes_in_use"]` over the run, where
  the backend reports it (GPU/TPU; None on CPU, where the compiled footprint stands in);
* the largest batch (sequences of the same length) whose step fits `--cap` bytes of device
  footprint: estimated from two compiled batch sizes (footprints grow linearly in the batch),
  then checked on the compiled program and stepped by 4% until it holds; for jremat the
  check is `jremat.plan(budget=cap)`, so each batch gets its own plan, and a batch is out of
  reach when that raises `InfeasibleBudgetError`.

Writes `benchmarks/results/gpu.md` (and `gpu.csv`). Designed to finish in about 8 minutes on
one H200 with the default sizes; wall times are quoted only from a GPU run. The largest
batch is searched for no remat, the per-layer built-ins and `auto` with the cap as its budget.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import jax
import jax.numpy as jnp

import jremat
from jremat import data
from jremat._src.base.budget import parse_budget
from jremat._src.compile.program import Program
from jremat._src.compile.xla import MemoryFigures, compile_step, xla_flops
from jremat._src.plan.recipes import recipe_plan
from jremat._src.reports.measure import median_step_seconds
from jremat._src.search.solve import solve

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {
    # n_layer, n_embd, n_head, seq_len, batch for the timing runs
    "default": dict(n_layer=12, n_embd=768, n_head=12, seq_len=1024, batch=16),
    "small": dict(n_layer=6, n_embd=512, n_head=8, seq_len=512, batch=8),
    "tiny": dict(n_layer=4, n_embd=64, n_head=2, seq_len=64, batch=4),
}
POLICIES = (
    "no remat",
    "nothing_saveable per layer",
    "dots_saveable per layer",
    "auto 0.5",
    "auto 0.25",
)
#: Policies whose largest batch under the cap is searched (each probe is a compile; jremat's
#: row plans every probed batch with the cap itself as its budget).
BATCH_POLICIES = ("no remat", "nothing_saveable per layer", "dots_saveable per layer", "auto")


def gpt2(size: dict, batch: int):
    from jremat.models import gpt2 as g

    w = g.workload(
        n_layer=size["n_layer"],
        n_embd=size["n_embd"],
        n_head=size["n_head"],
        batch_size=1,
        seq_len=size["seq_len"],
    )
    tokens = jnp.asarray(data.batches(batch, size["seq_len"], seed=0))
    return w.loss, w.params, tokens


def policy_fn(policy: str, prog: Program):
    """The loss under `policy` and its plan (None for no remat)."""
    if policy == "no remat":
        return prog.fn, None
    if policy.startswith("auto"):
        plan = solve(prog, parse_budget(float(policy.split()[1])))
    else:
        plan = recipe_plan(prog.graph, policy.split()[0], "layers")
    return jremat.rematerialize(prog.fn, plan), plan


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def time_policy(policy: str, loss, params, tokens, runs: int) -> dict:
    prog = Program(loss, (params, tokens), 0)
    fn, _ = policy_fn(policy, prog)
    exe = compile_step(fn, (params, tokens), (0,))
    mem = MemoryFigures.of(exe)  # the figure jremat budgets on this backend
    before = peak_bytes()
    jax.block_until_ready(exe(params, tokens))  # warm-up
    seconds = median_step_seconds(exe, (params, tokens), runs)
    after = peak_bytes()
    return {
        "policy": policy,
        "temp_bytes": mem.temp_bytes,
        "footprint_bytes": mem.footprint_bytes,
        "flops": xla_flops(exe),
        "step_seconds": round(seconds, 5),
        "peak_growth_bytes": None if before is None else after - before,
    }


def _program(size: dict, batch: int) -> Program:
    loss, params, tokens = gpt2(size, batch)
    return Program(loss, (params, tokens), 0)


def footprint(policy: str, prog: Program) -> int:
    """Compiled footprint bytes of one step under a fixed `policy`; for "auto" the smallest
    that planning reaches (its min-memory and per-layer nothing_saveable anchors)."""
    if policy == "no remat":
        c = prog.baseline
    elif policy == "auto":
        planner = prog.planner("chain", 160)
        cands = [planner.min_memory_plan(), recipe_plan(prog.graph, "nothing_saveable")]
        c = min((prog.compile(p) for p in cands), key=lambda c: c.temp_bytes)
    else:
        c = prog.compile(recipe_plan(prog.graph, policy.split()[0], "layers"))
    return c.temp_bytes + c.fixed_bytes


def fits(policy: str, size: dict, batch: int, cap: int) -> bool:
    """Whether a step of `batch` sequences fits `cap` footprint bytes under `policy` (for
    "auto": `jremat.plan` with the cap as its budget finds a plan)."""
    prog = _program(size, batch)
    if policy != "auto":
        return footprint(policy, prog) <= cap
    try:
        plan = solve(prog, parse_budget(cap), max_rounds=2)
    except jremat.InfeasibleBudgetError:
        return False
    return plan.measured_temp_bytes + prog.baseline.fixed_bytes <= cap


def largest_batch(policy: str, size: dict, cap: int, limit: int = 1 << 16) -> int:
    """Largest batch whose step fits `cap` bytes. Footprints grow linearly in the batch, so
    two compiled probes give the estimate, which is then checked and stepped by 4% until it
    holds (each check is a compile, or a planning run for "auto")."""
    b0 = max(1, size["batch"] // 2)
    f1, f2 = footprint(policy, _program(size, b0)), footprint(policy, _program(size, 2 * b0))
    per_item = max((f2 - f1) / b0, 1.0)
    best = min(limit, int(b0 + (cap - f1) / per_item))
    if best < 1:
        return 0
    for _ in range(8):
        if fits(policy, size, best, cap):
            bigger = int(best * 1.04) + 1
            return bigger if bigger <= limit and fits(policy, size, bigger, cap) else best
        best = int(best * 0.96)
        if best < 1:
            return 0
    return best if fits(policy, size, best, cap) else 0


def write_results(rows: list[dict], out: str, size: dict, cap: int, seconds: float) -> list[str]:
    """(Re)write gpu.csv and gpu.md: after every row, so that a run cut short keeps its rows."""
    base = rows[0]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    mib = 2**20
    md = [
        f"# Device benchmark ({jax.__version__}, {jax.devices()[0].device_kind}, {seconds:.0f} s)",
        "",
        f"GPT-2 {size['n_layer']} layers, d={size['n_embd']}, batch {size['batch']} x "
        f"{size['seq_len']} tokens; largest batch under a {cap / mib:,.0f} MiB footprint cap.",
        "",
        "| policy | temp MiB | footprint MiB | extra FLOPs | step ms | peak growth MiB | "
        "largest batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = "-" if r["peak_growth_bytes"] is None else f"{r['peak_growth_bytes'] / mib:.1f}"
        if r["temp_bytes"] is None:
            md.append(f"| {r['policy']} | - | - | - | - | - | {r['largest_batch']} |")
            continue
        md.append(
            f"| {r['policy']} | {r['temp_bytes'] / mib:.1f} | {r['footprint_bytes'] / mib:.1f} | "
            f"{100 * (r['flops'] / base['flops'] - 1):.1f}% | {1e3 * r['step_seconds']:.2f} | "
            f"{peak} | {r['largest_batch'] if r['largest_batch'] is not None else '-'} |"
        )
    if jax.devices()[0].platform == "cpu":
        md += ["", "CPU run: step times are not representative; peak memory is not reported."]
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="default", choices=sorted(SIZES))
    ap.add_argument(
        "--cap",
        default=None,
        help='footprint cap, e.g. "40GiB" (default: 1/4 of '
        "the device's free memory, or 64MiB on CPU)",
    )
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--no-largest-batch", action="store_true", help="skip the largest-batch search")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    platform = jax.devices()[0].platform
    if args.cap is None:
        cap = parse_budget("auto").footprint_bytes // 4 if platform != "cpu" else 64 * 2**20
    else:
        cap = parse_budget(args.cap).footprint_bytes
        if cap is None:
            raise SystemExit(f"--cap must be a size such as 40GiB, got {args.cap!r}")
    policies = args.policies.split(",")
    t0 = time.perf_counter()
    loss, params, tokens = gpt2(size, size["batch"])
    rows = []
    for policy in policies:
        row = time_policy(policy, loss, params, tokens, args.runs)
        row["largest_batch"] = (
            largest_batch(policy, size, cap)
            if policy in BATCH_POLICIES and not args.no_largest_batch
            else None
        )
        rows.append(row)
        print(row, flush=True)
        write_results(rows, args.out, size, cap, time.perf_counter() - t0)
    if "auto" in BATCH_POLICIES and not args.no_largest_batch:
        rows.append(
            {
                "policy": "auto (budget = the cap)",
                "temp_bytes": None,
                "footprint_bytes": None,
                "flops": None,
                "step_seconds": None,
                "peak_growth_bytes": None,
                "largest_batch": largest_batch("auto", size, cap),
            }
        )
    md = write_results(rows, args.out, size, cap, time.perf_counter() - t0)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
