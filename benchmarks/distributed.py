"""MirroredStrategy steps/s: kmp's loss scaling against Keras' own.

Usage (from the repository root):

    python -m benchmarks.distributed            # ~1-2 minutes on 2 CPU cores
    python -m benchmarks.distributed --smoke    # a few seconds, checks it runs
    python -m benchmarks.distributed --json out.json

Two replicas on two logical CPU devices of this machine (the set-up the tests
use), mixed_float16, the same MLP and data for both:

- `keras`: a plain `keras.Model`, compiled with Keras' defaults, so Keras
  wraps the optimizer in its own `keras.optimizers.LossScaleOptimizer`;
- `kmp`: a `kmp.Model` (`kmp.LossScaleOptimizer`, one all-reduce of the
  gradients that also carries the skip decision's input).

Each configuration is built and warmed up; then the timed repeats are
interleaved (keras, kmp, keras, kmp, ...) so that drift in machine speed hits
both alike, each repeat `--steps` calls of the model's own `train_function` on
a repeated in-memory batch. It prints the median steps/s of each and the
median over repeats of the paired ratio kmp / keras (> 1: kmp is faster).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# Before TensorFlow initializes its devices: two replicas on one CPU.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmp  # noqa: E402
from benchmarks import harness  # noqa: E402


def _build(api, strategy, width, depth):
    keras.utils.set_random_seed(0)
    model_class = kmp.Model if api == "kmp" else keras.Model
    with strategy.scope():
        if api == "kmp":
            kmp.set_policy("mixed_float16")
        else:
            kmp.set_policy("float32")
            keras.config.set_dtype_policy("mixed_float16")
        inputs = keras.Input((width,))
        hidden = inputs
        for _ in range(depth):
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
        outputs = keras.layers.Dense(10)(hidden)
        if api == "keras":
            outputs = keras.layers.Activation("linear", dtype="float32")(outputs)
        model = model_class(inputs, outputs)
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    kmp.set_policy("float32")
    keras.config.set_dtype_policy("float32")
    return model


def _check_scaler(api, model):
    expected = (
        kmp.LossScaleOptimizer if api == "kmp" else keras.optimizers.LossScaleOptimizer
    )
    if type(model.optimizer) is not expected:
        raise RuntimeError(
            f"The {api} model trains with {type(model.optimizer).__name__}, not "
            f"{expected.__name__}: the comparison would be meaningless."
        )


def run(steps=20, repeats=15, batch_size=256, width=256, depth=3, warmup=5):
    """Times both configurations; returns a dict of results.

    Args:
        steps: Int. `train_function` calls per timed repeat.
        repeats: Int. Timed repeats per configuration (median kept).
        batch_size: Int. Global batch size (split over the two replicas).
        width: Int. Units of each hidden layer and input features.
        depth: Int. Hidden layers.
        warmup: Int. Untimed calls after tracing.

    Returns:
        Dict: median `steps_per_s` per configuration, `ratio` (the median
        over repeats of kmp / keras, each repeat's two runs back to back),
        every sample, and the settings.
    """
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, width)).astype("float32")
    y = rng.integers(0, 10, size=(batch_size,)).astype("int32")
    dataset = harness.repeated_batch(x, y)

    runs = {}
    for api in ("keras", "kmp"):
        model = _build(api, strategy, width, depth)
        model.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0)
        _check_scaler(api, model)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        for _ in range(warmup):
            model.train_function(iterator)
        runs[api] = (model, iterator)

    samples = {api: [] for api in runs}
    order = list(runs)
    for _ in range(repeats):
        order.reverse()  # neither always runs first
        for api in order:
            model, iterator = runs[api]
            start = time.perf_counter()
            for _ in range(steps):
                logs = model.train_function(iterator)
            float(logs["loss"])  # waits for the last step
            samples[api].append(steps / (time.perf_counter() - start))

    steps_per_s = {api: statistics.median(values) for api, values in samples.items()}
    return {
        "steps_per_s": steps_per_s,
        # Paired: each repeat's two runs are back to back, so the load of a
        # shared machine mostly cancels in their ratio.
        "ratio": statistics.median(
            kmp_value / keras_value
            for kmp_value, keras_value in zip(samples["kmp"], samples["keras"])
        ),
        "samples": samples,
        "settings": {
            "replicas": strategy.num_replicas_in_sync,
            "batch_size": batch_size,
            "width": width,
            "depth": depth,
            "steps": steps,
            "repeats": repeats,
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
        },
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, few steps: checks that it runs")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        results = run(steps=2, repeats=2, batch_size=16, width=8, depth=1, warmup=1)
    else:
        results = run()
    for api, value in results["steps_per_s"].items():
        print(f"{api:>5} mixed_float16, MirroredStrategy x2: {value:8.1f} steps/s")
    print(f"kmp / keras: {results['ratio']:.3f} (median of paired repeats)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
