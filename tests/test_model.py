import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from _helpers import (
    OVERFLOWING_SAMPLE_WEIGHT,
    TrainableWeightsPerStep,
    activations_overflowing_in_the_second_batch,
    assert_close_to_float16_rounding,
    overflowing_sample_weights,
)
from kmp import _keras_internals
from kmp.model import FunctionalModel


def _data(n=64, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=n)
    return x, y


def _functional(features=6, classes=3):
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(classes, activation="softmax")(hidden)
    return kmp.Model(inputs, outputs)


class Subclassed(kmp.Model):
    def __init__(self, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.norm = keras.layers.LayerNormalization()
        self.out = keras.layers.Dense(classes, activation="softmax")

    def call(self, x, training=False):
        return self.out(self.norm(self.hidden(x)))


_BUILDERS = {"functional": _functional, "subclassed": Subclassed}


# Half of policy x kind x XLA in the fast tier, a set that holds every pair
# of two factors once; the other half in the slow tier (tests/conftest.py).
@pytest.mark.parametrize(("policy", "kind", "jit_compile"), [
    pytest.param(policy, kind, jit_compile, marks=(
        () if (policy == "mixed_float16") ^ (kind == "functional") ^ jit_compile
        else pytest.mark.slow))
    for policy in ("mixed_float16", "mixed_bfloat16")
    for kind in ("functional", "subclassed")
    for jit_compile in (False, True)
])
def test_fit_in_mixed_precision(policy, kind, jit_compile):
    kmp.set_policy(policy)
    model = _BUILDERS[kind]()
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit_compile,
        overflow_retries=0,  # the overflowing batch is skipped, not redone
    )
    x, y = _data()
    model(x[:1])  # built, so that the weights before the first step are known
    # Batch 3 of 4 overflows float16 in the backward pass, in both epochs.
    sample_weight = overflowing_sample_weights(len(x), 16, batches=[3])
    steps = TrainableWeightsPerStep()
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=16, epochs=2,
                        shuffle=False, verbose=0, callbacks=[steps])
    compute_dtype = "float16" if policy == "mixed_float16" else "bfloat16"
    hidden = model.layers[1] if kind == "functional" else model.hidden
    assert hidden.compute_dtype == compute_dtype
    # A functional model's softmax output computes in float32: its
    # probabilities are float32's own (a 16-bit softmax cast up sums to 1
    # only within ~1e-3), on TensorFlow as on JAX.
    if kind == "functional":
        assert model.layers[-1].compute_dtype == "float32"
    assert all(v.dtype == "float32" for v in model.weights)
    assert np.all(np.isfinite(history.history["loss"]))
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
        # Exactly the two poisoned steps are skipped, each one backoff of the
        # default scale (2**15, growth every 2000 steps: none here).
        assert history.history["skipped_steps"] == [1, 2]
        assert history.history["loss_scale"] == [2.0**15 * 0.5**1, 2.0**15 * 0.5**2]
        assert int(model.optimizer.iterations) == 8 - 2
        unchanged = [3, 7]
    else:  # bfloat16 has float32's range: no scaling, the guard alone
        assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
        assert not model.optimizer.scaling and float(model.optimizer.loss_scale) == 1.0
        assert "loss_scale" not in history.history
        assert history.history["skipped_steps"] == [0, 0]
        assert int(model.optimizer.iterations) == 8
        unchanged = []
    assert [step for step in range(1, 9) if steps.unchanged_by(step)] == unchanged
    predictions = model.predict(x[:4], verbose=0)
    assert predictions.dtype == np.float32
    np.testing.assert_allclose(predictions.sum(axis=1), 1.0,
                               rtol=1e-6 if kind == "functional" else 1e-2)


