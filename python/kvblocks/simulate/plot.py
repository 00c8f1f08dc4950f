"""Timeline plot of a simulation (matplotlib, Agg backend; no display needed)."""

from __future__ import annotations

from pathlib import Path

from kvblocks.simulate.runner import SimulationResult

__all__ = ["write_plot"]


def write_plot(result: SimulationResult, path: str | Path) -> None:
    """Write KV usage, running batch size and prefix hit rate over simulated time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = result.timeline
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    usable = result.config.num_blocks - 1
    axes[0].plot(t["time_s"], 100 * t["kv_usage"], label="paged (used blocks)")
    axes[0].plot(
        t["time_s"],
        100 * t["contiguous_blocks"] / usable,
        label="contiguous reservation, same batch",
        alpha=0.7,
    )
    axes[0].set_ylabel("KV memory, % of pool")
    axes[0].legend(loc="upper left", fontsize="small")
    axes[1].plot(t["time_s"], t["running_seqs"], label="sequences in the step")
    axes[1].plot(t["time_s"], t["waiting"], label="waiting requests", alpha=0.7)
    axes[1].set_ylabel("count")
    axes[1].legend(loc="upper left", fontsize="small")
    axes[2].plot(t["time_s"], 100 * t["prefix_hit_rate"])
    axes[2].set_ylabel("prefix hit rate, %")
    axes[2].set_xlabel("simulated time, s")
    fig.suptitle("kvblocks simulate")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
