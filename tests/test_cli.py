"""`jremat compare` on the command line, run in-process through `jremat.cli.main`.

One real run (the tiny MLP, JSON and a plot); the output formats and exit codes are checked
against a canned comparison so that nothing else compiles.
"""

from __future__ import annotations

import csv
import io
import json

import pytest

from jremat import cli
from jremat._src.reports import comparison
from jremat._src.reports.comparison import Comparison, Row

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_compare_json_and_plot_on_a_tiny_model(tmp_path, capsys):
    png = tmp_path / "pareto.png"
    argv = ["compare", "--model", "mlp", "--size", "tiny", "--budgets", "0.5"]
    code = cli.main(argv + ["--format", "json", "--plot", str(png)])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = json.loads(out)  # stdout holds the JSON and nothing else
    assert [r["policy"] for r in rows][0] == "no remat"
    assert {r["budget"] for r in rows} == {None, 0.5}
    assert all(r["status"] == "ok" and r["temp_bytes"] > 0 for r in rows)
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 20_000
    assert "plot written" in err
    # progress on stderr, not a terminal here: a log line as each row starts and ends
    assert "jremat: compare residual MLP" in err and "(6 of 6, " in err


@pytest.fixture
def canned(monkeypatch):
    """`compare` replaced by a canned result; records the keywords it was called with."""
    calls = []
    rows = [
        Row("no remat", None, 2**21, 2**22, 1e9, 0.0, 0.0, 1.5),
        Row("nothing_saveable per layer", None, 2**19, 2**21, 1.3e9, 30.0, 1e-8, 1.2),
        Row("jremat auto", 0.5, 2**20, 2**21, 1.1e9, 10.0, 2e-8, 0.9, None, 3.0, 2**20),
    ]

    def fake(fn, *args, **kw):
        calls.append(kw)
        return Comparison(rows, kw.get("description", ""), 2**21)

    monkeypatch.setattr(comparison, "compare", fake)
    return calls


def _run(argv, capsys):
    code = cli.main(["compare", "--model", "mlp", "--size", "tiny"] + argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_and_version_import_no_jax():
    """`jremat --help` and `--version` answer before jax is imported (a subprocess: this one
    has jax already)."""
    import subprocess
    import sys

    import jremat
    from jremat._src.search.solve import SOLVERS

    assert cli.SOLVER_NAMES == SOLVERS  # the copy --help lists without importing the solvers
    code = (
        "import sys\n"
        "from jremat import cli\n"
        "for argv in (['--help'], ['compare', '--help'], ['--version']):\n"
        "    assert cli.main(argv) == 0\n"
        "print('jax imported:', 'jax' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.rstrip().endswith("jax imported: False")
    assert f"jremat {jremat.__version__}" in out and "--budgets BUDGETS" in out
    assert 'pip install "jremat[zoo]"' in out and 'pip install "jremat[plot]"' in out


def test_default_budgets_stay_in_the_reachable_range():
    from jremat._src.reports.comparison import DEFAULT_BUDGETS, default_budgets

    assert default_budgets(None) == default_budgets(0.2) == DEFAULT_BUDGETS == (0.25, 0.5, 0.75)
    assert default_budgets(0.25) == DEFAULT_BUDGETS  # the lowest default is reachable
    assert default_budgets(0.412) == (0.42, 0.61, 0.81)  # tiny MLP: nothing_saveable at 0.412
    assert default_budgets(0.9) == (0.9, 0.93, 0.97)
    assert default_budgets(1.0) == (1.0,)


def test_markdown_is_the_default(canned, capsys):
    code, out, _ = _run(["--budgets", "0.5,64MiB,1000000"], capsys)
    assert code == 0
    assert out.startswith("# jremat compare: residual MLP")
    assert "| policy | budget | temp MiB |" in out and "| jremat auto | 0.5 |" in out
    assert canned[0]["budgets"] == [0.5, "64MiB", 1000000]
    assert canned[0]["policies"] is None
    assert "Pareto: yes when no other row has both less temp" in out  # the legend
    _run([], capsys)
    assert canned[1]["budgets"] is None  # compare's defaults: inside the reachable range


def test_json_flag_and_csv_format(canned, capsys):
    code, out, _ = _run(["--json"], capsys)
    assert code == 0 and [r["policy"] for r in json.loads(out)][-1] == "jremat auto"
    code, out, _ = _run(["--format", "csv", "--policies", "full_remat,dots_saveable"], capsys)
    assert code == 0
    recs = list(csv.DictReader(io.StringIO(out)))
    assert [r["budget"] for r in recs] == ["", "", "0.5"]
    assert Comparison.from_csv(out).rows[2].temp_bytes == 2**20
    assert canned[-1]["policies"] == ["full_remat", "dots_saveable"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "2.0"], "budget=2.0"),
        (["--policies", "nope"], "policies[0]='nope'"),
        (["--model", "nope"], "invalid choice"),
        (["--runs", "-1"], "--runs must be >= 0"),
        (["--json", "--format", "csv"], "not allowed with"),
        (["--plot", "/no/such/folder/p.png"], "does not exist"),
        (["--plot", "/"], "is a folder: give a file"),
        (["--plot", "p.xyz"], "matplotlib cannot write .xyz files; accepted: "),
        (["--solvers", "chain,magic"], "--solvers: 'magic': accepted planners: auto"),
    ],
)
def test_bad_arguments_exit_2(canned, capsys, argv, message):
    code, out, err = _run(argv, capsys)
    assert code == 2 and message in err and out == ""
    assert canned == []  # nothing was compiled


