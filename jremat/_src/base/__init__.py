"""Arguments, budgets and errors: the checks every public entry point shares, mesh and
sharding arguments, and every JAX version difference (`compat`)."""
