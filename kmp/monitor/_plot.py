"""`LossScaleMonitor`'s plot: the loss scale on a log2 axis, the loss below it.

Also how a monitor's plot gets matplotlib and is written (`Float8Monitor`'s
plot, `kmp/monitor/_float8.py`, uses them).

matplotlib is optional (`pip install -e ".[plot]"`): without it the monitor
warns how to get it and carries on.
"""

import os
import warnings

import numpy as np

from kmp import _user_line
from kmp.backup import _atomic_files
from kmp.monitor._ledger import REASON_FORWARD


def matplotlib_figure(caller, path):
    """matplotlib's `Figure` class, or `None` after a warning naming `caller`
    and saying how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(
            f"{caller}: plot_path was given but matplotlib is not "
            "installed, so no plot was written. Install it with "
            "`pip install -e \".[plot]\"` in your clone of kmp (or `pip install "
            "matplotlib`). "
            f"Received: plot_path={path!r}",
            stacklevel=_user_line.stacklevel(),
        )
        return None
    return Figure


def save_figure(figure, path):
    """Lays `figure` out and writes it to `path` as a PNG, creating its directory."""
    figure.tight_layout()
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    # Written under a new name, then moved onto `path`: a file whose
    # writing was cut short never sits at `path`, and a link planted there
    # is replaced, not written through.
    _atomic_files.write_then_replace(
        os.fspath(path), write_path=lambda partial: figure.savefig(partial, format="png"))


def write_plot(path, history):
    """Writes the loss-scale and loss plot; warns instead when matplotlib is missing.

    Args:
        path: String. Where to write the PNG; its directory is created.
        history: Dict of lists, as `kmp.monitor._ledger.Ledger.history`: `step`,
            `loss`, `loss_scale`, `scale_before`, `reason`.
    """
    Figure = matplotlib_figure("LossScaleMonitor", path)
    if Figure is None:
        return
    steps = np.asarray(history["step"], dtype=np.float64)
    losses = np.asarray(history["loss"], dtype=np.float64)
    scales = np.asarray(history["loss_scale"], dtype=np.float64)
    before = np.asarray(history["scale_before"], dtype=np.float64)
    reasons = np.asarray(history["reason"], dtype=object)
    skipped = reasons != ""
    forward = np.array([REASON_FORWARD in r for r in reasons], dtype=bool)

    # Figure without pyplot: no global state, no GUI backend needed.
    figure = Figure(figsize=(8, 6), dpi=100)
    scale_axis, loss_axis = figure.subplots(2, 1, sharex=True)
    scale_axis.step(steps, scales, where="post", color="tab:blue", label="loss scale")
    scale_axis.set_yscale("log", base=2)
    if np.any(skipped & ~forward):
        scale_axis.scatter(steps[skipped & ~forward], before[skipped & ~forward],
                           marker="v", color="tab:red", zorder=3,
                           label="skipped: gradients not finite")
    if np.any(forward):
        scale_axis.scatter(steps[forward], before[forward], marker="x",
                           color="black", zorder=3, label="skipped: loss not finite")
    scale_axis.set_ylabel("loss scale (log2)")
    scale_axis.set_title(
        f"{int(skipped.sum())} of {len(steps)} "
        f"{'steps' if len(steps) != 1 else 'step'} skipped"
    )
    scale_axis.legend(loc="best", fontsize="small")
    scale_axis.grid(True, which="major", alpha=0.3)

    finite = np.isfinite(losses)
    loss_axis.plot(steps[finite], losses[finite], color="tab:green", linewidth=1)
    for step in steps[forward]:
        loss_axis.axvline(step, color="black", alpha=0.2, linewidth=1)
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    loss_axis.grid(True, alpha=0.3)
    save_figure(figure, path)
