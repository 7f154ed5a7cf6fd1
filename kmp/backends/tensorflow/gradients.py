"""Gradients on TensorFlow: an embedding's is a `tf.IndexedSlices`.

The same names as `kmp/backends/jax/gradients.py`; imports nothing of kmp's.
"""

import tensorflow as tf

# The dtype of the scaler's counters.
COUNTER_DTYPE = "int64"


def with_values(gradients, values):
    """Each of `gradients` with its values replaced by those in `values`
    (as `values_of` gives them): a dense gradient is its new values, a
    sparse one keeps its indices; `None` stays `None`."""
    return [_with_values(g, v) for g, v in zip(gradients, values)]


def _with_values(gradient, values):
    if not isinstance(gradient, tf.IndexedSlices):
        return values
    if values is gradient.values:  # left as it was (a cast to its own dtype, say)
        return gradient
    return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)


def values_of(gradients):
    """The tensors of values: a dense gradient itself, a sparse one's
    `.values` (`None` stays `None`)."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients]
