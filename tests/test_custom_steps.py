"""Every way Keras users train: their own train_step (keras.io's DCGAN and VAE
shapes), several optimizers, and loops outside fit."""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmp
from _helpers import assert_close_to_float16_rounding
from kmp import _keras_internals

_LATENT = 4
_FEATURES = 6


def _mlp(inputs, units, name):
    return keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(units)],
        name=name,
    )


def _gan_class(base, scaled):
    """keras.io's DCGAN `GAN`, on vectors; `scaled` adds its one line per loss."""

    class GAN(base):
        # keras.io's constructor: `GAN(discriminator=..., generator=...)`.
        def __init__(self, discriminator=None, generator=None):
            super().__init__()
            self.discriminator = discriminator or _mlp(_FEATURES, 1, "discriminator")
            self.generator = generator or _mlp(_LATENT, _FEATURES, "generator")

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

        def train_step(self, data):
            real, latent = data
            batch_size = ops.shape(real)[0]
            generated = self.generator(latent)
            combined = ops.concatenate([ops.cast(generated, "float32"), real], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
                scaled_d = self.d_optimizer.scale_loss(d_loss) if scaled else d_loss
            grads = tape.gradient(scaled_d, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(latent))
                g_loss = self.loss_fn(ops.zeros((batch_size, 1)), predictions)
                scaled_g = self.g_optimizer.scale_loss(g_loss) if scaled else g_loss
            grads = tape.gradient(scaled_g, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

        def call(self, latent):
            return self.generator(latent)

    return GAN


def _gan_data(poison_step=None, steps=6, batch=4):
    rng = np.random.default_rng(0)
    real = rng.normal(size=(steps * batch, _FEATURES)).astype("float32")
    latent = rng.normal(size=(steps * batch, _LATENT)).astype("float32")
    if poison_step is not None:
        # A real batch beyond float16's range: the discriminator's step
        # overflows and is skipped; the generator's is not.
        real[poison_step * batch:(poison_step + 1) * batch] *= 1e5
    return tf.data.Dataset.from_tensor_slices((real, latent)).batch(batch)


def _train_gan(base, scaled, optimizer, poison_step=None, models_given=False, callbacks=()):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    if models_given:  # as keras.io builds it: two Keras models, positional
        gan = _gan_class(base, scaled)(
            _mlp(_FEATURES, 1, "discriminator"), _mlp(_LATENT, _FEATURES, "generator")
        )
    else:
        gan = _gan_class(base, scaled)()
    gan.compile(optimizer(), optimizer(), keras.losses.BinaryCrossentropy(from_logits=True))
    history = gan.fit(_gan_data(poison_step), epochs=1, verbose=0, callbacks=list(callbacks)).history
    return gan, history


class _ScalerTrace(keras.callbacks.Callback):
    """After each batch: each optimizer's loss scale and applied steps, so
    that two runs can be compared step by step (which steps were skipped)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(tuple(
            (float(opt.loss_scale if isinstance(opt, kmp.LossScaleOptimizer) else opt.dynamic_scale),
             int(opt.iterations))
            for opt in (self.model.d_optimizer, self.model.g_optimizer)
        ))


def _assert_gan_matches_within_float16_rounding(mine, theirs):
    """`mine`'s weights and losses against `theirs` (Keras' own run of the
    same GAN), within one float16 rounding.

    Not bit for bit, because of where TensorFlow rounds, not what kmp
    computes: kmp's fit calls its train step as a function TensorFlow does
    not inline (`_noinline`, see `kmp/backends/tensorflow/distribute.py`), which grappler then
    optimizes without the step's input shapes. Where oneDNN runs float16
    natively (a CPU with AVX512_FP16), grappler's remapper fuses a Dense's
    `MatMul` and bias `Add` into one kernel that adds the bias to the float32
    accumulator and rounds once, but only where it can prove the `Add` adds
    a bias: for the discriminator's 1-unit Dense (Keras adds its bias with
    `AddV2`, not `BiasAdd`) it can in Keras' inlined step and cannot in
    kmp's, which rounds the product to float16 and rounds again after the
    bias: one rounding more, on the logits, per forward pass (so
    `roundings=1`; what follows from it stays far below that). With kmp's
    step inlined the two runs are bit-identical, as they are with
    `TF_ENABLE_ONEDNN_OPTS=0` and on CPUs without AVX512_FP16 (no fused
    float16 kernel). Measured on a CPU with AVX512_FP16: losses 2e-5
    relative apart (1% of the tolerance), weights at most 1% of it, while
    the weights of Keras' run with its last batch left out are 3 to 300
    times over it. Scales, iterations and skipped steps are compared
    exactly by the callers.
    """
    # The poisoned batch's d_loss is not finite: the step's own Mean counts
    # it, in both runs (NaN equals NaN here).
    for key in ("d_loss", "g_loss"):
        assert_close_to_float16_rounding(mine[1][key], theirs[1][key], roundings=1)
    for mine_weight, their_weight in zip(mine[0].weights, theirs[0].weights):
        assert_close_to_float16_rounding(np.asarray(mine_weight), np.asarray(their_weight), roundings=1)


def test_gan_with_one_line_per_loss_matches_keras_own_scaler_recipe():
    kmp_trace, keras_trace = _ScalerTrace(), _ScalerTrace()
    kmp_gan, kmp_history = _train_gan(
        kmp.Model, True, lambda: keras.optimizers.SGD(0.05), 2, callbacks=[kmp_trace]
    )
    keras_gan, keras_history = _train_gan(
        keras.Model, True,
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)), 2,
        callbacks=[keras_trace],
    )
    # kmp wrapped both attribute optimizers, with no change to the code.
    assert isinstance(kmp_gan.d_optimizer, kmp.LossScaleOptimizer)
    assert isinstance(kmp_gan.g_optimizer, kmp.LossScaleOptimizer)
    d_skips = int(kmp_gan.d_optimizer.skipped_steps)
    assert d_skips >= 1  # the poisoned batch
    assert int(kmp_gan.d_optimizer.counters["forward_overflows"]) >= 1
    assert kmp_history["d_optimizer_skipped_steps"] == [d_skips]
    assert kmp_history["g_optimizer_skipped_steps"] == [int(kmp_gan.g_optimizer.skipped_steps)]
    assert kmp_history["d_optimizer_loss_scale"] == [float(kmp_gan.d_optimizer.loss_scale)]
    # Keras' own scaler backs off the same way: the same scales and applied
    # steps after every batch (so the same steps skipped), exactly.
    assert kmp_trace.steps == keras_trace.steps and len(kmp_trace.steps) == 6
    assert float(keras_gan.d_optimizer.dynamic_scale) == float(kmp_gan.d_optimizer.loss_scale)
    assert float(keras_gan.g_optimizer.dynamic_scale) == float(kmp_gan.g_optimizer.loss_scale)
    assert int(kmp_gan.d_optimizer.iterations) == int(keras_gan.d_optimizer.iterations) == 6 - d_skips
    assert int(kmp_gan.g_optimizer.iterations) == int(keras_gan.g_optimizer.iterations)
    # The same losses and weights, within the one float16 rounding by which
    # TensorFlow computes the two steps' graphs apart (see the helper).
    _assert_gan_matches_within_float16_rounding(
        (kmp_gan, kmp_history), (keras_gan, keras_history)
    )


def test_gan_code_unchanged_is_never_divided_and_warns_once_per_optimizer():
    with pytest.warns(UserWarning, match="scale_loss") as record:
        kmp_gan, history = _train_gan(kmp.Model, False, lambda: keras.optimizers.SGD(0.05))
    unscaled = [str(w.message) for w in record if "was not scaled" in str(w.message)]
    assert len(unscaled) == 2  # d_optimizer and g_optimizer, once each
    # Each names the attribute and the line to add (in fit, the warning's own
    # location is AutoGraph's copy of the step).
    assert sorted(m.split("(the model's `")[1].split("`")[0] for m in unscaled) == [
        "d_optimizer", "g_optimizer"
    ]
    assert any("scaled_loss = self.d_optimizer.scale_loss(loss)" in m for m in unscaled)
    # The same as the example run without any loss scaling, within float16
    # rounding (see the helper); every step applied, as there.
    plain_gan, plain_history = _train_gan(keras.Model, False, lambda: keras.optimizers.SGD(0.05))
    _assert_gan_matches_within_float16_rounding((kmp_gan, history), (plain_gan, plain_history))
    assert history["d_optimizer_skipped_steps"] == [0]
    assert history["g_optimizer_skipped_steps"] == [0]
    for name in ("d_optimizer", "g_optimizer"):
        assert int(getattr(kmp_gan, name).iterations) == int(getattr(plain_gan, name).iterations) == 6


def _mixing_gan(policy):
    """A step that mixes its sub-models' outputs with float32 data the way
    keras.io's GAN guide (tf.concat) and WGAN-GP (fake - real) do, with no
    cast of its own."""
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)

    class GAN(kmp.Model):
        def __init__(self):
            super().__init__()
            self.discriminator = _mlp(_FEATURES, 1, "discriminator")
            self.generator = _mlp(_LATENT, _FEATURES, "generator")

        def train_step(self, data):
            real, latent = data
            fake = self.generator(latent)
            combined = tf.concat([fake, real], axis=0)
            with tf.GradientTape() as tape:
                d_loss = tf.reduce_mean(tf.square(self.discriminator(combined)))
                d_loss = d_loss + tf.reduce_mean(tf.square(fake - real))
                scaled = self.optimizer.scale_loss(d_loss)
            variables = self.discriminator.trainable_weights
            self.optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
            return {"d_loss": d_loss}

        def call(self, latent):
            return self.generator(latent)

    gan = GAN()
    gan.compile(keras.optimizers.SGD(0.01))
    return gan, gan.fit(_gan_data(), epochs=1, verbose=0).history


def test_a_custom_step_mixes_its_sub_models_outputs_with_float32_data():
    # Under Keras' own mixed_float16 both lines raise TypeError ("Tensors in
    # list passed to 'values' of 'ConcatV2' Op have types [float16,
    # float32]"); a kmp.Model's sub-models return float32, as it does.
    gan, history = _mixing_gan("mixed_float16")
    reference, reference_history = _mixing_gan("float32")
    np.testing.assert_allclose(history["d_loss"], reference_history["d_loss"], rtol=1e-2)
    latent = np.ones((2, _LATENT), "float32")
    assert gan.generator(latent).dtype == "float32"
    # They still compute in float16 inside.
    assert [layer.compute_dtype for layer in gan.generator.layers] == ["float16", "float16"]
    assert gan.generator.layers[-1](np.ones((2, 8), "float32")).dtype == "float16"
    assert reference.generator(latent).dtype == "float32"


class _TwoHeads(kmp.Model):
    """One optimizer, two losses, two applies (CycleGAN's persistent tape
    with one optimizer); `scale_second=False` forgets the second line."""

    def __init__(self, scale_second):
        super().__init__()
        self.scale_second = scale_second
        self.a, self.b = (
            keras.Sequential([keras.Input((2,)), keras.layers.Dense(
                1, use_bias=False, kernel_initializer="ones")], name=name) for name in "ab")

    def train_step(self, x):
        with tf.GradientTape(persistent=True) as tape:
            loss_a = ops.mean(self.a(x))
            loss_b = ops.mean(self.b(x))
            scaled_a = self.optimizer.scale_loss(loss_a)
            scaled_b = self.optimizer.scale_loss(loss_b) if self.scale_second else loss_b
        for head, scaled in ((self.a, scaled_a), (self.b, scaled_b)):
            variables = head.trainable_variables
            self.optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
        return {"loss_a": loss_a, "loss_b": loss_b}


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("scale_second", [True, False])
def test_one_optimizer_applies_each_of_two_scaled_losses_divided_once(scale_second, mode):
    # Each apply takes the loss scaled before it: the second apply once got
    # gradients 2**15 times too large, with a warning that scale_loss had
    # not run.
    kmp.set_policy("mixed_float16")
    model = _TwoHeads(scale_second)
    model.compile(keras.optimizers.SGD(0.1), run_eagerly=mode == "eager", jit_compile=mode == "xla")
    model.optimizer.build(model.a.trainable_variables + model.b.trainable_variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(np.ones((4, 2), "float32"), batch_size=4, epochs=1, verbose=0)
    unscaled = [w for w in caught if "scale_loss` did not run" in str(w.message)]
    # d mean(x @ k) / dk = mean(x) = 1 per coordinate: 1 - 0.1 * 1.
    for head in (model.a, model.b):
        np.testing.assert_allclose(head.get_weights()[0].ravel(), [0.9, 0.9], rtol=1e-6)
    assert int(model.optimizer.iterations) == 2
    assert len(unscaled) == (0 if scale_second else 1)  # the forgotten line is named


@keras.saving.register_keras_serializable(package="kmp_tests")
class KerasIoDistiller(kmp.Model):
    """keras.io's knowledge distillation: a `compile` of its own arguments."""

    def __init__(self, student, **kwargs):
        super().__init__(**kwargs)
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        return self.student_loss_fn(y, y_pred)

    def call(self, x):
        return self.student(x)

    def get_config(self):
        return {**super().get_config(), "student": keras.saving.serialize_keras_object(self.student)}

    @classmethod
    def from_config(cls, config):
        return cls(**{**config, "student": keras.saving.deserialize_keras_object(config["student"])})


