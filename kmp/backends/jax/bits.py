"""A tensor's bits on JAX: what stochastic rounding needs
(`kmp.precision._compensated`).

The same names as `kmp/backends/tensorflow/bits.py`; imports nothing of kmp's.
"""

import jax
import jax.numpy as jnp


def bitcast(x, dtype):
    """`x`'s bits read as `dtype`, a dtype of the same width."""
    return jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


def random_bits(shape, seed):
    """uint32 random bits of `shape`, a function of `seed` alone (an int32
    array of 2 values): the same seed gives the same bits, jitted or not."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed[0]), seed[1])
    return jax.random.bits(key, tuple(shape), jnp.uint32)
