"""The guard (issue 46): a step whose loss or gradients are not finite is
skipped and counted under every policy, and a loss spike on request.

Backend-neutral (the JAX pass runs it too): every fit runs eagerly, as a
graph and under XLA (`jit_compile=True`), and each skipped step is checked
against a run that never saw its batch, weight for weight and slot for slot.
"""

import csv
import math

import keras
import numpy as np
from keras import ops
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import kmp
from _helpers import assert_close_to_float16_rounding
from kmp.scaling import _gate
from kmp.scaling import _spikes

BACKEND = keras.backend.backend()
MODES = {
    "eager": {"run_eagerly": True},
    "graph": {"jit_compile": False},
    "xla": {"jit_compile": True},
}
BATCH = 16


def _regression(rows=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True).astype("float32")


def _with_a_nan_record():
    """The issue's data: 64 rows, row 37 (in the third batch of 16) NaN."""
    x, y = _regression()
    x[37] = np.nan
    return x, y


def _mlp(policy, model_class=None, batch_norm=False):
    keras.utils.set_random_seed(0)
    with kmp.policy_scope(policy):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        if batch_norm:
            hidden = keras.layers.BatchNormalization()(hidden)
        outputs = keras.layers.Dense(1)(hidden)
        return (model_class or kmp.Model)(inputs, outputs)


def _fit(model, x, y, mode, epochs=2, callbacks=None, **compile_kwargs):
    model.compile(keras.optimizers.Adam(1e-2), "mse", **MODES[mode], **compile_kwargs)
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


def _slots(model):
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return [np.asarray(v) for v in inner.variables]


def _assert_same_training(model, reference):
    """Weights, non-trainable state and the optimizer's slots, bit for bit."""
    for ours, theirs in zip(model.weights, reference.weights):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs), err_msg=ours.path)
    for ours, theirs in zip(_slots(model), _slots(reference), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_record_under_bfloat16_is_skipped_counted_and_changes_nothing(mode):
    # The setup: one row of the inputs NaN (row 37: the third batch).
    x, y = _with_a_nan_record()
    model = _mlp("mixed_bfloat16")
    history = _fit(model, x, y, mode)
    assert history.history["skipped_steps"] == [1, 2]
    assert "loss_scale" not in history.history  # nothing scales
    assert int(model.optimizer.iterations) == 6
    # It trained as a run that never saw that batch: weights, Adam's moments
    # and its step count, and the epoch's logs, which describe applied steps.
    clean = _mlp("mixed_bfloat16")
    keep = np.r_[0:32, 48:64]
    clean_history = _fit(clean, x[keep], y[keep], mode)
    _assert_same_training(model, clean)
    assert history.history["loss"] == clean_history.history["loss"]
    assert np.isfinite(model.predict(x[:8], verbose=0)).all()

    # Without the guard (Keras' step), the one record turns the weights NaN.
    unguarded = _mlp("mixed_bfloat16")
    _fit(unguarded, x, y, mode, skip_nonfinite=False)
    assert isinstance(unguarded.optimizer, keras.optimizers.Adam)
    assert np.isnan(np.asarray(unguarded.layers[1].kernel)).any()


class WritesDirectly(keras.optimizers.SGD):
    """Writes its variables with `variable.assign_sub`, not the optimizer's
    `assign_sub` (the path kmp gates under XLA): the select must catch it."""

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(ops.cast(learning_rate, variable.dtype) * gradient)


class AddsItsOwnWay(keras.optimizers.Adam):
    """Overrides `assign_add` (as one that logs or shards its writes might):
    the gate gives the override `where(keep, delta, 0)`."""

    def assign_add(self, variable, value):
        super().assign_add(variable, value)


OPTIMIZERS = {
    "Adam": lambda: keras.optimizers.Adam(1e-2),
    "AdamW": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "SGD nesterov": lambda: keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
    "Adam EMA": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=2),
    "RMSprop centered": lambda: keras.optimizers.RMSprop(1e-2, centered=True),
    "Lion": lambda: keras.optimizers.Lion(1e-3),
    "writes directly": lambda: WritesDirectly(1e-2),
    "overrides assign_add": lambda: AddsItsOwnWay(1e-2),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["assign", "assign_add", "assign_sub"])
