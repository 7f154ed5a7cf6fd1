"""The numbers `LossScaleMonitor` keeps for one optimizer: steps, skips, scales.

Pure Python: the monitor reads each step's counters off the optimizer and
hands them to a `Ledger`; its lines, warnings, CSV rows and plot are made
from what the ledger keeps. The ledger knows nothing of Keras or of the
optimizer, so one ledger per watched optimizer is one more instance.
"""

import collections

REASON_FORWARD = "forward"
REASON_BACKWARD = "backward"
REASON_SPIKE = "spike"

# One record as the CSV and the plot see it.
Step = collections.namedtuple(
    "Step", ["step", "loss", "loss_scale", "skipped", "reason", "nonfinite_variables"]
)


class Ledger:
    """Steps, skips and loss scales of one optimizer, per epoch and in all.

    Each record carries the optimizer's running counters after a step (or
    after an execution of several steps); the ledger works out what happened
    since the record before:

    ```
    record(counters = (step, skipped_total, forward_total,
                       consecutive, consecutive_forward, spikes_total),
           loss, loss_scale):
        steps    = step - last step                    # 1, or steps_per_execution
        skipped  = skipped_total - last skipped_total  # 0 .. steps
        forward  = forward_total - last forward_total  # the loss was not finite
        spikes   = spikes_total - last spikes_total    # the loss spiked
        backward = skipped - forward - spikes          # the gradients were not finite
        if steps <= 0: nothing happened, keep nothing
        reason = "forward", "backward", "spike", or several joined by "+"
        the epoch adds steps, skipped, forward, backward, spikes; its end
        scale is loss_scale, its min and max scales take it in; history
        adds a row
    ```

    Args:
        counters: Sequence of ints. The optimizer's `(step, skipped_total,
            forward_total, ...)` before the first record. Defaults to zeros.
        scale: Float. The loss scale before the first record. Defaults to
            `1.0`.

    Attributes:
        scale: Float. The loss scale after the last record.
        consecutive: Int. Consecutive skipped steps at the last record.
        consecutive_forward: Int. Consecutive forward overflows at the last
            record.
        last_names: List of the variable names whose gradients were not
            finite at the last record that had steps.
        history: Dict of lists, one item per record with steps: `step`,
            `loss`, `loss_scale` (after the step), `scale_before`, `reason`.
        epoch_summaries: List of dicts, one per ended epoch: `epoch`,
            `steps`, `skipped`, `forward`, `backward`, `spikes`, `start_scale`,
            `end_scale`, `min_scale`, `max_scale`, `nonfinite_variables`.

    Example:

    >>> ledger = Ledger(scale=1024.0)
    >>> ledger.begin_epoch(1)
    >>> ledger.record((1, 0, 0, 0, 0), loss=0.5, loss_scale=1024.0).reason
    ''
    >>> ledger.record((2, 1, 0, 1, 0), loss=0.4, loss_scale=512.0,
    ...               nonfinite_names=lambda: ["dense/kernel"]).reason
    'backward'
    >>> summary = ledger.end_epoch()
    >>> summary["steps"], summary["skipped"], summary["min_scale"]
    (2, 1, 512.0)
    """

    def __init__(self, counters=(0, 0, 0), scale=1.0):
        # (step, skipped, forward, spikes) totals; a spike count of 0 where
        # the counters predate it.
        counters = list(counters)
        self._totals = tuple(int(c) for c in counters[:3]) + (
            int(counters[5]) if len(counters) > 5 else 0,)
        self.scale = float(scale)
        self.consecutive = 0
        self.consecutive_forward = 0
        self.last_names = []
        self.history = {
            "step": [], "loss": [], "loss_scale": [], "scale_before": [], "reason": []
        }
        self.epoch_summaries = []
        self._epoch = None

    @property
    def step(self):
        """Int. The optimizer's step count at the last record."""
        return self._totals[0]

    def begin_epoch(self, epoch):
        """Starts counting epoch number `epoch` (1-based) at the current scale."""
        self._epoch = {
            "epoch": epoch,
            "steps": 0,
            "skipped": 0,
            "forward": 0,
            "backward": 0,
            "spikes": 0,
            "start_scale": self.scale,
            "end_scale": self.scale,
            "min_scale": self.scale,
            "max_scale": self.scale,
            "nonfinite_variables": [],
        }

    def record(self, counters, loss, loss_scale, nonfinite_names=None):
        """Takes in one step's (or execution's) counters.

        Args:
            counters: Sequence of 5 or 6 ints: the optimizer's `step`,
                `skipped_total`, `forward_total`, `consecutive`,
                `consecutive_forward` and `spikes_total` (0 where missing)
                after the step.
            loss: Float. The step's loss.
            loss_scale: Float. The loss scale after the step.
            nonfinite_names: Callable returning the names of the variables
                whose gradients were not finite. Called only when the record
                has a backward overflow (reading them costs a device read).
                Defaults to `None`: no names.

        Returns:
            A `Step` (`step`, `loss`, `loss_scale`, `skipped`, `reason`,
            `nonfinite_variables`), or `None` when no step was taken since
            the record before.
        """
        counters = [int(c) for c in counters[:6]]
        step, skipped_total, forward_total, consecutive, consecutive_forward = counters[:5]
        spikes_total = counters[5] if len(counters) > 5 else 0
        last_step, last_skipped, last_forward, last_spikes = self._totals
        self._totals = (step, skipped_total, forward_total, spikes_total)
        self.consecutive = consecutive
        self.consecutive_forward = consecutive_forward
        steps = step - last_step
        skipped = skipped_total - last_skipped
        forward = forward_total - last_forward
        spikes = spikes_total - last_spikes
        if steps <= 0:
            return None
        backward = skipped - forward - spikes
        reason, names = "", []
        if skipped:
            reason = "+".join(
                r for r, n in ((REASON_FORWARD, forward), (REASON_BACKWARD, backward),
                               (REASON_SPIKE, spikes)) if n
            )
            if backward and nonfinite_names is not None:
                names = list(nonfinite_names())

        epoch = self._epoch
        epoch["steps"] += steps
        epoch["skipped"] += skipped
        epoch["forward"] += forward
        epoch["backward"] += backward
        epoch["spikes"] += spikes
        epoch["end_scale"] = loss_scale
        epoch["min_scale"] = min(epoch["min_scale"], loss_scale)
        epoch["max_scale"] = max(epoch["max_scale"], loss_scale)
        for name in names:
            if name not in epoch["nonfinite_variables"]:
                epoch["nonfinite_variables"].append(name)

        history = self.history
        history["step"].append(step)
        history["loss"].append(loss)
        history["loss_scale"].append(loss_scale)
        history["scale_before"].append(self.scale)
        history["reason"].append(reason)
        self.scale = loss_scale
        self.last_names = names
        return Step(step, loss, loss_scale, skipped, reason, names)

    def end_epoch(self):
        """Ends the epoch: returns its summary and adds it to `epoch_summaries`."""
        summary = dict(self._epoch)
        summary["nonfinite_variables"] = list(summary["nonfinite_variables"])
        self.epoch_summaries.append(summary)
        return summary

    def step_reaching(self, limit):
        """The step at which `limit` consecutive skips were reached, or `None`.

        With several steps per record the limit may have been reached before
        the record's last step: `step - (consecutive - limit)`.
        """
        if self.consecutive < limit:
            return None
        return self.step - (self.consecutive - limit)
