"""Training: gradient accumulation over optax, in-step microbatching, and `plan_training`."""
