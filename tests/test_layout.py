"""The package's layout: import-linter's contracts, no import cycles, the public names.

`jremat/_src` is layered (base -> trace -> plan -> compile -> search -> frontends/training ->
reports); the contracts in `pyproject.toml` say which imports are allowed and `lint-imports`
checks them. Each contract is its own test here (one import-linter run, shared).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import jremat

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def _contract_names() -> list[str]:
    config = tomllib.loads(PYPROJECT.read_text())
    return [c["name"] for c in config["tool"]["importlinter"]["contracts"]]


def _env() -> dict[str, str]:
    """The environment for subprocesses: the `jremat` under test (this checkout) first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (this one), from the repository root; the timeout only
    guards against a hang."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def lint_output() -> str:
    """The output of `lint-imports` (all contracts of `pyproject.toml`), run once."""
    pytest.importorskip(
        "importlinter", reason="import-linter is not installed (pip install -e '.[dev]')"
    )
    # `lint-imports` is the console script of `importlinter.cli:lint_imports_command`; run that
    # with this interpreter (the script may not be on PATH), from the repository root, where
    # it reads `pyproject.toml`. No cache: the graph is built from the files as they are.
    code = (
        "import sys; from importlinter.cli import lint_imports_command; "
        "lint_imports_command(['--no-cache', '--no-logo'])"
    )
    r = _run_python(code)
    out = r.stdout + r.stderr
    assert r.returncode in (0, 1), f"lint-imports could not run (exit {r.returncode}):\n{out}"
    assert "Contracts:" in out, f"lint-imports printed no contract report:\n{out}"
    return out


@pytest.mark.parametrize("name", _contract_names())
def test_import_linter_contract_is_kept(lint_output, name):
    lines = [ln for ln in lint_output.splitlines() if ln.startswith(f"{name} ")]
    assert lines, f"lint-imports did not report contract {name!r}:\n{lint_output}"
    assert lines[0].endswith("KEPT"), f"contract {name!r} is broken:\n{lint_output}"


def _strongly_connected_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (components in no particular order, each sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def test_strongly_connected_components_finds_a_cycle():
    """The checker itself: a 3-cycle and a self-contained chain."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    comps = _strongly_connected_components(edges)
    assert sorted(map(tuple, comps)) == [("a", "b", "c"), ("d",), ("e",)]


@pytest.mark.parametrize(
    "exclude_type_checking", [True, False], ids=["runtime-imports", "with-TYPE_CHECKING-imports"]
)
def test_no_import_cycle_among_jremat_modules(exclude_type_checking):
    """No strongly connected component of more than one module in jremat's import graph
    (imports inside functions count; `if TYPE_CHECKING:` imports in the second case)."""
    grimp = pytest.importorskip("grimp", reason="grimp (installed with import-linter) is missing")
    # jremat is imported from this checkout (tests run from the repository root).
    assert Path(jremat.__file__).resolve().parent == ROOT / "jremat"
    graph = grimp.build_graph(
        "jremat", exclude_type_checking_imports=exclude_type_checking, cache_dir=None
    )
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = [c for c in _strongly_connected_components(edges) if len(c) > 1]
    report = []
    for comp in cycles:
        report.append("cycle among: " + ", ".join(comp))
        for a in comp:
            for b in sorted(edges[a] & set(comp)):
                lines = sorted(
                    {d["line_number"] for d in graph.get_import_details(importer=a, imported=b)}
                )
                report.append(f"  {a} -> {b} (line {', '.join(map(str, lines))})")
    assert not cycles, "import cycles in jremat:\n" + "\n".join(report)


# -- the public names ---------------------------------------------------------------------------
def test_every_public_name_resolves():
    assert len(set(jremat.__all__)) == len(jremat.__all__)
    missing = [n for n in jremat.__all__ if not hasattr(jremat, n)]
    assert not missing, f"jremat.__all__ names attributes jremat lacks: {missing}"
    for name in jremat.__all__:
        obj = getattr(jremat, name)
        assert obj is not None, name
        if isinstance(obj, dict):  # a constant table (MEMORY_FIGURES): data, no __module__
            assert obj and all(isinstance(k, str) for k in obj), name
        elif isinstance(obj, types.UnionType):  # a type alias (BudgetLike): its __module__ is types
            assert all(isinstance(t, type) for t in obj.__args__), name
        elif not isinstance(obj, types.ModuleType):  # defined in jremat, or its own module
            assert (getattr(obj, "__module__", "") or "").startswith("jremat"), (name, obj)


@pytest.mark.parametrize("name", ["plan", "trace", "measure", "explain"])
def test_named_functions_are_functions_not_modules(name):
    obj = getattr(jremat, name)
    assert inspect.isfunction(obj), f"jremat.{name} is {obj!r}, not a function"
    assert importlib.util.find_spec(f"jremat.{name}") is None, (
        f"a module jremat.{name} exists and is shadowed by the function jremat.{name}"
    )


def test_no_public_name_shadows_a_module():
    """A public name that is not a module is not also a `jremat.<name>` module: importing
    `jremat.<name>` would otherwise rebind (or be hidden by) the attribute."""
    shadowing = []
    for name in jremat.__all__:
        obj = getattr(jremat, name)
        spec = importlib.util.find_spec(f"jremat.{name}")
        if isinstance(obj, types.ModuleType):
            assert spec is not None and obj is importlib.import_module(f"jremat.{name}"), name
        elif spec is not None:
            shadowing.append(f"{name} ({spec.origin})")
    assert not shadowing, f"public names that shadow a module: {shadowing}"


# -- what `import jremat` pulls in --------------------------------------------------------------
def test_import_jremat_does_not_import_optional_heavy_packages():
    code = (
        "import json, sys; import jremat; bare = 'jax' in sys.modules; "
        "[getattr(jremat, n) for n in jremat.__all__]; "  # the public names load lazily
        "print(json.dumps([jremat.__file__, sorted({m.split('.')[0] for m in sys.modules})]))"
        "; print(json.dumps(bare))"
    )
    r = _run_python(code)
    assert r.returncode == 0, r.stderr
    *_, listing, bare = r.stdout.strip().splitlines()
    path, top_level = json.loads(listing)
    assert json.loads(bare) is False  # `import jremat` alone imports no jax (`jremat --help`)
    assert Path(path).resolve() == ROOT / "jremat" / "__init__.py"  # the checkout under test
    assert "jax" in top_level  # sanity: the list is what `import jremat` loaded
    unwanted = {"flax", "transformers", "matplotlib"} & set(top_level)
    assert not unwanted, f"`import jremat` imports {sorted(unwanted)}"


def test_the_jax_requirement_is_bounded_to_the_lines_ci_tests():
    """`jax` is required within the lines CI tests (0.10 .. 0.12; issue 47): the private read
    of `jit`'s frames is checked on those, so the next JAX is not installed by default before
    CI has run on it. Moving the bound: docs/guides/jax-versions.md."""
    from packaging.requirements import Requirement

    config = tomllib.loads(PYPROJECT.read_text())
    project = config["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for r in project["optional-dependencies"]["cuda12"]]
    jax_reqs = [r for r in reqs if r.name == "jax"]
    assert len(jax_reqs) == 2
    for r in jax_reqs:
        assert r.specifier.contains("0.10.2") and r.specifier.contains("0.12.0.1"), r
        assert not r.specifier.contains("0.13.0"), r
    import jax

    assert jax_reqs[0].specifier.contains(jax.__version__)
