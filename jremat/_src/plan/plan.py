"""`Plan`: where a program is cut into segments and what each segment saves (validated JSON).

Why a plan is many segments with names saved: docs/design.md#plans-and-the-rewrite.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import numbers
import os
from typing import Any

from jremat import policies
from jremat._src.base.budget import BudgetLike
from jremat._src.trace.graph import Graph
from jremat._src.trace.sources import source_span

#: `Segment.policy` value for a segment that is not checkpointed (keeps all its residuals).
KEEP = "keep"
#: `Segment.policy` value for a checkpointed segment that saves only `Segment.saved`.
SAVE_NAMES = "names"


@dataclasses.dataclass
class Segment:
    """Equations `[start, end)` of the traced graph under one checkpoint decision.

    Attributes:
      start, end: node indices; the segment holds nodes `start .. end-1`.
      policy: `"keep"` (no checkpoint: every residual kept), `"names"` (`jax.checkpoint` saving
        only the values in `saved`), or the name of a policy in `jremat.policies` (for example
        `"dots_saveable"`), applied with `jax.checkpoint` to the segment.
      saved: value ids tagged with `checkpoint_name` and saved (policy `"names"` only).
      offloaded: value ids tagged with `checkpoint_name` and offloaded to pinned host memory
        between the forward and backward pass (policy `"names"` only; see `jremat.OffloadCost`).
        Empty in plans made without `offload=`, and in plans saved before the field existed.
      stored_bytes: predicted bytes this segment keeps on the device from forward to backward
        (offloaded values excluded).
      transient_bytes: predicted bytes live while its backward pass runs (recompute included).
      recompute_flops: predicted FLOPs its backward pass recomputes.
      source: layer name and first .. last source line of its equations (for `summary`).

    Examples:
      >>> import jremat
      >>> seg = jremat.Segment(0, 4, policy="dots_saveable")
      >>> seg.checkpointed, jremat.Segment(4, 6, policy="keep").checkpointed
      (True, False)
    """

    start: int
    end: int
    policy: str = SAVE_NAMES
    saved: list[int] = dataclasses.field(default_factory=list)
    stored_bytes: int = 0
    transient_bytes: int = 0
    recompute_flops: float = 0.0
    source: str = ""
    offloaded: list[int] = dataclasses.field(default_factory=list)

    @property
    def checkpointed(self) -> bool:
        """Whether the segment runs under `jax.checkpoint` (its policy is not "keep")."""
        return self.policy != KEEP


#: The body policy of a scan setting or piece that names none.
DEFAULT_SCAN_POLICY = "nothing_saveable"
#: The JSON forms of one `Plan.scans` entry, for messages.
SCAN_FORMS = (
    '{"policy": <a jremat.policies name, a preset or "keep">, "nest": <int >= 1>, '
    '"inner": <a jremat.policies name, optional>} or '
    '{"pieces": [{"length": <int >= 1>, "policy": <name>, "nest": <int >= 1>}, ...]}'
)


@dataclasses.dataclass(frozen=True)
class ScanPiece:
    """Consecutive iterations of a split loop under one body policy (see `ScanSetting`).

    Attributes:
      length: how many iterations (>= 1); the pieces' lengths sum to the loop's length.
      policy: the body policy of these iterations: a `jremat.policies` name or preset, or
        `"keep"` (the iterations run without a checkpoint).
      nest: sqrt(L) nesting of these iterations, as `ScanSetting.nest`.

    Raises:
      ValueError: a field of the wrong type or out of range, naming the field.

    Examples:
      >>> import jremat
      >>> piece = jremat.ScanPiece(6, "dots_saveable")
      >>> piece.to_dict()
      {'length': 6, 'policy': 'dots_saveable', 'nest': 1}
      >>> jremat.ScanPiece.from_dict({"length": 6, "policy": "dots_saveable"}) == piece
      True
    """

    length: int
    policy: str = DEFAULT_SCAN_POLICY
    nest: int = 1

    def __getitem__(self, field: str) -> Any:
        """`setting["policy"]`: read access in the JSON form's terms (as when entries were
        dicts)."""
        return self.to_dict()[field]

    def __post_init__(self) -> None:
        _check_piece(type(self).__name__, self.length, self.policy, self.nest)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: `{"length": n, "policy": p, "nest": k}`."""
        return {"length": self.length, "policy": self.policy, "nest": self.nest}

    @classmethod
    def from_dict(cls, d: Any, where: str = "ScanPiece") -> ScanPiece:
        """Read `to_dict`'s form (`policy` and `nest` may be left out: their defaults).

        Raises:
          ValueError: not a dict, a missing `length`, an unknown field, or a field of the
            wrong type or out of range; the message starts with `where` and names the field.
        """
        _check_keys(
            where, d, {"length", "policy", "nest"}, "a piece has the fields length, policy and nest"
        )
        if "length" not in d:
            raise ValueError(f"{where}.length is missing; accepted forms: {SCAN_FORMS}")
        length, policy, nest = d["length"], d.get("policy", DEFAULT_SCAN_POLICY), d.get("nest", 1)
        _check_piece(where, length, policy, nest)
        return cls(length, policy, nest)


