"""tf-keras' mixed-precision model tests, ported to `kmp.Model`.

Port of keras-team/tf-keras `tf_keras/mixed_precision/model_test.py`
(classes `KerasModelTest` and `ApplicationModelTest`); each test keeps its
original's name. The scenarios and expected numbers are restated in Keras 3's
API, with `kmp.Model` for `keras.Model`, `kmp.policy_scope` for tf-keras'
`policy.policy_scope` and `kmp.LossScaleOptimizer` for tf-keras'
`BaseLossScaleOptimizer`:

- the original's strategies are the default one and a MirroredStrategy; here
  the MirroredStrategy is conftest's two-replica one;
- tf-keras' legacy-optimizer and graph-mode variants collapse to Keras 3's one
  optimizer API and its eager / compiled `fit`;
- tf-keras' SavedModel ("tf") format is Keras 3's `.keras` file; `.h5` stays;
- the helper layers of `tf_keras/mixed_precision/test_util.py`
  (`MultiplyLayer`, `MultiplyLayerWithoutAutoCast`, the gradient-checking
  and NaN-gradient identities, the two regularizers) are restated below as
  Keras 3 layers.

TensorFlow only (`tf.custom_gradient`, `tf.distribute`, `tf.data`).
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmp

ORIGINAL = "keras-team/tf-keras tf_keras/mixed_precision/model_test.py"


# --- the helpers of tf_keras/mixed_precision/test_util.py, in Keras 3 ---------


def _grad_check(expected, expected_dtype=None):
    """An identity whose gradient must equal `expected` (a number, list or
    variable read when the gradient runs) and have `expected_dtype`."""

    @tf.custom_gradient
    def identity(x):
        x = tf.identity(x)

        def grad(dx):
            if expected_dtype:
                assert dx.dtype == expected_dtype, f"gradient dtype {dx.dtype}"
            want = tf.cast(tf.convert_to_tensor(expected), dx.dtype)
            with tf.control_dependencies([x]):
                check = tf.debugging.assert_equal(dx, want, message="unexpected gradient")
            with tf.control_dependencies([check]):
                return tf.identity(dx)

        return x, grad

    def identity_with_grad_check(x):
        return identity(x)

    return identity_with_grad_check


def _nan_gradients(have_nan_gradients):
    """An identity whose gradient is NaN while the boolean variable
    `have_nan_gradients` is True."""

    @tf.custom_gradient
    def identity(x):
        x = tf.identity(x)

        def grad(dx):
            return tf.cond(have_nan_gradients, lambda: dx * float("nan"), lambda: dx)

        return x, grad

    def identity_with_nan_gradients(x):
        return identity(x)

    return identity_with_nan_gradients


@keras.saving.register_keras_serializable(package="tfkeras_port")
class IdentityRegularizer(keras.regularizers.Regularizer):
    def __call__(self, x):
        assert x.dtype == "float32", x.dtype  # weights stay float32
        return ops.sum(x) if len(x.shape) else x

    def get_config(self):
        return {}


@keras.saving.register_keras_serializable(package="tfkeras_port")
class ReduceSumRegularizer(keras.regularizers.Regularizer):
    def __call__(self, x):
        return ops.sum(x)

    def get_config(self):
        return {}


@keras.saving.register_keras_serializable(package="tfkeras_port")
class MultiplyLayer(keras.layers.Layer):
    """Multiplies its input by a scalar variable (initially 1), asserting
    the dtype of its inputs."""

    def __init__(self, regularizer=None, activity_regularizer=None, use_operator=False,
                 var_name="v", assert_type=None, **kwargs):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self._regularizer = keras.regularizers.get(regularizer)
        self._use_operator = use_operator
        self._var_name = var_name
        self._assert_type = assert_type

    def build(self, _):
        self.v = self.add_weight(shape=(), initializer="ones", name=self._var_name,
                                 regularizer=self._regularizer)

    def _check_inputs(self, inputs):
        if self._assert_type:
            assert inputs.dtype == self._assert_type, (inputs.dtype, self._assert_type)

    def call(self, inputs):
        self._check_inputs(inputs)
        return inputs * self.v if self._use_operator else ops.multiply(inputs, self.v)

    def get_config(self):
        config = super().get_config()
        config.update(
            regularizer=keras.regularizers.serialize(self._regularizer),
            use_operator=self._use_operator,
            var_name=self._var_name,
            assert_type=self._assert_type,
        )
        return config


class MultiplyLayerWithoutAutoCast(MultiplyLayer):
    """A MultiplyLayer whose variable is not auto-cast: it casts it itself."""

    def build(self, _):
        self.v = self.add_weight(shape=(), initializer="ones", name="v", dtype="float32",
                                 autocast=False, regularizer=self._regularizer)

    def call(self, inputs):
        self._check_inputs(inputs)
        assert self.v.dtype == "float32"
        v = ops.cast(self.v, inputs.dtype)
        return inputs * v if self._use_operator else ops.multiply(inputs, v)


def _loss_fn(y_true, y_pred):
    # tf-keras' `reduce_mean(y_pred)`, per sample: Keras 3 divides a loss by
    # the replica count only when it reduces it itself (a scalar returned by
    # the function is taken as it is, by keras.Model too), so the same mean
    # is left to Keras' "sum_over_batch_size" reduction.
    del y_true
    return ops.mean(y_pred, axis=-1)


@pytest.fixture(params=["default", "mirrored"])
def strategy(request):
    if request.param == "default":
        return tf.distribute.get_strategy()
    return request.getfixturevalue("mirrored_strategy")


def _value(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).tolist()


def _ones_dataset(batch_size, rows=None):
    rows = rows or batch_size
    x = np.ones((rows, 1), "float32")
    return tf.data.Dataset.from_tensor_slices((x, x)).batch(batch_size)


def _the_multiply_layer(model):
    (layer,) = (layer for layer in model.layers if isinstance(layer, MultiplyLayer))
    return layer


# --- KerasModelTest ----------------------------------------------------------

_TEST_MODEL_CASES = {
    # name: (strategy, options); the original's cases, less the legacy
    # optimizer ones (Keras 3 has one optimizer API).
    "base": ("default", {}),
    "distribute": ("mirrored", {}),
    "operator": ("mirrored", {"use_operator": True}),
    "regularizer": ("mirrored", {"use_regularizer": True}),
    "get_config": ("mirrored", {"get_config": True, "use_regularizer": True}),
    "saved_model": ("default", {"save_format": "keras", "use_regularizer": True}),
    "saved_model_input_spec": ("default", {"save_format": "keras", "use_regularizer": True,
                                           "use_input_spec": True}),
    "h5": ("default", {"save_format": "h5", "use_regularizer": True}),
    "saved_model_distribute": ("mirrored", {"save_format": "keras", "use_regularizer": True}),
    "saved_model_input_spec_distribute": ("mirrored", {"save_format": "keras",
                                                       "use_regularizer": True,
                                                       "use_input_spec": True}),
    "h5_distribute": ("mirrored", {"save_format": "h5", "use_regularizer": True}),
}


@pytest.mark.parametrize("case", list(_TEST_MODEL_CASES))
@pytest.mark.parametrize("model_type", ["functional", "subclass"])
def test_model(case, model_type, request, tmp_path):
    # Original: KerasModelTest.test_model (run with every model type). The
    # original leaves out subclassed models under a MirroredStrategy (a
    # tf-keras limit Keras 3 does not have: they run here) and in HDF5.
    strategy_name, options = _TEST_MODEL_CASES[case]
    save_format = options.get("save_format")
    if model_type == "subclass" and save_format == "h5":
        pytest.skip("Keras 3 no longer has it: its legacy .h5 format does not round-trip "
                    "a subclassed model (a registered keras.Model subclass saved to .h5 "
                    "fails to load: 'Layer count mismatch ... expected 0 layers'), as "
                    "tf-keras' did not (the original's own skip); tests/test_export.py holds "
                    "kmp.Model subclasses to keras.Model's outcome there.")
    strategy = (request.getfixturevalue("mirrored_strategy") if strategy_name == "mirrored"
                else tf.distribute.get_strategy())
    use_regularizer = options.get("use_regularizer", False)
    regularizers = (
        dict(regularizer=IdentityRegularizer(), activity_regularizer=ReduceSumRegularizer())
        if use_regularizer else {}
    )
    with strategy.scope(), kmp.policy_scope("mixed_float16"):
        layer = MultiplyLayer(assert_type="float16",
                              use_operator=options.get("use_operator", False), **regularizers)
        if options.get("use_input_spec"):
            layer.input_spec = keras.InputSpec(shape=(None, 1))
        if model_type == "functional":
            inputs = keras.Input((1,), dtype="float16")
            model = kmp.Model(inputs, layer(inputs))
        else:
            model = OneLayerModel(layer)
        if options.get("get_config"):
            model = model.__class__.from_config(model.get_config())
            layer = _the_multiply_layer(model)
        # A learning rate so small that, applied to a float16 variable, it
        # would change nothing: the float32 variable must take it. A fixed
        # scale: a step skipped by dynamic scaling would fail the test.
        learning_rate = 2**-14
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate), dynamic=False,
                                     initial_scale=8)
        model.compile(opt, loss=_loss_fn)

    dataset = _ones_dataset(2)
    model.fit(dataset, verbose=0)
    # v starts at 1 and its gradient is 1: minus 2**-14. The weight and the
    # activity regularizer each add 1 to the gradient.
    step = learning_rate * (3 if use_regularizer else 1)
    expected = 1 - step
    assert _value(layer.v) == expected

    if save_format:
        path = str(tmp_path / f"model.{save_format}")
        model.save(path)
        custom = {"MultiplyLayer": MultiplyLayer, "_loss_fn": _loss_fn, "loss_fn": _loss_fn,
                  "OneLayerModel": OneLayerModel}
        model = keras.saving.load_model(path, custom_objects=custom)
        layer = _the_multiply_layer(model)
        assert _value(layer.v) == expected
        if save_format == "h5":
            # Not in Keras 3.15: its .h5 loader builds the optimizer for none
            # of a functional model's variables, so a keras.Model loaded from
            # .h5 cannot train on either (tests/test_export.py's
            # test_h5_loaded_model_trains_on_as_a_keras_model_does holds kmp
            # to keras.Model there). Should Keras fix it, this fails: then
            # restore the original's check below for h5 as well.
            with pytest.raises(ValueError, match="Unknown variable"):
                model.fit(dataset, verbose=0)
        else:
            # Training goes on from there.
            model.fit(dataset, verbose=0)
            assert _value(layer.v) == expected - step
        # Loading again gives the saved value back.
        model = keras.saving.load_model(path, custom_objects=custom)
        layer = _the_multiply_layer(model)
        assert _value(layer.v) == expected
        # The layer's dtype-related aspects.
        assert layer.dtype == "float32"  # its variables' dtype
        assert layer.dtype_policy.name == "mixed_float16"
        assert layer.v.dtype == "float32"
        assert layer(np.ones((2, 1), "float16")).dtype == "float16"
        policy = keras.dtype_policies.deserialize(layer.get_config()["dtype"])
        assert policy.name == "mixed_float16"


class OneLayerModel(kmp.Model):
    """tf-keras' subclassed test model: its layers called in turn."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def call(self, inputs):
        return self.layer(inputs)

    def get_config(self):
        return {"layer": keras.saving.serialize_keras_object(self.layer)}

    @classmethod
    def from_config(cls, config):
        return cls(keras.saving.deserialize_keras_object(config["layer"]))


