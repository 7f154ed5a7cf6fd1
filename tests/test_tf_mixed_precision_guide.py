"""TensorFlow's mixed-precision guide, run as a Keras 3 user who adopts kmp runs it.

https://www.tensorflow.org/guide/mixed_precision ("Mixed precision", the
tf.keras guide; source: tensorflow/docs, site/en/guide/mixed_precision.ipynb).
The guide's code, changed only where kmp or Keras 3 asks:

- `mixed_precision.set_global_policy('mixed_float16')` is kmp's one line,
  `kmp.set_policy("mixed_float16")`;
- `mixed_precision.LossScaleOptimizer(optimizer)` is `kmp.LossScaleOptimizer`;
- tf.keras names are Keras 3's (`keras.layers`, `keras.optimizers.RMSprop`,
  `keras.mixed_precision.global_policy()`), and `x.dtype.name` is `x.dtype`
  (a Keras 3 tensor's and variable's dtype is a string already);
- the model is the guide's CPU model (64 units, the guide's own choice without
  a GPU) on scikit-learn's 8x8 digits (64 pixels, no download) instead of
  MNIST's 784, with batches of 64: float16 is emulated on a CPU.

Each test is one section of the guide, and checks what the guide prints or
promises against a reference: Keras' own classes and defaults, a float32 run
of the same model from the same weights, a plain-Python reading of the rule.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import kmp

# The guide's choice without a GPU ("Use fewer units on CPUs so the model
# finishes in a reasonable amount of time").
NUM_UNITS = 64
# 1280 training images: 20 batches of 64, and 16 + 4 once fit's
# validation_split=0.2 holds out 256, so every batch has one shape and each
# step is traced once. The other 517 images are the test set.
TRAIN = 1280
BATCH = 64
EPOCHS = 5  # the guide's
# Test accuracy after the guide's 5 epochs, measured on this split and model
# (TensorFlow 2.21, Keras 3.15.1, a 2-core CPU without GPU), seeds 0 to 5:
# fit 0.80 to 0.86, the custom loop 0.84 to 0.89, under mixed_float16 and
# float32 alike (each seed within 0.004 of its float32 run). Chance is 0.10.
MIN_TEST_ACCURACY = 0.75


def _digits():
    """`(x_train, y_train), (x_test, y_test)`, the guide's MNIST cell on the
    digits: pixels scaled to [0, 1] in float32, as the guide does ("you
    should run input processing math in float32 if it runs on the CPU")."""
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn is a test extra")
    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return (x[:TRAIN], y[:TRAIN]), (x[TRAIN:], y[TRAIN:])


def _guide_model(dtype=None):
    """The guide's "Building the model" cells, with its printed dtypes.

    `dtype="float32"` gives every layer float32 (the float32 reference).

    Returns:
        `(model, printed)`: `printed` holds the dtypes the guide prints.
    """
    inputs = keras.Input(shape=(64,), name="digits")
    dense1 = layers.Dense(NUM_UNITS, activation="relu", name="dense_1", dtype=dtype)
    x = dense1(inputs)
    dense2 = layers.Dense(NUM_UNITS, activation="relu", name="dense_2", dtype=dtype)
    x = dense2(x)
    printed = {"dense1.dtype_policy": dense1.dtype_policy, "x.dtype": x.dtype,
               "dense1.kernel.dtype": dense1.kernel.dtype}
    # CORRECT: softmax and model output are float32
    x = layers.Dense(10, name="dense_logits", dtype=dtype)(x)
    printed["logits.dtype"] = x.dtype
    outputs = layers.Activation("softmax", dtype="float32", name="predictions")(x)
    printed["outputs.dtype"] = outputs.dtype
    # The linear activation is an identity function: a cast to float32, here a no-op.
    outputs = layers.Activation("linear", dtype="float32")(outputs)
    printed["linear outputs.dtype"] = outputs.dtype
    return keras.Model(inputs=inputs, outputs=outputs), printed


def _compiled_guide_model():
    """The guide's model under kmp's one line, compiled as its two training
    sections (`Model.fit` and the custom loop) compile it."""
    kmp.set_policy("mixed_float16")
    model, _ = _guide_model()
    model.compile(loss="sparse_categorical_crossentropy",
                  optimizer=keras.optimizers.RMSprop(),
                  metrics=["accuracy"])
    return model


def _guide_train_step(model, optimizer, loss_object):
    """The guide's `train_step`, word for word."""

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            predictions = model(x)
            loss = loss_object(y, predictions)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return train_step


def test_the_policy_is_mixed_float16_as_the_guide_prints():
    # "Setting the dtype policy": the guide's
    #   policy = mixed_precision.Policy('mixed_float16')
    #   mixed_precision.set_global_policy(policy)
    # is kmp's one line, which returns the policy it set.
    policy = kmp.set_policy("mixed_float16")
    # print('Compute dtype: %s' % policy.compute_dtype)  -> float16
    # print('Variable dtype: %s' % policy.variable_dtype) -> float32
    assert (policy.compute_dtype, policy.variable_dtype) == ("float16", "float32")
    # What Keras reads is Keras' own policy of that name, under every name it has.
    for reading in (keras.mixed_precision.global_policy(), keras.mixed_precision.dtype_policy(),
                    keras.config.dtype_policy()):
        assert type(reading) is keras.DTypePolicy
        assert (reading.name, reading.compute_dtype, reading.variable_dtype) == (
            "mixed_float16", "float16", "float32")
        # print(...) shows what Keras 3 shows for its own policy: `<DTypePolicy
        # "mixed_float16">`, Keras 3's name for tf.keras' `<Policy "mixed_float16">`.
        assert repr(reading) == repr(keras.DTypePolicy("mixed_float16"))

    # "Building the model": each Dense layer takes the global policy, computes
    # in float16 and keeps float32 variables:
    # <Policy "mixed_float16">, x.dtype: float16, dense1.kernel.dtype: float32.
    _, printed = _guide_model()
    assert printed["dense1.dtype_policy"].name == "mixed_float16"
    assert printed["x.dtype"] == "float16"
    assert printed["dense1.kernel.dtype"] == "float32"


def test_the_guides_model_outputs_float32_after_its_float32_softmax():
    kmp.set_policy("mixed_float16")
    model, printed = _guide_model()
    # INCORRECT: softmax and model output will be float16, when it should be float32
    incorrect = layers.Dense(10, activation="softmax", name="predictions")(
        model.get_layer("dense_2").output)
    assert incorrect.dtype == "float16"  # 'Outputs dtype: float16'
    # CORRECT: the Dense logits stay float16, the float32 softmax outputs float32
    # ('Outputs dtype: float32'), and the linear float32 Activation keeps it.
    assert printed["logits.dtype"] == "float16"
    assert printed["outputs.dtype"] == "float32"
    assert printed["linear outputs.dtype"] == "float32"
    assert model.outputs[0].dtype == "float32"
    # "Their variables are float32 and will be cast to float16 when the layers
    # are called": every weight is float32, and a real batch comes out float32.
    assert {w.dtype for w in model.weights} == {"float32"}
    (x_train, _), _ = _digits()
    predictions = model(x_train[:BATCH])
    assert keras.backend.standardize_dtype(predictions.dtype) == "float32"
    np.testing.assert_allclose(np.sum(keras.ops.convert_to_numpy(predictions), axis=-1), 1.0,
                               rtol=1e-5)


def test_model_fit_trains_with_keras_own_loss_scale_optimizer():
    model = _compiled_guide_model()
    (x_train, y_train), (x_test, y_test) = _digits()
    history = model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS,
                        validation_split=0.2, verbose=0)
    test_scores = model.evaluate(x_test, y_test, verbose=0)

    # "If you use Model.fit, loss scaling is done for you". A plain
    # keras.Model's compile is Keras' own, and kmp changes no Keras method:
    # Keras wraps the optimizer because the model's policy is named
    # "mixed_float16" (compile's auto_scale_loss=True), in Keras' own
    # LossScaleOptimizer, once. kmp's scaler, its logs and its skipped-step
    # guarantees are kmp.Model's (README, "A first model").
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    assert not isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert type(model.optimizer.inner_optimizer) is keras.optimizers.RMSprop
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]

    for name in ("loss", "val_loss"):
        assert np.isfinite(history.history[name]).all(), history.history[name]
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert np.isfinite(test_scores[0])
    assert test_scores[1] >= MIN_TEST_ACCURACY, test_scores


