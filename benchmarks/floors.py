"""Floors: the smallest budget `jremat.plan` states on each model, against per-block built-ins.

    python benchmarks/floors.py            # every model; writes benchmarks/results/floors.md
    python benchmarks/floors.py --quick    # a subset (three 12-layer chains, two zoo models)
    python benchmarks/floors.py --model mlp12 --json   # one model (what each child runs)

For every zoo model (`jremat.models.NAMES`, tiny size) and for 12-layer chains and decoders
(a residual MLP chain with named layers, a GPT-2 decoder, the same MLP chain of plain Python
blocks without names), each in a fresh process:

* floor: `jremat.plan` at budget 0.05 raises `InfeasibleBudgetError`; its
  `smallest_reachable` is the floor, and a fresh `jremat.plan` call at that budget must
  return a plan whose compiled temp is at or below it (`again` column);
* each built-in policy applied per block (nothing_saveable, dots_with_no_batch_dims_saveable,
  dots_saveable): compiled temp as a fraction of the unrematerialized program. Where the
  model's builder checkpoints its own block calls (`block_policy=`), that is the user's
  `jax.checkpoint` at each call; otherwise the policy on each named layer (jremat's recipe,
  what `nn.remat` per layer compiles to);
* the floor as a multiple of per-block nothing_saveable (issue 16's goal: 0.6 on 12-layer
  chains and decoders), and whether the floor is at or below the best per-block built-in.

Figures are XLA's deterministic compiled temp bytes, so the table is the same on every run of
the same jax version and backend (seconds are not).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("JREMAT_PLAN_CACHE", "0")  # every plan searched, none read from disk
# this checkout's jremat, not another one installed in the environment
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import jremat
import jremat.models
from jremat._src.compile.program import Program
from jremat._src.plan.recipes import recipe_plan

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "floors.md")
POLICIES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable")
#: Asked first: below any floor, so that the error states the smallest reachable budget.
TINY_BUDGET = 0.05
#: The issue's goal for 12-layer chains and decoders: floor / per-block nothing_saveable.
GOAL = 0.6

CHAINS = ("mlp12", "gpt2_12", "chain12_plain")
QUICK = (*CHAINS, "unet_maxpool", "resnet_plain")


def chain_plain(
    depth: int = 12, width: int = 128, batch_size: int = 128, block_policy: str | None = None
) -> jremat.models.Workload:
    """A residual MLP chain of plain Python blocks, no names: `x + W2 gelu(W1 norm(x))`."""
    from jremat.models.plain import residual_mlp_arrays

    params, x = residual_mlp_arrays(depth, width, batch_size, seed=5)

    def block(p, x):
        h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
        return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

    if block_policy is not None:
        block = jax.checkpoint(block, policy=getattr(jax.checkpoint_policies, block_policy))

    def loss(params, x):
        for p in params:
            x = block(p, x)
        return jnp.mean(x**2)

    return jremat.models.Workload("chain12_plain", loss, params, x, "plain MLP chain, no names")


def build(name: str, block_policy: str | None = None) -> tuple[jremat.models.Workload, str]:
    """(workload, description of its size) of model `name`; `block_policy` only for models
    whose builder takes it."""
    kw: dict[str, Any] = {} if block_policy is None else {"block_policy": block_policy}
    if name == "mlp12":
        return jremat.models.get("mlp", depth=12, width=128, batch_size=128), "12 x 128, batch 128"
    if name == "gpt2_12":
        w = jremat.models.get("gpt2", n_layer=12, n_embd=64, n_head=2, batch_size=4, seq_len=64)
        return w, "12 layers, embd 64, 4 x 64 tokens"
    if name == "chain12_plain":
        return chain_plain(**kw), "12 x 128, batch 128"
    return jremat.models.get(name, "tiny", **kw), "tiny"


def takes_block_policy(name: str) -> bool:
    return name == "chain12_plain" or name in ("unet_maxpool", "resnet_plain")


def temp_of(loss, args) -> int:
    exe = jax.jit(jax.value_and_grad(loss)).lower(*args).compile()
    return int(exe.memory_analysis().temp_size_in_bytes)


def measure(name: str) -> dict[str, Any]:
    """One model's row (run in a fresh process)."""
    t0 = time.perf_counter()
    w, size = build(name)
    args = (w.params, w.batch)
    prog = Program(w.loss, args, 0)
    base = prog.baseline.temp_bytes
    # each policy on each layer jremat finds (names, calls or repeats), as jremat runs it
    per_block = {
        p: prog.compile(recipe_plan(prog.graph, p, "layers")).temp_bytes / base for p in POLICIES
    }
    row: dict[str, Any] = dict(
        name=name,
        size=size,
        equations=prog.graph.num_nodes,
        base_bytes=base,
        per_block=per_block,
        reference="per layer",
    )
    if takes_block_policy(name):
        # the user's own `jax.checkpoint` at each block call (on jax < 0.11 XLA:CPU undoes it:
        # docs/design.md#jax-versions, so there it compiles to about the unrematerialized temp)
        row["user_block"] = {p: temp_of(build(name, p)[0].loss, args) / base for p in POLICIES}
    t1 = time.perf_counter()
    try:
        jremat.plan(w.loss, *args, budget=TINY_BUDGET)
        row["floor"] = None  # 0.05 reached: nothing to state
    except jremat.InfeasibleBudgetError as e:
        row["floor"] = float(e.smallest_reachable)  # rounded up to 1e-4
        row["floor_bytes"] = int(e.smallest_reachable_bytes)
    t2 = time.perf_counter()
    if row["floor"] is not None:
        try:
            again = jremat.plan(w.loss, *args, budget=row["floor"])
            row["again"] = again.measured_temp_bytes / base
            row["again_bytes"] = int(again.measured_temp_bytes)
            row["again_solver"] = again.solver
        except jremat.InfeasibleBudgetError as e:  # a stated floor that does not hold: a bug
            row["again"], row["again_bytes"] = math.inf, math.inf
            row["again_solver"] = f"InfeasibleBudgetError, states {e.smallest_reachable}"
    row["seconds"] = dict(references=t1 - t0, floor=t2 - t1, again=time.perf_counter() - t2)
    return row