def test_loss_scale_too_high_is_backed_off_and_every_skip_counted():
    kmp.set_policy("mixed_float16")
    model = _functional()
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05), initial_scale=2.0**24, growth_interval=10_000
    )
    model.compile(optimizer, "sparse_categorical_crossentropy", overflow_retries=0)
    x, y = _data(n=320)
    steps = TrainableWeightsPerStep()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[steps])
    skipped = int(optimizer.skipped_steps)
    # float16 tops out at 65504: 2**24 times the loss overflows until the scale
    # has backed off under ~2**16 (lower where a softmax output is small and
    # its cross-entropy gradient, -scale / (16 p), large): then steps apply.
    assert 4 <= skipped < 20
    assert history.history["skipped_steps"] == [skipped]
    assert float(optimizer.loss_scale) == 2.0**24 * 0.5**skipped
    assert int(optimizer.iterations) == 20 - skipped
    # Each skip left the weights as they were, and the first steps are skips:
    # 2**24 / 16 (a gradient of order 1/16) is beyond 65504 until 2**20.
    unchanged = [step for step in range(1, 21) if steps.unchanged_by(step)]
    assert len(unchanged) == skipped and unchanged[:5] == [1, 2, 3, 4, 5]
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_poisoned_batch_is_skipped_and_loses_nothing():
    kmp.set_policy("mixed_float16")
    x, y = _data(n=64)
    x_poisoned = x.copy()
    x_poisoned[35] = np.inf  # batch 3 of 4
    results = []
    for inputs in (x, x_poisoned):
        keras.utils.set_random_seed(3)
        model = Subclassed()
        model.compile(
            kmp.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**8),
            "sparse_categorical_crossentropy",
        )
        model.fit(inputs[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)
        before = [np.copy(v) for v in model.get_weights()]
        slots = [np.copy(v) for v in model.optimizer.inner_optimizer.variables]
        model.fit(inputs[32:48], y[32:48], batch_size=16, epochs=1, verbose=0)
        results.append((model, before, slots))
    model, before, slots = results[1]
    assert int(model.optimizer.skipped_steps) == 1
    assert int(model.optimizer.iterations) == 2
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    for old, new in zip(slots, model.optimizer.inner_optimizer.variables):
        np.testing.assert_array_equal(old, np.asarray(new))
    assert int(results[0][0].optimizer.iterations) == 3


def test_tf_data_steps_per_execution_sample_weights():
    kmp.set_policy("mixed_float16")
    x, y = _data(n=96)
    weights = np.linspace(0.5, 1.5, 96).astype("float32")
    # Batch 5 of 6 overflows in the backward pass, in both epochs; the other
    # batches keep their own weights.
    poisoned = overflowing_sample_weights(96, 16, batches=[5]) > 1
    weights[poisoned] = OVERFLOWING_SAMPLE_WEIGHT

    def fit(keep):
        keras.utils.set_random_seed(0)
        model = _functional()
        # A scale at which this model's own gradients stay far below 65504.
        optimizer = kmp.LossScaleOptimizer("adam", initial_scale=2.0**10)
        model.compile(optimizer, "sparse_categorical_crossentropy", steps_per_execution=3,
                      overflow_retries=0)
        dataset = tf.data.Dataset.from_tensor_slices((x[keep], y[keep], weights[keep])).batch(16)
        return model, dataset, model.fit(dataset, epochs=2, verbose=0)

    model, dataset, history = fit(np.ones(96, bool))
    assert history.history["skipped_steps"] == [1, 2]
    assert int(model.optimizer.skipped_steps) == 2
    assert int(model.optimizer.iterations) == 12 - 2
    assert history.history["loss_scale"] == [2.0**10 * 0.5**1, 2.0**10 * 0.5**2]
    # The skipped steps changed no trainable weight: the run trained exactly
    # like one on the data without batch 5 (whose loss scale never backed
    # off, a power of 2 that changes no rounding here).
    control, _, control_history = fit(~poisoned)
    assert control_history.history["skipped_steps"] == [0, 0]
    assert int(control.optimizer.iterations) == 10
    for ours, theirs in zip(model.trainable_weights, control.trainable_weights):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    loss = model.evaluate(dataset, verbose=0)
    assert np.isfinite(loss)


def test_multiple_inputs_and_outputs_are_float32():
    kmp.set_policy("mixed_float16")
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    hidden = keras.layers.Dense(8)(keras.layers.Concatenate()([a, b]))
    outputs = {
        "value": keras.layers.Dense(1, name="value")(hidden),
        "label": keras.layers.Dense(2, activation="softmax", name="label")(hidden),
    }
    model = kmp.Model({"a": a, "b": b}, outputs)
    model.compile(
        "adam", {"value": "mse", "label": "sparse_categorical_crossentropy"}
    )
    rng = np.random.default_rng(0)
    inputs = {"a": rng.normal(size=(32, 4)).astype("float32"),
              "b": rng.normal(size=(32, 3)).astype("float32")}
    targets = {"value": rng.normal(size=(32, 1)).astype("float32"),
               "label": rng.integers(0, 2, size=32)}
    history = model.fit(inputs, targets, batch_size=8, epochs=1, verbose=0)
    skipped = int(model.optimizer.skipped_steps)
    assert history.history["skipped_steps"] == [skipped]
    assert int(model.optimizer.iterations) == 4 - skipped
    predictions = model(inputs)
    assert {k: v.dtype for k, v in predictions.items()} == {
        "value": tf.float32,
        "label": tf.float32,
    }


def test_compile_loss_scale_choices():
    kmp.set_policy("mixed_float16")
    model = _functional()
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert model.optimizer.dynamic
    model.compile("sgd", "mse", loss_scale=None)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.compile("sgd", "mse", auto_scale_loss=False)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # Without a scale, the guard on request: a scale fixed at 1 scales nothing.
    model.compile("sgd", "mse", loss_scale=None, skip_nonfinite=True)
    guard = model.optimizer
    assert isinstance(guard, kmp.LossScaleOptimizer) and not guard.scaling
    assert (guard.dynamic, guard.initial_scale, guard.min_scale, guard.max_scale) == (
        False, 1.0, 1.0, 1.0)
    model.compile("sgd", "mse", loss_scale=None, skip_spikes=4.5)
    assert not model.optimizer.scaling and model.optimizer.skip_spikes == 4.5
    model.compile("sgd", "mse", skip_spikes=4.5)
    assert model.optimizer.dynamic and model.optimizer.skip_spikes == 4.5
    model.compile("sgd", "mse", loss_scale=1024)
    assert not model.optimizer.dynamic
    assert float(model.optimizer.loss_scale) == 1024.0
    given = kmp.LossScaleOptimizer("sgd", initial_scale=8.0)
    model.compile(given, "mse", loss_scale=None)
    assert model.optimizer is given
    keras_scaler = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=64.0, dynamic_growth_steps=7
    )
    model.compile(keras_scaler, "mse")
    assert type(model.optimizer) is kmp.LossScaleOptimizer
    assert model.optimizer.inner_optimizer is keras_scaler.inner_optimizer
    assert (model.optimizer.initial_scale, model.optimizer.growth_interval) == (64.0, 7)

    kmp.set_policy("mixed_bfloat16")
    model = _functional()
    model.compile("sgd", "mse")  # the guard by default
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer) and not model.optimizer.scaling
    model.compile("sgd", "mse", skip_nonfinite=False)
    assert isinstance(model.optimizer, keras.optimizers.SGD)
    model.compile("sgd", "mse", loss_scale="dynamic")
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer) and model.optimizer.scaling

    kmp.set_policy("float32")
    model = _functional()
    model.compile("sgd", "mse")  # Keras' step
    assert isinstance(model.optimizer, keras.optimizers.SGD)
    model.compile("sgd", "mse", skip_nonfinite=True)
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer) and not model.optimizer.scaling


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"skip_nonfinite": "yes"}, "`skip_nonfinite` must be 'auto' (skip under a 16-bit "
         "policy), True or False. Received: skip_nonfinite='yes'"),
        ({"skip_nonfinite": 1}, "Received: skip_nonfinite=1"),
        ({"skip_spikes": 0}, "`skip_spikes` must be a finite number > 0 or None. Received: "
         "skip_spikes=0"),
        ({"skip_spikes": float("nan")}, "Received: skip_spikes=nan"),
        ({"skip_spikes": 6.0, "skip_nonfinite": False}, "cannot be combined with "
         "skip_nonfinite=False. Received: skip_nonfinite=False, skip_spikes=6.0"),
        ({"skip_nonfinite": False}, "`skip_nonfinite=False` needs `loss_scale=None` and an "
         "optimizer that is not a LossScaleOptimizer. Received: skip_nonfinite=False, "
         "loss_scale='dynamic' (float16 computation)"),
        ({"skip_nonfinite": False, "loss_scale": 256}, "Received: skip_nonfinite=False, "
         "loss_scale=256"),
        ({"compensation": "round"}, "`compensation` must be one of ('kahan', 'stochastic') "
         "(how a 16-bit weight keeps what rounding its updates loses). Received: "
         "compensation='round'"),
    ],
)
def test_compile_refuses_guard_settings_and_changes_nothing(kwargs, message):
    kmp.set_policy("mixed_float16")
    model = _functional()
    model.compile("adam", "mse")
    before = model.optimizer
    with pytest.raises(ValueError) as raised:
        model.compile("sgd", "mse", **kwargs)
    assert message in str(raised.value)
    assert model.optimizer is before


