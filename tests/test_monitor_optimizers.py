"""Tests for LossScaleMonitor and kmp's progress bar on a model with several
scaling optimizers: a GAN written the keras.io way.

The GAN's `compile(d_optimizer, g_optimizer)` calls `super().compile()`,
which under mixed_float16 makes a default `kmp.LossScaleOptimizer` that the
GAN's own `train_step` never uses (never built), then keeps its two
optimizers as attributes. Its step trains the discriminator, then the
generator, each with `scale_loss`, `tape.gradient`, `apply_gradients`.

Overflows are real, at known steps, for one optimizer at a time. Batches of
4 rows are fed in order; `y` holds two per-row loss weights, column 0 for the
discriminator's loss and column 1 for the generator's. A weight of 1e30
keeps the float32 loss finite but overflows float16 on the way back (a
*backward* overflow of that optimizer only); a weight of inf makes the loss
itself inf (a *forward* overflow).
"""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmp
from kmp import callbacks as kmp_callbacks

BATCH = 4
INITIAL_SCALE = 1024.0
BACKWARD, FORWARD = 1e30, np.inf


class _Gan(kmp.Model):
    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(4)], name="generator"
        )
        self.discriminator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(1)], name="discriminator"
        )

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer

    def _logits(self, x):
        return ops.cast(self.discriminator(x), "float32")

    def train_step(self, data):
        real, weights = data
        noise = real[:, :2]
        with tf.GradientTape() as tape:
            d_loss = ops.mean(ops.square(self._logits(real) - 1.0) * weights[:, :1])
            d_loss = d_loss + ops.mean(ops.square(self._logits(self.generator(noise))))
            scaled = self.d_optimizer.scale_loss(d_loss)
        variables = self.discriminator.trainable_variables
        self.d_optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
        with tf.GradientTape() as tape:
            fake_logits = self._logits(self.generator(noise))
            g_loss = ops.mean(ops.square(fake_logits - 1.0) * weights[:, 1:])
            scaled = self.g_optimizer.scale_loss(g_loss)
        variables = self.generator.trainable_variables
        self.g_optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def _scaler():
    # A growth interval longer than the run: after n skips the scale is
    # INITIAL_SCALE / 2**n.
    return kmp.LossScaleOptimizer("sgd", initial_scale=INITIAL_SCALE, growth_interval=1000)


@pytest.fixture
def gan():
    # conftest.py's autouse fixture sets float32 back after the test.
    kmp.set_policy("mixed_float16")
    model = _Gan()
    model.compile(d_optimizer=_scaler(), g_optimizer=_scaler())
    assert model.discriminator.layers[0].compute_dtype == "float16"
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)  # the unused default
    return model


def _data(steps, d=None, g=None):
    """`steps` batches; `d`/`g` map a 1-based step to its loss weight."""
    x = np.ones((steps * BATCH, 4), "float32")
    y = np.ones((steps * BATCH, 2), "float32")
    for column, poisoned in ((0, d or {}), (1, g or {})):
        for step, weight in poisoned.items():
            y[(step - 1) * BATCH : step * BATCH, column] = weight
    return x, y


def _fit(model, data, **kwargs):
    x, y = data
    kwargs.setdefault("verbose", 0)
    return model.fit(x, y, batch_size=BATCH, shuffle=False, **kwargs)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _counts(summary):
    return summary["optimizer"], summary["steps"], summary["skipped"], summary["backward"], summary["forward"]


# d: a backward overflow at step 2, a forward one at 5; g: a backward one at 4.
_POISON = {"d": {2: BACKWARD, 5: FORWARD}, "g": {4: BACKWARD}}


