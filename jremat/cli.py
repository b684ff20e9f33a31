"""The `jremat` command line: `jremat compare` runs the policy comparison on a model.

    jremat compare [--model gpt2] [--size default|tiny] [--budgets 0.25,0.5,0.75]
                   [--policies NAME,...] [--solvers auto,...] [--runs N]
                   [--format markdown|csv|json | --json]
                   [--plot pareto.png]

Markdown (the default) prints a caption and the table; `--format csv` prints CSV and
`--format json` (or `--json`) a JSON list of row objects, with nothing else on stdout. The exit
status is 0 on success, 2 for invalid arguments or a missing optional package, and 1 when the
comparison itself fails.
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


def _parser() -> argparse.ArgumentParser:
    from jremat import models
    from jremat._src.search.solve import SOLVERS

    parser = argparse.ArgumentParser(prog="jremat", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser(
        "compare",
        help="compare remat policies on a model (compiled figures)",
        description="Compile one training step of a model under each remat policy and "
        "report XLA's temp memory, extra FLOPs and gradient differences.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="models:\n"
        + "\n".join(f"  {n:11s} {models.describe(n)}" for n in models.NAMES)
        + "\n\npolicy names: jremat.policies.names() and jremat.policies.preset_names()",
    )
    cmp.add_argument(
        "--model", default="gpt2", choices=models.NAMES, help="workload (default: gpt2)"
    )
    cmp.add_argument(
        "--size",
        default="default",
        choices=models.SIZES,
        help="model size preset: default (minutes on a laptop CPU) or tiny (seconds)",
    )
    cmp.add_argument(
        "--budgets",
        default=[0.25, 0.5, 0.75],
        type=_budgets,
        help='comma-separated planner budgets: fractions, bytes or sizes like "64MiB" '
        "(default: 0.25,0.5,0.75)",
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
        f"{', '.join(SOLVERS)} (default: auto, as jremat.plan)",
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
        "--plot", metavar="PATH", help="also save a Pareto plot (temp memory vs extra FLOPs)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jremat` console script; returns the exit status (0, 1 or 2)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help)
        return int(e.code or 0)
    _show_progress()
    return _compare(args)


def _show_progress() -> None:
    """Planning stages (trace, compiles, rounds, with seconds) on stderr: the "jremat" logger
    at INFO, unless the caller configured it already."""
    log = logging.getLogger("jremat")
    if log.level == logging.NOTSET and not any(
        not isinstance(h, logging.NullHandler) for h in log.handlers
    ):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("jremat: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


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


def _error(msg: str, code: int) -> int:
    print(f"jremat compare: error: {msg}", file=sys.stderr)
    return code


def _compare(args: argparse.Namespace) -> int:
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
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            return _error(f"--plot {args.plot!r}: folder {folder!r} does not exist", 2)
    t0 = time.perf_counter()
    try:
        with _stdout_to_stderr():
            work = models.get(args.model, size=args.size)
    except (ImportError, ValueError, TypeError) as e:
        return _error(str(e), 2)
    try:
        with _stdout_to_stderr():
            result = compare(
                work.loss,
                work.params,
                work.batch,
                policies=args.policies,
                budgets=args.budgets,
                solvers=args.solvers,
                runs=args.runs,
                description=work.description,
                progress=sys.stderr.isatty(),
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
