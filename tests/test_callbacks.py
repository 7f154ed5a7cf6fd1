"""Tests for kmp.callbacks: every skipped step seen, counted and explained.

Overflows are real, at known steps. Inputs are batches of 4 rows, fed in
order, and a batch can be poisoned two ways:

- a *backward* overflow: column 0 of the batch is 0, so `_OverflowGate`
  takes `sqrt(0)`; the loss stays finite but its weight's gradient is NaN;
- a *forward* overflow: the batch's labels are inf, so the loss itself is inf.

The gate's weight stays 0 (its gradient is 0 on clean batches), so every
clean step is finite and every poisoned one is skipped.
"""

import csv
import glob
import re
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmp
from kmp import callbacks as kmp_callbacks

BATCH = 4
INITIAL_SCALE = 1024.0


class _OverflowGate(keras.layers.Layer):
    """Adds `sqrt(|trouble| + mean(x[:, 0]))`, with `trouble` = 0."""

    def build(self, input_shape):
        self.trouble = self.add_weight(shape=(), initializer="zeros", name="trouble")

    def call(self, x):
        return x + ops.sqrt(ops.abs(self.trouble) + ops.mean(x[:, :1]))


def _model(steps_per_execution=1, model_class=kmp.Model, optimizer=None):
    inputs = keras.Input((4,))
    hidden = _OverflowGate(name="gate")(inputs)
    outputs = keras.layers.Dense(2, name="head")(hidden)
    model = model_class(inputs, outputs)
    if optimizer is None:
        # A growth interval longer than the run: the scale only backs off,
        # so after n skips it is INITIAL_SCALE / 2**n.
        optimizer = kmp.LossScaleOptimizer(
            "sgd", initial_scale=INITIAL_SCALE, growth_interval=1000
        )
    # Injected overflows are skipped, not redone: the monitor's skip accounting.
    retries = {"overflow_retries": 0} if issubclass(model_class, kmp.Model) else {}
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution,
                  **retries)
    return model


def _data(steps, backward=(), forward=()):
    """`steps` batches; the 1-based steps in `backward`/`forward` overflow."""
    x = np.ones((steps * BATCH, 4), "float32")
    y = np.zeros((steps * BATCH, 2), "float32")
    for step in backward:
        x[(step - 1) * BATCH : step * BATCH, 0] = 0.0
    for step in forward:
        y[(step - 1) * BATCH : step * BATCH] = np.inf
    return x, y


def _fit(model, data, **kwargs):
    x, y = data
    kwargs.setdefault("verbose", 0)
    return model.fit(x, y, batch_size=BATCH, shuffle=False, **kwargs)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _monitor_warnings(record):
    return [str(w.message) for w in record if "LossScaleMonitor" in str(w.message)]


