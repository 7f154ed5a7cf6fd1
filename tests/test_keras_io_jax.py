"""keras.io's JAX guides, as a Keras user writes them, on kmp
(`KERAS_BACKEND=jax`; tests/conftest.py runs this file only in that pass).

Each test restates one keras.io guide (cited in its docstring) at a tiny size
with `kmp.Model` in place of `keras.Model` and kmp's documented line: in a
`kmp.Model`'s stateless `train_step`, `self.optimizer.scale_loss(loss)`
inside the function given to `jax.value_and_grad` (Keras' own line, on every
optimizer under every policy); in a `jax.grad` loop outside `kmp.Model`,
`kmp.LossScaleOptimizer(...)` and
`optimizer.stateless_scale_loss(optimizer_variables, loss)`. Under
`mixed_float16` each step's loss stays within float16's rounding band of the
float32 run of the same code (tests/_float16_band.py), no loss is NaN, the
logs carry the scaler's `loss_scale` and `skipped_steps`; without the line,
kmp's warning names it. The TensorFlow versions are in test_keras_io.py.
"""

import warnings

import jax
import keras
import numpy as np
import pytest
from _float16_band import assert_within_band

import kmp

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the KERAS_BACKEND=jax pass runs it"
)

STEPS = 4
BATCH = 8


def _no_scale_loss_warning(record):
    messages = [str(w.message) for w in record if "scale_loss" in str(w.message)]
    assert not messages, messages


def _assert_reported(history, optimizer):
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    assert history["skipped_steps"][-1] == int(optimizer.skipped_steps)
    assert history["loss_scale"][-1] == float(optimizer.loss_scale)


# --- guides/custom_train_step_in_jax.py ---------------------------------------


def _first_example_class(line):
    class CustomModel(kmp.Model):                             # kmp: was keras.Model
        def compute_loss_and_updates(self, trainable_variables, non_trainable_variables,
                                     metrics_variables, x, y, sample_weight, training=False):
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=training
            )
            loss, (trainable_variables, non_trainable_variables, metrics_variables) = (
                self.stateless_compute_loss(
                    trainable_variables, non_trainable_variables, metrics_variables,
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training,
                )
            )
            scaled_loss = self.optimizer.scale_loss(loss) if line else loss     # kmp
            return scaled_loss, (loss, y_pred, non_trainable_variables, metrics_variables)

        def train_step(self, state, data):
            (trainable_variables, non_trainable_variables, optimizer_variables,
             metrics_variables) = state
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (_, (loss, y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, metrics_variables,
                x, y, sample_weight, training=True,
            )
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
            new_metrics_vars = []
            logs = {}
            for metric in self.metrics:
                this_metric_vars = metrics_variables[
                    len(new_metrics_vars): len(new_metrics_vars) + len(metric.variables)
                ]
                if metric.name == "loss":
                    this_metric_vars = metric.stateless_update_state(
                        this_metric_vars, loss, sample_weight=sample_weight
                    )
                else:
                    this_metric_vars = metric.stateless_update_state(
                        this_metric_vars, y, y_pred, sample_weight=sample_weight
                    )
                logs[metric.name] = metric.stateless_result(this_metric_vars)
                new_metrics_vars += this_metric_vars
            state = (trainable_variables, non_trainable_variables, optimizer_variables,
                     new_metrics_vars)
            return logs, state

    return CustomModel


def _lower_level_class(line):
    class CustomModel(kmp.Model):                             # kmp: was keras.Model
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def compute_loss_and_updates(self, trainable_variables, non_trainable_variables,
                                     x, y, sample_weight, training=False):
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=training
            )
            loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
            scaled_loss = self.optimizer.scale_loss(loss) if line else loss     # kmp
            return scaled_loss, (loss, y_pred, non_trainable_variables)

        def train_step(self, state, data):
            (trainable_variables, non_trainable_variables, optimizer_variables,
             metrics_variables) = state
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (_, (loss, y_pred, non_trainable_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, x, y, sample_weight,
                training=True,
            )
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
            loss_tracker_vars = metrics_variables[: len(self.loss_tracker.variables)]
            mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
            loss_tracker_vars = self.loss_tracker.stateless_update_state(
                loss_tracker_vars, loss, sample_weight=sample_weight
            )
            mae_metric_vars = self.mae_metric.stateless_update_state(
                mae_metric_vars, y, y_pred, sample_weight=sample_weight
            )
            logs = {
                self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars),
            }
            new_metrics_vars = loss_tracker_vars + mae_metric_vars
            state = (trainable_variables, non_trainable_variables, optimizer_variables,
                     new_metrics_vars)
            return logs, state

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    return CustomModel


def _train_custom_model(policy, make_class, line=True, **compile_kwargs):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = make_class(line)(inputs, outputs)
    model.compile(optimizer="adam", **compile_kwargs)
    rng = np.random.default_rng(0)
    x = rng.random((STEPS * BATCH, 32)).astype("float32")
    y = rng.random((STEPS * BATCH, 1)).astype("float32")
    history = model.fit(x, y, batch_size=STEPS * BATCH, epochs=STEPS, verbose=0).history
    return model, history


_GUIDE_MODELS = pytest.mark.parametrize("make_class, compile_kwargs", [
    (_first_example_class, {"loss": "mse", "metrics": ["mae"]}),
    (_lower_level_class, {}),
], ids=["stateless_compute_loss", "own_metrics"])


