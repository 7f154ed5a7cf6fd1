"""The scale starts where it should: no batch lost while it settles.

`kmp.Model.compile`'s default `overflow_retries="auto"` redoes the first batch
until the scale has found its level, then skips an overflowing batch as
Keras does (the host reads no flag once settled); a recompile keeps the
scaler's state; `apply` says whether a step was applied, so a custom loop
can redo a batch.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

from kmp.scaling import _model_step
from kmp.scaling import _retry

def _overflowing_regression(steps, **compile_kwargs):
    """A float16 regression whose first gradients overflow at 2**15 (targets
    ~300: d(mse)/dw ~ 600 per unit input, times 2**15 > float16's max) but not
    at 2**6."""
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(1e-4), "mse", **compile_kwargs)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * steps, 4)).astype("float32")
    y = (300.0 + rng.normal(size=(8 * steps, 1))).astype("float32")
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    return model, history


def test_the_default_loses_no_batch_while_the_scale_settles():
    model, history = _overflowing_regression(6)
    optimizer = model.optimizer
    assert int(optimizer.skipped_steps) == 0
    assert int(optimizer.iterations) == 6  # every batch applied
    retries = int(optimizer.counters["retries"])
    assert retries >= 5  # the first batch backed the scale off that often
    # Each retry halved the scale once; nothing grew in six steps.
    assert float(optimizer.loss_scale) == 2.0**15 / 2**retries
    assert history["retried_steps"] == [retries] and history["skipped_steps"] == [0]
    assert np.all(np.isfinite(model.get_weights()[0]))


def test_without_retries_the_same_run_drops_the_first_batches():
    model, history = _overflowing_regression(6, overflow_retries=0)
    skipped = int(model.optimizer.skipped_steps)
    assert skipped >= 5 and int(model.optimizer.iterations) == 6 - skipped
    assert "retried_steps" not in history


def test_after_the_first_applied_step_auto_reads_no_flag():
    model, _ = _overflowing_regression(2)
    retries = _model_step.retries(model, own_step=True)
    assert retries.settled and retries.budget() == 0  # skip, as Keras; nothing read
    fresh = _regression_model()
    retries = _model_step.retries(fresh, own_step=True)
    assert not retries.settled and retries.budget() == _retry.SETTLING_RETRIES == 32


def _regression_model(**compile_kwargs):
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", **compile_kwargs)
    return model


def test_auto_has_no_retries_for_a_scaler_the_user_made_or_a_fixed_one():
    model = _regression_model()
    assert model.get_compile_config()["overflow_retries"] == "auto"
    assert _model_step.retries(model, own_step=False) is None  # a subclass's own step
    model.compile(kmp.LossScaleOptimizer("sgd"), "mse")
    assert _model_step.retries(model, own_step=True) is None
    model.compile("sgd", "mse", loss_scale=256)
    assert _model_step.retries(model, own_step=True) is None
    model.compile(kmp.LossScaleOptimizer("sgd"), "mse", overflow_retries=3)
    assert _model_step.retries(model, own_step=True).budget() == 3


def test_retries_run_under_a_merge_call_strategy(mirrored_strategy):
    """The train function redoes a batch on the host, so a strategy whose
    step needs `merge_call` retries as one without: both replicas redo it."""
    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (300.0 + rng.normal(size=(32, 1))).astype("float32")
    with mirrored_strategy.scope():
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(1e-4), "mse", jit_compile=False)
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    assert history["skipped_steps"] == [0] and history["retried_steps"][0] >= 5
    assert int(model.optimizer.iterations.numpy()) == 4


def test_a_rare_overflowing_batch_moves_the_scale_as_a_skip_would():
    """A batch that overflows at the settled scale (one batch of 8 with a
    target 64x larger) is redone once at half the scale instead of dropped:
    the scale ends where dropping it would have left it."""
    def run(**compile_kwargs):
        kmp.set_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(kmp.LossScaleOptimizer(keras.optimizers.SGD(1e-6), initial_scale=256.0),
                      "mse", **compile_kwargs)
        rng = np.random.default_rng(1)
        x = rng.normal(size=(64, 4)).astype("float32")
        y = np.full((64, 1), 3.0, "float32")
        y[40:48] = 3.0 * 64
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model.optimizer

    # The scaler is the user's (made with its own initial scale): retries
    # are asked for, as "auto" gives them only to a scaler kmp made.
    dropped, retried = run(overflow_retries=0), run(overflow_retries=1)
    assert int(dropped.skipped_steps) == 1 and int(dropped.iterations) == 7
    assert int(retried.skipped_steps) == 0 and int(retried.iterations) == 8
    assert int(retried.counters["retries"]) == 1
    assert float(retried.loss_scale) == float(dropped.loss_scale) == 128.0


def test_recompiling_keeps_the_scale_and_counters():
    model, _ = _overflowing_regression(3, overflow_retries=0)
    before = model.optimizer
    scale, counters = float(before.loss_scale), before._counters.numpy()
    assert scale < 2.0**15 and counters[2] > 0  # it backed off and skipped

    model.compile(keras.optimizers.SGD(1e-5), "mse")  # a fine-tune
    assert model.optimizer is not before
    assert float(model.optimizer.loss_scale) == scale
    np.testing.assert_array_equal(model.optimizer._counters.numpy(), counters)
    assert int(model.optimizer.skipped_steps) == int(before.skipped_steps)

    # A scaler the user passes starts as it was made.
    model.compile(kmp.LossScaleOptimizer(keras.optimizers.SGD(1e-5)), "mse")
    assert float(model.optimizer.loss_scale) == 2.0**15
    assert int(model.optimizer.skipped_steps) == 0


def test_a_fine_tune_after_recompiling_loses_no_batch():
    model, _ = _overflowing_regression(4)  # the scale settles on the first batch
    settled = float(model.optimizer.loss_scale)
    # The same batches again, without retries: at the settled scale they pass;
    # a fresh scaler at 2**15 would drop the first ones again.
    model.compile(keras.optimizers.SGD(1e-5), "mse", overflow_retries=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (300.0 + rng.normal(size=(32, 1))).astype("float32")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(model.optimizer.skipped_steps) == 0
    assert int(model.optimizer.iterations.numpy()) == 4
    assert float(model.optimizer.loss_scale) == settled


@pytest.mark.parametrize("traced", [False, True])
def test_apply_says_whether_the_step_was_applied_and_a_loop_can_redo_it(traced):
    # d(loss)/dw = 2e34: finite times 2**14, inf (float32) times 2**15.
    w = keras.Variable([1.0])
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(1e-36))

    def train_on(batch_weight):
        # The README's loop recipe: redo a batch whose gradients overflowed.
        for _ in range(4):
            applied = optimizer.apply(tape_gradients(optimizer, w, batch_weight), [w])
            if applied:
                break
        return applied

    if traced:
        step = tf.function(lambda: optimizer.apply(
            tape_gradients(optimizer, w, 2e34), [w]))
        first = step()
        assert isinstance(first, tf.Tensor) and first.dtype == tf.bool
        assert not bool(first) and bool(step())
    else:
        assert bool(train_on(2e34))
    assert int(optimizer.skipped_steps) == 1 and int(optimizer.iterations) == 1
    assert float(optimizer.loss_scale) == 2.0**14
    np.testing.assert_allclose(w.numpy(), [1.0 - 1e-36 * 2e34], rtol=1e-6)


def tape_gradients(optimizer, w, batch_weight):
    with tf.GradientTape() as tape:
        scaled_loss = optimizer.scale_loss(batch_weight * w[0])
    return tape.gradient(scaled_loss, [w])


def test_apply_without_scaling_says_applied():
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), enabled=False)
    w = keras.Variable([1.0])
    assert bool(optimizer.apply([tf.constant([1.0])], [w]))


class CountsCalls(keras.layers.Layer):
    """Passes its input on and counts the forward passes that ran in
    training: a side effect a retry would run again. kmp.Model puts back
    what the forward pass of a skipped or redone attempt wrote (as a
    BatchNormalization's moving statistics), so on it the count is of the
    attempts that counted."""

    def build(self, input_shape):
        # int64, as Keras' own `iterations`: TensorFlow keeps an int32
        # variable in host memory on a GPU, where no XLA step can write it.
        self.calls = self.add_weight(shape=(), dtype="int64", initializer="zeros",
                                     trainable=False, name="calls")

    def call(self, x, training=False):
        if training:
            self.calls.assign_add(1)
        return x


def _fit_with_one_overflowing_batch(base, optimizer, **compile_kwargs):
    """4 batches of 8; the 2nd has sample weights of 1e6, whose gradients
    overflow float16 at any scale the scaler reaches in one or two halvings.
    The others (targets ~0.1) are finite at 2**15.

    Returns:
        `(model, history, forward passes in training)`.
    """
    from _helpers import overflowing_sample_weights

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    counter = CountsCalls()
    outputs = keras.layers.Dense(1, kernel_initializer="zeros")(counter(inputs))
    model = base(inputs, outputs)
    if base is kmp.Model:
        model.compile(optimizer, "mse", **compile_kwargs)
    else:
        model.compile(optimizer, "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = np.full((32, 1), 0.1, "float32")
    weights = overflowing_sample_weights(32, 8, [2])
    history = model.fit(x, y, sample_weight=weights, batch_size=8, shuffle=False,
                        verbose=0).history
    return model, history, int(counter.calls.numpy())


@pytest.mark.parametrize("scaler", ["kmp", "keras"])
def test_a_scaler_the_user_made_skips_as_in_keras_without_retries(scaler):
    """Issue 30: `overflow_retries="auto"` redid the overflowing batch of a
    scaler the user passed (a layer with side effects ran twice); retries by
    default belong to the scaler kmp made."""
    make = {"kmp": kmp.LossScaleOptimizer, "keras": keras.optimizers.LossScaleOptimizer}[scaler]
    model, history, calls = _fit_with_one_overflowing_batch(
        kmp.Model, make(keras.optimizers.SGD(0.01), initial_scale=256.0)
    )
    # Keras' own scaler on keras.Model: the reference.
    reference, _, reference_calls = _fit_with_one_overflowing_batch(
        keras.Model, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01),
                                                         initial_scale=256.0)
    )
    # One forward pass per batch; the skipped batch's is put back by kmp's
    # step (Keras' keeps what a skipped step's forward pass wrote).
    assert reference_calls == 4 and calls == 3
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 3
    assert float(model.optimizer.loss_scale) == float(reference.optimizer.dynamic_scale) == 128.0
    assert int(model.optimizer.skipped_steps) == 1 and history["skipped_steps"] == [1]
    assert int(model.optimizer.counters["retries"]) == 0
    assert "retried_steps" not in history
    for weight, expected in zip(model.trainable_weights, reference.trainable_weights):
        np.testing.assert_allclose(weight.numpy(), expected.numpy(), rtol=1e-3)


def test_the_scaler_kmp_made_skips_once_settled_and_a_user_can_ask_for_retries():
    model, history, calls = _fit_with_one_overflowing_batch(kmp.Model, keras.optimizers.SGD(0.01))
    # The first batch settled the scale (it was applied): the overflowing
    # second batch is skipped, as Keras skips it, not redone: 4 batches, of
    # which the 3 applied steps' forward passes count.
    assert history["retried_steps"] == [0] and calls == 3
    assert int(model.optimizer.skipped_steps) == 1 and int(model.optimizer.iterations) == 3
    _, history, calls = _fit_with_one_overflowing_batch(
        kmp.Model, kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=256.0),
        overflow_retries=2,
    )
    assert history["retried_steps"] == [2] and calls == 3


def test_who_made_the_scaler_survives_recompile_keras_file_and_load_model(tmp_path):
    def retries(model):
        return _model_step.retries(model, own_step=True) is not None

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")

    model.compile("sgd", "mse")
    assert retries(model) and model.get_compile_config()["users_scaler"] is False
    model.compile(model.optimizer, "mse")  # kmp's own scaler, compiled again
    assert retries(model)
    users = kmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0)
    model.compile(users, "mse")
    assert not retries(model) and model.get_compile_config()["users_scaler"] is True
    model.compile(model.optimizer, "mse")  # still the user's
    assert not retries(model)
    model.compile(users, "mse", overflow_retries=3)
    assert _model_step.retries(model, own_step=True).budget() == 3
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0),
                  "mse")
    assert not retries(model)  # Keras' scaler, taken over by kmp's, is the user's
    assert float(model.optimizer.loss_scale) == 8.0  # and starts as the user made it

    for users_scaler in (True, False):
        model.compile(users if users_scaler else "sgd", "mse")
        model.fit(x, y, verbose=0)
        path = tmp_path / f"users_{users_scaler}.keras"
        model.save(path)
        for loaded in (keras.models.load_model(path), kmp.load_model(path),
                       kmp.load_model(path, policy="mixed_float16")):
            assert type(loaded.optimizer) is kmp.LossScaleOptimizer
            assert retries(loaded) is not users_scaler
            assert loaded.get_compile_config()["users_scaler"] is users_scaler
        history = loaded.fit(x, y, verbose=0).history
        assert ("retried_steps" in history) is not users_scaler

    # Saved without scaling, loaded under float16: the scaler kmp.load_model
    # adds is kmp's.
    kmp.set_policy("float32")
    inputs = keras.Input((4,))
    plain = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    plain.compile("sgd", "mse")
    plain.fit(x, y, verbose=0)
    plain.save(tmp_path / "plain.keras")
    loaded = kmp.load_model(tmp_path / "plain.keras", policy="mixed_float16")
    assert type(loaded.optimizer) is kmp.LossScaleOptimizer and retries(loaded)