@pytest.mark.parametrize("load", [keras.models.load_model, kmp.load_model])
def test_a_model_with_its_own_compile_loads_uncompiled_as_keras_does(tmp_path, load):
    # kmp once called its compile with the saved config: "Distiller.compile()
    # got an unexpected keyword argument 'loss'".
    kmp.set_policy("mixed_float16")
    model = KerasIoDistiller(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]))
    model.compile(keras.optimizers.Adam(), ["accuracy"],
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model.fit(x, np.arange(32) % 3, epochs=1, verbose=0)
    model.save(tmp_path / "distiller.keras")
    with pytest.warns(UserWarning, match=r"`compile\(\)` was not called as part of model "
                      "loading because the model's `compile\(\)` method is custom"):
        loaded = load(tmp_path / "distiller.keras")
    assert type(loaded) is KerasIoDistiller and getattr(loaded, "optimizer", None) is None
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


class _CrashAtSecondEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("the machine went away")


def _mixed_float16_gan(optimizers_built):
    """A compiled and built kmp.Model GAN under mixed_float16, seeded; its
    `compile` builds its two optimizers where `optimizers_built` (the
    documented line, as Keras' own resume needs)."""
    class GAN(_gan_class(kmp.Model, scaled=True)):
        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile(d_optimizer, g_optimizer, loss_fn)
            if optimizers_built:
                d_optimizer.build(self.discriminator.trainable_variables)
                g_optimizer.build(self.generator.trainable_variables)

    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = GAN()
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    model(np.zeros((1, _LATENT), "float32"))  # Keras' BackupAndRestore wants it built
    return model


@pytest.mark.parametrize("built", [True, False], ids=["optimizers_built", "unbuilt"])
def test_a_gan_resumes_from_kmps_backup_with_its_optimizers_state(tmp_path, built):
    # kmp once built the unused `model.optimizer` and raised "its variables
    # are another model's" for the same GAN; an optimizer built before fit
    # was wrapped in an unbuilt scaler, so no resume could keep its state.
    gan = functools.partial(_mixed_float16_gan, optimizers_built=built)
    data = _gan_data(poison_step=1)  # a skipped step: the counters hold something
    reference = gan()
    reference.fit(data, epochs=2, verbose=0)
    with pytest.raises(RuntimeError, match="went away"):
        gan().fit(data, epochs=2, verbose=0, callbacks=[
            kmp.callbacks.BackupAndRestore(tmp_path / "backup"), _CrashAtSecondEpoch()])
    resumed = gan()
    fresh = [v.numpy() for v in resumed.weights]
    resume = lambda: resumed.fit(  # noqa: E731
        data, epochs=2, verbose=0, callbacks=[kmp.callbacks.BackupAndRestore(tmp_path / "backup")])
    if not built:
        with pytest.raises(ValueError, match=r"holds the state of the model's `d_optimizer`, "
                           r"`g_optimizer`, which are not built yet.*`self.d_optimizer.build\("):
            resume()
        for before, variable in zip(fresh, resumed.weights):
            np.testing.assert_array_equal(variable.numpy(), before)
        return
    assert len(resume().history["d_loss"]) == 1
    for name in ("d_optimizer", "g_optimizer"):
        mine, theirs = getattr(resumed, name), getattr(reference, name)
        # More than the 6 steps of the resumed epoch: the first epoch's count.
        assert int(mine.iterations) == int(theirs.iterations) > 6
        assert float(mine.loss_scale) == float(theirs.loss_scale)
        assert int(mine.skipped_steps) == int(theirs.skipped_steps)
    for mine, theirs in zip(resumed.weights, reference.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_load_weights_into_a_fresh_compiled_gan_keeps_its_optimizers_state(tmp_path):
    # A GAN's optimizers become scalers at its first fit: before, a file
    # saved after a fit was loaded into the plain optimizers its `compile`
    # set, and Keras skipped their state with a warning (15 variables saved,
    # 10 built), where Keras alone keeps it.
    gan = functools.partial(_mixed_float16_gan, optimizers_built=True)
    data = _gan_data(poison_step=1)  # a skipped step: the counters hold something
    trained = gan()
    trained.fit(data, epochs=1, verbose=0)
    trained.save_weights(tmp_path / "gan.weights.h5")
    loaded = gan()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading")
        loaded.load_weights(tmp_path / "gan.weights.h5")
    for name in ("d_optimizer", "g_optimizer"):
        mine, theirs = getattr(loaded, name), getattr(trained, name)
        assert int(mine.iterations) == int(theirs.iterations) > 0
        assert float(mine.loss_scale) == float(theirs.loss_scale)
        assert int(mine.skipped_steps) == int(theirs.skipped_steps) == (name == "d_optimizer")
    trained.fit(data, epochs=1, verbose=0)
    loaded.fit(data, epochs=1, verbose=0)
    for mine, theirs in zip(loaded.weights, trained.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


class PatchEncoder(keras.layers.Layer):
    """keras.io's masked autoencoder's: embeddings and positions, both in
    the compute dtype."""

    def build(self, input_shape):
        self.projection = keras.layers.Dense(4)
        self.position = self.add_weight(shape=(1, 3, 4), initializer="random_normal")

    def call(self, patches):
        embeddings = self.projection(patches)
        positions = ops.cast(ops.broadcast_to(self.position, ops.shape(embeddings)),
                             self.compute_dtype)
        return embeddings, positions


class MaskedAutoencoder(kmp.Model):
    def __init__(self):
        super().__init__()
        self.patch_encoder = PatchEncoder()
        self.encoder = keras.Sequential([keras.Input((3, 4)), keras.layers.Dense(4)], name="encoder")

    def call(self, patches):
        embeddings, positions = self.patch_encoder(patches)
        self.inside_dtype = embeddings.dtype  # within the model's call: its compute dtype
        return self.encoder(embeddings) + ops.cast(positions, "float32")

    def train_step(self, patches):
        with tf.GradientTape() as tape:
            embeddings, positions = self.patch_encoder(patches)
            outputs = self.encoder(embeddings) + positions  # keras.io's line
            loss = ops.mean(ops.square(outputs))
            scaled = self.optimizer.scale_loss(loss)
        variables = self.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
        return {"my_loss": loss}


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_a_custom_step_mixes_a_held_layers_output_with_a_held_models(mode):
    # Under Keras' own mixed_float16 both are float16; kmp's held models
    # return float32, and the layers the step calls itself now do too (the
    # step raised "Input 'y' of 'AddV2' Op has type float16 that does not
    # match type float32").
    losses = {}
    for policy in ("mixed_float16", "float32"):
        kmp.set_policy(policy)
        keras.utils.set_random_seed(0)
        model = MaskedAutoencoder()
        model.compile(keras.optimizers.SGD(0.1), run_eagerly=mode == "eager",
                      jit_compile=mode == "xla")
        patches = np.random.default_rng(0).normal(size=(8, 3, 2)).astype("float32")
        losses[policy] = model.fit(patches, batch_size=4, epochs=2, verbose=0).history["my_loss"]
    np.testing.assert_allclose(losses["mixed_float16"], losses["float32"], rtol=1e-2)
    kmp.set_policy("mixed_float16")
    mixed = MaskedAutoencoder()
    mixed.compile(keras.optimizers.SGD(0.1))
    mixed.fit(patches, batch_size=4, epochs=1, verbose=0)
    assert [t.dtype for t in mixed.patch_encoder(patches)] == ["float32", "float32"]  # alone
    mixed(patches)
    assert mixed.inside_dtype == "float16"  # within the model's call, as Keras computes it


def _keras_io_vae_class(base):
    class VAE(base):
        """keras.io's VAE constructor (examples/generative/vae.py):
        `VAE(encoder, decoder)`, two Keras models, positional."""

        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                reconstruction = ops.cast(self.decoder(self.encoder(data)), "float32")
                loss = ops.mean(ops.sum(ops.square(data - reconstruction), axis=1))
                scaled_loss = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(loss)
            return {"total_loss": self.total_loss_tracker.result()}

    return VAE


def _train_keras_io_vae(base, steps=4):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    encoder, decoder = _mlp(_FEATURES, _LATENT, "encoder"), _mlp(_LATENT, _FEATURES, "decoder")
    vae = _keras_io_vae_class(base)(encoder, decoder, name="vae")
    assert vae.encoder is encoder and vae.decoder is decoder and vae.name == "vae"
    optimizer = keras.optimizers.SGD(0.01)
    # Keras' own recipe wraps the optimizer itself; kmp's compile does.
    vae.compile(keras.optimizers.LossScaleOptimizer(optimizer) if base is keras.Model
                else optimizer)
    x = np.random.default_rng(1).normal(size=(8 * steps, _FEATURES)).astype("float32")
    history = vae.fit(x, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    return vae, history


def test_keras_io_vae_taking_two_models_builds_and_trains_as_keras_does():
    # Two positional Keras models are the subclass's own arguments, not
    # (inputs, outputs): Keras makes only `Model(inputs, outputs)` itself
    # functional (issue 30: kmp raised "Functional.__init__() missing 2
    # required positional arguments").
    ours, our_history = _train_keras_io_vae(kmp.Model)
    theirs, their_history = _train_keras_io_vae(keras.Model)
    for vae in (ours, theirs):
        assert not isinstance(vae, _keras_internals.Functional)
    assert isinstance(ours, kmp.Model)
    assert our_history["loss_scale"] == [float(ours.optimizer.loss_scale)]
    # The same steps applied (and skipped) as under Keras' own scaler.
    applied = int(ours.optimizer.iterations)
    assert applied == int(theirs.optimizer.iterations) >= 2
    assert our_history["skipped_steps"] == [4 - applied]
    np.testing.assert_allclose(our_history["total_loss"], their_history["total_loss"], rtol=1e-6)
    for mine, reference in zip(ours.weights, theirs.weights):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(reference), rtol=1e-6, atol=1e-7)


def test_keras_io_gan_taking_two_models_builds_and_trains_as_keras_does():
    # As test_gan_with_one_line_per_loss_matches_keras_own_scaler_recipe,
    # with the models passed as keras.io passes them.
    kmp_gan, kmp_history = _train_gan(
        kmp.Model, True, lambda: keras.optimizers.SGD(0.05), 2, models_given=True
    )
    keras_gan, keras_history = _train_gan(
        keras.Model, True, lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
        2, models_given=True,
    )
    for gan in (kmp_gan, keras_gan):
        assert not isinstance(gan, _keras_internals.Functional)
        assert [model.name for model in (gan.discriminator, gan.generator)] == [
            "discriminator", "generator"
        ]
    assert kmp_history["d_optimizer_skipped_steps"] == [int(kmp_gan.d_optimizer.skipped_steps)]
    assert int(kmp_gan.d_optimizer.skipped_steps) >= 1  # the poisoned batch
    # The same skips and scales as Keras' own scaler, exactly; losses and
    # weights within float16 rounding of Keras' (see the helper).
    assert float(keras_gan.d_optimizer.dynamic_scale) == float(kmp_gan.d_optimizer.loss_scale)
    assert int(keras_gan.d_optimizer.iterations) == int(kmp_gan.d_optimizer.iterations)
    _assert_gan_matches_within_float16_rounding((kmp_gan, kmp_history), (keras_gan, keras_history))


def _vae_class(base):
    class VAE(base):
        """keras.io's VAE shape: its own train_step on `self.optimizer`."""

        def __init__(self, scaled, **kwargs):
            super().__init__(**kwargs)
            self.scaled = scaled
            self.encoder = _mlp(_FEATURES, 2 * _LATENT, "encoder")
            self.decoder = _mlp(_LATENT, _FEATURES, "decoder")

        def call(self, x):
            return self.decoder(self.encoder(x)[:, :_LATENT])

        def train_step(self, data):
            with tf.GradientTape() as tape:
                encoded = ops.cast(self.encoder(data), "float32")
                mean, log_var = encoded[:, :_LATENT], encoded[:, _LATENT:]
                reconstruction = ops.cast(self.decoder(mean), "float32")
                loss = ops.mean(ops.sum(ops.square(data - reconstruction), axis=1)) - 0.5 * ops.mean(
                    ops.sum(1 + log_var - ops.square(mean) - ops.exp(log_var), axis=1)
                )
                scaled_loss = self.optimizer.scale_loss(loss) if self.scaled else loss
            grads = tape.gradient(scaled_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            return {"vae_loss": loss}

    return VAE


_VAE = _vae_class(kmp.Model)


def _train_vae(scaled, loss_scale, keras_recipe=False, data_scale=1.0, learning_rate=0.01):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    if keras_recipe:
        vae = _vae_class(keras.Model)(scaled)
        vae.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate)))
    else:
        vae = _VAE(scaled)
        vae.compile(keras.optimizers.SGD(learning_rate), loss_scale=loss_scale)
    x = data_scale * np.random.default_rng(1).normal(size=(32, _FEATURES)).astype("float32")
    history = vae.fit(x, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    return vae, history


def test_vae_code_unchanged_trains_as_without_scaling_not_divided_by_the_scale():
    with pytest.warns(UserWarning, match=r"scaled_loss = self.optimizer.scale_loss\(loss\)"):
        vae, history = _train_vae(scaled=False, loss_scale="auto")
    reference, _ = _train_vae(scaled=False, loss_scale=None)
    moved = [np.abs(np.asarray(v) - np.asarray(r)).max() for v, r in zip(vae.weights, reference.weights)]
    assert max(moved) < 1e-6
    assert history["loss_scale"] == [2.0**15] and history["skipped_steps"] == [0]


def test_vae_with_one_line_is_scaled_and_reported():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        vae, history = _train_vae(scaled=True, loss_scale="auto")
    assert isinstance(vae.optimizer, kmp.LossScaleOptimizer)
    assert history["skipped_steps"] == [int(vae.optimizer.skipped_steps)]
    assert int(vae.optimizer.iterations) + int(vae.optimizer.skipped_steps) == 4


def test_vae_with_one_line_matches_keras_own_scaler_recipe():
    # Large inputs: a loss in the thousands, so 2**15 overflows at first and
    # both scalers back off alike.
    vae, history = _train_vae(scaled=True, loss_scale="auto", data_scale=60.0,
                              learning_rate=1e-5)
    reference, reference_history = _train_vae(scaled=True, loss_scale=None, keras_recipe=True,
                                              data_scale=60.0, learning_rate=1e-5)
    skipped = int(vae.optimizer.skipped_steps)
    assert skipped >= 1 and history["skipped_steps"] == [skipped]
    assert float(vae.optimizer.loss_scale) == float(reference.optimizer.dynamic_scale)
    assert np.all(np.isfinite(history["vae_loss"]))
    np.testing.assert_allclose(history["vae_loss"], reference_history["vae_loss"], rtol=1e-6)
    for mine, theirs in zip(vae.weights, reference.weights):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("compiled", [False, True])
def test_custom_loop_recipe_skips_an_injected_overflow(compiled, caplog):
    # The README's recipe: GradientTape, scale_loss, apply_gradients, counters.
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(1)])
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**8)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(ops.cast(model(x), "float32") - y))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    step = tf.function(step) if compiled else step
    rng = np.random.default_rng(0)
    for i in range(4):
        x = rng.normal(size=(8, _FEATURES)).astype("float32")
        if i == 2:
            x *= 1e4  # float16 gradients overflow at scale 2**8: skipped
        before = [np.asarray(w) for w in model.weights]
        step(x, np.zeros((8, 1), "float32"))
        after = [np.asarray(w) for w in model.weights]
        unchanged = all(np.array_equal(b, a) for b, a in zip(before, after))
        assert unchanged == (i == 2)
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == 3
    assert float(optimizer.loss_scale) == 2.0**7
    # AutoGraph converted kmp's code in the traced step without a complaint.
    assert not [r for r in caplog.records if "AutoGraph could not transform" in r.getMessage()]


