"""Gradients on JAX: arrays (Keras' JAX optimizers take a sparse BCOO too,
which `keras.ops` handles as it is).

The same names as `kmp/backends/tensorflow/gradients.py`; imports nothing of
kmp's.
"""

# The dtype of the scaler's counters: JAX holds 32-bit integers unless
# `jax_enable_x64` is set.
COUNTER_DTYPE = "int32"


def with_values(gradients, values):
    """The new values themselves (JAX's gradients are arrays)."""
    return list(values)


def values_of(gradients):
    """The gradients themselves (JAX's are arrays)."""
    return list(gradients)