def test_fixed_loss_scaling(strategy):
    # Original: KerasModelTest.test_fixed_loss_scaling (loss scaling only, no
    # mixed precision).
    loss_scale = 8.0
    batch_size = 4
    with strategy.scope():
        inputs = keras.Input((1,))
        layer = MultiplyLayer()
        y = layer(inputs)
        # The gradient of y is 1/batch_size per element (the loss is a mean),
        # times the loss scale.
        expected_gradient = loss_scale / batch_size
        y = keras.layers.Lambda(_grad_check([expected_gradient]))(y)
        model = kmp.Model(inputs, y)
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), dynamic=False,
                                     initial_scale=loss_scale)
        model.compile(opt, loss=_loss_fn)
    assert _value(layer.v) == 1
    model.fit(_ones_dataset(batch_size), verbose=0)
    # v starts at 1 and loses its gradient, 1.
    assert _value(layer.v) == 0


@pytest.mark.parametrize(
    "strategy_name, use_loss_scaling",
    [("default", False), ("mirrored", False), ("mirrored", True)],
    ids=["base", "distribute", "loss_scaling"],
)
def test_advanced_model(strategy_name, use_loss_scaling, request):
    # Original: KerasModelTest.test_advanced_model: layers with and without
    # auto-cast variables, regularization on some, a fixed loss scale.
    strategy = (request.getfixturevalue("mirrored_strategy") if strategy_name == "mirrored"
                else tf.distribute.get_strategy())
    loss_scale = 8.0
    learning_rate = 2**-14
    with strategy.scope(), kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((1,))
        layer1 = MultiplyLayer(assert_type="float16", regularizer=IdentityRegularizer(),
                               use_operator=True)
        layer2 = MultiplyLayerWithoutAutoCast(assert_type="float16", use_operator=True)
        layer3 = MultiplyLayer(assert_type="float16", use_operator=False)
        layer4 = MultiplyLayerWithoutAutoCast(assert_type="float16",
                                              regularizer=IdentityRegularizer(),
                                              use_operator=False)
        y = layer4(layer3(layer2(layer1(inputs))))
        if use_loss_scaling:
            # The gradient of y is 1/2 per element (a mean over a batch of 2),
            # times the loss scale, in float16.
            y = keras.layers.Lambda(
                _grad_check([loss_scale / 2], expected_dtype=tf.float16))(y)
        model = kmp.Model(inputs, y)
        opt = keras.optimizers.SGD(learning_rate)
        if use_loss_scaling:
            opt = kmp.LossScaleOptimizer(opt, dynamic=False, initial_scale=loss_scale)
        model.compile(opt, loss=_loss_fn)
    model.fit(_ones_dataset(2), verbose=0)
    for layer in (layer1, layer2, layer3, layer4):
        if layer.losses:  # a weight regularizer: twice the step
            assert _value(layer.v) == 1 - 2 * learning_rate, layer.name
        else:
            assert _value(layer.v) == 1 - learning_rate, layer.name


