"""kmp.convert on any model (issue 16): models with their own compile and
train_step, models their config cannot rebuild, models without call(), and
what kmp chose on a model (policy, keep_float32, loss scaling) surviving a
`.keras` file."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from _helpers import DtypeProbe
from _helpers import graph_dtypes
import kmp
from kmp.convert import _WrappedModel
from kmp.model import FunctionalModel

_LATENT = 4
_FEATURES = 6


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


@keras.saving.register_keras_serializable(package="kmp_tests_any")
class ComputeProbe(keras.layers.Layer):
    """Records the dtype it computes in (its input after Keras' autocast)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(_dtype(x))
        return x * 2.0

    def get_config(self):
        return super().get_config()  # with the name, which keep_float32 uses


@keras.saving.register_keras_serializable(package="kmp_tests_any")
class KeptByClass(ComputeProbe):
    """A `ComputeProbe` that `keep_float32` names by its class."""


# --- Models that train their own way (keras.io's DCGAN) ----------------------


def _mlp(inputs, units, name, probe=None):
    layers = [keras.Input((inputs,)), keras.layers.Dense(8, activation="relu")]
    if probe is not None:
        layers.append(DtypeProbe(name=probe))
    return keras.Sequential(layers + [keras.layers.Dense(units)], name=name)


def _gan_class(base):
    """keras.io's DCGAN `GAN` on vectors: its own compile and train_step,
    with one `scale_loss` line per loss."""

    class GAN(base):
        def __init__(self):
            super().__init__(name="gan")
            self.discriminator = _mlp(_FEATURES, 1, "discriminator")
            self.generator = _mlp(_LATENT, _FEATURES, "generator", probe="generator_probe")

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn
            self.d_loss_metric = keras.metrics.Mean(name="d_loss")
            self.g_loss_metric = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def call(self, latent):
            return self.generator(latent)

        def train_step(self, data):
            real, latent = data
            batch_size = ops.shape(real)[0]
            generated = ops.cast(self.generator(latent), "float32")
            combined = ops.concatenate([generated, real], axis=0)
            labels = ops.concatenate(
                [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0
            )
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
                scaled = self.d_optimizer.scale_loss(d_loss)
            grads = tape.gradient(scaled, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(latent))
                g_loss = self.loss_fn(ops.zeros((batch_size, 1)), predictions)
                scaled = self.g_optimizer.scale_loss(g_loss)
            grads = tape.gradient(scaled, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

    return GAN


def _gan_data(steps=6, batch=4, poison_step=2):
    rng = np.random.default_rng(0)
    real = rng.normal(size=(steps * batch, _FEATURES)).astype("float32")
    latent = rng.normal(size=(steps * batch, _LATENT)).astype("float32")
    # Beyond float16's range: the discriminator's step overflows, is skipped.
    real[poison_step * batch:(poison_step + 1) * batch] *= 1e5
    return tf.data.Dataset.from_tensor_slices((real, latent)).batch(batch)


def _compile_gan(gan):
    gan.compile(
        d_optimizer=keras.optimizers.SGD(0.05),
        g_optimizer=keras.optimizers.SGD(0.05),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )


def test_converted_gan_compiles_with_its_own_arguments_and_trains_as_a_kmp_gan():
    gan = _gan_class(keras.Model)()
    start = gan.get_weights()
    with pytest.warns(UserWarning, match=r"could not rebuild 'gan' faithfully.*shares its weights"):
        converted = kmp.convert(gan, "mixed_float16")
    assert isinstance(converted, type(gan)) and isinstance(converted, _WrappedModel)
    assert converted.generator is gan.generator  # the GAN's own attributes
    _compile_gan(converted)
    history = converted.fit(_gan_data(), epochs=1, shuffle=False, verbose=0).history
    # Its own step ran, with its layers under the policy, and kmp wrapped the
    # optimizers its own compile set.
    assert gan.generator.get_layer("generator_probe").seen[-1] == "float16"
    # Set once, when it was wrapped (the warning says so), not per step.
    assert gan.generator.layers[0].dtype_policy.name == "mixed_float16"
    for name in ("d_optimizer", "g_optimizer"):
        assert isinstance(getattr(converted, name), kmp.LossScaleOptimizer)
        assert isinstance(getattr(converted, name).inner_optimizer, keras.optimizers.SGD)
    assert int(converted.d_optimizer.skipped_steps) >= 1  # the poisoned batch
    assert history["d_optimizer_skipped_steps"] == [int(converted.d_optimizer.skipped_steps)]

    # The same GAN written as a kmp.Model under the policy: the same run.
    kmp.set_policy("mixed_float16")
    native = _gan_class(kmp.Model)()
    native.set_weights(start)
    _compile_gan(native)
    native_history = native.fit(_gan_data(), epochs=1, shuffle=False, verbose=0).history
    assert set(history) == set(native_history)
    for key in history:
        np.testing.assert_allclose(history[key], native_history[key], rtol=1e-6, err_msg=key)
    for mine, theirs in zip(gan.weights, native.weights):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-6, atol=1e-7)


def test_compiled_model_that_overrides_compile_is_left_for_its_own_compile():
    gan = _gan_class(keras.Model)()
    _compile_gan(gan)
    with pytest.warns(UserWarning) as record:
        converted = kmp.convert(gan, "mixed_float16")
    assert any(
        "GAN overrides compile()" in str(w.message) and "compile=False" in str(w.message)
        for w in record
    )
    assert not converted.compiled
    _compile_gan(converted)
    assert isinstance(converted.d_optimizer, keras.optimizers.SGD)  # its own arguments


class CustomStep(keras.Model):
    """keras.io's "customizing what happens in fit()": a functional model
    (`CustomStep(inputs, outputs)`) with its own train_step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"own_step_loss": loss}


def test_functional_subclass_keeps_its_train_step_on_a_rebuilt_copy():
    inputs = keras.Input((4,))
    hidden = ComputeProbe(name="probe")(keras.layers.Dense(4, name="hidden")(inputs))
    model = CustomStep(inputs, keras.layers.Dense(1)(hidden))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # it rebuilds: no wrapping
        converted = kmp.convert(model, "mixed_float16")
    assert isinstance(converted, CustomStep) and converted.wrapped is not model
    converted.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    history = converted.fit(x, np.zeros((8, 1), "float32"), batch_size=4, verbose=0).history
    assert set(history) >= {"own_step_loss", "loss_scale", "skipped_steps"}
    assert converted.wrapped.get_layer("probe").seen[-1] == "float16"
    assert model.get_layer("probe").dtype_policy.name == "float32"


# --- What kmp chose on a model, through a .keras file --------------------------


def _kept_layers_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    hidden = ComputeProbe(name="by_name")(hidden)
    hidden = KeptByClass(name="by_class")(hidden)
    hidden = ComputeProbe(name="by_pattern_1")(hidden)
    hidden = DtypeProbe(name="handed_on")(hidden)
    outputs = ComputeProbe(name="free")(hidden)
    return keras.Model(inputs, outputs, name="net")


_KEEP = ["by_name", KeptByClass, "re:by_pat.*"]


def _loads(path):
    kmp.set_policy("float32")  # whatever the policy where it is loaded
    return {
        "keras.saving.load_model": keras.saving.load_model(path),
        "kmp.load_model": kmp.load_model(path),
    }


def _assert_kept(model, x, compute="float16"):
    """Calls `model` and checks what its probes saw: the kept layers computed
    in float32 and handed `compute` on."""
    model(x)
    seen = {
        layer.name: layer.seen[-1]
        for layer in model._flatten_layers(recursive=True)
        if hasattr(layer, "seen")
    }
    assert seen == {
        "by_name": "float32",
        "by_class": "float32",
        "by_pattern_1": "float32",
        "handed_on": compute,
        "free": compute,
    }


def test_functional_model_keeps_policy_keep_float32_and_loss_scale_in_a_keras_file(tmp_path):
    converted = kmp.convert(_kept_layers_model(), "mixed_float16", keep_float32=_KEEP)
    converted.compile("sgd", "mse", loss_scale=256)
    x = np.ones((2, 4), "float32")
    converted.fit(x, x, verbose=0)
    _assert_kept(converted, x)
    path = str(tmp_path / "converted.keras")
    converted.save(path)
    for how, loaded in _loads(path).items():
        assert isinstance(loaded, FunctionalModel), how
        _assert_kept(loaded, x)
        assert loaded.dtype_policy.name == "mixed_float16", how
        rows = {row["layer"]: row for row in kmp.summary(loaded, print_fn=lambda _: None)}
        assert rows["free"]["reason"] == "policy mixed_float16", how
        assert rows["by_class"]["reason"].startswith("keep_float32: KeptByClass"), how
        assert loaded._kmp_loss_scale == 256, how
        assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer), how
        assert not loaded.optimizer.dynamic and float(loaded.optimizer.loss_scale) == 256.0
    # Loaded under another policy, the kept layers stay in float32.
    bfloat16 = kmp.load_model(path, policy="mixed_bfloat16")
    _assert_kept(bfloat16, x, compute="bfloat16")


@keras.saving.register_keras_serializable(package="kmp_tests_any")
class Tower(keras.Model):
    """A subclassed model with a config: converted as a wrapper of a copy."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units, name="hidden")
        self.by_name = ComputeProbe(name="by_name")
        self.by_class = KeptByClass(name="by_class")
        self.by_pattern = ComputeProbe(name="by_pattern_1")
        self.handed_on = DtypeProbe(name="handed_on")
        self.free = ComputeProbe(name="free")

    def call(self, x):
        x = self.by_pattern(self.by_class(self.by_name(self.dense(x))))
        return self.free(self.handed_on(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="kmp_tests_any")
class TowerWithStep(Tower):
    """A `Tower` with its own train_step: converted as a wrapper of its class."""

    def train_step(self, data):
        logs = super().train_step(data)
        return {**logs, "own_step": 1.0}


@pytest.mark.parametrize("tower", [Tower, TowerWithStep])
def test_wrapper_keeps_policy_keep_float32_and_its_class_in_a_keras_file(tower, tmp_path):
    x = np.ones((2, 4), "float32")
    model = tower(units=3 if tower is Tower else 4)
    model(x)
    converted = kmp.convert(model, "mixed_float16", keep_float32=_KEEP)
    assert isinstance(converted, _WrappedModel)
    converted.compile("sgd", "mse", loss_scale=512)
    history = converted.fit(x, np.ones((2, model.units), "float32"), verbose=0).history
    assert ("own_step" in history) == (tower is TowerWithStep)
    _assert_kept(converted, x)
    path = str(tmp_path / "wrapper.keras")
    converted.save(path)
    for how, loaded in _loads(path).items():
        assert isinstance(loaded, _WrappedModel) and type(loaded.wrapped) is tower, how
        assert isinstance(loaded, tower) == (tower is TowerWithStep), how
        assert loaded.wrapped.units == model.units
        _assert_kept(loaded, x)
        assert loaded._kmp_loss_scale == 512, how
        history = loaded.fit(x, np.ones((2, model.units), "float32"), verbose=0).history
        assert ("own_step" in history) == (tower is TowerWithStep), how
        assert history["loss_scale"] == [512.0], how
    # Loaded under another policy, the wrapper computes in that one.
    loaded = kmp.load_model(path, policy="float32")
    loaded(x)
    assert loaded.wrapped.free.seen[-1] == "float32"


# --- keep_float32 in a .keras file, models Keras cannot rebuild, no call() ---


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
    with pytest.warns(
        UserWarning,
        match=r"could not rebuild 'classifier' faithfully.*Could not locate class "
        r"'TokenAndPositionEmbedding'.*shares its weights",
    ):
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


def test_a_wrapped_model_exports_and_loads_in_the_policy_asked_for(tmp_path):
    # kmp.convert's wrapper sets the original's layers to its policy once;
    # export and kmp.load_model set them to another policy, and the wrapper
    # must leave them so (it used to serve float16 matmuls in a float32
    # export).
    inputs = keras.Input((8,), dtype="int32")
    x = TokenAndPositionEmbedding(8, 50, 4)(inputs)
    outputs = keras.layers.Dense(2)(keras.layers.Dense(6)(x))
    model = keras.Model(inputs, outputs, name="classifier")
    tokens = np.arange(16).reshape(2, 8) % 50
    float32_outputs = np.asarray(model(tokens))  # before the wrapper sets its policy
    with pytest.warns(UserWarning, match="could not rebuild"):
        converted = kmp.convert(model, "mixed_float16", compile=False)
    assert isinstance(converted, _WrappedModel)
    assert converted.built  # built, as the model it wraps
    trained = np.asarray(converted(tokens))
    converted.export(tmp_path / "f32", inference_policy="float32", verbose=False)
    converted.export(tmp_path / "f16", verbose=False)
    assert "float16" not in graph_dtypes(tmp_path / "f32")
    assert "float16" in graph_dtypes(tmp_path / "f16")
    loaded = tf.saved_model.load(str(tmp_path / "f32"))
    served = loaded.serve(tokens)
    np.testing.assert_allclose(np.asarray(served), float32_outputs, rtol=1e-6, atol=1e-6)
    # After the export, the wrapper computes in float16 again.
    assert not np.allclose(trained, float32_outputs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(converted(tokens)), trained)


class KerasVAE(keras.Model):
    """keras.io's VAE shape: no call(), its own train_step."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(2)

    def train_step(self, data):
        return {}


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
    with pytest.warns(UserWarning, match=r"could not rebuild .* faithfully.*weights differ"):
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
