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


def map_gradients(fn, gradients, keep=None):
    """`map_gradient(fn, g)` for each of `gradients`, but those whose `keep`
    is true, left as they are."""
    keep = keep or [False] * len(gradients)
    return [g if skip else map_gradient(fn, g) for g, skip in zip(gradients, keep)]


def values_of(gradients):
    """The tensors of values: a dense gradient itself, a sparse one's
    `.values` (`None` stays `None`)."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients]
