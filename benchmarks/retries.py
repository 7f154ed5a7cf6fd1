"""What `compile(overflow_retries=N)` saves, and what it costs when nothing overflows.

    python -m benchmarks.retries                 # the figures in the README
    python -m benchmarks.retries --smoke         # the convnet alone, a few steps: for the test suite

Batches lost: the quickstart's digits convnet (Adam 3e-3, batch 32, its first
epoch of 41 steps) and a VAE-shaped model (keras.io's VAE as a functional
model: reconstruction loss summed over 28x28 pixels, ~500, plus the KL term
through `add_loss`; Adam 1e-3, batch 32, 32 steps), each under mixed_float16
from the default scale 2**15, with overflow_retries 0 and 3.

Cost: the same convnet from a scale that never overflows (2**8), the train
step with overflow_retries=0 against 3, in alternating rounds of the same
steps in one process; the ratio is the median over rounds of (time with
retries / time without).
"""

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import kmp  # noqa: E402

_QUICKSTART = pathlib.Path(__file__).parents[1] / "examples" / "quickstart.py"


def _quickstart_model():
    spec = importlib.util.spec_from_file_location("quickstart", _QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model()


def _digits():
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    return images, digits.target


class _KLDivergence(keras.layers.Layer):
    """Samples z and adds the KL term as a layer loss (in float32)."""

    def call(self, inputs):
        z_mean, z_log_var = (keras.ops.cast(t, "float32") for t in inputs)
        kl = -0.5 * keras.ops.mean(
            keras.ops.sum(1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var), axis=1)
        )
        self.add_loss(kl)
        epsilon = keras.random.normal(keras.ops.shape(z_mean), seed=1)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


def _vae_model(latent_dim=2):
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    z_mean = keras.layers.Dense(latent_dim)(x)
    z_log_var = keras.layers.Dense(latent_dim)(x)
    z = _KLDivergence()([z_mean, z_log_var])
    x = keras.layers.Dense(7 * 7 * 64, activation="relu")(z)
    x = keras.layers.Reshape((7, 7, 64))(x)
    x = keras.layers.Conv2DTranspose(64, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(x)
    outputs = keras.layers.Conv2DTranspose(1, 3, padding="same", activation="sigmoid")(x)
    return kmp.Model(inputs, outputs, name="vae")


def _reconstruction_loss(y_true, y_pred):
    # keras.io's VAE: binary cross-entropy summed over the 28x28 pixels.
    return 28 * 28 * keras.ops.mean(keras.losses.binary_crossentropy(y_true, y_pred), axis=(1, 2))


def _digits_28():
    images, _ = _digits()
    big = np.kron(images[..., 0], np.ones((3, 3), "float32"))  # 24x24
    return np.pad(big, ((0, 0), (2, 2), (2, 2)))[..., None]


def lost_batches(workload, retries, steps):
    """Skipped and retried steps in the first `steps` steps of `workload`."""
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    if workload == "quickstart":
        images, labels = _digits()
        x, y = images[: 32 * steps], labels[: 32 * steps]
        model = _quickstart_model()
        model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy",
                      overflow_retries=retries)
    else:
        x = _digits_28()[: 32 * steps]
        y = x
        model = _vae_model()
        model.compile(keras.optimizers.Adam(1e-3), _reconstruction_loss, overflow_retries=retries)
    history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
    counters = model.optimizer.counters
    return {
        "steps": steps,
        "skipped": int(counters["skipped_steps"]),
        "retried": int(counters["retries"]),
        "applied": int(model.optimizer.iterations),
        "final_loss_scale": float(model.optimizer.loss_scale),
        "loss": float(history["loss"][-1]),
    }


# No retries, three, and the default (`"auto"`: the first batch settles the
# scale, then one retry per batch).
_VARIANTS = (0, 3, "auto")


def retry_cost(rounds, steps):
    """Median ratio of step time with `overflow_retries=3` to without, no overflow."""
    kmp.set_policy("mixed_float16")
    images, labels = _digits()
    x, y = images[: 32 * steps], labels[: 32 * steps]
    models = {}
    for retries in _VARIANTS:
        keras.utils.set_random_seed(0)
        model = _quickstart_model()
        model.compile(
            kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**8),
            "sparse_categorical_crossentropy", overflow_retries=retries,
        )
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)  # trace
        models[retries] = model
    ratios, auto_ratios, seconds = [], [], {r: [] for r in _VARIANTS}
    for _ in range(rounds):
        times = {}
        for retries in _VARIANTS:
            start = time.perf_counter()
            models[retries].fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
            times[retries] = time.perf_counter() - start
            seconds[retries].append(times[retries])
        ratios.append(times[3] / times[0])
        auto_ratios.append(times["auto"] / times[0])
    overflowed = {r: int(m.optimizer.counters["retries"]) + int(m.optimizer.skipped_steps)
                  for r, m in models.items()}
    return {
        "rounds": rounds,
        "steps_per_round": steps,
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
        # The default, `overflow_retries="auto"`, against none.
        "median_ratio_auto": statistics.median(auto_ratios),
        "ratios_auto": auto_ratios,
        "median_seconds": {str(r): statistics.median(s) for r, s in seconds.items()},
        "overflows": {str(r): n for r, n in overflowed.items()},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny: the convnet alone, a few steps, two rounds")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    # The VAE's float16 convolutions, emulated on a CPU, took most of the
    # smoke run's time: --smoke runs the convnet alone.
    steps = {"quickstart": 4} if args.smoke else {"quickstart": 41, "vae": 32}
    result = {"lost": {}, "cost": None}
    for workload, count in steps.items():
        result["lost"][workload] = {
            str(retries): lost_batches(workload, retries, count) for retries in _VARIANTS
        }
    result["cost"] = retry_cost(rounds=2 if args.smoke else 15, steps=4 if args.smoke else 20)
    for workload, runs in result["lost"].items():
        for retries, run in runs.items():
            print(f"{workload}, overflow_retries={retries}: {run['skipped']} of {run['steps']} "
                  f"batches lost, {run['retried']} retries, final scale {run['final_loss_scale']:g}, "
                  f"loss {run['loss']:.4g}")
    cost = result["cost"]
    print(f"cost with nothing to retry: time(overflow_retries=3) / time(0) = "
          f"{cost['median_ratio']:.3f}, time('auto') / time(0) = "
          f"{cost['median_ratio_auto']:.3f} (medians of {cost['rounds']} rounds of "
          f"{cost['steps_per_round']} steps)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