def test_a_gated_write_writes_what_keras_own_would_or_nothing(name, dtype):
    # A kept step writes the bits Keras' own method writes (a bfloat16
    # variable given a float32 delta included: TensorFlow's optimizer casts
    # the delta first, `keras.Variable.assign_add` adds in float32), a
    # skipped one leaves the variable as it was.
    rng = np.random.default_rng(0)
    start = rng.normal(size=(512,)).astype("float32")
    delta = (rng.normal(size=(512,)) * 1e-2).astype("float32")

    def written(keep=None):
        optimizer, variable = keras.optimizers.SGD(), keras.Variable(start, dtype=dtype)
        write = lambda: getattr(optimizer, name)(variable, delta)
        if keep is None:
            write()
        else:
            # Keras' TensorFlow optimizer casts before adding; on JAX
            # `keras.Variable.assign_add` adds first.
            with _gate.gated_writes(optimizer, ops.convert_to_tensor(keep),
                                    lambda variable, value, gated, plain: gated(),
                                    casts_before_adding=BACKEND == "tensorflow"):
                write()
        return np.asarray(ops.cast(variable.value, "float32"))

    np.testing.assert_array_equal(written(True), written())
    as_stored = np.asarray(ops.cast(ops.cast(start, dtype), "float32"))
    np.testing.assert_array_equal(written(False), as_stored)
    assert not np.array_equal(written(True), as_stored)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_skips_exactly_under_xla_however_it_writes(optimizer):
    # Under XLA kmp gates the writes an optimizer makes through its own
    # `assign` methods and selects the rest: weights, slots, EMA averages
    # and `iterations` end as in a run that never saw the NaN batch.
    x, y = _with_a_nan_record()
    model, clean = _mlp("mixed_bfloat16"), _mlp("mixed_bfloat16")
    keep = np.r_[0:32, 48:64]
    for net, rows in ((model, slice(None)), (clean, keep)):
        net.compile(OPTIMIZERS[optimizer](), "mse", jit_compile=True)
        history = net.fit(x[rows], y[rows], batch_size=BATCH, epochs=2, shuffle=False,
                          verbose=0)
    assert history.history["skipped_steps"] == [0, 0]
    assert model.optimizer.counters["skipped_steps"] == 2
    _assert_same_training(model, clean)
    for name in ("assign", "assign_add", "assign_sub"):  # nothing left on it
        assert name not in vars(model.optimizer.inner_optimizer)


@pytest.mark.parametrize("mode", MODES)
def test_without_a_bad_record_the_guard_changes_nothing(mode):
    x, y = _regression()
    guarded, unguarded = _mlp("mixed_bfloat16"), _mlp("mixed_bfloat16")
    guarded_history = _fit(guarded, x, y, mode)
    unguarded_history = _fit(unguarded, x, y, mode, skip_nonfinite=False)
    assert guarded_history.history["skipped_steps"] == [0, 0]
    _assert_same_training(guarded, unguarded)
    assert guarded_history.history["loss"] == unguarded_history.history["loss"]
    # Keras' own mixed_bfloat16 (the same initial weights): within bfloat16's
    # rounding (two Dense layers, forward and backward, 8 Adam steps).
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        keras_model = _mlp("mixed_bfloat16", model_class=keras.Model)
    finally:
        keras.config.set_dtype_policy(previous)
    _fit(keras_model, x, y, mode)
    for ours, theirs in zip(guarded.weights, keras_model.weights):
        assert_close_to_float16_rounding(ours, theirs, roundings=16, dtype="bfloat16")