def test_each_optimizer_is_counted_and_reported_apart(gan, tmp_path, capsys, recwarn):
    monitor = kmp.callbacks.LossScaleMonitor(
        csv_path=tmp_path / "steps.csv", plot_path=tmp_path / "scale.png"
    )
    _fit(gan, _data(6, **_POISON), callbacks=[monitor], verbose=1)

    d, g = gan.d_optimizer, gan.g_optimizer
    assert (int(d.skipped_steps), int(d._forward_overflows), int(d.iterations)) == (2, 1, 4)
    assert (int(g.skipped_steps), int(g._forward_overflows), int(g.iterations)) == (1, 0, 5)
    assert not gan.optimizer.built  # never used, and nothing crashed on it
    d_summary, g_summary = monitor.epoch_summaries
    assert _counts(d_summary) == ("d_optimizer", 6, int(d.skipped_steps), 1, 1)
    assert _counts(g_summary) == ("g_optimizer", 6, int(g.skipped_steps), 1, 0)
    assert d_summary["end_scale"] == float(d.loss_scale) == INITIAL_SCALE / 4
    assert g_summary["end_scale"] == float(g.loss_scale) == INITIAL_SCALE / 2
    assert all(name.startswith("discriminator/") for name in d_summary["nonfinite_variables"])
    assert all(name.startswith("generator/") for name in g_summary["nonfinite_variables"])

    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "epoch 1:" in line] == [
        "d_optimizer: epoch 1: 2 of 6 steps skipped (33.3%: 1 backward, 1 forward), "
        "loss scale 1024 -> 256 (min 256, max 1024)",
        "g_optimizer: epoch 1: 1 of 6 steps skipped (16.7%: 1 backward, 0 forward), "
        "loss scale 1024 -> 512 (min 512, max 1024)",
    ]
    assert "training steps were skipped" not in out  # the monitor reports skips
    monitor_warnings = [str(w.message) for w in recwarn if "LossScaleMonitor" in str(w.message)]
    assert [w.split(" skipped ")[0] for w in monitor_warnings] == [
        "LossScaleMonitor: d_optimizer: epoch 1",
        "LossScaleMonitor: g_optimizer: epoch 1",
    ]

    # One CSV and one plot per optimizer that took steps; none for the default.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "scale.d_optimizer.png", "scale.g_optimizer.png",
        "steps.d_optimizer.csv", "steps.g_optimizer.csv",
    ]
    d_rows = _rows(tmp_path / "steps.d_optimizer.csv")
    g_rows = _rows(tmp_path / "steps.g_optimizer.csv")
    assert [(int(r["step"]), r["reason"]) for r in d_rows] == [
        (1, ""), (2, "backward"), (3, ""), (4, ""), (5, "forward"), (6, "")
    ]
    assert [(int(r["step"]), r["reason"]) for r in g_rows] == [
        (1, ""), (2, ""), (3, ""), (4, "backward"), (5, ""), (6, "")
    ]
    assert [float(r["loss_scale"]) for r in d_rows] == [1024, 512, 512, 512, 256, 256]
    assert [float(r["loss_scale"]) for r in g_rows] == [1024, 1024, 1024, 512, 512, 512]
    # Each optimizer's loss is its own log: d_loss is inf at d's forward overflow.
    assert float(d_rows[4]["loss"]) == np.inf
    assert all(np.isfinite(float(r["loss"])) for r in g_rows)
    assert d_rows[1]["nonfinite_variables"].startswith("discriminator/")
    assert g_rows[3]["nonfinite_variables"].startswith("generator/")

    # Every scaling optimizer records where it overflowed while watched.
    assert d._monitored and g._monitored and gan.optimizer._monitored
    assert int(np.sum(np.asarray(d._nonfinite_gradients))) > 0


