"""Timeline plot of a simulation (matplotlib, Agg backend; no display needed)."""

from __future__ import annotations

import os
from pathlib import Path

from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate.runner import SimulationResult

__all__ = ["check_plot_path", "write_plot"]


def check_plot_path(path: str | Path) -> None:
    """Check up front that :func:`write_plot` can write ``path``, before a long run.

    Raises:
        InvalidArgumentError: matplotlib is missing, the path is empty, the folder does not
            exist or is not writable, the path is a folder, or matplotlib has no writer for
            its extension.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise InvalidArgumentError(
            "--plot needs matplotlib (pip install 'kvblocks[cli]')"
        ) from None
    if not str(path):  # Path("") is the current folder
        raise InvalidArgumentError("plot path is empty; expected a file name")
    target = Path(path)
    if target.is_dir():
        raise InvalidArgumentError(f"plot path {str(path)!r} is a directory; expected a file name")
    folder = target.parent
    if not folder.is_dir():
        raise InvalidArgumentError(f"plot folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise InvalidArgumentError(f"plot folder {str(folder)!r} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise InvalidArgumentError(f"plot file {str(path)!r} is not writable")
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = target.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise InvalidArgumentError(
            f"plot file {str(path)!r}: no image format for extension {target.suffix!r}; "
            f"use one of {', '.join('.' + f for f in sorted(formats))}"
        )


def write_plot(result: SimulationResult, path: str | Path) -> None:
    """Write KV usage, running batch size and prefix hit rate over simulated time.

    Raises:
        InvalidArgumentError: the file cannot be written (see :func:`check_plot_path`,
            which callers should run before the simulation).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = result.timeline.series()
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
    axes[1].plot(t["time_s"], t["waiting"], label="queued requests (waiting or swapped)", alpha=0.7)
    axes[1].set_ylabel("count")
    axes[1].legend(loc="upper left", fontsize="small")
    axes[2].plot(t["time_s"], 100 * t["prefix_hit_rate"])
    axes[2].set_ylabel("prefix hit rate, %")
    axes[2].set_xlabel("simulated time, s")
    fig.suptitle("kvblocks simulate")
    fig.tight_layout()
    try:
        fig.savefig(str(path), dpi=100)
    except (OSError, ValueError) as exc:
        # The path was checked up front; this is a late failure (disk full, races).
        raise InvalidArgumentError(f"cannot write plot {str(path)!r}: {exc}") from None
    finally:
        plt.close(fig)