def test_compile_refuses_spikes_that_differ_from_the_scaler_passed():
    kmp.set_policy("mixed_float16")
    model = _functional()
    given = kmp.LossScaleOptimizer("sgd", skip_spikes=3.0)
    with pytest.raises(ValueError, match=r"pass `skip_spikes=6.0` to it instead"):
        model.compile(given, "mse", skip_spikes=6.0)
    model.compile(given, "mse", skip_spikes=3.0)  # the same setting: as given
    assert model.optimizer is given
    with pytest.raises(ValueError, match=r"pass `compensation='stochastic'` to it instead"):
        model.compile(given, "mse", compensation="stochastic")
    assert model.optimizer is given


def test_keras_scaler_above_kmps_default_maximum_is_taken_over_and_trains():
    # Keras' scaler has no maximum: 2**40 is a setting Keras accepts, and
    # kmp raised "min_scale <= initial_scale <= max_scale" for it (issue 38).
    kmp.set_policy("mixed_float16")
    x, y = _data()
    model = _functional()
    model.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2**40),
        "sparse_categorical_crossentropy",
    )
    scaler = model.optimizer
    assert type(scaler) is kmp.LossScaleOptimizer
    assert (scaler.initial_scale, scaler.max_scale, scaler.min_scale) == (2.0**40, 2.0**40, 1.0)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    skipped = int(scaler.skipped_steps)
    # Keras' semantics for a scaler the user passed: each overflow skips the
    # step and halves the scale; 8 steps cannot reach the growth interval.
    assert 0 < skipped <= 8
    assert float(scaler.loss_scale) == 2.0**40 / 2**skipped
    assert int(scaler.iterations) == 8 - skipped
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("initial_scale, bounds", [(0.5, (0.5, 2.0**24)), (2.0**30, (1.0, 2.0**30))])
def test_keras_scaler_outside_kmps_default_bounds_moves_the_bound(initial_scale, bounds):
    kmp.set_policy("mixed_float16")
    model = _functional()
    model.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=initial_scale),
        "mse",
    )
    scaler = model.optimizer
    assert scaler.initial_scale == initial_scale
    assert (scaler.min_scale, scaler.max_scale) == bounds