@dataclasses.dataclass(frozen=True)
class ScanSetting:
    """How one `scan` equation's loop is rematerialized (an entry of `Plan.scans`).

    Either one decision for every iteration (`policy`, `nest`), or a split loop (`pieces`).

    Attributes:
      policy: the body runs under `jax.checkpoint(policy)`: a `jremat.policies` name or
        preset, or `"keep"` (the loop as it was).
      nest: k > 1 makes the loop an outer scan of length/k over checkpointed inner scans of k
        steps (sqrt(L) nesting); k must divide the length (`rematerialize` raises
        ValueError otherwise).
      pieces: None, or the loop split into consecutive scans: the first `pieces[0].length`
        iterations under `pieces[0].policy`, and so on (see [design.md#mixes](../design.md#mixes)).
        With pieces, `policy` and `nest` stay at their defaults: each piece has its own. A list is
        stored as a tuple.
      inner: None, or the loops nested in the body (scans among its equations) run their own
        bodies under `jax.checkpoint(inner)` (a `jremat.policies` name or preset): each
        iteration then holds the nested loops' carries, not their residuals, as a user's
        `jax.checkpoint` on the step of a nested loop does. With `policy` "keep" the body
        itself is not checkpointed. Not with `pieces`.

    The JSON form (`to_dict`, `from_dict`; `Plan.to_json` writes it) is
    `{"policy": p, "nest": k}` (with `"inner": q` where set) or
    `{"pieces": [{"length": n, "policy": p, "nest": k}, ...]}`.

    Raises:
      ValueError: a field of the wrong type or out of range, naming the field.

    Examples:
      A loop of 8 iterations, nested by 4, or split into 2 kept and 6 checkpointed iterations:

      >>> import jremat
      >>> jremat.ScanSetting("nothing_saveable", nest=4).to_dict()
      {'policy': 'nothing_saveable', 'nest': 4}
      >>> split = jremat.ScanSetting(pieces=[jremat.ScanPiece(2, "keep"), jremat.ScanPiece(6)])
      >>> split.describe()
      '2 iterations under keep, 6 iterations under nothing_saveable'
      >>> jremat.ScanSetting.from_dict(split.to_dict()) == split
      True
    """

    policy: str = DEFAULT_SCAN_POLICY
    nest: int = 1
    pieces: tuple[ScanPiece, ...] | None = None
    inner: str | None = None

    def __getitem__(self, field: str) -> Any:
        """`setting["policy"]`: read access in the JSON form's terms (as when entries were
        dicts)."""
        return self.to_dict()[field]

    def __post_init__(self) -> None:
        where = type(self).__name__
        if self.inner is not None:
            _check_policy_nest(f"{where}.inner", self.inner, 1, keep=False)
            if self.pieces is not None or (self.policy == KEEP and self.nest != 1):
                raise ValueError(
                    f"{where}.inner does not apply to a split loop or a kept loop nested by "
                    f"{self.nest}; accepted forms: {SCAN_FORMS}"
                )
        if self.pieces is None:
            _check_policy_nest(where, self.policy, self.nest)
            return
        if not isinstance(self.pieces, (list, tuple)) or not self.pieces:
            raise ValueError(
                f"{where}.pieces must be None or a non-empty sequence of ScanPiece, got "
                f"{self.pieces!r}; accepted forms: {SCAN_FORMS}"
            )
        object.__setattr__(self, "pieces", tuple(self.pieces))
        for i, piece in enumerate(self.pieces):
            if not isinstance(piece, ScanPiece):
                raise ValueError(
                    f"{where}.pieces[{i}] must be a ScanPiece, got {type(piece).__name__} {piece!r}"
                )
        if self.policy != DEFAULT_SCAN_POLICY or self.nest != 1:
            raise ValueError(
                f"{where}: policy and nest do not apply to a split loop (pieces given): each "
                f"piece has its own; accepted forms: {SCAN_FORMS}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: `{"policy": p, "nest": k}` or `{"pieces": [...]}`."""
        if self.pieces is None:
            inner = {} if self.inner is None else {"inner": self.inner}
            return {"policy": self.policy, "nest": self.nest, **inner}
        return {"pieces": [p.to_dict() for p in self.pieces]}

    @classmethod
    def from_dict(cls, d: Any, where: str = "ScanSetting") -> ScanSetting:
        """Read `to_dict`'s form (`policy` and `nest` may be left out: their defaults).

        Raises:
          ValueError: not a dict, an unknown field, `pieces` with other fields or not a
            non-empty list, or a field of the wrong type or out of range; the message starts
            with `where`, names the field (`Plan.scans['3'].pieces[1].length`) and gives the
            accepted forms.
        """
        if isinstance(d, dict) and "pieces" in d:
            _check_keys(where, d, {"pieces"}, "pieces is the only field of a split loop")
            raw = d["pieces"]
            if not isinstance(raw, (list, tuple)) or not raw:
                raise ValueError(
                    f"{where}.pieces must be a non-empty list of pieces, got {raw!r}; accepted "
                    f"forms: {SCAN_FORMS}"
                )
            pieces = [ScanPiece.from_dict(p, f"{where}.pieces[{i}]") for i, p in enumerate(raw)]
            return cls(pieces=tuple(pieces))
        _check_keys(
            where,
            d,
            {"policy", "nest", "inner"},
            "a scan setting has the fields policy, nest and inner, or only pieces",
        )
        policy, nest = d.get("policy", DEFAULT_SCAN_POLICY), d.get("nest", 1)
        _check_policy_nest(where, policy, nest)
        return cls(policy, nest, inner=d.get("inner"))

    def describe(self) -> str:
        """One line for `Plan.summary`: which iterations run under which policy."""

        def under(policy: str, nest: int) -> str:
            return f"under {policy}" + (f" nested by {nest}" if nest > 1 else "")

        if self.pieces is None:
            inner = "" if self.inner is None else f", the loops inside under {self.inner}"
            return "every iteration " + under(self.policy, self.nest) + inner
        return ", ".join(f"{p.length} iterations " + under(p.policy, p.nest) for p in self.pieces)


def _check_keys(where: str, d: Any, allowed: set[str], what: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(
            f"{where} must be a dict, got {type(d).__name__} {d!r}; accepted forms: {SCAN_FORMS}"
        )
    unknown = sorted(set(d) - allowed, key=str)
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {unknown} ({what}); accepted forms: {SCAN_FORMS}"
        )


def _check_piece(where: str, length: Any, policy: Any, nest: Any) -> None:
    if not _is_int(length) or length < 1:
        raise ValueError(
            f"{where}.length must be an int >= 1, got {type(length).__name__} {length!r}; "
            f"accepted forms: {SCAN_FORMS}"
        )
    _check_policy_nest(where, policy, nest)


def _check_policy_nest(where: str, policy: Any, nest: Any, keep: bool = True) -> None:
    if not (
        isinstance(policy, str)
        and (
            (keep and policy == KEEP)
            or policy in policies.names()
            or policy in policies.preset_names()
        )
    ):
        known = sorted({*policies.names(), *policies.preset_names(), *([KEEP] if keep else [])})
        field = "" if where.endswith(".inner") else ".policy"
        raise ValueError(f"{where}{field}: unknown policy {policy!r}; accepted: {known}")
    if not _is_int(nest) or nest < 1:
        raise ValueError(
            f"{where}.nest must be an int >= 1, got {type(nest).__name__} {nest!r}; accepted "
            f"forms: {SCAN_FORMS}"
        )


@dataclasses.dataclass
class Plan:
    """A rematerialization plan for one traced program (one shape/dtype signature).

    Attributes:
      segments: contiguous segments covering every node, in order.
      fingerprint: the `Graph.fingerprint` the plan was made for.
      num_nodes: number of equations in that graph.
      solver: the planner that produced it (`"chain"`, `"layers"`, `"identity"` ...).
      budget: the budget asked for, as the caller gave it (JSON-able), or None.
      budget_temp_bytes: that budget translated to XLA temp bytes, or None.
      predicted_temp_bytes: the planner's calibrated prediction of compiled temp bytes; 0 when
        the cost model cannot describe the plan (sub-layer segments,
        [design.md#refinement](../design.md#refinement)).
      recompute_flops: predicted FLOPs recomputed in the backward pass.
      offloaded_bytes: predicted bytes the plan offloads to pinned host memory (each copied to
        host in the forward pass and back in the backward pass); 0 without offload.
      measured_temp_bytes: compiled temp bytes when the plan was verified, else None.
      measured_flops: compiled FLOPs of `value_and_grad` when verified, else None.
      baseline_temp_bytes: compiled temp bytes of the unrematerialized program, when known.
      measured_footprint_bytes: compiled argument + output - alias + temp bytes when verified
        (None in plans saved before the field existed).
      baseline_flops: compiled FLOPs of the unrematerialized `value_and_grad`, when known.
      memory_figure: how the compiled temp bytes were read from XLA's `memory_analysis()` on
        the target (`"temp_size_in_bytes"` on CPU and GPU; on TPU `"peak_memory_in_bytes -
        (argument + output - alias)"`,
        [guides/tpu.md#the-memory-figure](../guides/tpu.md#the-memory-figure)); None when nothing
        was compiled (or in plans saved before the field existed).
      target: the platform and device kind the plan was compiled for, e.g. `"cpu"` or
        `"tpu:TPU v5 lite x4"` (devices of the mesh); None when nothing was compiled.
      compiles: whole-program compiles the search that made the plan spent (each
        `value_and_grad` or `jit(grad)` step; memoized ones not counted), bounded by an int
        `compile_budget`; under the default's, `jit(grad)` checks compiled ahead in the
        background that the search did not read come on top; None where no search ran
        (plans loaded or built by hand).
      notes: free-form lines (rounds of verification, calibration).
      scans: per scan equation (its node index, as a string), how its loop is rematerialized:
        a `ScanSetting`, either one body policy for every iteration (with sqrt(L) nesting
        when `nest` > 1) or the loop split into consecutive `ScanPiece`s, each under its own
        policy (a policy "keep" leaves its iterations unrematerialized); see
        [design.md#mixes](../design.md#mixes). In JSON each is `{"policy": p, "nest": k}` or
        `{"pieces": [{"length": n, "policy": p, "nest": k}, ...]}` (`ScanSetting.to_dict`).

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> def loss(ws, x):  # a 4-layer MLP
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> ws, x = [jnp.full((64, 64), 0.01)] * 4, jnp.ones((128, 64))
      >>> p = jremat.plan(loss, ws, x, budget=0.9)
      >>> p.num_nodes == sum(s.end - s.start for s in p.segments)  # segments cover the graph
      True
      >>> jremat.Plan.from_json(p.to_json()) == p  # saved and loaded unchanged
      True
    """

    segments: list[Segment]
    fingerprint: str
    num_nodes: int
    solver: str = "chain"
    budget: BudgetLike | None = None
    budget_temp_bytes: int | None = None
    predicted_temp_bytes: int = 0
    recompute_flops: float = 0.0
    measured_temp_bytes: int | None = None
    measured_flops: float | None = None
    baseline_temp_bytes: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    scans: dict[str, ScanSetting] = dataclasses.field(default_factory=dict)
    offloaded_bytes: int = 0
    measured_footprint_bytes: int | None = None
    baseline_flops: float | None = None
    memory_figure: str | None = None
    target: str | None = None
    compiles: int | None = None

    @property
    def is_identity(self) -> bool:
        """True when no segment is checkpointed: the function runs unchanged."""
        return not any(s.checkpointed for s in self.segments) and not self.scans

    @classmethod
    def identity(cls, graph: Graph, **kw: Any) -> Plan:
        """The plan that rematerializes nothing."""
        return cls(
            [Segment(0, graph.num_nodes, KEEP)] if graph.num_nodes else [],  # none: no equations
            graph.fingerprint,
            graph.num_nodes,
            solver="identity",
            **kw,
        )

    @classmethod
    def from_spans(
        cls,
        graph: Graph,
        spans: list[tuple[int, int]],
        policies: list[str],
        solver: str,
        saved: list[list[int]] | None = None,
    ) -> Plan:
        """A plan with node range `spans[i]` under `policies[i]` (a `jremat.policies` name,
        "keep", or "names" saving the value ids `saved[i]`) and the nodes between spans kept;
        adjacent kept stretches are merged."""
        if len(policies) != len(spans):
            raise ValueError(f"{len(policies)} policies for {len(spans)} spans")
        saves = saved if saved is not None else [[] for _ in spans]
        segs: list[Segment] = []
        pos = 0
        for (start, end), policy, keep in zip(spans, policies, saves, strict=True):
            if start > pos:
                segs.append(Segment(pos, start, KEEP))
            segs.append(Segment(start, end, policy, list(keep)))
            pos = end
        if pos < graph.num_nodes:
            segs.append(Segment(pos, graph.num_nodes, KEEP))
        merged: list[Segment] = []
        for seg in segs:
            if merged and seg.policy == KEEP and merged[-1].policy == KEEP:
                merged[-1].end = seg.end
            else:
                merged.append(seg)
        return cls(merged, graph.fingerprint, graph.num_nodes, solver=solver)

    def validate(self) -> None:
        """Check the segments' fields have their types (start/end ints, policy a string,
        saved/offloaded lists of int value ids) and tile `[0, num_nodes)`; raise ValueError
        naming the segment and field otherwise."""
        _check_plan_fields(self)
        pos = 0
        for i, s in enumerate(self.segments):
            _check_segment_fields(i, s)
            if s.start != pos or s.end <= s.start:
                raise ValueError(f"plan segments must tile [0, {self.num_nodes}); bad {s}")
            if s.offloaded and s.policy != SAVE_NAMES:
                raise ValueError(
                    f"segment {s.start}-{s.end} offloads values under policy {s.policy!r}; "
                    f"offloaded values need policy {SAVE_NAMES!r}"
                )
            pos = s.end
        if pos != self.num_nodes:
            raise ValueError(f"plan segments end at {pos}, the graph has {self.num_nodes} nodes")
        _validate_scans(self.scans, self.num_nodes)

    def annotate(self, graph: Graph) -> Plan:
        """Record each segment's layer name and source lines from `graph`; returns self."""
        for s in self.segments:
            if s.start < s.end <= graph.num_nodes:
                s.source = _segment_source(graph, s)
        return self

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-able dicts and lists (scan settings in their JSON form)."""
        d = dataclasses.asdict(dataclasses.replace(self, scans={}))
        d["scans"] = _scans_json(self.scans)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as a JSON string (no pickles); inverse of `Plan.from_json`."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan from `to_json` output.

        Raises:
          ValueError: malformed JSON, missing or unknown fields, a segment field of the wrong
            type (naming the segment index and field), a malformed scan setting (naming the
            entry and field, `Plan.scans['3'].nest`, with the accepted forms), or segments
            that do not tile the equations (`validate`). Whether saved/offloaded value ids
            exist in the program is checked when the plan runs on it
            (`jremat.rematerialize`).
        """
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"not a jremat plan JSON: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(
                f"not a jremat plan JSON: the top level must be an object with the fields of "
                f"jremat.Plan, got {type(d).__name__} {d!r:.80}"
            )
        raw_segs = d.pop("segments", None)
        if not isinstance(raw_segs, list):
            raise ValueError(
                f"Plan.segments must be a list of segment objects, got {raw_segs!r:.80}"
            )
        segs = []
        for i, raw in enumerate(raw_segs):
            if not isinstance(raw, dict):
                raise ValueError(f"Plan.segments[{i}] must be an object, got {raw!r:.80}")
            try:
                segs.append(Segment(**raw))
            except TypeError as e:
                raise ValueError(f"Plan.segments[{i}]: {e}") from e
        raw_scans = d.pop("scans", {})
        if not isinstance(raw_scans, dict):
            raise ValueError(
                f"Plan.scans must be a dict of equation index -> scan setting, got {raw_scans!r}"
            )
        scans = {
            key: ScanSetting.from_dict(cfg, where=f"Plan.scans[{key!r}]")
            for key, cfg in raw_scans.items()
        }
        try:
            plan = cls(segments=segs, scans=scans, **d)
        except TypeError as e:
            raise ValueError(f"not a jremat plan JSON: {e}") from e
        plan.validate()
        return plan

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON to `path`."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan written by `Plan.save`.

        Raises:
          OSError: the file cannot be read.
          ValueError: it is not UTF-8 text or not a valid plan (as `from_json`); the message
            names the file.
        """
        with open(path, "rb") as f:
            raw = f.read()
        try:
            return cls.from_json(raw.decode("utf-8"))  # UnicodeDecodeError is a ValueError
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from e

    # -- reporting ------------------------------------------------------------------------
    def summary(self, graph: Graph | None = None) -> str:
        """The plan as a report: what was asked and what the compiled program holds, then one
        row per segment, largest kept bytes first.

        Head: the budget asked for (and its temp bytes), the unrematerialized program's compiled
        temp bytes and FLOPs, this plan's compiled temp, footprint and FLOPs (extra FLOPs in
        percent), the cost model's prediction, and one line saying what the columns mean.
        Rows: segment index, equations, policy, how many values it saves, bytes it keeps from
        the forward to the backward pass, bytes live in its backward pass, FLOPs recomputed,
        layer and source lines (`file.py:12:16-32 (fn)`, relative to the working folder).
        Figures the plan does not have (a plan not compiled, per-segment bytes of a built-in
        policy's plan) print as "-". With the `graph` the plan was made for, the saved and
        offloaded values' shapes follow their row.
        """
        head, cols, rows = self._report(graph)
        widths = [max(len(c), *(len(r[0][i]) for r in rows)) for i, c in enumerate(cols[:-1])]

        def line(cells: list[str]) -> str:
            left = f"{cells[0]:>{widths[0]}} {cells[1]:>{widths[1]}} {cells[2]:<{widths[2]}}"
            right = " ".join(f"{c:>{w}}" for c, w in zip(cells[3:-1], widths[3:], strict=True))
            return f"{left} {right}  {cells[-1]}".rstrip()

        lines = head + [line(cols)]
        for cells, details in rows:
            lines.append(line(cells))
            lines += [f"{'':>{widths[0]}} {d}" for d in details]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """`summary` as HTML (Jupyter shows it when a cell returns the plan)."""
        import html

        head, cols, rows = self._report(None)
        out = ["<div><pre style='margin:0'>" + html.escape("\n".join(head)) + "</pre><table>"]
        out.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>")
        for cells, details in rows:
            tds = "".join(
                f"<td style='text-align:{'left' if i in (2, len(cells) - 1) else 'right'}'>"
                f"{html.escape(c)}</td>"
                for i, c in enumerate(cells)
            )
            out.append(f"<tr>{tds}</tr>")
            for d in details:
                out.append(f"<tr><td></td><td colspan='{len(cols) - 1}'>{html.escape(d)}</td></tr>")
        out.append("</table></div>")
        return "".join(out)

    def figures(self) -> list[str]:
        """Lines stating the budget asked for, the unrematerialized program's compiled temp
        bytes and FLOPs, this plan's compiled temp, footprint and FLOPs, and the cost model's
        prediction (the head of `summary` and of `jremat.explain`'s table)."""
        mib = 2.0**20

        def mb(x: float | None) -> str:
            return "-" if x is None else f"{x / mib:.2f} MiB"

        def gf(x: float | None) -> str:
            return "-" if x is None else f"{x / 1e9:.4g} GFLOP"

        block = any(n.startswith("block plan:") for n in self.notes)
        temp = "kept bytes" if block else "temp"
        asked = f"budget {self.budget!r}" if self.budget is not None else "no budget recorded"
        if self.budget_temp_bytes is not None:
            asked += f" = at most {mb(self.budget_temp_bytes)} of compiled {temp}"
        lines = [f"jremat plan ({self.solver}): {asked}"]
        if block:
            lines.append(
                "  a Flax block's plan: its figures are the bytes the block keeps from its "
                "forward to its backward pass (docs/design.md#flax-blocks)"
            )
        accelerator = self.target is not None and not self.target.startswith("cpu")
        if accelerator and self.memory_figure is not None and not block:
            lines.append(f"  compiled for:    {self.target}; {temp} = {self.memory_figure}")
        if self.baseline_temp_bytes is not None:
            base = f"  without remat:   {temp} {mb(self.baseline_temp_bytes)}"
            if self.baseline_flops:
                base += f", {gf(self.baseline_flops)}"
            lines.append(base + " (compiled)")
        if self.measured_temp_bytes is not None:
            got = f"  under this plan: {temp} {mb(self.measured_temp_bytes)}"
            if self.baseline_temp_bytes:
                got += f" ({self.measured_temp_bytes / self.baseline_temp_bytes:.0%} of that)"
            if self.measured_footprint_bytes is not None and not block:  # a block: kept bytes
                got += f", footprint {mb(self.measured_footprint_bytes)}"
            if self.measured_flops is not None:
                got += f", {gf(self.measured_flops)}"
                if self.baseline_flops:
                    got += f" ({100 * (self.measured_flops / self.baseline_flops - 1):+.1f}% FLOPs)"
            lines.append(got + " (compiled)")
        else:
            lines.append("  under this plan: not compiled (verify=False)")
        model = f"  cost model:      predicted {temp} {mb(self.predicted_temp_bytes or None)}"
        if self.recompute_flops or any(s.stored_bytes for s in self.segments):
            model += f", {gf(self.recompute_flops)} recomputed"
        if self.offloaded_bytes:
            model += f", {mb(self.offloaded_bytes)} offloaded to host"
        lines.append(model)
        return lines

    def _report(
        self, graph: Graph | None
    ) -> tuple[list[str], list[str], list[tuple[list[str], list[str]]]]:
        """(head lines, column names, rows as (cells, detail lines)) of `summary`."""
        mib = 2.0**20
        head = self.figures()
        known = any(s.stored_bytes or s.transient_bytes for s in self.segments)
        # a Flax block planned as one segment under a built-in policy: the block's compiled
        # kept bytes are that segment's
        block = any(n.startswith("block plan:") for n in self.notes)
        whole = len(self.segments) == 1 and block and self.measured_temp_bytes is not None
        order = sorted(
            range(len(self.segments)),
            key=lambda i: (-self.segments[i].stored_bytes, i) if known else (i,),
        )
        n_seg, n_ckpt = len(self.segments), sum(s.checkpointed for s in self.segments)
        head += [
            f"{n_seg} segment{'s' * (n_seg != 1)}, {n_ckpt} checkpointed"
            + (", largest kept first." if known else "; per-segment bytes not modelled (-).")
            + " Columns: policy = keep (not checkpointed:",
            "  all its residuals kept), names (checkpointed: keeps its 'saves' values, recomputes "
            "the rest) or a",
            "  jax.checkpoint_policies name; kept MiB = held from the forward to the backward "
            "pass; bwd MiB = live",
            "  while its backward runs; recompute GFLOP = forward work its backward redoes.",
        ]
        for index, setting in self.scans.items():
            head.append(f"scan at equation {index}: {setting.describe()}")
        cols = [
            "seg",
            "eqns",
            "policy",
            "saves",
            "kept MiB",
            "bwd MiB",
            "recompute GFLOP",
            "layer / source",
        ]
        rows = []
        for i in order:
            s = self.segments[i]
            src = _segment_source(graph, s) if graph is not None else s.source
            cells = [
                str(i),
                f"{s.start}-{s.end - 1}",
                s.policy + ("+offload" if s.offloaded else ""),
                str(len(s.saved)) if s.policy == SAVE_NAMES else "-",
                f"{s.stored_bytes / mib:.2f}"
                if known
                else (f"{self.measured_temp_bytes / mib:.2f}" if whole else "-"),
                f"{s.transient_bytes / mib:.2f}" if known else "-",
                f"{s.recompute_flops / 1e9:.4g}" if known or not s.checkpointed else "-",
                src,
            ]
            details = []
            if graph is not None and s.saved:
                details.append("saves: " + _shapes(graph, s.saved))
            if graph is not None and s.offloaded:
                details.append("offloads to host: " + _shapes(graph, s.offloaded))
            rows.append((cells, details))
        return head, cols, rows


def _segment_source(graph: Graph, s: Segment) -> str:
    """The layer a segment starts in and its user source lines, from the graph; for a
    segment whose equations carry no frame of the user's code (the body of a jitted `jnp`
    function, inlined, on jax 0.10), the nearest equation's line that does, as "near ..."."""
    first = graph.nodes[s.start]
    scope = f"[{first.name_stack}] " if first.name_stack else ""
    span = source_span(n.eqn for n in graph.nodes[s.start : s.end])
    if not span:
        before = range(s.start - 1, -1, -1)
        after = range(s.end, graph.num_nodes)
        for i in (j for pair in itertools.zip_longest(before, after) for j in pair):
            if i is not None and (near := source_span([graph.nodes[i].eqn])):
                return f"{scope}near {near}"
    return scope + span


def _shapes(graph: Graph, ids: list[int], limit: int = 6) -> str:
    shown = ", ".join(f"{graph.values[v].dtype}{list(graph.values[v].shape)}" for v in ids[:limit])
    return shown + (" ..." if len(ids) > limit else "")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


#: Plan fields checked by `validate`: name -> (test, accepted form for messages).
_PLAN_FIELDS: dict[str, tuple[Any, str]] = {
    "fingerprint": (lambda v: isinstance(v, str), "a string"),
    "num_nodes": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    "solver": (lambda v: isinstance(v, str), "a string"),
    "budget_temp_bytes": (lambda v: v is None or _is_int(v), "an int or null"),
    "predicted_temp_bytes": (_is_int, "an int"),
    "recompute_flops": (_is_number, "a number"),
    "measured_temp_bytes": (lambda v: v is None or _is_int(v), "an int or null"),
    "measured_flops": (lambda v: v is None or _is_number(v), "a number or null"),
    "baseline_temp_bytes": (lambda v: v is None or _is_int(v), "an int or null"),
    "notes": (
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "a list of strings",
    ),
    "offloaded_bytes": (_is_int, "an int"),
    "memory_figure": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "target": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "compiles": (lambda v: v is None or _is_int(v), "an int or null"),
    "segments": (lambda v: isinstance(v, list), "a list of jremat.Segment"),
}


def _check_plan_fields(plan: Plan) -> None:
    """Raise ValueError naming `Plan.<field>` when a top-level field has the wrong type."""
    for name, (ok, form) in _PLAN_FIELDS.items():
        value = getattr(plan, name)
        if not ok(value):
            raise ValueError(
                f"Plan.{name} must be {form}, got {type(value).__name__} {value!r:.80}"
            )


def _check_segment_fields(i: int, s: Any) -> None:
    """Raise ValueError naming `Plan.segments[i]` and the field when a field has the wrong type."""
    where = f"Plan.segments[{i}]"
    if not isinstance(s, Segment):
        raise ValueError(f"{where} must be a jremat.Segment, got {type(s).__name__} {s!r}")
    for name in ("start", "end"):
        value = getattr(s, name)
        if not _is_int(value):
            raise ValueError(f"{where}.{name} must be an int, got {type(value).__name__} {value!r}")
    for name in ("stored_bytes", "transient_bytes", "recompute_flops"):
        value = getattr(s, name)
        if not _is_number(value):
            raise ValueError(
                f"{where}.{name} must be a number, got {type(value).__name__} {value!r}"
            )
    if not isinstance(s.source, str):
        raise ValueError(f"{where}.source must be a string, got {s.source!r}")
    if not isinstance(s.policy, str):
        raise ValueError(
            f"{where}.policy must be a string, got {type(s.policy).__name__} {s.policy!r}"
        )
    for name in ("saved", "offloaded"):
        value = getattr(s, name)
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
            raise ValueError(f"{where}.{name} must be a list of int value ids, got {value!r}")


def _validate_scans(scans: Any, num_nodes: int) -> None:
    """Check `Plan.scans`: keys are equation indices, values `ScanSetting`s (whose fields their
    constructor checked); raise ValueError naming the entry otherwise. An int key and a value
    in the JSON form (a dict, as plans held before `ScanSetting` existed) are accepted and
    normalized in place to the string key and the `ScanSetting`."""
    if not isinstance(scans, dict):
        raise ValueError(
            f"Plan.scans must be a dict of equation index -> ScanSetting, got {scans!r}"
        )
    for key, setting in list(scans.items()):
        where = f"Plan.scans[{key!r}]"
        text = str(key) if isinstance(key, (str, int)) and not isinstance(key, bool) else ""
        if not text.isdigit() or not 0 <= int(text) < num_nodes:
            raise ValueError(f"{where}: keys are equation indices in [0, {num_nodes}) as strings")
        if isinstance(setting, dict):
            setting = ScanSetting.from_dict(setting, where)
        if not isinstance(setting, ScanSetting):
            raise ValueError(
                f"{where} must be a ScanSetting or its JSON form {SCAN_FORMS}, got "
                f"{type(setting).__name__} {setting!r}"
            )
        if text != key:
            del scans[key]
        scans[text] = setting


def _scans_json(scans: Any) -> Any:
    """`Plan.scans` in its JSON form (entries that are not `ScanSetting`s as they are, for
    `validate` to name)."""
    if not isinstance(scans, dict):
        return scans
    return {k: v.to_dict() if isinstance(v, ScanSetting) else v for k, v in scans.items()}


def plan_key(p: Plan | None) -> str:
    """What decides the rewritten program: segments with their saves, and scan settings."""
    if p is None or p.is_identity:
        return "unchanged"
    segs = ";".join(
        f"{s.start}:{s.end}:{s.policy}:{','.join(map(str, s.saved))}"
        + (f">{','.join(map(str, s.offloaded))}" if s.offloaded else "")
        for s in p.segments
    )
    return f"{segs}|{json.dumps(_scans_json(p.scans), sort_keys=True)}"
