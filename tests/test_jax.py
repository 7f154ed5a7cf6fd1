"""kmp on Keras' JAX backend (the suite's `KERAS_BACKEND=jax` pass).

Each part of what a JAX user runs: the policy, `kmp.Model`'s fit, evaluate
and predict, the scaler as a functional optimizer under `jax.jit` (against
the plain-Python state machine), a custom stateless `train_step` and a
`jax.grad` loop with their one line, the logs and the monitor, data parallel
over two host devices, export, `.keras` files, and the clear errors for what
stays TensorFlow-only. `tests/conftest.py` runs this file only in that pass.
"""

import csv
import os
import subprocess
import sys
import warnings

import jax
import keras
import numpy as np
import pytest
from _helpers import ReferenceScaler
from _helpers import activations_overflowing_in_the_second_batch
from keras import ops

import kmp
from kmp.precision import _hardware

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the KERAS_BACKEND=jax pass runs it"
)


def _mlp(outputs=3, activation=None, width=16):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    return kmp.Model(inputs, keras.layers.Dense(outputs, activation=activation)(hidden))


def _data(rows=64, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((rows, 8), dtype=np.float32), rng.integers(0, classes, rows)


def _values(variables):
    return [np.asarray(v.value if hasattr(v, "value") else v) for v in variables]


def _overflowing_at_first():
    """A float16 model at scale 2**24 and 32 rows, one of which overflows
    its gradients until the scale has backed off far enough."""
    kmp.set_policy("mixed_float16")
    model = _mlp()
    model.compile(kmp.LossScaleOptimizer("sgd", initial_scale=2.0**24),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(rows=32)
    x[0] = 3e4
    return model, x, y


# -- the policy ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, compute",
    [("float32", "float32"), ("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")],
)
def test_set_policy_sets_keras_global_policy_on_jax(name, compute):
    policy = kmp.set_policy(name)
    assert policy.compute_dtype == compute
    assert keras.config.dtype_policy().compute_dtype == compute
    assert keras.layers.Dense(2).dtype_policy.compute_dtype == compute


def test_auto_asks_jax_for_gpus_and_picks_float32_on_a_cpu():
    gpus = _hardware._gpus()
    assert [d.platform for d in jax.devices()].count("gpu") == len(gpus)
    policy = kmp.set_policy("auto")
    if gpus:
        expected, _ = _hardware._choose_auto_policy(
            _hardware._gpu_compute_capabilities(), _hardware._cpu_flags()
        )
        assert policy.name == expected
    else:
        # XLA's CPU backend emulates bfloat16, whatever the CPU's flags.
        assert policy.name == "float32"
        assert "XLA" in policy.reason
    assert kmp.get_policy().reason.startswith("auto: ")


def test_auto_on_a_jax_gpu_follows_the_compute_capability(monkeypatch):
    monkeypatch.setattr(_hardware, "_gpus", lambda: [
        ("gpu:0", {"device_name": "NVIDIA H100", "compute_capability": (9, 0)})
    ])
    assert kmp.set_policy("auto").name == "mixed_bfloat16"
    monkeypatch.setattr(_hardware, "_gpus", lambda: [
        ("gpu:0", {"device_name": "Tesla V100", "compute_capability": (7, 0)})
    ])
    assert kmp.set_policy("auto").name == "mixed_float16"


# -- kmp.Model: fit, evaluate, predict ------------------------------------------


def test_fit_evaluate_predict_in_float16_log_the_scaler_and_return_float32():
    kmp.set_policy("mixed_float16")
    model = _mlp(activation="softmax")
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    x, y = _data()
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    assert history.history["loss_scale"] == [2.0**15, 2.0**15]
    assert history.history["skipped_steps"] == [0, 0]
    assert history.history["loss"][1] < history.history["loss"][0]
    assert int(model.optimizer.iterations) == 8
    assert model.layers[1].compute_dtype == "float16"
    predictions = model.predict(x[:4], verbose=0)
    assert predictions.dtype == np.float32
    np.testing.assert_allclose(predictions.sum(axis=1), 1.0, rtol=1e-3)
    assert model(x[:4]).dtype == "float32"
    loss, accuracy = model.evaluate(x, y, verbose=0)
    assert np.isfinite(loss) and 0 <= accuracy <= 1


class _SchedulerOfTheGuide(keras.callbacks.Callback):
    """keras.io's callbacks guide: the optimizer's own learning rate set
    back on it at each epoch's start (its value for an unlisted epoch)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.model.optimizer.learning_rate = self.model.optimizer.learning_rate


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_learning_rate_set_through_the_scaler_trains_as_one_left_alone(policy):
    # The scaler then tracked the inner optimizer's rate in its own list too:
    # its buffer donated twice, or "Invalid variable value in StatelessScope".
    histories = []
    for callbacks in ([], [_SchedulerOfTheGuide()]):
        kmp.set_policy(policy)
        keras.utils.set_random_seed(0)
        model = _mlp()
        model.compile(keras.optimizers.RMSprop(0.01), "sparse_categorical_crossentropy")
        x, y = _data()
        histories.append(model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                                   callbacks=callbacks).history)
    assert histories[1] == histories[0]
    variables = model.optimizer.variables
    assert len({id(v) for v in variables}) == len(variables)
    assert sum(v is model.optimizer.inner_optimizer.learning_rate for v in variables) == 1


def test_the_progress_bar_shows_the_scale_as_an_integer_and_the_skips(capsys):
    model, x, y = _overflowing_at_first()
    model.fit(x, y, batch_size=32, epochs=2, verbose=2)
    out = capsys.readouterr().out
    skipped = int(model.optimizer.skipped_steps)
    scale = int(float(model.optimizer.loss_scale))
    assert skipped >= 1
    if tuple(int(part) for part in keras.__version__.split(".")[:2]) >= (3, 12):
        assert f"loss_scale: {scale} - skipped_steps: {skipped}" in out
    else:  # Keras 3.10 and 3.11 format every value themselves (kmp/monitor/_progbar.py)
        assert f"loss_scale: {scale}.0000 - skipped_steps: {skipped}.0000" in out
    # And the line fit ends with, since no monitor is attached.
    assert f"{skipped} of 2 training steps were skipped" in out


def test_a_step_that_overflows_changes_no_weight_slot_or_iteration_and_is_counted():
    kmp.set_policy("mixed_float16")
    model = _mlp()
    optimizer = kmp.LossScaleOptimizer("adam", initial_scale=2.0**8, growth_interval=5)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    x, y = _data(rows=16)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # builds; finite at 2**8
    assert int(optimizer.iterations) == 1
    weights, slots = _values(model.trainable_variables), _values(optimizer.inner_optimizer.variables)
    before = {k: int(v) for k, v in optimizer.counters.items()}
    history = model.fit(x * 1e5, y, batch_size=16, epochs=1, verbose=0)  # float16 overflows
    for old, new in zip(weights, _values(model.trainable_variables)):
        np.testing.assert_array_equal(old, new)
    for old, new in zip(slots, _values(optimizer.inner_optimizer.variables)):
        np.testing.assert_array_equal(old, new)
    assert int(optimizer.iterations) == 1
    assert int(optimizer.skipped_steps) == before["skipped_steps"] + 1
    assert float(optimizer.loss_scale) == 2.0**7
    assert history.history["skipped_steps"] == [1]
    # An epoch of no applied step logs the skipped step's own metrics (Keras'
    # mean of no step would read 0): those of the same batch, evaluated.
    evaluated = model.evaluate(x * 1e5, y, batch_size=16, verbose=0, return_dict=True)
    assert history.history["accuracy"] == [pytest.approx(evaluated["accuracy"])]


def test_steps_per_execution_and_eager_steps_count_as_the_jitted_step():
    def run(**compile_kwargs):
        keras.utils.set_random_seed(0)
        kmp.set_policy("mixed_float16")
        model = _mlp()
        model.compile(kmp.LossScaleOptimizer("sgd", initial_scale=2.0**24),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs)
        x, y = _data(rows=64)
        x[0] = 3e4
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return (history.history["skipped_steps"], history.history["loss_scale"],
                int(model.optimizer.iterations), _values(model.trainable_variables))

    reference = run()
    assert reference[0][-1] >= 1
    for kwargs in (dict(steps_per_execution=2), dict(run_eagerly=True)):
        other = run(**kwargs)
        assert other[:3] == reference[:3], kwargs
        for ours, theirs in zip(other[3], reference[3]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_overflow_retries_redo_a_batch_on_jax_as_on_tensorflow():
    # Before, an int was refused on JAX: kmp's train function now redoes a
    # batch on the host there too (kmp/scaling/_retry.py).
    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (300.0 + rng.normal(size=(32, 1))).astype("float32")  # overflows at 2**15
    results = {}
    for retries in (2, 0):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(1e-4), "mse", overflow_retries=retries)
        results[retries] = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    assert results[2]["retried_steps"][0] > 0 and "retried_steps" not in results[0]
    # Two retries a batch lose fewer batches than none.
    assert results[2]["skipped_steps"][0] < results[0]["skipped_steps"][0]


def test_float32_layers_and_exact_token_ids_are_settled_on_jax():
    kmp.set_policy("mixed_float16")
    ids = keras.Input((4,))
    embedded = keras.layers.Embedding(5000, 4)(ids)
    normalized = keras.layers.UnitNormalization()(embedded)
    model = kmp.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(normalized)))
    x = np.array([[2049.0, 4095.0, 3.0, 4999.0]], np.float32)  # not float16-exact
    out = model.predict(x, verbose=0)
    assert out.dtype == np.float32
    table = np.asarray(model.layers[1].embeddings.value)
    # What the embedding looked up: the rows of the exact ids.
    probe = keras.Model(ids, model.layers[1].output)
    looked_up = np.asarray(probe.predict(x, verbose=0), np.float32)
    np.testing.assert_allclose(looked_up[0], table[[2049, 4095, 3, 4999]].astype(np.float16),
                               rtol=0, atol=0)
    assert model.layers[2].compute_dtype == "float32"


def test_convert_and_summary_bring_a_plain_keras_model_to_jax():
    plain = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16), keras.layers.LayerNormalization(),
        keras.layers.Dense(3),
    ])
    kmp.set_policy("mixed_float16")
    model = kmp.convert(plain)
    assert [layer.name for layer in model.layers] == [layer.name for layer in plain.layers]
    assert plain.layers[0].compute_dtype == "float32"  # the argument is untouched
    lines = []
    rows = kmp.summary(model, print_fn=lines.append)
    assert [r["compute_dtype"] for r in rows if r["class"] == "Dense"] == ["float16", "float16"]
    assert "mixed_float16" in lines[0]
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    history = model.fit(x, y, epochs=1, verbose=0)
    assert history.history["loss_scale"] == [2.0**15]
    assert model.predict(x[:2], verbose=0).dtype == np.float32


# -- the scaler as a functional optimizer ----------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        dict(initial_scale=8.0, growth_interval=2, hysteresis=1),
        dict(initial_scale=2.0**10, growth_interval=3, hysteresis=2, backoff_factor=0.25),
        dict(initial_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0),
        dict(initial_scale=64.0, dynamic=False),
    ],
)
def test_stateless_apply_under_jit_follows_the_reference_state_machine(config):
    rng = np.random.default_rng(1)
    w = keras.Variable(rng.normal(size=(3,)).astype("float32"))
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **config)
    optimizer.build([w])
    reference = ReferenceScaler(**config)
    apply = jax.jit(optimizer.stateless_apply)
    weights, values = [w.value], [v.value for v in optimizer.variables]
    expected = np.asarray(w.value, np.float64)
    for finite in [True, True, False, True, False, False, True, True, True, False, True]:
        gradient = rng.normal(size=(3,)).astype("float32")
        scaled = gradient * np.float32(reference.scale)
        if not finite:
            scaled[1] = np.inf if rng.random() < 0.5 else np.nan
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, values))):
            optimizer.scale_loss(1.0)  # the step's loss went through scale_loss
        weights, values = apply(values, [scaled], weights)
        if finite:
            expected = expected - 0.1 * np.float64(gradient)
        reference.step(finite)
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, values))):
            assert float(optimizer.loss_scale) == reference.scale
            counters = {k: int(v) for k, v in optimizer.counters.items()}
            assert int(optimizer.iterations) == reference.applied_steps
        assert counters["skipped_steps"] == reference.skipped_steps
        if reference.dynamic:
            assert counters["good_steps"] == reference.good_steps
            assert counters["hysteresis_left"] == reference.hysteresis_left
        np.testing.assert_allclose(np.asarray(weights[0]), expected, rtol=1e-6)


def test_a_skipped_stateless_step_returns_the_inner_slots_and_weights_unchanged():
    w = keras.Variable(np.ones((2,), "float32"))
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(0.1))
    optimizer.build([w])
    values = [v.value for v in optimizer.variables]
    weights, new_values = jax.jit(optimizer.stateless_apply)(
        values, [np.array([np.nan, 1.0], np.float32)], [w.value]
    )
    np.testing.assert_array_equal(np.asarray(weights[0]), np.ones(2))
    inner = {id(v) for v in optimizer.inner_optimizer.variables}
    for variable, old, new in zip(optimizer.variables, values, new_values):
        if id(variable) in inner:
            np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, new_values))):
        assert float(optimizer.loss_scale) == 2.0**14
        assert int(optimizer.skipped_steps) == 1


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_stateless_apply_given_the_loss_counts_its_overflow_as_fit_counts_it(traced):
    """A loss that overflowed, with gradients that did too (a forward
    overflow) or not (a NaN term no weight depends on): given `loss=`, the
    step is skipped and counted as a forward overflow, as kmp.Model's step
    counts it; without it, as before, the gradients alone decide."""
    w = keras.Variable(np.ones((2,), "float32"))
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    optimizer.build([w])

    def step(values, gradient, loss, give_loss):
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, values))):
            optimizer.scale_loss(1.0)  # the step's loss went through scale_loss
        kwargs = {"loss": loss} if give_loss else {}
        return optimizer.stateless_apply(values, [gradient], [w.value], **kwargs)

    if traced:
        step = jax.jit(step, static_argnums=3)

    def after(gradient, loss, give_loss):
        weights, values = step([v.value for v in optimizer.variables],
                               np.asarray(gradient, np.float32), np.float32(loss), give_loss)
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, values))):
            counters = {k: int(v) for k, v in optimizer.counters.items()}
            return np.asarray(weights[0]), counters, float(optimizer.loss_scale)

    scale = 2.0**15
    both = ([np.inf, 1.0], np.inf)  # loss and gradients overflowed
    nan_term = ([scale, scale], np.nan)  # finite gradients (1 each, unscaled)
    for gradient, loss in (both, nan_term):
        weights, counters, new_scale = after(gradient, loss, give_loss=True)
        np.testing.assert_array_equal(weights, [1.0, 1.0])
        assert (counters["skipped_steps"], counters["forward_overflows"]) == (1, 1)
        assert counters["consecutive_forward_overflows"] == 1 and new_scale == scale / 2
    weights, counters, _ = after(*both, give_loss=False)
    assert (counters["skipped_steps"], counters["forward_overflows"]) == (1, 0)
    weights, counters, new_scale = after(*nan_term, give_loss=False)
    np.testing.assert_array_equal(weights, [0.5, 0.5])  # applied: the loss was not seen
    assert counters["skipped_steps"] == 0 and new_scale == scale
    # A finite loss changes nothing.
    weights, counters, _ = after([scale, scale], 1.0, give_loss=True)
    np.testing.assert_array_equal(weights, [0.5, 0.5])
    assert counters["skipped_steps"] == 0


def test_stateless_apply_needs_a_built_optimizer():
    optimizer = kmp.LossScaleOptimizer("sgd")
    with pytest.raises(ValueError, match="must be built"):
        optimizer.stateless_apply([], [], [])


def test_gradient_accumulation_is_a_clear_error_on_jax():
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match=r"JAX backend.*gradient_accumulation_steps=2"):
        optimizer.build([keras.Variable(np.ones(2, "float32"))])


def test_accumulation_under_bfloat16_names_the_compile_argument_that_trains_it():
    # Under mixed_bfloat16 the scaler is the guard kmp's compile added: its
    # error now says how to train as Keras does, which fits.
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((3,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    model.compile(keras.optimizers.SGD(gradient_accumulation_steps=2), "mse")
    with pytest.raises(ValueError, match=r"compile with `skip_nonfinite=False`.*"
                                         r"gradient_accumulation_steps=2"):
        model.fit(x, y, batch_size=4, verbose=0)
    model.compile(keras.optimizers.SGD(gradient_accumulation_steps=2), "mse", skip_nonfinite=False)
    model.fit(x, y, batch_size=4, verbose=0)
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    plain = keras.Model(inputs, model.layers[-1](inputs))  # the same layer, Keras' step
    plain.compile(keras.optimizers.SGD(gradient_accumulation_steps=2), "mse")
    plain.fit(x, y, batch_size=4, verbose=0)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 1


def _grad_loop(model, optimizer, x, y, steps, scale_line=True):
    """keras.io's stateless JAX loop; `scale_line`: the one line kmp adds."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compute_loss(trainable, non_trainable, optimizer_variables, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x)
        loss = loss_fn(y, y_pred)
        if scale_line:
            return optimizer.stateless_scale_loss(optimizer_variables, loss), (loss, non_trainable)
        return loss, (loss, non_trainable)

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    @jax.jit
    def train_step(state, x, y):
        trainable, non_trainable, optimizer_variables = state
        (_, (loss, non_trainable)), grads = grad_fn(
            trainable, non_trainable, optimizer_variables, x, y
        )
        trainable, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return loss, (trainable, non_trainable, optimizer_variables)

    optimizer.build(model.trainable_variables)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    for _ in range(steps):
        loss, state = train_step(state, x, y)
    return float(loss), state


def test_a_jax_grad_loop_with_one_line_equals_the_unscaled_float32_loop():
    x, y = _data(rows=32)
    keras.utils.set_random_seed(3)
    model = _mlp()
    initial = _values(model.trainable_variables)
    _, (scaled_weights, _, optimizer_values) = _grad_loop(
        model, kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)), x, y, steps=5
    )
    for variable, value in zip(model.trainable_variables, initial):
        variable.assign(value)
    _, (plain_weights, _, _) = _grad_loop(model, keras.optimizers.SGD(0.1), x, y, steps=5,
                                          scale_line=False)
    # Scaling by 2**15 and dividing again is exact in float32.
    for scaled, plain in zip(scaled_weights, plain_weights):
        np.testing.assert_array_equal(np.asarray(scaled), np.asarray(plain))
    assert float(optimizer_values[2]) == 2.0**15  # the loss_scale variable


