"""jremat against PyTorch's activation memory budget, on models the tests do not know.

    /work/venv-torch/bin/python benchmarks/vs_pytorch.py            # all models, both sides
    python benchmarks/vs_pytorch.py --quick                          # budgets 0.1, 0.5, 1.0
    python benchmarks/vs_pytorch.py --pytorch-from benchmarks/results/vs_pytorch.jsonl
        # jremat's side only, at the PyTorch points of an earlier run (no torch needed)
    python benchmarks/vs_pytorch.py --sweep [--cell NAME --append]
        # the GPT and MLP size sweep (`SWEEP`) at budgets 0.1/0.2/0.3/0.5: one table of cells,
        # jremat/PyTorch extra matmul FLOPs per cell, its median and worst per family

`pip install -e ".[bench]"` adds torch (CPU); torch is never a dependency of jremat.

Models (weights drawn once in numpy and loaded into both frameworks, the same batch; float32):
a pre-LN GPT decoder (layer norm, causal attention and softmax written out op by op,
cross-entropy over the vocabulary), a residual MLP chain with GELU, and a conv net (3x3
convolutions with ReLU, average pooling by reshape and mean, a linear head, cross-entropy).
The script checks that both frameworks give the same loss and gradient norm (1e-5 relative)
before measuring anything.

PyTorch (CPU, `torch.compile`, inductor): for each
`torch._functorch.config.activation_memory_budget` in 0.1 .. 0.9 and 1.0, a fresh compile
(`torch._dynamo.reset()`, inductor's FX graph and AOTAutograd caches off) of
`loss = model(params, batch)`, then `torch.autograd.grad(loss, params)`.

* peak (temp) bytes: the CPU profiler (`profile_memory=True`) records every allocation and
  free of one steady step; allocations still alive at its end (the gradients, the loss) are
  the step's outputs and are left out over their whole lifetime, as are the parameters and
  the batch (allocated before it). The peak of the remaining live bytes is what XLA's
  `memory_analysis().temp_size_in_bytes` counts for jremat: everything but arguments and
  outputs.
* saved bytes: the tensors the partitioned forward graph returns for the backward (AOTAutograd's
  saved tensors, read off the graph the partitioner returns), less the parameters and views of
  them; exact, no sampling.
* matmul FLOPs: 2*M*N*K over every `mm`/`addmm`/`bmm` and convolution (forward and
  `convolution_backward`, PyTorch's `flop_counter` formulas) of the partitioned forward and
  backward graphs; extra = that minus the joint graph's (every matmul once: the
  no-recompute step). The recomputed nodes (backward nodes that the joint graph computes in
  its forward part) are listed with their source lines.
* compile seconds: the first call (trace, partition, inductor codegen, C++ compile) minus a
  steady step.

jremat (JAX/XLA, CPU): at each PyTorch point, `jremat.plan(loss, params, batch, budget=f,
compile_budget=None)` with f = PyTorch's peak temp bytes / jremat's unrematerialized compiled
temp bytes (a fraction of temp, so the budget is in the same unit on both sides; f >= 1 is
the identity): the unlimited search, as PyTorch's partitioner has no compile budget either
(`jremat.plan`'s default caps it at 6 compiles; docs/guides/planning-cost.md).

* temp: `plan.measured_temp_bytes` (XLA's compiled temp, what the plan was verified on).
* saved bytes: JAX's residuals of the rewritten step (`saved_residuals`), less the arguments.
* matmul FLOPs: 2*M*N*K over every `dot_general` and `conv_general_dilated` of the jaxpr of
  `value_and_grad` of the rewritten function (recursively, loops times their trip count);
  extra = that minus the unrematerialized step's. For the plain step both sides count the
  same matmuls (checked: the `plain` line of each table). XLA's whole-program extra FLOPs
  (`cost_analysis`, elementwise included) are given beside it.
* plan seconds: the `jremat.plan` call (trace, reference plans, search, verifying compiles).
* floor: the smallest compiled temp any jremat plan reaches (`InfeasibleBudgetError
  .smallest_reachable_bytes` at a budget below it).

Bytes and FLOPs are deterministic for a given torch / jax version; seconds are wall seconds on
whatever machine ran it (indicative only on a shared one).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JREMAT_PLAN_CACHE", "0")  # every plan searched, none read from disk
# this checkout's jremat, not another one installed in the environment
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_MD = os.path.join(HERE, "results", "vs_pytorch.md")
BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
QUICK_BUDGETS = (0.1, 0.5, 1.0)
SWEEP_MD = os.path.join(HERE, "results", "vs_pytorch_sweep.md")
#: The sweep's PyTorch budgets: where PyTorch recomputes matmuls at the default sizes (0.1 ..
#: 0.5; none at 0.7 and above), fewer compiles per cell than the full list.
SWEEP_BUDGETS = (0.1, 0.2, 0.3, 0.5)
MIB = 2**20
#: Loss and gradient norm must agree between the frameworks to this relative tolerance.
MATCH_RTOL = 1e-5


# ----------------------------------------------------------------------------------------------
# Models: numpy weights and batch, one loss per framework over the same flat parameter list
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    """One benchmark model: `params` and `batch` as numpy arrays, one forward pass for both.

    `forward(ops, params, batch)` takes `_ops(framework)`, a list of float32 parameter arrays
    and a batch tuple in that framework's array type, and returns a scalar float32 loss;
    `jax_loss` and `torch_loss` bind it to each framework.
    """

    name: str
    description: str
    params: list[np.ndarray]
    batch: tuple[np.ndarray, ...]
    forward: Callable[..., Any]

    @property
    def jax_loss(self) -> Callable[..., Any]:
        return functools.partial(self.forward, _ops("jax"))

    @property
    def torch_loss(self) -> Callable[..., Any]:
        return functools.partial(self.forward, _ops("torch"))


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _cross_entropy(ops: Any, logits: Any, targets: Any) -> Any:
    """Mean cross-entropy of `logits` (..., classes) against integer `targets` (...), the
    log-sum-exp shifted by its stopped maximum, in either framework (`ops`)."""
    xp = ops.xp
    m = ops.stop(ops.amax(logits, -1))
    lse = xp.log(xp.exp(logits - m).sum(-1)) + m[..., 0]
    return (lse - ops.take(logits, targets)).mean()


@functools.cache
def _ops(framework: str) -> Any:
    """The few operations whose names differ between jax.numpy and torch, one namespace per
    framework, so that each model's forward pass is written once for both."""
    from types import SimpleNamespace

    if framework == "jax":
        import jax
        import jax.numpy as jnp

        return SimpleNamespace(
            xp=jnp,
            amax=lambda x, axis: jnp.max(x, axis, keepdims=True),
            swap=lambda x, a, b: jnp.swapaxes(x, a, b),
            relu=lambda x: jnp.maximum(x, 0.0),
            gelu=lambda x: jax.nn.gelu(x, approximate=True),
            stop=jax.lax.stop_gradient,
            take=lambda lg, t: jnp.take_along_axis(lg, t[..., None], -1)[..., 0],
            causal=lambda n: jnp.tril(jnp.ones((n, n), dtype=bool)),
            # channels last (NHWC), as Flax's nn.Conv; the kernels stay OIHW (PyTorch's arrays)
            channels_last=True,
            conv=lambda x, w: jax.lax.conv_general_dilated(
                x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "OIHW", "NHWC")
            ),
            mask_value=jnp.float32(-1e9),
        )
    import torch

    return SimpleNamespace(
        xp=torch,
        amax=lambda x, axis: torch.amax(x, axis, keepdim=True),
        swap=lambda x, a, b: x.transpose(a, b),
        relu=torch.relu,
        gelu=lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        stop=lambda x: x.detach(),
        take=lambda lg, t: lg.gather(-1, t[..., None])[..., 0],
        causal=lambda n: torch.tril(torch.ones((n, n), dtype=torch.bool)),
        channels_last=False,  # NCHW, PyTorch's own layout
        conv=lambda x, w: torch.nn.functional.conv2d(x, w, padding=1),
        mask_value=torch.tensor(-1e9),
    )


