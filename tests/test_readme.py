"""Every ```python block of README.md runs as written.

Each block runs on its own, as a reader would paste it, in this process: jax already started,
with the 8 host devices the suite sees (conftest.py), as on a GPU node. The blocks are kept
small so that this file stays cheap. The docs' blocks run in `test_docs.py`, which leaves out
those equal to a README block (the quick start is on both).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import jremat

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)


def test_the_readme_has_its_quick_start():
    assert len(BLOCKS) == 1  # the quick start; the other examples live in docs/
    assert "plan.summary()" in BLOCKS[0]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_written(index, capsys, tmp_path, monkeypatch):
    code = BLOCKS[index]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"readme_block_{index}"}
    exec(compile(code, f"README.md block {index}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    if "plan.summary()" in code:  # the quick start prints a report with its plan's figures
        plan = namespace["plan"]
        assert plan.measured_temp_bytes <= plan.budget_temp_bytes
        assert out.startswith(f"jremat plan ({plan.solver}): budget 0.4 = at most ")
        assert f"temp {plan.measured_temp_bytes / 2**20:.2f} MiB" in out
        # `jremat.explain`'s rows of this plan count the recompute the compiled step runs
        from jremat._src.reports.explain import explain_plan

        with jremat.disabled():
            graph = jremat.trace(namespace["loss"], namespace["params"], namespace["x"])
        recompute = sum(r.recompute_flops for r in explain_plan(graph, plan))
        assert recompute == pytest.approx(plan.measured_flops - plan.baseline_flops, rel=0.15)
