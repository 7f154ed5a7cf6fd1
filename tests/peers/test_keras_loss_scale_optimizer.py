"""Keras' LossScaleOptimizer tests, on `kmp.LossScaleOptimizer`.

Ported from keras-team/keras, keras/src/optimizers/loss_scale_optimizer_test.py
(`LossScaleOptimizerTest`, as of Keras 3.15): each test keeps its name and
restates the original's scenario and numbers. Where the original's path
exists for Keras' own scaler on this backend (`apply` on TensorFlow,
`stateless_apply` on JAX), Keras' scaler runs the same scenario beside kmp's
as a second reference.

Keras runs the stateful case on TensorFlow only and the stateless one on JAX
only; kmp's `apply` also works on JAX (docs/jax.md), so the stateful case runs
in both passes, and the stateless one (Keras' JAX path; TensorFlow refuses
`stateless_apply` for any optimizer) in the JAX pass.

Deliberate differences of kmp, tested as kmp documents them rather than
skipped:
- `dynamic=False` keeps a fixed scale and still skips non-finite steps
  (docs/loss-scaling.md, "The rule"); Keras' scaler refuses it.
- `clipnorm`, `global_clipnorm` and `clipvalue` are accepted and set on the
  inner optimizer, which clips the unscaled gradients (docs/loss-scaling.md,
  "kmp.LossScaleOptimizer by hand"); Keras' scaler refuses them.
- `get_config` returns every constructor argument (`growth_interval` is
  kmp's name for `dynamic_growth_steps`, docs/loss-scaling.md), not Keras'
  four keys.
"""

import keras
import numpy as np
import pytest
from keras import ops

import kmp

ON_JAX = keras.backend.backend() == "jax"

# `stateful`: `apply` (both backends in kmp); `stateless`: Keras' JAX path.
MODES = [
    pytest.param(False, id="stateful"),
    pytest.param(True, id="stateless", marks=pytest.mark.backend("jax")),
]

GRADS = [1.0, 6.0, 7.0, 2.0]
START = [1.0, 2.0, 3.0, 4.0]


def _run(optimizer, grads, variables, stateless):
    """One step through `apply` or `stateless_apply`; the new values are
    assigned back, as the original does for the optimizer's."""
    if not stateless:
        optimizer.apply(grads, variables)
        return
    new_values, optimizer_values = optimizer.stateless_apply(
        [v.value for v in optimizer.variables], grads, [v.value for v in variables]
    )
    for variable, value in zip(variables, new_values):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_values):
        variable.assign(value)


def _keras_reference(stateless, steps, grads, **kwargs):
    """The same scenario on Keras' own scaler, where this backend runs its
    path: `(variable values, scale_loss(1.0))`, or `None`."""
    if stateless != ON_JAX:
        return None
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.5), **kwargs
    )
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    for _ in range(steps):
        _run(optimizer, grads, variables, stateless)
    return ops.convert_to_numpy(variables[0]), float(optimizer.scale_loss(1.0))


def test_config():
    """Original: `test_config` (Keras' class serialization round trip)."""
    inner = keras.optimizers.SGD(learning_rate=0.5, momentum=0.06, nesterov=True,
                                 weight_decay=0.004)
    optimizer = kmp.LossScaleOptimizer(inner)
    config = optimizer.get_config()
    revived = kmp.LossScaleOptimizer.from_config(config)
    assert revived.get_config() == config
    serialized = keras.saving.serialize_keras_object(optimizer)
    again = keras.saving.deserialize_keras_object(serialized)
    assert type(again) is kmp.LossScaleOptimizer
    assert again.get_config() == config
    inner_config = again.inner_optimizer.get_config()
    assert inner_config["learning_rate"] == pytest.approx(0.5)
    assert inner_config["momentum"] == pytest.approx(0.06)
    assert inner_config["nesterov"] is True
    assert inner_config["weight_decay"] == pytest.approx(0.004)