def gpt(layers=4, width=128, heads=4, seq=256, batch=4, vocab=1024, seed=0) -> Model:
    """A pre-LN GPT decoder: token + position embeddings, `layers` blocks of causal
    self-attention (softmax written out: max, exp, sum, divide; the mask by `where`) and a
    4x GELU MLP, a final layer norm, an untied head and mean cross-entropy (log-sum-exp minus
    the target's logit). Tokens (batch, seq) int, targets the next tokens."""
    rng = np.random.default_rng(seed)
    d = width
    p = [_normal(rng, (vocab, d), 0.02), _normal(rng, (seq, d), 0.02)]
    for _ in range(layers):
        p += [np.ones(d, np.float32), np.zeros(d, np.float32)]  # ln1
        p += [_normal(rng, (d, 3 * d), d**-0.5), np.zeros(3 * d, np.float32)]  # qkv
        p += [_normal(rng, (d, d), d**-0.5 / layers), np.zeros(d, np.float32)]  # out proj
        p += [np.ones(d, np.float32), np.zeros(d, np.float32)]  # ln2
        p += [_normal(rng, (d, 4 * d), d**-0.5), np.zeros(4 * d, np.float32)]  # mlp in
        p += [_normal(rng, (4 * d, d), (4 * d) ** -0.5 / layers), np.zeros(d, np.float32)]
    p += [np.ones(d, np.float32), np.zeros(d, np.float32), _normal(rng, (d, vocab), d**-0.5)]
    tokens = rng.integers(0, vocab, (batch, seq + 1))
    data = (tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32))
    dh = d // heads

    def forward(ops, params, batch_):
        tok, tgt = batch_
        xp = ops.xp
        it = iter(params)
        wte, wpe = next(it), next(it)

        def norm(x, g, b):
            c = x - x.mean(-1, keepdims=True)
            return c / xp.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + b

        def heads_first(t):  # (batch, seq, d) -> (batch, heads, seq, dh)
            return ops.swap(t.reshape(batch, seq, heads, dh), 1, 2)

        x = wte[tok] + wpe[None]
        causal = ops.causal(seq)
        for _ in range(layers):
            g1, b1, wqkv, bqkv, wo, bo, g2, b2, w1, c1, w2, c2 = (next(it) for _ in range(12))
            qkv = norm(x, g1, b1) @ wqkv + bqkv
            q, k, v = (heads_first(qkv[..., i * d : (i + 1) * d]) for i in range(3))
            s = (q @ ops.swap(k, -1, -2)) * (dh**-0.5)
            s = xp.where(causal, s, ops.mask_value)
            e = xp.exp(s - ops.stop(ops.amax(s, -1)))
            o = (e / e.sum(-1, keepdims=True)) @ v
            x = x + ops.swap(o, 1, 2).reshape(batch, seq, d) @ wo + bo
            x = x + ops.gelu(norm(x, g2, b2) @ w1 + c1) @ w2 + c2
        gf, bf, head = next(it), next(it), next(it)
        logits = norm(x, gf, bf) @ head
        return _cross_entropy(ops, logits, tgt)

    desc = (
        f"pre-LN GPT decoder: {layers} layers, width {width}, {heads} heads, batch {batch} x "
        f"{seq} tokens, vocabulary {vocab}"
    )
    return Model("gpt", desc, p, data, forward)


def mlp(layers=8, width=256, hidden=1024, rows=1024, seed=1) -> Model:
    """A residual MLP chain: `x + W2 gelu(W1 x + b1) + b2` per layer, a linear readout and a
    mean squared error against random targets."""
    rng = np.random.default_rng(seed)
    p: list[np.ndarray] = []
    for _ in range(layers):
        p += [_normal(rng, (width, hidden), width**-0.5), np.zeros(hidden, np.float32)]
        p += [_normal(rng, (hidden, width), hidden**-0.5 / 2), np.zeros(width, np.float32)]
    p += [_normal(rng, (width, 16), width**-0.5)]
    data = (_normal(rng, (rows, width), 1.0), _normal(rng, (rows, 16), 1.0))

    def forward(ops, params, batch_):
        x, y = batch_
        it = iter(params)
        for _ in range(layers):
            w1, b1, w2, b2 = (next(it) for _ in range(4))
            x = x + ops.gelu(x @ w1 + b1) @ w2 + b2
        r = x @ next(it) - y
        return (r * r).mean()

    desc = f"residual MLP chain: {layers} layers, width {width}, hidden {hidden}, {rows} rows"
    return Model("mlp", desc, p, data, forward)


