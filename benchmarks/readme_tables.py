"""Regenerate the default comparison the docs' benchmarks page quotes (one command).

    python benchmarks/readme_tables.py      # writes benchmarks/results/readme.md and .json
    python benchmarks/readme_tables.py --render   # the Markdown again from the JSON

Runs `jremat compare` on the default model (Hugging Face Flax GPT-2, 6 layers, d=128, a batch
of 8x128 byte tokens) at budgets 0.25 / 0.5 / 0.75 with `solver="auto"`, and writes each block
docs/benchmarks/index.md shows between `<!-- readme:NAME -->` and `<!-- /readme:NAME -->`
markers (the names date from when README.md showed them): the
comparison table (compiled figures only: XLA's `memory_analysis()` temp and footprint bytes,
`cost_analysis()` FLOPs, the gradient difference; no seconds, which depend on the machine) and
the sentence comparing `auto` with the built-ins, and replaces the same blocks in
docs/benchmarks/index.md (`--no-docs`: only the results files); `tests/test_readme_tables.py`
checks that the page's blocks equal this file's.
About a minute on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "readme.md")
PAGE = os.path.join(os.path.dirname(HERE), "docs", "benchmarks", "index.md")
BUDGETS = (0.25, 0.5, 0.75)
#: Columns the benchmarks page shows (the table's seconds columns depend on the machine).
COLUMNS = (
    "policy",
    "budget",
    "temp MiB",
    "footprint MiB",
    "extra FLOPs %",
    "max grad diff",
    "Pareto",
)


def block(name: str, text: str) -> str:
    """`text` between the markers the benchmarks page and the results file share."""
    return f"<!-- readme:{name} -->\n{text.strip()}\n<!-- /readme:{name} -->"


def blocks(text: str) -> dict[str, str]:
    """Every `<!-- readme:NAME -->` block of `text`, by name (markers included)."""
    found = re.finditer(r"<!-- readme:([\w-]+) -->\n.*?\n<!-- /readme:\1 -->", text, re.S)
    return {m.group(1): m.group(0) for m in found}


def select_columns(markdown: str, columns=COLUMNS) -> str:
    """The rows of a Markdown table (`Comparison.to_markdown`) with only `columns`, in their
    order; lines after the table (notes) are kept as they are.

    Raises:
      ValueError: a column of `columns` is not in the table.
    """
    lines = markdown.strip().splitlines()
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    head = split(lines[0])
    missing = [c for c in columns if c not in head]
    if missing:
        raise ValueError(f"columns {missing} not in the table's header {head}")
    keep = [head.index(c) for c in columns]
    numeric = {"temp", "footprint", "extra", "max"}  # right-aligned columns' first words
    out = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if c.split()[0] in numeric else "---" for c in columns) + "|",
    ]
    for i, line in enumerate(lines[2:], start=2):
        if not line.startswith("|"):
            # the legend, without the columns this table leaves out
            legend = [re.sub(r" ?compile s / plan s: [^;]*;", "", x) for x in lines[i:]]
            out += legend
            break
        cells = [split(line)[k] for k in keep]
        out.append(("| " + " | ".join(cells) + " |").replace("|  |", "| |"))
    return "\n".join(out)


def auto_sentence(result) -> str:
    """For each budget: `auto`'s extra FLOPs against the built-in row (per layer, sqrt(n))
    that fits the budget's temp bytes with the fewest."""
    builtins = [r for r in result.rows if r.ok and r.budget is None and r.policy != "no remat"]
    parts = []
    for r in result.rows:
        if r.budget is None:
            continue
        if not r.ok:
            parts.append(f"no plan at {r.budget} ({r.status})")
            continue
        fits = [b for b in builtins if b.temp_bytes <= r.budget_temp_bytes]
        best = min(fits, key=lambda b: b.extra_flops_pct, default=None)
        against = f"{best.extra_flops_pct:.1f}% ({best.policy})" if best else "none fits"
        parts.append(f"{r.extra_flops_pct:.1f}% vs {against} at {r.budget}")
    return (
        "Extra FLOPs of `auto` against the cheapest built-in that fits the same budget: "
        + "; ".join(parts)
        + "."
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument(
        "--no-docs",
        action="store_true",
        help="write only the results files, not docs/benchmarks/index.md",
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="rewrite the Markdown from the committed JSON (no compiles)",
    )
    args = ap.parse_args(argv)
    from jremat import models
    from jremat._src.reports.comparison import Comparison, compare

    data = os.path.splitext(args.out)[0] + ".json"
    work = models.get("gpt2", size="default")
    if args.render:
        result = Comparison.from_json(data, description=work.description)
        platform = "rendered from " + os.path.basename(data)
    else:
        result = compare(
            work.loss,
            work.params,
            work.batch,
            budgets=BUDGETS,
            solvers=("auto",),
            description=work.description,
            progress=False,
        )
        result.to_json(data)
        platform = f"jax {jax.__version__}, {jax.devices()[0].platform}"
    md = [
        "# The default comparison (docs/benchmarks/index.md)",
        "",
        f"Written by `python benchmarks/readme_tables.py` ({platform}): `jremat compare` on "
        f"{result.description}, unrematerialized temp "
        f"{result.baseline_temp_bytes / 2**20:.2f} MiB; every row compiled "
        f"(`{os.path.basename(data)}` has the full rows).",
        "",
        block("compare-table", select_columns(result.to_markdown())),
        "",
        block("compare-claims", auto_sentence(result)),
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    if not args.no_docs:
        write_page(blocks("\n".join(md)))
    return 0


def write_page(new: dict[str, str], path: str = PAGE) -> None:
    """Replace each `<!-- readme:NAME -->` block of the benchmarks page with the block of that
    name.

    Raises:
      ValueError: the page lacks one of the blocks (its markers were edited away).
    """
    with open(path) as f:
        text = f.read()
    old = blocks(text)
    missing = sorted(set(new) - set(old))
    if missing:
        raise ValueError(f"{path} has no <!-- readme:NAME --> block for {missing}")
    for name, b in new.items():
        text = text.replace(old[name], b)
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