def test_a_jax_grad_loop_without_the_line_warns_once_naming_it():
    x, y = _data(rows=32)
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _grad_loop(_mlp(), optimizer, x, y, steps=3, scale_line=False)
    messages = [str(w.message) for w in caught if "kmp.LossScaleOptimizer" in str(w.message)]
    assert len(messages) == 1
    assert "scale_loss" in messages[0] and "divided" in messages[0]


class _StatelessStepModel(kmp.Model):
    """keras.io's "customizing fit() with JAX" model, with kmp's one line
    (Keras' own `self.optimizer.scale_loss(loss)`)."""

    def __init__(self, scale_line=True, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)
        self.scale_line = scale_line

    def call(self, x):
        return self.out(self.hidden(x))

    def compute_loss_and_updates(self, trainable, non_trainable, optimizer_variables, x, y):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
        loss = ops.mean(ops.square(y_pred - y))
        if self.scale_line:
            scaled = self.optimizer.scale_loss(loss)
        else:
            scaled = loss
        return scaled, (loss, non_trainable)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (_, (loss, non_trainable)), grads = grad_fn(
            trainable, non_trainable, optimizer_variables, x, y
        )
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


@pytest.mark.parametrize("scale_line", [True, False])
def test_a_custom_stateless_train_step_is_protected_and_reports(scale_line):
    kmp.set_policy("float32")
    x = np.random.default_rng(0).random((32, 8), dtype=np.float32)
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(5)
    model = _StatelessStepModel(scale_line=scale_line)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss_scale="dynamic")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    messages = [str(w.message) for w in caught if "kmp.LossScaleOptimizer" in str(w.message)]
    assert history.history["loss_scale"] == [2.0**15, 2.0**15]
    assert history.history["skipped_steps"] == [0, 0]
    # The same steps as plain SGD on the unscaled loss: with the line the
    # scale cancels exactly; without it the gradients are applied as they
    # are (never divided by 2**15), and a warning names the line.
    keras.utils.set_random_seed(5)
    reference = _StatelessStepModel(scale_line=False)
    reference.compile(optimizer=keras.optimizers.SGD(0.01), loss_scale=None)
    reference.fit(x, y, epochs=2, batch_size=32, verbose=0)
    for ours, theirs in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(np.asarray(ours.value), np.asarray(theirs.value), rtol=1e-6)
    if scale_line:
        assert messages == []
    else:
        assert len(messages) == 1
        assert "`scaled_loss = self.optimizer.scale_loss(loss)`" in messages[0]