def test_the_custom_training_loop_divides_gradients_once_and_trains():
    model = _compiled_guide_model()
    (x_train, y_train), (x_test, y_test) = _digits()
    initial_weights = model.get_weights()

    optimizer = keras.optimizers.RMSprop()
    optimizer = kmp.LossScaleOptimizer(optimizer)
    # The guide's loss scale, read before training: a float32 scalar, the
    # initial scale of Keras' own scaler (2**15, tf.keras' too).
    keras_default = keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop()).initial_scale
    assert keras.backend.standardize_dtype(optimizer.loss_scale.dtype) == "float32"
    assert tuple(optimizer.loss_scale.shape) == ()
    assert float(optimizer.loss_scale) == keras_default == 2.0**15

    loss_object = keras.losses.SparseCategoricalCrossentropy()
    train_dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                     .shuffle(10000).batch(BATCH))
    # The test set in one batch, as the guide's 8192 hold most of MNIST's 10000.
    test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(len(x_test))
    train_step = _guide_train_step(model, optimizer, loss_object)

    @tf.function
    def test_step(x):
        return model(x, training=False)

    model.set_weights(initial_weights)

    # The float32 reference: the same model in float32, from the same weights,
    # one RMSprop step on the loop's first batch, without any scaling.
    reference, _ = _guide_model(dtype="float32")
    reference.set_weights(initial_weights)
    reference_optimizer = keras.optimizers.RMSprop()

    epoch_losses, test_accuracies, steps = [], [], 0
    with warnings.catch_warnings():
        # kmp warns when it divides gradients of a loss `scale_loss` never
        # saw; get_scaled_loss is tf.keras' name for it, so nothing warns.
        warnings.simplefilter("error", UserWarning)
        for epoch in range(EPOCHS):
            epoch_loss_avg = keras.metrics.Mean()
            test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
            for x, y in train_dataset:
                if steps == 0:
                    with tf.GradientTape() as tape:
                        reference_loss = loss_object(y, reference(x))
                    reference_optimizer.apply(
                        tape.gradient(reference_loss, reference.trainable_variables),
                        reference.trainable_variables)
                loss = train_step(x, y)
                steps += 1
                if steps == 1:
                    _assert_one_step_matches_float32(model, optimizer, reference,
                                                     reference_optimizer)
                epoch_loss_avg(loss)
            for x, y in test_dataset:
                predictions = test_step(x)
                test_accuracy.update_state(y, predictions)
            epoch_losses.append(float(epoch_loss_avg.result()))
            test_accuracies.append(float(test_accuracy.result()))

    assert np.isfinite(epoch_losses).all(), epoch_losses
    assert epoch_losses[-1] < epoch_losses[0]
    assert test_accuracies[-1] >= MIN_TEST_ACCURACY, test_accuracies
    # Every step was applied or skipped, and the scale is the rule's in closed
    # form: doubled every 2000 applied steps in a row (none here), halved at
    # each skip (hysteresis 1).
    applied, skipped = int(optimizer.iterations), int(optimizer.skipped_steps)
    assert applied + skipped == steps == EPOCHS * TRAIN // BATCH
    assert float(optimizer.loss_scale) == keras_default * 0.5**skipped * 2.0 ** (applied // 2000)


def _assert_one_step_matches_float32(model, optimizer, reference, reference_optimizer):
    """After the first step, RMSprop's state is the float32 reference's, to
    float16 rounding: gradients divided exactly once.

    RMSprop's first step stores (1 - rho) * g**2 in its velocity: a gradient
    divided twice (or not at all) by the loss scale 2**15 would leave it
    2**30 times too small (too large).
    """
    assert int(optimizer.iterations) == 1 and int(optimizer.skipped_steps) == 0
    # One velocity per trainable variable, in the order both were built on:
    # sqrt(velocity / (1 - rho)) is the gradient RMSprop received, and its
    # norm the float32 reference's. A gradient divided twice would give
    # 2**-15, an undivided one 2**15. Float16 moves it by 0.3% here (the
    # first layer's, through ReLU masks that float16 rounding flips; the
    # other layers' by 0.02%).
    mine = [v for v in optimizer.inner_optimizer.variables if "velocity" in v.name]
    theirs = [v for v in reference_optimizer.variables if "velocity" in v.name]
    assert len(mine) == len(theirs) == len(model.trainable_variables)
    for variable, velocity, expected in zip(model.trainable_variables, mine, theirs):
        norm_ratio = np.sqrt(np.sum(velocity.numpy()) / np.sum(expected.numpy()))
        np.testing.assert_allclose(norm_ratio, 1.0, rtol=0.05, err_msg=variable.path)


def test_an_overflowing_batch_is_skipped_and_halves_the_loss_scale():
    # "Underflow and Overflow": float16 overflows above 65504, underflows
    # below 6.0e-8.
    x = tf.constant(256, dtype="float16")
    assert np.isinf((x**2).numpy())  # Overflow
    x = tf.constant(1e-5, dtype="float16")
    assert (x**2).numpy() == 0.0  # Underflow

    # "LossScaleOptimizer.apply_gradients will then apply gradients if none of
    # them have Infs or NaNs. It will also update the loss scale, halving it
    # if the gradients had Infs or NaNs and potentially increasing it
    # otherwise." kmp: the step changes nothing (weights, RMSprop's slots,
    # iterations) and counts in skipped_steps (docs/overflows.md).
    kmp.set_policy("mixed_float16")
    model, _ = _guide_model()
    (x_train, y_train), _ = _digits()
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.RMSprop())
    train_step = _guide_train_step(model, optimizer,
                                   keras.losses.SparseCategoricalCrossentropy())
    x, y = x_train[:BATCH], y_train[:BATCH]
    # Pixels times 100: activations and logits stay below a few hundred, so
    # the forward pass and the loss are finite, but the kernels' gradients,
    # the activations times the loss's gradient times the scale 2**15, pass
    # 65504: the backward overflow loss scaling is there to catch.
    overflowing = x * 100.0

    def state():
        return model.get_weights(), [v.numpy() for v in optimizer.inner_optimizer.variables]

    train_step(x, y)  # applied: RMSprop's slots now hold something to keep
    assert (int(optimizer.iterations), int(optimizer.skipped_steps)) == (1, 0)
    scale = float(optimizer.loss_scale)
    assert scale == 2.0**15
    before = state()
    loss = train_step(overflowing, y)
    after = state()
    # A backward overflow: the loss was finite (no forward overflow counted).
    assert np.isfinite(float(loss))
    assert int(optimizer.counters["forward_overflows"]) == 0
    for old, new in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(old, new)
    assert (int(optimizer.iterations), int(optimizer.skipped_steps)) == (1, 1)
    assert float(optimizer.loss_scale) == scale * 0.5

    # Keras' own scaler, Keras 3's heir of tf.keras', on the same weights and
    # batch: it skips the step and halves its scale as well.
    keras_optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop())
    keras_optimizer.build(model.trainable_variables)
    loss_object = keras.losses.SparseCategoricalCrossentropy()
    with tf.GradientTape() as tape:
        scaled_loss = keras_optimizer.scale_loss(loss_object(y, model(overflowing)))
    keras_optimizer.apply_gradients(
        zip(tape.gradient(scaled_loss, model.trainable_variables), model.trainable_variables))
    assert int(keras_optimizer.iterations) == 0
    assert float(keras_optimizer.dynamic_scale) == keras_optimizer.initial_scale * 0.5
    for old, new in zip(before[0], model.get_weights()):
        np.testing.assert_array_equal(old, new)

    # The next ordinary batch is applied, at the halved scale.
    train_step(x, y)
    assert (int(optimizer.iterations), int(optimizer.skipped_steps)) == (2, 1)
    assert float(optimizer.loss_scale) == scale * 0.5
    assert not all(np.array_equal(old, new) for old, new in zip(before[0], model.get_weights()))
