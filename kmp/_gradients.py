"""Gradient helpers of the loss-scaled step: finite checks, unscaling, clipping.

Every function takes a list of gradients in which an entry may be a dense
tensor, a `tf.IndexedSlices` (an embedding's sparse gradient) or `None` (a
variable without a gradient), and keeps that shape.
"""

import tensorflow as tf
from keras import ops


def map_gradient(fn, gradient):
    """Applies `fn` to a dense gradient or to the values of a sparse one."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
    return fn(gradient)


def values(gradient):
    """The tensor of values: the dense gradient, or a sparse one's `.values`."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def finite_flags(gradients):
    """One boolean scalar per gradient (`None` for a missing gradient)."""
    return [None if g is None else ops.all(ops.isfinite(values(g))) for g in gradients]


def nonfinite_indicator(flags, indices, size):
    """Int64 vector of `size`: 1 at `indices[i]` where `flags[i]` is false.

    Built from the finite check's own per-gradient flags (no second pass
    over the gradients); missing gradients (`None` flags) count as finite.
    """
    indicator = [ops.convert_to_tensor(0, "int64")] * size
    for finite, index in zip(flags, indices):
        if finite is not None:
            indicator[index] = ops.cast(ops.logical_not(finite), "int64")
    return ops.stack(indicator) if indicator else ops.zeros((0,), "int64")


def all_true(flags):
    """Whether every flag that is not `None` is true (true for none at all)."""
    flags = [f for f in flags if f is not None]
    if not flags:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(flags))


def all_finite(gradients):
    """Returns a boolean scalar: whether every gradient is free of inf and NaN.

    Args:
        gradients: List of tensors (dense or `tf.IndexedSlices`); `None`
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
    keep = keep or [False] * len(gradients)
    return [
        g if skip else map_gradient(lambda t: t / ops.cast(divisor, t.dtype), g)
        for g, skip in zip(gradients, keep)
    ]


def _squared_norm(gradient):
    return ops.sum(ops.square(ops.cast(values(gradient), "float32")))


def _scale_by(factor):
    return lambda t: t * ops.cast(factor, t.dtype)


def clip_gradients(gradients, clipvalue=None, clipnorm=None, global_clipnorm=None):
    """Clips gradients by value, then by per-tensor or global norm.

    Both kinds of clipping only shrink values, so the result meets every
    bound that was asked for. `None` entries pass through.

    Args:
        gradients: List of tensors (dense or `tf.IndexedSlices`) or `None`.
        clipvalue: Optional float > 0. Each element is clipped to
            `[-clipvalue, clipvalue]`.
        clipnorm: Optional float > 0. Each tensor whose L2 norm exceeds it is
            rescaled to that norm.
        global_clipnorm: Optional float > 0. All tensors are rescaled together
            when their joint L2 norm exceeds it.

    Returns:
        The list of clipped gradients.

    Example:

    >>> [g] = clip_gradients([ops.array([3.0, 4.0])], global_clipnorm=1.0)
    >>> [round(float(v), 3) for v in g]
    [0.6, 0.8]
    """
    if clipvalue is not None:
        gradients = [
            map_gradient(lambda v: ops.clip(v, -clipvalue, clipvalue), g) for g in gradients
        ]
    if clipnorm is not None:
        gradients = [
            map_gradient(
                lambda v: _scale_by(clipnorm / ops.maximum(ops.sqrt(_squared_norm(v)), clipnorm))(v),
                g,
            )
            for g in gradients
        ]
    if global_clipnorm is not None:
        present = [g for g in gradients if g is not None]
        if present:
            norm = ops.sqrt(ops.sum(ops.stack([_squared_norm(g) for g in present])))
            factor = global_clipnorm / ops.maximum(norm, global_clipnorm)
            gradients = [map_gradient(_scale_by(factor), g) for g in gradients]
    return gradients
