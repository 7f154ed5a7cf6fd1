"""`kmp.float8.Float8Monitor`: what float8 does to each float8 layer, every epoch.

It reads `kmp.float8.stats` (`kmp/precision/_float8_measure.py`) at the end
of each epoch and keeps, writes and says what it read.
"""

import keras

from kmp.precision._float8_measure import stats

# Float8Monitor reports a tensor whose amax is more than this many times its
# scale's range: at least its top binade was clipped.
_RANGE_WARNING = 2.0


@keras.saving.register_keras_serializable(package="kmp")
class Float8Monitor(keras.callbacks.Callback):
    """Reports what float8 does to each float8 layer, every epoch.

    At the end of each epoch it reads `kmp.float8.stats(model, x)` (no work
    in the train step: the amax histories are Keras' own variables), keeps
    the figures in `history`, writes them to `csv_path` and, for each
    tensor that saturated or flushed more than `warn_share` of its values
    (or whose recorded amax exceeded its scale's range), says so once per
    epoch through `print_fn`.

    Args:
        x: Optional batch of inputs on which to measure each float8 layer's
            inputs (a functional model). Defaults to `None`: the inputs'
            amax and range only.
        csv_path: Optional path of a CSV file, one row per epoch, layer and
            tensor: `epoch, layer, tensor, amax, scale, range_used,
            saturated, flushed`. Defaults to `None`.
        warn_share: Float in [0, 1]. The share of saturated or flushed
            values above which a tensor is reported. Defaults to `0.01`.
        print_fn: Optional callable taking one string. Defaults to `print`.

    Attributes:
        history: List of `(epoch, stats)` pairs, `stats` as
            `kmp.float8.stats` returns it.

    Raises:
        ValueError: if `warn_share` is not in [0, 1].

    Example:

    ```python
    monitor = kmp.float8.Float8Monitor(x=x_train[:256], csv_path="float8.csv")
    model.fit(x_train, y_train, epochs=3, callbacks=[monitor])
    monitor.history[-1][1]["dense"]["outputs_grad"]["range_used"]
    ```
    """

    CSV_COLUMNS = (
        "epoch", "layer", "tensor", "amax", "scale", "range_used", "saturated", "flushed"
    )

    def __init__(self, x=None, csv_path=None, warn_share=0.01, print_fn=None):
        super().__init__()
        if isinstance(warn_share, bool) or not isinstance(warn_share, (int, float)) or not (
            0.0 <= warn_share <= 1.0
        ):
            raise ValueError(
                f"`warn_share` must be a number in [0, 1]. Received: warn_share={warn_share!r}"
            )
        self.x = x
        self.csv_path = csv_path
        self.warn_share = float(warn_share)
        self.print_fn = print_fn or print
        self.history = []

    def get_config(self):
        """The constructor's arguments but `x` and `print_fn` (data and a
        callable: not configuration)."""
        return {"csv_path": self.csv_path, "warn_share": self.warn_share}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def on_train_begin(self, logs=None):
        self.history = []
        if self.csv_path is not None:
            with open(self.csv_path, "w", encoding="utf-8") as file:
                file.write(",".join(self.CSV_COLUMNS) + "\n")

    def on_epoch_end(self, epoch, logs=None):
        figures = stats(self.model, self.x)
        self.history.append((epoch, figures))
        lines = []
        for layer, tensors in figures.items():
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
        if self.csv_path is not None:
            with open(self.csv_path, "a", encoding="utf-8") as file:
                for layer, tensors in figures.items():
                    for tensor, values in tensors.items():
                        cells = [str(epoch + 1), layer, tensor] + [
                            "" if values[key] is None else repr(values[key])
                            for key in self.CSV_COLUMNS[3:]
                        ]
                        file.write(",".join(cells) + "\n")
