"""keras.io's examples and guides, as a Keras user writes them, on kmp
(TensorFlow backend).

Each test restates one keras.io page (cited in its docstring) at a tiny size
(8x8 images, a few units, a few steps) with `kmp.Model` in place of
`keras.Model` and kmp's documented line (docs/custom-steps.md): in a
`train_step`, `scaled_loss = self.optimizer.scale_loss(loss)` inside the tape
and the gradients of `scaled_loss`; in a loop outside `fit`,
`kmp.LossScaleOptimizer(...)` and the same line. Under `mixed_float16` it
checks what a user relies on:

- each step's loss stays within float16's rounding band of the same code run
  under float32 from the same weights and seeds (`_float16_band.band_of`);
- no loss is NaN or infinite;
- the logs (`History`) carry `loss_scale` and `skipped_steps`, and they are
  the scaler's own counters;
- without the line, kmp's warning names the line to add.

The JAX versions are in test_keras_io_jax.py.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _float16_band import assert_within_band
from keras import ops

import kmp

STEPS = 4          # one batch per epoch: History holds one loss per step
BATCH = 8
LATENT = 2


def _assert_reported(history, optimizer, prefix=""):
    """History carries the scaler's `loss_scale` and `skipped_steps`."""
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    assert history[f"{prefix}skipped_steps"][-1] == int(optimizer.skipped_steps)
    assert history[f"{prefix}loss_scale"][-1] == float(optimizer.loss_scale)
    assert all(np.isfinite(history[f"{prefix}loss_scale"]))


def _no_scale_loss_warning(record):
    messages = [str(w.message) for w in record if "scale_loss" in str(w.message)]
    assert not messages, messages


def _images(low=0.0, high=1.0):
    return np.random.default_rng(0).uniform(low, high, size=(STEPS * BATCH, 8, 8, 1)).astype("float32")


# --- examples/generative/vae.py ----------------------------------------------


