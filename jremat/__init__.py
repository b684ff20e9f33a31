"""jremat: automatic, budgeted rematerialization and gradient accumulation for JAX and Flax.

trace -> plan (planners, rewrite) -> compile (XLA's figures) -> search (a verified plan)
      -> frontends (auto, Flax) | training (accumulation) -> reports (measure, compare, explain)

The implementation lives in `jremat._src`, one subpackage per layer of that flow; every public
name is re-exported here (see `docs/architecture.md`; the reasoning is in `docs/design.md`).
"""

from jremat import policies
from jremat._src.base.budget import parse_budget
from jremat._src.base.errors import InfeasibleBudgetError, PlanMismatchError
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

__version__ = "0.2.0"

__all__ = [
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
