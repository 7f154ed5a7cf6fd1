"""Float8 matmuls under a kmp policy: which layers, kept consistent, and seen.

Keras 3 trains `Dense` and `EinsumDense` layers with float8 matmuls once they
are quantized with `layer.quantize("float8")`: inputs and kernel are
quantized to e4m3 in the forward pass, the output gradient to e5m2 in the
backward pass, each with a scale computed from a history of recent absolute
maxima ("delayed scaling", as NVIDIA's Transformer Engine does). The
histories and scales are variables that Keras overwrites with their
"gradient" (`overwrite_with_gradient=True`). This module adds to that
mechanism what makes it usable under a kmp policy:

- `enable(model)`: quantizes the layers that gain from float8, by a stated
  rule (`FILTER_RULE`), and says why the others stay in the 16-bit policy;
  `kmp.convert(model, policy, float8=True)` calls it.
- `rescale_gradient_amax` and `gradient_amax_variables`: under
  `mixed_float16` the output gradients float8 records are multiplied by the
  loss scale; when the scale changes, the recorded maxima must change with it.
- `stats(model, x, y)` and `Float8Monitor`: per float8 layer, the amax of
  each quantized tensor and the share of values saturated at float8's
  maximum or flushed to zero (the output gradient's by a probe step on
  `(x, y)`); `compare(model, x)`: each float8 layer's output against its
  16-bit and float32 output, which `kmp.diagnose` reports.

Nothing here changes a Keras class or attribute: the layers are quantized
through Keras' own `Model.quantize("float8", filters=...)`.

This module holds `enable`, `plan` and the rescaling, and re-exports the
rest from where it is defined: the rule in `kmp/precision/_float8_rule.py`,
`stats` and `compare` in `kmp/precision/_float8_measure.py`, the monitor in
`kmp/monitor/_float8.py`, the matmul `kmp doctor` times in
`kmp/precision/_float8_matmul.py`.
"""

import inspect

import keras

from kmp import _keras_internals
from kmp.precision import _float8_rule
from kmp.precision import _float8_training
from kmp.precision import _keep_float32

# Public names of this module, defined beside what they belong to: the rule
# (kmp/precision/_float8_rule.py), the measurements
# (kmp/precision/_float8_measure.py), the monitor (kmp/monitor/_float8.py)
# and the matmul `kmp doctor` times (kmp/precision/_float8_matmul.py).
from kmp.monitor._float8 import Float8Monitor  # noqa: F401
from kmp.precision._float8_matmul import FLOAT8_COMPUTE_CAPABILITY  # noqa: F401
from kmp.precision._float8_matmul import has_float8_tensor_cores as _has_float8_tensor_cores  # noqa: F401
from kmp.precision._float8_matmul import matmul_step as _matmul_step  # noqa: F401
from kmp.precision._float8_formats import E4M3_MAX  # noqa: F401
from kmp.precision._float8_formats import E4M3_TINY  # noqa: F401
from kmp.precision._float8_formats import E5M2_MAX  # noqa: F401
from kmp.precision._float8_formats import E5M2_TINY  # noqa: F401
from kmp.precision._float8_formats import TENSORS as _TENSORS  # noqa: F401
from kmp.precision._float8_measure import compare  # noqa: F401
from kmp.precision._float8_measure import stats  # noqa: F401
from kmp.precision._float8_rule import DIMENSION_MULTIPLE  # noqa: F401
from kmp.precision._float8_rule import FILTER_RULE  # noqa: F401
from kmp.precision._float8_rule import SMALL_INPUT_FEATURES  # noqa: F401
from kmp.precision._float8_rule import SMALL_OUTPUT_FEATURES  # noqa: F401
from kmp.precision._float8_training import float8_layers

