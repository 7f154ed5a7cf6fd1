"""A DCGAN-shaped model with its own train_step and two optimizers, in mixed precision.

    python examples/gan.py                             # mixed_float16
    python examples/gan.py --policy float32 --epochs 2

keras.io's "DCGAN to generate face images", shrunk to scikit-learn's bundled
8x8 digits (no download). The model subclasses `kmp.Model` instead of
`keras.Model`; its `compile(d_optimizer, g_optimizer, loss_fn)` and
`train_step` are the example's own, plus one line per loss:
`scaled = self.d_optimizer.scale_loss(loss)` inside each GradientTape,
whose gradients are taken. kmp
wraps both optimizers in `kmp.LossScaleOptimizer` before the first step,
skips a step whose gradients are not finite, and logs each optimizer's loss
scale and skipped steps (`d_optimizer_loss_scale`, ...). It prints the
losses of the last epoch and each optimizer's scale and skips.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kmp  # noqa: E402

LATENT_DIM = 16


def discriminator():
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, strides=2, padding="same"),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Conv2D(32, 3, strides=2, padding="same"),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )


def generator():
    return keras.Sequential(
        [
            keras.Input((LATENT_DIM,)),
            keras.layers.Dense(2 * 2 * 32),
            keras.layers.Reshape((2, 2, 32)),
            keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same"),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


class GAN(kmp.Model):
    def __init__(self, latent_dim):
        super().__init__()
        self.discriminator = discriminator()
        self.generator = generator()
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

    def call(self, latent):
        return self.generator(latent)

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        generated = ops.cast(self.generator(latent), "float32")
        combined = ops.concatenate([generated, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
            scaled = self.d_optimizer.scale_loss(d_loss)  # kmp's one line
        grads = tape.gradient(scaled, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(latent))
            g_loss = self.loss_fn(misleading_labels, predictions)
            scaled = self.g_optimizer.scale_loss(g_loss)  # kmp's one line
        grads = tape.gradient(scaled, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    kmp.set_policy(args.policy)
    keras.utils.set_random_seed(0)
    images = (load_digits().images / 16.0).astype("float32")[..., None]
    dataset = tf.data.Dataset.from_tensor_slices(images).shuffle(2048, seed=0).batch(
        args.batch_size, drop_remainder=True
    )
    gan = GAN(LATENT_DIM)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(1e-3),
        g_optimizer=keras.optimizers.Adam(1e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    history = gan.fit(dataset, epochs=args.epochs, shuffle=False, verbose=0).history
    print(f"policy {kmp.get_policy().name}: d_loss {history['d_loss'][-1]:.4f}, "
          f"g_loss {history['g_loss'][-1]:.4f}")
    for name in ("d_optimizer", "g_optimizer"):
        optimizer = getattr(gan, name)
        if isinstance(optimizer, kmp.LossScaleOptimizer):
            print(f"{name}: {type(optimizer).__module__}.{type(optimizer).__name__}, "
                  f"loss scale {float(optimizer.loss_scale):g}, "
                  f"skipped steps {int(optimizer.skipped_steps)} of "
                  f"{int(optimizer.iterations) + int(optimizer.skipped_steps)}")
        else:
            print(f"{name}: {type(optimizer).__name__} (no loss scaling under this policy)")
    samples = np.asarray(gan.generator(keras.random.normal((4, LATENT_DIM), seed=1)), "float32")
    print(f"generated images: shape {samples.shape}, dtype {samples.dtype}, "
          f"finite {bool(np.all(np.isfinite(samples)))}")
    return history


if __name__ == "__main__":
    main()
