"""Callbacks: `LossScaleMonitor`, and crash-safe `BackupAndRestore` and
`ModelCheckpoint` (defined in `kmp.checkpoint`).

`LossScaleMonitor` makes every skipped step visible.

A skipped step is otherwise invisible: the scale halves, the update is
dropped, and nothing is said unless the run diverges. `LossScaleMonitor`
reports each epoch's skips, tells a forward overflow (the loss itself was not
finite) from a backward one (the scale was too high for the gradients), names
the variables whose gradients overflowed, writes a per-step CSV and a plot,
and stops a run that has stopped making progress.

The monitor reads the steps; `kmp/_ledger.py` keeps their numbers,
`kmp/_monitor_messages.py` words them and `kmp/_monitor_plot.py` draws them.
"""

import csv
import functools
import math
import numbers
import os

import keras
import numpy as np

from kmp import _keras_internals
from kmp import _monitor_messages as messages
from kmp import loss_scale as loss_scale_module
from kmp._ledger import Ledger
from kmp._monitor_plot import write_plot
from kmp._optimizers import optimizers_by_attribute
from kmp._optimizers import read_counters as _read_counters
from kmp._optimizers import retries as _retries
from kmp._optimizers import scaling_optimizers
from kmp._progbar import _ProgbarLogger
from kmp.checkpoint import BackupAndRestore
from kmp.checkpoint import ModelCheckpoint

__all__ = [
    "BackupAndRestore",
    "LossScaleMonitor",
    "ModelCheckpoint",
]

# Steps the monitor collects before processing them (CSV rows, statistics).
_PROCESS_EVERY = 256

CSV_COLUMNS = ("step", "loss", "loss_scale", "skipped", "reason", "nonfinite_variables")

def _csv_number(value):
    """A number for the CSV: integers without `.0`, floats as Python writes them."""
    value = float(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 2.0**53:
        return int(value)
    return value


def _has_monitor(callbacks):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return any(
        isinstance(c, LossScaleMonitor)
        for c in (keras.tree.flatten(callbacks) if callbacks else [])
    )


def _watch_optimizer(model, monitored, optimizers=()):
    """Turns the per-step monitor outputs of the model's optimizers on or off.

    A step records which variables overflowed, and `kmp.Model` returns the
    monitor's values with its logs, only while a `LossScaleMonitor` watches:
    without one, a step does no more than the scaling itself. Every
    `kmp.LossScaleOptimizer` the model holds as an attribute is switched
    (a GAN's `d_optimizer` and `g_optimizer` too, built or not: the flag is
    read when the step is traced), and so are `optimizers`. A change
    retraces the train function.
    """
    found = list(scaling_optimizers(model).values())
    found += [o for o in optimizers if all(o is not seen for seen in found)]
    changed = [o for o in found if o._monitored != monitored]
    for optimizer in changed:
        optimizer._monitored = monitored
    if changed and getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)


def _with_readable_progbar(callbacks, verbose):
    """The callbacks `kmp.Model.fit` passes on: kmp's progress bar added.

    Left alone when fit is silent, when the caller built the
    `CallbackList` or passed a progress bar of their own.
    """
    if verbose == 0 or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    callbacks = list(keras.tree.flatten(callbacks)) if callbacks else []
    if any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        return callbacks
    return callbacks + [_ProgbarLogger(report_skips=not _has_monitor(callbacks))]


def _check_path(name, value):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"`{name}` must be a file path (str or os.PathLike) or None. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )


def _is_integer(value, minimum):
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Integral)
        and value >= minimum
    )


def _check_monitor_arguments(max_consecutive_skips, warn_skip_rate, csv_path, plot_path, verbose):
    if max_consecutive_skips is not None and not _is_integer(max_consecutive_skips, 1):
        raise ValueError(
            "`max_consecutive_skips` must be an integer >= 1 or None. "
            f"Received: max_consecutive_skips={max_consecutive_skips!r}"
        )
    if warn_skip_rate is not None and (
        isinstance(warn_skip_rate, bool)
        or not isinstance(warn_skip_rate, numbers.Real)
        or not 0 <= warn_skip_rate <= 1
    ):
        raise ValueError(
            "`warn_skip_rate` must be a number in [0, 1] or None. "
            f"Received: warn_skip_rate={warn_skip_rate!r}"
        )
    _check_path("csv_path", csv_path)
    _check_path("plot_path", plot_path)
    if not _is_integer(verbose, 0):
        raise ValueError(f"`verbose` must be an integer >= 0. Received: verbose={verbose!r}")


