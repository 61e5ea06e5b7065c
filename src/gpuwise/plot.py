"""Pictures of results, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from gpuwise.files import atomic_path
from gpuwise.units import GiB

if TYPE_CHECKING:
    from gpuwise.planning.plan import MemoryPlan

_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
           "temporaries": "#8172b3", "inputs": "#937860", "kv_cache": "#da8bc3"}


def plot_plan(plan: MemoryPlan, path: str | os.PathLike) -> None:
    """The memory timeline of one step, stacked by category, with the peak and each GPU's capacity marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gpuwise.planning.tracker import CATEGORIES

    live = plan.timeline / GiB
    x = np.arange(len(live))
    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    shown = [i for i, c in enumerate(CATEGORIES) if live[:, i].any()]
    ax.stackplot(x, *(live[:, i] for i in shown), labels=[CATEGORIES[i] for i in shown],
                 colors=[_COLORS[CATEGORIES[i]] for i in shown], linewidth=0)
    peak = int(live.sum(axis=1).argmax())
    ax.axvline(peak, color="black", linestyle=":", linewidth=1)
    ax.annotate(f"peak {plan.peak_bytes / GiB:.2f} GiB", (peak, live[peak].sum()), textcoords="offset points",
                xytext=(4, 4), fontsize=9)
    phases = plan.timeline_phases
    for i in range(1, len(phases)):
        if phases[i] != phases[i - 1]:
            ax.axvline(i, color="grey", linewidth=0.5)
            ax.text(i, ax.get_ylim()[1] * 0.01, f" {phases[i]}", fontsize=7, va="bottom", color="grey")
    if len(plan.gpus) == 1:
        cap = (plan.gpus[0].memory_bytes - plan.overhead_bytes) / GiB
        ax.axhline(cap, color="red", linewidth=1)
        ax.text(0, cap, f" {plan.gpus[0].gpu}: {cap:.1f} GiB for tensors", color="red", fontsize=8, va="bottom")
    ax.set_xlabel("allocating op in the step (forward, backward, optimizer)")
    ax.set_ylabel("live tensor memory (GiB)")
    ax.set_title(f"{plan.model}: {plan.setup.describe()}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(x=0)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
