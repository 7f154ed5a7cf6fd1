"""kmp.convert on any model (issue 16): models with their own training, models
without call(), models Keras cannot rebuild, and keep_float32 round trips."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from _helpers import DtypeProbe


@keras.saving.register_keras_serializable(package="kmp_tests")
class Doubler(keras.layers.Layer):
    """Records the dtype it computes in."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(keras.backend.standardize_dtype(x.dtype))
        return x * 2.0


def _kept_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    hidden = DtypeProbe(name="after")(Doubler(name="kept")(hidden))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden), name="net")


def _kept_dtype(model):
    kept, after = model.get_layer("kept"), model.get_layer("after")
    model(np.ones((2, 4), "float32"))
    return kept.seen[-1], after.seen[-1]


@pytest.mark.parametrize("loader", ["keras", "kmp"])
def test_keep_float32_survives_a_keras_file_round_trip(loader, tmp_path):
    kmp.set_policy("mixed_float16")
    converted = kmp.convert(_kept_model(), "mixed_float16", keep_float32=["kept"], compile=False)
    assert _kept_dtype(converted) == ("float32", "float16")
    path = tmp_path / "model.keras"
    converted.save(path)
    kmp.set_policy("float32")  # a fresh process has no policy set
    load = keras.saving.load_model if loader == "keras" else kmp.load_model
    loaded = load(path, custom_objects={"DtypeProbe": DtypeProbe})
    assert _kept_dtype(loaded) == ("float32", "float16")
    np.testing.assert_allclose(
        np.asarray(loaded(np.ones((2, 4), "float32"))),
        np.asarray(converted(np.ones((2, 4), "float32"))),
    )


def test_keep_float32_classes_and_patterns_round_trip_through_the_config():
    rules = kmp.policy._Float32Rules.parse([Doubler, "kept", "re:hid.*"])
    again = kmp.policy._Float32Rules.from_config(rules.to_config())
    assert again.classes == (Doubler,) and again.names == ("kept",)
    assert [p.pattern for p in again.patterns] == ["hid.*"]
    with pytest.raises(ValueError, match="not registered"):
        kmp.policy._Float32Rules.from_config(["class:nowhere>Missing"])


class TokenAndPositionEmbedding(keras.layers.Layer):  # not registered, as on keras.io
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = self.pos_emb(keras.ops.arange(0, keras.ops.shape(x)[-1], 1))
        return self.token_emb(x) + positions


def test_a_functional_model_keras_cannot_rebuild_is_wrapped_with_a_warning():
    inputs = keras.Input((8,), dtype="int32")
    x = TokenAndPositionEmbedding(8, 50, 4)(inputs)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inputs, outputs, name="classifier")
    with pytest.warns(UserWarning, match="could not rebuild 'classifier' faithfully"):
        converted = kmp.convert(model, "mixed_float16", compile=False)
    assert isinstance(converted, kmp.Model)
    tokens = np.arange(16).reshape(2, 8) % 50
    output = converted(tokens)
    assert output.dtype == "float32"
    np.testing.assert_allclose(np.asarray(output), np.asarray(model(tokens)), atol=1e-2)
    converted.compile(keras.optimizers.SGD(0.01), "mse")
    assert isinstance(converted.optimizer, kmp.LossScaleOptimizer)
    converted.fit(tokens, np.zeros((2, 2), "float32"), verbose=0)
    # The wrapper shares the original's weights: it trains them.
    np.testing.assert_allclose(np.asarray(converted(tokens)), np.asarray(model(tokens)), atol=1e-2)


class KerasGAN(keras.Model):
    """keras.io's DCGAN shape: its own compile and train_step."""

    def __init__(self):
        super().__init__()
        self.generator = keras.layers.Dense(4)

    def call(self, x):
        return self.generator(x)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, data):
        return {}


class KerasVAE(keras.Model):
    """keras.io's VAE shape: no call(), its own train_step."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(2)

    def train_step(self, data):
        return {}


def test_a_model_with_its_own_compile_and_train_step_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"replace KerasGAN's own `train_step` and `compile`") as info:
        kmp.convert(KerasGAN())
    assert "class KerasGAN(kmp.Model)" in str(info.value)
    assert "scale_loss" in str(info.value)


def test_a_model_without_call_is_refused_naming_the_problem():
    with pytest.raises(TypeError, match=r"KerasVAE \('.*'\) defines no call\(\)") as info:
        kmp.convert(KerasVAE())
    assert "class KerasVAE(kmp.Model)" in str(info.value)


def test_a_kmp_model_with_its_own_train_step_keeps_it():
    class Counting(kmp.Model):
        steps = 0

        def train_step(self, data):
            Counting.steps += 1
            return super().train_step(data)

    inputs = keras.Input((4,))
    model = Counting(inputs, keras.layers.Dense(1)(inputs))
    converted = kmp.convert(model, "mixed_float16", compile=False)
    assert type(converted).train_step is Counting.train_step


def test_a_keras_hub_backbone_with_lora_is_wrapped_with_a_warning():
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub builds the backbone")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=8, dropout=0.0,
    )
    backbone.enable_lora(rank=2)
    with pytest.warns(UserWarning, match="could not rebuild .* faithfully"):
        converted = kmp.convert(backbone, "mixed_float16", compile=False)
    inputs = {
        "token_ids": np.ones((2, 8), "int32"),
        "segment_ids": np.zeros((2, 8), "int32"),
        "padding_mask": np.ones((2, 8), "int32"),
    }
    outputs = converted(inputs)
    assert all(tensor.dtype == "float32" for tensor in tf.nest.flatten(outputs))
    # LoRA's trainable weights are the original's: the wrapper shares them.
    assert {id(w) for w in converted.trainable_weights} == {
        id(w) for w in backbone.trainable_weights
    }
