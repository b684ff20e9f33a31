"""Shared fixtures for the jremat core tests (models live in `tests/models.py`).

* `remat3`: parametrizes a test over `jax_remat3` off/on (only "off" where jax lacks the flag),
  restoring the previous value afterwards.
* `compiles`: counts, for one test, calls of `xla.compile_jitted` (jremat's one compile path)
  and of JAX's AOT `Lowered.compile` from anywhere (`Counts`).
* `cache`: a session-wide memo of models, unrematerialized measurements and plans, so that the
  expensive figures (each is an XLA compile) are computed once per session and shared by files.

XLA:CPU compiles dominate these tests' runtime, and jremat compiles the same programs many
times (every `jremat.plan` call compiles the unrematerialized baseline and the same reference
plans again). The session therefore uses JAX's persistent compilation cache in a fresh
temporary directory: an identical program compiled twice in one session is compiled once; no
state survives the session. The figures the tests assert (temp bytes, FLOPs) are read from the
same executables either way. Set JREMAT_TESTS_NO_COMPILE_CACHE=1 to compile everything afresh.

`jremat.auto`'s default on-disk plan cache is off for the session (`JREMAT_PLAN_CACHE=0`,
inherited by the subprocesses tests start): no test passes because of a plan an earlier run
saved in the user's cache. Tests of the plan cache give it a folder of their own.

The session also compiles with `--xla_backend_optimization_level=0` (as `test_notebook.py`
does): LLVM's optimisation level changes how fast XLA:CPU builds and runs the kernels, not the
HLO, buffer assignment or FLOP counts the tests assert (the same temp bytes, FLOPs and plans
either way), and it makes the suite's compiles about twice as fast. Set
JREMAT_TESTS_FULL_OPT=1 to compile at XLA's default level.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# The suite sees 8 host devices, as a GPU or TPU node would (users' jit steps run on hosts with
# many devices); a test that needs exactly one device says so (`one_device`). Set before jax's
# CPU backend starts, like the flag below; an XLA_FLAGS that sets a device count keeps it.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

if not os.environ.get("JREMAT_TESTS_FULL_OPT") and "--xla_backend_optimization_level" not in (
    os.environ.get("XLA_FLAGS", "")
):  # read when jax's CPU backend starts: before any test module makes an array
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# set before jremat is imported, and whatever the caller's environment says
os.environ["JREMAT_PLAN_CACHE"] = "0"
# where libtpu is installed (the jax 0.12 line's dev extra), every JAX process loads it and
# takes its lock file; without this, a second process (an xdist worker) that compiles for a
# TPU topology fails (docs/guides/tpu.md#several-processes)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import models as M  # noqa: E402

import jremat  # noqa: E402

if not os.environ.get("JREMAT_TESTS_NO_COMPILE_CACHE") and not jax.config.values.get(
    "jax_compilation_cache_dir"
):
    _cache_dir = tempfile.mkdtemp(prefix="jremat-tests-xla-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

HAS_REMAT3 = "jax_remat3" in jax.config.values
REMAT3_PARAMS = [False, True] if HAS_REMAT3 else [False]


@pytest.fixture(params=REMAT3_PARAMS, ids=lambda v: f"remat3={'on' if v else 'off'}")
def remat3(request):
    """Run the test with `jax_remat3` set to the parameter; restore the old value after."""
    if not HAS_REMAT3:
        yield False
        return
    old = jax.config.values["jax_remat3"]
    jax.config.update("jax_remat3", request.param)
    try:
        yield request.param
    finally:
        jax.config.update("jax_remat3", old)


class SessionCache:
    """Memoized models, baseline measurements, plans and `jremat.auto` wrappers."""

    #: (model, budget) whose `plan` is the plan `jremat.auto` made at its first call: `auto`
    #: is `jremat.plan` on the arguments' shapes, so the session plans these only once.
    PLANNED_BY_AUTO = (("mlp_chain", 0.5), ("decoder", 0.5))

    def __init__(self) -> None:
        self._models: dict[str, M.Model] = {}
        self._base: dict[str, jremat.Measurement] = {}
        self._plans: dict[tuple[str, Any, bool], Any] = {}
        self._grads: dict[str, Any] = {}
        self._autos: dict[tuple[str, float], Any] = {}

    def model(self, name: str) -> M.Model:
        if name not in self._models:
            self._models[name] = M.MODELS[name]()
        return self._models[name]

    def baseline(self, name: str) -> jremat.Measurement:
        """`jremat.measure` of the unrematerialized model."""
        if name not in self._base:
            m = self.model(name)
            self._base[name] = jremat.measure(m.loss, *m.args)
        return self._base[name]

    def ref_grads(self, name: str) -> Any:
        """`jax.grad` of the unrematerialized model (no jremat involved)."""
        if name not in self._grads:
            m = self.model(name)
            self._grads[name] = jax.jit(jax.grad(m.loss))(*m.args)
        return self._grads[name]

    def auto(self, name: str, fraction: float) -> tuple[Any, Any]:
        """`(wrapped, loss)`: `wrapped = jremat.auto(model.loss, budget=fraction,
        solver=SOLVER)` after its first call `loss = wrapped(*args)`, which planned."""
        key = (name, fraction)
        if key not in self._autos:
            m = self.model(name)
            wrapped = jremat.auto(m.loss, budget=fraction, solver=M.SOLVER)
            assert wrapped.plans == {}  # nothing is planned before the first call
            self._autos[key] = (wrapped, wrapped(*m.args))
        return self._autos[key]

    def plan(self, name: str, budget: Any, verify: bool = True) -> Any:
        """`jremat.plan(model, budget=budget, solver=SOLVER, verify=verify)`; an
        InfeasibleBudgetError is memoized (and returned) too."""
        key = (name, budget, verify)
        if key not in self._plans and verify and (name, budget) in self.PLANNED_BY_AUTO:
            (self._plans[key],) = self.auto(name, budget)[0].plans.values()
        if key not in self._plans:
            m = self.model(name)
            try:
                self._plans[key] = jremat.plan(
                    m.loss, *m.args, budget=budget, solver=M.SOLVER, verify=verify
                )
            except jremat.InfeasibleBudgetError as e:
                self._plans[key] = e
        return self._plans[key]


@pytest.fixture(scope="session")
def cache() -> SessionCache:
    return SessionCache()


@dataclasses.dataclass
class Counts:
    jremat: int = 0  # calls of xla.compile_jitted
    aot: int = 0  # calls of jax.stages.Lowered.compile (from anywhere)


@pytest.fixture
def compiles(monkeypatch):
    from jremat._src.compile import xla

    counts = Counts()
    real_compile_jitted = xla.compile_jitted
    real_lowered_compile = jax.stages.Lowered.compile

    def compile_jitted(jitted, args, **kw):
        counts.jremat += 1
        return real_compile_jitted(jitted, args, **kw)

    def lowered_compile(self, *a, **kw):
        counts.aot += 1
        return real_lowered_compile(self, *a, **kw)

    monkeypatch.setattr(xla, "compile_jitted", compile_jitted)
    monkeypatch.setattr(jax.stages.Lowered, "compile", lowered_compile)
    return counts