def test_counts_reasons_csv_plot_and_epoch_line(tmp_path, capsys):
    csv_path, plot_path = tmp_path / "steps.csv", tmp_path / "plots" / "scale.png"
    model = _model()
    monitor = kmp.callbacks.LossScaleMonitor(csv_path=csv_path, plot_path=plot_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(model, _data(12, backward=(3, 7), forward=(10,)), callbacks=[monitor])

    rows = _rows(csv_path)
    assert list(rows[0]) == list(kmp_callbacks.CSV_COLUMNS)
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    skipped = {int(r["step"]): r["reason"] for r in rows if r["skipped"] == "1"}
    assert skipped == {3: "backward", 7: "backward", 10: "forward"}
    assert all(r["skipped"] == "0" and r["reason"] == "" for r in rows if int(r["step"]) not in skipped)
    assert [r["nonfinite_variables"] for r in rows if r["reason"] == "backward"] == ["gate/trouble"] * 2
    assert rows[9]["nonfinite_variables"] == ""  # a forward overflow names no variable
    assert float(rows[9]["loss"]) == np.inf and np.isfinite(float(rows[8]["loss"]))
    # The scale after each step, in closed form: halved at each skip.
    expected = [INITIAL_SCALE / 2 ** sum(s <= step for s in skipped) for step in range(1, 13)]
    assert [float(r["loss_scale"]) for r in rows] == expected
    assert rows[0]["loss_scale"] == "1024"  # integers without ".0"

    (summary,) = monitor.epoch_summaries
    assert (summary["steps"], summary["skipped"], summary["backward"], summary["forward"]) == (12, 3, 2, 1)
    assert (summary["start_scale"], summary["end_scale"], summary["min_scale"]) == (1024, 128, 128)
    optimizer = model.optimizer
    assert int(optimizer.skipped_steps) == 3 and int(optimizer._forward_overflows) == 1
    assert int(optimizer.iterations) == 9

    out = capsys.readouterr().out
    assert (
        "epoch 1: 3 of 12 steps skipped (25.0%: 2 backward, 1 forward), "
        "loss scale 1024 -> 128 (min 128, max 1024)"
    ) in out
    (warning,) = _monitor_warnings(record)  # once for the epoch, not per step
    assert "25.0%" in warning and "gate/trouble" in warning
    assert "2 backward overflows" in warning and "1 forward overflow " in warning
    assert "learning rate" in warning and "inf/NaN" in warning
    # At the user's line (here `_fit`'s, in this file), not in Keras'
    # callback_list.py, which called the hook (issue 38).
    assert {w.filename for w in record if "LossScaleMonitor" in str(w.message)} == {__file__}

    from PIL import Image

    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(plot_path) as image:
        image.verify()
    with Image.open(plot_path) as image:
        assert image.format == "PNG" and image.size == (800, 600)


def test_no_warning_below_the_rate_and_no_skips(capsys):
    monitor = kmp.callbacks.LossScaleMonitor(warn_skip_rate=0.5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = _model()
        _fit(model, _data(8, backward=(2,)), callbacks=[monitor])
    assert _monitor_warnings(record) == []
    out = capsys.readouterr().out
    assert "epoch 1: 1 of 8 steps skipped (12.5%: 1 backward, 0 forward), loss scale 1024 -> 512" in out
    _fit(model, _data(8), callbacks=[monitor])
    out = capsys.readouterr().out
    assert "epoch 1: 0 of 8 steps skipped (0.0%), loss scale 512 -> 512 (min 512, max 512)" in out


def test_csv_is_flushed_at_each_epoch_end(tmp_path):
    csv_path = tmp_path / "steps.csv"
    rows_seen = []

    class ReadCsv(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rows_seen.append(len(_rows(csv_path)))

    monitor = kmp.callbacks.LossScaleMonitor(csv_path=csv_path, verbose=0)
    _fit(_model(), _data(5), callbacks=[monitor, ReadCsv()], epochs=2)
    assert rows_seen == [5, 10]
    assert [int(r["step"]) for r in _rows(csv_path)] == list(range(1, 11))


def test_links_at_the_csv_and_plot_paths_are_replaced_not_written_through(tmp_path):
    pytest.importorskip("matplotlib")
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's own data\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("steps.csv", "scale.png"):
        (run / name).symlink_to(precious)
    monitor = kmp.callbacks.LossScaleMonitor(
        csv_path=run / "steps.csv", plot_path=run / "scale.png", verbose=0)
    _fit(_model(), _data(5), callbacks=[monitor])
    assert precious.read_text() == "the user's own data\n"
    assert not (run / "steps.csv").is_symlink() and not (run / "scale.png").is_symlink()
    assert [int(r["step"]) for r in _rows(run / "steps.csv")] == [1, 2, 3, 4, 5]
    assert (run / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in run.iterdir()) == ["scale.png", "steps.csv"]  # no temporaries


@pytest.mark.parametrize("name", ["csv_path", "plot_path"])
def test_a_folder_given_as_a_file_path_is_refused_when_made(tmp_path, name):
    with pytest.raises(ValueError, match=f"`{name}` must be the path of a file to write, but "
                       "it names an existing folder"):
        kmp.callbacks.LossScaleMonitor(**{name: tmp_path})


@pytest.mark.parametrize("name", ["csv_path", "plot_path"])
def test_a_path_under_a_file_is_refused_when_made(tmp_path, name):
    (tmp_path / "notes").write_text("the user's notes")
    path = tmp_path / "notes" / "run" / "out"
    with pytest.raises(ValueError, match=f"`{name}` must be the path of a file to write, but "
                       f"'{tmp_path / 'notes'}', where its folder would be, is not a folder"):
        kmp.callbacks.LossScaleMonitor(**{name: path})
    assert (tmp_path / "notes").read_text() == "the user's notes"


@pytest.mark.parametrize("name", ["csv_path", "plot_path"])
def test_a_folder_made_at_the_path_after_the_monitor_is_refused_before_any_step(tmp_path, name):
    model = _model()
    monitor = kmp.callbacks.LossScaleMonitor(**{name: tmp_path / "out"})
    (tmp_path / "out").mkdir()  # made after the monitor: once found at the first write
    before = [v.numpy() for v in model.weights]
    with pytest.raises(ValueError, match=f"`{name}` must be the path of a file to write, but "
                       "it names an existing folder"):
        _fit(model, _data(4), callbacks=[monitor])
    assert int(model.optimizer.iterations) == 0 and list((tmp_path / "out").iterdir()) == []
    for value, variable in zip(before, model.weights):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_stops_after_consecutive_forward_overflows(capsys):
    model = _model()
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=3, warn_skip_rate=None)
    history = _fit(model, _data(10, forward=range(5, 11)), callbacks=[monitor], epochs=3)
    assert monitor.stopped_step == 7
    assert int(model.optimizer.iterations + model.optimizer.skipped_steps) == 7
    assert len(history.history["loss"]) == 1
    assert "stopping training at step 7" in monitor.stop_message
    assert "loss itself was not finite" in monitor.stop_message
    assert "cannot help" in monitor.stop_message
    assert monitor.stop_message in capsys.readouterr().out


def test_consecutive_count_resets_on_a_finite_step():
    consecutive = []

    class ReadConsecutive(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            consecutive.append(int(kmp_callbacks._read_counters(self.model.optimizer)[3]))

    model = _model()
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=3, verbose=0, warn_skip_rate=None)
    history = _fit(model, _data(8, backward=(2, 3, 5, 6)), callbacks=[monitor, ReadConsecutive()])
    # Two runs of two skips, each ended by a finite step: never 3 in a row.
    assert consecutive == [0, 1, 2, 0, 1, 2, 0, 0]
    assert monitor.stopped_step is None and monitor.stop_message is None
    assert not model.stop_training
    # The monitor saw the whole run: 8 steps, the 4 skips, 4 backoffs.
    (summary,) = monitor.epoch_summaries
    assert (summary["steps"], summary["skipped"], summary["backward"], summary["forward"]) == (8, 4, 4, 0)
    assert (summary["start_scale"], summary["end_scale"]) == (INITIAL_SCALE, INITIAL_SCALE / 2**4)
    assert int(model.optimizer.skipped_steps) == 4 and int(model.optimizer.iterations) == 4
    assert float(model.optimizer.loss_scale) == INITIAL_SCALE / 2**4
    assert history.history["skipped_steps"] == [4]

    # The same run with one more skip in a row (step 4) stops there.
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=3, verbose=0, warn_skip_rate=None)
    _fit(_model(), _data(8, backward=(2, 3, 4, 6)), callbacks=[monitor])
    assert monitor.stopped_step == 4


def test_steps_per_execution_counts_stay_exact(tmp_path):
    csv_path = tmp_path / "steps.csv"
    model = _model(steps_per_execution=4)
    monitor = kmp.callbacks.LossScaleMonitor(csv_path=csv_path, verbose=0, warn_skip_rate=None)
    _fit(model, _data(12, backward=(2, 10), forward=(3,)), callbacks=[monitor])
    rows = [(int(r["step"]), int(r["skipped"]), r["reason"], r["nonfinite_variables"]) for r in _rows(csv_path)]
    assert rows == [
        (4, 2, "forward+backward", "gate/trouble"),
        (8, 0, "", ""),
        (12, 1, "backward", "gate/trouble"),
    ]
    (summary,) = monitor.epoch_summaries
    assert (summary["steps"], summary["backward"], summary["forward"]) == (12, 2, 1)


def test_stop_step_is_exact_with_steps_per_execution():
    model = _model(steps_per_execution=4)
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=5, verbose=0, warn_skip_rate=None)
    _fit(model, _data(16, backward=range(3, 17)), callbacks=[monitor])
    # The 5th consecutive skip is step 7; the execution ends at step 8.
    assert monitor.stopped_step == 7
    assert int(model.optimizer.iterations + model.optimizer.skipped_steps) == 8
    assert "stopping training at step 7" in monitor.stop_message
    assert "after step 8" in monitor.stop_message
    # The words run on into the first variable's name.
    assert "gradients were not finite although the loss was finite (first in " in monitor.stop_message
    assert "gate/trouble" in monitor.stop_message