@_GUIDE_MODELS
def test_custom_train_step_in_jax_guide_with_the_line_tracks_float32(make_class, compile_kwargs):
    """guides/custom_train_step_in_jax.py (keras-io): "A first simple
    example" (`stateless_compute_loss`, compiled loss and metrics) and "Going
    lower-level" (`__init__(self, *args, **kwargs)`, own metrics)."""
    _, reference = _train_custom_model("float32", make_class, **compile_kwargs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, history = _train_custom_model("mixed_float16", make_class, **compile_kwargs)
    _no_scale_loss_warning(record)
    # One Dense layer, and the squared error of its output.
    for key in ("loss", "mae"):
        assert_within_band(history[key], reference[key], 3 * 2, f"CustomModel {key}")
    _assert_reported(history, model.optimizer)


@_GUIDE_MODELS
def test_custom_train_step_in_jax_guide_without_the_line_warns_naming_it(make_class,
                                                                         compile_kwargs):
    with pytest.warns(UserWarning, match=r"self\.optimizer\.scale_loss\(loss\)"):
        model, history = _train_custom_model(
            "mixed_float16", make_class, line=False, **compile_kwargs
        )
    assert all(np.isfinite(history["loss"]))
    _assert_reported(history, model.optimizer)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_custom_train_step_in_jax_guide_with_the_line_runs_under_every_policy(policy):
    """The line is Keras' own: the same code runs where there is no scaling."""
    model, history = _train_custom_model(policy, _lower_level_class)
    assert all(np.isfinite(history["loss"]))


# --- guides/writing_a_custom_training_loop_in_jax.py -------------------------


def _train_jax_loop(policy, line=True):
    """The guide's jitted loop with metrics; kmp's additions are the
    optimizer's wrapper and `stateless_scale_loss` (docs/jax.md). Returns the
    optimizer and each step's loss."""
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)

    inputs = keras.Input(shape=(64,), name="digits")
    x1 = keras.layers.Dense(16, activation="relu")(inputs)
    x2 = keras.layers.Dense(16, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    model = kmp.Model(inputs=inputs, outputs=outputs)          # kmp: was keras.Model

    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(learning_rate=1e-3))   # kmp
    train_acc_metric = keras.metrics.CategoricalAccuracy()

    def compute_loss_and_updates(trainable_variables, non_trainable_variables,
                                 metric_variables, optimizer_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x
        )
        loss = loss_fn(y, y_pred)
        metric_variables = train_acc_metric.stateless_update_state(metric_variables, y, y_pred)
        scaled_loss = (optimizer.stateless_scale_loss(optimizer_variables, loss)   # kmp
                       if line else loss)
        return scaled_loss, (loss, non_trainable_variables, metric_variables)

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        (trainable_variables, non_trainable_variables, optimizer_variables,
         metric_variables) = state
        x, y = data
        (_, (loss, non_trainable_variables, metric_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, metric_variables,
            optimizer_variables, x, y,
        )
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return loss, (trainable_variables, non_trainable_variables, optimizer_variables,
                      metric_variables)

    rng = np.random.default_rng(0)
    x_train = rng.normal(size=(STEPS * BATCH, 64)).astype("float32")
    y_train = keras.utils.to_categorical(rng.integers(0, 10, STEPS * BATCH), 10)

    optimizer.build(model.trainable_variables)
    # The guide hands the Variable objects themselves to the jitted step;
    # JAX 0.10 refuses that ("Triggering __jax_array__() during
    # abstractification is no longer supported") with plain Keras 3.15 and
    # Keras' own Adam too, so their values, as docs/jax.md does.
    trainable_variables = [v.value for v in model.trainable_variables]
    non_trainable_variables = [v.value for v in model.non_trainable_variables]
    optimizer_variables = [v.value for v in optimizer.variables]
    metric_variables = [v.value for v in train_acc_metric.variables]
    state = (trainable_variables, non_trainable_variables, optimizer_variables, metric_variables)

    losses = []
    for step in range(STEPS):
        data = (x_train[step * BATCH:(step + 1) * BATCH], y_train[step * BATCH:(step + 1) * BATCH])
        loss, state = train_step(state, data)
        losses.append(float(loss))

    trainable_variables, non_trainable_variables, optimizer_variables, metric_variables = state
    for variable, value in zip(model.trainable_variables, trainable_variables):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable_variables):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_variables):
        variable.assign(value)
    return optimizer, losses


def test_custom_training_loop_in_jax_guide_with_the_line_tracks_float32():
    """guides/writing_a_custom_training_loop_in_jax.py (keras-io): a jitted
    stateless step over `(trainable, non_trainable, optimizer, metric)`
    values, assigned back to the variables after the loop."""
    _, reference = _train_jax_loop("float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optimizer, losses = _train_jax_loop("mixed_float16")
    _no_scale_loss_warning(record)
    assert_within_band(losses, reference, 3 * 3, "JAX loop")
    # Outside fit there is no History: the scaler's own counters are the report.
    assert int(optimizer.iterations) + int(optimizer.skipped_steps) == len(losses)
    assert np.isfinite(float(optimizer.loss_scale))


def test_custom_training_loop_in_jax_guide_without_the_line_warns_naming_it():
    with pytest.warns(UserWarning, match=r"stateless_scale_loss\(optimizer_variables, loss\)"):
        _, losses = _train_jax_loop("mixed_float16", line=False)
    assert all(np.isfinite(losses))
