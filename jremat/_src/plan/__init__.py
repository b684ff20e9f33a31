"""Plans: the `Plan` type, checkpoint policies and fixed recipes, the planners, host offload, and the rewrite that runs a plan."""
