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


def matmul(device, n, dtype):
    """`step()`: an `n`x`n` matmul in `dtype` on `device`, returning a float32
    scalar (converting it to a Python float waits for the device)."""
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), "float32"), _target(device))
    a, b = a.astype(dtype), a.T.astype(dtype)
    return lambda: _product_sum(a, b)


def conv(device, batch, size, channels, dtype):
    """`step()`: a 3x3 same-padded convolution of a `batch`x`size`x`size`x
    `channels` input to `channels`, in `dtype` on `device` (see `matmul`)."""
    key_x, key_w = jax.random.split(jax.random.key(1))
    x = jax.random.normal(key_x, (batch, size, size, channels), "float32")
    w = jax.random.normal(key_w, (3, 3, channels, channels), "float32") * 0.05
    x, w = (jax.device_put(t, _target(device)).astype(dtype) for t in (x, w))
    return lambda: _conv_sum(x, w)


def _target(device):
    platform, index = device.split(":")
    return jax.devices(platform)[int(index)]


# Each step sums its whole result in float32: a slice of it could let XLA
# compute only that slice.
@jax.jit
def _product_sum(a, b):
    return jnp.sum((a @ b).astype("float32"))


@jax.jit
def _conv_sum(x, w):
    y = jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.sum(y.astype("float32"))
