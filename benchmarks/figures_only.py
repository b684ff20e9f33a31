"""Figures-only compiles: the same memory and cost figures as the default compile, sooner.

    python benchmarks/figures_only.py            # every zoo model, a few minutes
    python benchmarks/figures_only.py mlp gpt2   # some of them

For each model, the unrematerialized step and two rematerialized ones (per-layer
`nothing_saveable`; `dots_with_no_batch_dims_saveable` on sqrt(n) groups), each as
`jit(value_and_grad)` and `jit(grad)`: compiled with the default options, then with
`xla.FIGURES_ONLY_OPTIONS` of this platform (`compile_jitted(..., figures_only=True)`).
Prints both compile seconds and whether `memory_analysis()` and the FLOPs are equal
(docs/design.md#figures-only-compiles). Exits 1 on any difference.
"""

from __future__ import annotations

import sys
import time

import jax
from plan_cost import workload

MODELS = ("mlp", "gpt2:6", "scan:6", "vit", "resnet", "unet")


def main(models: list[str]) -> int:
    from jremat._src.compile import xla
    from jremat._src.compile.program import Program
    from jremat._src.plan.recipes import recipe_plan

    print(
        f"jax {jax.__version__}, {jax.default_backend()}: "
        f"{xla.FIGURES_ONLY_OPTIONS.get(jax.default_backend())}\n"  # a table needs a blank line
    )
    print("| model | plan | step | default s | figures-only s | same figures |")
    print("|---|---|---|---|---|---|")
    differ = 0
    for name in models:
        loss, params, batch = workload(name)
        prog = Program(loss, (params, batch), 0)
        plans = [
            None,
            recipe_plan(prog.graph, "nothing_saveable"),
            recipe_plan(prog.graph, "dots_with_no_batch_dims_saveable", "sqrt_n"),
        ]
        for plan in plans:
            f = prog.objective.step_fn(prog, plan)
            for value in (True, False):
                jitted = jax.jit(xla.step_grad(f, (0,), value=value))
                t0 = time.perf_counter()
                default = xla.compile_jitted(jitted, (params, batch))
                t1 = time.perf_counter()
                cheap = xla.compile_jitted(jitted, (params, batch), figures_only=True)
                t2 = time.perf_counter()
                same = xla.MemoryFigures.of(default) == xla.MemoryFigures.of(cheap) and (
                    xla.xla_flops(default) == xla.xla_flops(cheap)
                )
                differ += not same
                label = "no remat" if plan is None else plan.solver
                step = "value_and_grad" if value else "grad"
                print(
                    f"| {name} | {label} | {step} | {t1 - t0:.2f} | {t2 - t1:.2f} | {same} |",
                    flush=True,
                )
    print(f"\n{differ} programs with other figures")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(MODELS)))
