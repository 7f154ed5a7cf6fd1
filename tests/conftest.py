"""Test set-up: TensorFlow backend, two logical CPUs, GPU memory growth, the
`gpu` marker, a clean policy and seed per test."""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# TensorFlow reserves nearly all of a GPU's memory in the first process that
# touches it; a test's child process would then fail with "cudaSetDevice() on
# GPU:0 failed. Status: out of memory". Growth allocates only what is used.
# Like the CPU split below, it must be set before devices initialize.
GPUS = tf.config.list_physical_devices("GPU")
for _gpu in GPUS:
    tf.config.experimental.set_memory_growth(_gpu, True)

# Two logical CPU devices let tf.distribute.MirroredStrategy run two replicas
# here; this must happen before TensorFlow initializes its devices.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import pytest  # noqa: E402

import kmp  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    if GPUS:
        return
    skip = pytest.mark.skip(reason="needs a GPU: tf.config.list_physical_devices('GPU') is empty")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _float32_policy_around_each_test():
    kmp.set_policy("float32")
    # Each test draws the same weights whatever ran before it in the process
    # (pytest -n 2 hands tests to workers in varying order).
    keras.utils.set_random_seed(0)
    yield
    kmp.set_policy("float32")
    keras.utils.clear_session()


@pytest.fixture(scope="session")
def mirrored_strategy():
    """One two-replica strategy for the whole session: a second
    MirroredStrategy in the same process can reuse collective instance keys
    with other shapes and fail with "Shape mismatch in the collective"."""
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