def convnet(channels=(32, 64, 128), batch=16, size=64, classes=10, seed=2) -> Model:
    """A conv net: per stage two 3x3 convolutions (stride 1, padding 1, bias) with ReLU and a
    2x2 average pool (reshape and mean), then a global average pool, a linear head and mean
    cross-entropy. The same batch (NCHW) and OIHW kernels in both frameworks; each computes in
    its own convolution layout (`ops.channels_last`): PyTorch in NCHW, JAX in NHWC (the batch
    transposed once on entry), as Flax's `nn.Conv` does. XLA:CPU's convolutions run on NHWC
    activations: written in NCHW, the step copies activations and gradients between the two
    layouts around every convolution (jax 0.10: compiled temp 52.8 -> 50.8 MiB unrematerialized,
    jremat's floor 40.1 -> 34.8 MiB in NHWC; the loss and gradients agree to 1e-7 either way)."""
    rng = np.random.default_rng(seed)
    p: list[np.ndarray] = []
    cin = 3
    for c in channels:
        for _ in range(2):
            p += [_normal(rng, (c, cin, 3, 3), (9 * cin) ** -0.5), np.zeros(c, np.float32)]
            cin = c
    p += [_normal(rng, (cin, classes), cin**-0.5), np.zeros(classes, np.float32)]
    images = _normal(rng, (batch, 3, size, size), 1.0)
    labels = rng.integers(0, classes, (batch,)).astype(np.int32)

    def forward(ops, params, batch_):
        x, y = batch_
        last = ops.channels_last
        if last:
            x = ops.xp.permute_dims(x, (0, 2, 3, 1))  # NCHW -> NHWC
        it = iter(params)
        for _ in channels:
            for _ in range(2):
                w, b = next(it), next(it)
                x = ops.relu(ops.conv(x, w) + (b if last else b[None, :, None, None]))
            if last:
                n, h, wd, c = x.shape
                x = x.reshape(n, h // 2, 2, wd // 2, 2, c).mean((2, 4))
            else:
                n, c, h, wd = x.shape
                x = x.reshape(n, c, h // 2, 2, wd // 2, 2).mean((3, 5))
        logits = x.mean((1, 2) if last else (2, 3)) @ next(it) + next(it)
        return _cross_entropy(ops, logits, y)

    desc = (
        f"conv net: 3 stages of two 3x3 convs ({', '.join(map(str, channels))} channels) + "
        f"avg pool, batch {batch} x 3 x {size} x {size}, {classes} classes"
    )
    return Model("convnet", desc, p, (images, labels), forward)


MODELS: dict[str, Callable[..., Model]] = {"gpt": gpt, "mlp": mlp, "convnet": convnet}

#: The size sweep (`--sweep`): per family, cells that vary depth, width and batch x sequence
#: (rows), each factory's fixed seed. The first of each family is its default size; the GPT's
#: second is the held-out size of the planning-cost work (6 layers, width 128, batch 8).
SWEEP: tuple[tuple[str, dict[str, int]], ...] = (
    ("gpt", {}),
    ("gpt", {"layers": 6, "width": 128, "batch": 8}),
    ("gpt", {"layers": 2, "width": 64, "seq": 128, "batch": 8}),
    ("gpt", {"layers": 8, "width": 64, "seq": 128, "batch": 4}),
    ("gpt", {"width": 256}),
    ("gpt", {"seq": 512, "batch": 2}),
    ("mlp", {}),
    ("mlp", {"layers": 4, "width": 512, "hidden": 2048, "rows": 512}),
    ("mlp", {"layers": 16, "width": 128, "hidden": 512, "rows": 2048}),
    ("mlp", {"rows": 4096}),
    ("mlp", {"layers": 16, "rows": 512}),
)
#: Short keys of the factories' size arguments, for cell names.
_SIZE_KEYS = {"layers": "L", "width": "d", "hidden": "hid", "rows": "r"}


def sweep_cell(family: str, sizes: dict[str, int]) -> Model:
    """The `family` model at `sizes` (the factory's defaults for the rest), named by its
    sizes: `gpt-L6-d128-b8x256`, `mlp-L8-d256-hid1024-r1024`."""
    import inspect

    full = {
        k: v.default for k, v in inspect.signature(MODELS[family]).parameters.items() if k != "seed"
    }
    full.update(sizes)
    parts = [family]
    for k, short in _SIZE_KEYS.items():
        if k in full:
            parts.append(f"{short}{full[k]}")
    if family == "gpt":
        parts.append(f"b{full['batch']}x{full['seq']}")
    model = MODELS[family](**sizes)
    return dataclasses.replace(model, name="-".join(parts))


# ----------------------------------------------------------------------------------------------
# PyTorch side
# ----------------------------------------------------------------------------------------------

#: aten ops counted as matmul FLOPs (PyTorch's `flop_counter` formulas: 2*M*N*K).
TORCH_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")
#: Ops that only view their input (a saved view of a parameter stores no new bytes).
TORCH_VIEWS = ("t", "view", "reshape", "permute", "transpose", "expand", "_unsafe_view", "alias")


def _torch_batch(model: Model) -> tuple:
    import torch

    return tuple(
        torch.from_numpy(b.astype(np.int64) if b.dtype.kind == "i" else b) for b in model.batch
    )


def _torch_params(model: Model) -> list:
    import torch

    return [torch.from_numpy(p.copy()).requires_grad_() for p in model.params]


def _node_flops(node: Any) -> float:
    """2*M*N*K of one fx node if it is a matmul or convolution, else 0."""
    import torch
    from torch.utils.flop_counter import flop_registry

    target = getattr(node, "target", None)
    packet = getattr(target, "overloadpacket", None)
    if packet is None or packet.__name__ not in TORCH_MATMULS or packet not in flop_registry:
        return 0.0
    val = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a
    args = torch.utils._pytree.tree_map(val, node.args)
    kwargs = torch.utils._pytree.tree_map(val, node.kwargs)
    return float(flop_registry[packet](*args, **kwargs, out_val=node.meta["val"]))


def _graph_flops(gm: Any) -> float:
    return sum(_node_flops(n) for n in gm.graph.nodes if n.op == "call_function")


def _source(node: Any) -> str:
    """The model line a node comes from: `line N: code` of its stack trace's last frame."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    lines = [ln for ln in lines if ln and set(ln) - set("^~ ")]  # no caret underlines
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File ") and ", line " in lines[i]:
            num = lines[i].split(", line ")[1].split(",")[0]
            code = lines[i + 1] if i + 1 < len(lines) else "?"
            return f"line {num}: {code}"
    return "?"


def _forward_names(joint: Any) -> set[str]:
    """Names of the joint graph's forward nodes: those that no tangent reaches."""
    tangent: set[str] = set()
    for n in joint.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            tangent.add(n.name)
        elif any(a.name in tangent for a in n.all_input_nodes):
            tangent.add(n.name)
    return {n.name for n in joint.graph.nodes if n.name not in tangent and n.op != "output"}


def _saved_tensors(fw: Any, num_outputs: int) -> tuple[int, list[tuple[str, tuple, int]]]:
    """Bytes the forward graph hands the backward (outputs past the first `num_outputs`),
    less parameters and inputs and views of them; and (name, shape, bytes) of each."""
    import torch

    (outs,) = [n.args[0] for n in fw.graph.nodes if n.op == "output"]

    def base(n: Any) -> Any:
        while (
            n.op == "call_function"
            and getattr(getattr(n.target, "overloadpacket", None), "__name__", "") in TORCH_VIEWS
        ):
            n = n.args[0]
        return n

    total, listed = 0, []
    for n in outs[num_outputs:]:
        if not isinstance(n, torch.fx.Node) or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        v = n.meta["val"]
        nbytes = 0 if base(n).op == "placeholder" else v.numel() * v.element_size()
        total += nbytes
        listed.append((n.name, tuple(v.shape), nbytes))
    return total, listed


def _profile_step(compiled: Callable, params: list, batch: tuple) -> dict[str, int]:
    """Peak live bytes of one step without its arguments and outputs, and the live bytes at
    the start of the backward pass (what the forward left for it), from the CPU profiler."""
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench_forward"):
            loss = compiled(params, batch)
        with record_function("bench_backward"):
            grads = torch.autograd.grad(loss, params)
    del grads, loss
    allocs, marks = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
            allocs.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        elif e.name in ("bench_forward", "bench_backward"):
            marks[e.name] = e.start_time_ns
    allocs.sort(key=lambda a: a[0])
    # First pass: which allocations outlive the step (the step's outputs).
    live: dict[int, int] = {}
    alloc_index: dict[int, int] = {}
    survivors: set[int] = set()
    for i, (_, ptr, size) in enumerate(allocs):
        if size > 0:
            live[ptr] = size
            alloc_index[ptr] = i
        else:
            live.pop(ptr, None)
    survivors = {alloc_index[p] for p in live}
    # Second pass: live bytes of everything else.
    cur = peak = at_backward = 0
    counted: set[int] = set()
    backward_t = marks.get("bench_backward", math.inf)
    seen_backward = False
    for i, (t, ptr, size) in enumerate(allocs):
        if not seen_backward and t >= backward_t:
            at_backward, seen_backward = cur, True
        if size > 0:
            if i in survivors:
                continue
            counted.add(ptr)
            cur += size
        elif ptr in counted:
            counted.discard(ptr)
            cur += size
        peak = max(peak, cur)
    if not seen_backward:
        at_backward = cur
    return {"peak": peak, "held_after_forward": at_backward}


def torch_point(model: Model, budget: float) -> dict[str, Any]:
    """Compile and measure the PyTorch step under `activation_memory_budget = budget`."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    torch._dynamo.reset()
    functorch_config.activation_memory_budget = budget
    captured: dict[str, Any] = {}
    original = compile_fx.min_cut_rematerialization_partition

    def recording_partition(joint, joint_inputs, **kw):
        fw, bw = original(joint, joint_inputs, **kw)
        captured.update(joint=joint, fw=fw, bw=bw, num_fwd_outputs=kw.get("num_fwd_outputs", 1))
        return fw, bw

    params, batch = _torch_params(model), _torch_batch(model)
    compiled = torch.compile(model.torch_loss)
    compile_fx.min_cut_rematerialization_partition = recording_partition
    try:
        t0 = time.perf_counter()
        loss = compiled(params, batch)
        torch.autograd.grad(loss, params)
        first = time.perf_counter() - t0
    finally:
        compile_fx.min_cut_rematerialization_partition = original
    t0 = time.perf_counter()
    loss = compiled(params, batch)
    torch.autograd.grad(loss, params)
    step = time.perf_counter() - t0
    mem = _profile_step(compiled, params, batch)
    joint, fw, bw = captured["joint"], captured["fw"], captured["bw"]
    fwd_names = _forward_names(joint)
    recomputed = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in fwd_names]
    matmuls = [
        {
            "op": n.target.overloadpacket.__name__,
            "shape": list(n.meta["val"].shape),
            "flops": _node_flops(n),
            "source": _source(n),
        }
        for n in recomputed
        if _node_flops(n) > 0
    ]
    other: dict[str, int] = {}
    for n in recomputed:
        if _node_flops(n) == 0:
            name = getattr(getattr(n.target, "overloadpacket", None), "__name__", str(n.target))
            other[name] = other.get(name, 0) + 1
    saved, saved_list = _saved_tensors(fw, captured["num_fwd_outputs"])
    plain = _graph_flops(joint)
    return {
        "side": "pytorch",
        "model": model.name,
        "budget": budget,
        "loss": loss.item(),
        "temp_bytes": mem["peak"],
        "held_after_forward_bytes": mem["held_after_forward"],
        "saved_bytes": saved,
        "saved": saved_list,
        "matmul_flops": _graph_flops(fw) + _graph_flops(bw),
        "plain_matmul_flops": plain,
        "recomputed_matmuls": matmuls,
        "recomputed_other_ops": dict(sorted(other.items(), key=lambda kv: -kv[1])),
        "compile_seconds": max(first - step, 0.0),
        "step_seconds": step,
        "torch": torch.__version__,
    }


def torch_check(model: Model) -> dict[str, float]:
    """Eager loss and gradient norm (the reference the JAX side must match)."""
    import torch

    params = _torch_params(model)
    loss = model.torch_loss(params, _torch_batch(model))
    grads = torch.autograd.grad(loss, params)
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    return {"loss": loss.item(), "grad_norm": norm}


# ----------------------------------------------------------------------------------------------
# jremat side
# ----------------------------------------------------------------------------------------------


def _jax_inputs(model: Model) -> tuple[list, tuple]:
    import jax.numpy as jnp

    return [jnp.asarray(p) for p in model.params], tuple(jnp.asarray(b) for b in model.batch)


def _eqn_matmul_flops(eqn: Any) -> float:
    """2*M*N*K of a `dot_general` or `conv_general_dilated` equation, else 0."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(out.shape) * math.prod(lhs[i] for i in lc)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        macs_per_out = math.prod(rhs) // rhs[out_feature_dim] // eqn.params["batch_group_count"]
        return 2.0 * math.prod(out.shape) * macs_per_out
    return 0.0


def jaxpr_matmul_flops(jaxpr: Any) -> float:
    """Matmul and convolution FLOPs of a jaxpr, sub-jaxprs included (scan bodies times their
    length; for `cond`, the most expensive branch)."""
    import jax

    total = 0.0
    for eqn in jaxpr.eqns:
        total += _eqn_matmul_flops(eqn)
        subs = [
            v.jaxpr if isinstance(v, jax.extend.core.ClosedJaxpr) else v
            for k, v in eqn.params.items()
            if isinstance(v, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr)
        ]
        if eqn.primitive.name == "cond":
            total += max(jaxpr_matmul_flops(b.jaxpr) for b in eqn.params["branches"])
        elif subs:
            trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            total += trips * sum(jaxpr_matmul_flops(s) for s in subs)
    return total


def step_matmul_flops(fn: Callable, params: list, batch: tuple) -> float:
    """Matmul FLOPs of `value_and_grad(fn)` (forward and backward, recompute included)."""
    import jax

    return jaxpr_matmul_flops(jax.make_jaxpr(jax.value_and_grad(fn))(params, batch).jaxpr)


def saved_residual_bytes(fn: Callable, params: list, batch: tuple) -> int:
    """Bytes of the residuals JAX keeps for `fn`'s backward pass, arguments left out."""
    from jax._src.ad_checkpoint import saved_residuals

    found = saved_residuals(lambda p: fn(p, batch), params)
    return sum(
        math.prod(aval.shape) * aval.dtype.itemsize
        for aval, why in found
        if "from the argument" not in why
    )


def jax_check(model: Model) -> dict[str, float]:
    import jax

    params, batch = _jax_inputs(model)
    loss, grads = jax.jit(jax.value_and_grad(model.jax_loss))(params, batch)
    norm = math.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum()) for g in grads))
    return {"loss": float(loss), "grad_norm": norm}


