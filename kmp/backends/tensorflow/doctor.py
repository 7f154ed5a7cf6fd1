"""`kmp doctor` on TensorFlow: its version, its devices, and the timed ops."""

import tensorflow as tf

KEY = "tensorflow"
NAME = "TensorFlow"
CUDA_INSTALL = "pip install tensorflow[and-cuda]"


def version():
    """Returns TensorFlow's version string."""
    return tf.__version__


def built_with_cuda():
    """Returns whether this TensorFlow was built with CUDA."""
    return tf.test.is_built_with_cuda()


def cpu_devices():
    """Returns the number of CPU devices TensorFlow lists."""
    return len(tf.config.list_physical_devices("CPU"))


def device(on_gpu):
    """Returns the name of the device the benchmark runs on: the first GPU
    (`on_gpu`) or the CPU."""
    return "/GPU:0" if on_gpu else "/CPU:0"


def matmul(device, n, dtype):
    """`step()`: an `n`x`n` matmul in `dtype` on `device`, returning a float32
    scalar (converting it to a Python float waits for the device)."""
    with tf.device(device):
        a = tf.random.normal((n, n), dtype="float32")
        a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)
    return _on(device, lambda: tf.reduce_sum(tf.cast(tf.matmul(a, b)[:1, :1], "float32")))


def conv(device, batch, size, channels, dtype):
    """`step()`: a 3x3 same-padded convolution of a `batch`x`size`x`size`x
    `channels` input to `channels`, in `dtype` on `device` (see `matmul`)."""
    with tf.device(device):
        x = tf.cast(tf.random.normal((batch, size, size, channels)), dtype)
        w = tf.cast(tf.random.normal((3, 3, channels, channels)) * 0.05, dtype)
    return _on(device, lambda: tf.reduce_sum(
        tf.cast(tf.nn.conv2d(x, w, 1, "SAME")[:1, :1, :1, :1], "float32")))


def _on(device, compute):
    """`compute` as a `tf.function` whose ops are placed on `device`."""

    def step():
        with tf.device(device):
            return compute()

    return tf.function(step)