@pytest.mark.parametrize(
    "strategy_name, get_config",
    [("default", False), ("mirrored", False), ("mirrored", True)],
    ids=["base", "distribute", "get_config"],
)
def test_dynamic_loss_scaling(strategy_name, get_config, request):
    # Original: KerasModelTest.test_dynamic_loss_scaling.
    strategy = (request.getfixturevalue("mirrored_strategy") if strategy_name == "mirrored"
                else tf.distribute.get_strategy())
    initial_loss_scale = 2.0
    batch_size = 4
    expected_gradient = tf.Variable([initial_loss_scale / batch_size], dtype=tf.float16)
    # While True, the model's gradients are NaN.
    have_nan_gradients = tf.Variable(False)
    with strategy.scope():
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                     initial_scale=initial_loss_scale, dynamic_growth_steps=2)
        with kmp.policy_scope("mixed_float16"):
            inputs = keras.Input((1,), dtype="float16")
            layer = MultiplyLayer(assert_type="float16")
            y = layer(inputs)
            nan_fn = _nan_gradients(have_nan_gradients)
            check_fn = _grad_check(expected_gradient, expected_dtype=tf.float16)
            y = keras.layers.Lambda(nan_fn)(y)
            y = keras.layers.Lambda(check_fn)(y)
            model = kmp.Model(inputs, y)
            if get_config:
                # Keras 3 names a Lambda's function in its config: the
                # functions are handed back as custom objects.
                model = keras.saving.deserialize_keras_object(
                    keras.saving.serialize_keras_object(model),
                    custom_objects={"identity_with_nan_gradients": nan_fn,
                                    "identity_with_grad_check": check_fn,
                                    "MultiplyLayer": MultiplyLayer})
                layer = _the_multiply_layer(model)
            model.compile(opt, loss=_loss_fn)

    assert _value(layer.v) == 1
    dataset = _ones_dataset(batch_size)
    # v starts at 1 and its gradient is 1: it goes down by 1 a step.
    model.fit(dataset, verbose=0)
    assert _value(layer.v) == 0
    model.fit(dataset, verbose=0)
    assert _value(layer.v) == -1
    # Two finite steps: the scale doubled, and so does the gradient seen.
    expected_gradient.assign(expected_gradient * 2)
    model.fit(dataset, verbose=0)
    assert _value(layer.v) == -2
    # NaN gradients: v is not updated.
    have_nan_gradients.assign(True)
    model.fit(dataset, verbose=0)
    assert _value(layer.v) == -2
    # Finite again, at half the scale (the NaN step backed it off).
    have_nan_gradients.assign(False)
    expected_gradient.assign(expected_gradient / 2)
    model.fit(dataset, verbose=0)
    assert _value(layer.v) == -3