def test_progress_bar_names_each_optimizer_without_a_monitor(gan, capsys):
    _fit(gan, _data(6, **_POISON), verbose=1)
    out = capsys.readouterr().out
    assert (
        "kmp: training steps were skipped because their loss or gradients were not finite: "
        "d_optimizer skipped 2 of 6 (loss scale now 256); "
        "g_optimizer skipped 1 of 6 (loss scale now 512). Add "
        "kmp.callbacks.LossScaleMonitor() to the callbacks to see which steps and why."
    ) in out
    assert out.count("kmp: ") == 1
    # No monitor: no optimizer pays for recording where it overflowed.
    assert not (gan.d_optimizer._monitored or gan.g_optimizer._monitored)

    # A second fit, now watched: the step is retraced to record where it
    # overflowed, and each optimizer's counts start where the last fit ended.
    monitor = kmp.callbacks.LossScaleMonitor(verbose=0, warn_skip_rate=None)
    _fit(gan, _data(3, d={2: BACKWARD}), callbacks=[monitor])
    assert [_counts(s) for s in monitor.epoch_summaries] == [
        ("d_optimizer", 3, 1, 1, 0), ("g_optimizer", 3, 0, 0, 0)
    ]
    assert int(gan.d_optimizer.skipped_steps) == 3
    assert monitor.epoch_summaries[0]["nonfinite_variables"]


def test_optimizers_kmp_wraps_at_the_first_step_are_watched_too():
    # Plain optimizers: kmp.Model wraps them when it makes the train
    # function, after fit began and before the monitor's train begin.
    kmp.set_policy("mixed_float16")  # conftest.py's fixture sets float32 back
    gan = _Gan()
    gan.compile(d_optimizer=keras.optimizers.SGD(), g_optimizer=keras.optimizers.SGD())
    monitor = kmp.callbacks.LossScaleMonitor(verbose=0, warn_skip_rate=None)
    _fit(gan, _data(6, **_POISON), callbacks=[monitor])
    assert isinstance(gan.d_optimizer, kmp.LossScaleOptimizer) and gan.d_optimizer._monitored
    d, g = gan.d_optimizer, gan.g_optimizer
    # At Keras' default scale of 2**15 the discriminator's first step(s) may
    # overflow float16 by themselves: its counts are the optimizer's own.
    skipped, forward = int(d.skipped_steps), int(d._forward_overflows)
    assert forward == 1 and skipped >= 2 and int(g.skipped_steps) >= 1
    assert [_counts(s) for s in monitor.epoch_summaries] == [
        ("d_optimizer", 6, skipped, skipped - forward, forward),
        ("g_optimizer", 6, int(g.skipped_steps), int(g.skipped_steps), 0),
    ]
    assert monitor.epoch_summaries[0]["end_scale"] == float(d.loss_scale) == 2.0**15 / 2**skipped
    assert monitor.epoch_summaries[0]["nonfinite_variables"]


@pytest.mark.parametrize("by", ["name", "instance"])
def test_only_the_given_optimizer_is_watched_as_if_alone(gan, tmp_path, capsys, by):
    chosen = "g_optimizer" if by == "name" else gan.g_optimizer
    monitor = kmp.callbacks.LossScaleMonitor(
        optimizers=[chosen], csv_path=tmp_path / "steps.csv", warn_skip_rate=None
    )
    _fit(gan, _data(6, **_POISON), callbacks=[monitor])

    (summary,) = monitor.epoch_summaries
    assert _counts(summary) == ("g_optimizer", 6, int(gan.g_optimizer.skipped_steps), 1, 0)
    # One optimizer watched: the line and the CSV are as for a one-optimizer model.
    assert capsys.readouterr().out.splitlines() == [
        "epoch 1: 1 of 6 steps skipped (16.7%: 1 backward, 0 forward), "
        "loss scale 1024 -> 512 (min 512, max 1024)"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["steps.csv"]
    rows = _rows(tmp_path / "steps.csv")
    assert [r["reason"] for r in rows] == ["", "", "", "backward", "", ""]


def test_stops_when_one_optimizer_reaches_the_limit_and_says_which(gan, capsys):
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=2, warn_skip_rate=None)
    history = _fit(
        gan, _data(8, d={3: BACKWARD, 4: BACKWARD}), callbacks=[monitor], epochs=2
    )
    assert (monitor.stopped_optimizer, monitor.stopped_step) == ("d_optimizer", 4)
    assert monitor.stop_message.startswith(
        "LossScaleMonitor: d_optimizer: stopping training at step 4: 2 consecutive steps"
    )
    assert "discriminator/" in monitor.stop_message
    assert monitor.stop_message in capsys.readouterr().out
    assert len(history.history["d_loss"]) == 1
    # Both optimizers stepped in each of the 4 batches, then training stopped.
    assert int(gan.d_optimizer.iterations + gan.d_optimizer.skipped_steps) == 4
    assert (int(gan.g_optimizer.iterations), int(gan.g_optimizer.skipped_steps)) == (4, 0)


