"""The `Examples:` of the public names' docstrings (what the API reference shows) run.

Each object's examples run with the standard `doctest` module, as a reader would paste them:
in a fresh namespace (each example imports what it uses), with ELLIPSIS and
NORMALIZE_WHITESPACE. The examples use small arrays on CPU (a 4-layer MLP of 64 x 64 weights
for the planning entry points, 8 x 8 matrices elsewhere) and print booleans, shapes, names and
byte counts fixed by shapes and dtypes, never figures that depend on the machine.
`test_docs.py` runs the examples of the other public docstrings (those not listed here), and
checks that every public name taking arguments has an example.
"""

from __future__ import annotations

import doctest
import importlib
import re
import typing
from pathlib import Path

import pytest

import jremat
from jremat._src.base.budget import Budget

#: the objects (names under `jremat`) whose docstrings must carry a runnable example; this file
#: runs their examples, `test_docs.py` the other public docstrings'
DOCUMENTED = (
    # planning and reports
    "auto",
    "plan",
    "rematerialize",
    "explain",
    "measure",
    "plan_training",
    "compare",
    "Plan",
    "trace",
    "disabled",
    "parse_budget",
    "log_to_stderr",
    "target_mesh",
    # what they return and take
    "Graph",
    "Segment",
    "ScanSetting",
    "ScanPiece",
    "OffloadCost",
    "Comparison",
    "Measurement",
    "Explanation",
    "TrainingPlan",
    # training
    "accumulate",
    "has_updated",
    "state_bytes",
    "microbatch",
    # public modules
    "policies.save_if_flops_per_byte_above",
    "policies.save_dots_in_size_range",
    "policies.dots_and_transcendentals_saveable",
    "policies.names",
    "policies.get",
    "policies.Preset",
    "policies.preset_names",
    "policies.preset",
    "models.get",
    "models.describe",
    "models.sizes",
    "models.init_key",
    "models.require",
    "data.batches",
)
#: the objects whose examples may carry `# doctest: +SKIP` lines, and why
SKIPS = {"target_mesh": "a TPU target needs libtpu, which the jax 0.10 test environment lacks"}
ROOT = Path(__file__).resolve().parent.parent
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _object(name: str) -> object:
    """`jremat.<name>`, importing the public module a dotted name starts with."""
    module, _, attr = name.rpartition(".")
    owner = importlib.import_module(f"jremat.{module}") if module else jremat
    return getattr(owner, attr)


def _examples(name: str) -> doctest.DocTest:
    obj = _object(name)
    finder = doctest.DocTestFinder(recurse=False)
    (test,) = finder.find(obj, f"jremat.{name}", module=False, globs={})
    return test


@pytest.mark.parametrize("name", DOCUMENTED)
def test_docstring_example_passes(name):
    test = _examples(name)
    # `# doctest: +SKIP` only where a line needs what not every install has (target_mesh: libtpu)
    run = [ex for ex in test.examples if not ex.options.get(doctest.SKIP)]
    assert len(run) >= 3, f"jremat.{name} has no (or a trivial) Examples: block"
    assert name in SKIPS or len(run) == len(test.examples), f"jremat.{name}: a skipped example"
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted == len(run)
    assert result.failed == 0, f"jremat.{name}: {result.failed} example(s) failed (output above)"


def test_a_failing_example_fails():
    """The runner above reports a wrong expected output (the check is not vacuous)."""
    test = doctest.DocTestParser().get_doctest(
        ">>> import jremat\n>>> jremat.parse_budget(0.5).fraction\n0.25\n",
        {},
        "wrong",
        None,
        0,
    )
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test, out=lambda _: None)
    assert runner.summarize(verbose=False).failed == 1


def test_budget_like_names_the_accepted_types():
    assert set(typing.get_args(jremat.BudgetLike)) == {float, int, str, Budget}
    for budget in (0.5, 1 << 20, "512MiB", jremat.parse_budget("8GB")):
        assert isinstance(budget, jremat.BudgetLike)
        assert isinstance(jremat.parse_budget(budget), Budget)


def _anchors(page: Path) -> set[str]:
    """The heading ids of a docs page, as mkdocs' `toc` extension makes them."""
    from markdown.extensions.toc import slugify

    ids = set()
    for m in re.finditer(r"^#{1,6} +(.+?)(?: *\{#([\w-]+)\})? *$", page.read_text("utf-8"), re.M):
        ids.add(m[2] or slugify(m[1].replace("`", ""), "-"))
    return ids


def test_docstring_links_to_the_docs_resolve():
    """The docs links of the docstrings (relative to the API pages, docs/api/) name a page and
    a heading that exist; the strict build does not check links inside docstrings."""
    docs = ROOT / "docs"
    links = set()
    for path in (ROOT / "jremat").rglob("*.py"):
        links |= set(re.findall(r"\]\(\.\./([\w/-]+\.md)(?:#([\w-]+))?\)", path.read_text("utf-8")))
    assert len(links) >= 10
    broken = [
        f"{page}#{anchor}"
        for page, anchor in sorted(links)
        if not (docs / page).is_file() or (anchor and anchor not in _anchors(docs / page))
    ]
    assert not broken, f"docstring links to missing pages or headings: {broken}"