def jremat_baseline(model: Model) -> dict[str, Any]:
    """The unrematerialized step's compiled figures, residuals and matmul FLOPs."""
    import jax

    import jremat

    params, batch = _jax_inputs(model)
    m = jremat.measure(model.jax_loss, params, batch)
    return {
        "temp_bytes": m.temp_bytes,
        "flops": m.flops,
        "matmul_flops": step_matmul_flops(model.jax_loss, params, batch),
        "saved_bytes": saved_residual_bytes(model.jax_loss, params, batch),
        "jax": jax.__version__,
    }


def jremat_point(model: Model, target_temp: int, base: dict[str, Any]) -> dict[str, Any]:
    """`jremat.plan` at `target_temp` bytes of compiled temp (as a fraction of the baseline)."""
    import jremat

    params, batch = _jax_inputs(model)
    frac = min(target_temp / base["temp_bytes"], 1.0)
    row: dict[str, Any] = {
        "side": "jremat",
        "model": model.name,
        "target_temp_bytes": target_temp,
        "budget": frac,
    }
    t0 = time.perf_counter()
    try:
        plan = jremat.plan(model.jax_loss, params, batch, budget=frac, compile_budget=None)
    except jremat.InfeasibleBudgetError as e:
        row.update(
            infeasible=True,
            plan_seconds=time.perf_counter() - t0,
            smallest_reachable_bytes=e.smallest_reachable_bytes,
        )
        return row
    row["plan_seconds"] = time.perf_counter() - t0
    fn = jremat.rematerialize(model.jax_loss, plan)
    temp, flops = plan.measured_temp_bytes, plan.measured_flops
    if temp is None or flops is None:  # the identity plan carries no compiled figures
        m = jremat.measure(fn, params, batch)
        temp, flops = m.temp_bytes, m.flops
    row.update(
        infeasible=False,
        solver=plan.solver,
        temp_bytes=temp,
        met=temp <= target_temp or frac >= 1.0,
        flops=flops,
        matmul_flops=step_matmul_flops(fn, params, batch),
        saved_bytes=saved_residual_bytes(fn, params, batch),
        checkpointed_segments=sum(s.checkpointed for s in plan.segments),
        # what the plan recomputes: its checkpointed segments (equations, policy, values
        # saved, predicted recompute FLOPs, source lines)
        segments=[
            {
                "eqns": [s.start, s.end],
                "policy": s.policy,
                "saved": len(s.saved),
                "recompute_flops": s.recompute_flops,
                "source": s.source,
            }
            for s in plan.segments
            if s.checkpointed
        ],
    )
    return row


