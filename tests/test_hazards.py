"""Hazards of reduced precision that cost users quietly (issue 17)."""

import keras
import numpy as np
import pytest

import kmp


def _fit_regression(x, y, strategy=None, steps_per_execution=1):
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else _no_scope()
    with scope:
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(
            kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**8),
            "mse", metrics=["mae"], steps_per_execution=steps_per_execution,
        )
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return model, history


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def _data(poisoned_batches=(), batches=6):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * batches, 4)).astype("float32")
    y = rng.normal(size=(8 * batches, 1)).astype("float32")
    for batch in poisoned_batches:
        x[8 * batch:8 * (batch + 1)] = 1e30  # a forward overflow: the loss is inf
    return x, y


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_skipped_steps_loss_and_metrics_stay_out_of_the_epochs_logs(steps_per_execution):
    kmp.set_policy("mixed_float16")
    x, y = _data(poisoned_batches=(2,))
    model, history = _fit_regression(x, y, steps_per_execution=steps_per_execution)
    assert history["skipped_steps"] == [1, 2]
    # A skipped step changes no weight: the run without that batch applies
    # the same steps to the same weights, so its logs are the reference.
    keep = np.r_[0:16, 24:48]
    _, reference = _fit_regression(x[keep], y[keep], steps_per_execution=steps_per_execution)
    for key in ("loss", "mae"):
        assert np.all(np.isfinite(history[key]))
        np.testing.assert_allclose(history[key], reference[key], rtol=1e-6)


def test_an_epoch_without_an_applied_step_still_shows_its_loss():
    kmp.set_policy("mixed_float16")
    x, y = _data(poisoned_batches=range(6))
    model, history = _fit_regression(x, y)
    assert history["skipped_steps"] == [6, 12]
    assert not np.isfinite(history["loss"][0])  # not Keras' 0 of an empty mean
    assert int(model.optimizer.iterations) == 0


def test_skipped_step_kept_out_of_the_logs_under_mirrored(mirrored_strategy):
    kmp.set_policy("mixed_float16")
    x, y = _data(poisoned_batches=(2,))
    _, history = _fit_regression(x, y, strategy=mirrored_strategy)
    keep = np.r_[0:16, 24:48]
    _, reference = _fit_regression(x[keep], y[keep], strategy=mirrored_strategy)
    assert history["skipped_steps"] == [1, 2]
    np.testing.assert_allclose(history["loss"], reference["loss"], rtol=1e-5)