def test_eager_apply_skips_and_counts_like_the_traced_step():
    optimizer = kmp.LossScaleOptimizer("sgd", initial_scale=8.0)
    w = keras.Variable(np.ones((3,), "float32"))
    optimizer.build([w])
    grads = jax.grad(lambda v: optimizer.scale_loss(ops.sum(v * 2.0)))(w.value)
    assert bool(optimizer.apply([grads], [w]))
    np.testing.assert_allclose(np.asarray(w.value), 1.0 - 0.01 * 2.0)
    grads = jax.grad(lambda v: optimizer.scale_loss(ops.sum(v * np.inf)))(w.value)
    assert not bool(optimizer.apply([grads], [w]))
    np.testing.assert_allclose(np.asarray(w.value), 1.0 - 0.01 * 2.0)
    assert float(optimizer.loss_scale) == 4.0 and int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("clip_type", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_set_after_construction_clips_the_next_step_on_jax(clip_type, traced):
    # tf-keras' testClipping, on JAX: the scaler's clipping attributes are the
    # inner optimizer's, so a clip set later clips the next step (issue 30).
    var = keras.Variable(np.array([5.0], "float32"))
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(2.0), initial_scale=2.0,
                                       growth_interval=1, **{clip_type: 2.0})
    optimizer.build([var])

    def step(factor):
        if not traced:
            grads = jax.grad(lambda w: optimizer.scale_loss(ops.sum(w * factor)))(var.value)
            optimizer.apply([grads], [var])
            return

        def pure_step(values, weights):
            grads = jax.grad(lambda w: optimizer.stateless_scale_loss(
                values, ops.sum(w[0] * factor)))(weights)
            return optimizer.stateless_apply(values, grads, weights)

        # A new trace per step: a traced step reads the clip when traced.
        weights, values = jax.jit(pure_step)([v.value for v in optimizer.variables], [var.value])
        var.assign(weights[0])
        for variable, value in zip(optimizer.variables, values):
            variable.assign(value)

    step(4.0)
    assert np.asarray(var.value).tolist() == [1.0]  # 5 - 2.0 * clip(4 -> 2)
    assert float(optimizer.loss_scale) == 4.0
    setattr(optimizer, clip_type, 3.0)
    assert getattr(optimizer.inner_optimizer, clip_type) == 3.0
    step(4.0)
    assert np.asarray(var.value).tolist() == [-5.0]  # 1 - 2.0 * clip(4 -> 3)
    assert float(optimizer.loss_scale) == 8.0
    step(np.inf)  # skipped, not clipped
    assert np.asarray(var.value).tolist() == [-5.0]
    assert float(optimizer.loss_scale) == 4.0
    other = next(name for name in ("clipnorm", "global_clipnorm") if name != clip_type)
    with pytest.raises(ValueError, match=rf"Received: {other}=1.0, with {clip_type}=3.0"):
        setattr(optimizer, other, 1.0)
    assert getattr(optimizer.inner_optimizer, other) is None


