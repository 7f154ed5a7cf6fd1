"""What `LossScaleMonitor` and kmp's progress bar say about skipped steps.

Each function turns numbers (an epoch summary of `kmp.monitor._ledger.Ledger`, a stop
step) into the text people read: the epoch line, the skip-rate warning with
its likely causes, the reason training was stopped.
"""

import warnings

from kmp import _keras_internals
from kmp import _user_line
from kmp._format import format_scale

# How many overflowing variables a message or CSV row names before "+N more".
NAMES_SHOWN = 3


class Pending:
    """Lines and warnings held back until the progress bar has ended its line.

    Keras' progress bar is the last callback: a line printed at the end of an
    epoch would land inside its line. The monitor says them at the next
    epoch's start or at the end of training.
    """

    def __init__(self):
        self._lines = []
        self._warnings = []

    def add_line(self, line):
        self._lines.append(line)

    def add_warning(self, message):
        self._warnings.append(message)

    def flush(self):
        """Prints the lines, then warns; call it from a callback hook."""
        lines, messages = self._lines, self._warnings
        self._lines, self._warnings = [], []
        for line in lines:
            _keras_internals.print_msg(line)
        for message in messages:
            # At the user's line (`fit(...)`), not Keras' callback_list.py.
            warnings.warn(message, stacklevel=_user_line.stacklevel())


def plural(count, noun):
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def shorten_names(names, separator=", "):
    """The first `NAMES_SHOWN` names, then `+N more`."""
    shown = separator.join(names[:NAMES_SHOWN])
    if len(names) > NAMES_SHOWN:
        shown += f"{separator}+{len(names) - NAMES_SHOWN} more"
    return shown


def skip_rate(summary):
    """The share of an epoch's steps that were skipped (0 for no steps)."""
    return summary["skipped"] / summary["steps"] if summary["steps"] else 0.0


def nothing_to_monitor(compute_dtype):
    return (
        "LossScaleMonitor: the optimizer does not scale the loss "
        f"(compute dtype {compute_dtype}), so no step can be skipped; nothing "
        "to monitor."
    )


def skipped_in_fit(skipped, steps, scale):
    """The line kmp's progress bar prints at the end of a fit without a monitor."""
    return (
        f"kmp: {skipped} of {steps} training steps were skipped because "
        "their gradients were not finite; the loss scale is now "
        f"{format_scale(scale)}. Add kmp.callbacks.LossScaleMonitor() to the "
        "callbacks to see which steps and why."
    )


def skipped_in_fit_by_optimizer(counts):
    """The end-of-fit line for several optimizers.

    Args:
        counts: List of `(name, skipped, steps, scale)`, one per optimizer
            that took steps in the fit.
    """
    parts = "; ".join(
        f"{name} skipped {skipped} of {steps} (loss scale now {format_scale(scale)})"
        for name, skipped, steps, scale in counts
    )
    return (
        "kmp: training steps were skipped because their gradients were not "
        f"finite: {parts}. Add kmp.callbacks.LossScaleMonitor() to the "
        "callbacks to see which steps and why."
    )


def for_optimizer(name, text):
    """`text` about one of several optimizers: its attribute name comes first,
    after the speaker (`LossScaleMonitor: `) when there is one.

    >>> for_optimizer("d_optimizer", "epoch 1: 0 of 4 steps skipped")
    'd_optimizer: epoch 1: 0 of 4 steps skipped'
    >>> for_optimizer("d_optimizer", "LossScaleMonitor: stopping training")
    'LossScaleMonitor: d_optimizer: stopping training'
    """
    speaker = "LossScaleMonitor: "
    if text.startswith(speaker):
        return f"{speaker}{name}: {text[len(speaker):]}"
    return f"{name}: {text}"


