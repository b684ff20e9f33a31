"""One process of `test_multiprocess.py`: plans and runs a data-parallel step on a 2-process
CPU mesh (one device each, gloo collectives), printing its plan's key and the loss."""

from __future__ import annotations

import hashlib
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = sys.argv[1], int(sys.argv[2])
try:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
except Exception as e:  # noqa: BLE001 - no gloo / no distributed runtime: the test skips
    print(f"UNAVAILABLE {e!r}")
    sys.exit(77)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from models import mlp_chain  # noqa: E402

import jremat  # noqa: E402
from jremat._src.plan.plan import plan_key  # noqa: E402

m = mlp_chain(depth=3, width=8, batch=128)
params, x = m.args
mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def global_array(value, spec):
    value = np.asarray(value)
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


gparams = jax.tree_util.tree_map(lambda a: global_array(a, P()), params)
gx = global_array(x, P("data"))
specs = (jax.tree_util.tree_map(lambda _: P(), params), P("data"))
f = jremat.auto(m.loss, budget=0.6, max_rounds=2, in_shardings=specs, mesh=mesh)
loss, grads = jax.jit(jax.value_and_grad(f))(gparams, gx)
(plan,) = f.plans.values()
digest = hashlib.sha256(plan_key(plan).encode()).hexdigest()[:16]
print(f"PLAN {digest} {plan.measured_temp_bytes} {plan.baseline_temp_bytes}")
print(f"LOSS {float(loss):.8f}")
jax.distributed.shutdown()
