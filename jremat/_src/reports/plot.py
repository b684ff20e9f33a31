"""The Pareto plot of a `Comparison`: temp memory against extra FLOPs, the frontier marked
(matplotlib, drawn with Agg)."""

from __future__ import annotations

import math
from typing import Any

from jremat._src.reports.pareto import pareto_front
from jremat._src.reports.units import memory_unit

# -- the figure ------------------------------------------------------------------------------
_KIND_STYLE = {  # kind -> (colour, marker, size, legend label)
    "baseline": ("#222222", "s", 70, "no remat"),
    "fixed": ("#1f77b4", "o", 60, "fixed policy"),
    "planner": ("#e8710a", "*", 170, "jremat plan at a budget"),
}


_FRONT = "#2a9d3f"


def _kind(row: Any) -> str:
    if row.policy == "no remat":
        return "baseline"
    return "planner" if row.budget is not None else "fixed"


def _short(row: Any, many_solvers: bool) -> str:
    if row.budget is None:
        return row.policy
    name = row.policy
    if name.startswith("jremat auto") and not many_solvers:
        name = "auto"
    return f"{name} @ {row.budget}"


def plot_comparison(comparison: Any, path: Any = None, *, title: str | None = None, dpi: int = 150):
    """Draw a `jremat.Comparison` as temp memory against extra FLOPs (see `Comparison.plot`).

    Raises ImportError without matplotlib and ValueError when no row was compiled.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError('Comparison.plot needs matplotlib: pip install "jremat[plot]"') from e

    rows = [r for r in comparison.rows if r.ok]
    if not rows:
        raise ValueError("nothing to plot: no row of the comparison was compiled (all infeasible)")
    unit, scale = memory_unit(max(r.temp_bytes for r in rows))
    xs = [float(r.extra_flops_pct) for r in rows]
    ys = [r.temp_bytes / scale for r in rows]
    front = pareto_front(list(zip(xs, ys, strict=True)))
    on_front = set(front)
    many_solvers = len({r.policy for r in rows if r.budget is not None}) > 1

    fig = Figure(figsize=(10, 6.2), dpi=100)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.085, right=0.87, top=0.86, bottom=0.1)
    ax = fig.add_subplot()
    x_lo, x_hi = min(0.0, *xs), max(xs)
    span = max(x_hi - x_lo, 1.0)
    ax.set_xlim(x_lo - 0.07 * span, x_hi + 0.32 * span)
    y_top = max(ys) * 1.18 or 1.0
    ax.set_ylim(0, y_top)

    # dominated region and the frontier staircase
    fx = [xs[i] for i in front]
    fy = [ys[i] for i in front]
    x_end = ax.get_xlim()[1]
    sx, sy = [fx[0]], [y_top]
    for k in range(len(fx)):
        sx += [fx[k], fx[k + 1] if k + 1 < len(fx) else x_end]
        sy += [fy[k], fy[k]]
    ax.fill_between(sx, sy, y_top, color="#9e9e9e", alpha=0.10, lw=0, zorder=0)
    ax.plot(sx, sy, color=_FRONT, lw=2.2, alpha=0.9, zorder=1, solid_joinstyle="miter")

    # budgets of the planner rows
    budget_texts, budget_ys = [], []
    seen: set[int] = set()
    for r in comparison.rows:
        b = r.budget_temp_bytes
        if r.budget is None or b is None or b in seen or not 0 < b / scale < y_top:
            continue
        seen.add(b)
        feasible = any(q.budget == r.budget and q.ok for q in comparison.rows)
        note = "" if feasible else " (infeasible)"
        ax.axhline(b / scale, color="#777777", lw=1, ls=(0, (5, 4)), zorder=0.5)
        budget_ys.append(b / scale)
        budget_texts.append(
            ax.text(
                0.995,
                b / scale,
                f"budget {r.budget}{note} ",
                transform=ax.get_yaxis_transform(),
                ha="right",
                va="bottom",
                fontsize=8,
                color="#555555",
            )
        )

    for i, r in enumerate(rows):
        color, marker, size, _ = _KIND_STYLE[_kind(r)]
        ax.scatter(
            xs[i],
            ys[i],
            s=size,
            marker=marker,
            zorder=3,
            linewidths=1.6,
            facecolors=color if i in on_front else "white",
            edgecolors=color,
        )

    ax.set_xlabel("extra FLOPs vs no remat (%)   [recompute cost]", fontsize=10)
    ax.set_ylabel(f"XLA temp memory ({unit})   [activations]", fontsize=10)
    base = comparison.baseline_temp_bytes
    if base:
        sec = ax.secondary_yaxis(
            "right", functions=(lambda y: y * scale / base, lambda f: f * base / scale)
        )
        sec.set_ylabel("fraction of no-remat temp memory", fontsize=10)
    ax.grid(True, color="#e6e6e6", lw=0.8, zorder=0)
    ax.set_axisbelow(True)
    head = title or "Remat policies: memory vs recompute"
    fig.suptitle(head, fontsize=13, fontweight="bold", x=0.085, ha="left", y=0.975)
    if comparison.description:
        fig.text(0.085, 0.905, comparison.description, fontsize=9.5, color="#444444")
    kinds = sorted({_kind(r) for r in rows}, key=list(_KIND_STYLE).index)
    handles = [
        Line2D(
            [],
            [],
            ls="",
            marker=_KIND_STYLE[k][1],
            color=_KIND_STYLE[k][0],
            markersize=13 if k == "planner" else 8,
            label=_KIND_STYLE[k][3],
        )
        for k in kinds
    ]
    handles += [
        Line2D([], [], color=_FRONT, lw=2.2, label="Pareto frontier (filled: on it)"),
        Patch(facecolor="#9e9e9e", alpha=0.25, label="dominated: another point beats it on both"),
    ]
    legend = ax.legend(handles=handles, loc="best", fontsize=8.5, framealpha=0.95)
    ax.text(
        0.01,
        0.015,
        "better: lower left",
        transform=ax.transAxes,
        fontsize=8.5,
        color="#2a9d3f",
        ha="left",
        va="bottom",
        style="italic",
    )

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    obstacles = [legend.get_window_extent(renderer)]
    obstacles += [t.get_window_extent(renderer) for t in budget_texts]
    obstacles += _segment_boxes(ax, sx, sy, pad=2.5)
    x0, x1 = ax.get_xlim()
    for y in budget_ys:
        obstacles += _segment_boxes(ax, [x0, x1], [y, y], pad=1.5)
    # one label per spot: points closer than a marker's width share it, one name per line,
    # top to bottom as the points lie (separate labels would be ambiguous there)
    groups = _clusters(ax.transData.transform(list(zip(xs, ys, strict=True))), radius=11.0)
    groups = [sorted(g, key=lambda i: (-ys[i], xs[i])) for g in groups]
    labels = ["\n".join(_short(rows[i], many_solvers) for i in g) for g in groups]
    gx = [sum(xs[i] for i in g) / len(g) for g in groups]
    gy = [sum(ys[i] for i in g) / len(g) for g in groups]
    first = [k for k, g in enumerate(groups) if any(i in on_front for i in g)]
    _place_labels(ax, renderer, gx, gy, labels, first, obstacles)
    if path is not None:
        fig.savefig(path, dpi=dpi)
    return fig


def _place_labels(ax, renderer, xs, ys, labels, first, obstacles) -> None:
    """Annotate each point with its label where it overlaps nothing placed before it.

    Greedy: frontier points first, then the others; for each, the first of a ring of offsets
    (right, left, above, below, diagonals, then farther out with a leader line) whose text box
    stays inside the axes and clear of the points, the legend and earlier labels.
    """
    from matplotlib.transforms import Bbox

    pts = ax.transData.transform(list(zip(xs, ys, strict=True)))
    pad = 7.0
    boxes = list(obstacles) + [
        Bbox.from_extents(px - pad, py - pad, px + pad, py + pad) for px, py in pts
    ]
    axbox = ax.get_window_extent(renderer)
    near = [
        (8, 0, "left", "center"),
        (-8, 0, "right", "center"),
        (0, 8, "center", "bottom"),
        (0, -9, "center", "top"),
        (7, 7, "left", "bottom"),
        (7, -7, "left", "top"),
        (-7, 7, "right", "bottom"),
        (-7, -7, "right", "top"),
    ]
    ring = near + [(dx * f, dy * f, ha, va) for f in (2.6, 4.2) for dx, dy, ha, va in near[4:]]
    order = list(first) + [i for i in range(len(xs)) if i not in set(first)]
    for i in order:
        best = None
        for n, (dx, dy, ha, va) in enumerate(ring):
            far = n >= len(near)
            ann = ax.annotate(
                labels[i],
                (xs[i], ys[i]),
                xytext=(dx, dy),
                textcoords="offset points",
                ha=ha,
                va=va,
                fontsize=8.5,
                zorder=4,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8),
                arrowprops=dict(arrowstyle="-", color="#888888", lw=0.7) if far else None,
            )
            bb = ann.get_window_extent(renderer)
            cost = sum(_overlap(bb, o) for o in boxes)
            outside = (max(axbox.x0 - bb.x0, 0) + max(bb.x1 - axbox.x1, 0)) * bb.height + (
                max(axbox.y0 - bb.y0, 0) + max(bb.y1 - axbox.y1, 0)
            ) * bb.width
            cost += 4 * outside + n  # prefer the nearer spots on ties
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, ann, bb)
            else:
                ann.remove()
            if cost <= n:  # clear spot
                break
        boxes.append(best[2])


def _clusters(points, radius: float) -> list[list[int]]:
    """Indices of display-space points grouped so that linked points lie within `radius`."""
    groups: list[list[int]] = []
    for i, (x, y) in enumerate(points):
        near = [g for g in groups if any(math.dist((x, y), points[j]) <= radius for j in g)]
        merged = [i] + [j for g in near for j in g]
        groups = [g for g in groups if g not in near] + [sorted(merged)]
    return sorted(groups)


def _segment_boxes(ax, xs, ys, pad: float) -> list:
    """Display-space boxes around the segments of a polyline (obstacles for labels)."""
    from matplotlib.transforms import Bbox

    pts = ax.transData.transform(list(zip(xs, ys, strict=True)))
    return [
        Bbox.from_extents(
            min(a[0], b[0]) - pad,
            min(a[1], b[1]) - pad,
            max(a[0], b[0]) + pad,
            max(a[1], b[1]) + pad,
        )
        for a, b in zip(pts[:-1], pts[1:], strict=True)
    ]


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0