def _three_variables():
    return [keras.Variable(np.array(v, "float32")) for v in ([1.0, 2.0], [3.0], [4.0, 5.0])]


# Scaled gradients of three steps; `None` leaves a variable alone.
_STEPS_WITH_NONE = (
    ([8.0, 16.0], None, [8.0, 8.0]),
    ([8.0, 8.0], [4.0], None),
    ([np.inf, 0.0], None, [1.0, 1.0]),
)


def _gradients_of(step):
    return [None if g is None else np.array(g, "float32") for g in step]


def _keras_scaler_reference():
    """Keras' own scaler around the same SGD, stepped with `stateless_apply`
    (its `apply` on JAX raises an UnexpectedTracerError in Keras 3.15)."""
    variables = _three_variables()
    keras_scaler = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, momentum=0.9), initial_scale=8.0)
    keras_scaler.build(variables)
    weights = [v.value for v in variables]
    values = [v.value for v in keras_scaler.variables]
    for step in _STEPS_WITH_NONE:
        weights, values = keras_scaler.stateless_apply(values, _gradients_of(step), weights)
    slots = [np.asarray(value) for variable, value in zip(keras_scaler.variables, values)
             if any(variable is v for v in keras_scaler.inner_optimizer.variables)]
    scale = np.asarray(values[[v.name for v in keras_scaler.variables].index("dynamic_scale")])
    return [np.asarray(w) for w in weights], slots, float(scale)


