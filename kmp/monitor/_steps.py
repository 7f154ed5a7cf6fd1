"""One optimizer a `LossScaleMonitor` watches in one fit, and how its steps
are read.

Each step's counters, loss and loss scale come from the values the train step
returns (or, where it returns none, from the optimizer); they wait in a list
until processed in batches, then go to the optimizer's `kmp.monitor._ledger.Ledger`
and its CSV. At the end of the fit its plot is drawn from the ledger.
"""

import functools
import os

import numpy as np

from kmp import _keras_internals
from kmp.monitor._arguments import check_path
from kmp.monitor import _messages as messages
from kmp.monitor._csv import StepCsv
from kmp.monitor._ledger import Ledger
from kmp.monitor._plot import write_plot
from kmp.scaling import _step as _scaling_step
from kmp.scaling._optimizers import read_counters
from kmp.scaling._optimizers import retries


def _loss_log(name):
    """The log key of an optimizer's loss: `d_loss` for `d_optimizer`, else `loss`."""
    if name.endswith("optimizer") and name != "optimizer":
        return name[: -len("optimizer")] + "loss"
    return "loss"


def _path_for(path, name):
    """`path` for one of several optimizers: `steps.csv` -> `steps.d_optimizer.csv`."""
    if path is None or name is None:
        return path
    root, extension = os.path.splitext(path)
    return f"{root}.{name}{extension}"


def check_paths(csv_path, plot_path, names):
    """Checks again, when a fit begins, the files each watched optimizer
    (`names`; None for one alone) will write: a folder made at one since the
    monitor was made is named before any step, not at the first write."""
    for name in names:
        check_path("csv_path", _path_for(csv_path, name))
        check_path("plot_path", _path_for(plot_path, name))


def _read_step(model, optimizer, logs, loss_log="loss"):
    """Returns `(counters, nonfinite_gradients, loss, loss_scale)` for the step
    just taken; `nonfinite_gradients` and `loss` from the step's outputs stay
    tensors until the step is processed (nothing reuses them), those read
    from the optimizer's variables are copied to the host now.
    """
    # kmp.Model's own step returns the values of `model.optimizer` only.
    own = optimizer is getattr(model, "optimizer", None)
    monitor_logs = (getattr(model, "_kmp_monitor_logs", None) or {}) if own else {}
    if "counters" in monitor_logs:
        counters = monitor_logs["counters"]
        nonfinite_gradients = monitor_logs["nonfinite_gradients"]
        loss = monitor_logs["loss"]  # converted when the step is processed
    else:
        # Not a kmp.Model, several replicas, a custom train_step or another
        # optimizer: read the optimizer (one small host read per step) and
        # take the loss from the logs (the epoch's mean, for Keras' own step).
        counters, nonfinite_gradients = _scaling_step.monitor_state(optimizer)
        # Copied now: on JAX a variable's value read during fit is an input
        # of the next step, which may reuse (donate) its buffer.
        nonfinite_gradients = np.array(nonfinite_gradients)
        loss = float(logs.get(loss_log, logs.get("loss", float("nan"))))
    counters = np.asarray(counters).tolist()  # Python ints: cheap below
    if own and "loss_scale" in logs:
        loss_scale = float(logs["loss_scale"])
    else:
        loss_scale = float(optimizer.loss_scale)
    return counters, nonfinite_gradients, loss, loss_scale


def _variable_names(optimizer, nonfinite_gradients):
    """The paths of the variables whose flag in `nonfinite_gradients` is set."""
    variables = _keras_internals.built_variables(optimizer)
    return [
        getattr(variables[i], "path", variables[i].name)
        for i in np.flatnonzero(np.asarray(nonfinite_gradients))
        if i < len(variables)
    ]


class WatchedOptimizer:
    """One optimizer a monitor watches in one fit: its ledger, CSV and plot,
    and the steps read but not processed yet.

    Args:
        name: String. The optimizer's attribute name on the model.
        optimizer: The `kmp.LossScaleOptimizer`, built or not (an optimizer
            is built by its first step).
        csv_path: Optional string. The monitor's `csv_path`.
        plot_path: Optional string. The monitor's `plot_path`.
        several: Bool. Whether the monitor watches several optimizers in this
            fit. Then the paths get the name (`steps.d_optimizer.csv`), the
            CSV is created at its first row (one that takes no step leaves no
            file), messages start with the name, and one that takes no step
            is not reported.
    """

    def __init__(self, name, optimizer, csv_path, plot_path, several):
        self.name = name
        self.optimizer = optimizer
        self.several = several
        self.loss_log = _loss_log(name)
        # Zeros for an optimizer not built yet: it has taken no step.
        self.ledger = Ledger(read_counters(optimizer).tolist(), float(optimizer.loss_scale))
        self._first_step = self.ledger.step
        suffix = name if several else None
        self.csv = StepCsv(_path_for(csv_path, suffix), lazy=several)
        self._plot_path = _path_for(plot_path, suffix)
        self._retries_at_epoch_start = 0
        self.pending_steps = []

    @property
    def reported(self):
        """Whether its epochs are reported (lines, warnings, summaries, plot).

        Of several, one that took no step (the optimizer a GAN's `compile`
        makes and its train_step never uses) would only add noise.
        """
        return not self.several or self.ledger.step > self._first_step

    @property
    def scale_floor(self):
        """A dynamic loss scale's `min_scale`, or `None` (a fixed scale, or
        none: nothing falls to a floor)."""
        optimizer = self.optimizer
        return optimizer.min_scale if optimizer.scaling and optimizer.dynamic else None

    def say(self, text):
        """`text` about this optimizer, named when the monitor watches several."""
        return messages.for_optimizer(self.name, text) if self.several else text

    def begin_epoch(self, epoch):
        """Starts epoch number `epoch` (1-based)."""
        self.ledger.begin_epoch(epoch)
        self._retries_at_epoch_start = retries(self.optimizer)

    def read_step(self, model, logs):
        """Keeps the step just taken; returns its consecutive skips."""
        record = _read_step(model, self.optimizer, logs, self.loss_log)
        self.pending_steps.append(record)
        return record[0][3]

    def process_pending_steps(self):
        for counters, flags, loss, loss_scale in self.pending_steps:
            # Names are read (a device read of the flags) only on a backward skip.
            names = functools.partial(_variable_names, self.optimizer, flags)
            self.csv.write(self.ledger.record(counters, float(loss), loss_scale, names))
        self.pending_steps = []

    def stop_reason(self, limit):
        """`(step, message)`: the step at which `limit` consecutive skips were
        reached (see `Ledger.step_reaching`), and why training stops there."""
        ledger = self.ledger
        step = ledger.step_reaching(limit)
        forward = ledger.consecutive_forward >= limit
        optimizer = self.optimizer
        return step, self.say(messages.stop_message(
            step, ledger.step, limit, forward, ledger.last_names,
            ledger.scale if optimizer.scaling else None, optimizer.skip_spikes is not None,
            self.scale_floor,
        ))

    def end_epoch(self):
        """Processes the epoch's steps, flushes the CSV; returns the epoch's summary."""
        self.process_pending_steps()
        self.csv.flush()
        summary = self.ledger.end_epoch()
        # Batches redone at a lower scale (`compile(overflow_retries=...)`).
        return dict(summary, retried=retries(self.optimizer) - self._retries_at_epoch_start,
                    scaling=self.optimizer.scaling)

    def end_fit(self):
        """Processes the last steps, closes the CSV and writes the plot."""
        self.process_pending_steps()
        self.csv.close()
        if self._plot_path is not None and self.reported:
            write_plot(self._plot_path, self.ledger.history)
