"""Float8 layers in Keras' JAX `fit`: which record their amax.

The same names as `kmp/backends/tensorflow/float8.py`.
"""

import jax
import keras
import numpy as np

from kmp import _keras_internals


def recorded_in_fit(model, layers, x):
    """Whether each float8 layer of `layers` records its kernel's amax when
    Keras' JAX trainer calls `model` on `x`: `model.stateless_call(...,
    training=True)` (without `training` where `call` takes none), which runs
    `call` itself, outside any outer call's `training`; a layer records
    where the "gradient" of its `kernel_amax_history` is not zero."""
    trainable = list(model.trainable_variables)
    index = {id(variable): i for i, variable in enumerate(trainable)}
    positions = [index[id(layer.kernel_amax_history)] for layer in layers]
    non_trainable = [v.value for v in model.non_trainable_variables]
    kwargs = {"training": True} if _keras_internals.call_takes_training(model) else {}

    def total(values):
        outputs, _ = model.stateless_call(values, non_trainable, x, **kwargs)
        return sum(keras.ops.sum(keras.ops.cast(output, "float32"))
                   for output in keras.tree.flatten(outputs))

    grads = jax.grad(total)([v.value for v in trainable])
    return [bool(np.any(np.asarray(grads[i]))) for i in positions]
