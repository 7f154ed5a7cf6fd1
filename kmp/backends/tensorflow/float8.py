"""Float8 layers in Keras' TensorFlow `fit`: which record their amax.

The same names as `kmp/backends/jax/float8.py`.
"""


def recorded_in_fit(model, layers, x):
    """`None`: nothing needs running on TensorFlow. Keras' TensorFlow
    trainer calls `model(x, training=True)` where `call` takes the argument,
    and the layers inside inherit it, so every float8 layer records unless
    `call` takes no `training` (which `kmp.float8.enable` checks without a
    batch)."""
    return None