@pytest.mark.parametrize("mode", MODES)
def test_float32_keeps_keras_step_unless_compile_asks_for_the_guard(mode):
    x, y = _with_a_nan_record()
    plain = _mlp("float32")
    history = _fit(plain, x, y, mode)
    assert isinstance(plain.optimizer, keras.optimizers.Adam)
    assert "skipped_steps" not in history.history
    assert np.isnan(np.asarray(plain.layers[1].kernel)).any()

    guarded = _mlp("float32")
    history = _fit(guarded, x, y, mode, skip_nonfinite=True)
    assert history.history["skipped_steps"] == [1, 2]
    clean = _mlp("float32")
    keep = np.r_[0:32, 48:64]
    _fit(clean, x[keep], y[keep], mode, skip_nonfinite=True)
    _assert_same_training(guarded, clean)


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_skipped_forward_pass_leaves_batch_norm_statistics_as_they_were(mode):
    x, y = _regression()
    x[37] = np.nan  # the forward pass of batch 3 writes NaN statistics
    model = _mlp("mixed_bfloat16", batch_norm=True)
    history = _fit(model, x, y, mode)
    assert history.history["skipped_steps"] == [1, 2]
    clean = _mlp("mixed_bfloat16", batch_norm=True)
    keep = np.r_[0:32, 48:64]
    _fit(clean, x[keep], y[keep], mode)
    _assert_same_training(model, clean)  # moving mean and variance included
    assert np.isfinite(model.predict(x[:8], verbose=0)).all()


def test_several_steps_per_execution_skip_the_same_step():
    x, y = _with_a_nan_record()
    model = _mlp("mixed_bfloat16")
    history = _fit(model, x, y, "xla", steps_per_execution=2)
    assert history.history["skipped_steps"] == [1, 2]
    clean = _mlp("mixed_bfloat16")
    keep = np.r_[0:32, 48:64]
    # 3 batches an epoch: executions of 2 and 1, as the same batches' steps.
    _fit(clean, x[keep], y[keep], "xla", steps_per_execution=2)
    _assert_same_training(model, clean)


def test_the_monitor_reports_a_skip_under_bfloat16_without_a_loss_scale(tmp_path, capsys):
    x, y = _with_a_nan_record()
    model = _mlp("mixed_bfloat16")
    monitor = kmp.callbacks.LossScaleMonitor(csv_path=tmp_path / "steps.csv")
    with pytest.warns(UserWarning, match="skipped 1 of 4 steps") as warned:
        _fit(model, x, y, "xla", epochs=1, callbacks=[monitor])
    # Its causes are bfloat16's: the data or an undefined operation, not a
    # layer overflowing float16 nor a loss scale.
    # The monitor's own warning: other libraries may warn during the fit (a
    # NumPy 2 DeprecationWarning from Keras 3.12's arrays, say).
    (message,) = [str(w.message) for w in warned if "skipped 1 of 4 steps" in str(w.message)]
    assert "check the data with np.isfinite" in message
    assert "float16" not in message.replace("bfloat16", "") and "loss scal" not in message
    out = capsys.readouterr().out
    assert "epoch 1: 1 of 4 steps skipped (25.0%: 0 backward, 1 forward)\n" in out
    assert "loss scale" not in out
    with open(tmp_path / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(row["step"], row["skipped"], row["reason"]) for row in rows] == [
        ("1", "0", ""), ("2", "0", ""), ("3", "1", "forward"), ("4", "0", "")]
    assert monitor.epoch_summaries[0]["scaling"] is False


