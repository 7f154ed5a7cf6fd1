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


def cases(device, on_gpu):
    """The ops `kmp doctor` times, placed on `device`.

    Args:
        device: String, as `device` returns it.
        on_gpu: Bool. Whether `device` is a GPU: its ops are larger.

    Returns:
        List of `(op, shape, build)`, `build(dtype)` returning `(step,
        flops)`: `step()` runs the op once in `dtype` and returns a float32
        scalar (converting it to a Python float waits for the device).
    """
    n = 4096 if on_gpu else 512
    batch, size, channels = (32, 56, 128) if on_gpu else (8, 32, 64)

    def matmul(dtype):
        with tf.device(device):
            a = tf.random.normal((n, n), dtype="float32")
            a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)
        return _on(device, lambda: tf.reduce_sum(tf.cast(tf.matmul(a, b)[:1, :1], "float32"))), 2 * n**3

    def conv(dtype):
        with tf.device(device):
            x = tf.cast(tf.random.normal((batch, size, size, channels)), dtype)
            w = tf.cast(tf.random.normal((3, 3, channels, channels)) * 0.05, dtype)
        step = _on(device, lambda: tf.reduce_sum(
            tf.cast(tf.nn.conv2d(x, w, 1, "SAME")[:1, :1, :1, :1], "float32")))
        return step, 2 * batch * size * size * channels * channels * 9

    return [
        ("matmul", f"{n}x{n} @ {n}x{n}", matmul),
        ("conv3x3", f"{batch}x{size}x{size}x{channels} -> {channels}", conv),
    ]


def _on(device, compute):
    """`compute` as a `tf.function` whose ops are placed on `device`."""

    def step():
        with tf.device(device):
            return compute()

    return tf.function(step)
