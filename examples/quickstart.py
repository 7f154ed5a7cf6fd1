"""Quickstart: a small convnet on scikit-learn's bundled digits, in mixed precision.

    python examples/quickstart.py                      # kmp.set_policy("auto")
    python examples/quickstart.py --policy mixed_float16 --plot loss_scale.png
    KERAS_BACKEND=jax python examples/quickstart.py    # on JAX

Needs scikit-learn (the `examples` extra: `pip install -e ".[tensorflow,examples]"`,
or `".[jax,examples]"` on JAX). Runs on TensorFlow (Keras' default backend)
or JAX; the SavedModel export at the end needs TensorFlow on both, and is
left out, with a line saying so, where TensorFlow is not installed.

Trains with the Keras progress bar (which shows the loss scale when the policy
computes in float16) and kmp's LossScaleMonitor (one line per epoch on skipped
steps and the scale, and a plot with --plot), reports accuracy, skipped steps
and time per epoch,
exports a SavedModel, reloads it and checks its predictions match the trained
model's to within a few roundings of the compute type.
"""

import argparse
import importlib.util
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import kmp  # noqa: E402


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = getattr(self, "seconds", []) + [time.perf_counter() - self._start]


def build_model():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Conv2D(64, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.3)(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    return kmp.Model(inputs, outputs, name="digits_convnet")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy",
        default="auto",
        choices=["auto", "float32", "mixed_float16", "mixed_bfloat16"],
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--export-dir", default=None)
    parser.add_argument(
        "--plot", default=None, help="PNG of the loss scale and loss (needs matplotlib)"
    )
    args = parser.parse_args(argv)

    policy = kmp.set_policy(args.policy)
    print(f"policy: {policy.name} ({policy.reason})")

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    keras.utils.set_random_seed(0)
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    timer = EpochTimer()
    # Prints each epoch's skipped steps (and the loss scale, where it scales).
    monitor = kmp.callbacks.LossScaleMonitor(plot_path=args.plot)
    history = model.fit(
        x_train, y_train, batch_size=32, epochs=args.epochs, verbose=1,
        validation_split=0.1, callbacks=[timer, monitor],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    skipped = history.history.get("skipped_steps", [0])[-1]
    steady = timer.seconds[1:] or timer.seconds
    print(
        f"test accuracy: {accuracy:.4f} | skipped steps: {int(skipped)} | "
        f"time per epoch: {np.median(steady):.2f} s (median after the first, "
        f"first {timer.seconds[0]:.2f} s)"
    )
    if "loss_scale" in history.history:
        print(f"final loss scale: {history.history['loss_scale'][-1]:g}")
    else:
        # kmp's guard skips a step that is not finite under bfloat16; under
        # float32 the step stays Keras' own unless compile asks for it.
        guarded = isinstance(model.optimizer, kmp.LossScaleOptimizer)
        print(f"no loss scaling: {policy.compute_dtype} does not need it "
              + ("(a step that is not finite is still skipped)" if guarded else
                 "(Keras' own step: compile(..., skip_nonfinite=True) skips a step "
                 "that is not finite)"))

    if importlib.util.find_spec("tensorflow") is None:
        print(
            "SavedModel not exported: it needs TensorFlow, which is not installed "
            '(pip install -e ".[tensorflow]" adds it; Keras writes a SavedModel with '
            "TensorFlow on every backend)"
        )
        return accuracy
    import tensorflow as tf

    export_dir = args.export_dir or os.path.join(tempfile.mkdtemp(), "serving")
    model.export(export_dir, verbose=False)
    served = tf.saved_model.load(export_dir).signatures["serving_default"]
    (served_output,) = served(tf.constant(x_test)).values()
    predictions = model.predict(x_test, verbose=0)
    difference = float(np.max(np.abs(served_output.numpy() - predictions)))
    allowed, rounding = _allowed_difference(policy.compute_dtype, predictions)
    print(
        f"SavedModel {export_dir}: input {served.structured_input_signature[1]}, "
        f"output dtype {served_output.dtype.name}, max |served - model| = {difference:.2e} "
        f"(allowed {allowed:.2e}: {_ROUNDINGS} roundings to {rounding})"
    )
    if served_output.dtype != tf.float32 or difference > allowed:
        raise SystemExit("the exported model does not match the trained one")
    return accuracy


# The spacing of numbers just above 1.0 in each compute type.
_STEP = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "tensorfloat32": 2.0**-10}
# The SavedModel runs TensorFlow's kernels; on a GPU, Keras runs the model
# under XLA, which rounds at other points (it fuses the bias add and
# activation into the convolution, keeps some intermediates in float32, sums
# in another order). Each of the 3 layers with weights may differ by its
# output and its bias add, and the Dense layer's softmax by 2 more: 8.
_ROUNDINGS = 8


def _allowed_difference(compute_dtype, predictions):
    """How far the served and the Keras predictions may be apart: `_ROUNDINGS`
    steps of the compute type at the size of the largest prediction."""
    import tensorflow as tf

    rounding = compute_dtype
    if (
        compute_dtype == "float32"
        and _has_gpu()
        and tf.config.experimental.tensor_float_32_execution_enabled()
    ):
        rounding = "tensorfloat32"  # Ampere and later: float32 matmuls round to TF32
    scale = float(np.max(np.abs(predictions)))
    return _ROUNDINGS * _STEP[rounding] * scale, rounding



def _has_gpu():
    """Whether the backend Keras runs on trains on a GPU."""
    if keras.backend.backend() == "jax":
        import jax

        return any(device.platform == "gpu" for device in jax.devices())
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


if __name__ == "__main__":
    main()