def run_child(name: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--model", name, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        return dict(name=name, error=(out.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | size | floor (stated) | fresh call at it | per layer: nothing / dots-no-batch"
        " / dots | jax.checkpoint per call (best) | floor / per-layer nothing | floor <= best"
        " per-block | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | - | error: {r['error'][:120]} | | | | | | |")
            continue
        pb, user = r["per_block"], r.get("user_block") or {}
        refs = " / ".join(f"{pb[p]:.3f}" for p in POLICIES)
        user_text = f"{min(user.values()):.3f}" if user else "-"
        best = min([*pb.values(), *user.values()])
        floor, again = r["floor"], r.get("again")
        secs = f"{sum(r['seconds'].values()):.0f}"
        if floor is None:
            lines.append(
                f"| {r['name']} | {r['size']} | <= {TINY_BUDGET} | - | {refs} | {user_text} | - "
                f"| yes | {secs} |"
            )
            continue
        # in bytes: the stated fraction is rounded up
        base = r["base_bytes"]
        holds = "" if r["again_bytes"] <= r["floor_bytes"] else " (ABOVE the stated floor)"
        ok = "yes" if r["floor_bytes"] <= round(best * base) else "**no**"
        multiple = r["floor_bytes"] / base / pb["nothing_saveable"]
        lines.append(
            f"| {r['name']} | {r['size']} | {floor:.4f} | {again:.4f} `{r['again_solver']}`"
            f"{holds} | {refs} | {user_text} | {multiple:.2f} | {ok} "
            f"| {secs} |"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--model", help="one model, in this process")
    ap.add_argument("--json", action="store_true", help="with --model: print the row as JSON")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    if args.model:
        row = measure(args.model)
        print(json.dumps(row) if args.json else "\n".join(table([row])))
        return 0
    names = QUICK if args.quick else (*CHAINS, *jremat.models.NAMES)
    t_start = time.perf_counter()
    rows = []
    for name in names:
        rows.append(run_child(name))
        print(table(rows[-1:])[-1], flush=True)
    md = [
        f"# Floors ({jax.__version__}, {jax.devices()[0].platform}, "
        f"{time.perf_counter() - t_start:.0f} s)",
        "",
        "Compiled temp bytes as a fraction of the unrematerialized program. Floor: the smallest",
        f"budget `jremat.plan` states (budget {TINY_BUDGET} -> `InfeasibleBudgetError`); fresh",
        "call: a new `jremat.plan` at that budget (its compiled temp, its plan's origin).",
        f"Goal on the 12-layer chains and decoders: floor / per-block nothing <= {GOAL}.",
        "",
        *table(rows),
    ]
    if not args.quick:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
