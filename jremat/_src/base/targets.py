"""Compile targets: the devices a plan is compiled for, and their memory.

A target is named as `jremat compare --target` takes it: `"tpu:v5e:2x2"` (a TPU topology, as
`jax.experimental.topologies.get_topology_desc` names it; compile-only devices, so that a CPU
host plans for a TPU slice it does not have) or `"local"` (this host's devices). How the
memory figure is read on each platform: docs/guides/tpu.md.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

TARGET_FORMS = (
    '"local" (this host\'s devices) or "tpu:<topology>" with a TPU topology name as '
    'jax.experimental.topologies.get_topology_desc takes it, e.g. "tpu:v5e:1x1", '
    '"tpu:v5e:2x2", "tpu:v5p:2x2x1", "tpu:v6e:2x2"'
)

#: HBM bytes of one JAX device by `device.device_kind`, for devices that report no
#: `memory_stats()` (compile-only TPU devices of a topology): the vendors' published memory
#: per chip, divided by the JAX devices per chip (one on v5e, v5p and v6e; two TensorCores as
#: two devices on v2 and v3). v4 is left out: its topologies give one device per TensorCore
#: where a v4 VM in megacore mode shows one per chip, so a share of "its memory" is ambiguous.
DEVICE_MEMORY_BYTES: dict[str, int] = {
    "TPU v2": 8 * 2**30,
    "TPU v3": 16 * 2**30,
    "TPU v5 lite": 16 * 2**30,
    "TPU v5": 95 * 2**30,
    "TPU v6 lite": 32 * 2**30,
}
"""HBM bytes of one JAX device by `device.device_kind`, for devices that report no
`memory_stats()` (compile-only TPU devices): the published memory per chip over the JAX
devices per chip. Read by `"device"` budgets (`jremat.parse_budget`)."""


def target_devices(target: str) -> list[Any]:
    """The devices of a target (see `target_mesh`), in id order.

    Raises:
      ValueError: `target` is not one of `TARGET_FORMS`, or its topology is one JAX's TPU
        compiler does not know (the compiler's reason is quoted).
      RuntimeError: a TPU target where `libtpu` is not installed; the message names the
        install command for this JAX version.
    """
    import jax

    if not isinstance(target, str):
        raise TypeError(f"target must be a string, {TARGET_FORMS}; got {type(target).__name__}")
    name = target.strip()
    if name == "local":
        return list(jax.devices())
    platform, _, topology = name.partition(":")
    if platform != "tpu" or not topology:
        raise ValueError(f"target={target!r} is not a target name; accepted: {TARGET_FORMS}")
    # libtpu kills the process (SIGFPE) on a zero-sized topology such as "v5e:0x0"
    if any(d.isdigit() and int(d) == 0 for d in re.split(r"[x:]", topology)):
        raise ValueError(f"target={target!r}: a topology has no dimension of size 0")
    try:
        return list(_topology_devices(topology))
    except RuntimeError as e:
        if "lockfile" in str(e):
            raise RuntimeError(
                f"target={target!r}: another process holds libtpu's lock file (every JAX "
                "process loads an installed libtpu). Set ALLOW_MULTIPLE_LIBTPU_LOAD=1 in the "
                f"environment before JAX starts (docs/guides/tpu.md). JAX said: {e}"
            ) from None
        if "not installed" in str(e):
            raise RuntimeError(
                f"target={target!r} compiles for a TPU, which needs libtpu, the TPU compiler: "
                f'pip install "jax[tpu]=={jax.__version__}" (or jremat[tpu]). It installs on '
                f"any Linux host, no TPU needed. JAX said: {e}"
            ) from None
        raise ValueError(
            f"target={target!r}: the TPU compiler does not know topology {topology!r} "
            f"({str(e).splitlines()[0]}); accepted: {TARGET_FORMS}"
        ) from None


@functools.cache
def _topology_devices(topology: str) -> tuple[Any, ...]:
    """A TPU topology's devices, once per process: meshes of two `target_mesh` calls for the
    same topology share devices (JAX refuses arrays on two topologies' devices together)."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # noqa: BLE001 - retried below, else re-raised as it came
        # jax 0.10's libtpu (0.0.42) takes a topology smaller than its default host of 2x2x1
        # chips ("v5e:1x1") only with host bounds of the topology's own size
        dims = _topology_dims(topology)
        if "chips_per_host_bounds" not in str(e) or dims is None:
            raise
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, chips_per_host_bounds=dims
        )
    return tuple(sorted(topo.devices, key=lambda d: d.id))


def _topology_dims(topology: str) -> tuple[int, ...] | None:
    """The chip grid of a topology name, 3 dims ("v5e:1x1" -> (1, 1, 1)); None where the
    name ends otherwise."""
    parts = topology.rsplit(":", 1)[-1].split("x")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    return (*map(int, parts), *[1] * (3 - len(parts)))


def target_mesh(
    target: str,
    axis_names: Sequence[str] = ("data",),
    axis_shape: Sequence[int] | None = None,
) -> Any:
    """A mesh over a target's devices, for planning ahead of time from any host.

    Arguments placed on it as `jax.ShapeDtypeStruct(shape, dtype,
    sharding=NamedSharding(mesh, spec))` make `jremat.plan`, `jremat.auto` (inside the
    caller's `jax.jit(...).lower(...)`) and `jremat.compare` compile every candidate for
    that target, per device, as `jax.jit(...).lower(...).compile()` does for those devices.
    A compile-only TPU's programs are compiled and measured, never run.

    Args:
      target: `"tpu:<topology>"` (e.g. `"tpu:v5e:2x2"`: 4 v5e chips; libtpu compiles for it
        on any host) or `"local"` (this host's devices).
      axis_names: the mesh's axis names (default one axis, `"data"`).
      axis_shape: the size of each axis, product the number of devices (default: all
        devices on the first axis, 1 on the others).

    Returns:
      A `jax.sharding.Mesh` (Auto axes) over the target's devices in id order.

    Raises:
      ValueError: an unknown target or topology (see `target_devices`), repeated axis
        names, or `axis_shape` whose length differs from `axis_names` or whose product is
        not the device count.
      TypeError: `axis_names` not a tuple of strings, `axis_shape` not a tuple of
        positive ints.
      RuntimeError: a TPU target without libtpu installed (names the install command).

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jremat.target_mesh("local")
      >>> x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P()))
      >>> x.sharding.mesh.axis_names
      ('data',)

      A TPU target needs libtpu (`pip install "jax[tpu]"`), which not every JAX install has,
      so the tests skip this line:

      >>> jremat.target_mesh("tpu:v5e:2x2").devices.shape  # doctest: +SKIP
      (4,)
    """
    from jax.sharding import Mesh

    devices = target_devices(target)
    if isinstance(axis_names, str) or not all(isinstance(n, str) for n in axis_names):
        raise TypeError(
            f"axis_names must be a tuple of strings, e.g. ('data',); got {axis_names!r}"
        )
    names = tuple(axis_names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"axis_names={names}: one or more distinct names")
    if axis_shape is None:
        shape = (len(devices),) + (1,) * (len(names) - 1)
    else:
        ok = isinstance(axis_shape, (tuple, list)) and all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in axis_shape
        )
        if not ok:
            raise TypeError(f"axis_shape must be a tuple of positive ints; got {axis_shape!r}")
        shape = tuple(axis_shape)
    if len(shape) != len(names) or math.prod(shape) != len(devices):
        raise ValueError(
            f"axis_shape={tuple(shape)} for axis_names={names}: one size per name, whose "
            f"product is the {len(devices)} devices of target={target!r}"
        )
    return Mesh(np.array(devices, dtype=object).reshape(shape), names)