class Sampling(keras.layers.Layer):
    """keras.io's VAE `Sampling`: z from (z_mean, z_log_var)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        # keras.io draws in the default float32; TensorFlow's `*` does not mix
        # float16 and float32, under Keras' own mixed precision too, hence
        # the input's dtype (docs/custom-steps.md).
        epsilon = keras.random.normal(
            shape=(batch, dim), dtype=z_mean.dtype, seed=self.seed_generator
        )
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _vae_encoder_decoder():
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = keras.layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    z_mean = keras.layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = keras.layers.Dense(LATENT, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input(shape=(LATENT,))
    x = keras.layers.Dense(2 * 2 * 8, activation="relu")(latent_inputs)
    x = keras.layers.Reshape((2, 2, 8))(x)
    x = keras.layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    x = keras.layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = keras.layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return encoder, decoder


def _vae_class(line):
    class VAE(kmp.Model):                                     # kmp: was keras.Model
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(
                    ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
                )
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
                if line:
                    scaled_loss = self.optimizer.scale_loss(total_loss)       # kmp
                else:
                    scaled_loss = total_loss
            grads = tape.gradient(scaled_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {
                "loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result(),
            }

    return VAE


def _train_vae(policy, line=True):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    encoder, decoder = _vae_encoder_decoder()
    vae = _vae_class(line)(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam(1e-3))
    history = vae.fit(_images(), epochs=STEPS, batch_size=STEPS * BATCH, verbose=0).history
    return vae, history


def test_vae_example_with_the_line_tracks_float32_and_reports_its_scaler():
    """examples/generative/vae.py (keras-io): `class VAE(keras.Model)` with
    `__init__(self, encoder, decoder, **kwargs)`, `VAE(encoder, decoder)`."""
    _, reference = _train_vae("float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        vae, history = _train_vae("mixed_float16")
    _no_scale_loss_warning(record)
    # Encoder and decoder: 5 + 4 layers deep.
    for key in ("loss", "reconstruction_loss", "kl_loss"):
        assert_within_band(history[key], reference[key], 3 * 9, f"VAE {key}")
    _assert_reported(history, vae.optimizer)


def test_vae_example_without_the_line_warns_naming_it():
    with pytest.warns(UserWarning, match=r"scaled_loss = self\.optimizer\.scale_loss\(loss\)"):
        vae, history = _train_vae("mixed_float16", line=False)
    assert all(np.isfinite(history["loss"]))
    _assert_reported(history, vae.optimizer)


# --- examples/generative/dcgan_overriding_train_step.py ----------------------


def _gan_models():
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(LATENT,)),
            keras.layers.Dense(2 * 2 * 8),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Reshape((2, 2, 8)),
            keras.layers.Conv2DTranspose(8, (4, 4), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2DTranspose(8, (4, 4), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    return discriminator, generator


def _dcgan_class(line):
    class GAN(kmp.Model):                                     # kmp: was keras.Model
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.seed_generator = keras.random.SeedGenerator(1337)

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

        def train_step(self, real_images):
            batch_size = ops.shape(real_images)[0]
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator
            )
            generated_images = self.generator(random_latent_vectors)
            combined_images = ops.concatenate([generated_images, real_images], axis=0)
            labels = ops.concatenate(
                [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0
            )
            labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)

            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
                scaled_d = self.d_optimizer.scale_loss(d_loss) if line else d_loss       # kmp
            grads = tape.gradient(scaled_d, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator
            )
            misleading_labels = ops.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(random_latent_vectors))
                g_loss = self.loss_fn(misleading_labels, predictions)
                scaled_g = self.g_optimizer.scale_loss(g_loss) if line else g_loss       # kmp
            grads = tape.gradient(scaled_g, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

    return GAN


def _train_dcgan(policy, line=True):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    discriminator, generator = _gan_models()
    gan = _dcgan_class(line)(discriminator=discriminator, generator=generator, latent_dim=LATENT)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    dataset = tf.data.Dataset.from_tensor_slices(_images()).batch(BATCH)
    history = gan.fit(dataset, epochs=STEPS, steps_per_epoch=1, verbose=0).history
    return gan, history


def test_dcgan_example_with_a_line_per_loss_tracks_float32_and_reports_both_scalers():
    """examples/generative/dcgan_overriding_train_step.py (keras-io):
    `GAN(discriminator=..., generator=..., latent_dim=...)`, two optimizers
    set in its own `compile`."""
    _, reference = _train_dcgan("float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gan, history = _train_dcgan("mixed_float16")
    _no_scale_loss_warning(record)
    # The generator's loss goes through generator and discriminator: 9 + 7 layers.
    for key in ("d_loss", "g_loss"):
        assert_within_band(history[key], reference[key], 3 * 16, f"DCGAN {key}")
    _assert_reported(history, gan.d_optimizer, "d_optimizer_")
    _assert_reported(history, gan.g_optimizer, "g_optimizer_")


def test_dcgan_example_without_the_lines_warns_naming_each():
    with pytest.warns(UserWarning) as record:
        gan, history = _train_dcgan("mixed_float16", line=False)
    messages = " ".join(str(w.message) for w in record)
    assert "scaled_loss = self.d_optimizer.scale_loss(loss)" in messages
    assert "scaled_loss = self.g_optimizer.scale_loss(loss)" in messages
    assert all(np.isfinite(history["d_loss"] + history["g_loss"]))


# --- examples/generative/wgan_gp.py -------------------------------------------


def _wgan_models():
    img_input = keras.layers.Input(shape=(8, 8, 1))
    x = keras.layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same")(img_input)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same")(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(1)(x)
    d_model = keras.models.Model(img_input, x, name="discriminator")

    noise = keras.layers.Input(shape=(LATENT,))
    x = keras.layers.Dense(2 * 2 * 8, use_bias=False)(noise)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Reshape((2, 2, 8))(x)
    x = keras.layers.UpSampling2D((2, 2))(x)
    x = keras.layers.Conv2D(4, (3, 3), padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.UpSampling2D((2, 2))(x)
    x = keras.layers.Conv2D(1, (3, 3), padding="same", use_bias=False)(x)
    x = keras.layers.Activation("tanh")(x)
    g_model = keras.models.Model(noise, x, name="generator")
    return d_model, g_model


def _wgan_class(line):
    class WGAN(kmp.Model):                                    # kmp: was keras.Model
        def __init__(self, discriminator, generator, latent_dim,
                     discriminator_extra_steps=3, gp_weight=10.0):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_steps = discriminator_extra_steps
            self.gp_weight = gp_weight
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.d_loss_fn = d_loss_fn
            self.g_loss_fn = g_loss_fn

        def gradient_penalty(self, batch_size, real_images, fake_images):
            alpha = keras.random.normal([batch_size, 1, 1, 1], 0.0, 1.0, seed=self.seed_generator)
            diff = fake_images - real_images
            interpolated = real_images + alpha * diff
            with tf.GradientTape() as gp_tape:
                gp_tape.watch(interpolated)
                pred = self.discriminator(interpolated, training=True)
            grads = gp_tape.gradient(pred, [interpolated])[0]
            norm = ops.sqrt(ops.sum(ops.square(grads), axis=[1, 2, 3]))
            return ops.mean((norm - 1.0) ** 2)

        def train_step(self, real_images):
            if isinstance(real_images, tuple):
                real_images = real_images[0]
            batch_size = ops.shape(real_images)[0]
            for _ in range(self.d_steps):
                random_latent_vectors = keras.random.normal(
                    shape=(batch_size, self.latent_dim), seed=self.seed_generator
                )
                with tf.GradientTape() as tape:
                    fake_images = self.generator(random_latent_vectors, training=True)
                    fake_logits = self.discriminator(fake_images, training=True)
                    real_logits = self.discriminator(real_images, training=True)
                    d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                    gp = self.gradient_penalty(batch_size, real_images, fake_images)
                    d_loss = d_cost + gp * self.gp_weight
                    scaled_d = self.d_optimizer.scale_loss(d_loss) if line else d_loss   # kmp
                d_gradient = tape.gradient(scaled_d, self.discriminator.trainable_variables)
                self.d_optimizer.apply_gradients(
                    zip(d_gradient, self.discriminator.trainable_variables)
                )
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator
            )
            with tf.GradientTape() as tape:
                generated_images = self.generator(random_latent_vectors, training=True)
                gen_img_logits = self.discriminator(generated_images, training=True)
                g_loss = self.g_loss_fn(gen_img_logits)
                scaled_g = self.g_optimizer.scale_loss(g_loss) if line else g_loss       # kmp
            gen_gradient = tape.gradient(scaled_g, self.generator.trainable_variables)
            self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
            return {"d_loss": d_loss, "g_loss": g_loss}

    return WGAN


def discriminator_loss(real_img, fake_img):
    return ops.mean(fake_img) - ops.mean(real_img)


def generator_loss(fake_img):
    return -ops.mean(fake_img)


def _train_wgan(policy, line=True):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    d_model, g_model = _wgan_models()
    wgan = _wgan_class(line)(
        discriminator=d_model, generator=g_model, latent_dim=LATENT, discriminator_extra_steps=2
    )
    wgan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
        g_loss_fn=generator_loss,
        d_loss_fn=discriminator_loss,
    )
    history = wgan.fit(_images(-1.0, 1.0), batch_size=STEPS * BATCH, epochs=STEPS, verbose=0).history
    return wgan, history


def test_wgan_gp_example_with_a_line_per_loss_tracks_float32_and_reports_both_scalers():
    """examples/generative/wgan_gp.py (keras-io): a gradient penalty taken
    with a second tape inside the discriminator's, two optimizers."""
    _, reference = _train_wgan("float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        wgan, history = _train_wgan("mixed_float16")
    _no_scale_loss_warning(record)
    # The penalty differentiates the discriminator once more: its 4 layers
    # twice, after the generator's 11.
    for key in ("d_loss", "g_loss"):
        assert_within_band(history[key], reference[key], 3 * 19, f"WGAN-GP {key}")
    _assert_reported(history, wgan.d_optimizer, "d_optimizer_")
    _assert_reported(history, wgan.g_optimizer, "g_optimizer_")


def test_wgan_gp_example_without_the_lines_warns_naming_each():
    with pytest.warns(UserWarning) as record:
        wgan, history = _train_wgan("mixed_float16", line=False)
    messages = " ".join(str(w.message) for w in record)
    assert "scaled_loss = self.d_optimizer.scale_loss(loss)" in messages
    assert "scaled_loss = self.g_optimizer.scale_loss(loss)" in messages
    assert all(np.isfinite(history["d_loss"] + history["g_loss"]))


# --- guides/custom_train_step_in_tensorflow.py --------------------------------


def _custom_model_class(line):
    class CustomModel(kmp.Model):                             # kmp: was keras.Model
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                scaled_loss = self.optimizer.scale_loss(loss) if line else loss    # kmp
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(scaled_loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return CustomModel


def _lower_level_model_class(line):
    class CustomModel(kmp.Model):                             # kmp: was keras.Model
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
                scaled_loss = self.optimizer.scale_loss(loss) if line else loss    # kmp
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(scaled_loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    return CustomModel


def _regression_data():
    rng = np.random.default_rng(0)
    return (rng.random((STEPS * BATCH, 32)).astype("float32"),
            rng.random((STEPS * BATCH, 1)).astype("float32"))


def _train_custom_model(policy, make_class, line=True, **compile_kwargs):
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = make_class(line)(inputs, outputs)
    model.compile(optimizer="adam", **compile_kwargs)
    x, y = _regression_data()
    history = model.fit(x, y, batch_size=STEPS * BATCH, epochs=STEPS, verbose=0).history
    return model, history


@pytest.mark.parametrize("make_class, compile_kwargs", [
    (_custom_model_class, {"loss": "mse", "metrics": ["mae"]}),
    (_lower_level_model_class, {}),
], ids=["compute_loss", "own_metrics"])
def test_custom_train_step_guide_with_the_line_tracks_float32(make_class, compile_kwargs):
    """guides/custom_train_step_in_tensorflow.py (keras-io): "A first simple
    example" (`compute_loss`, compiled loss and metrics) and "Going
    lower-level" (`__init__(self, *args, **kwargs)`, own metrics)."""
    _, reference = _train_custom_model("float32", make_class, **compile_kwargs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, history = _train_custom_model("mixed_float16", make_class, **compile_kwargs)
    _no_scale_loss_warning(record)
    # One Dense layer, and the squared error of its output.
    for key in ("loss", "mae"):
        assert_within_band(history[key], reference[key], 3 * 2, f"CustomModel {key}")
    _assert_reported(history, model.optimizer)


@pytest.mark.parametrize("make_class, compile_kwargs", [
    (_custom_model_class, {"loss": "mse", "metrics": ["mae"]}),
    (_lower_level_model_class, {}),
], ids=["compute_loss", "own_metrics"])
def test_custom_train_step_guide_without_the_line_warns_naming_it(make_class, compile_kwargs):
    with pytest.warns(UserWarning, match=r"scaled_loss = self\.optimizer\.scale_loss\(loss\)"):
        model, history = _train_custom_model(
            "mixed_float16", make_class, line=False, **compile_kwargs
        )
    assert all(np.isfinite(history["loss"]))
    _assert_reported(history, model.optimizer)


# --- guides/writing_a_training_loop_from_scratch.py ---------------------------


def _train_from_scratch(policy, line=True):
    """The guide's `tf.function` loop; kmp's additions are the optimizer's
    wrapper and the line in the tape (docs/custom-steps.md, "A loop outside
    `fit`"). Returns the optimizer and each step's loss."""
    kmp.set_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(64,), name="digits")
    x1 = keras.layers.Dense(16, activation="relu")(inputs)
    x2 = keras.layers.Dense(16, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    model = kmp.Model(inputs=inputs, outputs=outputs)          # kmp: was keras.Model

    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1e-1))   # kmp
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_acc_metric = keras.metrics.SparseCategoricalAccuracy()

    rng = np.random.default_rng(0)
    x_train = rng.normal(size=(STEPS * BATCH, 64)).astype("float32")
    y_train = rng.integers(0, 10, STEPS * BATCH)
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(BATCH)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
            scaled_loss = optimizer.scale_loss(loss_value) if line else loss_value    # kmp
        grads = tape.gradient(scaled_loss, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        train_acc_metric.update_state(y, logits)
        return loss_value

    losses = []
    for epoch in range(2):
        for step, (x_batch_train, y_batch_train) in enumerate(train_dataset):
            losses.append(float(train_step(x_batch_train, y_batch_train)))
        train_acc_metric.reset_state()
    return optimizer, losses


def test_training_loop_from_scratch_guide_with_the_line_tracks_float32():
    """guides/writing_a_training_loop_from_scratch.py (keras-io): a
    `tf.function` train step, `GradientTape`, `optimizer.apply`."""
    _, reference = _train_from_scratch("float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optimizer, losses = _train_from_scratch("mixed_float16")
    _no_scale_loss_warning(record)
    assert_within_band(losses, reference, 3 * 3, "loop from scratch")
    # Outside fit there is no History: the scaler's own counters are the report.
    assert int(optimizer.iterations) + int(optimizer.skipped_steps) == len(losses)
    assert np.isfinite(float(optimizer.loss_scale))


def test_training_loop_from_scratch_guide_without_the_line_warns_naming_it():
    with pytest.warns(UserWarning, match=r"scaled_loss = optimizer\.scale_loss\(loss\)"):
        optimizer, losses = _train_from_scratch("mixed_float16", line=False)
    assert all(np.isfinite(losses))
