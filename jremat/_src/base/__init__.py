"""Arguments, budgets and errors: checks every public entry point shares; JAX version differences (`compat`)."""
