"""`examples/compare_policies.ipynb` executes end to end (tiny model sizes, via nbclient).

The notebook reads JREMAT_NOTEBOOK_SIZE=tiny and then compares policies on a tiny GPT-2 and a
tiny U-Net at one budget. Needs the `dev` extra (nbclient, ipykernel) and transformers.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "examples" / "compare_policies.ipynb"


def test_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("JREMAT_NOTEBOOK_SIZE", "tiny")
    monkeypatch.setenv("JREMAT_NOTEBOOK_QUICK", "1")  # one budget per model
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # the kernel runs in tmp_path: import this checkout's jremat, not an installed one
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    # XLA:CPU compiles dominate the run; LLVM's optimisation level changes no buffer sizes or
    # FLOP counts (those are decided on the HLO), only how fast the kernels are built and run.
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=1800,  # per cell: a guard against a hung kernel, not a speed requirement
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working folder
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "nothing to install" in text and "model sizes: 'tiny'" in text
    assert "Warning" not in text  # no TqdmWarning, no deprecation noise in the output
    assert "jremat: compare" in text  # progress, through jremat.log_to_stderr()
    from jremat import models

    for name in models.NAMES:  # every model of the zoo is listed, with its command
        assert f"jremat compare --model {name} --size tiny" in text
    tables = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert len(tables) == 2 and all("jremat auto" in t for t in tables)
    pngs = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 2
    assert all(base64.b64decode(p)[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert (tmp_path / "gpt2_pareto.png").exists() and (tmp_path / "gpt2_compare.csv").exists()
