"""jremat: automatic, budgeted rematerialization and gradient accumulation for JAX and Flax.

trace -> solve (planners) -> Plan -> rewrite (jax.checkpoint per segment) -> verify (XLA)
"""

from . import policies
from .accumulation import accumulate, has_updated, state_bytes
from .budget import parse_budget
from .comparison import Comparison, compare
from .decorator import auto
from .errors import InfeasibleBudgetError, PlanMismatchError
from .explain import ExplainRow, Explanation, explain
from .measure import Measurement, measure
from .microbatching import microbatch
from .offload import OffloadCost
from .plan import Plan, Segment
from .planning import plan
from .rewrite import rematerialize
from .trace import Graph, trace
from .training_plan import TrainingPlan, plan_training

__version__ = "0.1.0"

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
    "Segment",
    "TrainingPlan",
    "accumulate",
    "auto",
    "compare",
    "explain",
    "has_updated",
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
