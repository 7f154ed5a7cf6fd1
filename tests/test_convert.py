"""kmp.convert, keep_float32 and kmp.summary."""

import pathlib
import warnings

import keras
import numpy as np
import pytest

from _helpers import DtypeProbe
import kmp
from kmp import _keras_internals
from kmp.convert import _WrappedModel
from kmp.model import FunctionalModel


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


@keras.saving.register_keras_serializable(package="kmp_tests")
class Recorder(keras.layers.Layer):
    """Records the dtype it computes in, and returns its input scaled."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(_dtype(x))
        return x * 2.0


def _functional(head_dtype=None):
    inputs = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    hidden = DtypeProbe(name="after_recorder")(Recorder(name="recorder")(hidden))
    outputs = keras.layers.Dense(3, name="head", dtype=head_dtype)(hidden)
    return keras.Model(inputs, outputs, name="net")


def _data(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, size=n)


def _policies(model):
    return [layer.dtype_policy.name for layer in model._flatten_layers(recursive=True)]


def _assert_close(converted, original, x, atol):
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(converted(x)),
        keras.ops.convert_to_numpy(original(x)),
        atol=atol,
    )


def test_functional_model_is_rebuilt_under_the_policy_and_left_untouched():
    model = _functional()
    x, y = _data()
    before = _policies(model)
    converted = kmp.convert(model, "mixed_float16")
    assert isinstance(converted, FunctionalModel)
    assert converted.get_layer("hidden").compute_dtype == "float16"
    assert _policies(model) == before
    _assert_close(converted, model, x, atol=2e-2)
    assert _dtype(converted(x)) == "float32"
    converted.compile("adam", "sparse_categorical_crossentropy")
    weights_before = [w.copy() for w in model.get_weights()]
    converted.fit(x, y, epochs=2, verbose=0)
    for before_value, after_value in zip(weights_before, model.get_weights()):
        np.testing.assert_array_equal(before_value, after_value)
    assert _dtype(model(x)) == "float32"


def test_default_policy_is_the_active_kmp_policy():
    model = _functional()
    kmp.set_policy("mixed_bfloat16")
    assert kmp.convert(model).get_layer("hidden").compute_dtype == "bfloat16"


def test_a_layers_own_dtype_is_kept():
    kmp.set_policy("mixed_float16")
    model = _functional(head_dtype="float32")
    converted = kmp.convert(model, "mixed_bfloat16")
    assert converted.get_layer("head").dtype_policy.name == "float32"
    assert converted.get_layer("hidden").dtype_policy.name == "mixed_bfloat16"
    rows = {row["layer"]: row for row in kmp.summary(converted, print_fn=lambda _: None)}
    assert rows["head"]["reason"] == "dtype= on the layer (float32), kept"
    assert rows["hidden"]["reason"] == "policy mixed_bfloat16"


@pytest.mark.parametrize("built", [False, True])
def test_sequential(built):
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
    x, _ = _data()
    if built:
        model.build((None, 4))
    converted = kmp.convert(model, "mixed_bfloat16")
    assert isinstance(converted, kmp.Model)
    assert _dtype(converted(x)) == "float32"
    if built:
        assert isinstance(converted, FunctionalModel)
        _assert_close(converted, model, x, atol=5e-2)
    assert all(layer.dtype_policy.name == "float32" for layer in model.layers)


class WithConfig(keras.Model):
    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)
        self.recorder = Recorder()

    def call(self, x):
        return self.recorder(self.dense(x))

    def get_config(self):
        return {"units": self.units, "name": self.name}


class WithoutConfig(keras.Model):
    def __init__(self, layer):
        super().__init__()
        self.inner = layer
        self.recorder = Recorder()

    def call(self, x):
        return self.recorder(self.inner(x))



class TwoDenseWithoutConfig(keras.Model):
    """The model of issue 38: subclassed, two Dense layers, no get_config."""

    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(8, activation="relu")
        self.second = keras.layers.Dense(1)

    def call(self, x):
        return self.second(self.first(x))


def test_wrapping_a_model_without_a_config_says_what_it_changes_in_the_original():
    # Keras cannot copy it (copy.deepcopy goes through get_config too), so
    # the wrapper shares its layers: the warning and the guide say that the
    # original computes under the policy from then on, and without loss
    # scaling if trained directly (issue 38: the guide said "never changed").
    model = TwoDenseWithoutConfig()
    x, _ = _data()
    model(x)
    with pytest.warns(UserWarning) as record:
        converted = kmp.convert(model, "mixed_float16")
    (warned,) = [w for w in record if "kmp.convert" in str(w.message)]
    message = str(warned.message)
    assert "the original's layers compute under mixed_float16 from now on" in message
    assert "float16 without loss scaling: compile and fit the result" in message
    assert warned.filename == __file__
    assert converted.wrapped is model
    assert [layer.compute_dtype for layer in model.layers] == ["float16", "float16"]
    guide = (pathlib.Path(__file__).parents[1] / "docs" / "bringing-models.md").read_text()
    assert "never changed" not in guide
    assert "the original computes under the policy too" in " ".join(guide.split())


def test_wrapping_under_bfloat16_does_not_speak_of_loss_scaling():
    model = TwoDenseWithoutConfig()
    model(_data()[0])
    with pytest.warns(UserWarning, match="compute under mixed_bfloat16 from now on. For a copy"):
        kmp.convert(model, "mixed_bfloat16")

def test_subclassed_model_with_a_config_is_copied():
    model = WithConfig()
    x, _ = _data()
    model(x)
    converted = kmp.convert(model, "mixed_float16")
    assert isinstance(converted, _WrappedModel)
    assert converted.wrapped is not model
    _assert_close(converted, model, x, atol=2e-2)
    assert converted.wrapped.recorder.seen[-1] == "float16"
    assert model.dense.dtype_policy.name == "float32"


def test_subclassed_model_without_a_config_is_wrapped_and_shares_weights():
    model = WithoutConfig(keras.layers.Dense(2))
    x, _ = _data()
    model(x)
    with pytest.warns(UserWarning, match="shares its weights"):
        converted = kmp.convert(model, "mixed_float16")
    assert converted.wrapped is model
    result = converted(x)
    assert _dtype(result) == "float32"
    assert model.recorder.seen[-1] == "float16"  # under the policy
    # Set once, when it was wrapped (the warning says so), not per call:
    # the original, whose layers the wrapper shares, computes under it too.
    assert model.inner.dtype_policy.name == "mixed_float16"
    converted.compile("sgd", "mse")
    assert isinstance(converted.optimizer, kmp.LossScaleOptimizer)
    history = converted.fit(x, np.zeros((16, 2), "float32"), epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.recorder.seen[-1] == "float16"
    assert model(x).dtype == "float16"  # a keras.Model's output: its layers' dtype
    assert converted(x).dtype == "float32"


def test_kmp_model_is_returned_repolicied():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    original = kmp.Model(inputs, keras.layers.Dense(2)(inputs))
    converted = kmp.convert(original, "mixed_bfloat16")
    assert isinstance(converted, FunctionalModel)
    assert converted.layers[-1].compute_dtype == "bfloat16"
    assert original.layers[-1].compute_dtype == "float16"


def test_compiled_model_is_compiled_the_same_with_a_fresh_optimizer():
    model = _functional()
    model.compile(
        keras.optimizers.Adam(learning_rate=0.01),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    converted = kmp.convert(model, "mixed_float16")
    assert isinstance(converted.optimizer, kmp.LossScaleOptimizer)
    inner = converted.optimizer.inner_optimizer
    assert isinstance(inner, keras.optimizers.Adam)
    assert inner is not model.optimizer
    assert float(inner.learning_rate) == pytest.approx(0.01)
    history = converted.fit(x, y, epochs=1, verbose=0)
    assert set(history.history) >= {"loss", "accuracy", "loss_scale"}
    bf16 = kmp.convert(model, "mixed_bfloat16")
    # Nothing to scale: the guard alone, around a fresh Adam.
    assert isinstance(bf16.optimizer, kmp.LossScaleOptimizer) and not bf16.optimizer.scaling
    assert isinstance(bf16.optimizer.inner_optimizer, keras.optimizers.Adam)
    assert not getattr(kmp.convert(model, compile=False), "compiled", False)


def _recorded(converted):
    recorder = converted.get_layer("recorder")
    after = converted.get_layer("after_recorder")
    converted(_data()[0])
    return recorder.seen[-1], after.seen[-1]


@pytest.mark.parametrize(
    "keep_float32", [[Recorder], ["recorder"], ["re:rec.*"], "re:.*order"]
)
def test_keep_float32_forms_compute_in_float32_and_hand_float16_on(keep_float32):
    model = _functional()
    converted = kmp.convert(model, "mixed_float16", keep_float32=keep_float32)
    assert _recorded(converted) == ("float32", "float16")
    rows = {row["layer"]: row for row in kmp.summary(converted, print_fn=lambda _: None)}
    assert rows["recorder"]["compute_dtype"] == "float32"
    assert rows["recorder"]["reason"].startswith("keep_float32: ")
    assert rows["recorder"]["reason"].endswith("outputs cast back to float16")
    assert rows["hidden"]["compute_dtype"] == "float16"


def test_keep_float32_of_set_policy_applies_to_convert():
    model = _functional()
    kmp.set_policy("mixed_float16", keep_float32=["recorder"])
    assert _recorded(kmp.convert(model)) == ("float32", "float16")


def test_keep_float32_on_a_composite_layer_puts_its_sublayers_in_float32():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((3, 4))
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2, name="attn")
    probe = DtypeProbe()
    hidden = keras.layers.Dense(4)(inputs)
    outputs = probe(attention(hidden, hidden) + hidden)
    model = kmp.Model(inputs, outputs)
    converted = kmp.convert(model, keep_float32=["attn"])
    rows = {row["layer"]: row for row in kmp.summary(converted, print_fn=lambda _: None)}
    assert rows["attn/query"]["compute_dtype"] == "float32"
    assert rows["attn/query"]["reason"] == "inside float32 layer 'attn'"
    converted(np.ones((2, 3, 4), "float32"))
    assert converted.layers[-1].seen[-1] == "float16"
    assert attention.query_dense.dtype_policy.name == "mixed_float16"


def test_unknown_name_lists_the_names_there_are():
    model = _functional()
    with pytest.raises(ValueError, match="'recordr'.*Layer names in 'net': .*recorder"):
        kmp.convert(model, keep_float32=["recordr"])
    kmp.set_policy("mixed_float16", keep_float32=["nowhere"])
    with pytest.raises(ValueError, match="keep_float32 of kmp.set_policy.*'nowhere'"):
        kmp.convert(model)


def test_argument_errors():
    model = _functional()
    with pytest.raises(TypeError, match="Received: keep_float32 entry 7"):
        kmp.convert(model, keep_float32=[7])
    with pytest.raises(ValueError, match="regular expression"):
        kmp.convert(model, keep_float32=["re:[unclosed"])
    with pytest.raises(ValueError, match="Received: policy='float8'"):
        kmp.convert(model, policy="float8")
    with pytest.raises(TypeError, match="Received: model of type Dense"):
        kmp.convert(keras.layers.Dense(2))
    with pytest.raises(TypeError, match=r"`keep_float32` must be None, a layer name.*"
                       r"Received: keep_float32=5 of type int"):
        kmp.convert(model, keep_float32=5)
    for bad in ("x", None):
        with pytest.raises(TypeError, match=rf"`model` must be a keras.Model. Received: "
                           rf"model={bad!r} of type {type(bad).__name__}"):
            kmp.summary(bad)
    with pytest.raises(TypeError, match=r"`filepath` must be the path of a .keras.*"
                       r"Received: filepath=123 of type int"):
        kmp.load_model(123)


def test_summary_prints_a_table_with_every_layer():
    kmp.set_policy("mixed_float16")
    lines = []
    rows = kmp.summary(kmp.convert(_functional()), print_fn=lines.append)
    text = lines[0]
    assert "policy mixed_float16" in text.splitlines()[0]
    assert [row["layer"] for row in rows] == [
        "features", "hidden", "norm", "recorder", "after_recorder", "head"
    ]
    norm = rows[2]
    assert norm["compute_dtype"] == "float16"
    assert norm["reason"].endswith("Keras computes its statistics in float32")
    assert rows[0]["compute_dtype"] == "float32"  # the data's dtype
    for row in rows:
        assert row["layer"] in text and row["reason"] in text


def test_keras_hub_backbone_converts_and_the_original_still_runs():
    keras_hub = pytest.importorskip(
        "keras_hub",
        reason="keras-hub is not installed: a test extra, which requires tensorflow-text and so "
               "TensorFlow (the JAX pass without TensorFlow leaves it out; the TensorFlow pass runs this)",
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=8,
    )
    tokens = {
        "token_ids": np.arange(16).reshape(2, 8) % 64,
        "segment_ids": np.zeros((2, 8), "int32"),
        "padding_mask": np.ones((2, 8), "int32"),
    }
    before = _policies(backbone)
    converted = kmp.convert(backbone, "mixed_float16")
    outputs = converted(tokens)
    assert {k: _dtype(v) for k, v in outputs.items()} == {
        "sequence_output": "float32", "pooled_output": "float32"
    }
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(outputs["pooled_output"]),
        keras.ops.convert_to_numpy(backbone(tokens)["pooled_output"]),
        atol=2e-2,
    )
    # Wrapping the backbone's own layers leaves them as they were too.
    kmp.set_policy("mixed_float16")
    wrapped = kmp.Model(backbone.input, backbone.output["pooled_output"])
    wrapped(tokens)
    assert _policies(backbone) == before
    assert _dtype(backbone(tokens)["pooled_output"]) == "float32"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("how", ["kmp.Model", "kmp.convert"])
def test_the_output_mask_still_weights_the_loss_and_metrics(policy, how):
    # Padded steps (id 0) carry huge targets: counted, they dominate the loss.
    # kmp's float32 output cast once dropped the mask Keras' loss and metrics
    # weight by (the mask is on the output, not a cast of it).
    kmp.set_policy(policy)
    ids = np.array([[5, 6, 0, 0], [7, 0, 0, 0]], "int32")
    targets = np.where(ids[..., None] == 0, 100.0, 0.5).astype("float32")
    inputs = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, mask_zero=True, embeddings_initializer="ones")(inputs)
    head = keras.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros", name="head")
    if how == "kmp.Model":
        model = kmp.Model(inputs, head(hidden))
    else:
        model = kmp.convert(keras.Model(inputs, head(hidden)))
    model.compile("sgd", "mse", metrics=["mae"])
    outputs = model(ids)
    assert _dtype(outputs) == "float32"
    mask = keras.ops.convert_to_numpy(_keras_internals.get_keras_mask(outputs))
    np.testing.assert_array_equal(mask, ids != 0)
    # Outputs are 0: the masked mse and mae over the 3 real steps (Keras
    # divides the masked sum by the number of real steps).
    loss, mae = model.evaluate(ids, targets, verbose=0)
    assert loss == pytest.approx(0.25) and mae == pytest.approx(0.5)
    first = model.train_on_batch(ids, targets, return_dict=True)
    assert first["loss"] == pytest.approx(0.25)
    # d(loss)/d(output) = 2 * (0 - 0.5) / 3 on each real step, whose
    # embedding is 1: kernel and bias step by 0.01 * 1 (the 5 padded steps
    # unmasked would make it 1.254).
    head = model.get_layer("head")  # kmp.convert's model has layers of its own
    np.testing.assert_allclose(keras.ops.convert_to_numpy(head.kernel), np.full((4, 1), 0.01),
                               rtol=1e-2)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(head.bias), [0.01], rtol=1e-2)


@pytest.mark.parametrize("how", ["kmp.Model", "kmp.convert"])
def test_train_on_batch_returns_what_keras_returns(how):
    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")

    def make(model_class):
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")(inputs)
        return model_class(inputs, outputs)

    keras_model = make(keras.Model)
    model = make(kmp.Model) if how == "kmp.Model" else kmp.convert(make(keras.Model))
    for metrics in ([], ["accuracy"]):
        keras_model.compile("sgd", "binary_crossentropy", metrics=metrics)
        model.compile("sgd", "binary_crossentropy", metrics=metrics)
        expected = keras_model.train_on_batch(x, y)
        result = model.train_on_batch(x, y)
        if not metrics:
            assert np.ndim(result) == 0 and np.ndim(expected) == 0
        else:
            loss, accuracy = result  # unpacks as for Keras: no scaler entries
            assert len(expected) == 2
            assert accuracy == pytest.approx(expected[1])
        assert np.ravel(result)[0] == pytest.approx(np.ravel(expected)[0], rel=1e-2)
    logs = model.train_on_batch(x, y, return_dict=True)
    # The dict keeps the scaler's entries, as fit's History does.
    assert {"loss", "accuracy", "loss_scale", "skipped_steps"} <= set(logs)
    assert logs["loss_scale"] == float(model.optimizer.loss_scale)