_OPTIMIZERS_RULE = (
    "`optimizers` must be None (every kmp.LossScaleOptimizer the model holds) "
    "or a list of the model's optimizer attribute names (str) or "
    "kmp.LossScaleOptimizer instances"
)


def _check_optimizers(optimizers):
    """`LossScaleMonitor(optimizers=...)` as a tuple (or `None`), or the error."""
    if optimizers is None:
        return None
    if isinstance(optimizers, (str, keras.optimizers.Optimizer)):
        shown = repr(optimizers) if isinstance(optimizers, str) else "model.g_optimizer"
        raise TypeError(
            f"{_OPTIMIZERS_RULE}. Received: optimizers={optimizers!r}. For one "
            f"optimizer pass a list: optimizers=[{shown}]"
        )
    if not isinstance(optimizers, (list, tuple)):
        raise TypeError(
            f"{_OPTIMIZERS_RULE}. Received: optimizers={optimizers!r} of type "
            f"{type(optimizers).__name__}"
        )
    if not optimizers:
        raise ValueError(
            f"{_OPTIMIZERS_RULE}; an empty list would watch nothing. "
            "Received: optimizers=[]"
        )
    wrong = [
        item for item in optimizers
        if not isinstance(item, (str, loss_scale_module.LossScaleOptimizer))
    ]
    if wrong:
        raise TypeError(
            f"{_OPTIMIZERS_RULE}; another optimizer does not scale the loss, so "
            f"it never skips a step. Received: optimizers={list(optimizers)!r}, "
            f"with {wrong!r} neither"
        )
    repeated = [item for i, item in enumerate(optimizers) if item in optimizers[:i]]
    if repeated:
        raise ValueError(
            f"{_OPTIMIZERS_RULE}, each at most once. Received: "
            f"optimizers={list(optimizers)!r}, repeating {repeated!r}"
        )
    return tuple(optimizers)


def _resolve_optimizers(model, selection):
    """The optimizers a monitor watches, by name (their model attribute name).

    Args:
        model: The `keras.Model` being trained.
        selection: `None` (every `kmp.LossScaleOptimizer` of the model) or
            the checked `optimizers` argument.

    Raises:
        ValueError: if a name in `selection` is not an attribute of the
            model holding a `kmp.LossScaleOptimizer`.
    """
    if selection is None:
        return scaling_optimizers(model)
    by_attribute = optimizers_by_attribute(model)
    found = {}
    for item in selection:
        if not isinstance(item, str):
            name = next((n for n, o in by_attribute.items() if o is item), None)
            if name is None:
                # Not held by the model: its own name, made unique.
                name, number = item.name, 1
                while name in found or name in by_attribute:
                    name, number = f"{item.name}_{number}", number + 1
            found[name] = item
            continue
        optimizer = by_attribute.get(item)
        if not isinstance(optimizer, loss_scale_module.LossScaleOptimizer):
            what = (
                "the model has no optimizer attribute of that name"
                if optimizer is None
                else f"it is a {type(optimizer).__name__}, which does not scale the loss"
            )
            raise ValueError(
                f"LossScaleMonitor cannot watch {item!r}: {what}. The model's "
                f"kmp.LossScaleOptimizer attributes: {sorted(scaling_optimizers(model))}. "
                f"Received: optimizers={list(selection)!r}"
            )
        found[item] = optimizer
    return found


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
        counters, nonfinite_gradients = loss_scale_module.monitor_state(optimizer)
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


