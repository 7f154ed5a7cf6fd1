"""Batches lost while the loss scale settles: Keras' own scaler against kmp.

    python -m benchmarks.first_steps            # the table in docs/benchmarks.md
    python -m benchmarks.first_steps --smoke    # seconds, for the test suite

Every dynamic scaler starts at 2**15 and, unless it redoes them, drops each
batch whose gradients overflow until the scale is low enough. Four short runs
under mixed_float16, each once with Keras' mixed precision (a plain
`keras.Model` under Keras' `mixed_float16` policy, Keras' `LossScaleOptimizer`,
which `compile` adds by itself) and once with kmp at its defaults:

- `quickstart`: the quickstart's digits convnet, `compile` + `fit`, Adam 3e-3,
  batch 32, its first 50 steps;
- `vae`: keras.io's VAE as a functional model (a reconstruction loss of ~500
  summed over 28x28 pixels, the KL term through `add_loss`), Adam 1e-3,
  batch 32, 50 steps;
- `reptile`: keras.io's Reptile inner loop written as a plain eager
  `GradientTape` loop (4 meta-iterations of 4 SGD(0.01) steps, a 4-block
  strided convnet with batch normalization, random 28x28 images, 5 classes,
  batches of 25), with `scale_loss` in the tape; kmp's model comes from
  `kmp.convert` of a float32 model, Keras' is built under its policy;
- `finetune`: the quickstart trained 40 steps, then compiled again with
  Adam 1e-4 for a fine-tune of 8 steps; the fine-tune's lost batches count.

A batch is lost when its gradients were not finite and it was not redone.
"""

import argparse
import json
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402
from benchmarks import retries  # noqa: E402

SCALERS = ("keras", "kmp")
WORKLOADS = ("quickstart", "vae", "reptile", "finetune")


def _under(scaler, build):
    """`build()` under mixed_float16 as `scaler` sets it: a plain Keras model
    under Keras' policy, or kmp's model as kmp builds it."""
    if scaler == "keras":
        keras.config.set_dtype_policy("mixed_float16")
        try:
            model = build()
            # The same graph as a plain keras.Model (Keras' own training),
            # made under the policy: Keras' compile adds its scaler to a
            # model whose policy is mixed_float16.
            return keras.Model(model.inputs, model.outputs, name=model.name)
        finally:
            keras.config.set_dtype_policy("float32")
    kmp.set_policy("mixed_float16")
    try:
        return build()
    finally:
        kmp.set_policy("float32")


def _fit_lost(scaler, model, loss, optimizer, x, y):
    """Batches lost in one epoch of `fit`, and the final scale."""
    model.compile(optimizer, loss)
    steps = -(-len(x) // 32)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return _lost_and_scale(scaler, model.optimizer, steps)


def _lost_and_scale(scaler, optimizer, steps):
    if scaler == "keras":
        # Keras' scaler counts no skips; its inner optimizer counts applied steps.
        return steps - int(optimizer.iterations), float(optimizer.dynamic_scale)
    return int(optimizer.skipped_steps), float(optimizer.loss_scale)


def quickstart(scaler, steps):
    images, labels = retries._digits()
    keras.utils.set_random_seed(0)
    model = _under(scaler, retries._quickstart_model)
    return _fit_lost(scaler, model, "sparse_categorical_crossentropy",
                     keras.optimizers.Adam(3e-3), images[: 32 * steps], labels[: 32 * steps])


def vae(scaler, steps):
    x = retries._digits_28()[: 32 * steps]
    keras.utils.set_random_seed(0)
    model = _under(scaler, retries._vae_model)
    return _fit_lost(scaler, model, retries._reconstruction_loss, keras.optimizers.Adam(1e-3), x, x)


def finetune(scaler, steps, pretrain_steps=40):
    images, labels = retries._digits()
    keras.utils.set_random_seed(0)
    model = _under(scaler, retries._quickstart_model)
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy")
    model.fit(images[: 32 * pretrain_steps], labels[: 32 * pretrain_steps], batch_size=32,
              shuffle=False, verbose=0)
    tune = slice(32 * pretrain_steps, 32 * (pretrain_steps + steps))
    return _fit_lost(scaler, model, "sparse_categorical_crossentropy",
                     keras.optimizers.Adam(1e-4), images[tune], labels[tune])


def _reptile_convnet(classes=5):
    inputs = keras.Input((28, 28, 1))
    x = inputs
    for _ in range(4):
        x = keras.layers.Conv2D(64, 3, strides=2, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="reptile")


def reptile(scaler, steps, inner_steps=4, meta_step_size=0.25):
    """keras.io's Reptile loop; `steps` inner steps in all."""
    keras.utils.set_random_seed(0)
    if scaler == "keras":
        model = _under("keras", _reptile_convnet)
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    else:
        model = kmp.convert(_reptile_convnet(), "mixed_float16")
        optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    rng = np.random.default_rng(0)
    images = rng.random((100, 28, 28, 1)).astype("float32")
    labels = rng.integers(0, 5, 100)
    lost = 0
    for _ in range(steps // inner_steps):
        before = model.get_weights()
        for _ in range(inner_steps):
            batch = rng.choice(100, 25, replace=False)
            with tf.GradientTape() as tape:
                predictions = model(images[batch])
                loss = keras.losses.sparse_categorical_crossentropy(labels[batch], predictions)
                scaled_loss = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled_loss, model.trainable_weights)
            # Both scalers skip exactly the steps with a non-finite gradient.
            lost += not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
        after = model.get_weights()
        model.set_weights([b + (a - b) * meta_step_size for b, a in zip(before, after)])
    scale = optimizer.dynamic_scale if scaler == "keras" else optimizer.loss_scale
    return lost, float(scale)


def measure(scaler, workload, steps):
    """`{"steps", "lost", "final_loss_scale"}` of one workload under one scaler."""
    lost, scale = globals()[workload](scaler, steps)
    return {"steps": steps, "lost": lost, "final_loss_scale": scale}


def format_table(results):
    lines = ["| workload | steps | lost, Keras' scaler | lost, kmp | final scale, Keras / kmp |",
             "|---|---:|---:|---:|---|"]
    for workload, runs in results.items():
        k, m = runs["keras"], runs["kmp"]
        lines.append(f"| {workload} | {k['steps']} | {k['lost']} | {m['lost']} | "
                     f"{k['final_loss_scale']:g} / {m['final_loss_scale']:g} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps of each")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    steps = ({"quickstart": 3, "vae": 2, "reptile": 4, "finetune": 2} if args.smoke
             else {"quickstart": 50, "vae": 50, "reptile": 16, "finetune": 8})
    results = {w: {s: measure(s, w, steps[w]) for s in SCALERS} for w in WORKLOADS}
    print(format_table(results))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