def test_stop_at_the_scales_floor_says_the_gradients_overflow_unscaled():
    # The scale is at its floor from the start: every backward skip there
    # overflowed float16 unscaled, so a lower learning rate is not the first fix.
    optimizer = kmp.LossScaleOptimizer("sgd", initial_scale=4.0, min_scale=4.0)
    model = _model(optimizer=optimizer)
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=3, verbose=0, warn_skip_rate=None)
    _fit(model, _data(6, backward=range(1, 7)), callbacks=[monitor])
    assert monitor.stopped_step == 3
    message = monitor.stop_message
    assert "the loss scale is down to 4, its min_scale: the gradients overflow float16" in message
    assert "min_scale=2**-8" in message and "gate/trouble" in message
    # Above the floor, the message is the diverging weights' one.
    model = _model()
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=3, verbose=0, warn_skip_rate=None)
    _fit(model, _data(6, backward=range(1, 7)), callbacks=[monitor])
    assert "likely diverging" in monitor.stop_message
    assert "min_scale" not in monitor.stop_message


def test_an_epoch_that_overflows_at_the_scales_floor_warns_that_float16_overflows_unscaled():
    # 2 backward overflows of 6 steps: the skip-rate warning's causes. At the
    # floor, a lower learning rate is not the first fix (as in the stop message).
    def causes(model):
        monitor = kmp.callbacks.LossScaleMonitor(verbose=0, max_consecutive_skips=None)
        with pytest.warns(UserWarning, match="skipped 2 of 6 steps") as record:
            _fit(model, _data(6, backward=(2, 4)), callbacks=[monitor])
        (message,) = _monitor_warnings(record)
        return message.split("Likely causes and what to try: ")[1]

    model = _model(optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=4.0, min_scale=2.0))
    at_floor = causes(model)
    assert at_floor.startswith("the loss scale fell to its min_scale (2) this epoch, where a "
                               "gradient that overflows overflows float16 even unscaled")
    assert "min_scale=2**-8" in at_floor and "kmp.diagnose" in at_floor
    assert "raise growth_interval" not in at_floor  # the scale did not grow back
    assert float(model.optimizer.loss_scale) == 2.0  # 4, then halved once, then held
    # Above the floor, the same epoch's causes are the diverging weights' first.
    above = causes(_model())
    assert above.startswith("a learning rate too high")
    assert "min_scale" not in above and "raise growth_interval" in above


