"""The benchmarks page's default comparison is the committed output of
`benchmarks/readme_tables.py`.

Text only (nothing compiles): every `<!-- readme:NAME -->` block of docs/benchmarks/index.md
equals the block of that name in `benchmarks/results/readme.md`, and the sentence about the
table states what the table's own rows say. After a change that moves the figures, run
`python benchmarks/readme_tables.py`, which rewrites both.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "readme_tables", ROOT / "benchmarks" / "readme_tables.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_blocks_equal_the_committed_results():
    script = _script()
    page = script.blocks((ROOT / "docs" / "benchmarks" / "index.md").read_text())
    results = script.blocks((ROOT / "benchmarks" / "results" / "readme.md").read_text())
    assert set(page) == set(results) == {"compare-table", "compare-claims"}
    for name, text in results.items():
        assert page[name] == text, f"benchmarks page block {name!r} differs from the results file"
    assert not script.blocks((ROOT / "README.md").read_text())  # measured figures: docs only


def test_claims_follow_from_the_table():
    """The sentence's percentages are the table's: auto's row at each budget, and the per-layer
    or sqrt(n) row with the fewest extra FLOPs among those whose temp fits that budget."""
    script = _script()
    results = script.blocks((ROOT / "benchmarks" / "results" / "readme.md").read_text())
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in results["compare-table"].splitlines()[3:-1]
        if line.startswith("|")
    ]
    base_temp = float(next(r for r in rows if r[0] == "no remat")[2])
    builtins = [r for r in rows if r[1] == "-" and r[0] != "no remat"]
    claims = results["compare-claims"]
    auto = [r for r in rows if r[0] == "jremat auto"]
    assert [float(r[1]) for r in auto] == list(script.BUDGETS)
    for r in auto:
        budget, extra = float(r[1]), float(r[4])
        assert float(r[2]) <= budget * base_temp + 0.01  # MiB rounded to 2 decimals
        fits = [b for b in builtins if float(b[2]) <= budget * base_temp]
        best = min(fits, key=lambda b: float(b[4]))
        said = re.search(
            rf"([\d.]+)% vs ([\d.]+)% \({re.escape(best[0])}\) at {budget}(;|\.\n)", claims
        )
        assert said, (budget, best[0], claims)
        assert float(said.group(1)) == extra and float(said.group(2)) == float(best[4])
