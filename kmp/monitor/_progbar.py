"""kmp's progress bar: Keras' own, with the loss scalers' logs readable.

`kmp.Model.fit` puts `_ProgbarLogger` in place of Keras' default progress bar
(see `kmp.callbacks._with_readable_progbar`).
"""

import numbers

import keras

from kmp import _keras_internals
from kmp._format import format_scale
from kmp.monitor import _messages as messages
from kmp.scaling._optimizers import read_counters
from kmp.scaling._optimizers import scaling_optimizers


# The logs kmp adds to `fit`'s: each is a current value, not a per-step
# quantity, so the progress bar shows it as it is, never averaged.
_SCALING_LOGS = ("loss_scale", "skipped_steps")
_COUNT_LOGS = ("skipped_steps", "retried_steps")


class _Readable(float):
    """A float that the progress bar prints as `text`.

    `keras.utils.Progbar` divides each value by its count and formats it with
    `.4f`/`.4e`; keeping the subclass through the division lets the loss scale
    print as `32768` and the skip count as `0` while staying a number.
    Keras 3.10 and 3.11 pass every value through NumPy before formatting it,
    which drops the subclass: there they print as `32768.0000` and `0.0000`,
    the same numbers in Keras' own format.
    """

    def __new__(cls, value, text):
        number = super().__new__(cls, value)
        number.text = text
        return number

    def __truediv__(self, other):
        return _Readable(float(self) / other, self.text)

    def __format__(self, spec):
        return self.text


def _scaling_log_kind(key):
    """`"loss_scale"` or a count's name when `key` is one of kmp's scaler logs
    (`loss_scale`, `d_optimizer_loss_scale`, `skipped_steps`, ...), else `None`."""
    for kind in ("loss_scale",) + _COUNT_LOGS:
        if key == kind or key.endswith("_" + kind):
            return kind
    return None


# `Float8Monitor`'s figures (`float8/<layer>/<tensor>/<figure>`): nine per
# float8 layer, for History, CSVLogger and TensorBoard; the bar leaves them out.
_FLOAT8_LOGS = "float8/"


def _readable_logs(logs):
    """A copy of `logs` with kmp's scaler logs in readable form (`32768`, `3`),
    without `Float8Monitor`'s figures."""
    if not logs:
        return logs
    readable = {key: value for key, value in logs.items() if not key.startswith(_FLOAT8_LOGS)}
    for key, value in list(readable.items()):
        kind = _scaling_log_kind(key)
        if kind is None or not isinstance(value, numbers.Real):
            continue
        text = format_scale(value) if kind == "loss_scale" else str(int(value))
        readable[key] = _Readable(value, text)
    return readable


class _ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, with the loss scale and skip count readable.

    `kmp.Model.fit` uses it in place of Keras' default one. Unless a
    `LossScaleMonitor` reports skips already (`report_skips=False`), it
    prints one line at the end of fit when any step of that fit was skipped;
    when the model holds several scaling optimizers, the line gives each
    one that took steps by its attribute name.
    """

    # Like Keras' own progress bar, it may run in Keras' callback thread.
    async_safe = True

    def __init__(self, report_skips=True):
        super().__init__()
        self.report_skips = report_skips
        self._counters_at_start = {}

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._counters_at_start = {}
        if self.report_skips:
            # An optimizer not built yet has taken no step: its zeros are
            # right even if the first step builds it.
            self._counters_at_start = {
                name: (optimizer, read_counters(optimizer))
                for name, optimizer in scaling_optimizers(self.model).items()
            }

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        # Before Keras 3.15 the progress bar averages every log over the
        # epoch's steps unless it is one of its `stateful_metrics`: a scale
        # that halved mid-epoch would print as the mean of two scales, and the
        # skip count as a fraction. From 3.15 on no log is averaged, and
        # `stateful_metrics` is None.
        stateful = getattr(self.progbar, "stateful_metrics", None)
        if stateful is not None:
            stateful.update(_SCALING_LOGS)

    def on_train_batch_end(self, batch, logs=None):
        # Also a GAN's `d_optimizer_loss_scale`, ..., known only from the logs.
        stateful = getattr(self.progbar, "stateful_metrics", None)
        if stateful is not None and logs:
            stateful.update(key for key in logs if _scaling_log_kind(key))
        super().on_train_batch_end(batch, _readable_logs(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, _readable_logs(logs))

    def on_train_end(self, logs=None):
        if not self.verbose:
            return
        counts = []
        for name, (optimizer, at_start) in self._counters_at_start.items():
            steps, skipped = (read_counters(optimizer) - at_start)[:2]
            scale = optimizer.loss_scale if optimizer.scaling else None
            counts.append((name, int(skipped), int(steps), scale))
        if not any(skipped > 0 for _, skipped, _, _ in counts):
            return
        spikes = any(optimizer.skip_spikes is not None
                     for optimizer, _ in self._counters_at_start.values())
        if len(counts) == 1:
            _, skipped, steps, scale = counts[0]
            _keras_internals.print_msg(messages.skipped_in_fit(skipped, steps, scale, spikes))
        else:
            # Only those that took steps: a GAN's compile makes a default
            # optimizer that its train_step never uses.
            used = [count for count in counts if count[2] > 0]
            _keras_internals.print_msg(messages.skipped_in_fit_by_optimizer(used, spikes))
