"""Gradients on TensorFlow: an embedding's is a `tf.IndexedSlices`.

The same names as `kmp/backends/jax/gradients.py`; imports nothing of kmp's.
"""

import tensorflow as tf

# The dtype of the scaler's counters.
COUNTER_DTYPE = "int64"


def map_gradient(fn, gradient):
    """Applies `fn` to a dense gradient or to the values of a sparse one
    (`None`, a variable without a gradient, stays `None`)."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
    return fn(gradient)


def values(gradient):
    """The tensor of values: the dense gradient, or a sparse one's `.values`."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
