"""kmp's float32 outputs keep the logits behind a softmax, as Keras' float16
outputs do, so a loss computed from them does not overflow sooner.

Keras' cross-entropies differentiate a softmax output from its logits
(`_keras_logits`): the gradient is `scale * (p - y)`. Through a bare cast to
float32 they took `log(p)`, whose gradient `scale * (1 - p) / p` overflows
float16 for a small p: a GradientTape loop on a `kmp.convert`ed model then
skipped steps that Keras' own mixed precision did not (keras.io's Reptile).
"""

import keras
import numpy as np
import tensorflow as tf

import kmp

SCALE = 2.0**14


def _softmax_model(policy):
    kmp.set_policy(policy)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3, activation="softmax")(inputs)
    model = kmp.Model(inputs, outputs)
    # The true class gets p ~ 0.05: scale * (1 - p) / p ~ 3e5 > float16's max.
    model.set_weights([np.array([[0, 0, -3]] * 4, "float32") / 4, np.zeros(3, "float32")])
    return model


def _scaled_gradients(model, loss_fn):
    x, y = np.ones((2, 4), "float32"), np.array([2, 2])
    with tf.GradientTape() as tape:
        outputs = model(x)
        loss = keras.ops.sum(loss_fn(y, outputs)) * SCALE
    return outputs, tape.gradient(loss, model.trainable_variables)


def test_a_16_bit_softmax_output_is_float32_and_keeps_its_logits():
    outputs, _ = _scaled_gradients(_softmax_model("mixed_float16"),
                                   keras.losses.sparse_categorical_crossentropy)
    assert outputs.dtype == tf.float32
    assert outputs._keras_logits.dtype == tf.float32
    np.testing.assert_allclose(keras.ops.softmax(outputs._keras_logits), outputs, atol=1e-3)


def test_the_scaled_gradient_of_a_softmax_output_stays_finite_and_right_in_float16():
    reference = _scaled_gradients(_softmax_model("float32"),
                                  keras.losses.sparse_categorical_crossentropy)[1]
    kmp_gradients = _scaled_gradients(_softmax_model("mixed_float16"),
                                      keras.losses.sparse_categorical_crossentropy)[1]
    for got, want in zip(kmp_gradients, reference):
        assert bool(tf.reduce_all(tf.math.is_finite(got)))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=SCALE * 2e-3)


def test_kmp_loses_no_more_reptile_steps_than_keras_own_scaler():
    from benchmarks import first_steps

    # One meta-step of four inner steps (the benchmark's --smoke): through a
    # bare cast, the gradient scale * (1 - p) / p overflows float16 from the
    # first step on, where the true class has p ~ 1/5 (4 * 2**15 > 65504).
    # 8 steps lost what 4 lose: Keras 1, kmp 0 (2026-12-06).
    keras_run = first_steps.measure("keras", "reptile", 4)
    kmp_run = first_steps.measure("kmp", "reptile", 4)
    assert kmp_run["lost"] <= keras_run["lost"], (kmp_run, keras_run)
    assert kmp_run["final_loss_scale"] >= keras_run["final_loss_scale"]
