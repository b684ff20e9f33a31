"""Two processes (one CPU device each, gloo collectives over 127.0.0.1) plan the same sharded
step: the plans must be equal (else they compile different SPMD programs and hang at the first
collective) and the step must complete. The MILP is deterministic (node limit, one thread, a
fixed seed), so this holds under any load."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_choose_the_same_plan_and_finish_the_step():
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    env.pop("PYTEST_ADDOPTS", None)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env["XLA_FLAGS"] = flags.strip()
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(here / "multiprocess_worker.py"), port, str(i)],
            env=env,
            cwd=here.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode == 77 for p in procs):
        pytest.skip("jax.distributed with gloo CPU collectives is unavailable: " + outs[0][-300:])
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]

    def line(out: str, tag: str) -> str:
        (found,) = [ln for ln in out.splitlines() if ln.startswith(tag + " ")]
        return found

    plans = [line(out, "PLAN") for out in outs]
    assert plans[0] == plans[1], plans
    _, _, measured, base = plans[0].split()
    assert int(measured) <= 0.6 * int(base)
    assert line(outs[0], "LOSS") == line(outs[1], "LOSS")
