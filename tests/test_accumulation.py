"""kmp.LossScaleOptimizer with the inner optimizer's `gradient_accumulation_steps`."""

import keras
import numpy as np
import pytest

import kmp

_MICRO_BATCH = 8
_ACCUMULATION = 4
_WINDOWS = 8
_INITIAL_SCALE = 2.0**10


def _data(poisoned_micro_batches=()):
    rng = np.random.default_rng(0)
    n = _MICRO_BATCH * _ACCUMULATION * _WINDOWS
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    for micro_batch in poisoned_micro_batches:
        # Finite in the float16 forward pass; the scaled gradient overflows
        # (in a micro-batch of 8 and in a batch of 32 alike).
        x[micro_batch * _MICRO_BATCH + 1] = 3e4
    return x, y


class _ScalePerStep(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.scales = []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(logs["loss_scale"]))


def _fit(accumulate, data, inner=keras.optimizers.Adam, jit_compile="auto", **kmp_kwargs):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))
    inner_optimizer = inner(
        0.01, gradient_accumulation_steps=_ACCUMULATION if accumulate else None
    )
    model.compile(
        kmp.LossScaleOptimizer(inner_optimizer, initial_scale=_INITIAL_SCALE,
                               growth_interval=2, **kmp_kwargs),
        "mse",
        # Both runs drop an overflowing batch (a retry would redo one
        # micro-batch of a window, so accumulation has none).
        overflow_retries=0,
        jit_compile=jit_compile,
    )
    scales = _ScalePerStep()
    batch_size = _MICRO_BATCH if accumulate else _MICRO_BATCH * _ACCUMULATION
    x, y = data
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[scales])
    return model, scales.scales


def _assert_same_training(accumulated, reference):
    for name in ("loss_scale", "skipped_steps"):
        assert float(getattr(accumulated.optimizer, name)) == float(
            getattr(reference.optimizer, name)
        ), name
    assert int(accumulated.optimizer.iterations) == int(reference.optimizer.iterations)
    for a, b in zip(accumulated.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4)


# Under XLA the window's branches are selects (kmp/backends/tensorflow/step.py).
_JIT = pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])


@pytest.fixture(scope="module")
def unaccumulated():
    """`run(poisoned=(), **kmp_kwargs)`: the model of the reference run, one
    batch of the window's size per step, trained once per data and options
    for this file (the graph and XLA cases compare with the same one; the
    tests only read it)."""
    models = {}

    def run(poisoned=(), **kmp_kwargs):
        key = (tuple(poisoned), tuple(sorted(kmp_kwargs.items())))
        if key not in models:
            models[key], _ = _fit(False, _data(poisoned), **kmp_kwargs)
        return models[key]

    return run


@_JIT
def test_accumulated_run_equals_one_run_on_the_concatenated_batches(jit_compile, unaccumulated):
    data = _data()
    accumulated, _ = _fit(True, data, jit_compile=jit_compile)
    reference = unaccumulated()
    assert int(accumulated.optimizer.skipped_steps) == 0
    assert int(accumulated.optimizer.iterations) == _WINDOWS
    _assert_same_training(accumulated, reference)


@_JIT
@pytest.mark.parametrize("poisoned", [(9,), (9, 11)], ids=["one", "two_in_one_window"])
def test_overflow_discards_the_whole_accumulated_step_once(poisoned, jit_compile, unaccumulated):
    # Micro-batches 9 and 11 are in window 2 (micro-batches 8-11).
    data = _data(poisoned)
    accumulated, scales = _fit(True, data, jit_compile=jit_compile)
    reference = unaccumulated(poisoned)
    assert int(accumulated.optimizer.skipped_steps) == 1
    assert int(accumulated.optimizer.iterations) == _WINDOWS - 1
    _assert_same_training(accumulated, reference)
    # No inf or NaN reached the accumulators, and they are empty after the
    # last (applied) window.
    for accumulator in accumulated.optimizer.inner_optimizer._accumulated_gradients:
        np.testing.assert_array_equal(np.asarray(accumulator), 0.0)
    # The scale changes only at a window's last micro-batch.
    changes = [i for i in range(1, len(scales)) if scales[i] != scales[i - 1]]
    assert changes and all((i + 1) % _ACCUMULATION == 0 for i in changes)
    assert scales[2 * _ACCUMULATION] == _INITIAL_SCALE * 2  # grew after windows 0-1
    assert scales[3 * _ACCUMULATION - 1] == _INITIAL_SCALE  # backed off at window 2's end


@_JIT
def test_accumulators_stay_finite_mid_window(jit_compile):
    x, y = _data((9,))
    # Stop inside window 2, right after the overflowing micro-batch.
    x, y = x[: 10 * _MICRO_BATCH], y[: 10 * _MICRO_BATCH]
    model, scales = _fit(True, (x, y), inner=keras.optimizers.SGD, jit_compile=jit_compile)
    for accumulator in model.optimizer.inner_optimizer._accumulated_gradients:
        assert np.all(np.isfinite(np.asarray(accumulator)))
    assert int(model.optimizer.skipped_steps) == 0  # not decided before the window ends
    assert scales[-1] == _INITIAL_SCALE * 2


def test_clipping_with_accumulation_clips_the_accumulated_gradients(unaccumulated):
    # The scaler's clipping is the inner optimizer's (issue 23), which clips
    # the accumulated, unscaled gradients of a window: the same training as
    # one batch of the window's size, clipped once.
    data = _data()
    accumulated, _ = _fit(True, data, global_clipnorm=0.05)
    reference = unaccumulated(global_clipnorm=0.05)
    unclipped = unaccumulated()
    assert accumulated.optimizer.inner_optimizer.global_clipnorm == 0.05
    _assert_same_training(accumulated, reference)
    # The clip was active: without it the weights differ.
    assert any(
        not np.allclose(a, b, rtol=2e-3, atol=2e-4)
        for a, b in zip(reference.get_weights(), unclipped.get_weights())
    )


def test_accumulation_under_mirrored_strategy(mirrored_strategy):
    # Only where Keras' own accumulation trains a float32 keras.Model: with
    # MirroredStrategy on CPUs (merge_call) its optimizer's cond around
    # merge_call fails (TF 2.21, Keras 3.15).
    with mirrored_strategy.scope():
        inputs = keras.Input((4,))
        plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        plain.compile(keras.optimizers.SGD(gradient_accumulation_steps=2), "mse")
    try:
        plain.fit(np.ones((16, 4), "float32"), np.ones((16, 1), "float32"),
                  batch_size=8, verbose=0)
    except RuntimeError as error:
        pytest.skip(
            "Keras' own gradient accumulation fails under MirroredStrategy here: "
            + next(line for line in str(error).splitlines() if "merge_call" in line)[:160]
        )
    data = _data((9,))
    with mirrored_strategy.scope():
        distributed, scales = _fit(True, data)
    single, single_scales = _fit(True, data)
    assert scales == single_scales
    assert int(distributed.optimizer.skipped_steps) == 1
    _assert_same_training(distributed, single)
