"""A tensor's bits on TensorFlow: what stochastic rounding needs
(`kmp.precision._compensated`).

The same names as `kmp/backends/jax/bits.py`; imports nothing of kmp's.
"""

import tensorflow as tf


def bitcast(x, dtype):
    """`x`'s bits read as `dtype`, a dtype of the same width."""
    return tf.bitcast(x, dtype)


def random_bits(shape, seed):
    """uint32 random bits of `shape`, a function of `seed` alone (an int32
    tensor of 2 values): the same seed gives the same bits in every mode and
    on every replica."""
    return tf.random.stateless_uniform(shape, seed=seed, minval=None, maxval=None,
                                       dtype=tf.uint32)
