"""The `jremat` command line: `jremat compare` runs the policy comparison on a model.

    jremat compare [--model gpt2] [--size default|tiny] [--budgets 0.25,0.5,0.75]
                   [--policies NAME,...] [--solvers auto,...] [--runs N]
                   [--target local|tpu:v5e:2x2]
                   [--format markdown|csv|json | --json]
                   [--plot pareto.png] [--quiet]
    jremat --version

Markdown (the default) prints a caption and the table; `--format csv` prints CSV and
`--format json` (or `--json`) a JSON list of row objects, with nothing else on stdout. Progress
goes to stderr: log lines (row, budget, elapsed seconds), and a progress bar when stderr is a
terminal. The exit status is 0 on success, 2 for invalid arguments or a missing optional
package, and 1 when the comparison itself fails.

Parsing the arguments (and `--help`, `--version`) imports no jax: the work's modules are
imported once the arguments are known.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import traceback


def _budgets(text: str) -> list:
    from jremat._src.base.budget import parse_budget
    from jremat._src.reports.comparison import parse_budget_text

    out = [parse_budget_text(p) for p in text.split(",") if p.strip()]
    if not out:
        raise argparse.ArgumentTypeError("give at least one budget, e.g. 0.25,0.5")
    for b in out:
        try:
            parse_budget(b)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return out


def _names(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


#: The planners `--solvers` accepts: `jremat.plan`'s `solver=` names (checked against
#: `jremat._src.search.solve.SOLVERS` in tests; not imported here, which would import jax).
SOLVER_NAMES = ("auto", "chain", "greedy", "dtr", "milp")


def _parser() -> argparse.ArgumentParser:
    from jremat import __version__, models

    parser = argparse.ArgumentParser(prog="jremat", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"jremat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser(
        "compare",
        help="compare remat policies on a model (compiled figures)",
        description="Compile one training step of a model under each remat policy and "
        "report XLA's temp memory, extra FLOPs and gradient differences.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="models:\n"
        + "\n".join(f"  {n:11s} {models.describe(n)}" for n in models.NAMES)
        + "\n\nextras: the Hugging Face models need transformers (pip install "
        '"jremat[models]"), resnet also jax-resnet (pip install "jremat[zoo]"); --plot needs '
        'matplotlib (pip install "jremat[plot]")'
        + "\npolicy names: jremat.policies.names() and jremat.policies.preset_names()",
    )
    cmp.add_argument(
        "--model", default="gpt2", choices=models.NAMES, help="workload (default: gpt2)"
    )
    cmp.add_argument(
        "--size",
        default="default",
        choices=models.SIZES,
        help="model size preset: default (gpt2: about a minute on a 2-core machine, unloaded; "
        "other models several minutes) or tiny (20-90 s per model there; for smoke tests)",
    )
    cmp.add_argument(
        "--budgets",
        default=None,
        type=_budgets,
        help='comma-separated planner budgets: fractions, bytes or sizes like "64MiB" '
        "(default: 0.25,0.5,0.75, or, when the model's lowest reference plan holds more than "
        "0.25 of its no-remat temp, three budgets from that lowest fraction up to 1, so that "
        "every default row is feasible)",
    )
    cmp.add_argument(
        "--policies",
        type=_names,
        default=None,
        help="comma-separated policies/presets to compare (default: JAX's built-ins per "
        "layer and sqrt(n) segments)",
    )
    cmp.add_argument(
        "--solvers",
        type=_names,
        default=["auto"],
        help="comma-separated planners run at every budget: "
        f"{', '.join(SOLVER_NAMES)} (default: auto, as jremat.plan)",
    )
    cmp.add_argument(
        "--target",
        default="local",
        help='what to compile for: "local" (this host\'s devices, the default; rows run and '
        'their gradients are compared) or a TPU topology, "tpu:v5e:1x1", "tpu:v5e:2x2" '
        "(compiled for those TPU chips from any host, never run; needs libtpu: pip install "
        '"jremat[tpu]"). The batch is split over the devices on its first axis',
    )
    cmp.add_argument(
        "--compile-budget",
        type=int,
        default=None,
        metavar="N",
        help="whole-program compiles each planner row may spend, verification included "
        "(at least 3; default: no limit); see docs/guides/planning-cost.md",
    )
    cmp.add_argument(
        "--runs", type=int, default=0, help="time this many executions of each step (default 0)"
    )
    fmt = cmp.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="same as --format json")
    fmt.add_argument(
        "--format",
        choices=("markdown", "csv", "json"),
        default="markdown",
        help="output format on stdout (json: a list of row objects)",
    )
    cmp.add_argument(
        "--plot",
        metavar="PATH",
        help="also save a Pareto plot (temp memory vs extra FLOPs); needs matplotlib: pip "
        'install "jremat[plot]"',
    )
    cmp.add_argument(
        "-q", "--quiet", action="store_true", help="no progress on stderr (errors still are)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jremat` console script; returns the exit status (0, 1 or 2)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help)
        return int(e.code or 0)
    # before JAX starts: a TPU target compiles beside any other process that loaded libtpu
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return _compare(args)


@contextlib.contextmanager
def _stdout_to_stderr():
    """While the comparison runs, send what anything prints to stdout (Python's `print`, or a
    native library writing to file descriptor 1, such as a solver's banner) to stderr, so that
    stdout carries only the table, CSV or JSON."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1: nothing native can print there either
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _bars_and_logs(quiet: bool):
    """On a terminal, log lines printed above the progress bar (tqdm's logging redirect)."""
    if quiet or not sys.stderr.isatty():
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logging.getLogger("jremat")])


