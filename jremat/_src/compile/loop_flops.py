"""The FLOPs XLA's cost analysis leaves out of a compiled program's loops, read from the
program's own optimized HLO.

`cost_analysis()` counts a `while` body once. XLA's `while-loop-trip-count-annotator` writes
each loop's trip count into its `backend_config` (`known_trip_count`), so the missing FLOPs are
(trips - 1) x the body's cost, nested loops recursively, each body costed by XLA's own cost
analysis on the optimized module with that body as its entry: the loop as it runs (after
fusion, CSE and loop-invariant code motion), per device under SPMD, and no compile.
Why and what it replaced: docs/design.md#measuring.
"""

from __future__ import annotations

import re
from typing import Any

from jremat._src.base import compat as _compat

_WHILE = re.compile(r"\bwhile\(.*?\), condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# computations an instruction calls once per execution (fusions hold no loops)
_CALLED = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
# a conditional's branches, of which one runs
_BRANCHES = re.compile(
    r"\btrue_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)"
    r"|\bbranch_computations=\{([^}]*)\}"
)
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) ")


def loop_flops_correction(executable: Any, reported: float) -> float | None:
    """FLOPs to add to `reported`, XLA's count for `executable` (`xla.xla_flops`), so that
    every `while` body counts once per trip. A conditional counts, as XLA counts it, its
    costliest branch, loops included.

    0.0 for a program without loops. None where the figure cannot be read from the optimized
    HLO, so that the caller counts another way: a loop without a known trip count, HLO this
    jaxlib cannot parse or cost, or a module whose re-read cost differs from XLA's own
    figure for the executable (the check that the re-read costs what XLA costs)."""
    try:
        text = executable.as_text()
    except Exception:  # noqa: BLE001 - an executable that prints no HLO
        return None
    if not isinstance(text, str) or " while(" not in text:
        return 0.0
    lines = text.split("\n")
    computations, entry = _split(lines)
    if entry is None:
        return None
    own = _compat.hlo_text_flops(text, executable)
    if own is None or own != reported:
        return None
    body_flops: dict[str, float | None] = {}

    def body_cost(name: str) -> float | None:  # a loop body's or a branch's own cost
        if name not in body_flops:
            body_flops[name] = _compat.hlo_text_flops(_with_entry(lines, name), executable)
        return body_flops[name]

    corrections: dict[str, float | None] = {}

    def correction(name: str) -> float | None:
        """Trip-count FLOPs missing inside computation `name` (one execution of it)."""
        if name in corrections:
            return corrections[name]
        corrections[name] = None  # a cycle (never in HLO) reads as unknown
        total = 0.0
        for line in computations.get(name, ()):
            if (m := _WHILE.search(line)) is not None:
                trips = _TRIPS.search(line)
                body = m.group(2)
                inner, cost = correction(body), body_cost(body)
                if trips is None or inner is None or cost is None:
                    return None
                n = int(trips.group(1))
                total += (n - 1) * cost + n * inner
                continue
            if (branches := _branches(line)) is not None:
                # XLA counts a conditional as its costliest branch; with each branch's
                # loops counted per trip, the costliest branch may be another one
                inner = [correction(b) for b in branches]
                if any(k is None for k in inner):
                    return None
                if any(inner):
                    costs = [body_cost(b) for b in branches]
                    if any(c is None for c in costs):
                        return None
                    total += max(c + k for c, k in zip(costs, inner, strict=True)) - max(costs)
                continue
            for called in _CALLED.findall(line):
                inner = correction(called)
                if inner is None:
                    return None
                total += inner
        corrections[name] = total
        return total

    return correction(entry)


def _split(lines: list[str]) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines} of an HLO module's text, and the entry's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in lines:
        if current is None:
            if line.endswith("{") and (m := _HEADER.match(line)):
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
        elif line.startswith("}"):
            current = None
        else:
            computations[current].append(line)
    return computations, entry


def _branches(line: str) -> list[str] | None:
    """The branch computations of a conditional instruction, or None for another one."""
    m = _BRANCHES.search(line)
    if m is None:
        return None
    if m.group(1):
        return [m.group(1), m.group(2)]
    return [b.strip().lstrip("%") for b in m.group(3).split(",") if b.strip()]


def _with_entry(lines: list[str], name: str) -> str:
    """The module's text with computation `name` as its entry (the old entry kept as an
    unreachable computation; the header's entry layout and aliasing dropped)."""
    out = []
    for line in lines:
        if line.startswith("HloModule"):
            out.append("HloModule loop_body")
            continue
        if line.startswith("ENTRY "):
            line = line[len("ENTRY ") :]
        m = _HEADER.match(line)
        if m and line.endswith("{") and m.group(2) == name:
            line = "ENTRY " + line
        out.append(line)
    return "\n".join(out)
