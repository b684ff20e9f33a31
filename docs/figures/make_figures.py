"""The figures of docs/how-it-works.md, written as PNGs beside this script.

    python docs/figures/make_figures.py

* `segments.png`: a program cut into segments, and what each kind of segment keeps from the
  forward pass to the backward pass (a schematic of a 6-layer chain).
* `checkpoint_memory.png`: activation memory over one training step of that chain, without
  remat, with every layer checkpointed, and under a budget (a schematic: each layer's
  internal values are 3 units, its output 1).
* `frontier.png`: compiled temp memory against extra FLOPs for a GPT-2 (6 layers, d=128),
  JAX's built-in policies and jremat's plans at budgets 0.2 .. 0.9, read from
  benchmarks/results/results.csv (`python benchmarks/run.py`, XLA's figures of the compiled
  programs, jax 0.10.2 on CPU).
"""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent.parent / "benchmarks" / "results" / "results.csv"
LAYERS = 6
INNER, OUT = 3.0, 1.0  # units of memory: a layer's internal values, its output
#: the plan of the schematic: per layer, "keep" (not checkpointed), "names" (checkpointed,
#: keeps some values), "nothing" (checkpointed, keeps only its input)
PLAN = ["nothing", "nothing", "names", "names", "keep", "keep"]
COLORS = {"keep": "#4c72b0", "names": "#dd8452", "nothing": "#55a868"}
LABELS = {
    "keep": "kept whole (not checkpointed)",
    "names": "checkpointed, saves some values",
    "nothing": "checkpointed, saves nothing",
}
KEPT = {"keep": INNER, "names": 1.0, "nothing": 0.0}  # internal units kept per segment


def segments() -> None:
    fig, ax = plt.subplots(figsize=(8, 2.6))
    for i, kind in enumerate(PLAN):
        ax.add_patch(
            FancyBboxPatch(
                (i * 1.3, 0.9), 1.0, 0.8, boxstyle="round,pad=0.03", color=COLORS[kind], alpha=0.85
            )
        )
        ax.text(i * 1.3 + 0.5, 1.3, f"layer {i}", ha="center", va="center", color="white")
        ax.bar(i * 1.3 + 0.5, KEPT[kind] / INNER * 0.6, width=0.6, bottom=0.1, color=COLORS[kind])
        if i:
            ax.annotate("", (i * 1.3 - 0.02, 1.3), (i * 1.3 - 0.28, 1.3),
                        arrowprops={"arrowstyle": "->"})  # fmt: skip
        ax.plot([i * 1.3 + 0.2, i * 1.3 + 0.8], [0.1, 0.1], color="black", lw=0.8)
    ax.text(-0.15, 0.4, "kept for\nbackward", ha="right", va="center", fontsize=9)
    ax.text(-0.15, 1.3, "forward", ha="right", va="center", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in LABELS]
    ax.legend(handles, LABELS.values(), loc="upper center", bbox_to_anchor=(0.5, 1.32), ncol=3,
              fontsize=8, frameon=False)  # fmt: skip
    ax.set_xlim(-1.2, LAYERS * 1.3)
    ax.set_ylim(0, 1.9)
    ax.axis("off")
    fig.savefig(HERE / "segments.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def profile(kinds: list[str]) -> list[float]:
    """Live activation memory after each forward layer, then during each layer's backward."""
    kept = [OUT + KEPT[k] for k in kinds]  # each segment keeps its output and what it saves
    trace, live = [], 0.0
    for i in range(len(kinds)):
        live += kept[i]
        trace.append(live + (INNER - KEPT[kinds[i]]))  # the layer's own values while it runs
    for i in reversed(range(len(kinds))):
        # its backward recomputes what it did not keep, then frees the segment
        trace.append(live + (INNER - KEPT[kinds[i]]) + OUT)
        live -= kept[i]
    return trace


def checkpoint_memory() -> None:
    cases = {
        "no remat": ["keep"] * LAYERS,
        "every layer checkpointed": ["nothing"] * LAYERS,
        "a plan under a budget": PLAN,
    }
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for (label, kinds), color in zip(cases.items(), ["#4c72b0", "#55a868", "#dd8452"], strict=True):
        y = profile(kinds)
        ax.step(range(len(y)), y, where="mid", label=f"{label} (peak {max(y):.0f})", color=color)
    ax.axvline(LAYERS - 0.5, color="grey", lw=0.8, ls=":")
    ax.text(LAYERS / 2 - 0.5, ax.get_ylim()[1] * 0.95, "forward", ha="center", va="top")
    ax.text(LAYERS * 1.5 - 0.5, ax.get_ylim()[1] * 0.95, "backward", ha="center", va="top")
    ax.set_xticks(range(2 * LAYERS))
    ax.set_xticklabels([str(i) for i in range(LAYERS)] + [str(i) for i in reversed(range(LAYERS))])
    ax.set_xlabel("layer running")
    ax.set_ylabel("live activation memory (units)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False)
    fig.savefig(HERE / "checkpoint_memory.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def frontier() -> None:
    rows = [r for r in csv.DictReader(RESULTS.open()) if r["model"] == "gpt2"]
    fig, ax = plt.subplots(figsize=(7, 4))
    chain = sorted(
        (float(r["temp_fraction"]), float(r["extra_flops_pct"]))
        for r in rows
        if r["policy"] == "jremat chain"
    )
    ax.plot(*zip(*chain, strict=True), "o-", color="#dd8452", label="jremat (budgets 0.2 .. 0.9)")
    for r in rows:
        if not r["policy"].startswith("jremat"):
            x, y = float(r["temp_fraction"]), float(r["extra_flops_pct"])
            ax.plot(x, y, "s", color="#4c72b0")
            ax.annotate(r["policy"].replace(" per layer", ""), (x, y), fontsize=7,
                        xytext=(5, 3), textcoords="offset points")  # fmt: skip
    ax.plot([], [], "s", color="#4c72b0", label="JAX policies (per layer)")
    ax.set_xlabel("compiled temp memory (fraction of no remat)")
    ax.set_ylabel("extra FLOPs (%)")
    ax.set_title("GPT-2 (6 layers, d=128), batch 8x128: the memory/compute frontier", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(HERE / "frontier.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    segments()
    checkpoint_memory()
    frontier()