def test_keras_scaler_beyond_float32_is_refused_by_name():
    kmp.set_policy("mixed_float16")
    model = _functional()
    keras_scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=1e39)
    with pytest.raises(ValueError, match=r"`initial_scale` must be .*Received: initial_scale=1e\+39"):
        model.compile(keras_scaler, "mse")
    assert getattr(model, "optimizer", None) is None


def test_auto_loss_scale_sees_float16_layers_in_a_float32_model():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, dtype="mixed_float16")(inputs)
    model = kmp.Model(inputs, outputs)
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)


# 1e39 and 1e-46: beyond float32, the dtype of the scale's variable (issue 22).
@pytest.mark.parametrize("bad", ["static", 0, -1.0, float("inf"), True, [2.0], 1e39, 1e-46])
def test_compile_rejects_bad_loss_scale(bad):
    model = _functional()
    with pytest.raises(ValueError) as error:
        model.compile("sgd", "mse", loss_scale=bad)
    assert f"loss_scale={bad!r}" in str(error.value)
    assert "'auto'" in str(error.value)
    assert getattr(model, "optimizer", None) is None  # nothing changed


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, True])
def test_compile_rejects_overflow_retries_beyond_int32(bad):
    # The retry loop counts down in an int32 tensor (issue 22).
    model = _functional()
    with pytest.raises(ValueError, match=rf"Received: overflow_retries={bad!r}"):
        model.compile("sgd", "mse", overflow_retries=bad)
    assert getattr(model, "optimizer", None) is None


def test_keras_file_round_trip_keeps_class_optimizer_and_loss_scale_choice(tmp_path):
    kmp.set_policy("mixed_float16")
    x, y = _data()
    model = _functional()
    model.compile(
        kmp.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**9,
                               growth_interval=2),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored) is FunctionalModel and isinstance(restored, kmp.Model)
    assert type(restored.optimizer) is kmp.LossScaleOptimizer
    assert float(restored.optimizer.loss_scale) == float(model.optimizer.loss_scale) == 2.0**11
    assert int(restored.optimizer.iterations) == 4
    np.testing.assert_array_equal(model.predict(x, verbose=0), restored.predict(x, verbose=0))
    history = restored.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert history.history["loss_scale"] == [2.0**13]

    unscaled = _functional()
    unscaled.compile("sgd", "mse", loss_scale=None)
    unscaled.save(tmp_path / "unscaled.keras")
    again = keras.models.load_model(tmp_path / "unscaled.keras")
    assert not isinstance(again.optimizer, keras.optimizers.LossScaleOptimizer)


