"""Reports: `measure`, `compare` and its Pareto frontier and plot, `explain`."""