__all__ = [
    "DIMENSION_MULTIPLE",
    "E4M3_MAX",
    "E4M3_TINY",
    "E5M2_MAX",
    "E5M2_TINY",
    "FILTER_RULE",
    "FLOAT8_COMPUTE_CAPABILITY",
    "Float8Monitor",
    "SMALL_INPUT_FEATURES",
    "SMALL_OUTPUT_FEATURES",
    "apply_loss_scale_change",
    "compare",
    "enable",
    "float8_layers",
    "gradient_amax_variables",
    "plan",
    "rescale_gradient_amax",
    "stats",
]


def plan(model, exclude=None, skip_small=True):
    """Which Dense and EinsumDense layers of `model` `enable` makes float8, and why.

    Reads the model and changes nothing. See `enable` for the rule.

    Args:
        model: A built `keras.Model`.
        exclude: Optional list of layer classes, layer names or name
            patterns (`"re:.*attention.*"`), as `keep_float32` takes them.
            Defaults to `None`.
        skip_small: Boolean. Whether small matmuls stay in 16 bits.
            Defaults to `True`.

    Returns:
        A list of dicts, one per Dense or EinsumDense layer: `layer` (path
        or name), `float8` (boolean), `reason` (why not, or `None`), `K`
        and `N` (the kernel's input and output features).

    Raises:
        TypeError: if `model` is not a `keras.Model`, or an entry of
            `exclude` is neither a string nor a layer class.
        ValueError: if `model` is not built, or `exclude` names a layer
            `model` does not have.

    Example:

    >>> inputs = keras.Input((2048,))
    >>> hidden = keras.layers.Dense(64, name="up")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden))
    >>> [(row["layer"], row["float8"]) for row in kmp.float8.plan(model)]
    [('up', True), ('head', False)]
    """
    _check_model(model, "kmp.float8.plan")
    _check_bool(skip_small, "skip_small")
    rules = _keep_float32._Float32Rules.parse(exclude, argument="exclude")
    rules.check_names(model, argument="exclude")
    return [
        {
            "layer": _keep_float32._layer_label(layer),
            "float8": reason is None,
            "reason": reason,
            "K": _float8_rule.matmul_features(layer)[0],
            "N": _float8_rule.matmul_features(layer)[1],
        }
        for layer, reason in _float8_rule.decisions(model, rules, skip_small)
    ]


def _check_model(model, caller):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{caller} takes a keras.Model. Received: model of type {type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            f"{caller} needs a built model: the rule reads each kernel's shape. "
            f"Build {model.name!r} first (model.build(input_shape), or call it "
            "on a batch), then call it. Received: an unbuilt model"
        )


def _check_bool(value, argument):
    if not isinstance(value, bool):
        raise TypeError(f"`{argument}` must be True or False. Received: {argument}={value!r}")