def test_export_serving_signature_is_float32_and_matches(tmp_path):
    kmp.set_policy("mixed_float16")
    x, y = _data()
    model = _functional()
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.export(str(tmp_path / "serving"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "serving"))
    signature = served.signatures["serving_default"]
    (spec,) = signature.structured_input_signature[1].values()
    assert spec.dtype == tf.float32
    (output_spec,) = signature.structured_outputs.values()
    assert output_spec.dtype == tf.float32
    (served_output,) = signature(tf.constant(x)).values()
    # Not bit-equal on a GPU: Keras predicts under XLA there, the SavedModel
    # runs TensorFlow's kernels, and they round float16 at other points. They
    # may differ in each Dense's matmul output and bias add (2 roundings per
    # layer) and in the float16 softmax of the last one (its exp and its
    # division): 2 * 2 + 2.
    assert_close_to_float16_rounding(
        served_output.numpy(), model.predict(x, verbose=0), roundings=6
    )


def test_subclasses_stay_subclassed_after_functional_use():
    kmp.set_policy("mixed_bfloat16")
    bases_before = kmp.Model.__bases__
    _functional()

    class FunctionalSubclass(kmp.Model):
        def __init__(self):
            inputs = keras.Input((6,))
            super().__init__(inputs, keras.layers.Dense(3)(inputs), name="fs")

    functional_subclass = FunctionalSubclass()
    assert isinstance(functional_subclass, FunctionalModel)
    # Neither kmp.Model's bases nor those of the base it overrides Keras'
    # build in (kmp._keras_internals.ModelBase) were rewritten by Keras.
    assert kmp.Model.__bases__ == bases_before == (_keras_internals.ModelBase,)
    assert _keras_internals.ModelBase.__bases__ == (keras.Model,)
    model = Subclassed()
    x, y = _data()
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, epochs=1, verbose=0)
    assert [type(layer).__name__ for layer in model.layers] == [
        "Dense",
        "LayerNormalization",
        "Dense",
    ]
    # Keras computes LayerNormalization's statistics in float32 itself and
    # hands bfloat16 on; kmp leaves the layer as Keras made it.
    assert model.norm.compute_dtype == "bfloat16"
    assert functional_subclass(x).dtype == tf.float32


def test_distributed_fit_with_mirrored_strategy(mirrored_strategy):
    kmp.set_policy("mixed_float16")
    strategy = mirrored_strategy
    with strategy.scope():
        model = _functional()
        model.compile("adam", "sparse_categorical_crossentropy")
    x, y = _data()
    # Batch 2 of 4 overflows in the backward pass, in both epochs; one row of
    # it is enough, here one on replica 0 (rows 0-7 of each global batch).
    sample_weight = np.ones(len(x), "float32")
    sample_weight[16 + 3] = OVERFLOWING_SAMPLE_WEIGHT
    steps = TrainableWeightsPerStep()
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=16, epochs=2,
                        shuffle=False, verbose=0, callbacks=[steps])
    assert history.history["skipped_steps"] == [1, 2]
    assert int(model.optimizer.skipped_steps) == 2
    assert history.history["loss_scale"] == [2.0**15 * 0.5**1, 2.0**15 * 0.5**2]
    assert int(model.optimizer.iterations.numpy()) == 8 - 2
    assert [step for step in range(1, 9) if steps.unchanged_by(step)] == [2, 6]


def test_uncompiled_model_reloads_uncompiled(tmp_path):
    model = _functional()
    model.save(tmp_path / "raw.keras")
    restored = keras.models.load_model(tmp_path / "raw.keras")
    assert getattr(restored, "optimizer", None) is None


