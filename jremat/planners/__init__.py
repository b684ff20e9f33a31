"""Planners: (graph, budget) -> Plan. Each module is one algorithm."""

from .chain import ChainPlanner

PLANNERS = {"chain": ChainPlanner}

__all__ = ["PLANNERS", "ChainPlanner"]