def enable(model, exclude=None, skip_small=True):
    """Makes `model`'s Dense and EinsumDense layers run float8 matmuls, by a stated rule.

    Float8 matmuls (e4m3 inputs and kernel, e5m2 output gradients, delayed
    scaling from a 1,024-step history of absolute maxima) run at twice
    bfloat16's peak on GPUs with float8 tensor cores (compute capability
    8.9 and above: L4, L40, H100, H200). The layers keep their policy
    (`mixed_bfloat16`, `mixed_float16`) for everything else: bias,
    activation, the other layers. The rule, as torchao's
    `convert_to_float8_training(module_filter_fn=...)` states its own:

    ```
    for each Dense / EinsumDense layer of the model:
        skip a subclass, a LoRA layer, a quantized layer
        skip a layer computing in float32 (kmp's float32 layers,
            keep_float32) or under a policy of its own (dtype=)
        skip the layers named by `exclude`
        skip an output layer (its output is a model output, directly or
            through layers without weights)
        skip unless K and N are multiples of 16
        skip a small matmul: K <= 1024 and N <= 4096 (unless skip_small=False)
        otherwise: layer.quantize("float8"), through Keras' Model.quantize
    ```
    `K` and `N` are the kernel's input and output features (an
    EinsumDense's contracted and output kernel axes). `kmp.summary(model)`
    then says which layers run float8 and why the others do not.

    Call it on a built model, before training (a built optimizer has no
    slots for the new variables). On a `kmp.Model` computing in float16,
    the loss scale multiplies the output gradients float8 records: see
    `rescale_gradient_amax`.

    Args:
        model: A built `keras.Model`.
        exclude: Optional list of layer classes, layer names or name
            patterns (`"re:.*attention.*"`, as `keep_float32` takes them):
            layers that stay in the 16-bit policy. Defaults to `None`.
        skip_small: Boolean. Whether small matmuls (K <= 1024 and
            N <= 4096) stay in 16 bits. Defaults to `True`; `False` is for
            tests and measurements on small models.

    Returns:
        The rows of `plan(model, ...)`, as they were applied: one dict per
        Dense or EinsumDense layer.

    Raises:
        TypeError: if `model` is not a `keras.Model`, `skip_small` is not a
            boolean, or an entry of `exclude` is neither a string nor a
            layer class. Nothing is changed.
        ValueError: if `model` is not built, its optimizer is built
            already, or `exclude` names a layer `model` does not have.
            Nothing is changed.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    ... # doctest: +ELLIPSIS
    <kmp.Policy 'mixed_bfloat16': ...>
    >>> inputs = keras.Input((2048,))
    >>> hidden = keras.layers.Dense(64, name="up")(inputs)
    >>> model = kmp.Model(inputs, keras.layers.Dense(10, name="head")(hidden))
    >>> rows = kmp.float8.enable(model)
    >>> model.get_layer("up").dtype_policy.name
    'float8_from_mixed_bfloat16'
    >>> _ = kmp.set_policy("float32")
    """
    _check_model(model, "kmp.float8.enable")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        raise ValueError(
            f"kmp.float8.enable must run before {model.name!r} trains: its "
            "optimizer is built, and has no slots for the float8 scales and "
            "histories. Call it before fit(), or on a fresh model. Received: "
            "a model whose optimizer is built"
        )
    rows = plan(model, exclude=exclude, skip_small=skip_small)
    chosen = {row["layer"] for row in rows if row["float8"]}
    targets = {
        id(layer)
        for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True)
        if isinstance(layer, _float8_rule._MATMUL_CLASSES)
        and layer.dtype_policy.quantization_mode is None
        and _keep_float32._layer_label(layer) in chosen
    }
    if targets:
        _quantize(model, targets)
        _float8_training.warn_if_not_recording(model, stacklevel=3)
    return rows


def _quantize(model, targets, filters=None):
    """`model.quantize("float8")` on the layers whose `id` is in `targets`.

    Keras' `Model.quantize` takes `filters` in its newer releases; before
    (Keras 3.10 among those kmp admits) it quantizes every layer, so this
    runs its loop over the chosen layers instead, and drops the train,
    test and predict functions as it does, to be made again.
    """
    if filters is None:
        filters = "filters" in inspect.signature(model.quantize).parameters
    if filters:
        model.quantize("float8", filters=lambda layer: id(layer) in targets)
        return
    for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True):
        if id(layer) in targets:
            layer.quantize("float8")
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def gradient_amax_variables(model):
    """The output-gradient amax histories and scales of `model`'s float8 layers.

    These are the float8 variables whose values carry the loss scale: the
    output gradient a float8 layer quantizes to e5m2 is a gradient of the
    scaled loss.

    Args:
        model: A `keras.Model`.

    Returns:
        A list of `(history, scale)` pairs of variables, one per float8
        layer: `outputs_grad_amax_history` (shape `(history_length,)`) and
        `outputs_grad_scale` (a scalar).
    """
    return [
        (layer.outputs_grad_amax_history, layer.outputs_grad_scale)
        for layer in float8_layers(model)
    ]