def test_scale_forced_too_high_in_float16(tmp_path):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(inputs))
    model = kmp.Model(inputs, outputs)
    # 2**24 times a gradient of order 1 is far beyond float16's 65504.
    model.compile(
        optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=2.0**24, growth_interval=1000),
        loss="mse",
        overflow_retries=0,  # the monitor's view of each skip while the scale backs off
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 4)).astype("float32")
    y = rng.normal(size=(192, 2)).astype("float32")
    monitor = kmp.callbacks.LossScaleMonitor(csv_path=tmp_path / "s.csv", verbose=0, warn_skip_rate=None)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    rows = _rows(tmp_path / "s.csv")
    skipped = [int(r["skipped"]) for r in rows]
    n = sum(skipped)
    assert 0 < n < len(rows)
    assert skipped[:3] == [1, 1, 1]  # from the first step, until the scale fits
    skipped_rows = [r for r in rows if r["skipped"] == "1"]
    assert {r["reason"] for r in skipped_rows} == {"backward"}
    assert all(r["nonfinite_variables"] for r in skipped_rows)
    assert float(model.optimizer.loss_scale) == 2.0**24 / 2**n
    assert monitor.epoch_summaries[0]["forward"] == 0


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    plot_path = tmp_path / "scale.png"
    monitor = kmp.callbacks.LossScaleMonitor(plot_path=plot_path, verbose=0)
    with pytest.warns(UserWarning, match=r'pip install -e "\.\[plot\]"') as record:
        _fit(_model(), _data(2), callbacks=[monitor])
    assert not plot_path.exists()
    # At the user's line, not in Keras' callback_list.py (issue 38).
    (warning,) = [w for w in record if "matplotlib" in str(w.message)]
    assert warning.filename == __file__