def test_compile_wraps_with_loss_scale_optimizer():
    # Original: KerasModelTest.test_compile_wraps_with_loss_scale_optimizer.
    with kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((1,))
        outputs = MultiplyLayer()(inputs)
        # An optimizer is wrapped in kmp's scaler.
        model = kmp.Model(inputs, outputs)
        model.compile(keras.optimizers.SGD(1.0), "mse")
        assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert _value(model.optimizer.learning_rate) == 1.0
        # So is one named by a string.
        model = kmp.Model(inputs, outputs)
        model.compile("sgd", "mse")
        assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
        # A scaler is not wrapped again.
        model = kmp.Model(inputs, outputs)
        scaler = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), dynamic_growth_steps=2)
        model.compile(scaler, "mse")
        assert model.optimizer is scaler
        assert model.optimizer.dynamic_growth_steps == 2

    with kmp.policy_scope("mixed_bfloat16"):
        # A mixed_bfloat16 model is not wrapped in a loss scaler. kmp differs
        # on purpose (issue 46): its guard, a kmp.LossScaleOptimizer whose
        # scale is fixed at 1, skips a step whose loss or gradients are not
        # finite; `skip_nonfinite=False` keeps tf-keras' behaviour exactly.
        inputs = keras.Input((1,))
        model = kmp.Model(inputs, MultiplyLayer()(inputs))
        optimizer = keras.optimizers.SGD(1.0)
        model.compile(optimizer, "mse", skip_nonfinite=False)
        assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert model.optimizer is optimizer
        model.compile(optimizer, "mse")
        assert not model.optimizer.scaling and model.optimizer.inner_optimizer is optimizer


