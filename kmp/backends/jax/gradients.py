"""Gradients on JAX: arrays (Keras' JAX optimizers take a sparse BCOO too,
which `keras.ops` handles as it is).

The same names as `kmp/backends/tensorflow/gradients.py`; imports nothing of
kmp's.
"""

# The dtype of the scaler's counters: JAX holds 32-bit integers unless
# `jax_enable_x64` is set.
COUNTER_DTYPE = "int32"


def map_gradient(fn, gradient):
    """Applies `fn` to a gradient (`None` stays `None`)."""
    return None if gradient is None else fn(gradient)


def map_gradients(fn, gradients, keep=None):
    """`map_gradient(fn, g)` for each of `gradients`, but those whose `keep`
    is true, left as they are."""
    keep = keep or [False] * len(gradients)
    return [g if skip or g is None else fn(g) for g, skip in zip(gradients, keep)]


def values_of(gradients):
    """The gradients themselves (JAX's are arrays)."""
    return list(gradients)
