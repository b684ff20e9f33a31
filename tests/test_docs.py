"""The documentation site (docs/, mkdocs.yml) says what the code does.

* Every ```python block of docs/**/*.md runs: a page's blocks in order, in one namespace (a
  guide builds on its earlier blocks), in this process (8 host devices, conftest.py), from a
  temporary folder. A block equal to one of README.md's is left to `test_readme.py`. A block
  that cannot run here (many hosts, a process-wide JAX option) carries the line
  `<!-- not run: reason -->` just above its fence; `NOT_RUN` counts them per page, so none
  is added silently. Only the fences in `FENCES` may open a code block.
* The docstring examples (`>>>`) of the public names, which the API reference shows, pass.
* Every public name has a docstring (the API reference is generated from them; the strict
  build renders a name without one as an empty entry): `jremat.__all__`, the methods and
  properties of its classes, and what the public modules define.
* Every exception class defined in jremat is named on docs/troubleshooting.md, and every
  `warnings.warn` message of the package is quoted there (the start of its first literal
  part of 20 characters or more), so a new one fails here until it is documented.

The strict build itself (`mkdocs build --strict`: broken links, anchors, cross-references and
docstrings that name parameters the function lacks) runs in `.ci/run` on each JAX line.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import re
import sys
import types
from pathlib import Path

import pytest
from test_docstring_examples import DOCUMENTED  # tests/ is on sys.path via conftest

import jremat

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCES = {"", "python", "bash", "text"}
#: blocks marked `<!-- not run: ... -->`, per page
NOT_RUN = {
    "guides/sharding.md": 1,
    "guides/plan-cache.md": 1,
    "guides/tpu.md": 1,
    "faq.md": 1,
}
PUBLIC_MODULES = ("jremat.policies", "jremat.models", "jremat.data", "jremat.cli")

_BLOCK = re.compile(
    r"^(?:<!-- not run: (?P<why>[^\n]+?) -->\n)?```python\n(?P<code>.*?)^```", re.M | re.S
)


def _python_blocks(path: Path) -> list[tuple[str, str | None]]:
    """(code, reason it is not run or None) of each ```python block of `path`."""
    return [(m["code"], m["why"]) for m in _BLOCK.finditer(path.read_text(encoding="utf-8"))]


README_BLOCKS = {code for code, _ in _python_blocks(ROOT / "README.md")}
RUN = {
    p.relative_to(DOCS).as_posix(): [c for c, why in _python_blocks(p) if why is None]
    for p in PAGES
}
RUN = {page: [c for c in codes if c not in README_BLOCKS] for page, codes in RUN.items()}
RUN = {page: codes for page, codes in RUN.items() if codes}


def test_only_known_fences_open_code_blocks():
    bad = []
    for p in [ROOT / "README.md", *PAGES]:
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            m = re.match(r"\s*```\s*(\S*)", line)
            if m and m[1] not in FENCES:
                bad.append(f"{p.relative_to(ROOT)}:{n}: ```{m[1]}")
    assert not bad, f"fences other than {sorted(FENCES)} (a block the tests would miss): {bad}"


def test_blocks_not_run_are_the_known_ones():
    found = {}
    for p in PAGES:
        n = sum(why is not None for _, why in _python_blocks(p))
        if n:
            found[p.relative_to(DOCS).as_posix()] = n
    assert found == NOT_RUN


def test_the_quick_start_is_the_readmes():
    """The getting-started page shows the README's quick start (run by test_readme.py)."""
    page = {c for c, _ in _python_blocks(DOCS / "getting-started.md")}
    assert README_BLOCKS and README_BLOCKS <= page


@pytest.mark.parametrize("page", sorted(RUN))
def test_page_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{Path(page).stem}"}
    for i, code in enumerate(RUN[page]):
        exec(compile(code, f"docs/{page} block {i}", "exec"), namespace)  # noqa: S102


# -- docstrings -----------------------------------------------------------------------------------
def _public_objects() -> dict[str, object]:
    """Qualified name -> object for every public name the API reference documents."""
    out: dict[str, object] = {}
    for name in jremat.__all__:
        obj = getattr(jremat, name)
        # constant tables (MEMORY_FIGURES) and type aliases (BudgetLike) are documented by the
        # string after them (griffe)
        if not isinstance(obj, (types.ModuleType, dict, types.UnionType)):
            out[f"jremat.{name}"] = obj
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        out[modname] = module
        for name, obj in vars(module).items():
            defined_here = getattr(obj, "__module__", None) == modname
            if not name.startswith("_") and defined_here and callable(obj):
                out[f"{modname}.{name}"] = obj
    for qual, obj in list(out.items()):
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if name.startswith("_"):
                    continue
                fn = member.fget if isinstance(member, property) else member
                fn = getattr(fn, "__func__", fn)
                if isinstance(member, property) or inspect.isfunction(fn):
                    out[f"{qual}.{name}"] = fn
    return out