@pytest.mark.parametrize("compiled", [False, True])
def test_tf_keras_recipe_with_get_unscaled_gradients_is_divided_once(compiled):
    # TensorFlow's mixed-precision guide: get_scaled_loss in the tape,
    # get_unscaled_gradients on the gradients, then apply_gradients.
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(1)])
    reference = keras.Sequential(
        [keras.Input((_FEATURES,)), keras.layers.Dense(1, dtype="float32")]
    )
    reference.set_weights(model.get_weights())
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**8)
    reference_optimizer = keras.optimizers.SGD(0.01)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(ops.cast(model(x), "float32") - y))
            scaled = optimizer.get_scaled_loss(loss)
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, model.trainable_weights))
        optimizer.apply_gradients(zip(grads, model.trainable_weights))

    step = tf.function(step) if compiled else step
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for i in range(4):
            x = rng.normal(size=(8, _FEATURES)).astype("float32")
            y = np.zeros((8, 1), "float32")
            if i == 2:
                x *= 1e4  # float16 gradients overflow at scale 2**8: skipped
            step(x, y)
            if i != 2:
                with tf.GradientTape() as tape:
                    loss = ops.mean(ops.square(reference(x) - y))
                reference_optimizer.apply(
                    tape.gradient(loss, reference.trainable_weights), reference.trainable_weights
                )
    # Divided once: the float32 SGD run, to float16 rounding.
    for mine, theirs in zip(model.weights, reference.weights):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-2, atol=1e-3)
    assert int(optimizer.skipped_steps) == 1 and int(optimizer.iterations) == 3
    assert float(optimizer.loss_scale) == 2.0**7