def _error(msg: str, code: int) -> int:
    print(f"jremat compare: error: {msg}", file=sys.stderr)
    return code


def _compare(args: argparse.Namespace) -> int:
    """`jremat compare` with jremat's log records on stderr (unless --quiet) while it runs."""
    from jremat import log_to_stderr

    handler = None if args.quiet else log_to_stderr()
    try:
        return _run_compare(args)
    finally:
        if handler is not None:  # leave a program calling main() as it was
            logging.getLogger("jremat").removeHandler(handler)


def _run_compare(args: argparse.Namespace) -> int:
    from jremat import models
    from jremat._src.reports.comparison import compare, fixed_jobs
    from jremat._src.search.solve import SOLVERS

    if args.runs < 0:
        return _error(f"--runs must be >= 0, got {args.runs}", 2)
    try:
        fixed_jobs(args.policies, None)  # validates the names before anything compiles
    except ValueError as e:
        return _error(f"--policies: {e}", 2)
    bad = [s for s in args.solvers if s not in SOLVERS]
    if bad or not args.solvers:
        named = ", ".join(map(repr, bad)) or "none given"
        return _error(f"--solvers: {named}: accepted planners: {', '.join(SOLVERS)}", 2)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error('--plot needs matplotlib: pip install "jremat[plot]"', 2)
        if os.path.isdir(args.plot):
            return _error(
                f"--plot {args.plot!r} is a folder: give a file, e.g. "
                f"{os.path.join(args.plot, 'pareto.png')!r}",
                2,
            )
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            return _error(f"--plot {args.plot!r}: folder {folder!r} does not exist", 2)
        # the file matplotlib writes: with no suffix it adds ".png"; a suffix it cannot write
        # is refused now, not after the comparison has run
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        suffix = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if not suffix:
            args.plot += ".png"
        elif suffix not in formats:
            return _error(
                f"--plot {args.plot!r}: matplotlib cannot write .{suffix} files; accepted: "
                + ", ".join(f".{f}" for f in sorted(formats)),
                2,
            )
    t0 = time.perf_counter()
    if not args.quiet:
        print(
            f"jremat compare: building {args.model} ({args.size} size)", file=sys.stderr, flush=True
        )
    try:
        with _stdout_to_stderr():
            work = models.get(args.model, size=args.size)
    except (ImportError, ValueError, TypeError) as e:
        return _error(str(e), 2)
    params, batch = work.params, work.batch
    if args.target != "local":
        if args.runs:
            return _error(f"--runs times steps, which a --target {args.target} cannot run", 2)
        from jremat._src.base.targets import abstract_on, target_mesh

        try:
            mesh = target_mesh(args.target)
        except (ValueError, TypeError, RuntimeError) as e:
            return _error(f"--target: {e}", 2)
        params, batch = abstract_on(params, mesh), abstract_on(batch, mesh, "data")
        work.description += f" on {args.target}"
    try:
        with _stdout_to_stderr(), _bars_and_logs(args.quiet):
            result = compare(
                work.loss,
                params,
                batch,
                policies=args.policies,
                budgets=args.budgets,
                solvers=args.solvers,
                runs=args.runs,
                compile_budget=args.compile_budget,
                description=work.description,
                progress=sys.stderr.isatty() and not args.quiet,
            )
        fmt_name = "json" if args.json else args.format
        if fmt_name == "json":
            print(result.to_json())
        elif fmt_name == "csv":
            print(result.to_csv(), end="")
        else:
            print(f"# jremat compare: {work.description}")
            print(
                f"unrematerialized temp: {result.baseline_temp_bytes / 2**20:.2f} MiB; "
                f"total {time.perf_counter() - t0:.0f} s\n"
            )
            print(result.to_markdown())
        sys.stdout.flush()
        if args.plot:
            with _stdout_to_stderr():
                result.plot(args.plot)
            print(f"plot written to {args.plot}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - any failure: traceback, then exit status 1
        traceback.print_exc()
        return _error(f"{type(e).__name__}: {e}", 1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