def test_apply_with_no_vars():
    """Original: `test_apply_with_no_vars` (stateful only, as there): `apply`
    without variables updates the ones the optimizer was built with."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    grads = [ops.array(GRADS) * optimizer.initial_scale]
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    optimizer.apply(grads)
    # 1 - 0.5 * g for g = grads / scale.
    np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), [0.5, -1.0, -0.5, 3.0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stateless", MODES)
def test_finite_step(stateless):
    """Original: `test_finite_step`: gradients scaled by the initial scale are
    divided by it before SGD(0.5) applies them."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    grads = [ops.array(GRADS) * optimizer.initial_scale]
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    _run(optimizer, grads, variables, stateless)
    expected = np.array(START, np.float64) - 0.5 * np.array(GRADS, np.float64)
    np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), expected, rtol=1e-4, atol=1e-4)
    reference = _keras_reference(stateless, 1, grads)
    if reference is not None:
        np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), reference[0], rtol=1e-6)


@pytest.mark.parametrize("stateless", MODES)
def test_finite_step_with_inner_loss_scale(stateless):
    """Original: `test_finite_step_with_inner_loss_scale`: the inner
    optimizer's `loss_scale_factor` (100) does not change the update."""
    inner = keras.optimizers.SGD(learning_rate=0.5, loss_scale_factor=100)
    optimizer = kmp.LossScaleOptimizer(inner)
    grads = [ops.array(GRADS) * optimizer.initial_scale]
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    _run(optimizer, grads, variables, stateless)
    np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), [0.5, -1.0, -0.5, 3.0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stateless", MODES)
def test_infinite_step(stateless):
    """Original: `test_infinite_step`: an all-inf gradient leaves the
    variable as it was."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    grads = [ops.array([np.inf] * 4)]
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    _run(optimizer, grads, variables, stateless)
    np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), START, rtol=1e-4, atol=1e-4)
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == 0


@pytest.mark.parametrize("stateless", MODES)
def test_finite_step_with_overwrite(stateless):
    """Original: `test_finite_step_with_overwrite`: a variable with
    `overwrite_with_gradient` takes the (undivided) gradient as its value."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    grads = [ops.array(GRADS)]
    variables = [keras.Variable(START)]
    variables[0].overwrite_with_gradient = True
    optimizer.build(variables)
    _run(optimizer, grads, variables, stateless)
    np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), GRADS)


@pytest.mark.parametrize("stateless", MODES)
def test_downscaling(stateless):
    """Original: `test_downscaling`: four overflowing steps from a scale of
    400 halve it four times: 400 / 2**4 = 25."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5),
                                       initial_scale=400.0)
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    grads = [ops.array([np.inf] * 4)]
    for _ in range(4):
        _run(optimizer, grads, variables, stateless)
    assert float(optimizer.scale_loss(1.0)) == pytest.approx(400.0 * 0.5**4)
    reference = _keras_reference(stateless, 4, grads, initial_scale=400.0)
    if reference is not None:
        assert float(optimizer.scale_loss(1.0)) == pytest.approx(reference[1])


@pytest.mark.parametrize("stateless", MODES)
def test_upscaling(stateless):
    """Original: `test_upscaling`: eight finite steps with
    `dynamic_growth_steps=2` double a scale of 2 four times: 32."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5),
                                       initial_scale=2.0, dynamic_growth_steps=2)
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    grads = [ops.array(GRADS)]
    for _ in range(8):
        _run(optimizer, grads, variables, stateless)
    assert float(optimizer.scale_loss(1.0)) == pytest.approx(2.0 * 2.0 ** (8 // 2))
    reference = _keras_reference(stateless, 8, grads, initial_scale=2.0,
                                 dynamic_growth_steps=2)
    if reference is not None:
        assert float(optimizer.scale_loss(1.0)) == pytest.approx(reference[1])
        # kmp divides every step by the scale of that step, as Keras does.
        np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), reference[0], rtol=1e-6)


