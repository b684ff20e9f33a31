"""Value-by-value local search on a priced path of segments: the polish after the chain DP.

The chain DP chooses the cuts and one save option per checkpointed segment; a segment's best
save set is often none of the options' (PyTorch's partitioner and Checkmate choose value by
value). This search starts from the DP's path and changes it a move at a time, priced by
`save_sets.SaveSetPricer` (the segment model's accounting, so the result is priced as the DP's
plans and the per-value MILP's are). A move replaces one piece:

* a checkpointed piece saves one more value or stops saving one, or is kept whole;
* a kept piece becomes a checkpoint saving every value its backward reads (the VJP rules'
  residuals: often fewer bytes than those XLA keeps for it) or all of them but one;
* a piece is split at a cut inside it (`cuts`): a checkpoint's save set divided between the
  halves, a kept piece into a kept half and a half saving every value.

The move taken is the best one that recomputes fewer FLOPs and keeps every segment's modelled
peak within the budget: bytes freed at no FLOPs first, then the most FLOPs saved per byte
added (the FLOPs-per-byte order of PyTorch's knapsack, re-priced after each move). Where no
single move does: the best pair of a drop in one piece and a save in another whose FLOPs sum
is negative and which fit together (`PAIR_WIDTH` cheapest drops against the `PAIR_WIDTH` best
adds); then a kick, a drop that costs FLOPs followed by the single moves that then fit
(`KICK_WIDTH` drops, `KICK_MOVES` moves each), taken where the chain recomputes less in all.
It stops when nothing improves, or after `max_moves` moves. Each move re-prices only the
pieces it made. What it gains against the per-value optimum, and what it costs:
docs/design.md#per-value-save-sets.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jremat._src.plan.planners.save_sets import (
    Pieces,
    SaveSetCost,
    SaveSetPricer,
    merge_kept_pieces,
)

#: How many of the cheapest drops and of the best adds a pair search combines.
PAIR_WIDTH = 40

#: Where neither a move nor a pair improves: how many drops (cheapest FLOPs per byte freed
#: first) a kick tries, and how many moves it makes after each.
KICK_WIDTH = 8
KICK_MOVES = 12

#: No kick starts after this many pricings in one `polish` call (a bound on work, not on
#: time): a 200-layer MLP chain at 0.97 took 253k pricings (74 s) in kicks that found little.
MAX_PRICINGS = 20_000


@dataclasses.dataclass(frozen=True)
class Polished:
    """The result of `polish`.

    Attributes:
      pieces: the path, the same cuts, save sets changed (sorted value id tuples); adjacent
        kept pieces merged (`save_sets.merge_kept_pieces`).
      peak: its modelled peak in bytes (the segment model's formula, `path_cost`).
      flops: its recompute FLOPs.
      moves: how many moves (a pair counts once) were taken.
    """

    pieces: Pieces
    peak: float
    flops: float
    moves: int


@dataclasses.dataclass(frozen=True)
class _Move:
    """Piece `piece` replaced by `new`: one or two `(start, end, saved or None, cost)`."""

    piece: int
    new: tuple
    dflops: float
    dstored: float


def polish(
    pricer: SaveSetPricer,
    pieces: Pieces,
    budget: float,
    max_moves: int = 1000,
    cuts: Sequence[int] = (),
) -> Polished:
    """Lower the recompute FLOPs of `pieces` by single-value moves, within `budget`.

    Args:
      pricer: the pricer of the graph `pieces` tile.
      pieces: `[(start, end, saved value ids or None for kept)]` tiling the graph's nodes
        (`segments.option_pieces` turns the chain DP's choice into these).
      budget: modelled peak bytes the result must stay within.
      max_moves: the most moves taken (a bound on the work, not a time limit).
      cuts: node positions where a piece may also be split in two (a checkpointed piece's
        save set split between the halves; a kept piece into a kept half and a half saving
        every value its backward reads); none by default.

    Returns:
      A `Polished` path whose peak is at most `budget` and whose FLOPs are at most those of
      `pieces` (equal where no move improves).

    Raises:
      ValueError: when `pieces` do not tile the graph (`SaveSetPricer.path_cost`), when their
        modelled peak is above `budget`, when `budget` is not a finite number >= 0, when
        `max_moves` is not an int >= 0, or when `cuts` holds a non-integer.
    """
    if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 0:
        raise ValueError(f"max_moves must be an int >= 0; got {max_moves!r}")
    if not (isinstance(budget, int | float) and math.isfinite(budget) and budget >= 0):
        raise ValueError(f"budget must be a finite number of bytes >= 0; got {budget!r}")
    bad = [c for c in cuts if isinstance(c, bool) or not isinstance(c, int | np.integer)]
    if bad:
        raise ValueError(f"cuts must be node positions (ints); got {bad[:3]!r}")
    peak, _ = pricer.path_cost(pieces)
    if peak > budget:
        raise ValueError(
            f"pieces: modelled peak {peak:,.0f} bytes is above the budget {budget:,.0f}; "
            "polish starts from a path that fits"
        )
    cuts = sorted(set(cuts))
    path = []
    for start, end, saved in pieces:
        saved = None if saved is None else frozenset(saved)
        path.append((start, end, saved, pricer.piece(start, end, saved)))
    moves = [_moves(pricer, piece, cuts) for piece in path]
    work = [sum(len(ms) for ms in moves)]  # pricings so far: bounds the kicks' work
    taken = 0
    while taken < max_moves:
        chosen = _best_single(path, moves, budget) or _best_pair(path, moves, budget)
        if chosen is not None:
            path, moves = _apply(pricer, cuts, path, moves, chosen, work)
        else:
            kicked = _best_kick(pricer, cuts, path, moves, budget, work)
            if kicked is None:
                break
            path, moves = kicked
        taken += 1
    out = [(s, e, None if saved is None else tuple(sorted(saved))) for s, e, saved, _ in path]
    # the moves price adjacent kept pieces apart; the plan runs them as one kept segment, so
    # the answer is priced so (`path_cost`), and where that is over the budget the path the
    # polish started from is the answer
    out = merge_kept_pieces(out)
    peak, flops = pricer.path_cost(out)
    if peak > budget:
        start = [(s, e, None if v is None else tuple(sorted(v))) for s, e, v in pieces]
        return Polished(merge_kept_pieces(start), *pricer.path_cost(start), 0)
    return Polished(out, peak, flops, taken)


def _moves(pricer: SaveSetPricer, piece, cuts: Sequence[int]) -> list[tuple]:
    """Every change of one piece, as `(new pieces, dflops, dstored)`: one value saved or
    dropped (a kept piece: every candidate saved), or a split at a cut of `cuts` inside it."""
    start, end, saved, cost = piece
    g = pricer.graph
    candidates = pricer.facts(start, end).candidates
    if saved is None:  # a checkpoint saving every candidate, or all but one
        every = frozenset(candidates)
        changes = [every, *(every - {v} for v in candidates)]
    else:
        kept = set(cost.kept)
        # dropping a name the backward does not read changes nothing
        changes = [saved - {v} if v in saved else saved | {v} for v in candidates
                   if v not in saved or v in kept]  # fmt: skip
        changes.append(None)  # kept whole
    out = []
    for new in changes:
        c = pricer.piece(start, end, new)
        out.append((((start, end, new, c),), c.flops - cost.flops, c.stored - cost.stored))
    lo, hi = bisect.bisect_right(cuts, start), bisect.bisect_left(cuts, end)
    for cut in cuts[lo:hi]:
        if saved is None:
            halves = [(None, "all"), ("all", None)]
        else:
            halves = [(frozenset(v for v in saved if g.values[v].producer < cut),
                       frozenset(v for v in saved if g.values[v].producer >= cut))]  # fmt: skip
        for first, second in halves:
            new = []
            for s, e, sv in ((start, cut, first), (cut, end, second)):
                sv = frozenset(pricer.facts(s, e).candidates) if sv == "all" else sv
                new.append((s, e, sv, pricer.piece(s, e, sv)))
            flops = sum(p[3].flops for p in new) - cost.flops
            out.append((tuple(new), flops, sum(p[3].stored for p in new) - cost.stored))
    return out


def _peaks(costs: list[SaveSetCost]) -> list[float]:
    running, out = 0.0, []
    for c in costs:
        running += c.stored
        out.append(running + c.transient)
    return out


def _fits(path, budget: float, changed: list[_Move]) -> bool:
    new = {m.piece: m.new for m in changed}
    costs = [c for i, piece in enumerate(path) for *_, c in new.get(i, (piece,))]
    return max(_peaks(costs)) <= budget


def _best_single(path, moves, budget) -> list[_Move] | None:
    """The best improving move that fits: free bytes first, then FLOPs saved per byte."""
    costs = [c for *_, c in path]
    peaks = _peaks(costs)
    later = [-math.inf] * (len(peaks) + 1)  # the highest peak after each piece
    for k in range(len(peaks) - 1, -1, -1):
        later[k] = max(later[k + 1], peaks[k])
    before, running = [], 0.0
    for c in costs:
        before.append(running)
        running += c.stored
    best, best_key = None, None
    for i, ms in enumerate(moves):
        for new, dflops, dstored in ms:
            if not (dflops < 0 or (dflops == 0 and dstored < 0)):
                continue
            # every later peak moves by the change in stores; the new pieces' own peaks
            if later[i + 1] + dstored > budget:
                continue
            running, over = before[i], False
            for *_, c in new:
                running += c.stored
                over = over or running + c.transient > budget
            if over:
                continue
            key = (math.inf if dstored <= 0 else -dflops / dstored, -dflops)
            if best_key is None or key > best_key:
                best, best_key = _Move(i, new, dflops, dstored), key
    return None if best is None else [best]


def _best_pair(path, moves, budget) -> list[_Move] | None:
    """The best (drop in one piece, add in another) with a negative FLOPs sum that fits."""
    flat = [_Move(i, *m) for i, ms in enumerate(moves) for m in ms]
    drops = sorted(
        (m for m in flat if m.dstored < 0 < m.dflops), key=lambda m: m.dflops / -m.dstored
    )
    adds = sorted((m for m in flat if m.dflops < 0 < m.dstored), key=lambda m: m.dflops / m.dstored)
    best, gain = None, 0.0
    for d in drops[:PAIR_WIDTH]:
        for a in adds[:PAIR_WIDTH]:
            g = -(a.dflops + d.dflops)
            if a.piece != d.piece and g > gain and _fits(path, budget, [d, a]):
                best, gain = [d, a], g
    return best


def _apply(pricer, cuts, path, moves, chosen: list[_Move], work: list[int]):
    """New (path, moves) with the moves of `chosen` (on distinct pieces) made; the pricings
    their new moves took are added to `work[0]`."""
    path, moves = list(path), list(moves)
    for m in sorted(chosen, key=lambda m: -m.piece):  # from the back: indices stay valid
        path[m.piece : m.piece + 1] = m.new
        made = [_moves(pricer, piece, cuts) for piece in m.new]
        work[0] += sum(len(ms) for ms in made)
        moves[m.piece : m.piece + 1] = made
    return path, moves


def _best_kick(pricer, cuts, path, moves, budget, work):
    """The best chain of a drop that frees bytes at a cost (cheapest FLOPs per byte first)
    and the single moves that then fit, best first (`_best_single`, re-priced after each):
    (path, moves), or None where no chain tried recomputes less in all. No kick starts once
    `work[0]` (pricings so far) is above `MAX_PRICINGS`."""
    drops = sorted(
        (_Move(i, *m) for i, ms in enumerate(moves) for m in ms if m[2] < 0 and m[1] > 0),
        key=lambda m: m.dflops / -m.dstored,
    )
    best, best_total = None, 0.0
    for drop in drops[:KICK_WIDTH]:
        if work[0] > MAX_PRICINGS:
            break
        if not _fits(path, budget, [drop]):  # a split's halves can raise its own peak
            continue
        trial, trial_moves = _apply(pricer, cuts, path, moves, [drop], work)
        total = drop.dflops
        for _ in range(KICK_MOVES):
            chosen = _best_single(trial, trial_moves, budget)
            if chosen is None:
                break
            trial, trial_moves = _apply(pricer, cuts, trial, trial_moves, chosen, work)
            total += chosen[0].dflops
        if total < best_total:
            best, best_total = (trial, trial_moves), total
    return best
