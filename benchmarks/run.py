"""jremat benchmark suite: every solver vs JAX's built-in policies per layer and sqrt(n).

    python benchmarks/run.py            # XLA's bytes and FLOPs, planning seconds

Step time, peak device memory and the largest batch under a memory cap are measured by
`benchmarks/gpu.py` (the device benchmark). Each solver plans on a `Program` of its own, so no
solver's column holds a plan another solver compiled; the `origin` column of `results.csv`
says whether a cell's plan is the solver's own (its label), a built-in recipe or a mix of
recipes (`mix:...`), which `jremat.plan` returns when that is cheaper and fits.

Models: GPT-2-style decoder unrolled (Hugging Face Flax GPT-2) and scanned (`lax.scan` over
layers), ViT, ResNet, U-Net and an MLP chain, at budgets 0.2 .. 0.9. Figures are XLA's
deterministic `memory_analysis()` temp bytes and `cost_analysis()` FLOPs (scan bodies times
their trip counts) plus planning seconds. Writes `benchmarks/results/results.md`,
`results.csv` and `pareto_<model>.png`.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

import jremat
import jremat.models
from jremat._src.base.budget import parse_budget
from jremat._src.compile.program import Program
from jremat._src.plan.recipes import ANCHOR_RECIPES, recipe_plan, scan_configs
from jremat._src.search.solve import solve

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results")
SOLVERS = ("chain", "greedy", "dtr", "milp")
BUDGETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def scanned_decoder(
    depth: int = 6, d: int = 128, heads: int = 4, seq: int = 128, batch: int = 8, vocab: int = 257
):
    """GPT-2-style pre-norm decoder with its layers under `lax.scan` (stacked weights), the way
    large models are written (Flax `nn.scan`); trained on the shipped byte-tokenized text."""
    from jremat import data

    k = jax.random.split(jax.random.PRNGKey(0), 8)
    s = d**-0.5
    params = {
        "emb": jax.random.normal(k[0], (vocab, d)) * 0.02,
        "pos": jax.random.normal(k[1], (seq, d)) * 0.01,
        "qkv": jax.random.normal(k[2], (depth, d, 3 * d)) * s,
        "out": jax.random.normal(k[3], (depth, d, d)) * s,
        "w1": jax.random.normal(k[4], (depth, d, 4 * d)) * s,
        "w2": jax.random.normal(k[5], (depth, 4 * d, d)) * (4 * d) ** -0.5,
    }
    tokens = jnp.asarray(data.batches(batch, seq, seed=0))
    mask = jnp.tril(jnp.ones((seq, seq), bool))

    def norm(x):
        x = x - x.mean(-1, keepdims=True)
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)

    def layer(x, w):
        b, t, _ = x.shape
        q, kk, v = jnp.split(norm(x) @ w["qkv"], 3, axis=-1)
        split = lambda a: a.reshape(b, t, heads, d // heads)  # noqa: E731
        att = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(kk)) / math.sqrt(d // heads)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, split(v)).reshape(b, t, d)
        x = x + y @ w["out"]
        return x + jax.nn.gelu(norm(x) @ w["w1"]) @ w["w2"], None

    def loss(params, tokens):
        x = params["emb"][tokens] + params["pos"]
        stacked = {n: params[n] for n in ("qkv", "out", "w1", "w2")}
        x, _ = jax.lax.scan(layer, x, stacked)
        logits = norm(x) @ params["emb"].T
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    return loss, params, tokens


def workloads(names):
    out = {}
    for name in names:
        if name == "gpt2_scan":
            out[name] = scanned_decoder()
        else:
            w = jremat.models.get(name)
            out[name] = (w.loss, w.params, w.batch)
    return out


def run_model(name, loss, params, batch, budgets, solvers, rows):
    prog = Program(loss, (params, batch), 0)  # the reference rows
    base = prog.baseline
    print(
        f"[{name}] {prog.graph.num_nodes} equations, unrematerialized temp "
        f"{base.temp_bytes / 2**20:.2f} MiB",
        flush=True,
    )

    def add(policy, budget, c, plan_s, pred=None, solver_s=None, origin=None):
        rows.append(
            {
                "model": name,
                "policy": policy,
                "budget": budget,
                "temp_bytes": c.temp_bytes,
                "temp_fraction": round(c.temp_bytes / base.temp_bytes, 4),
                "extra_flops_pct": round(100 * (c.flops / base.flops - 1), 3),
                "predicted_temp_bytes": pred,
                "plan_seconds": plan_s,
                "solver_seconds": solver_s,
                "origin": origin,
            }
        )

    add("no remat", None, base, None)
    for policy, seg in ANCHOR_RECIPES:
        label = "sqrt(n) segments" if seg == "sqrt_n" else f"{policy} per layer"
        add(label, None, prog.compile(recipe_plan(prog.graph, policy, seg)), None)
    for cfg in scan_configs(prog.graph):  # nn.scan(nn.remat(Block, policy)) and sqrt(L) nesting
        c0 = next(iter(cfg.values()))
        label = (
            f"{c0.policy} on scan body"
            if c0.nest == 1
            else f"nested scan k={c0.nest} ({c0.policy} inner)"
        )
        p = jremat.Plan.identity(prog.graph)
        p.scans = cfg
        add(label, None, prog.compile(p), None)
    for solver in solvers:
        # a program of its own: solve takes any cheaper plan compiled on its program, and the
        # column must not show another solver's plans
        own = Program(loss, (params, batch), 0)
        t0 = time.perf_counter()
        planner = own.planner(solver, 160)
        m = len(planner.table.cuts)
        planner.plan(0.5 * planner.no_remat_peak())
        solver_s = time.perf_counter() - t0  # table + one solve, no compiles
        for b in budgets:
            t0 = time.perf_counter()
            try:
                p = solve(own, parse_budget(b), solver=solver, max_rounds=3)
            except jremat.InfeasibleBudgetError as e:
                rows.append(
                    {
                        "model": name,
                        "policy": f"jremat {solver}",
                        "budget": b,
                        "temp_bytes": None,
                        "temp_fraction": None,
                        "extra_flops_pct": None,
                        "predicted_temp_bytes": None,
                        "plan_seconds": round(time.perf_counter() - t0, 2),
                        "solver_seconds": round(solver_s, 3),
                        "note": f"infeasible, smallest {e.smallest_reachable}",
                    }
                )
                continue
            c = own.compile(p)
            add(
                f"jremat {solver}",
                b,
                c,
                round(time.perf_counter() - t0, 2),
                p.predicted_temp_bytes,
                round(solver_s, 3),
                p.solver,
            )
        print(f"  {solver}: {m} cuts, solver {solver_s:.2f} s", flush=True)


def pareto_plot(rows, model, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = {}
    for r in rows:
        if r["model"] == model and r["temp_bytes"] is not None:
            groups.setdefault(r["policy"], []).append(r)
    for policy, rs in sorted(groups.items()):
        xs = [r["temp_bytes"] / 2**20 for r in rs]
        ys = [r["extra_flops_pct"] for r in rs]
        marker = "o-" if policy.startswith("jremat") else "s"
        ax.plot(xs, ys, marker, label=policy, alpha=0.85, markersize=6)
    ax.set_xlabel("compiled temp memory (MiB)")
    ax.set_ylabel("extra FLOPs vs no remat (%)")
    ax.set_title(f"{model}: memory vs recompute (lower left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(rows, models):
    """Markdown: per model and budget, the best built-in that fits vs each solver."""
    lines = [
        "| model | budget | best built-in that fits (extra FLOPs %) | "
        + " | ".join(f"jremat {s}" for s in SOLVERS)
        + " |",
        "|---|---|---|" + "---|" * len(SOLVERS),
    ]
    for model in models:
        base_rows = [
            r
            for r in rows
            if r["model"] == model and r["budget"] is None and r["policy"] != "no remat"
        ]
        budgets = sorted({r["budget"] for r in rows if r["model"] == model and r["budget"]})
        for b in budgets:
            fits = [r for r in base_rows if r["temp_fraction"] <= b]
            best = min(fits, key=lambda r: r["extra_flops_pct"]) if fits else None
            cells = []
            for s in SOLVERS:
                r = next(
                    (
                        r
                        for r in rows
                        if r["model"] == model and r["budget"] == b and r["policy"] == f"jremat {s}"
                    ),
                    None,
                )
                if r is None:
                    cells.append("-")
                elif r["temp_bytes"] is None:
                    cells.append("infeasible")
                else:
                    cell = f"{r['temp_fraction']:.2f} / {r['extra_flops_pct']:.2f}%"
                    origin = r.get("origin") or ""
                    if origin.startswith("mix:"):
                        cell += " (mix)"
                    elif "/" in origin:  # a built-in recipe, "policy/segmentation"
                        cell += " (recipe)"
                    cells.append(cell)
            ref = (
                f"{best['policy']} {best['temp_fraction']:.2f} / {best['extra_flops_pct']:.2f}%"
                if best
                else "none fits"
            )
            lines.append(f"| {model} | {b} | {ref} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,gpt2_scan,vit,resnet,unet,mlp")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--solvers", default=",".join(SOLVERS))
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    solvers = args.solvers.split(",")
    names = args.models.split(",")
    rows: list[dict] = []
    t0 = time.perf_counter()
    for name, (loss, params, batch) in workloads(names).items():
        run_model(name, loss, params, batch, budgets, solvers, rows)
    fields = [
        "model",
        "policy",
        "budget",
        "temp_bytes",
        "temp_fraction",
        "extra_flops_pct",
        "predicted_temp_bytes",
        "plan_seconds",
        "solver_seconds",
        "origin",
        "note",
    ]
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    md = [
        f"# jremat benchmarks ({jax.__version__}, {jax.devices()[0].platform}, "
        f"{time.perf_counter() - t0:.0f} s)",
        "",
        "Cells: compiled temp as a fraction of the unrematerialized program / extra FLOPs; "
        "(mix) or (recipe): the cheapest compiled plan that fit was a mix of built-in "
        "policies or a built-in recipe, not the solver's own plan. Each solver planned on a "
        "program of its own.",
        "",
        summarize(rows, names),
        "",
    ]
    for name in names:
        pareto_plot(rows, name, os.path.join(args.out, f"pareto_{name}.png"))
        md.append(f"![{name}](pareto_{name}.png)")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
