"""bfloat16 weights that train (issue 48): a `kmp.Model` built under
`kmp.set_policy("bfloat16")` keeps its weights in bfloat16, and compile's
`kmp.LossScaleOptimizer` computes any Keras optimizer's update in float32 and
writes it with Kahan compensation (`kmp/precision/_compensated.py`).

Backend-neutral: every fit runs eagerly, as a graph and under XLA.
"""

import os

import keras
import numpy as np
import pytest

import kmp

BACKEND = keras.backend.backend()
MODES = {
    "eager": {"run_eagerly": True},
    "graph": {"jit_compile": False},
    "xla": {"jit_compile": True},
}


def _regression(rows=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def _mlp(policy, model_class=kmp.Model, start=None):
    """Dense(16, relu) -> Dense(1) under `policy` (kmp's, or a Keras
    layer dtype for `keras.Model`), from the weights `start` if given."""
    keras.utils.set_random_seed(0)
    dtype = None if model_class is kmp.Model else policy
    with kmp.policy_scope(policy if model_class is kmp.Model else "float32"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu", dtype=dtype)(inputs)
        model = model_class(inputs, keras.layers.Dense(1, dtype=dtype)(hidden))
    if start is not None:
        model.set_weights(start)
    return model


def _start():
    return _mlp("float32").get_weights()


def _fit(model, x, y, mode, epochs=3, optimizer=None):
    model.compile(optimizer or keras.optimizers.Adam(1e-2), "mse", **MODES[mode])
    return model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)


def _state(model):
    """Weights and every optimizer variable but the scaler's counters, as float32."""
    optimizer = model.optimizer
    state = [v for v in model.weights] + [
        v for v in optimizer.variables if "counters" not in v.path]
    return [np.asarray(keras.ops.cast(v, "float32")) for v in state]


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_weights_train_as_mixed_bfloat16_and_keras_own_do_not(mode):
    x, y = _regression()
    start = _start()
    model = _mlp("bfloat16", start=start)
    history = _fit(model, x, y, mode)
    assert {keras.backend.standardize_dtype(v.dtype) for v in model.trainable_variables} == {
        "bfloat16"}
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    # One compensation buffer per weight, in its dtype: 2 bytes a parameter.
    buffers = [v for v in model.optimizer.variables if "compensation" in v.path]
    assert [(tuple(b.shape), b.dtype) for b in buffers] == [
        (tuple(v.shape), v.dtype) for v in model.trainable_variables]
    # Ends within 2% of mixed_bfloat16 (float32 weights) from the same start.
    mixed = _fit(_mlp("mixed_bfloat16", start=start), x, y, mode)
    assert abs(history.history["loss"][-1] - mixed.history["loss"][-1]) <= (
        0.02 * mixed.history["loss"][-1])
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    # Keras' own bfloat16 model, the same start: Adam never moves it.
    keras_model = _mlp("bfloat16", keras.Model, start=start)
    keras_history = _fit(keras_model, x, y, mode)
    assert len(set(keras_history.history["loss"])) == 1
    for ours, theirs in zip(keras_model.get_weights(), start):
        np.testing.assert_array_equal(np.asarray(ours, "float32"),
                                      np.asarray(keras.ops.cast(theirs, "bfloat16"), "float32"))


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_record_leaves_weights_buffers_and_moments_as_without_its_batch(mode):
    x, y = _regression(64)
    x[37] = np.nan  # the third batch of 16
    start = _start()
    model = _mlp("bfloat16", start=start)
    model.compile(keras.optimizers.Adam(1e-2), "mse", **MODES[mode])
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert history.history["skipped_steps"] == [1, 2]
    clean = _mlp("bfloat16", start=start)
    clean.compile(keras.optimizers.Adam(1e-2), "mse", **MODES[mode])
    keep = np.r_[0:32, 48:64]
    clean.fit(x[keep], y[keep], batch_size=16, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(_state(model), _state(clean), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_a_keras_file_resumes_bit_for_bit_buffers_included(tmp_path):
    x, y = _regression()
    start = _start()
    path = os.fspath(tmp_path / "model.keras")
    first = _mlp("bfloat16", start=start)
    _fit(first, x, y, "graph", epochs=1)
    buffers = [v for v in first.optimizer.variables if "compensation" in v.path]
    assert len(buffers) == 4 and any(np.any(np.asarray(keras.ops.cast(b, "float32")))
                                     for b in buffers)
    first.save(path)
    resumed = keras.saving.load_model(path)
    resumed.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    through = _mlp("bfloat16", start=start)
    _fit(through, x, y, "graph", epochs=2)
    for ours, theirs in zip(_state(resumed), _state(through), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a tf.GradientTape loop is TensorFlow's")
def test_a_gradient_tape_loop_trains_bfloat16_weights_with_the_scaler_it_wraps_in():
    import tensorflow as tf

    x, y = _regression()
    start = _start()
    results = {}
    for name, optimizer in (
        ("kmp", kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))),  # the one line
        ("keras", keras.optimizers.Adam(1e-2)),
    ):
        model = _mlp("bfloat16", keras.Model, start=start)

        @tf.function
        def train_step(xb, yb, model=model, optimizer=optimizer):
            with tf.GradientTape() as tape:
                out = keras.ops.cast(model(xb, training=True), "float32")
                loss = keras.ops.mean(keras.ops.square(out - yb))
                scaled = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(scaled, model.trainable_variables),
                            model.trainable_variables)
            return loss

        losses = [float(train_step(x[i:i + 32], y[i:i + 32]))
                  for _ in range(3) for i in range(0, len(x), 32)]
        results[name] = (losses, model)
    kmp_losses, _ = results["kmp"]
    keras_losses, keras_model = results["keras"]
    assert np.mean(kmp_losses[-8:]) < 0.5 * np.mean(kmp_losses[:8])
    for ours, theirs in zip(keras_model.get_weights(), start):  # Keras' Adam: never moved
        np.testing.assert_array_equal(np.asarray(ours, "float32"),
                                      np.asarray(keras.ops.cast(theirs, "bfloat16"), "float32"))


def test_kmp_backup_and_restore_resumes_bfloat16_weights_exactly(tmp_path):
    # Interrupted after the first epoch, resumed from kmp's backup: the
    # weights, moments and compensation buffers of a run that never stopped.
    x, y = _regression()
    start = _start()

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise RuntimeError("interrupted")

    backup = kmp.callbacks.BackupAndRestore(os.fspath(tmp_path / "backup"))
    interrupted = _mlp("bfloat16", start=start)
    interrupted.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                        callbacks=[backup, Interrupt()])
    resumed = _mlp("bfloat16", start=start)
    resumed.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
    resumed.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                callbacks=[kmp.callbacks.BackupAndRestore(os.fspath(tmp_path / "backup"))])
    through = _mlp("bfloat16", start=start)
    _fit(through, x, y, "graph", epochs=2)
    for ours, theirs in zip(_state(resumed), _state(through), strict=True):
        np.testing.assert_array_equal(ours, theirs)
