"""The one compile-and-measure path: `Program` compiles a training step under a plan and
reads XLA's figures; `BlockProgram` measures a Flax block's kept bytes through the same path."""