@pytest.mark.parametrize("traced", [False, True], ids=["apply", "jit-stateless"])
def test_a_none_gradient_leaves_its_variable_alone_like_keras_scaler_on_jax(traced):
    # Keras' `apply` drops a variable whose gradient is None; kmp's `apply`
    # refused it ("built with 3 variables, received 2", issue 30).
    expected_weights, expected_slots, expected_scale = _keras_scaler_reference()
    variables = _three_variables()
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5, momentum=0.9),
                                       initial_scale=8.0)
    optimizer.build(variables)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scaled by hand; Keras' "Gradients do not exist"
        for step in _STEPS_WITH_NONE:
            if not traced:
                optimizer.apply(_gradients_of(step), variables)
                continue
            weights, values = jax.jit(optimizer.stateless_apply)(
                [v.value for v in optimizer.variables], _gradients_of(step),
                [v.value for v in variables])
            for variable, value in zip(variables + optimizer.variables, weights + values):
                variable.assign(value)
    for variable, expected in zip(variables, expected_weights):
        np.testing.assert_array_equal(np.asarray(variable.value), expected)
    for slot, expected in zip(optimizer.inner_optimizer.variables, expected_slots):
        np.testing.assert_array_equal(np.asarray(slot.value), expected)
    assert float(optimizer.loss_scale) == expected_scale == 4.0
    assert np.asarray(variables[1].value).tolist() == [3.0 - 0.5 * 0.5]  # moved once
    assert int(optimizer.skipped_steps) == 1 and int(optimizer.iterations) == 2
    # A subset of the variables, as Keras' `apply` takes it.
    optimizer.apply([np.array([8.0], "float32")], [variables[1]])
    assert int(optimizer.iterations) == 3


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "bcoo"])
def test_stateless_apply_takes_variables_as_keras_optimizers_do(sparse):
    # Keras' sparse-optimizer test passes `optimizer.variables` (Variables)
    # to `stateless_apply`; kmp raised "Triggering __jax_array__() during
    # abstractification is no longer supported" (issue 30).
    from jax.experimental import sparse as jax_sparse

    def gradient(step):
        grad = jax_sparse.BCOO((np.full((3, 3, 2), 10.0 - step, "float32"),
                                np.array([[0], [2], [4]])), shape=(5, 3, 2))
        return grad if sparse else grad.todense()

    def run(make_optimizer, as_variables):
        model_variable = keras.Variable(np.ones((5, 3, 2), "float32"))
        optimizer = make_optimizer(keras.optimizers.SGD(learning_rate=0.5))
        optimizer.build([model_variable])
        values = optimizer.variables  # Variables, as Keras' test passes them
        weights = [model_variable] if as_variables else [model_variable.value]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # gradients scaled by hand
            for step in range(3):
                weights, values = optimizer.stateless_apply(values, [gradient(step)], weights)
        return np.asarray(weights[0]), [np.asarray(v) for v in values]

    # Keras' scaler takes Variables for `optimizer_variables` only.
    expected, expected_values = run(keras.optimizers.LossScaleOptimizer, as_variables=False)
    for as_variables in (False, True):
        weights, _ = run(kmp.LossScaleOptimizer, as_variables)
        np.testing.assert_array_equal(weights, expected)
    rows = np.full((5, 3, 2), 1.0)
    rows[[0, 2, 4]] -= 0.5 * (10.0 + 9.0 + 8.0) / 2.0**15  # float64
    np.testing.assert_allclose(weights, rows, rtol=1e-6)


# -- logs, TensorBoard, CSV and the monitor ----------------------------------------


def test_loss_scale_and_skipped_steps_reach_csv_and_the_monitor(tmp_path):
    model, x, y = _overflowing_at_first()
    monitor = kmp.callbacks.LossScaleMonitor(verbose=0, csv_path=str(tmp_path / "steps.csv"),
                                             plot_path=str(tmp_path / "scale.png"))
    callbacks = [monitor, keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))]
    history = model.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0,
                        callbacks=callbacks)
    skipped = history.history["skipped_steps"]
    assert skipped[-1] == int(model.optimizer.skipped_steps) >= 1
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["skipped_steps"]) for r in rows] == skipped
    assert [float(r["loss_scale"]) for r in rows] == history.history["loss_scale"]
    # The monitor: every skip, its reason, the variables, the plot.
    summaries = monitor.epoch_summaries
    assert sum(s["skipped"] for s in summaries) == skipped[-1]
    assert sum(s["backward"] for s in summaries) == skipped[-1]
    assert summaries[0]["nonfinite_variables"]
    with open(tmp_path / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == 2
    assert sum(int(r["skipped"]) for r in steps) == skipped[-1]
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_loss_scale_and_skipped_steps_reach_tensorboard(tmp_path):
    # Keras' TensorBoard callback writes its events with tf.summary, on JAX too.
    tf = pytest.importorskip(
        "tensorflow",
        reason="keras.callbacks.TensorBoard writes through tf.summary on JAX too, and tensorflow "
               "is not installed (the jax extra leaves it out)",
    )
    model, x, y = _overflowing_at_first()
    history = model.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.TensorBoard(str(tmp_path / "tb"))])
    assert history.history["skipped_steps"][-1] >= 1
    values = {}
    for root, _, files in os.walk(tmp_path / "tb" / "train"):
        for name in sorted(files):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                for value in event.summary.value:
                    values.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    assert values["epoch_skipped_steps"] == history.history["skipped_steps"]
    assert values["epoch_loss_scale"] == history.history["loss_scale"]


# -- data parallel over two host devices ------------------------------------------


