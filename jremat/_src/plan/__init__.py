"""Plans: the `Plan` type, fixed recipes, the planners, host offload, and the rewrite that
runs a plan."""