def test_every_public_name_has_a_docstring():
    missing = [q for q, obj in _public_objects().items() if not (obj.__doc__ or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


def test_public_docstring_examples_pass():
    """The examples `test_docstring_examples.py` does not run (it runs `DOCUMENTED`'s), in
    their module's globals as `doctest.testmod` runs them: each example runs once per session."""
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(verbose=False)
    for qual, obj in _public_objects().items():
        if isinstance(obj, types.ModuleType) or qual.removeprefix("jremat.") in DOCUMENTED:
            continue
        module = sys.modules[obj.__module__]  # as `doctest.testmod` runs them: its globals
        for test in finder.find(obj, qual, module=module, globs=dict(vars(module))):
            if test.examples:
                runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed (output above)"


#: public names that take arguments yet carry no example, and why
NO_EXAMPLE = {
    "jremat.InfeasibleBudgetError": "raised by jremat, not built by users (troubleshooting.md)",
    "jremat.PlanMismatchError": "raised by jremat, not built by users (troubleshooting.md)",
    "jremat.UnsupportedBackendError": "raised by jremat, not built by users (troubleshooting.md)",
    "jremat.ExplainRow": "made by jremat.explain; jremat.Explanation's example reads one",
    "jremat.models.Workload": "made by jremat.models.get, whose example reads one",
    "jremat.models.init_hf": "needs the transformers package (the models extra)",
    "jremat.cli.main": "the console script; test_cli.py runs it",
}


def _takes_arguments(obj: object) -> bool:
    try:
        params = inspect.signature(obj).parameters  # a class: its __init__'s, less self
    except (TypeError, ValueError):
        return True  # no signature to read (an exception class): treated as taking some
    return bool(params)


def test_public_names_taking_arguments_have_examples():
    """Each public function and class (not methods) that takes arguments has an `Examples:`
    block that `test_docstring_examples.py` runs, or is in `NO_EXAMPLE` with a reason."""
    public = _public_objects()
    names = {  # functions and classes, not their methods
        qual
        for qual, obj in public.items()
        if not isinstance(obj, types.ModuleType)
        and qual.rpartition(".")[0] in ("jremat", *PUBLIC_MODULES)
    }
    without = sorted(
        q
        for q in names
        if _takes_arguments(public[q])
        and q.removeprefix("jremat.") not in DOCUMENTED
        and q not in NO_EXAMPLE
    )
    assert not without, f"public names taking arguments without an example: {without}"
    unknown = [n for n in DOCUMENTED if f"jremat.{n}" not in public]
    assert not unknown, f"DOCUMENTED names that are not public: {unknown}"
    stale = [q for q in NO_EXAMPLE if q not in names or q.removeprefix("jremat.") in DOCUMENTED]
    assert not stale, f"NO_EXAMPLE names that are not public or have an example now: {stale}"


# -- troubleshooting ------------------------------------------------------------------------------
def _package_files() -> list[Path]:
    return sorted((ROOT / "jremat").rglob("*.py"))


def _page_text() -> str:
    """docs/troubleshooting.md without Markdown quoting and code marks, whitespace collapsed."""
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    text = re.sub(r"^\s*> ?", "", text, flags=re.M).replace("`", "")
    return " ".join(text.split())


def _exception_classes() -> list[str]:
    names = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                if any(re.search(r"(Error|Exception|Warning)$", b) for b in bases):
                    names.append(node.name)
    return names


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "..."` string constants (implicit concatenation included)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


def _literal_parts(node: ast.AST, constants: dict[str, str]) -> list[str]:
    """The literal pieces of a message expression (f-strings, `+`, module constants)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.FormattedValue):
                parts += _literal_parts(v.value, constants) if isinstance(v.value, ast.Name) else []
            else:
                parts += _literal_parts(v, constants)
        return parts
    if isinstance(node, ast.BinOp):
        return _literal_parts(node.left, constants) + _literal_parts(node.right, constants)
    if isinstance(node, ast.Name) and node.id in constants:
        return [constants[node.id]]
    return []


def _warning_messages() -> list[tuple[str, str]]:
    """(where, the first 40 characters of its first literal part of 20 or more) of every
    `warnings.warn(...)` call: the words the message starts with, past the names and values
    formatted into it."""
    found = []
    for path in _package_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("warnings.warn", "warn")
                and node.args
            ):
                parts = [
                    " ".join(p.split()).strip(" ;:,.")
                    for p in _literal_parts(node.args[0], constants)
                ]
                first = next((p for p in parts if len(p) >= 20), "")
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", first[:40]))
    return found


def test_every_exception_class_has_a_troubleshooting_entry():
    classes = _exception_classes()
    assert {"InfeasibleBudgetError", "PlanMismatchError", "AutoTargetError"} <= set(classes)
    page = _page_text()
    missing = [c for c in classes if c not in page]
    assert not missing, f"exception classes not on docs/troubleshooting.md: {missing}"


def test_every_warning_has_a_troubleshooting_entry():
    messages = _warning_messages()
    assert len(messages) >= 10
    page = _page_text()
    missing = [where for where, start in messages if not start]
    assert not missing, f"warnings whose message the test cannot read: {missing}"
    missing = [f"{where}: {start!r}" for where, start in messages if start not in page]
    assert not missing, f"warnings not quoted on docs/troubleshooting.md: {missing}"
