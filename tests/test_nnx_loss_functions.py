"""`jremat.auto` on a loss function of NNX state, as Flax's examples write one (issue 50):
`loss_fn(params, rngs)` merges a graphdef with the parameters and the rest of the model's
state (its dropout RNG streams among it), takes the caller's `nnx.Rngs` and returns
`(loss, aux)`. It is planned as a loss, on the step the caller's
`jax.grad` runs: the caller's `jit(grad(..., has_aux=True))` holds the budget as a fraction of
its own unrematerialized temp bytes (or the budget is refused), a tighter budget never
compiles higher, and the gradients are the undecorated ones."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import models as M  # noqa: E402  (tests/ is on sys.path via conftest)
import numpy as np
import pytest
from flax import nnx

import jremat

VOCAB, D, LENGTH, BATCH = 64, 32, 32, 4


class Block(nnx.Module):
    """Pre-norm causal self-attention (one head) and MLP, each residual, dropout after each."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        q, k, v = jnp.split(self.qkv(self.norm(x)), 3, axis=-1)
        scores = jnp.where(mask, q @ k.swapaxes(-1, -2) / np.sqrt(D), -1e9)
        x = x + self.drop(jax.nn.softmax(scores) @ v)
        return x + self.drop(self.down(nnx.gelu(self.up(x))))


class TinyLM(nnx.Module):
    """Token embedding, two blocks, final norm, logits through the embedding (tied)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, tokens):
        mask = jnp.tril(jnp.ones((tokens.shape[-1],) * 2, bool))
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))


def grad_step(wrap):
    """The user's train step, gemma-style: `loss_fn(params, rngs)` closes over the graphdef,
    the non-parameter state and the batch; the step is `jit(grad(wrap(loss_fn),
    has_aux=True))`. The dropout draws from the model's streams, merged as copies inside the
    loss: under `jax.grad`, NNX refuses a draw from a variable of the outer trace (an
    `nnx.Rngs` argument, a variable of `rest` merged as is), with or without jremat. So the
    caller's `rngs` is carried but unused, as in Flax's gemma example at dropout rate 0 (the
    case where jremat once wrote it back: TraceContextError)."""

    def step(model, rngs, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params, rngs):
            del rngs
            module = nnx.merge(graphdef, params, rest, copy=True)
            logits = module(batch["inputs"])
            per_token = -jnp.sum(
                jax.nn.one_hot(batch["targets"], VOCAB) * nnx.log_softmax(logits), axis=-1
            )
            per_sample = per_token.mean(axis=1)
            return per_sample.mean(), (per_sample, logits)

        return jax.grad(wrap(loss_fn), has_aux=True)(params, rngs.fork())

    return jax.jit(step)


@pytest.fixture(scope="module")
def setup():
    model = TinyLM(nnx.Rngs(params=0, dropout=1))
    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, LENGTH + 1), dtype=np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    return model, batch


def test_loss_fn_of_params_and_rngs_holds_on_the_callers_grad_step(setup):
    """Before issue 50, `has_aux` was refused for a function of NNX state; without it the
    function was planned as a block by the bytes it keeps, which the caller's step missed."""
    model, batch = setup
    plain, base = M.compiled_step(grad_step(lambda f: f), model, nnx.Rngs(2), batch)
    want = plain(model, nnx.Rngs(2), batch)
    got_temps, refused = {}, []
    for budget in (0.5, 0.3):
        step = grad_step(
            functools.partial(jremat.auto, budget=budget, has_aux=True, plan_dir=False)
        )
        try:
            step, got = M.compiled_step(step, model, nnx.Rngs(2), batch)
        except jremat.InfeasibleBudgetError as e:
            assert e.smallest_reachable > budget
            refused.append(budget)
            continue
        assert not refused, f"{budget} planned, looser {refused} refused"
        assert got <= budget * base, (budget, got, base)
        assert all(got <= t for t in got_temps.values()), (budget, got, got_temps)
        got_temps[budget] = got
        chex.assert_trees_all_close(step(model, nnx.Rngs(2), batch), want, rtol=1e-5, atol=1e-6)
    assert got_temps, "no budget planned"
