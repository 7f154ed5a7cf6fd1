"""`kmp doctor` on JAX: its version, its devices, and the timed ops."""

import importlib.util

import jax
import jax.numpy as jnp

KEY = "jax"
NAME = "JAX"
CUDA_INSTALL = 'pip install "jax[cuda12]"'

# The modules a JAX CUDA plugin installs (the `jax[cuda12]` or `jax[cuda13]`
# extras): JAX itself has no build flag for it.
_CUDA_PLUGINS = (
    "jax_plugins.xla_cuda12",
    "jax_plugins.xla_cuda13",
    "jax_cuda12_plugin",
    "jax_cuda13_plugin",
)


def version():
    """Returns JAX's version string."""
    return jax.__version__


def built_with_cuda():
    """Returns whether a CUDA plugin for JAX is installed."""
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # `jax_plugins` itself is missing.
            continue
    return False


def cpu_devices():
    """Returns the number of CPU devices JAX lists."""
    return len(jax.devices("cpu"))


def device(on_gpu):
    """Returns the name of the device the benchmark runs on: the first GPU
    (`on_gpu`) or the CPU."""
    return "gpu:0" if on_gpu else "cpu:0"


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
    platform, index = device.split(":")
    target = jax.devices(platform)[int(index)]
    n = 4096 if on_gpu else 512
    batch, size, channels = (32, 56, 128) if on_gpu else (8, 32, 64)
    key_a, key_x, key_w = jax.random.split(jax.random.key(0), 3)

    # Each step sums its whole result in float32: a slice of it could let XLA
    # compute only that slice.
    @jax.jit
    def product_sum(a, b):
        return jnp.sum((a @ b).astype("float32"))

    @jax.jit
    def conv_sum(x, w):
        y = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(y.astype("float32"))

    def matmul(dtype):
        a = jax.device_put(jax.random.normal(key_a, (n, n), "float32"), target)
        a, b = a.astype(dtype), a.T.astype(dtype)
        return (lambda: product_sum(a, b)), 2 * n**3

    def conv(dtype):
        x = jax.random.normal(key_x, (batch, size, size, channels), "float32")
        w = jax.random.normal(key_w, (3, 3, channels, channels), "float32") * 0.05
        x, w = (jax.device_put(t, target).astype(dtype) for t in (x, w))
        return (lambda: conv_sum(x, w)), 2 * batch * size * size * channels * channels * 9

    return [
        ("matmul", f"{n}x{n} @ {n}x{n}", matmul),
        ("conv3x3", f"{batch}x{size}x{size}x{channels} -> {channels}", conv),
    ]
