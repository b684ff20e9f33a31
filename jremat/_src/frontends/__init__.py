"""Front ends: `jremat.auto` and its plan cache, for functions, Flax linen and Flax NNX."""
