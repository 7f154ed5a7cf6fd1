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
        "LossScaleMonitor: no optimizer of this model skips a step (compute dtype "
        f"{compute_dtype}: Keras' behaviour, nothing is checked), so there is nothing to "
        "monitor. Compile with skip_nonfinite=True to skip and count the steps whose "
        "loss or gradients are not finite."
    )


def _scale_now(scale, before="; "):
    """`; the loss scale is now 1024`, or nothing without one (`None`)."""
    return "" if scale is None else f"{before}the loss scale is now {format_scale(scale)}"


def _because(spikes):
    return "their loss or gradients were not finite" + (
        " or their loss spiked" if spikes else "")


def skipped_in_fit(skipped, steps, scale, spikes=False):
    """The line kmp's progress bar prints at the end of a fit without a
    monitor (`scale`: the loss scale now, `None` where nothing scales;
    `spikes`: whether loss spikes are skipped too)."""
    return (
        f"kmp: {skipped} of {steps} training steps were skipped because "
        f"{_because(spikes)}{_scale_now(scale)}. "
        "Add kmp.callbacks.LossScaleMonitor() to the callbacks to see which steps and why."
    )


def skipped_in_fit_by_optimizer(counts, spikes=False):
    """The end-of-fit line for several optimizers.

    Args:
        counts: List of `(name, skipped, steps, scale)`, one per optimizer
            that took steps in the fit (`scale` `None` where nothing scales).
        spikes: Bool. Whether any of them skips loss spikes too.
    """
    parts = "; ".join(
        f"{name} skipped {skipped} of {steps}"
        + ("" if scale is None else f" (loss scale now {format_scale(scale)})")
        for name, skipped, steps, scale in counts
    )
    return (
        f"kmp: training steps were skipped because {_because(spikes)}: {parts}. "
        "Add kmp.callbacks.LossScaleMonitor() to the callbacks to see which steps and why."
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
    scale 32768 -> 65536 (min 16384, max 65536)`; without the loss scale
    where nothing scales (`summary["scaling"]` false)."""
    steps, skipped = summary["steps"], summary["skipped"]
    spikes = summary.get("spikes", 0)
    breakdown = (
        f": {summary['backward']} backward, {summary['forward']} forward"
        + (f", {plural(spikes, 'loss spike')}" if spikes else "")
        if skipped
        else ""
    )
    retried = summary.get("retried", 0)
    batches = "batch" if retried == 1 else "batches"
    retries = f", {retried} {batches} retried at a lower scale" if retried else ""
    line = (
        f"epoch {summary['epoch']}: {skipped} of {plural(steps, 'step')} "
        f"skipped ({skip_rate(summary):.1%}{breakdown}{retries})"
    )
    if not summary.get("scaling", True):
        return line
    return (
        f"{line}, loss scale "
        f"{format_scale(summary['start_scale'])} -> "
        f"{format_scale(summary['end_scale'])} "
        f"(min {format_scale(summary['min_scale'])}, "
        f"max {format_scale(summary['max_scale'])})"
    )


# Where a non-finite loss comes from, besides the data, when nothing computes
# in float16 (bfloat16 and float32 reach float32's range).
UNDEFINED_OPERATION = ("an operation undefined at its input (log or division by 0, "
                       "sqrt of a negative)")

# What to compute in float32, or let fall, when gradients overflow float16
# with the scale at its floor (`min_scale`): Keras' own scaler has no floor
# and would go on halving. After "compute".
AT_THE_FLOOR = ("the layers whose gradients overflow in float32 (kmp.diagnose names them), "
                "let the scale fall further (kmp.LossScaleOptimizer(optimizer, min_scale=2**-8))")


def skip_rate_warning(summary, warn_skip_rate, floor=None):
    """The warning for an epoch that skipped more than `warn_skip_rate`
    (`floor`: a dynamic loss scale's `min_scale`, or `None`)."""
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
    if summary.get("spikes"):
        parts.append(
            f"{plural(summary['spikes'], 'loss spike')} (a finite loss far above the "
            "recent ones: skip_spikes)"
        )
    scaling = summary.get("scaling", True)
    causes = []
    if summary["forward"] and scaling:
        causes.append(
            "inputs or labels containing inf/NaN, or a layer overflowing "
            "float16 in the forward pass (large activations, exp, sums of "
            "squares): check the data with np.isfinite and give that layer "
            'dtype="float32"'
        )
    elif summary["forward"]:
        causes.append(
            f"inputs or labels containing inf/NaN, or {UNDEFINED_OPERATION} "
            "in the forward pass: check the data with np.isfinite"
        )
    at_floor = (summary["backward"] and scaling and floor is not None
                and summary["min_scale"] <= floor)
    if at_floor:
        causes.append(
            f"the loss scale fell to its min_scale ({format_scale(floor)}) this epoch, "
            "where a gradient that overflows overflows float16 even unscaled: compute "
            f"{AT_THE_FLOOR}"
        )
    if summary["backward"]:
        causes.append(
            "a learning rate too high, so the weights diverge: lower it or "
            "clip the gradients (global_clipnorm=1.0)"
            + ("; if the scale keeps growing back into overflows, raise growth_interval"
               if scaling and not at_floor else "")
        )
    if summary.get("spikes"):
        causes.append(
            "batches unlike the others (corrupt records, a shuffle that groups outliers): "
            "check the data, or raise skip_spikes"
        )
    if scaling:
        causes.append("where the hardware supports it, mixed_bfloat16 needs no loss scaling")
    return (
        f"LossScaleMonitor: epoch {summary['epoch']} skipped "
        f"{summary['skipped']} of {summary['steps']} steps "
        f"({skip_rate(summary):.1%}, above warn_skip_rate={warn_skip_rate:g}): "
        f"{'; '.join(parts)}. Likely causes and what to try: {'; '.join(causes)}."
    )


def stop_message(stopped_step, step, limit, forward, names, scale, spikes=False,
                 min_scale=None):
    """Why training stops at `stopped_step` after `limit` consecutive skips.

    Args:
        stopped_step: Int. The step at which the limit was reached.
        step: Int. The last step taken (the end of its execution).
        limit: Int. `max_consecutive_skips`.
        forward: Bool. Whether every one of those skips was a forward
            overflow (the loss itself not finite).
        names: List of the variables whose gradients were not finite.
        scale: Float. The loss scale now, or `None` where nothing scales.
        spikes: Bool. Whether loss spikes are skipped too.
        min_scale: Float. A dynamic scale's floor, or `None`.
    """
    if forward and scale is not None:
        why = (
            "the loss itself was not finite at each of them (forward "
            "overflow): the inputs or labels contain inf/NaN, or a layer "
            "overflows in the forward pass. Lowering the loss scale cannot "
            "help; check the data with np.isfinite and compute the "
            "overflowing layer in float32"
        )
    elif forward:
        why = (
            "the loss itself was not finite at each of them: the inputs or "
            f"labels contain inf/NaN, or there is {UNDEFINED_OPERATION}; "
            "check the data with np.isfinite"
        )
    else:
        where = f" (first in {shorten_names(names)})" if names else ""
        scale_now = "" if scale is None else (
            f", and the loss scale is down to {format_scale(scale)}")
        spiked = " (or their loss spiked: skip_spikes)" if spikes else ""
        if min_scale is not None and scale is not None and scale <= min_scale:
            advice = (
                ", its min_scale: the gradients overflow float16 even so. "
                f"Compute {AT_THE_FLOOR}, or lower the learning rate if the weights "
                "are diverging"
            )
        else:
            advice = (": the weights are likely diverging. Try a lower learning "
                      "rate or gradient clipping (global_clipnorm=1.0)")
        why = (
            "their gradients were not finite although the loss was finite"
            f"{where}{spiked}{scale_now}{advice}"
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