def test_the_monitor_stops_a_bfloat16_run_of_corrupt_records_naming_the_data(capsys):
    x, y = _regression()
    x[16:] = np.nan  # every batch after the first: a corrupt record
    model = _mlp("mixed_bfloat16")
    monitor = kmp.callbacks.LossScaleMonitor(max_consecutive_skips=3, warn_skip_rate=None)
    _fit(model, x, y, "graph", epochs=2, callbacks=[monitor])
    assert monitor.stopped_step == 4 and model.stop_training
    assert int(np.asarray(model.optimizer.skipped_steps)) == 3
    message = monitor.stop_message
    assert "the loss itself was not finite" in message
    assert "check the data with np.isfinite" in message
    # Nothing scales under bfloat16: no loss scale, and no float16 layer.
    assert "loss scale" not in message and "float32" not in message


# Loss spikes: 70 ordinary batches, then one whose targets are 1e4 times larger.
_SPIKE_BATCHES = 70


def _spike_data():
    rng = np.random.default_rng(1)
    rows = (_SPIKE_BATCHES + 1) * 8
    x = rng.normal(size=(rows, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
         + 0.1 * rng.normal(size=(rows, 1))).astype("float32")
    y[-8:] *= 1e4
    return x, y


def _linear(policy):
    keras.utils.set_random_seed(0)
    with kmp.policy_scope(policy):
        inputs = keras.Input((4,))
        return kmp.Model(inputs, keras.layers.Dense(1)(inputs))


def _fit_spikes(model, x, y, mode, **compile_kwargs):
    model.compile(keras.optimizers.SGD(0.01), "mse", **MODES[mode], **compile_kwargs)
    return model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_loss_spike_is_skipped_on_request_as_if_never_seen(policy, mode):
    x, y = _spike_data()
    model = _linear(policy)
    history = _fit_spikes(model, x, y, mode, skip_spikes=6.0)
    never_seen = _linear(policy)
    never_seen_history = _fit_spikes(never_seen, x[:-8], y[:-8], mode, skip_spikes=6.0)
    # (Under float16 the first steps may overflow while the scale settles,
    # in both runs alike.)
    settling = never_seen_history.history["skipped_steps"][0]
    assert history.history["skipped_steps"] == [settling + 1]
    assert int(model.optimizer.iterations) == _SPIKE_BATCHES - settling
    _assert_same_training(model, never_seen)
    # Under float16 the spike's gradients overflow at the loss scale (a
    # backward overflow, skipped once its retry overflows too); elsewhere it
    # is a spike.
    spikes = 0 if policy == "mixed_float16" else 1
    assert int(model.optimizer._spike_counts[1]) == spikes

    if policy == "mixed_float16":
        return  # there the batch overflows float16 whatever skip_spikes says
    # The default is off: the same batch is applied.
    applied = _linear(policy)
    history = _fit_spikes(applied, x, y, mode)
    assert history.history.get("skipped_steps", [0]) == [0]
    assert int(applied.optimizer.iterations) == _SPIKE_BATCHES + 1
    kernel = np.asarray(applied.layers[1].kernel)
    assert not np.array_equal(kernel, np.asarray(never_seen.layers[1].kernel))


def test_the_monitor_names_a_spike(tmp_path):
    x, y = _spike_data()
    model = _linear("float32")
    monitor = kmp.callbacks.LossScaleMonitor(csv_path=tmp_path / "steps.csv", verbose=0)
    model.compile(keras.optimizers.SGD(0.01), "mse", skip_spikes=6.0)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    with open(tmp_path / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["reason"] for row in rows if row["skipped"] == "1"] == ["spike"]
    assert rows[-1]["reason"] == "spike" and rows[-1]["step"] == str(_SPIKE_BATCHES + 1)
    summary = monitor.epoch_summaries[0]
    assert (summary["skipped"], summary["spikes"], summary["backward"]) == (1, 1, 0)


def test_no_spike_before_the_warmup_and_the_window_keeps_the_last_losses():
    window, seen = keras.ops.zeros((4,)), keras.ops.convert_to_tensor(0, "int32")
    for loss in (1.0, 2.0, float("nan"), 3.0, 4.0, 5.0):
        window, seen = _spikes.record(window, seen, keras.ops.convert_to_tensor(loss))
    # NaN is not recorded; 5 finite losses in a window of 4: the first is gone.
    assert int(seen) == 5
    assert sorted(np.asarray(window).tolist()) == [2.0, 3.0, 4.0, 5.0]
    huge = keras.ops.convert_to_tensor(1e6)
    assert bool(_spikes.is_spike(window, seen, huge, 6.0, 5))
    assert not bool(_spikes.is_spike(window, seen, huge, 6.0, 6))  # warming up
    assert not bool(_spikes.is_spike(window, seen, keras.ops.convert_to_tensor(-1e6), 6.0, 5))
    assert not bool(_spikes.is_spike(window, seen, keras.ops.convert_to_tensor(np.inf), 6.0, 5))


@settings(max_examples=60, deadline=None)
@given(
    losses=st.lists(st.floats(-100.0, 100.0, width=32), min_size=2, max_size=12),
    loss=st.floats(-1000.0, 1000.0, width=32),
    threshold=st.floats(0.5, 8.0),
)
def test_the_spike_rule_is_a_z_score_against_float64(losses, loss, threshold):
    size = 8
    window, seen = keras.ops.zeros((size,)), keras.ops.convert_to_tensor(0, "int32")
    for value in losses:
        window, seen = _spikes.record(window, seen, keras.ops.convert_to_tensor(value))
    last = np.asarray(losses[-size:], dtype=np.float64)
    mean = last.mean()
    std = last.std(ddof=1) if len(last) > 1 else 0.0
    margin = loss - mean - threshold * std
    if abs(margin) < 1e-3 * (1.0 + abs(loss) + abs(mean) + threshold * std):
        return  # float32 rounding decides within this margin
    got = _spikes.is_spike(window, seen, keras.ops.convert_to_tensor(loss, "float32"),
                           threshold, 2)
    assert bool(got) == (margin > 0), (losses, loss, threshold, mean, std)
    assert math.isfinite(float(mean))


_tensorflow_only = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.distribute and tf.GradientTape are TensorFlow's")


@_tensorflow_only
@pytest.mark.parametrize("spikes", [None, 6.0])
def test_replicas_skip_together_under_mirrored_strategy(mirrored_strategy, spikes):
    # A NaN target in one replica's half of the batch (its loss NaN, so the
    # batch's): both replicas skip.
    x, y = _regression()
    y[37] = np.nan
    with mirrored_strategy.scope():
        model = _mlp("mixed_bfloat16")
        history = _fit(model, x, y, "graph", skip_spikes=spikes)
    assert history.history["skipped_steps"] == [1, 2]
    with mirrored_strategy.scope():
        clean = _mlp("mixed_bfloat16")
        keep = np.r_[0:32, 48:64]
        _fit(clean, x[keep], y[keep], "graph", skip_spikes=spikes)
    _assert_same_training(model, clean)
    if spikes is not None:
        # The window holds the batch's loss (every replica's summed), alike
        # on both replicas: 6 applied steps' losses, the NaN one left out.
        window = model.optimizer._spike_window
        local = mirrored_strategy.experimental_local_results(window.value)
        np.testing.assert_array_equal(np.asarray(local[0]), np.asarray(local[1]))
        assert int(model.optimizer._spike_counts[0]) == 6


class OwnStep(kmp.Model):
    """keras.io's "customizing what happens in fit" step, with no kmp line."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.optimizer.apply_gradients(
            zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


class StatelessStep:
    """keras.io's "customizing what happens in fit() with JAX" step, with
    docs/jax.md's one line (`scale_loss`)."""

    def compute_loss_and_updates(self, trainable, non_trainable, x, y):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
        loss = self.compute_loss(x, y, y_pred)
        return self.optimizer.scale_loss(loss), (loss, non_trainable)

    def train_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (_, (loss, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class KmpStatelessStep(StatelessStep, kmp.Model):
    pass


@pytest.mark.parametrize("mode", MODES)
def test_a_custom_steps_skip_leaves_batch_norm_statistics_as_they_were(mode):
    # Only kmp.Model's own step put back what a skipped step's forward pass
    # wrote: a custom step's NaN record made the moving statistics NaN for
    # good, and every prediction after it, while its logs showed one skip.
    step = OwnStep if BACKEND == "tensorflow" else KmpStatelessStep
    x, y = _with_a_nan_record()
    model = _mlp("mixed_bfloat16", model_class=step, batch_norm=True)
    assert _fit(model, x, y, mode).history["skipped_steps"] == [1, 2]
    clean = _mlp("mixed_bfloat16", model_class=step, batch_norm=True)
    keep = np.r_[0:32, 48:64]
    _fit(clean, x[keep], y[keep], mode)
    _assert_same_training(model, clean)  # moving mean and variance included
    assert np.isfinite(model.predict(x[:8], verbose=0)).all()


@pytest.mark.skipif(BACKEND != "jax", reason="a stateless train_step(state, data) is JAX's")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_stateless_step_computes_a_regularized_loss_as_keras_does(policy):
    # kmp's scope around a custom JAX step mapped only the scalers' state:
    # Keras' regularizer read `None` for the kernel there and failed
    # ("'NoneType' object has no attribute 'dtype'").
    x, y = _regression(rows=16)
    losses = []
    for model_class in (KmpStatelessStep, type("KerasStatelessStep", (StatelessStep, keras.Model), {})):
        with kmp.policy_scope("float32"):
            keras.mixed_precision.set_dtype_policy(policy)  # the same layers for both
            keras.utils.set_random_seed(0)
            inputs = keras.Input((4,))
            hidden = keras.layers.Dense(16, kernel_regularizer=keras.regularizers.L2(0.5))(inputs)
            model = model_class(inputs, keras.layers.Dense(1)(hidden))
        keras.mixed_precision.set_dtype_policy("float32")
        model.compile(keras.optimizers.SGD(1e-2), "mse")
        losses.append(model.train_on_batch(x, y, return_dict=True)["loss"])
    kmp_loss, keras_loss = losses
    assert kmp_loss == keras_loss and keras_loss > float(np.mean(np.square(y)))


@_tensorflow_only
def test_a_custom_train_step_is_guarded_under_bfloat16_without_a_line():
    x, y = _with_a_nan_record()
    model = _mlp("mixed_bfloat16", model_class=OwnStep)
    history = _fit(model, x, y, "graph")
    assert history.history["skipped_steps"] == [1, 2]
    assert np.isfinite(np.asarray(model.layers[1].kernel)).all()
    clean = _mlp("mixed_bfloat16", model_class=OwnStep)
    keep = np.r_[0:32, 48:64]
    _fit(clean, x[keep], y[keep], "graph")
    _assert_same_training(model, clean)


@_tensorflow_only
def test_a_gradient_tape_loop_is_guarded_by_the_scaler_it_wraps_in():
    import tensorflow as tf

    x, y = _with_a_nan_record()
    results = []
    for rows in (slice(None), np.r_[0:32, 48:64]):
        model = _mlp("mixed_bfloat16", model_class=keras.Model)
        # The one line: the optimizer wrapped (under bfloat16 as under float16).
        optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        for start in range(0, len(x[rows]), BATCH):
            xb, yb = x[rows][start:start + BATCH], y[rows][start:start + BATCH]
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(model(xb, training=True) - yb))
                scaled = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(scaled, model.trainable_variables),
                            model.trainable_variables)
        results.append((model, optimizer))
    (model, optimizer), (clean, _) = results
    assert int(optimizer.skipped_steps) == 1 and int(optimizer.iterations) == 3
    for ours, theirs in zip(model.weights, clean.weights):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-7)
