"""`kmp.float8.Float8Monitor`: what float8 does to each float8 layer, every epoch.

It reads `kmp.float8.stats` (`kmp/precision/_float8_measure.py`) at the end
of each epoch, the inputs and output gradients through a probe it keeps
for the fit (a tapped copy of the model, `kmp/precision/_float8_probe.py`),
and keeps, logs, writes, says and plots what it read.
"""

import os

import keras
import numpy as np

from kmp.backup import _atomic_files
from kmp.monitor._arguments import check_path
from kmp.monitor._plot import matplotlib_figure
from kmp.monitor._plot import save_figure
from kmp.precision._float8_formats import TENSORS
from kmp.precision._float8_measure import measure
from kmp.precision._float8_measure import probe_for

# Float8Monitor reports a tensor whose amax is more than this many times its
# scale's range: at least its top binade was clipped.
_RANGE_WARNING = 2.0
# The figures it adds to `fit`'s logs, per layer and tensor.
LOGGED_FIGURES = ("amax", "saturated", "flushed")


def log_key(layer, tensor, figure):
    """The name of a figure in `fit`'s logs: `float8/up/outputs_grad/saturated`."""
    return f"float8/{layer}/{tensor}/{figure}"


@keras.saving.register_keras_serializable(package="kmp")
class Float8Monitor(keras.callbacks.Callback):
    """Reports what float8 does to each float8 layer, every epoch.

    At the end of each epoch it reads `kmp.float8.stats(model, x, y)` for
    each float8 layer and each tensor it quantizes (`inputs`, `kernel`,
    `outputs_grad`): the amax, the scale, and the shares of values
    saturated at the format's maximum and flushed to zero. Nothing is added
    to the train step: the amax histories and scales are Keras' own
    variables, and the shares are measured in a copy of the model, on `x`
    (the inputs, by a forward pass) and on `(x, y)` (the output gradients,
    by a probe step), for float8 layers at any depth: see
    `kmp.float8.stats`. Then:

    ```
    at the end of each epoch:
        figures = kmp.float8.stats(model, x, y)
        history.append((epoch, figures))
        logs["float8/<layer>/<tensor>/amax" | ".../saturated" | ".../flushed"]
            = the figure (where measured): History, CSVLogger and
              TensorBoard callbacks placed after the monitor see them
        write one CSV row per layer and tensor to csv_path
        say (print_fn) each tensor with saturated or flushed > warn_share,
            or whose amax exceeded its scale's range more than 2x, and
            each layer whose kernel amax is 0 after training steps (it ran
            without training=True: its scales do not move)
    at the end of training: plot the figures per epoch to plot_path
    ```

    Args:
        x: Optional batch of inputs on which to measure each float8 layer's
            inputs. Defaults to `None`: the inputs' amax and range only.
        y: Optional targets of `x`: with them, the output gradients'
            saturated and flushed shares are measured too, by a probe step
            at the current loss scale. Give a batch of the training batch
            size (the loss averages over the batch). Defaults to `None`: the
            output gradients' amax and range only.
        csv_path: Optional path of a CSV file, one row per epoch, layer and
            tensor: `epoch, layer, tensor, amax, scale, range_used,
            saturated, flushed`. Defaults to `None`.
        plot_path: Optional path of a PNG written at the end of training:
            one row per tensor, the amax per layer and epoch (log axis) on
            the left, the saturated (solid) and flushed (dashed) shares on
            the right. Needs matplotlib (`pip install -e ".[plot]"`);
            without it the monitor warns and carries on. Defaults to `None`.
        warn_share: Float in [0, 1]. The share of saturated or flushed
            values above which a tensor is reported. Defaults to `0.01`.
        print_fn: Optional callable taking one string. Defaults to `print`.

    Attributes:
        history: List of `(epoch, stats)` pairs, `stats` as
            `kmp.float8.stats` returns it.

    Raises:
        ValueError: if `warn_share` is not in [0, 1], or `y` is given
            without `x`.
        TypeError: if `csv_path` or `plot_path` is not a path.

    Example:

    ```python
    monitor = kmp.float8.Float8Monitor(
        x=x_train[:64], y=y_train[:64], csv_path="float8.csv", plot_path="float8.png")
    history = model.fit(x_train, y_train, batch_size=64, epochs=3, callbacks=[monitor])
    history.history["float8/dense/outputs_grad/flushed"]   # one share per epoch
    monitor.history[-1][1]["dense"]["outputs_grad"]["range_used"]
    ```
    """

    CSV_COLUMNS = (
        "epoch", "layer", "tensor", "amax", "scale", "range_used", "saturated", "flushed"
    )

    def __init__(self, x=None, y=None, csv_path=None, plot_path=None, warn_share=0.01,
                 print_fn=None):
        super().__init__()
        if isinstance(warn_share, bool) or not isinstance(warn_share, (int, float)) or not (
            0.0 <= warn_share <= 1.0
        ):
            raise ValueError(
                f"`warn_share` must be a number in [0, 1]. Received: warn_share={warn_share!r}"
            )
        if y is not None and x is None:
            raise ValueError(
                "Float8Monitor measures the output gradients on a batch `(x, y)`: "
                "`y` needs `x`. Received: x=None and y given"
            )
        check_path("csv_path", csv_path)
        check_path("plot_path", plot_path)
        self.x = x
        self.y = y
        self.csv_path = None if csv_path is None else os.fspath(csv_path)
        self.plot_path = None if plot_path is None else os.fspath(plot_path)
        self.warn_share = float(warn_share)
        self.print_fn = print_fn or print
        self.history = []
        self._probe = None
        self._csv = None

    def get_config(self):
        """The constructor's arguments but `x`, `y` and `print_fn` (data and
        a callable: not configuration)."""
        return {"csv_path": self.csv_path, "plot_path": self.plot_path,
                "warn_share": self.warn_share}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def on_train_begin(self, logs=None):
        self.history = []
        # One probe per fit: its copy of the model is made at the first epoch's end.
        self._probe = probe_for(self.model, self.x, self.y)
        self._close_csv()
        if self.csv_path is not None:
            # A new file replaces whatever is at the path (a link planted
            # there is not written through); kept open for the epochs' rows.
            self._csv = _atomic_files.open_replacing(self.csv_path, encoding="utf-8")
            self._csv.write(",".join(self.CSV_COLUMNS) + "\n")
            self._csv.flush()

    def _close_csv(self):
        if self._csv is not None:
            self._csv.close()
        self._csv = None

    def on_epoch_end(self, epoch, logs=None):
        figures = measure(self.model, self.x, self.y, self._probe)
        self.history.append((epoch, figures))
        if logs is not None:
            for layer, tensors in figures.items():
                for tensor, values in tensors.items():
                    for figure in LOGGED_FIGURES:
                        if values[figure] is not None:
                            logs[log_key(layer, tensor, figure)] = values[figure]
        lines = []
        steps = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        for layer, tensors in figures.items():
            kernel = tensors["kernel"]
            if steps and kernel["amax"] == 0.0:
                lines.append(
                    f"  {layer}: recorded no amax in training (its kernel's is 0 after "
                    f"{steps} steps, its scale {kernel['scale']:.4g}): it ran without "
                    "`training=True`, so its inputs' and kernel's scales do not follow "
                    "them. Pass `training=training` to it (or to the layer holding it) "
                    "in the model's `call`."
                )
            for tensor, values in tensors.items():
                problems = [
                    f"{values[key]:.1%} {key}"
                    for key in ("saturated", "flushed")
                    if values[key] is not None and values[key] > self.warn_share
                ]
                if values["range_used"] > _RANGE_WARNING:
                    problems.append(
                        f"amax {values['amax']:.4g} is {values['range_used']:.1f}x "
                        "the scale's range (a binade or more saturated)"
                    )
                if problems:
                    lines.append(f"  {layer} {tensor}: {', '.join(problems)}")
        if lines:
            self.print_fn(f"Float8Monitor, epoch {epoch + 1}:\n" + "\n".join(lines))
        if self._csv is not None:
            for layer, tensors in figures.items():
                for tensor, values in tensors.items():
                    cells = [str(epoch + 1), layer, tensor] + [
                        "" if values[key] is None else repr(values[key])
                        for key in self.CSV_COLUMNS[3:]
                    ]
                    self._csv.write(",".join(cells) + "\n")
            self._csv.flush()

    def on_train_end(self, logs=None):
        self._probe = None  # its copy of the model: not kept past the fit
        self._close_csv()
        if self.plot_path is not None and self.history:
            write_plot(self.plot_path, self.history)