def device_memory_bytes(device: Any) -> int:
    """Memory of one device in bytes: its `memory_stats()["bytes_limit"]` where the backend
    reports it (GPU, an attached TPU), else `DEVICE_MEMORY_BYTES` by its device kind (a
    compile-only TPU device), else, on CPU, the host's available memory (psutil).

    Raises:
      ValueError: a device that reports no memory and whose kind is not in the table.
    """
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - compile-only devices raise instead of returning None
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    kind = str(getattr(device, "device_kind", ""))
    if kind in DEVICE_MEMORY_BYTES:
        return DEVICE_MEMORY_BYTES[kind]
    if str(getattr(device, "platform", "")) == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    raise ValueError(
        f"the memory of device kind {kind!r} is not known (it reports no memory_stats() and "
        f"is not in jremat's table: {sorted(DEVICE_MEMORY_BYTES)}); pass the budget in bytes"
    )


def args_device(args: Any) -> Any:
    """A device that arguments compile for: the first of their mesh (a compile-only TPU's
    for arguments placed on a `target_mesh`), else JAX's default device.

    Raises:
      ValueError: the arguments are sharded over different meshes (`sharding.arg_mesh`).
    """
    import jax

    from jremat._src.base.sharding import arg_mesh, mesh_device

    device = mesh_device(arg_mesh(jax.tree_util.tree_leaves(args)))
    return jax.devices()[0] if device is None else device


def abstract_on(tree: Any, mesh: Any, batch_axis: str | None = None) -> Any:
    """`tree`'s leaves as `jax.ShapeDtypeStruct`s placed on `mesh`: split along their first
    dimension over mesh axis `batch_axis` where it divides that dimension, else replicated
    (as `jremat compare --target` places a model's parameters, None, and its batch, the
    first mesh axis)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    size = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)).get(batch_axis, 1)

    def place(x: Any) -> Any:
        shape = tuple(getattr(x, "shape", ()))
        split = batch_axis is not None and shape and shape[0] % size == 0
        spec = PartitionSpec(batch_axis) if split else PartitionSpec()
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(place, tree)
