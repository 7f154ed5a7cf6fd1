"""Helpers the tests share: child-process environments, float16 tolerances,
a layer that records the dtype it is handed and the dtypes of a SavedModel.

Imported as `from _helpers import ...`: pytest puts `tests/` on `sys.path`
because `tests/conftest.py` lives there and `tests/` is not a package. The
JAX pass imports it too, where TensorFlow may not be installed: TensorFlow is
imported only inside the helpers that read TensorFlow's own objects.
"""

import os

import keras
import numpy as np

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The spacing of floats just above 1.0 (2**-mantissa bits): the relative step
# between neighbouring values, twice the largest error of one rounding.
# numpy has no bfloat16, hence the table.
EPSILON = {
    "float16": float(np.finfo(np.float16).eps),  # 2**-10
    "bfloat16": 2.0**-7,
    "float32": float(np.finfo(np.float32).eps),  # 2**-23
    # What float32 matmuls and convolutions round their inputs to on NVIDIA
    # GPUs from Ampere on, where TensorFlow enables TF32 by default.
    "tensorfloat32": 2.0**-10,
}


def float32_compute_dtype():
    """`"tensorfloat32"` where float32 matmuls run in TF32 (a GPU, TF32 on),
    else `"float32"`: what float32 results of two engines differ by.

    On JAX, matmuls on an NVIDIA GPU take TF32 at JAX's default precision
    (`jax_default_matmul_precision` unset); on TensorFlow, where TensorFlow
    enables it (its default on a GPU).
    """
    if keras.backend.backend() == "jax":
        import jax

        try:
            gpus = jax.devices("gpu")
        except RuntimeError:  # no GPU backend
            gpus = []
        precision = jax.config.jax_default_matmul_precision
        if gpus and precision in (None, "default", "tensorfloat32"):
            return "tensorfloat32"
        return "float32"
    import tensorflow as tf

    if (
        tf.config.list_physical_devices("GPU")
        and tf.config.experimental.tensor_float_32_execution_enabled()
    ):
        return "tensorfloat32"
    return "float32"


def child_env(*, gpu=False, kmp_importable=True):
    """The environment for a child Python process that a test starts.

    The parent's environment is kept (on the GPU machine PYTHONPATH carries
    TensorFlow itself, so dropping it loses TensorFlow), with the repository
    root first on PYTHONPATH so the child imports this checkout's `kmp`.

    Args:
        gpu: Bool. Whether the child may use a GPU. `False` hides every GPU
            (`CUDA_VISIBLE_DEVICES=""`): the child runs on the CPU, and two
            children compared with each other run the same kernels. `True`
            lets it share the GPU with the test process, which then must not
            reserve all its memory (`conftest.py` turns on memory growth;
            `TF_FORCE_GPU_ALLOW_GROWTH` does the same in the child). Defaults
            to `False`.
        kmp_importable: Bool. `False` removes the repository root from
            PYTHONPATH instead of adding it (the child must also not start in
            the repository, and should block `import kmp` itself, as an
            editable install of another checkout may provide it). Defaults to
            `True`.

    Returns:
        A dict for `subprocess.run(..., env=...)`.
    """
    env = dict(os.environ)
    env["KERAS_BACKEND"] = "tensorflow"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    entries = [
        entry
        for entry in env.get("PYTHONPATH", "").split(os.pathsep)
        if entry and os.path.realpath(entry) != os.path.realpath(REPOSITORY)
    ]
    if kmp_importable:
        entries.insert(0, REPOSITORY)
    env["PYTHONPATH"] = os.pathsep.join(entries)
    if gpu:
        env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def float16_tolerance(expected, *, roundings, dtype="float16"):
    """`(rtol, atol)` for values that went through `roundings` roundings to `dtype`.

    One rounding moves a value by at most half a step, `eps / 2` relative to
    it. Two execution engines (XLA against TensorFlow's kernels, a GPU against
    a CPU, TFLite) round at different points: each may keep an intermediate
    in float32 where the other rounds it, or sum in another order. So each
    value can differ by up to `roundings` steps of its own size (`rtol`), and
    by `roundings` steps of the largest value compared (`atol`), because an
    output near zero is a sum or difference of larger terms and carries their
    absolute error, not one relative to itself.

    Args:
        expected: Array-like. The reference values.
        roundings: Int. How many roundings the two results may differ by
            (about `roundings_per_layer * layers`; state it at the call).
        dtype: String. The 16-bit compute dtype. Defaults to `"float16"`.

    Returns:
        Dict with `rtol` and `atol`, for `np.testing.assert_allclose`.
    """
    eps = EPSILON[dtype]
    scale = float(np.max(np.abs(np.asarray(expected, dtype=np.float64)), initial=0.0))
    return dict(rtol=roundings * eps, atol=roundings * eps * max(scale, np.finfo(np.float32).tiny))


