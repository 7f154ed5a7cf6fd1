"""Callbacks: `LossScaleMonitor`, and crash-safe `BackupAndRestore` and
`ModelCheckpoint` (defined in `kmp.checkpoint`).

`LossScaleMonitor` makes every skipped step visible.

A skipped step is otherwise invisible: the scale halves, the update is
dropped, and nothing is said unless the run diverges. `LossScaleMonitor`
reports each epoch's skips, tells a forward overflow (the loss itself was not
finite) from a backward one (the scale was too high for the gradients), names
the variables whose gradients overflowed, writes a per-step CSV and a plot,
and stops a run that has stopped making progress.

The monitor is the callback: it decides when to read, stop and report.
`kmp/monitor/_arguments.py` checks its arguments and finds the optimizers it
watches, `kmp/monitor/_steps.py` reads each optimizer's steps,
`kmp/monitor/_ledger.py` keeps their numbers, `kmp/monitor/_csv.py` writes them,
`kmp/monitor/_messages.py` words them and `kmp/monitor/_plot.py` draws them.
"""

import os

import keras

from kmp import _keras_internals
from kmp.checkpoint import BackupAndRestore
from kmp.checkpoint import ModelCheckpoint
from kmp.monitor import _arguments as arguments
from kmp.monitor import _messages as messages
from kmp.monitor._arguments import resolve_optimizers as _resolve_optimizers
from kmp.monitor._csv import CSV_COLUMNS  # noqa: F401 (the CSV's header, read here)
from kmp.monitor._progbar import _ProgbarLogger
from kmp.monitor._steps import WatchedOptimizer
from kmp.monitor._steps import check_paths
from kmp.scaling._optimizers import read_counters as _read_counters  # noqa: F401 (tests read it here)
from kmp.scaling._optimizers import scaling_optimizers

__all__ = [
    "BackupAndRestore",
    "LossScaleMonitor",
    "ModelCheckpoint",
]

# Steps the monitor collects before processing them (CSV rows, statistics).
_PROCESS_EVERY = 256


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


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleMonitor(keras.callbacks.Callback):
    """Reports, explains and records every step that loss scaling skipped.

    Add it to `fit` on a `kmp.Model` whose steps can be skipped: under
    every 16-bit policy (a `kmp.LossScaleOptimizer`, which under bfloat16 is
    the guard, a scale fixed at 1), and under float32 compiled with
    `skip_nonfinite=True` or `skip_spikes`. With any other optimizer there
    is nothing to monitor, and it says so.

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
    were not: under float16 the scale was too high for them, which dynamic
    scaling handles by backing off. A *spike* (`compile(skip_spikes=...)`)
    is a step whose finite loss was far above the recent ones. Where nothing
    scales (bfloat16, float32) the lines and messages leave the scale out. For backward overflows the monitor names the first
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
            the step; 1 where nothing scales), `skipped` (0/1), `reason`
            (`""`, `"forward"`, `"backward"`, `"spike"`),
            `nonfinite_variables`. The file is rewritten at the
            start of each fit and flushed at the end of each epoch, so a run
            that crashes keeps its completed epochs. Defaults to `None`.
        plot_path: Optional path. Where to write, at the end of training, a
            PNG with the loss scale on a log2 axis (skipped steps marked) and
            the loss below it. Needs matplotlib (`pip install -e ".[plot]"`);
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
            `spikes`, `start_scale`, `end_scale`, `min_scale`, `max_scale`,
            `nonfinite_variables`, `retried`, `scaling` (whether the
            optimizer scales the loss).

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
        arguments.check_arguments(
            max_consecutive_skips, warn_skip_rate, csv_path, plot_path, verbose
        )
        optimizers = arguments.check_optimizers(optimizers)
        self.max_consecutive_skips = (
            None if max_consecutive_skips is None else int(max_consecutive_skips)
        )
        self.warn_skip_rate = None if warn_skip_rate is None else float(warn_skip_rate)
        self.csv_path = None if csv_path is None else os.fspath(csv_path)
        self.plot_path = None if plot_path is None else os.fspath(plot_path)
        self.verbose = int(verbose)
        self.optimizers = optimizers
        self._watched = []
        self._forget_last_fit()

    def _forget_last_fit(self):
        for watched in self._watched:
            watched.csv.close()  # left open by a fit that raised
        self.stopped_step = None
        self.stopped_optimizer = None
        self.stop_message = None
        self._watched = []  # One `WatchedOptimizer` per optimizer, for one fit.
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
        return dict(config, optimizers=arguments.optimizers_config(self.optimizers))

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    @property
    def epoch_summaries(self):
        """List of dicts, one per epoch (and optimizer) of the last fit (see
        `Attributes:`)."""
        return list(self._summaries)

    def on_train_begin(self, logs=None):
        self._forget_last_fit()
        found = _resolve_optimizers(self.model, self.optimizers)
        if not found:
            if self.verbose:
                _keras_internals.print_msg(
                    messages.nothing_to_monitor(self.model.dtype_policy.compute_dtype)
                )
            return
        check_paths(self.csv_path, self.plot_path, [name if len(found) > 1 else None for name in found])
        # kmp.Model.fit has done this already for the model's attributes; for
        # a plain keras.Model, or instances it does not hold, it retraces the
        # step Keras built.
        _watch_optimizer(self.model, True, list(found.values()))
        self._watched = [
            WatchedOptimizer(name, optimizer, self.csv_path, self.plot_path, len(found) > 1)
            for name, optimizer in found.items()
        ]

    def on_epoch_begin(self, epoch, logs=None):
        # Said once the progress bar (the last callback) has ended its line.
        self._pending.flush()
        for watched in self._watched:
            watched.begin_epoch(epoch + 1)

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
        self.stopped_step, self.stop_message = watched.stop_reason(limit)
        self.stopped_optimizer = watched.name
        self.model.stop_training = True
        if self.verbose:
            self._pending.add_line(self.stop_message)

    def on_epoch_end(self, epoch, logs=None):
        for watched in self._watched:
            summary = watched.end_epoch()
            if not watched.reported:
                continue
            self._summaries.append(dict(summary, optimizer=watched.name))
            if self.verbose:
                self._pending.add_line(watched.say(messages.epoch_line(summary)))
            # An epoch without steps has a rate of 0: never above the limit.
            if (
                self.warn_skip_rate is not None
                and messages.skip_rate(summary) > self.warn_skip_rate
            ):
                self._pending.add_warning(watched.say(
                    messages.skip_rate_warning(summary, self.warn_skip_rate, watched.scale_floor)
                ))

    def on_train_end(self, logs=None):
        for watched in self._watched:
            watched.end_fit()
        self._pending.flush()