def test_plot_without_a_suffix_is_written_as_png_and_reported_so(canned, capsys, tmp_path):
    """matplotlib adds ".png" to a name without a suffix: the message names that file
    (helper-4: it named the path as given)."""
    code, _, err = _run(["--plot", str(tmp_path / "pareto")], capsys)
    assert code == 0 and (tmp_path / "pareto.png").is_file()
    assert f"plot written to {tmp_path / 'pareto.png'}" in err


def test_failure_exits_1(monkeypatch, capsys):
    def boom(*args, **kw):
        raise RuntimeError("XLA fell over")

    monkeypatch.setattr(comparison, "compare", boom)
    code, out, err = _run([], capsys)
    assert code == 1 and "RuntimeError: XLA fell over" in err and out == ""


def test_stdout_carries_only_the_json(monkeypatch, capfd):
    """Anything printed while comparing (a native solver's banner on file descriptor 1, a
    Python print) goes to stderr, so that `--format json` output parses."""
    import os

    def noisy(fn, *args, **kw):
        os.write(1, b"Running HiGHS 1.x: a banner on fd 1\n")
        print("a Python print")
        return Comparison([Row("no remat", None, 10, 20, 1.0, 0.0, 0.0, 0.1)])

    monkeypatch.setattr(comparison, "compare", noisy)
    code = cli.main(["compare", "--model", "mlp", "--size", "tiny", "--json"])
    out, err = capfd.readouterr()
    assert code == 0 and json.loads(out)[0]["temp_bytes"] == 10
    assert "banner on fd 1" in err and "a Python print" in err


def test_log_to_stderr_is_idempotent_and_follows_sys_stderr(capsys):
    import logging

    import jremat

    logger = logging.getLogger("jremat")
    before = list(logger.handlers)
    assert any(isinstance(h, logging.NullHandler) for h in before)  # quiet by default
    handler = jremat.log_to_stderr()
    try:
        assert jremat.log_to_stderr("WARNING") is handler  # one handler, level changed
        assert handler.level == logging.WARNING
        logging.getLogger("jremat.test").warning("row %d of %d", 2, 9)
        logging.getLogger("jremat.test").info("not shown at WARNING")
        err = capsys.readouterr().err  # the stderr of this test (pytest swaps it per test)
        assert "jremat: row 2 of 9" in err and "not shown" not in err
        with pytest.raises(ValueError, match="unknown level 'LOUD'"):
            jremat.log_to_stderr("LOUD")
    finally:
        logger.removeHandler(handler)
    assert logger.handlers == before
