"""The one compile-and-measure path: `Program` compiles a training step under a plan and
reads XLA's figures; `BlockProgram` measures a Flax block's kept bytes through the same path
(`Program.step`, with the `KeptBytes` objective). Every compile in jremat goes through
`xla.compile_jitted`, and `xla.MemoryFigures` is the one reading of `memory_analysis()`."""
