"""Train a small GPT-2 on real text with jremat: rematerialization + in-step microbatching.

The default jremat workload (Hugging Face Flax GPT-2, random init, 2 layers, d=64) is trained
for 600 Adam steps on byte-tokenized public-domain text (a fresh batch of 8 x 64 tokens each
step, `jremat.data.batches(..., seed=step)`). The loss is wrapped in `jremat.auto`
(rematerialization planned at half the unrematerialized temp bytes; Chen et al. 2016) and its
gradient taken over 2 microbatches with `jremat.microbatch` (gradient accumulation inside
the step, as `optax.MultiSteps` does across steps). It then asks `jremat.plan_training`
for a configuration that fits a byte budget the plain train step exceeds.

Needs `transformers<5` (`pip install "jremat[models]"`). 93 s of CPU time on a 2-core machine
(364 s wall while the machine was shared):

    python examples/train_lm.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jremat
import jremat.models
from jremat import data

STEPS, LR, K, BATCH, SEQ = 600, 3e-3, 2, 8, 64


def main() -> None:
    jremat.log_to_stderr()  # progress on stderr (jremat is quiet by default)
    wl = jremat.models.get("gpt2", n_layer=2, n_embd=64, n_head=2, batch_size=BATCH, seq_len=SEQ)
    print(wl.description)
    opt = optax.adam(LR)
    remat_loss = jremat.auto(wl.loss, budget=0.5)
    value_and_grad = jremat.microbatch(remat_loss, K)

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = value_and_grad(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = wl.params
    opt_state = opt.init(params)
    losses = []
    t0 = time.perf_counter()
    for i in range(STEPS):
        tokens = jnp.asarray(data.batches(BATCH, SEQ, seed=i))
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
        if i % 20 == 0 or i == STEPS - 1:
            print(f"step {i:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f} s)")
    for p in remat_loss.plans.values():
        print(
            f"jremat.auto plan (one microbatch of {BATCH // K}): compiled temp "
            f"{p.measured_temp_bytes:,} B vs {p.baseline_temp_bytes:,} B unrematerialized"
        )
    first, last = float(np.mean(losses[:20])), float(np.mean(losses[-20:]))
    print(
        f"mean loss, first 20 steps: {first:.4f}; last 20 steps: {last:.4f} "
        f"(ln 257 = {np.log(257):.4f} is chance)"
    )
    assert last < first, "the loss did not fall"

    # plan_training: a byte budget the plain (k=1, no remat) Adam step exceeds.
    plain = jremat.plan_training(wl.loss, wl.params, wl.batch, budget="64GiB", optimizer=opt)
    plain_fp = plain.alternatives[0]["footprint_bytes"]
    budget = int(plain_fp * 0.75)
    print(f"\nplain train step footprint: {plain_fp:,} bytes; asking for budget {budget:,} bytes")
    t = time.perf_counter()
    tp = jremat.plan_training(wl.loss, wl.params, wl.batch, budget=budget, optimizer=opt)
    print(tp.summary())
    print(f"(planned in {time.perf_counter() - t:.1f} s)")
    assert plain_fp > budget >= tp.compiled_footprint_bytes


if __name__ == "__main__":
    main()