def test_data_parallel_takes_one_decision_counts_a_skip_once_and_keeps_replicas_equal():
    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py asks XLA for two host devices"
    x, y = _data(rows=64)
    x[3] = 3e4  # one sample, on one device's half of a batch, overflows float16

    def run(distribution):
        keras.distribution.set_distribution(distribution)
        try:
            keras.utils.set_random_seed(0)
            kmp.set_policy("mixed_float16")
            model = _mlp()
            model.compile(kmp.LossScaleOptimizer("sgd", initial_scale=2.0**24),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
            return model, history.history
        finally:
            keras.distribution.set_distribution(None)

    model, history = run(keras.distribution.DataParallel(devices=devices))
    single, single_history = run(None)
    assert history["skipped_steps"] == single_history["skipped_steps"]
    assert history["skipped_steps"][-1] >= 1
    assert history["loss_scale"] == single_history["loss_scale"]
    assert int(model.optimizer.iterations) == int(single.optimizer.iterations)
    for variable in model.trainable_variables:
        shards = [np.asarray(s.data) for s in variable.value.addressable_shards]
        assert len(shards) == 2
        np.testing.assert_array_equal(shards[0], shards[1])
    for ours, theirs in zip(model.trainable_variables, single.trainable_variables):
        np.testing.assert_allclose(np.asarray(ours.value), np.asarray(theirs.value), atol=1e-3)


# -- export and files -------------------------------------------------------------


def test_export_writes_float32_signatures_and_load_model_takes_another_policy(tmp_path):
    # Without TensorFlow, export says so by name (test_without_tensorflow.py).
    tf = pytest.importorskip(
        "tensorflow",
        reason="model.export on JAX writes a SavedModel through jax2tf, which needs tensorflow, "
               "and tensorflow is not installed (the jax extra leaves it out)",
    )

    kmp.set_policy("mixed_float16")
    model = _mlp()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    model.export(str(tmp_path / "served"), inference_policy="float32")
    served = tf.saved_model.load(str(tmp_path / "served"))
    outputs = served.serve(tf.constant(x[:4]))
    assert outputs.dtype == tf.float32
    signature = served.signatures["serving_default"]
    assert [spec.dtype for spec in signature.structured_input_signature[1].values()] == [tf.float32]
    assert [spec.dtype for spec in signature.structured_outputs.values()] == [tf.float32]
    model.save(str(tmp_path / "model.keras"))
    loaded = kmp.load_model(str(tmp_path / "model.keras"), policy="float32")
    assert loaded.layers[1].compute_dtype == "float32"
    np.testing.assert_allclose(outputs.numpy(), loaded.predict(x[:4], verbose=0), rtol=1e-5, atol=1e-6)


def test_keras_file_round_trips_scaler_state_keep_float32_and_policy(tmp_path):
    kmp.set_policy("mixed_float16")
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="first"),
                              keras.layers.Dense(3, name="last")])
    model = kmp.convert(plain, keep_float32=["first"])
    model.compile(kmp.LossScaleOptimizer("adam", initial_scale=2.0**20, hysteresis=2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    x[0] = 3e4
    model.fit(x, y, epochs=1, batch_size=64, verbose=0)
    counters = {k: int(v) for k, v in model.optimizer.counters.items()}
    model.save(str(tmp_path / "model.keras"))
    kmp.set_policy("float32")
    loaded = keras.saving.load_model(str(tmp_path / "model.keras"))
    assert float(loaded.optimizer.loss_scale) == float(model.optimizer.loss_scale)
    assert {k: int(v) for k, v in loaded.optimizer.counters.items()} == counters
    assert loaded.optimizer.hysteresis == 2
    np.testing.assert_array_equal(loaded.predict(x[:4], verbose=0), model.predict(x[:4], verbose=0))
    # Settled at the first call, as the model saved was.
    assert loaded.get_layer("first").compute_dtype == "float32"
    assert loaded.get_layer("last").compute_dtype == "float16"


def test_backup_and_restore_resumes_on_jax(tmp_path):
    kmp.set_policy("mixed_float16")
    x, y = _data()

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:  # after epoch 1's backup, as Keras' own writes it
                raise RuntimeError("interrupted")

    model = _mlp()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = kmp.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, epochs=3, verbose=0, callbacks=[backup, Stop()])
    resumed = _mlp()
    resumed.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = resumed.fit(x, y, epochs=3, verbose=0,
                          callbacks=[kmp.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert history.epoch == [2]  # resumed after the last finished epoch, as Keras resumes
    assert int(resumed.optimizer.iterations) == 3 * 2


# -- what stays TensorFlow-only ---------------------------------------------------


def test_diagnose_is_one_clear_error_naming_the_backend_and_the_alternative():
    model = _mlp()
    with pytest.raises(NotImplementedError, match=r"TensorFlow backend.*KERAS_BACKEND='jax'.*LossScaleMonitor"):
        kmp.diagnose(model, _data())


def test_a_tf_distribute_strategy_is_one_clear_error_naming_keras_distribution():
    tf = pytest.importorskip(
        "tensorflow",
        reason="a tf.distribute strategy needs tensorflow, which is not installed (the jax "
               "extra leaves it out): no JAX user without it can enter one",
    )

    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = _mlp()
        with pytest.raises(NotImplementedError, match=r"tf.distribute.*DataParallel"):
            model.compile("sgd", "mse")


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_other_backends_get_a_clear_error_at_import(backend):
    # Keras' torch backend needs torch, which this suite does not install:
    # kmp says what it supports before Keras tries to import it.
    env = dict(os.environ, KERAS_BACKEND=backend)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", "import kmp"], env=env, cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "ImportError: kmp supports the TensorFlow and JAX backends of Keras" in result.stderr
    assert f"backend={backend!r}" in result.stderr


def test_a_softmax_output_is_computed_in_float32_so_the_scale_need_not_back_off():
    """Keras' cross-entropy differentiates the probabilities on JAX: computed
    in float16 their gradient, scale / p, overflows at 2**15 (Keras' own
    scaler skips and backs off); kmp computes the softmax output layer in
    float32, and the layers below get `scale * (p - y)`."""
    x, _ = _data(rows=64, classes=3)
    y = np.ones(64, "int64")  # the output layer's bias favours class 0: p(y) ~ 3e-4

    def build():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16), keras.layers.LayerNormalization(),
            keras.layers.Dense(3, activation="softmax"),
        ])
        # The same weights whatever JAX's random draw: scale / p(y) ~ 1e8
        # overflows float16 at every scale down to 2**13.
        rng = np.random.default_rng(0)
        model.set_weights([
            rng.normal(0, 0.3, (8, 16)), np.zeros(16), np.ones(16), np.zeros(16),
            rng.normal(0, 0.01, (16, 3)), np.array([8.0, 0.0, 0.0]),
        ])
        return model

    kmp.set_policy("mixed_float16")
    model = kmp.convert(build())
    model.compile("adam", "sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert history.history["skipped_steps"] == [0]
    assert history.history["loss_scale"] == [2.0**15]
    assert model.layers[-1].compute_dtype == "float32"
    assert model.layers[0].compute_dtype == "float16"
    reasons = {row["layer"]: row["reason"] for row in kmp.summary(model, print_fn=lambda _: None)}
    assert "softmax/sigmoid model output on JAX" in reasons[model.layers[-1].name]

    plain = build()  # built under mixed_float16
    plain.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
                  "sparse_categorical_crossentropy")
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # Keras' scaler skipped the four steps kmp applied.
    assert int(plain.optimizer.iterations) == 0
    assert float(plain.optimizer.dynamic_scale) == 2.0**11