def test_auto_loss_scale_follows_the_layers_not_the_model_policy():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, dtype="float32")(inputs)
    kmp.set_policy("mixed_float16")
    model = kmp.Model(inputs, outputs)  # the model takes mixed_float16 ...
    model.compile("sgd", "mse")  # ... but nothing in it computes in float16
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_a_subclass_given_inputs_and_outputs_becomes_functional_as_in_keras():
    # Keras' rule: `Sub(inputs=..., outputs=...)` of a subclass without its
    # own __init__ is functional too (through Model.__init__, not __new__).
    kmp.set_policy("float32")

    class Plain(kmp.Model):
        pass

    class KerasPlain(keras.Model):
        pass

    for base, cls in ((kmp.Model, Plain), (keras.Model, KerasPlain)):
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(3)(inputs)
        for model in (cls(inputs=inputs, outputs=outputs), cls(inputs, outputs)):
            assert isinstance(model, _keras_internals.Functional)
            assert isinstance(model, cls) and isinstance(model, base)
            assert model.layers[-1] is outputs._keras_history.operation
    assert isinstance(Plain(inputs, outputs), FunctionalModel)


class ReturnsItsInput(kmp.Model):
    """keras/src/trainers/trainer_test.py's `TrainingTestingLayer` as a
    kmp.Model: no weights at all."""

    def call(self, x, training=False):
        return x if training else x * 0


class KerasReturnsItsInput(keras.Model):
    def call(self, x, training=False):
        return x if training else x * 0


@pytest.mark.parametrize(
    "policy, compile_kwargs, scaled",
    [("mixed_float16", {}, True),
     ("mixed_float16", {"auto_scale_loss": False}, False),
     ("mixed_bfloat16", {}, False)],
)
def test_adds_loss_scaling_optimizer(policy, compile_kwargs, scaled):
    # Keras' trainer_test.py `test_adds_loss_scaling_optimizer`: a model
    # without trainable weights fits (Keras' step applies nothing and says
    # so); with no step to apply there is none to skip or redo (issue 30: kmp
    # raised "None values not supported" in its retry loop).
    # One difference, on purpose: under mixed_bfloat16 kmp.Model's optimizer
    # is the guard (a kmp.LossScaleOptimizer whose scale is fixed at 1), which
    # skips a step whose loss or gradients are not finite; Keras' keeps the
    # RMSprop, which would apply it.
    x, y = np.ones((128, 1)), np.zeros((128, 1))
    histories = []
    for cls in (ReturnsItsInput, KerasReturnsItsInput):
        model = cls(dtype=policy)
        model.compile(optimizer="rmsprop", loss="mse", **compile_kwargs)
        with pytest.warns(UserWarning, match="does not have any trainable weights"):
            histories.append(model.fit(x, y, batch_size=32, verbose=0).history)
        guarded = cls is ReturnsItsInput and policy == "mixed_bfloat16"
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (
            scaled or guarded)
        assert guarded == (isinstance(model.optimizer, kmp.LossScaleOptimizer)
                           and not model.optimizer.scaling)
        optimizer = model.optimizer.inner_optimizer if scaled or guarded else model.optimizer
        assert isinstance(optimizer, keras.optimizers.RMSprop)
        assert int(model.optimizer.iterations) == 0
    ours, theirs = histories
    # The training call returns its input: the mse of ones against zeros.
    assert ours == theirs == {"loss": [1.0]}


def test_functional_models_are_named_as_keras_names_a_class_called_functional_model():
    # FunctionalModel's __name__ is its registered name, "kmp>FunctionalModel"
    # (so that legacy .h5 files name it so); its models keep the names Keras
    # gives a class called FunctionalModel, from the same counter.
    class Reference(keras.Model):
        pass

    Reference.__name__ = "FunctionalModel"
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    names = [
        kmp.Model(inputs, outputs).name,
        Reference(inputs, outputs).name,
        kmp.Model(inputs, outputs).name,
    ]
    stem = names[1].rsplit("_", 1)[0] if names[1][-1].isdigit() else names[1]
    assert stem == "functional_model"
    assert len(set(names)) == 3
    assert all(name == stem or name.startswith(stem + "_") for name in names)
    assert kmp.Model(inputs, outputs, name="mine").name == "mine"
    assert FunctionalModel.__name__ == keras.saving.get_registered_name(FunctionalModel)
    assert FunctionalModel.__qualname__ == "FunctionalModel"


class _ActivityLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(x))
        return x