def test_tensorboard_and_csv_logger_get_loss_scale(tmp_path):
    pytest.importorskip(
        "tensorboard", reason="keras.callbacks.TensorBoard needs the tensorboard package"
    )
    log_dir, csv_path = tmp_path / "tb", tmp_path / "log.csv"
    _fit(
        _model(),
        _data(4, backward=(2,)),
        epochs=2,
        callbacks=[
            keras.callbacks.TensorBoard(log_dir=str(log_dir)),
            keras.callbacks.CSVLogger(str(csv_path)),
        ],
    )
    rows = _rows(csv_path)
    # (Keras' CSVLogger adds empty val_ columns when there is no validation.)
    assert list(rows[0])[:4] == ["epoch", "loss", "loss_scale", "skipped_steps"]
    assert [(float(r["loss_scale"]), float(r["skipped_steps"])) for r in rows] == [(512, 1), (256, 2)]

    scalars = {}
    for path in glob.glob(str(log_dir / "train" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    assert scalars["epoch_loss_scale"] == [512, 256]
    assert scalars["epoch_skipped_steps"] == [1, 2]


# Keras 3.10 and 3.11 format every progress bar value as `.4f` themselves;
# from 3.12 on kmp's readable text (`512`, `1`) reaches the line.
_KERAS_PRINTS_READABLE = tuple(int(part) for part in keras.__version__.split(".")[:2]) >= (3, 12)


def _shown(out, name):
    """The texts the progress bar printed for the log `name`, in order."""
    return re.findall(rf"{name}: ([0-9.e+-]+)", out)


def test_progress_bar_is_readable_and_history_numeric(capsys):
    model = _model()
    history = _fit(model, _data(4, backward=(2,)), verbose=1)
    out = capsys.readouterr().out
    scales, skipped = _shown(out, "loss_scale"), _shown(out, "skipped_steps")
    # Every line shows the step's own scale and count, never their average
    # over the epoch's steps (768 or 0.5 after the skip at step 2).
    assert {float(s) for s in scales} <= {1024, 512} and float(scales[-1]) == 512
    assert {float(s) for s in skipped} <= {0, 1} and float(skipped[-1]) == 1
    if _KERAS_PRINTS_READABLE:
        assert (scales[-1], skipped[-1]) == ("512", "1")
        assert "512.0000" not in out and "e+0" not in out
    else:
        assert (scales[-1], skipped[-1]) == ("512.0000", "1.0000")
    assert set(history.history) == {"loss", "loss_scale", "skipped_steps"}
    assert type(history.history["loss_scale"][0]) is float
    # Skips without a monitor: one line at the end of fit.
    assert out.count("kmp: 1 of 4 training steps were skipped") == 1

    _fit(model, _data(4), verbose=2)
    out = capsys.readouterr().out
    assert [float(s) for s in _shown(out, "loss_scale")] == [512]
    assert [float(s) for s in _shown(out, "skipped_steps")] == [1]
    assert "training steps were skipped" not in out  # none in this fit


def test_no_end_of_fit_line_with_a_monitor(capsys):
    monitor = kmp.callbacks.LossScaleMonitor(warn_skip_rate=None)
    _fit(_model(), _data(4, backward=(2,)), verbose=1, callbacks=[monitor])
    out = capsys.readouterr().out
    assert "training steps were skipped" not in out
    assert "epoch 1: 1 of 4 steps skipped" in out


def test_plain_keras_model_with_kmp_optimizer(tmp_path):
    model = _model(
        model_class=keras.Model,
        optimizer=kmp.LossScaleOptimizer("sgd", initial_scale=INITIAL_SCALE, growth_interval=1000),
    )
    monitor = kmp.callbacks.LossScaleMonitor(csv_path=tmp_path / "s.csv", verbose=0, warn_skip_rate=None)
    _fit(model, _data(4, backward=(3,)), callbacks=[monitor])
    rows = _rows(tmp_path / "s.csv")
    assert [(r["skipped"], r["reason"]) for r in rows][2] == ("1", "backward")
    assert rows[2]["nonfinite_variables"] == "gate/trouble"
    assert monitor.epoch_summaries[0]["skipped"] == 1


def test_forward_overflow_on_one_replica_under_mirrored_strategy():
    # Not collective ops: their instance keys can clash with those of another
    # MirroredStrategy earlier in the same process.
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = _model()
    monitor = kmp.callbacks.LossScaleMonitor(verbose=0, warn_skip_rate=None)
    # Global batches of 8: replica 0 gets rows 0-3, replica 1 rows 4-7; poison
    # only replica 1's half of the second batch.
    x, y = _data(4)
    y[12:16] = np.inf
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    (summary,) = monitor.epoch_summaries
    assert (summary["steps"], summary["skipped"], summary["forward"]) == (2, 1, 1)


def test_nothing_to_monitor_without_a_guard(tmp_path, capsys):
    # float32 keeps Keras' step unless compile asks for the guard.
    kmp.set_policy("float32")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    monitor = kmp.callbacks.LossScaleMonitor(csv_path=tmp_path / "s.csv", plot_path=tmp_path / "p.png")
    history = _fit(model, _data(2), callbacks=[monitor])
    out = capsys.readouterr().out
    assert "nothing to monitor" in out and "skip_nonfinite=True" in out
    assert not (tmp_path / "s.csv").exists() and not (tmp_path / "p.png").exists()
    assert set(history.history) == {"loss"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_consecutive_skips": 0}, "`max_consecutive_skips` must be an integer >= 1 or None. Received: max_consecutive_skips=0"),
        ({"max_consecutive_skips": 2.5}, "Received: max_consecutive_skips=2.5"),
        ({"warn_skip_rate": 1.5}, r"`warn_skip_rate` must be a number in \[0, 1\] or None. Received: warn_skip_rate=1.5"),
        ({"verbose": -1}, "`verbose` must be an integer >= 0. Received: verbose=-1"),
    ],
)
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kmp.callbacks.LossScaleMonitor(**kwargs)


def test_invalid_path_is_named():
    with pytest.raises(TypeError, match="`csv_path` must be a file path"):
        kmp.callbacks.LossScaleMonitor(csv_path=3)


def test_config_round_trip_with_every_field_set(tmp_path):
    monitor = kmp.callbacks.LossScaleMonitor(
        max_consecutive_skips=7,
        warn_skip_rate=0.2,
        csv_path=tmp_path / "a.csv",
        plot_path=tmp_path / "b.png",
        verbose=0,
    )
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(monitor))
    assert isinstance(restored, kmp.callbacks.LossScaleMonitor)
    assert restored.get_config() == monitor.get_config() == {
        "max_consecutive_skips": 7,
        "warn_skip_rate": 0.2,
        "csv_path": str(tmp_path / "a.csv"),
        "plot_path": str(tmp_path / "b.png"),
        "verbose": 0,
    }