@pytest.mark.parametrize(
    "optimizers, error, message",
    [
        ("g_optimizer", TypeError, r"Received: optimizers='g_optimizer'\. For one optimizer pass a list: optimizers=\['g_optimizer'\]"),
        (3, TypeError, "Received: optimizers=3 of type int"),
        ([], ValueError, r"an empty list would watch nothing\. Received: optimizers=\[\]"),
        (["g_optimizer", 3], TypeError, r"Received: optimizers=\['g_optimizer', 3\], with \[3\] neither"),
        (["g_optimizer", "g_optimizer"], ValueError, r"each at most once\. .*repeating \['g_optimizer'\]"),
    ],
)
def test_invalid_optimizers_are_named(optimizers, error, message):
    with pytest.raises(error, match="`optimizers` must be None") as raised:
        kmp.callbacks.LossScaleMonitor(optimizers=optimizers)
    assert raised.match(message)


def test_an_optimizer_that_does_not_scale_is_refused():
    with pytest.raises(TypeError, match="does not scale the loss.*SGD"):
        kmp.callbacks.LossScaleMonitor(optimizers=[keras.optimizers.SGD()])


@pytest.mark.parametrize(
    "name, why",
    [
        ("h_optimizer", "the model has no optimizer attribute of that name"),
        ("plain_optimizer", "it is a SGD, which does not scale the loss"),
    ],
)
def test_unknown_names_are_refused_when_training_starts(gan, name, why):
    gan.plain_optimizer = keras.optimizers.SGD()
    monitor = kmp.callbacks.LossScaleMonitor(optimizers=[name])
    monitor.set_model(gan)
    with pytest.raises(ValueError) as raised:
        monitor.on_train_begin()
    assert str(raised.value) == (
        f"LossScaleMonitor cannot watch {name!r}: {why}. The model's "
        "kmp.LossScaleOptimizer attributes: ['d_optimizer', 'g_optimizer', 'optimizer']. "
        f"Received: optimizers=[{name!r}]"
    )


def test_instances_the_model_does_not_hold_keep_apart_names(gan):
    first = kmp.LossScaleOptimizer("sgd", name="scaler")
    second = kmp.LossScaleOptimizer("sgd", name="scaler")
    found = kmp_callbacks._resolve_optimizers(gan, (gan.g_optimizer, first, second))
    assert list(found) == ["g_optimizer", "scaler", "scaler_1"]
    assert (found["g_optimizer"], found["scaler"], found["scaler_1"]) == (
        gan.g_optimizer, first, second
    )


def test_config_round_trip_keeps_names_and_refuses_instances(gan, tmp_path):
    monitor = kmp.callbacks.LossScaleMonitor(
        max_consecutive_skips=7, warn_skip_rate=0.2, csv_path=tmp_path / "a.csv",
        plot_path=tmp_path / "b.png", verbose=0, optimizers=["g_optimizer", "d_optimizer"],
    )
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(monitor))
    assert restored.get_config() == monitor.get_config() == {
        "max_consecutive_skips": 7,
        "warn_skip_rate": 0.2,
        "csv_path": str(tmp_path / "a.csv"),
        "plot_path": str(tmp_path / "b.png"),
        "verbose": 0,
        "optimizers": ["g_optimizer", "d_optimizer"],
    }
    with pytest.raises(ValueError, match=r"optimizers=\['g_optimizer'\]"):
        kmp.callbacks.LossScaleMonitor(optimizers=[gan.g_optimizer]).get_config()


def test_message_examples_run():
    import doctest

    from kmp.monitor import _messages as _monitor_messages

    result = doctest.testmod(_monitor_messages)
    assert result.attempted > 0 and result.failed == 0
