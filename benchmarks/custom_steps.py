"""Custom training under mixed_float16: a GAN, a VAE and a GradientTape loop.

    python -m benchmarks.custom_steps            # the figures in the README and the note
    python -m benchmarks.custom_steps --smoke    # a few steps each, for the test suite

Each workload is the shape of a keras.io example, on scikit-learn's bundled
digits (no download), trained from the same initial weights four ways:

- `float32`: the code as written, no loss scaling;
- `Keras recipe`: Keras' mixed_float16 with each optimizer wrapped in
  `keras.optimizers.LossScaleOptimizer` and `scale_loss` on every loss;
- `Keras recipe, line forgotten`: the same without `scale_loss` (Keras'
  scaler divides the gradients by the scale all the same);
- `kmp, one line per loss`: `kmp.set_policy("mixed_float16")`, the model
  subclasses `kmp.Model` and is handed plain optimizers (kmp wraps them; a
  loop wraps its own in `kmp.LossScaleOptimizer`), `scale_loss` on every
  loss;
- `kmp, code unchanged`: the same without `scale_loss` (in kmp.Model's
  train step kmp applies the gradients unscaled and warns once per
  optimizer; in a loop outside `fit` it divides them as Keras does, and
  warns once).

Workloads:
- GAN: `examples/gan.py`'s DCGAN shape (its discriminator and generator, its
  own `compile(d_optimizer, g_optimizer, loss_fn)` and `train_step`), Adam
  1e-3 each, batch 64, one epoch (28 steps).
- VAE: keras.io's VAE (conv encoder, sampling, conv decoder; its own
  `train_step` on `self.optimizer`; reconstruction loss summed over 28x28
  pixels, ~500, plus KL), Adam 1e-3, batch 32, 32 steps.
- loop: a GradientTape loop outside `fit` (Reptile's shape) on an MLP
  classifier, SGD 0.1, batch 32, 41 steps.

For each it prints the last step's losses, the skipped steps per optimizer
and the final loss scale; `--json PATH` writes the same.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kmp  # noqa: E402

_EXAMPLE_GAN = pathlib.Path(__file__).parents[1] / "examples" / "gan.py"
VARIANTS = ("float32", "Keras recipe", "Keras recipe, line forgotten", "kmp, one line per loss",
            "kmp, code unchanged")


def _example_gan_module():
    spec = importlib.util.spec_from_file_location("example_gan", _EXAMPLE_GAN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup(variant, loop=False):
    """Sets the policy for `variant`; returns (model base class, whether to
    call `scale_loss`, what wraps each optimizer). A `kmp.Model` is handed
    plain optimizers and wraps them itself; a loop outside `fit` wraps its
    optimizer in `kmp.LossScaleOptimizer` by hand."""
    keras.utils.set_random_seed(0)
    if variant == "float32":
        kmp.set_policy("float32")
        return keras.Model, False, lambda optimizer: optimizer
    kmp.set_policy("mixed_float16")
    if variant.startswith("Keras recipe"):
        return keras.Model, variant == "Keras recipe", keras.optimizers.LossScaleOptimizer
    wrap = kmp.LossScaleOptimizer if loop else (lambda optimizer: optimizer)
    return kmp.Model, variant == "kmp, one line per loss", wrap


def _scaler_state(optimizer, steps):
    """(skipped steps, final loss scale) of `optimizer` after `steps` steps
    that each applied it once, or (None, None) where nothing scales."""
    if isinstance(optimizer, kmp.LossScaleOptimizer):
        return int(optimizer.skipped_steps), float(optimizer.loss_scale)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Keras counts no skips; its `iterations` counts applied steps only.
        return steps - int(optimizer.iterations), float(optimizer.dynamic_scale)
    return None, None


def gan(variant, steps):
    """keras.io's DCGAN shape; returns its losses and each optimizer's skips."""
    example = _example_gan_module()
    base, scaled, wrap = _setup(variant)

    class GAN(base):
        def __init__(self):
            super().__init__()
            self.discriminator = example.discriminator()
            self.generator = example.generator()
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

        def call(self, latent):
            return self.generator(latent)

        def _update(self, model, optimizer, loss_of):
            with tf.GradientTape() as tape:
                loss = loss_of()
                target = optimizer.scale_loss(loss) if scaled else loss
            grads = tape.gradient(target, model.trainable_weights)
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
            return loss

        def train_step(self, real):
            batch_size = ops.shape(real)[0]
            latent = keras.random.normal((batch_size, example.LATENT_DIM), seed=self.seed_generator)
            combined = ops.concatenate([ops.cast(self.generator(latent), "float32"), real], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], 0)
            d_loss = self._update(self.discriminator, self.d_optimizer,
                                  lambda: self.loss_fn(labels, self.discriminator(combined)))
            latent = keras.random.normal((batch_size, example.LATENT_DIM), seed=self.seed_generator)
            g_loss = self._update(
                self.generator, self.g_optimizer,
                lambda: self.loss_fn(ops.zeros((batch_size, 1)),
                                     self.discriminator(self.generator(latent))),
            )
            return {"d_loss": d_loss, "g_loss": g_loss}

    images = (load_digits().images / 16.0).astype("float32")[..., None][: 64 * steps]
    model = GAN()
    model.compile(wrap(keras.optimizers.Adam(1e-3)), wrap(keras.optimizers.Adam(1e-3)),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    history = model.fit(images, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    return {"losses": {"d_loss": history["d_loss"][-1], "g_loss": history["g_loss"][-1]},
            "scalers": {name: _scaler_state(getattr(model, name), steps)
                        for name in ("d_optimizer", "g_optimizer")}}


def _digits_28():
    images = (load_digits().images / 16.0).astype("float32")
    big = np.kron(images, np.ones((3, 3), "float32"))  # 24x24
    return np.pad(big, ((0, 0), (2, 2), (2, 2)))[..., None]


def vae(variant, steps, latent_dim=2):
    """keras.io's VAE shape; returns its last loss and the optimizer's skips."""
    base, scaled, wrap = _setup(variant)
    layers = keras.layers
    encoder_inputs = keras.Input((28, 28, 1))
    x = layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(encoder_inputs)
    x = layers.Conv2D(64, 3, strides=2, padding="same", activation="relu")(x)
    x = layers.Dense(16, activation="relu")(layers.Flatten()(x))
    encoder = keras.Model(encoder_inputs, [layers.Dense(latent_dim)(x), layers.Dense(latent_dim)(x)])
    decoder = keras.Sequential([
        keras.Input((latent_dim,)),
        layers.Dense(7 * 7 * 64, activation="relu"),
        layers.Reshape((7, 7, 64)),
        layers.Conv2DTranspose(64, 3, strides=2, padding="same", activation="relu"),
        layers.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu"),
        layers.Conv2DTranspose(1, 3, padding="same", activation="sigmoid"),
    ])

    class VAE(base):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = encoder, decoder
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, x):
            return self.decoder(self.encoder(x)[0])

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var = (ops.cast(t, "float32") for t in self.encoder(data))
                epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
                reconstruction = ops.cast(
                    self.decoder(z_mean + ops.exp(0.5 * z_log_var) * epsilon), "float32")
                reconstruction_loss = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
                kl_loss = -0.5 * ops.mean(ops.sum(
                    1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var), axis=1))
                loss = reconstruction_loss + kl_loss
                target = self.optimizer.scale_loss(loss) if scaled else loss
            grads = tape.gradient(target, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            return {"total_loss": loss}

    model = VAE()
    model.compile(wrap(keras.optimizers.Adam(1e-3)))
    history = model.fit(_digits_28()[: 32 * steps], batch_size=32, epochs=1, shuffle=False,
                        verbose=0).history
    return {"losses": {"total_loss": history["total_loss"][-1]},
            "scalers": {"optimizer": _scaler_state(model.optimizer, steps)}}


def loop(variant, steps):
    """A GradientTape loop outside fit; returns its last loss and the skips."""
    _, scaled, wrap = _setup(variant, loop=True)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10), keras.layers.Activation("linear", dtype="float32"),
    ])
    optimizer = wrap(keras.optimizers.SGD(0.1))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            target = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(target, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    for i in range(steps):
        loss = step(x[32 * i: 32 * (i + 1)], y[32 * i: 32 * (i + 1)])
    return {"losses": {"loss": float(loss)}, "scalers": {"optimizer": _scaler_state(optimizer, steps)}}


WORKLOADS = {"GAN": (gan, 28), "VAE": (vae, 32), "loop": (loop, 41)}


def measure(workload, variant, steps=None):
    """Trains `workload` ("GAN", "VAE" or "loop") the `variant` way for
    `steps` steps (default: the workload's own); returns its losses, its
    scalers' `(skipped steps, scale)` and how many of kmp's unscaled-loss
    warnings it raised. Leaves the float32 policy set."""
    train, default_steps = WORKLOADS[workload]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train(variant, steps or default_steps)
    finally:
        kmp.set_policy("float32")
    result["unscaled_warnings"] = sum("was not scaled" in str(w.message) for w in caught)
    return result


def run(smoke=False):
    """Every workload under every variant; returns {workload: {variant: result}}."""
    return {
        workload: {variant: measure(workload, variant, 3 if smoke else None)
                   for variant in VARIANTS}
        for workload in WORKLOADS
    }


def format_table(results):
    lines = ["| workload | variant | last losses | skipped steps, final scale |", "|---|---|---|---|"]
    for name, variants in results.items():
        for variant, result in variants.items():
            losses = ", ".join(f"{k} {v:.4f}" for k, v in result["losses"].items())
            scalers = ", ".join(
                f"{k}: —" if skipped is None else f"{k}: {skipped} skipped, scale {scale:g}"
                for k, (skipped, scale) in result["scalers"].items()
            )
            lines.append(f"| {name} | {variant} | {losses} | {scalers} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="3 steps per run")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = run(smoke=args.smoke)
    print(format_table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