def write_plot(path, history):
    """Writes `Float8Monitor`'s plot of `history` (its `(epoch, stats)`
    pairs) to `path`; warns instead when matplotlib is missing."""
    Figure = matplotlib_figure("Float8Monitor", path)
    if Figure is None:
        return
    epochs = np.array([epoch + 1 for epoch, _ in history], dtype=np.float64)
    layers = list(history[-1][1])
    figure = Figure(figsize=(10, 3 * len(TENSORS)), dpi=100)
    axes = figure.subplots(len(TENSORS), 2, sharex=True, squeeze=False)
    for row, (tensor, fmt, _, _) in enumerate(TENSORS):
        amax_axis, share_axis = axes[row]
        for index, layer in enumerate(layers):
            color = f"C{index % 10}"
            series = {
                figure_name: np.array([
                    np.nan if stats.get(layer, {}).get(tensor, {}).get(figure_name) is None
                    else stats[layer][tensor][figure_name]
                    for _, stats in history
                ], dtype=np.float64)
                for figure_name in ("amax", "saturated", "flushed")
            }
            amax_axis.plot(epochs, series["amax"], marker="o", color=color, label=layer)
            share_axis.plot(epochs, series["saturated"], marker="o", color=color,
                            label=f"{layer} saturated")
            share_axis.plot(epochs, series["flushed"], marker="x", linestyle="--",
                            color=color, label=f"{layer} flushed")
        if np.any([stats[layer][tensor]["amax"] > 0 for _, stats in history for layer in stats]):
            amax_axis.set_yscale("log")
        amax_axis.set_ylabel(f"{tensor} ({fmt})\namax")
        share_axis.set_ylabel("share of values")
        share_axis.set_ylim(bottom=0.0)
        for axis in (amax_axis, share_axis):
            axis.grid(True, alpha=0.3)
        if row == 0:
            amax_axis.set_title("amax recorded by the last step")
            share_axis.set_title("saturated (solid), flushed to zero (dashed)")
            amax_axis.legend(loc="best", fontsize="small")
    for axis in axes[-1]:
        axis.set_xlabel("epoch")
        axis.set_xticks(epochs)
    save_figure(figure, path)
