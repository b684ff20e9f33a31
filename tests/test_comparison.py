"""`jremat.compare`, the `Comparison` exports and plot, and its Pareto frontier.

One tiny comparison (a 4-layer MLP, seconds to compile) is computed once per module and shared.
"""

from __future__ import annotations

import json
import logging
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat import models
from jremat._src.plan.recipes import recipe_plan
from jremat._src.reports.comparison import (
    AUTO,
    BUILTIN_PER_LAYER,
    NO_REMAT,
    SQRT_N,
    Comparison,
    Row,
)
from jremat._src.reports.pareto import dominates, pareto_front

BUDGETS = (0.5, 0.05)  # 0.05 is below what any plan reaches: an "infeasible" row
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def work():
    return models.get("mlp", size="tiny")


@pytest.fixture(scope="module")
def result(work) -> Comparison:
    return jremat.compare(
        work.loss,
        work.params,
        work.batch,
        budgets=BUDGETS,
        runs=1,
        progress=False,
        description=work.description,
    )


# -- rows ----------------------------------------------------------------------------------
def test_rows_cover_every_policy_and_budget(result):
    got = [(r.policy, r.budget) for r in result.rows]
    want = [(NO_REMAT, None)] + [(f"{p} per layer", None) for p in BUILTIN_PER_LAYER]
    want += [(SQRT_N, None)] + [(AUTO, b) for b in BUDGETS]
    assert got == want


def test_row_figures(result):
    base = result.rows[0]
    assert result.baseline_temp_bytes == base.temp_bytes > 0
    assert base.extra_flops_pct == 0.0 and base.max_grad_diff == 0.0
    ok = [r for r in result.rows if r.ok]
    assert len(ok) == len(result.rows) - 1
    for r in ok:
        assert r.footprint_bytes > r.temp_bytes > 0
        assert r.flops > 0 and r.compile_seconds >= 0
        assert r.step_seconds is not None and r.step_seconds > 0  # runs=1
        assert r.max_grad_diff < 1e-5
        assert r.extra_flops_pct == pytest.approx(100 * (r.flops / base.flops - 1))
    auto = next(r for r in result.rows if r.budget == 0.5)
    assert auto.temp_bytes <= auto.budget_temp_bytes == int(0.5 * base.temp_bytes)
    assert auto.plan_seconds > 0
    full = next(r for r in result.rows if r.policy == "nothing_saveable per layer")
    assert full.temp_bytes < base.temp_bytes and full.extra_flops_pct > 0


def test_infeasible_row(result):
    bad = result.rows[-1]
    assert bad.budget == 0.05 and bad.status == "infeasible" and not bad.ok
    assert bad.temp_bytes is None and "smallest reachable budget" in bad.note
    assert "below the reachable range" in bad.note and bad.note.endswith("1.0 is no remat)")


def test_a_plan_made_for_another_program_is_refused_naming_its_row(work):
    """A `(label, Plan)` row is checked against the program as `rematerialize` checks it
    (helper-4: another program's plan raised a bare KeyError, or made a row silently)."""
    graph = jremat.trace(work.loss, work.params, work.batch)
    plan = recipe_plan(graph, "dots_saveable", "sqrt_n")
    plan.fingerprint = "0" * 16  # as a plan of another program carries
    with pytest.raises(jremat.PlanMismatchError, match="fn \\(the row 'theirs'\\) traces to"):
        jremat.compare(
            work.loss,
            work.params,
            work.batch,
            policies=[("theirs", plan)],
            budgets=(0.5,),
            progress=False,
        )


def test_presets_plans_and_builtins_keyword(work):
    graph = jremat.trace(work.loss, work.params, work.batch)
    mine = recipe_plan(graph, "dots_saveable", "sqrt_n")
    c = jremat.compare(
        work.loss,
        work.params,
        work.batch,
        policies=["full_remat", "no_remat", "dots_saveable", ("my plan", mine)],
        builtins=["nothing_saveable"],
        budgets=(0.05,),  # infeasible: the planner stops at its (already compiled) anchors
        solvers=("chain",),
        progress=False,
    )
    assert [r.policy for r in c.rows] == [
        NO_REMAT,
        "nothing_saveable per layer",
        "full_remat",
        "no_remat",
        "dots_saveable per layer",
        "my plan",
        f"{AUTO} (chain)",
    ]
    by = {r.policy: r for r in c.rows}
    # the full_remat preset is nothing_saveable per layer; no_remat is the baseline
    assert by["full_remat"].temp_bytes == by["nothing_saveable per layer"].temp_bytes
    assert by["no_remat"].temp_bytes == by[NO_REMAT].temp_bytes
    assert all(r.step_seconds is None for r in c.rows)  # runs=0
    assert c.rows[-1].budget == 0.05 and c.rows[-1].status == "infeasible"


def test_builtins_keyword_alone_keeps_the_old_default(work, caplog):
    caplog.set_level(logging.INFO, logger="jremat")
    c = jremat.compare(
        work.loss,
        work.params,
        work.batch,
        builtins=("nothing_saveable",),
        budgets=(),
        progress=False,
        description="tiny",
    )
    assert [r.policy for r in c.rows] == [NO_REMAT, "nothing_saveable per layer", SQRT_N]
    # progress: each row's start (its count) and its compiled figures, at INFO
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("jremat")]
    assert "compare tiny: nothing_saveable per layer (2 of 3, " in "\n".join(logged)
    temp = c.rows[1].temp_bytes / 2**20
    assert any(f"nothing_saveable per layer: temp {temp:.2f} MiB" in m for m in logged)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(policies=["nope"]), r"policies\[0\]='nope'.*preset"),
        (dict(builtins=["dots"]), r"builtins\[0\]='dots'"),
        (dict(budgets=(2.0,)), r"budget=2.0"),
        (dict(runs=-1), r"runs must be an int >= 0"),
        (dict(solvers=("magic",)), r"solvers: 'magic'.*chain"),
    ],
)
def test_errors_name_the_argument(kw, match):
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match=match):
        jremat.compare(loss, jnp.ones((4, 4)), jnp.ones((2, 4)), progress=False, **kw)