def assert_close_to_float16_rounding(actual, expected, *, roundings, dtype="float16"):
    """Asserts `actual` matches `expected` within `roundings` roundings to `dtype`.

    For outputs of the same model run by two execution engines, where bit
    equality is not to be expected (see `float16_tolerance`). Where the very
    same kernels run (weights saved and restored, one engine twice), compare
    exactly instead.
    """
    tolerance = float16_tolerance(expected, roundings=roundings, dtype=dtype)
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64),
        np.asarray(expected, dtype=np.float64),
        err_msg=f"more than {roundings} {dtype} roundings apart",
        **tolerance,
    )


@keras.saving.register_keras_serializable(package="kmp_tests")
class DtypeProbe(keras.layers.Layer):
    """Records the dtype it is handed, without casting it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._convert_input_args = False
        self.seen = []

    def call(self, x):
        self.seen.append(keras.backend.standardize_dtype(x.dtype))
        return x


class TrainableWeightsPerStep(keras.callbacks.Callback):
    """Records the trainable weights before `fit` and after every step.

    `weights[0]` is the state before training (build the model first),
    `weights[n]` the state after step `n` (1-based, counted across epochs).
    With `steps_per_execution > 1` Keras calls back once per execution, so
    only then is a state recorded.
    Under a `MirroredStrategy` the values are replica 0's.
    """

    def on_train_begin(self, logs=None):
        self.weights = [self._read()]

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self._read())

    def _read(self):
        return [np.array(v.numpy()) for v in self.model.trainable_weights]

    def unchanged_by(self, step):
        """Whether step `step` (1-based) left every trainable weight as it was."""
        if len(self.weights[step - 1]) != len(self.weights[step]):
            raise ValueError(
                "Build the model before `fit`: the weights before step "
                f"{step} were not created yet. Received: step={step}"
            )
        return all(
            np.array_equal(before, after)
            for before, after in zip(self.weights[step - 1], self.weights[step])
        )


# A sample weight that makes the scaled gradient overflow float16 while the
# loss stays finite in float32: a backward overflow at a step of our choosing
# that leaves the forward pass (and BatchNormalization's statistics) alone.
# A loss of order 1 times 1e6 times a scale of 2**15 is ~3e10 in float32; the
# gradient cast back to float16 at the model's output is far beyond 65504.
OVERFLOWING_SAMPLE_WEIGHT = 1e6


def overflowing_sample_weights(rows, batch_size, batches):
    """Sample weights of 1, with `OVERFLOWING_SAMPLE_WEIGHT` on every row of
    the batches numbered in `batches` (1-based, in the data's order: fit with
    `shuffle=False`, and each epoch meets them again)."""
    weights = np.ones(rows, "float32")
    for batch in batches:
        weights[(batch - 1) * batch_size : batch * batch_size] = OVERFLOWING_SAMPLE_WEIGHT
    return weights


def activations_overflowing_in_the_second_batch():
    """`(x, y)`: 64 rows of 8 features and 1 target, normal; rows 32 on are
    times 1e5, so that a float16 Dense(8) on them (a batch of 32) computes
    activations above float16's 65504: a forward overflow."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    x[32:] *= 1e5
    return x, y


def free_ports(count):
    """`count` free TCP ports on 127.0.0.1, for workers a test starts."""
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def graph_dtypes(saved_model_dir):
    """Every dtype named by a node attribute of the SavedModel's graph and
    function library (the ops TF Serving and TFLite would run)."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    with open(os.path.join(saved_model_dir, "saved_model.pb"), "rb") as f:
        saved_model.ParseFromString(f.read())
    dtypes = set()
    for meta_graph in saved_model.meta_graphs:
        nodes = list(meta_graph.graph_def.node)
        for function in meta_graph.graph_def.library.function:
            nodes.extend(function.node_def)
        for node in nodes:
            for value in node.attr.values():
                if value.type:
                    dtypes.add(tf.as_dtype(value.type).name)
                dtypes.update(tf.as_dtype(t).name for t in value.list.type)
    return dtypes


class ReferenceScaler:
    """The issue's state machine in plain Python, the scale rounded to float32
    after every update as the float32 variable is."""

    def __init__(self, initial_scale=2.0**15, dynamic=True, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, hysteresis=1,
                 min_scale=1.0, max_scale=2.0**24):
        self.scale = np.float32(initial_scale)
        self.dynamic = dynamic
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.max_scale = min_scale, max_scale
        self.good_steps, self.hysteresis_left, self.skipped_steps = 0, hysteresis, 0
        self.applied_steps = 0

    def step(self, finite):
        if not finite:
            self.skipped_steps += 1
            if self.dynamic:
                self.good_steps = 0
                self.hysteresis_left -= 1
                if self.hysteresis_left <= 0:
                    self.scale = np.float32(
                        max(self.scale * np.float32(self.backoff_factor), self.min_scale)
                    )
            return
        self.applied_steps += 1
        if self.dynamic:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.good_steps = 0
                self.hysteresis_left = self.hysteresis
                self.scale = np.float32(
                    min(self.scale * np.float32(self.growth_factor), self.max_scale)
                )