def test_pass_invalid_optimizer_with_loss_scaling():
    # Original: KerasModelTest.test_pass_invalid_optimizer_with_loss_scaling
    # (a tf-keras V1 optimizer; Keras 3 has none): what is not an optimizer
    # is refused by compile, with a ValueError, as keras.Model refuses it.
    with kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((1,))
        model = kmp.Model(inputs, MultiplyLayer()(inputs))
        reference = keras.Model(inputs, MultiplyLayer()(inputs))
        not_an_optimizer = object()
        with pytest.raises(ValueError) as theirs:
            reference.compile(not_an_optimizer, "mse")
        with pytest.raises(ValueError) as ours:
            model.compile(not_an_optimizer, "mse")
        assert str(ours.value) == str(theirs.value)


class _AddsFloat32Loss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(ops.cast(ops.sum(x), "float32"))
        return x


def test_functional_model_loss_dtype():
    # Original: KerasModelTest.test_functional_model_loss_dtype: a float32
    # loss added under a float16 policy is not cast to float16. kmp has no
    # pure "float16" policy (docs/policies.md lists float32, mixed_float16,
    # mixed_bfloat16, auto): mixed_float16 computes in float16. Keras 3 adds
    # losses from layers, not on symbolic model outputs.
    with kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((1,))
        y = MultiplyLayer()(inputs)
        model = kmp.Model(inputs, _AddsFloat32Loss()(y))
        model(np.ones((2, 1), "float32"))
        assert model.losses[0].dtype == "float32"


