"""The `jremat` command line: `jremat compare` runs the policy comparison on a model."""

from __future__ import annotations

import argparse
import sys
import time


def _budgets(text: str) -> list:
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(float(part) if "." in part or part.startswith("0") else int(part))
        except ValueError:
            out.append(part)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jremat` console script; returns the exit status."""
    from . import models

    parser = argparse.ArgumentParser(prog="jremat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="compare remat policies on a model (compiled figures)")
    cmp.add_argument(
        "--model",
        default="gpt2",
        choices=models.NAMES,
        help="workload (default: gpt2, HF Flax GPT-2 on real text)",
    )
    cmp.add_argument(
        "--budgets",
        default="0.25,0.5,0.75",
        type=_budgets,
        help='comma-separated budgets: fractions, bytes or sizes like "64MiB"',
    )
    fmt = cmp.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    fmt.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown")
    args = parser.parse_args(argv)

    from .budget import parse_budget
    from .comparison import compare

    try:
        for b in args.budgets:
            parse_budget(b)
        t0 = time.perf_counter()
        work = models.get(args.model)
        result = compare(
            work.loss, work.params, work.batch, budgets=args.budgets, progress=sys.stderr.isatty()
        )
    except (ValueError, TypeError, ImportError) as e:
        print(f"jremat compare: error: {e}", file=sys.stderr)
        return 2
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
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