def epoch_line(summary):
    """`epoch 3: 12 of 500 steps skipped (2.4%: 12 backward, 0 forward), loss
    scale 32768 -> 65536 (min 16384, max 65536)`."""
    steps, skipped = summary["steps"], summary["skipped"]
    breakdown = (
        f": {summary['backward']} backward, {summary['forward']} forward"
        if skipped
        else ""
    )
    retried = summary.get("retried", 0)
    batches = "batch" if retried == 1 else "batches"
    retries = f", {retried} {batches} retried at a lower scale" if retried else ""
    return (
        f"epoch {summary['epoch']}: {skipped} of {plural(steps, 'step')} "
        f"skipped ({skip_rate(summary):.1%}{breakdown}{retries}), loss scale "
        f"{format_scale(summary['start_scale'])} -> "
        f"{format_scale(summary['end_scale'])} "
        f"(min {format_scale(summary['min_scale'])}, "
        f"max {format_scale(summary['max_scale'])})"
    )


def skip_rate_warning(summary, warn_skip_rate):
    """The warning for an epoch that skipped more than `warn_skip_rate`."""
    parts = []
    if summary["backward"]:
        where = (
            f"; first in {shorten_names(summary['nonfinite_variables'])}"
            if summary["nonfinite_variables"]
            else ""
        )
        parts.append(
            f"{plural(summary['backward'], 'backward overflow')} (the loss "
            f"was finite, its gradients were not{where})"
        )
    if summary["forward"]:
        parts.append(
            f"{plural(summary['forward'], 'forward overflow')} (the loss "
            "itself was inf or NaN)"
        )
    causes = []
    if summary["forward"]:
        causes.append(
            "inputs or labels containing inf/NaN, or a layer overflowing "
            "float16 in the forward pass (large activations, exp, sums of "
            "squares): check the data with np.isfinite and give that layer "
            'dtype="float32"'
        )
    if summary["backward"]:
        causes.append(
            "a learning rate too high, so the weights diverge: lower it or "
            "clip the gradients (global_clipnorm=1.0); if the scale keeps "
            "growing back into overflows, raise growth_interval"
        )
    causes.append("where the hardware supports it, mixed_bfloat16 needs no loss scaling")
    return (
        f"LossScaleMonitor: epoch {summary['epoch']} skipped "
        f"{summary['skipped']} of {summary['steps']} steps "
        f"({skip_rate(summary):.1%}, above warn_skip_rate={warn_skip_rate:g}): "
        f"{'; '.join(parts)}. Likely causes and what to try: {'; '.join(causes)}."
    )


def stop_message(stopped_step, step, limit, forward, names, scale):
    """Why training stops at `stopped_step` after `limit` consecutive skips.

    Args:
        stopped_step: Int. The step at which the limit was reached.
        step: Int. The last step taken (the end of its execution).
        limit: Int. `max_consecutive_skips`.
        forward: Bool. Whether every one of those skips was a forward
            overflow (the loss itself not finite).
        names: List of the variables whose gradients were not finite.
        scale: Float. The loss scale now.
    """
    if forward:
        why = (
            "the loss itself was not finite at each of them (forward "
            "overflow): the inputs or labels contain inf/NaN, or a layer "
            "overflows in the forward pass. Lowering the loss scale cannot "
            "help; check the data with np.isfinite and compute the "
            "overflowing layer in float32"
        )
    else:
        where = f" (first in {shorten_names(names)})" if names else ""
        why = (
            "their gradients were not finite although the loss was "
            f"{where}, and the loss scale is down to {format_scale(scale)}: "
            "the weights are likely diverging. Try a lower learning rate or "
            "gradient clipping (global_clipnorm=1.0)"
        )
    after = (
        f" Training stops after step {step}, the end of that execution "
        "(steps_per_execution > 1)."
        if step != stopped_step
        else ""
    )
    return (
        f"LossScaleMonitor: stopping training at step {stopped_step}: "
        f"{limit} consecutive steps were skipped (max_consecutive_skips="
        f"{limit}) and {why}.{after}"
    )