def test_save_weights_with_autocast_vars(strategy, tmp_path):
    # Original: KerasModelTest.test_save_weights_with_autocast_vars (its h5
    # cases are Keras 3's only weights format, `.weights.h5`).
    with strategy.scope(), kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((1,))
        model = kmp.Model(inputs, MultiplyLayer(assert_type="float16")(inputs))
    x = np.ones((2, 1), "float32")
    model.set_weights([np.array(100.0)])
    np.testing.assert_array_equal(_value(model(x)), x * 100.0)
    weights_file = str(tmp_path / "weights.weights.h5")
    model.save_weights(weights_file)
    model.set_weights([np.array(200.0)])
    np.testing.assert_array_equal(_value(model(x)), x * 200.0)
    model.load_weights(weights_file)
    np.testing.assert_array_equal(_value(model(x)), x * 100.0)
    assert [w.tolist() for w in model.get_weights()] == [100.0]


@pytest.mark.parametrize("var_name", ["v", "w"], ids=["base", "different_var_name"])
def test_save_slot_variables_with_autocast_vars(strategy, var_name, tmp_path):
    # Original: KerasModelTest.test_save_slot_variables_with_autocast_vars
    # (a variable named otherwise than its attribute: b/134713714).
    with strategy.scope(), kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((2,))
        layer = MultiplyLayer(assert_type="float16", var_name=var_name)
        model = kmp.Model(inputs, layer(inputs))
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0, momentum=1.0), dynamic=False,
                                     initial_scale=1)
        model.compile(optimizer=opt, loss="mse")

    def momentum_slot():
        return _value(opt.inner_optimizer.momentums[0])

    model.fit(np.ones((2, 2)), np.zeros((2, 2)), batch_size=2, verbose=0)
    weights_file = str(tmp_path / "weights.weights.h5")
    model.save_weights(weights_file)
    saved_slot = momentum_slot()
    model.fit(np.ones((2, 2)), np.zeros((2, 2)), batch_size=2, verbose=0)
    assert momentum_slot() != saved_slot
    model.load_weights(weights_file)
    assert momentum_slot() == saved_slot


def test_save_weights_with_dynamic_loss_scaling(strategy, tmp_path):
    # Original: KerasModelTest.test_save_weights_with_dynamic_loss_scaling.
    with strategy.scope():
        inputs = keras.Input((2,))
        model = kmp.Model(inputs, MultiplyLayer(assert_type="float32")(inputs))
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1.0,
                                     dynamic_growth_steps=2.0)
        model.compile(optimizer=opt, loss="mse")
    # 3 steps (6 examples, batches of 2): one growth, one step counted since.
    model.fit(np.zeros((6, 2)), np.zeros((6, 2)), batch_size=2, verbose=0)
    assert _value(opt.loss_scale) == 2
    assert _value(opt.counters["good_steps"]) == 1
    weights_file = str(tmp_path / "ckpt.weights.h5")
    model.save_weights(weights_file)
    # One more step: a second growth.
    model.fit(np.zeros((2, 2)), np.zeros((2, 2)), batch_size=2, verbose=0)
    assert _value(opt.loss_scale) == 4
    assert _value(opt.counters["good_steps"]) == 0
    # Loading the weights restores the loss scale and its counter.
    model.load_weights(weights_file)
    assert _value(opt.loss_scale) == 2
    assert _value(opt.counters["good_steps"]) == 1


