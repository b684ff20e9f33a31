"""jremat's implementation, in layers that follow the data flow (imports only go down).

    base      arguments, budgets, errors, mesh and sharding checks, JAX version differences
    trace     jaxpr -> Graph: values, equations, FLOPs, residuals, layers, per-device bytes
    plan      the Plan type, recipes, planners, host offload, the rewrite
    compile   the one compile-and-measure path: Program (step temp) and BlockProgram (kept bytes)
    search    solve: calibration, rounds, mixes of recipes, refinement
    frontends `auto` with its plan cache, Flax linen and NNX
    training  accumulation, microbatching, plan_training
    reports   measure, compare, pareto, plot, explain

Everything public is re-exported from `jremat`; modules here are private. The map, and where
a new module goes: docs/architecture.md; the reasoning: docs/design.md.
"""
