"""The logs of an epoch whose every step was skipped, on TensorFlow and JAX.

kmp puts a skipped step's metrics back, so that one poisoned batch does not
make an epoch's figures NaN. In an epoch that counted no step at all, the
metrics then held nothing, and Keras reported them as 0: a perfect `mae`,
which `EarlyStopping(restore_best_weights=True)` took as the best epoch and
restored the untrained weights from. The logs are then the last skipped
step's own, as Keras' own scaler (which counts a skipped step) reports it.
"""

import keras
import numpy as np
import pytest

import kmp

BATCH = 16


def _model():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_initializer="glorot_uniform")(inputs)
    model = kmp.Model(inputs, keras.layers.Dense(1)(hidden))
    # 2**20: every step of the first epoch overflows float16 (each skip only
    # halves the scale).
    model.compile(kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**20),
                  "mse", metrics=["mae"], overflow_retries=0)
    return model


def test_an_epoch_of_skipped_steps_logs_its_last_steps_figures_not_zero():
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True) * 3
    model = _model()
    last = slice(64 - BATCH, 64)
    predicted = keras.ops.convert_to_numpy(model(x[last])).astype("float64")
    stopping = keras.callbacks.EarlyStopping(monitor="mae", patience=10, restore_best_weights=True)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[stopping]).history
    assert int(model.optimizer.skipped_steps) == 4 and int(model.optimizer.iterations) == 0
    # The last batch, on the untrained weights (float16 compute on both sides).
    assert history["mae"][0] == pytest.approx(np.mean(np.abs(predicted - y[last])), rel=1e-3)
    assert history["loss"][0] == pytest.approx(np.mean((predicted - y[last]) ** 2), rel=1e-3)
    assert stopping.best == history["mae"][0] > 1.0