@pytest.mark.parametrize("stateless", MODES)
def test_iterations_update(stateless):
    """Original: `test_iterations_update`: `iterations` counts each applied
    step: 0, then 1, 2, 3."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    grads = [ops.array(GRADS)]
    assert int(optimizer.iterations) == 0
    for step in range(3):
        _run(optimizer, grads, variables, stateless)
        assert int(optimizer.iterations) == step + 1


def test_serialization():
    """Original: `test_serialization`. kmp's config holds every constructor
    argument (a deliberate difference, see the module docstring) rather than
    Keras' four keys; the values the original checks are there, and the
    config round-trips."""
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5),
                                       initial_scale=3.0, dynamic_growth_steps=2,
                                       name="test_opt")
    config = optimizer.get_config()
    assert config["name"] == "test_opt"
    assert config["initial_scale"] == 3.0
    assert config["growth_interval"] == 2  # Keras' `dynamic_growth_steps`
    assert "inner_optimizer" in config
    revived = kmp.LossScaleOptimizer.from_config(config)
    assert revived.get_config() == config
    assert revived.dynamic_growth_steps == 2


def test_init_dynamic_arg():
    """Original: `test_init_dynamic_arg`. `dynamic=True` is accepted, as in
    Keras; `dynamic=False`, which Keras refuses, is kmp's fixed scale
    (docs/loss-scaling.md): an overflow is skipped, the scale stays."""
    kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5), dynamic=True)
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5),
                                       dynamic=False, initial_scale=8.0)
    variables = [keras.Variable(START)]
    optimizer.build(variables)
    optimizer.apply([ops.array([np.inf] * 4)], variables)
    assert float(optimizer.loss_scale) == 8.0
    assert int(optimizer.skipped_steps) == 1
    np.testing.assert_allclose(ops.convert_to_numpy(variables[0]), START)


def test_init_unsupported_arg():
    """Original: `test_init_unsupported_arg`: unknown arguments raise a
    `ValueError` that lists them all."""
    with pytest.raises(ValueError, match="`foo`.*`bar`"):
        kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5), foo=True, bar=3)


@pytest.mark.parametrize(
    "arg_name, arg_value",
    [
        ("weight_decay", 0.5),
        ("use_ema", True),
        ("ema_momentum", 0.5),
        ("ema_overwrite_frequency", 2),
        ("loss_scale_factor", 0.5),
        ("gradient_accumulation_steps", 2),
    ],
)
def test_init_base_optimizer_unsupported_args(arg_name, arg_value):
    """Original: `test_init_base_optimizer_unsupported_args`: a base-optimizer
    argument is refused with a `ValueError` that says to set it on the inner
    optimizer. (The original's clipping cases, which kmp accepts, are in
    `test_init_base_optimizer_clipping_args`.)"""
    with pytest.raises(ValueError, match=rf"{arg_name}.*inner.optimizer"):
        kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5), **{arg_name: arg_value})


@pytest.mark.parametrize("arg_name", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_init_base_optimizer_clipping_args(arg_name):
    """Original: `test_init_base_optimizer_unsupported_args`, its clipping
    cases. kmp accepts them and sets them on the inner optimizer, which clips
    the unscaled gradients (docs/loss-scaling.md): a deliberate difference."""
    inner = keras.optimizers.SGD(learning_rate=0.5)
    kmp.LossScaleOptimizer(inner, **{arg_name: 0.5})
    assert getattr(inner, arg_name) == 0.5


def test_deserialization_backwards_compatibility():
    """Original: `test_deserialization_backwards_compatibility`: a config of
    Keras' scaler from before 3.4 (every base-optimizer argument at its
    default) deserializes, with its scale and growth steps."""
    base_defaults = {
        "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
        "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
        "ema_overwrite_frequency": None, "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
    }
    config = dict(
        base_defaults,
        name="loss_scale_optimizer",
        inner_optimizer={
            "module": "keras.optimizers",
            "class_name": "SGD",
            "config": dict(base_defaults, name="SGD", learning_rate=0.5, momentum=0.0,
                           nesterov=False),
            "registered_name": None,
        },
        initial_scale=2.0,
        dynamic_growth_steps=2,
    )
    optimizer = kmp.LossScaleOptimizer.from_config(config)
    assert optimizer.initial_scale == 2.0
    assert optimizer.growth_interval == 2
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.SGD)
    assert float(optimizer.inner_optimizer.learning_rate) == 0.5
