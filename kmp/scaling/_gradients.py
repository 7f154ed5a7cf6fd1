"""Gradient helpers of the loss-scaled step: finite checks and unscaling.

Clipping is the inner Keras optimizer's own (`clipnorm`, ...).

Every function takes a list of gradients in which an entry may be a dense
tensor, a sparse one (TensorFlow's `tf.IndexedSlices` of an embedding: the
backend's `gradients` module knows it) or `None` (a variable without a
gradient), and keeps that shape.
"""

import numpy as np
from keras import ops

from kmp import backends

# The backend's sparse gradients and counter dtype (a module that imports
# nothing of kmp's, so it is taken here, at import).
_backend = backends.get("gradients")
COUNTER_DTYPE = _backend.COUNTER_DTYPE
COUNTER_MAX = int(np.iinfo(COUNTER_DTYPE).max)


# The backend's own functions, called directly: `values_of(gradients)` are
# the tensors of values, a dense gradient itself or a sparse one's `.values`
# (`None` stays `None`); `with_values(gradients, values)` puts new values
# back, a sparse gradient keeping its indices. The math between them is
# the core's, over all gradients at once (`map_values`).
values_of = _backend.values_of
with_values = _backend.with_values


def map_values(fn, gradients, keep=None):
    """`fn` applied to each gradient's values (a dense gradient's own, a
    sparse one's `.values`), but those whose `keep` is true; `None` stays
    `None`."""
    keep = keep or [False] * len(gradients)
    return with_values(gradients, [
        v if skip or v is None else fn(v) for v, skip in zip(values_of(gradients), keep)
    ])


def finite_flags(gradients):
    """One boolean scalar per gradient (`None` for a missing gradient).

    A gradient is finite where the float32 sum of its values is: an inf or a
    NaN anywhere makes the sum inf or NaN. One reduction per gradient, with
    no boolean tensor of its size in between (`all(isfinite(g))` is two ops
    and one: in a TensorFlow graph, with hundreds of variables, each op
    counts); a finite gradient whose sum passes float32's 3.4e38 would be
    taken for an overflow, a sum no trained model's gradient reaches.
    """
    return [
        None if g is None else ops.isfinite(ops.sum(ops.cast(g, "float32")))
        for g in values_of(gradients)
    ]


def nonfinite_indicator(flags, indices, size):
    """Integer (`COUNTER_DTYPE`) vector of `size`: 1 at `indices[i]` where `flags[i]` is false.

    Built from the finite check's own per-gradient flags (no second pass
    over the gradients); missing gradients (`None` flags) count as finite.
    """
    indicator = [ops.convert_to_tensor(0, COUNTER_DTYPE)] * size
    for finite, index in zip(flags, indices):
        if finite is not None:
            indicator[index] = ops.cast(ops.logical_not(finite), COUNTER_DTYPE)
    return ops.stack(indicator) if indicator else ops.zeros((0,), COUNTER_DTYPE)


# From this many flags `all_true` sorts them (see there).
_SORTED_FROM = 32


def all_true(flags):
    """Whether every flag that is not `None` is true (true for none at all).

    The smallest of the sorted flags: XLA rewrites `all(stack(flags))` into
    a chain of `and`s over the per-gradient sums and copies that chain, and
    every sum as an operand, into each fusion that reads the answer (each of
    the step's gated writes: 202 operands in each of ~600 kernels on a model
    of 202 variables); a sort it neither rewrites nor copies, so the answer
    is one scalar, computed once. With few flags the copies cost less than
    the sort's ops in a graph (a dozen), so `all` stays below
    `_SORTED_FROM` flags.
    """
    flags = [f for f in flags if f is not None]
    if not flags:
        return ops.convert_to_tensor(True)
    if len(flags) < _SORTED_FROM:
        return ops.all(ops.stack(flags))
    return ops.sort(ops.cast(ops.stack(flags), "int32"))[0] > 0


def all_finite(gradients):
    """Returns a boolean scalar: whether every gradient is free of inf and NaN.

    Args:
        gradients: List of tensors (dense, or TensorFlow's `tf.IndexedSlices`); `None`
            entries are ignored.

    Returns:
        Boolean scalar tensor.

    Example:

    >>> bool(all_finite([ops.ones((2,)), None]))
    True
    >>> bool(all_finite([ops.array([1.0, float("inf")])]))
    False
    """
    return all_true(finite_flags(gradients))


def divide(gradients, divisor, keep=None):
    """`gradients` divided by the scalar `divisor`, each in its own dtype.

    Args:
        gradients: List of gradients (see the module docstring).
        divisor: Scalar tensor or number.
        keep: Optional list of booleans, one per gradient: `True` leaves that
            gradient as it is (a variable Keras overwrites with its
            "gradient", such as a BatchNormalization moving statistic).
    """
    return map_values(lambda v: v / ops.cast(divisor, v.dtype), gradients, keep)
