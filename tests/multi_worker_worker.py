"""One worker of the two-worker test in `test_distribute.py` (not a test file).

Run as `python multi_worker_worker.py RESULT_PATH` with `TF_CONFIG` set; it
trains `build_model()` on `dataset()` under MultiWorkerMirroredStrategy and
writes the weights, the loss scaler's state, the logs, and which of the
global steps had a non-finite value in this worker's own shard to
`RESULT_PATH` (an `.npz` file). The test imports `build_model`, `dataset` and
`fit` from here for its single-worker reference run. Each worker also
tries Keras' own `fit` with a plain `keras.Model` and records its error.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"

GLOBAL_BATCH = 16
STEPS = 6
# Global step 2 (0-based: 1) holds a huge sample. The dataset is sharded by
# data across the two workers, each taking half of every global batch, so
# this row lands on worker 1 only: an overflow on one worker's shard.
POISONED_ROW = GLOBAL_BATCH * 1 + GLOBAL_BATCH // 2 + 3
INITIAL_SCALE = 2.0**10
GROWTH_INTERVAL = 2


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
    # Finite in float32 and in the loss, but the scaled gradient overflows.
    x[POISONED_ROW] = 3e4
    return x, y


def dataset():
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return (
        tf.data.Dataset.from_tensor_slices(data())
        .batch(GLOBAL_BATCH)
        .with_options(options)
    )


def build_model():
    import keras

    import kmp

    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = kmp.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(
        kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            initial_scale=INITIAL_SCALE,
            growth_interval=GROWTH_INTERVAL,
        ),
        "mse",
        steps_per_execution=4,
        # Workers synchronize through merge_call, where no batch is redone;
        # the one-worker reference drops its overflowing batches alike.
        overflow_retries=0,
    )
    return model


def fit(model):
    history = model.fit(dataset(), epochs=1, verbose=0)
    return {
        "weights": model.get_weights(),
        "loss_scale": float(model.optimizer.loss_scale),
        "skipped_steps": int(model.optimizer.skipped_steps),
        "iterations": int(model.optimizer.iterations.numpy()),
        "log_loss": history.history["loss"][-1],
        "log_loss_scale": history.history["loss_scale"][-1],
        "log_skipped_steps": history.history["skipped_steps"][-1],
    }


def keras_fit_error(strategy):
    """Returns the error Keras' own `fit` raises here (`""` if it trains)."""
    import keras

    with strategy.scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse")
    try:
        model.fit(dataset(), epochs=1, verbose=0)
    except Exception as error:  # noqa: BLE001 - any failure is the finding
        return f"{type(error).__name__}: {error}"[:300]
    return ""


def main(result_path):
    import tensorflow as tf

    # Before anything else initializes TensorFlow's devices.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import numpy as np

    import kmp

    kmp.set_policy("mixed_float16")
    with strategy.scope():
        model = build_model()
    local_poisoned_steps = [
        step
        for step, (x, _) in enumerate(strategy.experimental_distribute_dataset(dataset()))
        if not np.all(np.abs(strategy.experimental_local_results(x)[0].numpy()) < 1e4)
    ]
    results = fit(model)
    weights = results.pop("weights")
    results["keras_error"] = keras_fit_error(strategy)
    np.savez(
        result_path,
        *weights,
        local_poisoned_steps=np.array(local_poisoned_steps, "int64"),
        **results,
    )


if __name__ == "__main__":
    main(sys.argv[1])
