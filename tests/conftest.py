"""Test set-up: TensorFlow backend, two logical CPUs, and a clean policy per test."""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# Two logical CPU devices let tf.distribute.MirroredStrategy run two replicas
# here; this must happen before TensorFlow initializes its devices.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import pytest  # noqa: E402

import kmp  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _float32_policy_around_each_test():
    kmp.set_policy("float32")
    yield
    kmp.set_policy("float32")
    keras.utils.clear_session()


@pytest.fixture(scope="session")
def mirrored_strategy():
    """One two-replica strategy for the whole session: a second
    MirroredStrategy in the same process can reuse collective instance keys
    with other shapes and fail with "Shape mismatch in the collective"."""
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
