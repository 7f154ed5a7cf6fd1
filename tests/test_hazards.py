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


# -- overflow retries ------------------------------------------------------


def _backward_overflow_data(batches=6, overflowing=(0, 3)):
    """Batches whose float16 gradients overflow at scale 2**15 but not at
    2**10 (|dW| ~ 32 * scale), with a finite loss: the targets are 20."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * batches, 4)).astype("float32")
    y = np.zeros((8 * batches, 1), "float32")
    for batch in overflowing:
        y[8 * batch:8 * (batch + 1)] = 20.0
    return x, y


def _fit_with_retries(retries, x, y, jit_compile=False, steps_per_execution=1):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    model.compile(
        keras.optimizers.SGD(1e-4), "mse", overflow_retries=retries,
        jit_compile=jit_compile, steps_per_execution=steps_per_execution,
    )
    weights = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: weights.append(np.asarray(model.weights[0]).copy())
    )
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                        callbacks=[callback]).history
    return model, history, weights


def test_without_retries_an_overflowing_batch_is_dropped():
    x, y = _backward_overflow_data()
    model, history, _ = _fit_with_retries(0, x, y)
    skipped = int(model.optimizer.skipped_steps)
    assert skipped >= 2 and int(model.optimizer.iterations) == 6 - skipped
    assert int(model.optimizer.counters["retries"]) == 0


@pytest.fixture(scope="module")
def unscaled_float32_kernel():
    """The kernel a float32 run with no scaling ends with on
    `_backward_overflow_data()` (SGD), trained once for the retries cases."""
    x, y = _backward_overflow_data()
    kmp.set_policy("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    reference = kmp.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    reference.compile(keras.optimizers.SGD(1e-4), "mse")
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return np.asarray(reference.weights[0])


@pytest.mark.parametrize("jit_compile, steps_per_execution", [(False, 1), (True, 1), (False, 3)])
def test_retries_redo_the_batch_at_a_lower_scale_and_lose_none(
    jit_compile, steps_per_execution, unscaled_float32_kernel
):
    x, y = _backward_overflow_data()
    model, history, _ = _fit_with_retries(
        8, x, y, jit_compile=jit_compile, steps_per_execution=steps_per_execution
    )
    optimizer = model.optimizer
    retried = int(optimizer.counters["retries"])
    assert int(optimizer.skipped_steps) == 0  # no batch lost
    assert int(optimizer.iterations) == 6  # every batch applied
    assert retried >= 1 and history["retried_steps"] == [retried]
    # Each retry halved the scale once.
    assert float(optimizer.loss_scale) == 2.0**15 * 0.5**retried
    # The same weights as a float32 run with no scaling (SGD, exact up to
    # float16 rounding of the forward pass).
    np.testing.assert_allclose(
        np.asarray(model.weights[0]), unscaled_float32_kernel, rtol=2e-2, atol=1e-5
    )


def test_a_forward_overflow_is_never_retried():
    x, y = _data(poisoned_batches=(2,))
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    # 2**8: no backward overflow on the clean batches, so any retry would be
    # the poisoned batch's.
    model.compile(
        kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**8), "mse",
        overflow_retries=3,
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    counters = model.optimizer.counters
    assert int(counters["retries"]) == 0
    assert int(model.optimizer.skipped_steps) == 1 and int(counters["forward_overflows"]) == 1


def test_overflow_retries_must_be_auto_or_a_non_negative_integer():
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    for bad in (-1, 1.5, True, "2", "Auto"):
        with pytest.raises(
            ValueError, match=r"`overflow_retries` must be 'auto' or an integer in \[0, "
        ):
            model.compile("sgd", "mse", overflow_retries=bad)
    model.compile("sgd", "mse", overflow_retries=2)
    assert model.get_compile_config()["overflow_retries"] == 2
    model.compile("sgd", "mse")
    assert model.get_compile_config()["overflow_retries"] == "auto"


def test_overflow_retries_under_a_merge_call_strategy_redo_the_batch(
        mirrored_strategy, unscaled_float32_kernel):
    # The train function redoes a batch on the host: a strategy whose step
    # needs `merge_call` retries as one without (before, a ValueError).
    kmp.set_policy("mixed_float16")
    x, y = _backward_overflow_data()
    with mirrored_strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
        model.compile(keras.optimizers.SGD(1e-4), "mse", overflow_retries=8)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    assert history["skipped_steps"] == [0] and history["retried_steps"][0] >= 1
    assert int(model.optimizer.iterations.numpy()) == 6
    np.testing.assert_allclose(
        np.asarray(model.weights[0]), unscaled_float32_kernel, rtol=2e-2, atol=1e-5
    )


def test_overflow_retries_with_a_custom_train_step_is_refused_clearly():
    class Custom(kmp.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((4,))
    model = Custom(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", overflow_retries=1)
    x, y = _data()
    with pytest.raises(ValueError, match="Custom overrides `train_step`"):
        model.fit(x, y, verbose=0)


def test_the_monitor_reports_retries_apart_from_skips(capsys):
    x, y = _backward_overflow_data()
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    model.compile(keras.optimizers.SGD(1e-4), "mse", overflow_retries=8)
    monitor = kmp.callbacks.LossScaleMonitor()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    retried = int(model.optimizer.counters["retries"])
    assert retried >= 1
    [summary] = monitor.epoch_summaries
    assert summary["retried"] == retried and summary["skipped"] == 0
    assert f"epoch 1: 0 of 6 steps skipped (0.0%, {retried} batches retried at a lower scale)" \
        in capsys.readouterr().out


def test_overflow_retries_with_gradient_accumulation_is_refused_clearly():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), "mse",
                  loss_scale="dynamic", overflow_retries=2)
    x, y = _data()
    with pytest.raises(ValueError, match="`overflow_retries` cannot be combined"):
        model.fit(x, y, batch_size=8, verbose=0)


_NO_STEP_APPLIED = """
import json, sys
import numpy as np, keras, kmp
kmp.set_policy("mixed_float16")
inputs = keras.Input((4,))
model = kmp.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
model.compile(keras.optimizers.SGD(0.01), "mse", overflow_retries=0)
# Targets 1e6, 2e6, 3e6 per batch: float32 losses of 1e12.., gradients past
# float16 at every scale down to min_scale: every step skipped.
x = np.ones((24, 4), "float32")
y = np.repeat([1e6, 2e6, 3e6], 8).astype("float32")[:, None]
history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
print(json.dumps({key: [float(v) for v in values] for key, values in history.items()}))
"""


def test_an_epoch_without_an_applied_step_logs_the_same_on_tensorflow_and_jax():
    """The same run on both backends, every step skipped: the same logs (the
    last skipped step's loss, the scale, the skips), not a mean on one and
    the last loss on the other."""
    import json
    import subprocess
    import sys

    from _helpers import child_env

    histories = {}
    for backend in ("tensorflow", "jax"):
        result = subprocess.run([sys.executable, "-c", _NO_STEP_APPLIED],
                                env=dict(child_env(), KERAS_BACKEND=backend),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        histories[backend] = json.loads(result.stdout.strip().splitlines()[-1])
    assert histories["tensorflow"] == histories["jax"]
    assert histories["jax"]["skipped_steps"] == [3, 6]
    last = float(np.float32(3e6) ** 2)  # the last batch's loss, in float32
    assert histories["jax"]["loss"] == [last, last]
    assert histories["jax"]["loss_scale"] == [2.0**12, 2.0**9]
