"""`kmp.diagnose`'s probe on TensorFlow: one forward and backward pass, layer by layer.

The probe runs a batch through a model that returns every layer's outputs
beside the model's outputs, and differentiates the loss times the loss scale
with respect to each layer's outputs and each of its trainable weights, under
a `tf.GradientTape`. What the values mean, and what is done with them, is
backend-neutral and lives in `kmp/diagnosis/_probe.py`.
"""

import keras
import numpy as np
import tensorflow as tf

from kmp.diagnosis import _probe as _diagnose_probe


def check_supported():
    """Returns `None`: `kmp.diagnose` measures on TensorFlow."""


def run_pass(extractor, weights, x, y, loss_fns, scale):
    """One forward and backward pass of `extractor` on a batch (no weight update).

    Args:
        extractor: A `keras.Model` returning `[layer_outputs, model_outputs]`:
            one entry per probed layer, then the model's own outputs.
        weights: List, one entry per probed layer: the trainable variables
            whose gradients count for that layer.
        x: The batch's inputs.
        y: The batch's targets, one per model output.
        loss_fns: List of loss callables, one per model output.
        scale: Float. The loss scale the gradients are taken at.

    Returns:
        A tuple `(loss, outputs, output_gradients, weight_gradients)`: the
        unscaled float32 loss as a float, then three lists with one entry
        per probed layer of float32 NumPy arrays: the layer's floating-point
        outputs, the gradients with respect to them and the gradients with
        respect to its weights, both divided by `scale`.

    Raises:
        ValueError: if the model's outputs, the targets and the losses are
            not as many.
    """
    flat_weights = [w for own in weights for w in own]
    with tf.GradientTape() as tape:
        layer_outputs, model_outputs = extractor(x, training=False)
        layer_outputs = [
            [t for t in keras.tree.flatten(o) if _is_float(t)] for o in layer_outputs
        ]
        predictions = [tf.cast(t, "float32") for t in keras.tree.flatten(model_outputs)]
        targets = _diagnose_probe.targets_for(predictions, y, loss_fns)
        loss = tf.add_n([
            tf.reduce_mean(tf.cast(fn(target, prediction), "float32"))
            for fn, target, prediction in zip(loss_fns, targets, predictions)
        ])
        scaled_loss = loss * scale
    flat_outputs = [t for per_layer in layer_outputs for t in per_layer]
    gradients = tape.gradient(
        scaled_loss, flat_outputs + flat_weights,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    output_gradients, weight_gradients = [], []
    position = 0
    for per_layer in layer_outputs:
        output_gradients.append(
            [_numpy(g) / scale for g in gradients[position:position + len(per_layer)]]
        )
        position += len(per_layer)
    for own in weights:
        weight_gradients.append(
            [_numpy(g) / scale for g in gradients[position:position + len(own)]]
        )
        position += len(own)
    outputs = [[_numpy(t) for t in per_layer] for per_layer in layer_outputs]
    return float(loss), outputs, output_gradients, weight_gradients


def _numpy(tensor):
    # An embedding's weight gradient is an IndexedSlices: densified, so the
    # rows no id touched count as the zeros they are.
    return np.asarray(tf.cast(tf.convert_to_tensor(tensor), "float32"))


def _is_float(tensor):
    return tensor is not None and tensor.dtype.is_floating