def rescale_gradient_amax(pairs, new_loss_scale, old_loss_scale):
    """The output-gradient amax histories and scales for a new loss scale.

    Under `mixed_float16` the output gradients a float8 layer records are
    gradients of the scaled loss: its `outputs_grad_amax_history` holds
    `loss_scale * max|g|` and its `outputs_grad_scale` follows it. When the
    loss scale backs off from `S` to `S / 2`, the next gradients are half
    those recorded: the scale, taken from the history's maximum for up to
    1,024 steps, is twice too large and the small gradients flush to zero
    in e5m2 (after `n` backoffs, `2**n` times too large). When it grows, the
    scale is too small until the larger gradients reach the history's
    maximum, a step or two later, and meanwhile the largest saturate at
    e5m2's maximum. Multiplying the histories and scales by `new / old` keeps them in the
    units of the gradients they will meet:

    ```
    ratio = new_loss_scale / old_loss_scale
    for history, scale in pairs:
        history <- history * ratio
        scale <- scale * ratio   if max(history) > 0
                 scale           otherwise (nothing recorded: Keras keeps
                                 the initial scale, so does this)
    ```
    Pure: it returns values, written with `keras.ops`, so it runs inside a
    compiled step on TensorFlow and JAX. A ratio of 1 returns the values
    unchanged (bit for bit).

    kmp's `LossScaleOptimizer` does this itself in every step of a
    `kmp.Model` (which registers the model's float8 layers with its scalers
    when it makes its train function), once per attempt, last in kmp's
    order of operations:
    ```
    scale loss -> gradients -> unscale -> finite check -> clip
      -> apply or skip (the float8 histories and scales are
         `overwrite_with_gradient` variables: applied with the weights,
         kept as they were on a skip)
      -> update the loss scale (old -> new)
      -> rescale the float8 output-gradient histories and scales   # here
    ```
    in `fit` and in a custom `train_step`. Call this (or
    `apply_loss_scale_change`) in a loop of your own, or around another
    scaler, Keras' own `LossScaleOptimizer`, with `old_loss_scale` the scale the
    step's loss was multiplied by and `new_loss_scale` the next step's; at a
    ratio of 1 (most steps) it multiplies by 1, exactly. Under bfloat16 or
    float32 (no loss scaling) it need not be called.

    Args:
        pairs: List of `(history, scale)` tensors or variables, as
            `gradient_amax_variables` gives them.
        new_loss_scale: Scalar tensor or number. The loss scale of the next
            step.
        old_loss_scale: Scalar tensor or number. The loss scale the recorded
            values were taken under.

    Returns:
        A list of `(history, scale)` float32 tensors, in the order given.

    Example:

    >>> pairs = [(keras.ops.array([1406.0, 700.0, 0.0]), keras.ops.array(0.0245))]
    >>> [(h, s)] = kmp.float8.rescale_gradient_amax(pairs, 4096.0, 8192.0)
    >>> keras.ops.convert_to_numpy(h).tolist()
    [703.0, 350.0, 0.0]
    """
    return _float8_training.rescale_gradient_amax(pairs, new_loss_scale, old_loss_scale)


def apply_loss_scale_change(model, new_loss_scale, old_loss_scale):
    """Rescales `model`'s float8 output-gradient histories and scales in place.

    `rescale_gradient_amax` on `gradient_amax_variables(model)`, assigned
    back: for a step that assigns variables (TensorFlow, or JAX outside a
    stateless step). See `rescale_gradient_amax` for where to call it.

    Args:
        model: A `keras.Model`.
        new_loss_scale: Scalar tensor or number. The next step's loss scale.
        old_loss_scale: Scalar tensor or number. The loss scale the recorded
            values were taken under.
    """
    pairs = gradient_amax_variables(model)
    for (history, scale), (new_history, new_scale) in zip(
        pairs, rescale_gradient_amax(pairs, new_loss_scale, old_loss_scale)
    ):
        history.assign(new_history)
        scale.assign(new_scale)
