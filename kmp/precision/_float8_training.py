"""Float8 layers that `fit` would run without `training=True`.

A float8 layer (Keras' `quantize("float8")`) records its inputs' and
kernel's amax only when called in training mode; one that is not keeps
scales that never move (Keras' TensorFlow optimizer drops the missing
"gradient") or, on JAX, has them overwritten with a zero one after the
first step. `kmp.float8.enable` and `kmp.Model`'s train function warn
where a model's float8 layers would run so (`warn_if_not_recording`).
Also `float8_layers`, the float8 layers of a model, which kmp's float8
modules and `kmp.Model` read (this module imports neither).
"""

import warnings
import weakref

import keras
import numpy as np
from keras import ops

from kmp import _keras_internals
from kmp import backends
from kmp.precision import _keep_float32


def float8_layers(model):
    """The layers of `model` that run float8 matmuls.

    Args:
        model: A `keras.Model`.

    Returns:
        A list of layers, each once, in tracking order.
    """
    found, seen = [], set()
    for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True):
        if id(layer) not in seen and layer.dtype_policy.quantization_mode == "float8":
            seen.add(id(layer))
            found.append(layer)
    return found


# The models `warn_if_not_recording` checked (each once: the check may run
# the model, and one warning a model is enough).
_CHECKED = weakref.WeakSet()


def warn_if_not_recording(model, stacklevel=2):
    """Warns, once per model, where `fit` would run some of `model`'s
    float8 layers without `training=True` (see `_training_mode_caveat`).
    `kmp.float8.enable` calls it, and `kmp.Model` when it makes its train
    function (float8 layers quantized by Keras' own
    `model.quantize("float8")`)."""
    if model in _CHECKED or not float8_layers(model):
        return
    _CHECKED.add(model)
    caveat = _training_mode_caveat(model)
    if caveat:
        warnings.warn(caveat, stacklevel=stacklevel + 1)


_NOT_RECORDED = (
    "would then never record their inputs' and kernel's amax: they would quantize with "
    "scales that never move (1.0 on TensorFlow; on JAX Keras overwrites them with 0, and "
    "the layers' outputs are not finite)."
)


def _training_mode_caveat(model):
    """Why some of `model`'s float8 layers would not record their amax in
    `fit`, or `None`.

    A float8 layer records its inputs' and kernel's amax only when called
    in training mode. Functional and Sequential models pass `training` to
    each layer. Keras' `fit` calls a subclassed model with `training=True`
    only where its `call` takes the argument; on TensorFlow the layers
    inside then inherit it, while on JAX Keras runs `call` itself and a
    layer gets `training` only where `call` passes it on. So: a `call`
    without `training` is named from its signature; on JAX, the float8
    layers `call` does not pass it to are found by running the model once
    as Keras' trainer does, on a batch of zeros of the shape it was built
    with (where it was built on one input; nothing is written).
    """
    if isinstance(model, (_keras_internals.Functional, keras.Sequential)):
        return None
    layers = float8_layers(model)
    name = type(model).__name__
    if not _keras_internals.call_takes_training(model):
        return (
            f"kmp.float8: {name}.call takes no `training` argument, so fit calls "
            f"{model.name!r} without one and the layers inside it run in inference mode. "
            f"Its {_listed(layers)} {_NOT_RECORDED} Add `training=None` to `call` and pass "
            "`training=training` to the layers that hold them."
        )
    batch = _zeros_batch(model)
    if batch is None:
        return None
    try:
        recorded = backends.get("float8").recorded_in_fit(model, layers, batch)
    except Exception:  # noqa: BLE001 - a model this check cannot run is not warned about
        return None
    missing = [layer for layer, done in zip(layers, recorded or ()) if not done]
    if not missing:
        return None
    return (
        f"kmp.float8: on JAX, Keras' fit runs {name}.call itself, and a layer inside "
        "it runs in training mode only where `call` passes it `training=training`. "
        f"{model.name!r} does not, for {_listed(missing)} (checked on a batch of zeros): "
        "they would never record their inputs' and kernel's amax, and after the first "
        "step Keras overwrites their scales with 0 (their outputs are then not finite). "
        "Pass `training=training` to them, or to the layers that hold them."
    )


def _listed(layers):
    names = [_keep_float32._layer_label(layer) for layer in layers]
    shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} float8 layer(s) ({shown})"


def _zeros_batch(model):
    """A batch of one of zeros, of the shape `model` was built with, or
    `None` where it was built on several inputs or none known."""
    shapes = _keras_internals.build_shapes(model)
    if not shapes or len(shapes) != 1:
        return None
    shape = next(iter(shapes.values()))
    if not isinstance(shape, (tuple, list)) or not shape or not all(
        d is None or isinstance(d, int) for d in shape
    ):
        return None
    return np.zeros([1] + [1 if d is None else d for d in shape[1:]], "float32")


def rescale_gradient_amax(pairs, new_scale, old_scale):
    """Float8 output-gradient amax histories and scales moved to a new loss scale.

    ```
    ratio = new_scale / old_scale
    for history, scale in pairs:
        history <- history * ratio
        scale <- scale * ratio   if max(history) > 0
                 scale           otherwise (nothing recorded yet: Keras
                                 keeps the initial scale, so does this)
    ```

    Pure, with `keras.ops`: the step calls it once per attempt, after apply
    or skip and the scale's update, with no branch (a ratio of 1, most
    steps, changes nothing, bit for bit). `kmp.float8.rescale_gradient_amax`
    says why.

    Args:
        pairs: List of `(history, scale)` tensors.
        new_scale, old_scale: Scalar tensors or numbers: the loss scale the
            next attempt uses, and the one the values were recorded under.

    Returns:
        A list of `(history, scale)` float32 tensors, in the order given.
    """
    if not pairs:
        return []
    ratio = ops.divide(ops.cast(new_scale, "float32"), ops.cast(old_scale, "float32"))
    rescaled = []
    for history, scale in pairs:
        history = ops.convert_to_tensor(history, "float32")
        scale = ops.convert_to_tensor(scale, "float32")
        recorded = ops.max(history) > 0.0
        rescaled.append((
            ops.multiply(history, ratio),
            ops.where(recorded, ops.multiply(scale, ratio), scale),
        ))
    return rescaled


def follow_loss_scale(model):
    """Registers, on each `kmp.LossScaleOptimizer` `model` holds, that its
    float8 layers' output-gradient amax histories and scales follow the
    loss scale (`rescale_gradient_amax`, in every step, after the scale's
    update; `kmp.scaling._step.follow_scale` runs it).

    These values are gradients of the scaled loss, so they carry the scale:
    when it moves they move with it. Found once, here, by the layers'
    quantization mode, not at every trace. `kmp.Model` calls it when it
    makes its train function; a loop of your own calls
    `kmp.float8.apply_loss_scale_change` after each step instead.
    """
    from kmp.scaling import _optimizers
    from kmp.scaling import _step

    pairs = tuple(
        (layer.outputs_grad_amax_history, layer.outputs_grad_scale)
        for layer in float8_layers(model)
    )
    followers = (_step.ScaleFollower(pairs, rescale_gradient_amax),) if pairs else ()
    for optimizer in _optimizers.scaling_optimizers(model).values():
        # object.__setattr__: Keras would track the variables as the
        # optimizer's own (its checkpoints would change).
        object.__setattr__(optimizer, "_kmp_scale_followers", followers)