class _Watched:
    """One optimizer a monitor watches in one fit: its ledger, CSV and the
    steps read but not processed yet.

    Args:
        name: String. The optimizer's attribute name on the model.
        optimizer: The `kmp.LossScaleOptimizer`, built or not (an optimizer
            is built by its first step).
        csv_path: Optional string. Its CSV.
        lazy_csv: Bool. Create the CSV at its first row, not now: of several
            optimizers, one that takes no step leaves no file.
    """

    def __init__(self, name, optimizer, csv_path, lazy_csv):
        self.name = name
        self.optimizer = optimizer
        self.loss_log = _loss_log(name)
        # Zeros for an optimizer not built yet: it has taken no step.
        self.ledger = Ledger(_read_counters(optimizer).tolist(), float(optimizer.loss_scale))
        self._first_step = self.ledger.step
        self.csv = _StepCsv(csv_path, lazy=lazy_csv)
        self.pending_steps = []

    @property
    def stepped(self):
        """Whether the processed steps include one of this fit."""
        return self.ledger.step > self._first_step

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


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleMonitor(keras.callbacks.Callback):
    """Reports, explains and records every step that loss scaling skipped.

    Add it to `fit` on a `kmp.Model` trained with loss scaling (a
    `kmp.LossScaleOptimizer`). With any other optimizer there is nothing to
    monitor and it does nothing.

    It watches every `kmp.LossScaleOptimizer` the model holds as an attribute
    (`model.optimizer`, and a GAN's `d_optimizer` and `g_optimizer` that its
    own `compile` sets), or those given as `optimizers`, each with its own
    counts. With several, each line, warning and stop message starts with the
    optimizer's attribute name (`d_optimizer: epoch 1: 3 of 40 steps
    skipped ...`), the CSV and the plot are one file per optimizer (`steps.csv`
    becomes `steps.d_optimizer.csv`), and one that takes no step in a fit
    (the default optimizer a custom `compile` makes and never uses) is left
    out of all of them. Training stops when any of them reaches
    `max_consecutive_skips`; `stopped_optimizer` says which.

    After every step it reads values the train step already returns with
    its logs (no extra device round trip), and:

    ```
    after each step (or execution):
        keep its counters, loss and loss scale
        if consecutive_skips >= max_consecutive_skips:
            model.stop_training = True   # and say at which step, and why
    every 256 steps and at the end of each epoch, for each step kept:
        skipped = skipped_steps - skipped_steps_before          # 0 or 1
        forward = forward_overflows - forward_overflows_before  # loss not finite
        backward = skipped - forward                            # gradients not finite
        write a CSV row (step, loss, loss_scale, skipped, reason, variables)
    at the end of each epoch:
        flush the CSV
        print "epoch 3: 12 of 500 steps skipped (2.4%: 12 backward, 0 forward),
               loss scale 32768 -> 65536 (min 16384, max 65536)"
        if skipped / steps > warn_skip_rate: warn, with likely causes
        (both once the progress bar has finished its line: when the next
        epoch starts or training ends)
    at the end of training: write the plot
    ```

    A *forward* overflow is a step whose unscaled loss was already inf or NaN:
    the data or the model is broken, and lowering the scale cannot help. A
    *backward* overflow is a step whose loss was finite but whose gradients
    were not: the scale was too high for them, which dynamic scaling handles
    by backing off. For backward overflows the monitor names the first
    variables (in the optimizer's order) whose gradients were not finite:
    the optimizer finds them on the device, with one `isfinite` reduction per
    gradient, and only on skipped steps.

    Cost: only while a monitor is attached does the train step record which
    variables overflowed and return the monitor's values (attaching or
    removing one retraces the step once); without one, a step does the
    scaling and nothing more. With it, about 20 microseconds of Python per
    step, plus what any Keras callback with a per-batch hook costs: `fit`
    waits for each step's (or execution's) logs instead of dispatching
    callbacks in a background thread. On an accelerator, `steps_per_execution > 1` amortizes that wait.
    The monitor reads the optimizer's counters once per step instead (they
    stay exact) under a `tf.distribute` strategy with several replicas, with
    a custom `train_step`, and for any optimizer other than `model.optimizer`.
    The CSV's `loss` then comes from the step's logs: `d_loss` for an
    optimizer named `d_optimizer` when the logs have it, else `loss` (the
    epoch's running mean, for Keras' own step).

    With `steps_per_execution > 1` Keras calls callbacks once per execution.
    The counts, the reasons and the stop step stay exact (they are counted on
    the device), but the CSV and the plot then have one row per execution:
    `step` is its last step, `loss` and `loss_scale` are that step's, and
    `skipped` is how many of its steps were skipped. Training can only stop
    at the end of an execution; the message names the step at which the
    limit was reached.

    Args:
        max_consecutive_skips: Optional int >= 1. Stop training once this many
            consecutive steps were skipped. Defaults to `None` (never stop).
        warn_skip_rate: Optional float in [0, 1]. Warn (Python `warnings`,
            once per epoch) when an epoch skipped a larger share of its steps.
            `None` turns the warning off. Defaults to `0.05`.
        csv_path: Optional path. Where to write one row per step: `step`
            (counting applied and skipped steps over the optimizer's life),
            `loss` (the step's loss, not the epoch average), `loss_scale` (after
            the step), `skipped` (0/1), `reason` (`""`, `"forward"`,
            `"backward"`), `nonfinite_variables`. The file is rewritten at the
            start of each fit and flushed at the end of each epoch, so a run
            that crashes keeps its completed epochs. Defaults to `None`.
        plot_path: Optional path. Where to write, at the end of training, a
            PNG with the loss scale on a log2 axis (skipped steps marked) and
            the loss below it. Needs matplotlib (`pip install kmp[plot]`);
            without it the monitor warns how to get it and carries on.
            Defaults to `None`.
        verbose: Int. 0 is silent (warnings still show); 1 prints one line
            per epoch and the reason training was stopped. Defaults to `1`.
        optimizers: Optional list of the model's attribute names (str, e.g.
            `["g_optimizer"]`) or of `kmp.LossScaleOptimizer` instances: the
            optimizers to watch. Names are looked up when training starts.
            Only names can be serialized: `get_config` raises for instances.
            Defaults to `None`: every `kmp.LossScaleOptimizer` of the model.

    Attributes:
        stopped_step: The step (of `stopped_optimizer`) at which
            `max_consecutive_skips` was reached, or `None`.
        stopped_optimizer: The attribute name of the optimizer that reached
            it, or `None`.
        stop_message: Why training was stopped, or `None`.
        epoch_summaries: List of dicts, one per epoch and watched optimizer
            (in the order of their attributes): `optimizer` (its attribute
            name), `epoch`, `steps`, `skipped`, `forward`, `backward`,
            `start_scale`, `end_scale`, `min_scale`, `max_scale`,
            `nonfinite_variables`.

    Raises:
        ValueError: if `max_consecutive_skips`, `warn_skip_rate` or `verbose`
            breaks its rule, or `optimizers` is empty or repeats one; when
            training starts, if a name in `optimizers` is not an attribute of
            the model holding a `kmp.LossScaleOptimizer`.
        TypeError: if `csv_path` or `plot_path` is not a path, or
            `optimizers` is not a list of names and `kmp.LossScaleOptimizer`s.

    Example:

    ```python
    kmp.set_policy("mixed_float16")
    model = kmp.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    monitor = kmp.callbacks.LossScaleMonitor(
        max_consecutive_skips=50, csv_path="steps.csv", plot_path="scale.png"
    )
    model.fit(x, y, epochs=5, callbacks=[monitor])
    # epoch 1: 9 of 500 steps skipped (1.8%: 9 backward, 0 forward), loss
    # scale 32768 -> 64 (min 64, max 32768)

    # A GAN whose compile sets d_optimizer and g_optimizer: watch only one.
    gan.fit(x, epochs=5, callbacks=[
        kmp.callbacks.LossScaleMonitor(optimizers=["g_optimizer"])
    ])
    ```
    """

    def __init__(
        self,
        max_consecutive_skips=None,
        warn_skip_rate=0.05,
        csv_path=None,
        plot_path=None,
        verbose=1,
        optimizers=None,
    ):
        super().__init__()
        _check_monitor_arguments(
            max_consecutive_skips, warn_skip_rate, csv_path, plot_path, verbose
        )
        self.max_consecutive_skips = (
            None if max_consecutive_skips is None else int(max_consecutive_skips)
        )
        self.warn_skip_rate = None if warn_skip_rate is None else float(warn_skip_rate)
        self.csv_path = None if csv_path is None else os.fspath(csv_path)
        self.plot_path = None if plot_path is None else os.fspath(plot_path)
        self.verbose = int(verbose)
        self.optimizers = _check_optimizers(optimizers)
        self._watched = []
        self._forget_last_fit()

    def _forget_last_fit(self):
        for watched in self._watched:
            watched.csv.close()  # left open by a fit that raised
        self.stopped_step = None
        self.stopped_optimizer = None
        self.stop_message = None
        self._watched = []  # One `_Watched` per optimizer, for one fit.
        self._summaries = []
        self._pending = messages.Pending()

    def get_config(self):
        config = {
            "max_consecutive_skips": self.max_consecutive_skips,
            "warn_skip_rate": self.warn_skip_rate,
            "csv_path": self.csv_path,
            "plot_path": self.plot_path,
            "verbose": self.verbose,
        }
        if self.optimizers is None:
            # Left out: a config saved before `optimizers` existed reads the same.
            return config
        if not all(isinstance(item, str) for item in self.optimizers):
            raise ValueError(
                "A LossScaleMonitor given optimizer instances cannot be "
                "serialized: an optimizer is state, not config. Give the "
                "model's attribute names instead (optimizers=['g_optimizer']), "
                f"or None for all of them. Received: optimizers={list(self.optimizers)!r}"
            )
        return dict(config, optimizers=list(self.optimizers))

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    @property
    def epoch_summaries(self):
        """List of dicts, one per epoch (and optimizer) of the last fit (see
        `Attributes:`)."""
        return list(self._summaries)

    def _say(self, watched, text):
        """`text` about `watched`, named when the monitor watches several."""
        if len(self._watched) > 1:
            return messages.for_optimizer(watched.name, text)
        return text

    def _reported(self, watched):
        # Of several, one that took no step (the optimizer a GAN's `compile`
        # makes and its train_step never uses) would only add noise.
        return len(self._watched) == 1 or watched.stepped

    def on_train_begin(self, logs=None):
        self._forget_last_fit()
        found = _resolve_optimizers(self.model, self.optimizers)
        if not found:
            if self.verbose:
                _keras_internals.print_msg(
                    messages.nothing_to_monitor(self.model.dtype_policy.compute_dtype)
                )
            return
        # kmp.Model.fit has done this already for the model's attributes; for
        # a plain keras.Model, or instances it does not hold, it retraces the
        # step Keras built.
        _watch_optimizer(self.model, True, list(found.values()))
        several = len(found) > 1
        self._watched = [
            _Watched(name, optimizer, _path_for(self.csv_path, name if several else None),
                     lazy_csv=several)
            for name, optimizer in found.items()
        ]

    def on_epoch_begin(self, epoch, logs=None):
        # Said once the progress bar (the last callback) has ended its line.
        self._pending.flush()
        for watched in self._watched:
            watched.ledger.begin_epoch(epoch + 1)
            watched.retries_at_epoch_start = _retries(watched.optimizer)

    def on_train_batch_end(self, batch, logs=None):
        # Right after a step, Python competes with the framework's worker
        # threads and runs several times slower: do only the stop check now
        # and process the steps in batches.
        limit = self.max_consecutive_skips
        reached = None
        for watched in self._watched:
            if not watched.optimizer.built:
                continue  # no step yet: an optimizer is built by its first
            consecutive = watched.read_step(self.model, logs or {})
            if (
                limit is not None and reached is None and self.stopped_step is None
                and consecutive >= limit
            ):
                reached = watched
            elif len(watched.pending_steps) >= _PROCESS_EVERY:
                watched.process_pending_steps()
        if reached is not None:
            reached.process_pending_steps()
            self._stop(limit, reached)

    def _stop(self, limit, watched):
        ledger = watched.ledger
        self.stopped_step = ledger.step_reaching(limit)
        self.stopped_optimizer = watched.name
        forward = ledger.consecutive_forward >= limit
        self.stop_message = self._say(watched, messages.stop_message(
            self.stopped_step, ledger.step, limit, forward, ledger.last_names, ledger.scale
        ))
        self.model.stop_training = True
        if self.verbose:
            self._pending.add_line(self.stop_message)

    def on_epoch_end(self, epoch, logs=None):
        for watched in self._watched:
            watched.process_pending_steps()
            watched.csv.flush()
            summary = watched.ledger.end_epoch()
            # Batches redone at a lower scale (`compile(overflow_retries=...)`).
            summary = dict(summary, retried=_retries(watched.optimizer) - getattr(
                watched, "retries_at_epoch_start", 0))
            if not self._reported(watched):
                continue
            self._summaries.append(dict(summary, optimizer=watched.name))
            if self.verbose:
                self._pending.add_line(self._say(watched, messages.epoch_line(summary)))
            # An epoch without steps has a rate of 0: never above the limit.
            if (
                self.warn_skip_rate is not None
                and messages.skip_rate(summary) > self.warn_skip_rate
            ):
                self._pending.add_warning(self._say(
                    watched, messages.skip_rate_warning(summary, self.warn_skip_rate)
                ))

    def on_train_end(self, logs=None):
        several = len(self._watched) > 1
        for watched in self._watched:
            watched.process_pending_steps()
            watched.csv.close()
            if self.plot_path is not None and self._reported(watched):
                path = _path_for(self.plot_path, watched.name if several else None)
                write_plot(path, watched.ledger.history)
        self._pending.flush()


class _StepCsv:
    """The monitor's per-step CSV: rewritten at each fit, flushed each epoch.

    With `path=None` every method does nothing, so the monitor never checks
    whether it writes a CSV. With `lazy=True` the file is created at the
    first row instead of now.
    """

    def __init__(self, path, lazy=False):
        self._path = path
        self._file = None
        if path is not None and not lazy:
            self._open()

    def _open(self):
        directory = os.path.dirname(self._path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file = open(self._path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_COLUMNS)
        self._file.flush()

    def write(self, row):
        """Writes one `kmp._ledger.Step` (nothing for `None`: no step taken)."""
        if self._path is None or row is None:
            return
        if self._file is None:
            self._open()
        self._writer.writerow((
            row.step, row.loss, _csv_number(row.loss_scale), row.skipped, row.reason,
            messages.shorten_names(row.nonfinite_variables, separator=";"),
        ))

    def flush(self):
        if self._file is not None:
            self._file.flush()

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        self._path = None  # a closed CSV stays closed