# -- Pareto --------------------------------------------------------------------------------
def test_pareto_front_hand_built():
    pts = [
        (0.0, 100.0),  # 0 no remat: front (fewest FLOPs)
        (20.0, 40.0),  # 1 front
        (25.0, 40.0),  # 2 dominated by 1 (same memory, more FLOPs)
        (20.0, 60.0),  # 3 dominated by 1 (same FLOPs, more memory)
        (10.0, 70.0),  # 4 front
        (30.0, 30.0),  # 5 front
        (30.0, 30.0),  # 6 identical to 5: neither dominates, both on the front
        (50.0, 35.0),  # 7 dominated by 5
        (None, 1.0),  # 8 not compiled: ignored
        (5.0, math.nan),  # 9 ignored
    ]
    assert pareto_front(pts) == [0, 4, 1, 5, 6]
    assert dominates((1, 1), (1, 2)) and not dominates((1, 1), (1, 1))
    assert pareto_front([]) == []
    with pytest.raises(ValueError, match=r"points\[0\]"):
        pareto_front([(1, 2, 3)])


def test_comparison_pareto_rows():
    rows = [
        Row(NO_REMAT, None, 100, 150, 1e6, 0.0, 0.0, 1.0),
        Row("a", None, 50, 100, 1.3e6, 30.0, 0.0, 1.0),
        Row("b", None, 60, 110, 1.4e6, 40.0, 0.0, 1.0),
        Row("auto", 0.5, 50, 100, 1.1e6, 10.0, 0.0, 1.0, None, 1.0, 50),
        Row("auto", 0.1, status="infeasible", note="infeasible"),
    ]
    front = Comparison(rows, "hand", 100).pareto()
    assert [(r.policy, r.budget) for r in front] == [(NO_REMAT, None), ("auto", 0.5)]


# -- exports -------------------------------------------------------------------------------
def test_json_round_trip(result, tmp_path):
    text = result.to_json(tmp_path / "c.json")
    data = json.loads(text)
    assert isinstance(data, list) and data[0]["policy"] == NO_REMAT
    for c in (Comparison.from_json(text), Comparison.from_json(tmp_path / "c.json")):
        assert c.rows == result.rows
        assert c.baseline_temp_bytes == result.baseline_temp_bytes


def test_csv_round_trip(result, tmp_path):
    text = result.to_csv(tmp_path / "c.csv")
    assert text.splitlines()[0].startswith("policy,budget,temp_bytes,")
    for c in (Comparison.from_csv(text), Comparison.from_csv(str(tmp_path / "c.csv"))):
        assert c.rows == result.rows  # same numbers, bit for bit (floats written by repr)
        assert c.to_csv() == text


def test_markdown_shows_the_same_numbers(result):
    md = result.to_markdown()
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    unit = re.match(r"temp (\w+)", head[2]).group(1)
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    body = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert len(body) == len(result.rows)
    front = {id(r) for r in result.pareto()}
    for cells, r in zip(body, result.rows, strict=True):
        assert cells[0] == r.policy and cells[1] == ("-" if r.budget is None else str(r.budget))
        if not r.ok:
            assert cells[2] == "infeasible"
            continue
        cell = dict(zip(head, cells, strict=True))
        assert float(cell[f"temp {unit}"]) == pytest.approx(r.temp_bytes / scale, abs=0.006)
        assert float(cell[f"footprint {unit}"]) == pytest.approx(
            r.footprint_bytes / scale, abs=0.006
        )
        assert float(cell["extra FLOPs %"]) == pytest.approx(r.extra_flops_pct, abs=0.06)
        assert float(cell["max grad diff"]) == pytest.approx(r.max_grad_diff, rel=0.06, abs=1e-30)
        assert (cell["Pareto"] == "yes") == (id(r) in front)
    assert "smallest reachable budget" in md  # the infeasible row's note follows the table


def test_html_table(result):
    page = result._repr_html_()
    assert page.startswith("<table") and page.count("<tr") == len(result.rows) + 1
    for r in result.rows:
        assert r.policy in page
    assert "font-weight:bold" in page  # frontier rows


def test_from_json_rejects_non_rows():
    with pytest.raises(ValueError, match="list of row objects"):
        Comparison.from_json('{"a": 1}')
    with pytest.raises(ValueError, match="'policy'"):
        Comparison.from_csv("a,b\n1,2\n")


# -- plot ----------------------------------------------------------------------------------
def test_plot_writes_a_real_png(result, tmp_path):
    import matplotlib.image

    path = tmp_path / "pareto.png"
    fig = result.plot(path)
    assert fig.axes and path.read_bytes()[:8] == PNG_SIGNATURE
    assert path.stat().st_size > 20_000
    img = matplotlib.image.imread(path)
    h, w = img.shape[:2]
    assert h >= 600 and w >= 1000
    rgb = img[..., :3].reshape(-1, 3)
    assert (rgb.min(axis=1) < 0.9).mean() > 0.02  # ink: points, lines and text
    assert len(np.unique((rgb * 255).astype(np.uint8), axis=0)) > 50  # not a flat image
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert any("auto @ 0.5" in t for t in texts) and any(NO_REMAT in t for t in texts)


def test_plot_needs_a_compiled_row():
    c = Comparison([Row("auto", 0.1, status="infeasible")])
    with pytest.raises(ValueError, match="nothing to plot"):
        c.plot()
