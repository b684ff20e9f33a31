"""jremat: automatic, budgeted rematerialization and gradient accumulation for JAX and Flax.

trace -> plan (planners, rewrite) -> compile (XLA's figures) -> search (a verified plan)
      -> frontends (auto, Flax) | training (accumulation) -> reports (measure, compare, explain)

The implementation lives in `jremat._src`, one subpackage per layer of that flow; every public
name is re-exported here (see `docs/architecture.md`; the reasoning is in `docs/design.md`).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from jremat._src.base.logs import log_to_stderr

if TYPE_CHECKING:  # the names below, for type checkers and IDEs; at run time they load lazily
    from jremat import policies
    from jremat._src.base.budget import BudgetLike, parse_budget
    from jremat._src.base.errors import (
        InfeasibleBudgetError,
        PlanMismatchError,
        UnsupportedBackendError,
    )
    from jremat._src.base.targets import DEVICE_MEMORY_BYTES, target_mesh
    from jremat._src.compile.xla import MEMORY_FIGURES
    from jremat._src.frontends.auto import auto
    from jremat._src.frontends.blocks import disabled
    from jremat._src.plan.offload import OffloadCost, host_offload_effective
    from jremat._src.plan.plan import Plan, ScanPiece, ScanSetting, Segment
    from jremat._src.plan.rewrite import rematerialize
    from jremat._src.reports.comparison import Comparison, compare
    from jremat._src.reports.explain import ExplainRow, Explanation, explain
    from jremat._src.reports.measure import Measurement, measure
    from jremat._src.search.solve import plan
    from jremat._src.trace.graph import Graph, trace
    from jremat._src.training.accumulation import accumulate, has_updated, state_bytes
    from jremat._src.training.microbatching import microbatch
    from jremat._src.training.training_plan import TrainingPlan, plan_training

__version__ = "0.3.0"

# The library is quiet unless the program configures logging (`jremat.log_to_stderr()`).
logging.getLogger(__name__).addHandler(logging.NullHandler())

# Public name -> the module defining it. They are imported on first access, so that
# `import jremat` (and `jremat --help`) does not import jax until a name is used.
_EXPORTS = {
    "policies": "jremat.policies",
    "BudgetLike": "jremat._src.base.budget",
    "parse_budget": "jremat._src.base.budget",
    "InfeasibleBudgetError": "jremat._src.base.errors",
    "PlanMismatchError": "jremat._src.base.errors",
    "DEVICE_MEMORY_BYTES": "jremat._src.base.targets",
    "target_mesh": "jremat._src.base.targets",
    "MEMORY_FIGURES": "jremat._src.compile.xla",
    "UnsupportedBackendError": "jremat._src.base.errors",
    "auto": "jremat._src.frontends.auto",
    "disabled": "jremat._src.frontends.blocks",
    "OffloadCost": "jremat._src.plan.offload",
    "host_offload_effective": "jremat._src.plan.offload",
    "Plan": "jremat._src.plan.plan",
    "ScanPiece": "jremat._src.plan.plan",
    "ScanSetting": "jremat._src.plan.plan",
    "Segment": "jremat._src.plan.plan",
    "rematerialize": "jremat._src.plan.rewrite",
    "Comparison": "jremat._src.reports.comparison",
    "compare": "jremat._src.reports.comparison",
    "ExplainRow": "jremat._src.reports.explain",
    "Explanation": "jremat._src.reports.explain",
    "explain": "jremat._src.reports.explain",
    "Measurement": "jremat._src.reports.measure",
    "measure": "jremat._src.reports.measure",
    "plan": "jremat._src.search.solve",
    "Graph": "jremat._src.trace.graph",
    "trace": "jremat._src.trace.graph",
    "accumulate": "jremat._src.training.accumulation",
    "has_updated": "jremat._src.training.accumulation",
    "state_bytes": "jremat._src.training.accumulation",
    "microbatch": "jremat._src.training.microbatching",
    "TrainingPlan": "jremat._src.training.training_plan",
    "plan_training": "jremat._src.training.training_plan",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jremat' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"jremat.{name}" else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "BudgetLike",
    "DEVICE_MEMORY_BYTES",
    "MEMORY_FIGURES",
    "UnsupportedBackendError",
    "target_mesh",
    "Comparison",
    "ExplainRow",
    "Explanation",
    "Graph",
    "InfeasibleBudgetError",
    "Measurement",
    "OffloadCost",
    "Plan",
    "PlanMismatchError",
    "ScanPiece",
    "ScanSetting",
    "Segment",
    "TrainingPlan",
    "accumulate",
    "auto",
    "compare",
    "disabled",
    "explain",
    "has_updated",
    "log_to_stderr",
    "host_offload_effective",
    "measure",
    "microbatch",
    "parse_budget",
    "plan",
    "plan_training",
    "policies",
    "rematerialize",
    "state_bytes",
    "trace",
]