def test_gradients_unscaled_in_a_tf_function_and_applied_outside_it_are_refused():
    # The function's Python runs only when it is traced: from its second
    # call on, the eager apply could not know the gradients were divided
    # already and divided them again (a step 1/scale of the right one).
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(1)])
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    optimizer.build(model.trainable_weights)

    @tf.function
    def unscaled_gradients(x):
        with tf.GradientTape() as tape:
            scaled = optimizer.get_scaled_loss(ops.mean(ops.cast(model(x), "float32") ** 2))
        return optimizer.get_unscaled_gradients(tape.gradient(scaled, model.trainable_weights))

    before = [w.numpy() for w in model.weights]
    grads = unscaled_gradients(np.ones((4, _FEATURES), "float32"))
    with pytest.raises(ValueError, match=r"`get_unscaled_gradients` ran inside a compiled "
                       r"function .* would divide them again"):
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
    for old, weight in zip(before, model.weights):
        np.testing.assert_array_equal(old, weight.numpy())
    assert int(optimizer.iterations) == 0 and int(optimizer.skipped_steps) == 0


def test_a_loss_scaled_in_a_tf_function_and_applied_outside_it_is_divided_once():
    # scale_loss reads the scale at each call of a tf.function: the eager
    # apply divides by the same scale, on every call (not refused).
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(1)])
    reference = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(1, dtype="float32")])
    reference.set_weights(model.get_weights())
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**8)
    reference_optimizer = keras.optimizers.SGD(0.01)

    @tf.function
    def scaled_gradients(x):
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(ops.mean(ops.cast(model(x), "float32") ** 2))
        return tape.gradient(scaled, model.trainable_weights)

    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "divided ... scale_loss did not run"
        for _ in range(3):
            x = rng.normal(size=(8, _FEATURES)).astype("float32")
            optimizer.apply(scaled_gradients(x), model.trainable_weights)
            with tf.GradientTape() as tape:
                loss = ops.mean(reference(x) ** 2)
            reference_optimizer.apply(tape.gradient(loss, reference.trainable_weights),
                                      reference.trainable_weights)
    for mine, theirs in zip(model.weights, reference.weights):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-2, atol=1e-3)
    assert int(optimizer.iterations) == 3


def test_progress_bar_shows_each_scaler_readably(capsys):
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    gan = _gan_class(kmp.Model, True)()
    optimizer = lambda: keras.optimizers.SGD(0.05)  # noqa: E731
    gan.compile(optimizer(), optimizer(), keras.losses.BinaryCrossentropy(from_logits=True))
    gan.fit(_gan_data(), epochs=1, verbose=2)
    output = capsys.readouterr().out
    # Before Keras 3.12 the progress bar formats every value itself
    # (`32768.0000`); from 3.12 on kmp's readable text reaches the line.
    if tuple(int(part) for part in keras.__version__.split(".")[:2]) >= (3, 12):
        assert "d_optimizer_loss_scale: 32768 " in output
        assert "g_optimizer_skipped_steps: 0" in output
        assert "32768.0000" not in output and "e+04" not in output
    else:
        assert "d_optimizer_loss_scale: 32768.0000" in output
