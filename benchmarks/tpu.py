"""TPU benchmark, compiled on any host: jremat's plans for a v5e, against JAX's built-in
policies and against the TPU compiler's own rematerialization.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/tpu.py            # all sections
    python benchmarks/tpu.py --models mlp --targets tpu:v5e:1x1 --no-xla   # one cell

Needs libtpu (`pip install "jremat[tpu]"`); nothing runs on a TPU: every program is compiled
by libtpu for a topology's compile-only devices (`jremat.target_mesh`), and every figure is
the TPU compiler's (`memory_analysis()`, `cost_analysis()`), read as jremat reads it there
(`jremat.MEMORY_FIGURES["tpu"]`: the compiler's peak less arguments and outputs).

Section 1, the zoo (a residual MLP, GPT-2, a U-Net, a decoder whose layers are a `lax.scan`)
on one v5e chip and on a 2x2 mesh (batch split over "data", each weight's last dimension over
"model" where it divides), at budgets 0.5 and 0.7 (and, where one is refused, at the floor
the refusal states, to show that it holds):
* the unrematerialized step (`jit(value_and_grad)`) and JAX's built-ins per layer and sqrt(n)
  segments (`jremat.compare`), and its plain compile seconds;
* `jremat.plan` at each budget: the figure of the step that runs (`jit(grad)` of
  `jremat.rematerialize(loss, plan)`, compiled again for the TPU) against the budget, extra
  FLOPs against the best built-in that fits, plan seconds against the plain compile, or the
  floor `InfeasibleBudgetError` states.

Section 2, XLA's own rematerialization: a residual MLP (bf16) whose step the TPU compiler
rematerializes itself under a memory limit (compile option
`xla_jf_rematerialization_percent_shared_memory_limit`, percent of the chip's HBM), against
`jremat.plan` with the footprint the compiler reached as its budget.

Writes `benchmarks/results/tpu.md`. Compile seconds are this host's (2 CPUs) and are noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # before JAX loads libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jremat  # noqa: E402
from jremat import models  # noqa: E402
from jremat._src.base.targets import abstract_on  # noqa: E402
from jremat._src.compile.xla import MemoryFigures, xla_flops  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
BUDGETS = (0.5, 0.7)
TARGETS = {
    "tpu:v5e:1x1": (("data",), (1,)),
    "tpu:v5e:2x2": (("data", "model"), (2, 2)),
}
MIB = 2.0**20


def workload(name: str):
    """(loss, params, batch, description), sized so that one TPU compile takes seconds here
    (libtpu's compile time grows with the model: an 8-layer width-512 MLP takes 18 s)."""
    if name == "mlp":
        from jremat.models import plain

        w = plain.mlp_workload(depth=4, width=128, batch_size=512)
        return w.loss, w.params, w.batch, "residual MLP, 4 layers, width 128, batch 512"
    if name in ("gpt2", "unet"):
        w = models.get(name, size="tiny")
        return w.loss, w.params, w.batch, w.description + " (tiny size)"
    if name == "scan":
        from run import scanned_decoder

        loss, params, batch = scanned_decoder(depth=4, d=64, heads=2, seq=32, batch=4)
        return loss, params, batch, "GPT-2-style decoder, 4 layers under lax.scan, d 64, 4x32"
    raise ValueError(f"unknown model {name!r}")


def place(params, batch, target: str):
    names, shape = TARGETS[target]
    mesh = jremat.target_mesh(target, names, shape)
    p = abstract_on(params, mesh)
    if "model" in names:  # each weight's last dimension over "model" where it divides
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        size = dict(zip(names, shape, strict=True))["model"]

        def split(x):
            if len(x.shape) >= 2 and x.shape[-1] % size == 0:
                spec = P(*([None] * (len(x.shape) - 1)), "model")
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
            return x

        p = jax.tree_util.tree_map(split, p)
    return p, abstract_on(batch, mesh, "data")


def step_figures(fn, *args) -> tuple[MemoryFigures, float, float]:
    t0 = time.perf_counter()
    exe = jax.jit(jax.grad(fn)).lower(*args).compile()
    return MemoryFigures.of(exe), xla_flops(exe), time.perf_counter() - t0


def zoo_cell(name: str, target: str, budgets) -> list[str]:
    loss, params, batch, what = workload(name)
    params, batch = place(params, batch, target)
    t0 = time.perf_counter()
    cmp = jremat.compare(loss, params, batch, budgets=())
    base = cmp.rows[0]
    builtins = [r for r in cmp.rows[1:] if r.ok]
    rows = [f"\n### {name} on {target}: {what}\n"]
    rows.append(
        f"Unrematerialized: temp {base.temp_bytes / MIB:.2f} MiB, footprint "
        f"{base.footprint_bytes / MIB:.2f} MiB, plain compile {base.compile_seconds:.1f} s; "
        f"built-ins compiled in {time.perf_counter() - t0:.0f} s.\n"
    )
    rows.append("| row | temp MiB (fraction) | extra FLOPs % | seconds |")
    rows.append("|---|---:|---:|---:|")
    for r in builtins:
        rows.append(
            f"| {r.policy} | {r.temp_bytes / MIB:.2f} ({r.temp_bytes / base.temp_bytes:.3f}) | "
            f"{r.extra_flops_pct:.1f} | compile {r.compile_seconds:.1f} |"
        )
    floor_checked = False
    for b in budgets:
        t1 = time.perf_counter()
        try:
            plan = jremat.plan(loss, params, batch, budget=b)
            label = f"jremat @ {b}"
        except jremat.InfeasibleBudgetError as e:
            rows.append(
                f"| jremat @ {b} | infeasible: floor {e.smallest_reachable} | - | "
                f"plan {time.perf_counter() - t1:.0f} |"
            )
            print(rows[-1], flush=True)
            if floor_checked:
                continue
            floor_checked = True  # does the floor it states hold? plan there
            b, t1 = e.smallest_reachable, time.perf_counter()
            plan, label = jremat.plan(loss, params, batch, budget=b), f"jremat @ its floor {b}"
        plan_s = time.perf_counter() - t1
        ran, _, _ = step_figures(jremat.rematerialize(loss, plan), params, batch)
        fits = [r for r in builtins if r.temp_bytes <= b * base.temp_bytes]
        best = min(fits, key=lambda r: r.flops, default=None)
        extra = 100 * (plan.measured_flops / base.flops - 1)
        versus = "none fits" if best is None else f"{best.policy} {best.extra_flops_pct:.1f}"
        met = "met" if ran.temp_bytes <= b * base.temp_bytes else "MISSED"
        rows.append(
            f"| {label} ({met} on the jit(grad) step) | {ran.temp_bytes / MIB:.2f} "
            f"({ran.temp_bytes / base.temp_bytes:.3f}) | {extra:.1f} (best built-in that fits: "
            f"{versus}) | plan {plan_s:.0f} ({plan_s / base.compile_seconds:.1f}x the plain "
            "compile) |"
        )
        print(rows[-1], flush=True)
    return rows


def xla_section(limits=(25, 15)) -> list[str]:
    mesh = jremat.target_mesh("tpu:v5e:1x1")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    s = NamedSharding(mesh, P())
    layers, d, h, batch = 8, 1024, 4096, 65536

    def mlp(params, x):
        for w1, w2 in params:
            x = x + jax.nn.gelu(x @ w1) @ w2
        return jnp.mean(x.astype(jnp.float32) ** 2)

    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s)  # noqa: E731
    params = [(sds((d, h)), sds((h, d))) for _ in range(layers)]
    x = sds((batch, d))
    lowered = jax.jit(jax.value_and_grad(mlp)).lower(params, x)
    t0 = time.perf_counter()
    plain = lowered.compile()
    plain_s = time.perf_counter() - t0
    base, base_flops = MemoryFigures.of(plain), xla_flops(plain)
    rows = [
        "\n## XLA's own rematerialization on TPU\n",
        f"A residual MLP, {layers} layers, {d} -> {h} -> {d}, bf16, batch {batch}, one v5e "
        f"chip: unrematerialized footprint {base.footprint_bytes / 2**30:.2f} GiB, temp "
        f"{base.temp_bytes / 2**30:.2f} GiB; plain compile {plain_s:.0f} s. The TPU compiler "
        "rematerializes by itself when a program exceeds its memory limit; the compile option "
        "`xla_jf_rematerialization_percent_shared_memory_limit` lowers that limit (percent of "
        "16 GiB HBM). jremat plans with the footprint XLA reached as its byte budget.\n",
        "| limit | XLA: footprint GiB | XLA: extra FLOPs % | jremat: footprint GiB "
        "| jremat: extra FLOPs % | jremat plan s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for pct in limits:
        exe = lowered.compile(
            compiler_options={"xla_jf_rematerialization_percent_shared_memory_limit": pct}
        )
        mem, flops = MemoryFigures.of(exe), xla_flops(exe)
        t1 = time.perf_counter()
        try:
            plan = jremat.plan(mlp, params, x, budget=int(mem.footprint_bytes))
            ours = (
                f"{plan.measured_footprint_bytes / 2**30:.2f} | "
                f"{100 * (plan.measured_flops / base_flops - 1):.1f}"
            )
        except jremat.InfeasibleBudgetError as e:
            ours = f"infeasible (floor {e.smallest_reachable / 2**30:.2f} GiB) | -"
        rows.append(
            f"| {pct}% | {mem.footprint_bytes / 2**30:.2f} | "
            f"{100 * (flops / base_flops - 1):.1f} | {ours} | {time.perf_counter() - t1:.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,gpt2,unet,scan")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--no-xla", action="store_true", help="skip section 2")
    parser.add_argument("--xla-limits", default="25,15", help="section 2's limits, percent of HBM")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "tpu.md"))
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    t0 = time.perf_counter()
    lines = [
        "# TPU plans, compiled from a CPU host",
        "",
        "`python benchmarks/tpu.py`: every program compiled by libtpu "
        f"(jax {jax.__version__}) for compile-only v5e devices on a 2-CPU host; the memory "
        "figure is the TPU compiler's peak less arguments and outputs "
        "(docs/guides/tpu.md). Fractions are of the unrematerialized `jit(value_and_grad)` "
        "step's figure; \"met\" checks the user's `jit(grad)` step under the plan, compiled "
        "again for the TPU. Seconds are this host's, under load from other work.",
        "",
        "## The zoo on one v5e chip and a 2x2 mesh",
    ]

    def write(done: bool) -> None:  # after each cell: a long run leaves what it measured
        tail = [f"\nTotal {time.perf_counter() - t0:.0f} s."] if done else ["\n(running)"]
        with open(args.out, "w") as f:
            f.write("\n".join(lines + tail) + "\n")

    for target in args.targets.split(","):
        for name in args.models.split(","):
            print(f"== {name} on {target}", flush=True)
            lines += zoo_cell(name, target, budgets)
            write(False)
    if not args.no_xla:
        lines += xla_section([int(p) for p in args.xla_limits.split(",")])
    write(True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