def test_losses_can_be_read_after_fit_as_in_keras():
    # After fit, Keras' `losses` hands back what the last traced step left
    # (symbolic tensors of an ended graph); kmp's float32 cast of them raised
    # "out of scope". An eager call's losses are float32 values.
    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def make(model_class):
        inputs = keras.Input((4,))
        hidden = _ActivityLoss()(keras.layers.Dense(4, kernel_initializer="ones")(inputs))
        model = model_class(inputs, keras.layers.Dense(1)(hidden))
        model.compile("adam", "mse")
        model.fit(x, y, verbose=0)
        return model

    model = make(kmp.Model)
    kmp.set_policy("float32")  # Keras' own float16 step cannot add a float16 layer loss
    keras_model = make(keras.Model)
    assert len(model.losses) == len(keras_model.losses) == 1
    model(x[:8])
    (loss,) = model.losses
    assert keras.backend.standardize_dtype(loss.dtype) == "float32"
    hidden = model.layers[1](x[:8])
    assert float(loss) == pytest.approx(0.01 * float(np.mean(hidden)), rel=1e-2)


def _batch_norm_model(momentum=0.5):
    inputs = keras.Input((8,))
    frozen = keras.layers.Dense(8, kernel_initializer="identity", name="frozen")
    frozen.trainable = False
    norm = keras.layers.BatchNormalization(momentum=momentum, name="norm")
    hidden = keras.layers.Dropout(0.1, name="drop")(norm(frozen(inputs)))
    return kmp.Model(inputs, keras.layers.Dense(1, name="head")(hidden))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_redone_batch_moves_batch_norm_statistics_once(jit_compile):
    # Targets of 1000: the first attempts' gradients overflow float16 at the
    # initial scale; each redo ran the forward pass again, and the moving
    # statistics moved once per attempt (11 times instead of once).
    kmp.set_policy("mixed_float16")
    x = np.random.default_rng(0).normal(3.0, 1.0, size=(64, 8)).astype("float32")
    y = np.full((64, 1), 1000.0, "float32")
    model = _batch_norm_model()
    model.compile(keras.optimizers.SGD(1e-6), "mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert int(model.optimizer.counters["retries"]) >= 2
    assert int(model.optimizer.iterations) == 1
    norm = model.get_layer("norm")
    # One update from (0, 1): momentum 0.5 times the old value plus 0.5 times
    # the batch's mean and variance, in float16 inside the layer.
    batch = x.astype("float64")
    np.testing.assert_allclose(norm.moving_mean.numpy(), 0.5 * batch.mean(0), rtol=2e-3)
    np.testing.assert_allclose(norm.moving_variance.numpy(), 0.5 + 0.5 * batch.var(0), rtol=2e-3)


def test_a_skipped_step_leaves_batch_norm_statistics_as_they_were():
    # A batch whose float16 activations overflow: the step is skipped, and
    # the moving statistics it would have set to inf stay as they were.
    kmp.set_policy("mixed_float16")
    x, y = activations_overflowing_in_the_second_batch()
    model = _batch_norm_model()
    model.compile("adam", "mse", overflow_retries=0)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    norm = model.get_layer("norm")
    before = [v.numpy().copy() for v in model.non_trainable_variables]
    model.fit(x[32:], y[32:], batch_size=32, epochs=1, verbose=0)
    assert int(model.optimizer.skipped_steps) == 1
    for old, variable in zip(before, model.non_trainable_variables):
        np.testing.assert_array_equal(old, variable.numpy())
    assert np.isfinite(model.predict(x[:4], verbose=0)).all()
    assert norm.moving_mean.numpy().any()  # the first, applied step did move them


def test_only_variables_the_forward_pass_writes_are_put_back():
    # A frozen layer's weights are only read: no select, no write, whatever
    # their size; the moving statistics and the dropout's seed are written.
    from kmp.backends.tensorflow import layer_state

    model = _batch_norm_model()
    model(np.zeros((2, 8), "float32"))
    candidates = [v.path for v in model.non_trainable_variables]
    assert {"frozen/kernel", "frozen/bias", "norm/moving_mean"} <= set(candidates)

    @tf.function
    def forward(x):
        graph = tf.compat.v1.get_default_graph()
        mark = len(graph.get_operations())
        model(x, training=True)
        written = layer_state._written_handles(graph.get_operations()[mark:])
        forward.written = [v.path for v in model.non_trainable_variables
                           if id(v.value.handle) in written]

    forward(tf.zeros((2, 8)))
    norm, drop = model.get_layer("norm"), model.get_layer("drop")
    assert sorted(forward.written) == sorted(
        [norm.moving_mean.path, norm.moving_variance.path, drop.seed_generator.state.path])