# -- a second compile, the monitor after an overflow, the one line under every policy


def _one_weight_model(cls):
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs)
    return cls(inputs, outputs)


@pytest.mark.parametrize("loss_scale", ["auto", "dynamic"])
def test_a_second_compile_trains_with_its_own_loss_and_metrics_as_keras_model(loss_scale):
    # jax.jit keeps a trace per Python function: the step of the first
    # compile must not come back for the second (keras-team/keras
    # trainer_test.py's test_recompile).
    x = np.ones((4, 1), "float32")
    y = np.full((4, 1), 3.0, "float32")
    runs = {}
    for cls in (keras.Model, kmp.Model):
        model = _one_weight_model(cls)
        kwargs = {"loss_scale": loss_scale} if cls is kmp.Model else {}
        model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"], **kwargs)
        first = model.fit(x, y, batch_size=4, verbose=0).history
        model.compile(keras.optimizers.SGD(0.1), "mae", metrics=["mse"], **kwargs)
        second = model.fit(x, y, batch_size=4, verbose=0).history
        runs[cls] = first, second, np.asarray(model.layers[1].kernel.value)
    (k_first, k_second, k_kernel), (ours_first, ours_second, ours_kernel) = runs.values()
    # mse at kernel 1: 4; one SGD step of mse: kernel 1.4; mae there: 1.6.
    assert ours_first["loss"] == k_first["loss"] == [4.0]
    np.testing.assert_allclose(ours_second["loss"], k_second["loss"], rtol=1e-6)
    np.testing.assert_allclose(ours_second["loss"], [1.6], rtol=1e-6)
    assert "mse" in ours_second and "mae" not in ours_second
    np.testing.assert_allclose(ours_second["mse"], k_second["mse"], rtol=1e-6)
    np.testing.assert_allclose(ours_kernel, k_kernel, rtol=1e-6)


def _overflowing_mid_epoch(optimizer, steps_per_execution, model=None):
    """A float16 regression at scale 2**10 whose third batch of eight (of
    each epoch) overflows its gradients, not its loss."""
    kmp.set_policy("mixed_float16")
    if model is None:
        inputs = keras.Input((8,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(4)(inputs)))
    model.compile(kmp.LossScaleOptimizer(optimizer, initial_scale=2.0**10), "mse",
                  steps_per_execution=steps_per_execution)
    x = np.random.default_rng(0).random((64, 8), dtype=np.float32)
    y = x.sum(axis=1, keepdims=True)
    x[20] = 1e3
    return model, x, y


@pytest.mark.parametrize("steps_per_execution", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_monitor_reports_backward_overflows_mid_epoch_on_jax(
        optimizer, steps_per_execution, tmp_path):
    # The flags of the overflowing variables were a variable's value, which
    # the next jitted step donated: "Array has been deleted" when processed.
    model, x, y = _overflowing_mid_epoch(optimizer, steps_per_execution)
    monitor = kmp.callbacks.LossScaleMonitor(verbose=0, csv_path=str(tmp_path / "steps.csv"))
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                        callbacks=[monitor])
    assert history.history["skipped_steps"] == [1, 2]
    assert history.history["loss_scale"] == [2.0**9, 2.0**8]
    summaries = monitor.epoch_summaries
    assert [(s["steps"], s["skipped"], s["backward"], s["forward"]) for s in summaries] == [
        (8, 1, 1, 0), (8, 1, 1, 0)]
    assert [(s["start_scale"], s["end_scale"]) for s in summaries] == [
        (2.0**10, 2.0**9), (2.0**9, 2.0**8)]
    names = {v.path for v in model.trainable_variables}
    for summary in summaries:
        assert summary["nonfinite_variables"] and set(summary["nonfinite_variables"]) <= names
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    # One row per execution: its last step, and how many of its steps skipped.
    assert [int(r["step"]) for r in rows] == list(range(steps_per_execution, 17,
                                                        steps_per_execution))
    skipped_rows = [int(r["step"]) for r in rows if int(r["skipped"])]
    overflow_step = 3 if steps_per_execution == 1 else 4  # the execution holding step 3
    assert skipped_rows == [overflow_step, overflow_step + 8]
    assert {r["reason"] for r in rows if int(r["skipped"])} == {"backward"}
    # The scale after each row, in closed form: halved once per skip so far.
    expected_scales = [2.0**10 * 0.5 ** sum(s <= int(r["step"]) for s in skipped_rows)
                       for r in rows]
    assert [float(r["loss_scale"]) for r in rows] == expected_scales
    if steps_per_execution == 1:
        # The step's own loss (kmp.Model's step returns it), not the epoch's
        # mean, which leaves the skipped step out: x[20] = 1e3 makes it huge.
        assert float(rows[2]["loss"]) > 100 * max(history.history["loss"])


def test_the_monitor_reads_a_custom_jax_step_from_the_optimizer_after_an_overflow(tmp_path):
    # A custom step returns no monitor values: the monitor reads the
    # optimizer's variables, copied before the next step reuses them.
    kmp.set_policy("mixed_float16")
    model, x, y = _overflowing_mid_epoch("sgd", 1, model=_StatelessStepModel())
    monitor = kmp.callbacks.LossScaleMonitor(verbose=0, csv_path=str(tmp_path / "steps.csv"))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert [(s["skipped"], s["backward"]) for s in monitor.epoch_summaries] == [(1, 1), (1, 1)]
    assert all(s["nonfinite_variables"] for s in monitor.epoch_summaries)
    with open(tmp_path / "steps.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if int(r["skipped"])] == [3, 11]


def _scale_line_model(base):
    """keras.io's custom JAX `train_step`, with Keras' own line
    `self.optimizer.scale_loss(loss)`; its logs carry `scaled / loss`."""

    class ScaleLineModel(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def compute_loss_and_updates(self, trainable, non_trainable, optimizer_variables, x, y):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
            loss = ops.mean(ops.square(y_pred - y))
            scaled = self.optimizer.scale_loss(loss)  # the one line
            return scaled, (loss, scaled, non_trainable)

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (_, (loss, scaled, non_trainable)), grads = grad_fn(
                trainable, non_trainable, optimizer_variables, x, y
            )
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
            logs = {"loss": loss, "scale_used": scaled / loss}
            return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    return ScaleLineModel()


def _fit_logging_steps(model, x, y, **kwargs):
    steps = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: steps.append(dict(logs)))
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[record],
                        **kwargs)
    return history.history, steps