def test_steps_processed_in_batches_mid_epoch(tmp_path, monkeypatch):
    monkeypatch.setattr(kmp_callbacks, "_PROCESS_EVERY", 3)
    monitor = kmp.callbacks.LossScaleMonitor(
        csv_path=tmp_path / "s.csv", max_consecutive_skips=2, verbose=0, warn_skip_rate=None
    )
    _fit(_model(), _data(10, backward=(2, 5, 6)), callbacks=[monitor])
    rows = _rows(tmp_path / "s.csv")
    assert [(int(r["step"]), r["reason"]) for r in rows] == [
        (1, ""), (2, "backward"), (3, ""), (4, ""), (5, "backward"), (6, "backward")
    ]
    assert monitor.stopped_step == 6
    assert "gate/trouble" in monitor.stop_message
    assert monitor.epoch_summaries[0]["skipped"] == 3


def test_step_records_overflowing_variables_only_while_monitored(tmp_path):
    model = _model()
    optimizer = model.optimizer
    flags = lambda: np.asarray(optimizer._nonfinite_gradients).tolist()  # noqa: E731

    _fit(model, _data(3, backward=(2,)))
    gate_index = [v.path for v in optimizer._trainable_variables].index("gate/trouble")
    # Without a monitor the step neither records where it overflowed nor
    # returns the monitor's values: it does the scaling and nothing more.
    assert int(optimizer.skipped_steps) == 1 and not optimizer._monitored
    assert flags() == [0] * len(flags())
    assert not getattr(model, "_kmp_monitor_logs", None)

    monitor = kmp.callbacks.LossScaleMonitor(csv_path=tmp_path / "s.csv", verbose=0, warn_skip_rate=None)
    _fit(model, _data(3, backward=(2,)), callbacks=[monitor])
    assert optimizer._monitored and flags()[gate_index] == 1 and sum(flags()) == 1
    assert _rows(tmp_path / "s.csv")[1]["nonfinite_variables"] == "gate/trouble"
    assert set(model._kmp_monitor_logs) == {"counters", "nonfinite_gradients", "loss"}

    _fit(model, _data(2))  # the monitor is gone: the step is retraced without it
    assert not optimizer._monitored and model._kmp_monitor_logs == {}
    assert int(optimizer.skipped_steps) == 2 and int(optimizer.iterations) == 6