def test_restore_old_loss_scale_checkpoint():
    pytest.skip("Keras 3 no longer has it: a checkpoint of tf.keras 2.2's "
                "LossScaleOptimizer (tf-keras testdata/lso_ckpt_tf2.2) is not a "
                "format Keras 3 reads.")


def test_restore_old_saved_model():
    pytest.skip("Keras 3 no longer has it: Keras 3 loads no tf.keras SavedModel "
                "(tf-keras testdata/lso_savedmodel_tf2.2).")


@pytest.mark.parametrize("save_format", ["keras", "h5"])
def test_save_model_with_dynamic_loss_scaling(strategy, save_format, tmp_path):
    # Original: KerasModelTest.test_save_model_with_dynamic_loss_scaling. The
    # original accepts the loss scale saved or as initialized; kmp promises
    # that `.keras` files carry it (kmp.LossScaleOptimizer's docstring:
    # "Checkpoints and .keras files carry the state") and its .h5 files do as
    # well, so this port asks for the saved values in both.
    with strategy.scope():
        inputs = keras.Input((2,))
        model = kmp.Model(inputs, MultiplyLayer()(inputs))
        opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1.0,
                                     dynamic_growth_steps=2.0)
        # The original's loss="mse" as an object: Keras 3 cannot rebuild a
        # string loss from an .h5 file ("Could not deserialize
        # 'keras.metrics.mse'"), for keras.Model as well.
        model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError())
    # 3 steps (6 examples, batches of 2).
    model.fit(np.ones((6, 2)), np.zeros((6, 2)), batch_size=2, verbose=0)
    assert _value(opt.loss_scale) == 2
    assert _value(opt.counters["good_steps"]) == 1
    (weight,) = model.trainable_weights
    orig_weight = _value(weight)
    path = str(tmp_path / f"model.{save_format}")
    model.save(path)
    # One more step.
    model.fit(np.ones((2, 2)), np.zeros((2, 2)), batch_size=2, verbose=0)
    assert _value(weight) != orig_weight
    assert _value(opt.loss_scale) == 4
    assert _value(opt.counters["good_steps"]) == 0

    model = keras.saving.load_model(path, custom_objects={"MultiplyLayer": MultiplyLayer})
    (weight,) = model.trainable_weights
    assert _value(weight) == orig_weight
    # .h5 files carry it too: Keras' loader restores the optimizer's own
    # variables (the scale and counters come first), not slot variables.
    assert _value(model.optimizer.loss_scale) == 2
    assert _value(model.optimizer.counters["good_steps"]) == 1
    assert model.optimizer.initial_scale == 1.0
    assert model.optimizer.dynamic_growth_steps == 2
    assert type(model.optimizer) is kmp.LossScaleOptimizer


# --- ApplicationModelTest ----------------------------------------------------


@pytest.mark.parametrize(
    "app",
    ["DenseNet121", "EfficientNetB0", "InceptionResNetV2", "InceptionV3", "MobileNet",
     "NASNetMobile", "VGG16", "Xception", "ResNet50"],
)
def test_application_model(app):
    # Original: ApplicationModelTest.test_application_model: Keras'
    # application models build under mixed_float16 (not trained: too long for
    # a unit test).
    with kmp.policy_scope("mixed_float16"), tf.device("/CPU:0"):
        model = getattr(keras.applications, app)(weights=None)
    assert model.layers[-1].dtype_policy.name == "mixed_float16"
    assert model.outputs[0].dtype in ("float16", "float32")
