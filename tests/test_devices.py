"""What training on a GPU depends on, checked on any machine where it can be.

On a GPU, Keras compiles the train step with XLA by default
(`jit_compile="auto"`), and TensorFlow keeps int32 tensors in host memory
there, so an int32 variable read inside an XLA-compiled step on the GPU fails
to compile. A CPU-only run never meets either unless a test asks for it:
these tests train under `jit_compile=True` and `"auto"` with several steps
per call, and pin the variable dtypes. The `gpu` test checks placement on a
real GPU and is skipped elsewhere.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from _helpers import overflowing_sample_weights


def _data(n=96, features=6, classes=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, rng.integers(0, classes, size=n)


def _model():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    return kmp.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


@pytest.mark.parametrize("jit_compile", [True, "auto"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_compiled_fit_with_several_steps_per_execution(policy, jit_compile):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)

    def compiled_model():
        model = _model()
        optimizer = "adam"  # bfloat16: no loss scaling
        if policy == "mixed_float16":
            # A scale at which this model's own gradients stay far below 65504.
            optimizer = kmp.LossScaleOptimizer("adam", initial_scale=2.0**10)
        # The overflowing batches are skipped, not redone: the skip count below.
        model.compile(optimizer, "sparse_categorical_crossentropy", jit_compile=jit_compile,
                      steps_per_execution=4, overflow_retries=0)
        return model

    model = compiled_model()
    # "auto" is Keras' rule, unchanged by kmp: XLA where there is a GPU.
    on_gpu = bool(tf.config.list_physical_devices("GPU"))
    assert model.jit_compile is (True if jit_compile is True else on_gpu)
    x, y = _data()
    # Batch 5 of 6 overflows float16 in the backward pass, in both epochs:
    # a skip inside the second call of each epoch (its 2 steps run together).
    sample_weight = overflowing_sample_weights(len(x), 16, batches=[5])

    def fit(model, keep):
        return model.fit(x[keep], y[keep], sample_weight=sample_weight[keep], batch_size=16,
                         epochs=2, shuffle=False, verbose=0)

    before = [w.copy() for w in model.get_weights()]
    # 6 batches an epoch: one call runs 4 steps, the next 2.
    history = fit(model, np.ones(len(x), bool))
    assert np.all(np.isfinite(history.history["loss"]))
    assert any(np.any(old != new) for old, new in zip(before, model.get_weights()))
    if policy == "mixed_float16":
        assert history.history["skipped_steps"] == [1, 2]
        assert int(model.optimizer.skipped_steps) == 2
        assert int(model.optimizer.iterations) == 12 - 2
        assert history.history["loss_scale"] == [2.0**10 * 0.5**1, 2.0**10 * 0.5**2]
        # The skipped steps changed no trainable weight: the same model
        # trained without batch 5 ends with the same ones.
        keras.utils.set_random_seed(0)
        control = compiled_model()
        fit(control, sample_weight == 1)
        assert int(control.optimizer.skipped_steps) == 0
        for ours, theirs in zip(model.trainable_weights, control.trainable_weights):
            np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    else:
        # bfloat16 needs no loss scaling (the guard scales nothing): the
        # heavy batch is a step like any.
        assert not model.optimizer.scaling
        assert int(model.optimizer.iterations) == 12


def _all_variables(model):
    variables = [*model.variables, *model.optimizer.variables]
    inner = getattr(model.optimizer, "inner_optimizer", None)
    if inner is not None:
        variables += inner.variables
    return variables


def test_no_variable_is_int32_which_a_gpu_keeps_in_host_memory():
    kmp.set_policy("mixed_float16")
    model = _model()
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=True)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    int32 = [v.path for v in _all_variables(model) if v.dtype == "int32"]
    assert int32 == []


@pytest.mark.gpu
def test_compiled_float16_fit_keeps_every_optimizer_variable_on_the_gpu():
    kmp.set_policy("mixed_float16")
    model = _model()
    model.compile("adam", "sparse_categorical_crossentropy", jit_compile=True)
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    placement = {
        v.path: tf.DeviceSpec.from_string(v.value.device).device_type
        for v in _all_variables(model)
    }
    assert {path for path, device in placement.items() if device != "GPU"} == set()