def jremat_floor(model: Model) -> dict[str, Any]:
    """The smallest compiled temp any jremat plan reaches (asked below it, the error says)."""
    import jremat

    params, batch = _jax_inputs(model)
    t0 = time.perf_counter()
    try:
        plan = jremat.plan(model.jax_loss, params, batch, budget=0.01, compile_budget=None)
        floor = plan.measured_temp_bytes
    except jremat.InfeasibleBudgetError as e:
        floor = e.smallest_reachable_bytes
    return {"floor_temp_bytes": floor, "floor_seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MIB:.1f}"


def _pct(extra: float, plain: float) -> str:
    return f"{100 * extra / plain:+.1f}%"


def model_table(model: Model, check: dict, base: dict, pts: list, jrs: dict, floor: dict) -> str:
    """Markdown for one model: the points, the floor, and what PyTorch recomputes."""
    lines = [f"### {model.name}: {model.description}", ""]
    lines.append(
        f"Loss {check['jax_loss']:.8f} (JAX) / {check['torch_loss']:.8f} (PyTorch), gradient norm "
        f"{check['jax_grad_norm']:.6e} / {check['torch_grad_norm']:.6e}. Plain step: "
        f"{base['matmul_flops'] / 1e9:.4f} matmul GFLOP (jaxpr) / "
        f"{pts[0]['plain_matmul_flops'] / 1e9:.4f} (PyTorch joint graph); jremat's "
        f"unrematerialized temp {_mib(base['temp_bytes'])} MiB, residuals "
        f"{_mib(base['saved_bytes'])} MiB."
    )
    lines += [
        "",
        "| PyTorch budget | PT temp MiB | PT saved MiB | PT extra matmul | PT compile s "
        "| jremat budget | jremat temp MiB | met | jremat saved MiB | jremat extra matmul "
        "| jremat extra XLA FLOPs | jremat plan s | extra ratio jremat/PT |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for p in pts:
        j = jrs[p["temp_bytes"]]
        pt_extra = p["matmul_flops"] - p["plain_matmul_flops"]
        pt_cols = (
            f"| {p['budget']:.1f} | {_mib(p['temp_bytes'])} | {_mib(p['saved_bytes'])} | "
            f"{_pct(pt_extra, p['plain_matmul_flops'])} | {p['compile_seconds']:.1f} "
        )
        if j["infeasible"]:
            lines.append(
                pt_cols + f"| {j['budget']:.3f} | infeasible (floor "
                f"{_mib(j['smallest_reachable_bytes'])}) | no | - | - | - | "
                f"{j['plan_seconds']:.1f} | - |"
            )
            continue
        j_extra = j["matmul_flops"] - base["matmul_flops"]
        if pt_extra > 0:
            ratio = f"{j_extra / pt_extra:.2f}"
            ratios.append(j_extra / pt_extra)
        else:
            ratio = "-" if j_extra == 0 else "inf"
        lines.append(
            pt_cols + f"| {j['budget']:.3f} | {_mib(j['temp_bytes'])} | "
            f"{'yes' if j['met'] else 'NO'} | {_mib(j['saved_bytes'])} | "
            f"{_pct(j_extra, base['matmul_flops'])} | "
            f"{_pct(j['flops'] - base['flops'], base['flops'])} | {j['plan_seconds']:.1f} | "
            f"{ratio} |"
        )
    lowest = min(p["temp_bytes"] for p in pts)
    ok = floor["floor_temp_bytes"] <= lowest
    lines += [
        "",
        f"jremat's floor: {_mib(floor['floor_temp_bytes'])} MiB of compiled temp "
        f"({floor['floor_temp_bytes'] / base['temp_bytes']:.2f} of unrematerialized; "
        f"{floor['floor_seconds']:.0f} s to find); PyTorch's lowest peak {_mib(lowest)} MiB: "
        f"floor {'at or below' if ok else 'ABOVE'} it.",
    ]
    if ratios:
        lines.append(
            "Extra matmul FLOPs jremat/PyTorch where PyTorch recomputes matmuls: "
            f"{', '.join(f'{r:.2f}' for r in ratios)}; max {max(ratios):.2f} (goal: at most 0.8 "
            "at every point)."
        )
    lines += ["", "What PyTorch's partition recomputes in the backward pass, per budget:", ""]
    for p in pts:
        mm: dict[tuple, list] = {}
        for r in p["recomputed_matmuls"]:
            key = (r["op"], tuple(r["shape"]), r["source"])
            mm.setdefault(key, []).append(r["flops"])
        mms = "; ".join(
            f"{len(v)}x {op}->{'x'.join(map(str, shape))} `{src}`"
            for (op, shape, src), v in sorted(mm.items(), key=lambda kv: -sum(kv[1]))
        )
        other = ", ".join(f"{k} {v}" for k, v in list(p["recomputed_other_ops"].items())[:8])
        lines.append(f"- {p['budget']:.1f}: matmuls: {mms or 'none'}; other ops: {other or 'none'}")
    return "\n".join(lines)


HEADER = """# jremat vs PyTorch's activation memory budget

Written by `benchmarks/vs_pytorch.py` (its docstring has the method). PyTorch {torch} (CPU,
`torch.compile` with inductor, `torch._functorch.config.activation_memory_budget`); jax {jax}.

Memory on both sides is **temp**: the step's peak live bytes without its arguments (parameters,
batch) and outputs (gradients, loss). PyTorch: the CPU profiler's allocations of one steady
step; jremat: XLA's compiled `temp_size_in_bytes`, which the plan was verified on. jremat is
asked for PyTorch's temp at each point (as a fraction of its own unrematerialized temp; a
fraction >= 1 is the identity). **saved** is what the forward pass hands the backward pass:
the tensors of PyTorch's partitioned forward graph, JAX's residual list of the rewritten step
(`saved_residuals`), arguments and their views left out. **extra matmul** is 2*M*N*K over
every matmul and convolution of the forward and backward passes, above each framework's
no-recompute step (the same matmuls on both sides: see the plain-step line). **extra XLA
FLOPs** is XLA's whole-program cost analysis (elementwise too) above jremat's
unrematerialized step. Seconds are wall seconds on a shared 2-core machine: indicative only.
"""


def pytorch_side(model: Model, budgets: tuple[float, ...], sink: Callable) -> list[dict]:
    """The eager check and one point per budget, each record passed to `sink` as it is made."""
    import torch
    import torch._inductor.config as inductor_config

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    inductor_config.compile_threads = 1  # one gcc at a time on a shared machine
    records = [{"side": "check", "model": model.name, **torch_check(model)}]
    sink(records[-1])
    for b in budgets:
        t0 = time.perf_counter()
        records.append(torch_point(model, b))
        sink(records[-1])
        print(
            f"   pytorch {b:.1f}: temp {_mib(records[-1]['temp_bytes'])} MiB, "
            f"{time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return records


def jremat_side(model: Model, pytorch: list[dict], sink: Callable) -> str:
    """jremat at each PyTorch point of `model` (records of `pytorch_side`); the Markdown."""
    (tcheck,) = [r for r in pytorch if r["side"] == "check" and r["model"] == model.name]
    pts = [r for r in pytorch if r["side"] == "pytorch" and r["model"] == model.name]
    jcheck = jax_check(model)
    rel = max(
        abs(jcheck["loss"] - tcheck["loss"]) / abs(tcheck["loss"]),
        abs(jcheck["grad_norm"] - tcheck["grad_norm"]) / abs(tcheck["grad_norm"]),
    )
    if rel > MATCH_RTOL:
        raise SystemExit(f"{model.name}: JAX {jcheck} and PyTorch {tcheck} disagree ({rel:.1e})")
    check = {
        "jax_loss": jcheck["loss"],
        "torch_loss": tcheck["loss"],
        "jax_grad_norm": jcheck["grad_norm"],
        "torch_grad_norm": tcheck["grad_norm"],
    }
    sink({"side": "jremat_check", "model": model.name, **jcheck})
    base = jremat_baseline(model)
    sink({"side": "jremat_baseline", "model": model.name, **base})
    jrs: dict[int, dict] = {}
    floor: dict[str, Any] | None = None
    # Lowest target first: an infeasible one states the floor, which holds whatever budget was
    # asked (jremat states it from budget-independent plans), so the targets below it are
    # infeasible without planning again.
    for p in sorted(pts, key=lambda p: p["temp_bytes"]):
        target = p["temp_bytes"]
        if target in jrs:  # budgets PyTorch partitions alike: one jremat plan
            continue
        t0 = time.perf_counter()
        if floor is not None and target < floor["floor_temp_bytes"]:
            j = {
                "side": "jremat",
                "model": model.name,
                "target_temp_bytes": target,
                "budget": min(target / base["temp_bytes"], 1.0),
                "infeasible": True,
                "plan_seconds": 0.0,
                "smallest_reachable_bytes": floor["floor_temp_bytes"],
                "note": "below the floor an earlier point stated",
            }
        else:
            j = jremat_point(model, target, base)
            if j["infeasible"]:
                floor = {
                    "floor_temp_bytes": j["smallest_reachable_bytes"],
                    "floor_seconds": j["plan_seconds"],
                }
        jrs[target] = j
        sink(j)
        print(
            f"   jremat at {_mib(target)} MiB: temp {_mib(j.get('temp_bytes'))} "
            f"MiB, {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    if floor is None:
        floor = jremat_floor(model)
    sink({"side": "jremat_floor", "model": model.name, **floor})
    return model_table(model, check, base, pts, jrs, floor)


def tables_from(records: list[dict], model: Model) -> str:
    """The Markdown of `model` from the JSON lines of an earlier full run (nothing compiled
    but the JAX check, where the run predates its record)."""
    mine = [r for r in records if r["model"] == model.name]
    by_side = lambda side: [r for r in mine if r["side"] == side]
    (tcheck,) = by_side("check")
    jchecks = by_side("jremat_check") or [jax_check(model)]
    check = {
        "jax_loss": jchecks[0]["loss"],
        "torch_loss": tcheck["loss"],
        "jax_grad_norm": jchecks[0]["grad_norm"],
        "torch_grad_norm": tcheck["grad_norm"],
    }
    (base,) = by_side("jremat_baseline")
    (floor,) = by_side("jremat_floor")
    jrs = {r["target_temp_bytes"]: r for r in by_side("jremat")}
    return model_table(model, check, base, by_side("pytorch"), jrs, floor)


SWEEP_HEADER = """# jremat vs PyTorch's activation memory budget: size sweep

Written by `benchmarks/vs_pytorch.py --sweep` (its docstring has the method; the measures are
those of `vs_pytorch.md`). PyTorch {torch} (CPU, `torch.compile` with inductor,
`torch._functorch.config.activation_memory_budget` at {budgets}); jax {jax}. Each cell is one
model size (weights and batch drawn from the factory's fixed seed) at one PyTorch budget;
jremat is asked for PyTorch's peak temp there. **ratio** is jremat's extra matmul
FLOPs over PyTorch's at that memory, defined where PyTorch recomputes matmuls (extra > 0); the
median and worst are taken over those cells (a cell jremat cannot reach counts as worst).
"""


def _median(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs)


def _sweep_cells(records: list[dict]) -> list[dict]:
    """The sweep's cell records, in `SWEEP`'s order (family by family), whatever order they
    ran in; cells not in `SWEEP` last."""
    order = {sweep_cell(f, s).name: i for i, (f, s) in enumerate(SWEEP)}
    cells = [r for r in records if r["side"] == "sweep_cell"]
    return sorted(cells, key=lambda r: order.get(r["model"], len(order)))


def sweep_summary(records: list[dict]) -> tuple[str, list[dict]]:
    """The Markdown cell table and summary of a sweep's records, and one dict per cell."""
    cells = _sweep_cells(records)
    rows: list[dict] = []
    for c in cells:
        mine = [r for r in records if r["model"] == c["model"]]
        base = next((r for r in mine if r["side"] == "jremat_baseline"), None)
        jrs = {r["target_temp_bytes"]: r for r in mine if r["side"] == "jremat"}
        for p in (r for r in mine if r["side"] == "pytorch"):
            pt_extra = p["matmul_flops"] - p["plain_matmul_flops"]
            row = {
                "family": c["family"],
                "cell": c["model"],
                "description": c["description"],
                "pytorch_budget": p["budget"],
                "pytorch_temp_bytes": p["temp_bytes"],
                "pytorch_extra": pt_extra / p["plain_matmul_flops"],
                "pytorch_recomputes": pt_extra > 0,
            }
            j = jrs.get(p["temp_bytes"])
            if base is None or j is None:
                row["jremat"] = "not run"
            elif j["infeasible"]:
                row.update(jremat="infeasible", jremat_floor=j["smallest_reachable_bytes"])
            else:
                j_extra = j["matmul_flops"] - base["matmul_flops"]
                row.update(
                    jremat="ok" if j["met"] else "over",
                    jremat_budget=j["budget"],
                    jremat_temp_bytes=j["temp_bytes"],
                    jremat_extra=j_extra / base["matmul_flops"],
                    jremat_segments=j.get("segments", []),
                )
                if pt_extra > 0:
                    row["ratio"] = j_extra / pt_extra
            if pt_extra > 0 and row["jremat"] in ("infeasible", "over"):
                row["ratio"] = math.inf
            rows.append(row)
    lines = [
        "| family | cell | PyTorch budget | PT temp MiB | jremat temp MiB | PT extra matmul "
        "| jremat extra matmul | ratio jremat/PT | jremat checkpointed segments |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["jremat"] in ("ok", "over"):
            jt, jx = _mib(r["jremat_temp_bytes"]), f"{100 * r['jremat_extra']:+.1f}%"
            jt += "" if r["jremat"] == "ok" else " (over)"
            segs = r["jremat_segments"]
            gflop = sum(s["recompute_flops"] for s in segs) / 1e9
            seg = f"{len(segs)}, {gflop:.3g} GFLOP predicted" if segs else "none"
        elif r["jremat"] == "infeasible":
            jt, jx, seg = f"infeasible (floor {_mib(r['jremat_floor'])})", "-", "-"
        else:
            jt, jx, seg = "not run", "-", "-"
        ratio = r.get("ratio")
        rt = "-" if ratio is None else ("inf" if math.isinf(ratio) else f"{ratio:.2f}")
        lines.append(
            f"| {r['family']} | {r['cell']} | {r['pytorch_budget']:.1f} | "
            f"{_mib(r['pytorch_temp_bytes'])} | {jt} | {100 * r['pytorch_extra']:+.1f}% | "
            f"{jx} | {rt} | {seg} |"
        )
    lines += [
        "",
        "Ratio jremat/PyTorch extra matmul FLOPs over cells where PyTorch recomputes matmuls:",
        "",
    ]
    for fam in [*dict.fromkeys(r["family"] for r in rows), None]:
        rs = [r["ratio"] for r in rows if "ratio" in r and (fam is None or r["family"] == fam)]
        label = fam or "all families"
        if rs:
            worst = max(rs)
            lines.append(
                f"- {label}: {len(rs)} cells, median {_median(rs):.2f}, worst "
                f"{'inf' if math.isinf(worst) else f'{worst:.2f}'}"
            )
        else:
            lines.append(f"- {label}: no cell where PyTorch recomputes matmuls")
    return "\n".join(lines), rows


def sweep_markdown(records: list[dict]) -> str:
    """The whole sweep file: header, cell table and summary, then each cell's own table."""
    first = lambda side, key: next((r[key] for r in records if r["side"] == side), "?")
    budgets = sorted({r["budget"] for r in records if r["side"] == "pytorch"})
    head = SWEEP_HEADER.format(
        torch=first("pytorch", "torch"),
        jax=first("jremat_baseline", "jax"),
        budgets=", ".join(f"{b:.1f}" for b in budgets),
    )
    table, _ = sweep_summary(records)
    sections = []
    for c in _sweep_cells(records):
        have = {r["side"] for r in records if r["model"] == c["model"]}
        if {"check", "jremat_baseline", "jremat_floor"} <= have:
            model = sweep_cell(c["family"], c["sizes"])
            sections.append(tables_from(records, model))
    return "\n".join([head, "## Cells", "", table, "", "## Per cell", "", *sections]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="repeatable")
    ap.add_argument("--quick", action="store_true", help=f"budgets {QUICK_BUDGETS}")
    ap.add_argument("--budgets", help="comma-separated PyTorch budgets (default 0.1 .. 1.0)")
    ap.add_argument("--out", default=OUT_MD, help="Markdown file (JSON lines beside it)")
    ap.add_argument(
        "--pytorch-from",
        help="JSON lines of an earlier run: reuse its PyTorch points and checks (no torch)",
    )
    ap.add_argument(
        "--pytorch-only", action="store_true", help="measure PyTorch's side only (JSON lines)"
    )
    ap.add_argument(
        "--tables-from", help="JSON lines of an earlier full run: write its Markdown only"
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help=f"the size sweep (SWEEP; budgets {SWEEP_BUDGETS} unless --budgets), to "
        f"{os.path.relpath(SWEEP_MD)} unless --out",
    )
    ap.add_argument("--cell", action="append", help="with --sweep: only this cell (repeatable)")
    ap.add_argument(
        "--append", action="store_true", help="append to the JSON lines instead of replacing"
    )
    args = ap.parse_args(argv)
    names = args.model or list(MODELS)
    if args.sweep:
        if args.out == OUT_MD:
            args.out = SWEEP_MD
        if args.budgets is None and not args.quick:
            args.budgets = ",".join(map(str, SWEEP_BUDGETS))
    if args.sweep and args.tables_from:
        with open(args.tables_from) as f:
            records = [json.loads(line) for line in f if line.strip()]
        text = sweep_markdown(records)
        with open(args.out, "w") as f:
            f.write(text)
        print(text)
        return
    if args.tables_from:
        with open(args.tables_from) as f:
            records = [json.loads(line) for line in f if line.strip()]
        names = [n for n in names if any(r["model"] == n for r in records)]
        first = lambda side, key: next(r[key] for r in records if r["side"] == side)
        versions = {"torch": first("pytorch", "torch"), "jax": first("jremat_baseline", "jax")}
        text = (
            HEADER.format(**versions)
            + "\n"
            + "\n\n".join(tables_from(records, MODELS[n]()) for n in names)
        )
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(text)
        return
    if args.budgets:
        budgets = tuple(float(b) for b in args.budgets.split(","))
    else:
        budgets = QUICK_BUDGETS if args.quick else BUDGETS
    earlier: list[dict] = []
    if args.pytorch_from:
        with open(args.pytorch_from) as f:
            earlier = [json.loads(line) for line in f if line.strip()]
        earlier = [
            r
            for r in earlier
            if r["side"] == "check" or (r["side"] == "pytorch" and r["budget"] in budgets)
        ]
    jsonl = os.path.splitext(args.out)[0] + ".jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # written record by record, so a cut run keeps its part
    out = open(jsonl, "a" if args.append else "w")  # noqa: SIM115

    def sink(record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    if args.sweep:
        models = [sweep_cell(fam, sizes) for fam, sizes in SWEEP if fam in names]
        if args.cell:
            models = [m for m in models if m.name in args.cell]
    else:
        models = [MODELS[name]() for name in names]
    sections: list[str] = []
    versions = {"torch": "?", "jax": "?"}
    for model in models:
        name = model.name
        if args.sweep:
            (sizes,) = [s for f, s in SWEEP if sweep_cell(f, s).name == name]
            family = name.split("-")[0]
            sink(
                {
                    "side": "sweep_cell",
                    "model": name,
                    "family": family,
                    "sizes": sizes,
                    "description": model.description,
                }
            )
        print(f"== {name}: {model.description}", file=sys.stderr, flush=True)
        if earlier:
            pytorch = [r for r in earlier if r["model"] == name]
            for r in pytorch:
                sink(r)
        else:
            pytorch = pytorch_side(model, budgets, sink)
        versions["torch"] = next(r["torch"] for r in pytorch if r["side"] == "pytorch")
        if args.pytorch_only:
            continue
        import jax

        versions["jax"] = jax.__version__
        sections.append(jremat_side(model, pytorch, sink))
        print(sections[-1], flush=True)
    out.close()
    if args.sweep and not args.pytorch_only:
        with open(jsonl) as f:
            records = [json.loads(line) for line in f if line.strip()]
        with open(args.out, "w") as f:
            f.write(sweep_markdown(records))
        print(sweep_summary(records)[0], flush=True)
        print(f"wrote {args.out}", file=sys.stderr)
    elif not args.pytorch_only:
        with open(args.out, "w") as f:
            f.write(HEADER.format(**versions) + "\n" + "\n\n".join(sections) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    print(f"wrote {jsonl}", file=sys.stderr)


if __name__ == "__main__":
    main()