def _same_weights(model, reference):
    for each in (model, reference):
        each(np.zeros((1, 4), "float32"))  # builds the layers
    reference.set_weights(model.get_weights())


def test_scale_loss_in_a_custom_jax_step_reads_the_scale_of_each_step():
    # Without the step's value the scale JAX saw when it traced the step
    # would be compiled in (or, in fit, a purged variable read: an error).
    x = np.random.default_rng(0).random((32, 4), dtype=np.float32)
    y = x.sum(axis=1, keepdims=True)
    x[9] = 1e17  # the second batch: a finite loss, gradients over float32's range
    model = _scale_line_model(kmp.Model)
    reference = _scale_line_model(keras.Model)
    _same_weights(model, reference)
    model.compile(kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**24))
    history, steps = _fit_logging_steps(model, x, y)
    assert [s["skipped_steps"] for s in steps] == [0, 1, 1, 1]
    assert [s["scale_used"] for s in steps if np.isfinite(s["scale_used"])] == [
        2.0**24, 2.0**23, 2.0**23]
    assert history["loss_scale"] == [2.0**23]
    # The weights: plain SGD on the unscaled loss of the batches applied.
    reference.compile(keras.optimizers.SGD(0.01))
    kept = np.r_[0:8, 16:32]
    reference.fit(x[kept], y[kept], batch_size=8, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "auto"])
def test_the_one_line_runs_unchanged_without_a_scaler_and_trains_as_keras_model(policy):
    # Under these policies (auto on a CPU: float32) compile makes no scaler:
    # `self.optimizer` is Keras' SGD, whose `scale_loss` returns the loss.
    kmp.set_policy(policy)
    x = np.random.default_rng(1).random((32, 4), dtype=np.float32)
    y = x.sum(axis=1, keepdims=True)
    model = _scale_line_model(kmp.Model)
    reference = _scale_line_model(keras.Model)
    _same_weights(model, reference)
    model.compile(keras.optimizers.SGD(0.01))
    reference.compile(keras.optimizers.SGD(0.01))
    history, _ = _fit_logging_steps(model, x, y, epochs=2)
    expected, _ = _fit_logging_steps(reference, x, y, epochs=2)
    assert "loss_scale" not in history
    assert history["scale_used"] == [1.0, 1.0]
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_a_skipped_step_leaves_batch_norm_statistics_as_they_were():
    # A batch whose float16 activations overflow: the step is skipped, and
    # the moving statistics Keras' stateless call returned as inf are not kept.
    kmp.set_policy("mixed_float16")
    x, y = activations_overflowing_in_the_second_batch()
    inputs = keras.Input((8,))
    norm = keras.layers.BatchNormalization(momentum=0.5)
    model = kmp.Model(inputs, keras.layers.Dense(1)(norm(keras.layers.Dense(8)(inputs))))
    model.compile("adam", "mse")
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    before = [np.asarray(v.value).copy() for v in model.non_trainable_variables]
    skipped = int(model.optimizer.skipped_steps)
    model.fit(x[32:], y[32:], batch_size=32, epochs=1, verbose=0)
    assert int(model.optimizer.skipped_steps) == skipped + 1
    for old, variable in zip(before, model.non_trainable_variables):
        np.testing.assert_array_equal(old, np.asarray(variable.value))
    assert np.isfinite(model.predict(x[:4], verbose=0)).all()
    # An applied step moves them (momentum 0.5: half of the batch's mean).
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    assert not np.array_equal(before[0], np.asarray(norm.moving_mean.value))


def _jit_loop_parts():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)
    return model, optimizer


def test_scale_loss_in_jax_jit_is_refused_for_the_stateless_line():
    # Inside jax.jit, `scale_loss` read the scale when JAX traced and kept it:
    # after one skip the loss was still scaled by 2**15 while the apply divided
    # by 2**14 (every later step twice too large, silently).
    model, optimizer = _jit_loop_parts()

    def scaled_loss(trainable, x, scale_line):
        y_pred, _ = model.stateless_call(trainable, [], x)
        loss = ops.mean(y_pred**2)
        return scale_line(loss)

    trainable = [v.value for v in model.trainable_variables]
    values = [v.value for v in optimizer.variables]
    x = np.ones((8, 4), "float32")
    with pytest.raises(ValueError, match=r"`scale_loss` inside `jax.jit` reads the loss scale "
                       r"once.*stateless_scale_loss\(optimizer_variables, loss\)"):
        jax.jit(jax.grad(lambda t: scaled_loss(t, x, optimizer.scale_loss)))(trainable)
    # The stateless line, and scale_loss where nothing is compiled (a jax.grad
    # loop run eagerly reads the scale at each call), are the same numbers.
    stateless = jax.jit(jax.grad(
        lambda t, v: scaled_loss(t, x, lambda loss: optimizer.stateless_scale_loss(v, loss))
    ))(trainable, values)
    eager = jax.grad(lambda t: scaled_loss(t, x, optimizer.scale_loss))(trainable)
    for a, b in zip(stateless, eager):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_gradients_unscaled_in_jax_jit_are_refused_for_stateless_apply():
    # get_unscaled_gradients would divide by the scale JAX read when it traced.
    model, optimizer = _jit_loop_parts()
    x = np.ones((8, 4), "float32")

    @jax.jit
    def unscaled_gradients(trainable, values):
        def scaled_loss(t):
            y_pred, _ = model.stateless_call(t, [], x)
            return optimizer.stateless_scale_loss(values, ops.mean(y_pred**2))

        return optimizer.get_unscaled_gradients(jax.grad(scaled_loss)(trainable))

    with pytest.raises(ValueError, match=r"`get_unscaled_gradients` inside `jax.jit` reads the "
                       r"loss scale once.*stateless_apply"):
        unscaled_gradients([v.value for v in model.trainable_variables],
                           [v.value for v in optimizer.variables])
    # Mapped to the step's optimizer values, as a stateless step carries them,
    # it divides by the scale it is given.
    @jax.jit
    def mapped(grads, values):
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, values))):
            return optimizer.get_unscaled_gradients(grads)

    values = [v.value for v in optimizer.variables]
    grads = [np.full(w.shape, 2.0**15, "float32") for w in model.trainable_variables]
    (kernel, _) = mapped(grads, values)
    np.testing.assert_array_equal(np.asarray(kernel), np.ones(kernel.shape))
