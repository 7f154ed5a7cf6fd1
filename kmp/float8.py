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
- `stats(model)` and `Float8Monitor`: per float8 layer, the amax of each
  quantized tensor and the share of values saturated at float8's maximum or
  flushed to zero.

Nothing here changes a Keras class or attribute: the layers are quantized
through Keras' own `Model.quantize("float8", filters=...)`.
"""

import inspect

import keras
import ml_dtypes
import numpy as np
from keras import ops

from kmp import _keras_internals
from kmp.precision import _float8_rule
from kmp.scaling import _step as _scaling_step
from kmp.precision import _keep_float32

# Public names of this module, defined with the rule.
from kmp.precision._float8_rule import DIMENSION_MULTIPLE  # noqa: F401
from kmp.precision._float8_rule import FILTER_RULE  # noqa: F401
from kmp.precision._float8_rule import SMALL_INPUT_FEATURES  # noqa: F401
from kmp.precision._float8_rule import SMALL_OUTPUT_FEATURES  # noqa: F401
from kmp.precision._float8_rule import float8_layers

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

# The largest finite values of the two float8 formats Keras uses.
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
E5M2_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)  # 57344
# The smallest positive (subnormal) values: anything below half of them
# rounds to zero.
E4M3_TINY = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).smallest_subnormal)  # 2**-9
E5M2_TINY = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).smallest_subnormal)  # 2**-16

# The three tensors each float8 layer quantizes: (variable prefix, format).
# Each float8 tensor of a layer: its format, and the layer's (public)
# attributes for its amax history and its scale.
_TENSORS = (
    ("inputs", "e4m3", "inputs_amax_history", "inputs_scale"),
    ("kernel", "e4m3", "kernel_amax_history", "kernel_scale"),
    ("outputs_grad", "e5m2", "outputs_grad_amax_history", "outputs_grad_scale"),
)
_FORMAT_LIMITS = {"e4m3": (E4M3_MAX, E4M3_TINY), "e5m2": (E5M2_MAX, E5M2_TINY)}
# Float8Monitor reports a tensor whose amax is more than this many times its
# scale's range: at least its top binade was clipped.
_RANGE_WARNING = 2.0


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

    kmp's `LossScaleOptimizer` does this itself in every step, once per
    attempt (a redone batch included), last in kmp's order of operations:
    ```
    scale loss -> gradients -> unscale -> finite check -> clip
      -> apply or skip (the float8 histories and scales are
         `overwrite_with_gradient` variables: applied with the weights,
         kept as they were on a skip)
      -> update the loss scale (old -> new)
      -> rescale the float8 output-gradient histories and scales   # here
    ```
    in `fit`, in a custom `train_step` and in a loop through its `apply`.
    Call this (or `apply_loss_scale_change`) only around another scaler,
    Keras' own `LossScaleOptimizer`, with `old_loss_scale` the scale the
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
    return _scaling_step.rescale_float8(pairs, new_loss_scale, old_loss_scale)


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


def _quantized_shares(values, scale, fmt):
    """`(saturated, flushed)`: the shares of `values` that quantizing with
    `scale` to `fmt` clips at its maximum, or rounds to zero (nonzero values
    only), exactly as Keras' `quantize_and_dequantize` does."""
    largest, tiny = _FORMAT_LIMITS[fmt]
    scaled = np.abs(np.asarray(values, np.float64)) / float(scale)
    count = max(scaled.size, 1)
    saturated = float(np.count_nonzero(scaled > largest)) / count
    # Below half the smallest subnormal, round-to-nearest-even gives zero.
    flushed = float(np.count_nonzero((scaled > 0) & (scaled <= tiny / 2))) / count
    return saturated, flushed


def _layer_inputs(model, layers, x):
    """The values each of `layers` received from `model` on `x`, or `None`
    per layer where the model has no graph to read them from."""
    try:
        tensors = [layer.input for layer in layers]
        extractor = keras.Model(model.inputs, tensors)
    except (AttributeError, ValueError):
        return [None] * len(layers)
    values = extractor.predict(x, verbose=0) if x is not None else None
    if len(layers) == 1:
        values = [values]
    return values


def stats(model, x=None):
    """What float8 does to each float8 layer's tensors, now.

    For each float8 layer and each tensor it quantizes (`inputs` and
    `kernel` to e4m3, `outputs_grad`, the output gradient, to e5m2):

    ```
    amax       the absolute maximum the last training step recorded
               (newest entry of `<tensor>_amax_history`)
    scale      the scale the next step quantizes with (`<tensor>_scale`)
    range_used amax / (scale * format max): above 1 the step saturated;
               2**-k means k binades of the format's range are unused at
               the top, and values that much smaller flush to zero
    saturated  share of values above scale * format max, clipped to it
    flushed    share of values that round to zero (nonzero before)
    ```
    `saturated` and `flushed` are exact for the kernel, and for the inputs
    of a functional model when `x` is given (the layer's inputs on `x`,
    quantized with the current scale, as Keras does); `None` otherwise. The
    output gradient's values are not seen outside the step: its `amax` and
    `range_used` say whether it saturated, and how far below the range it
    fell.

    Args:
        model: A `keras.Model`.
        x: Optional batch of inputs to measure the layers' inputs on.
            Defaults to `None`.

    Returns:
        A dict: layer path -> tensor name -> dict of the figures above
        (Python floats, or `None` where not measured).

    Example:

    >>> inputs = keras.Input((32,))
    >>> hidden = keras.layers.Dense(32, name="hidden")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    >>> _ = kmp.float8.enable(model, skip_small=False)
    >>> figures = kmp.float8.stats(model)["hidden"]["kernel"]
    >>> figures["saturated"], figures["amax"]
    (0.0, 0.0)
    """
    layers = float8_layers(model)
    inputs = _layer_inputs(model, layers, x) if layers else []
    report = {}
    for layer, layer_inputs in zip(layers, inputs):
        tensors = {}
        for name, fmt, history_attribute, scale_attribute in _TENSORS:
            largest = _FORMAT_LIMITS[fmt][0]
            history = ops.convert_to_numpy(getattr(layer, history_attribute))
            scale = float(ops.convert_to_numpy(getattr(layer, scale_attribute)))
            amax = float(history[0])
            values = {"inputs": layer_inputs, "kernel": None, "outputs_grad": None}[name]
            if name == "kernel":
                values = ops.convert_to_numpy(layer.kernel)
            saturated, flushed = (
                _quantized_shares(values, scale, fmt) if values is not None else (None, None)
            )
            tensors[name] = {
                "amax": amax,
                "scale": scale,
                "range_used": amax / (scale * largest),
                "saturated": saturated,
                "flushed": flushed,
            }
        report[_keep_float32._layer_label(layer)] = tensors
    return report


def _unquantized_output(layer, inputs, dtype):
    """What `layer` (a float8 Dense or EinsumDense) computes on `inputs`
    without float8: its matmul, bias and activation in `dtype`."""
    inputs = ops.cast(inputs, dtype)
    kernel = ops.cast(layer.kernel, dtype)
    if isinstance(layer, keras.layers.EinsumDense):
        outputs = ops.einsum(layer.equation, inputs, kernel)
    else:
        outputs = ops.matmul(inputs, kernel)
    if layer.bias is not None:
        outputs = ops.add(outputs, ops.cast(layer.bias, dtype))
    if layer.activation is not None:
        outputs = layer.activation(outputs)
    return ops.convert_to_numpy(ops.cast(outputs, "float32")).astype(np.float64)


def compare(model, x, tolerance=0.1):
    """How far each float8 layer's output is from its 16-bit and float32 output.

    For each float8 layer of a functional model, on the inputs it receives
    from `x`: its output as trained (float8, with the scales it has now), the
    same layer computed without float8 in its policy's compute dtype, and in
    float32. The errors are relative to the float32 output:

    ```
    error(y) = ||y - y_float32|| / ||y_float32||     (Frobenius norms)
    float8_error   = error(the float8 output)
    sixteen_bit_error = error(the layer without float8, in 16 bits)
    flagged        = float8_error > tolerance
    ```
    e4m3 keeps 3 mantissa bits: its rounding alone gives errors of a few
    percent. Far above that, inputs or kernel saturate or flush to zero
    (an outlier sets the scale, and the rest of the values fall below
    e4m3's range): leave the layer in 16 bits with `enable(...,
    exclude=[name])`.

    Args:
        model: A functional `keras.Model` with float8 layers.
        x: A batch of the model's inputs.
        tolerance: Float > 0. The float8 error above which a layer is
            flagged. Defaults to `0.1`.

    Returns:
        A list of dicts, one per float8 layer: `layer`, `float8_error`,
        `sixteen_bit_error`, `flagged`.

    Raises:
        ValueError: if `tolerance` is not a positive number, or `model` has
            no graph to read its layers' inputs from.

    Example:

    >>> inputs = keras.Input((32,))
    >>> hidden = keras.layers.Dense(32, name="hidden")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    >>> _ = kmp.float8.enable(model, skip_small=False)
    >>> x = np.random.default_rng(0).uniform(0.5, 1.0, size=(8, 32)).astype("float32")
    >>> [row] = kmp.float8.compare(model, x)
    >>> row["layer"], row["float8_error"] < 0.1, row["flagged"]
    ('hidden', True, False)
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance <= 0:
        raise ValueError(
            f"`tolerance` must be a positive number. Received: tolerance={tolerance!r}"
        )
    layers = float8_layers(model)
    if not layers:
        return []
    inputs = _layer_inputs(model, layers, x)
    if inputs[0] is None:
        raise ValueError(
            "kmp.float8.compare reads each float8 layer's inputs from the model's "
            f"graph, and {model.name!r} has none (a subclassed model). Received: "
            f"model of type {type(model).__name__}"
        )
    rows = []
    for layer, layer_inputs in zip(layers, inputs):
        reference = _unquantized_output(layer, layer_inputs, "float32")
        sixteen_bit = _unquantized_output(layer, layer_inputs, layer.compute_dtype)
        float8 = ops.convert_to_numpy(
            ops.cast(layer(layer_inputs, training=False), "float32")
        ).astype(np.float64)
        norm = max(float(np.linalg.norm(reference)), np.finfo(np.float64).tiny)
        float8_error = float(np.linalg.norm(float8 - reference)) / norm
        rows.append({
            "layer": _keep_float32._layer_label(layer),
            "float8_error": float8_error,
            "sixteen_bit_error": float(np.linalg.norm(sixteen_bit - reference)) / norm,
            "flagged": float8_error > tolerance,
        })
    return rows


@keras.saving.register_keras_serializable(package="kmp")
class Float8Monitor(keras.callbacks.Callback):
    """Reports what float8 does to each float8 layer, every epoch.

    At the end of each epoch it reads `kmp.float8.stats(model, x)` (no work
    in the train step: the amax histories are Keras' own variables), keeps
    the figures in `history`, writes them to `csv_path` and, for each
    tensor that saturated or flushed more than `warn_share` of its values
    (or whose recorded amax exceeded its scale's range), says so once per
    epoch through `print_fn`.

    Args:
        x: Optional batch of inputs on which to measure each float8 layer's
            inputs (a functional model). Defaults to `None`: the inputs'
            amax and range only.
        csv_path: Optional path of a CSV file, one row per epoch, layer and
            tensor: `epoch, layer, tensor, amax, scale, range_used,
            saturated, flushed`. Defaults to `None`.
        warn_share: Float in [0, 1]. The share of saturated or flushed
            values above which a tensor is reported. Defaults to `0.01`.
        print_fn: Optional callable taking one string. Defaults to `print`.

    Attributes:
        history: List of `(epoch, stats)` pairs, `stats` as
            `kmp.float8.stats` returns it.

    Raises:
        ValueError: if `warn_share` is not in [0, 1].

    Example:

    ```python
    monitor = kmp.float8.Float8Monitor(x=x_train[:256], csv_path="float8.csv")
    model.fit(x_train, y_train, epochs=3, callbacks=[monitor])
    monitor.history[-1][1]["dense"]["outputs_grad"]["range_used"]
    ```
    """

    CSV_COLUMNS = (
        "epoch", "layer", "tensor", "amax", "scale", "range_used", "saturated", "flushed"
    )

    def __init__(self, x=None, csv_path=None, warn_share=0.01, print_fn=None):
        super().__init__()
        if isinstance(warn_share, bool) or not isinstance(warn_share, (int, float)) or not (
            0.0 <= warn_share <= 1.0
        ):
            raise ValueError(
                f"`warn_share` must be a number in [0, 1]. Received: warn_share={warn_share!r}"
            )
        self.x = x
        self.csv_path = csv_path
        self.warn_share = float(warn_share)
        self.print_fn = print_fn or print
        self.history = []

    def get_config(self):
        """The constructor's arguments but `x` and `print_fn` (data and a
        callable: not configuration)."""
        return {"csv_path": self.csv_path, "warn_share": self.warn_share}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def on_train_begin(self, logs=None):
        self.history = []
        if self.csv_path is not None:
            with open(self.csv_path, "w", encoding="utf-8") as file:
                file.write(",".join(self.CSV_COLUMNS) + "\n")

    def on_epoch_end(self, epoch, logs=None):
        figures = stats(self.model, self.x)
        self.history.append((epoch, figures))
        lines = []
        for layer, tensors in figures.items():
            for tensor, values in tensors.items():
                problems = [
                    f"{values[key]:.1%} {key}"
                    for key in ("saturated", "flushed")
                    if values[key] is not None and values[key] > self.warn_share
                ]
                if values["range_used"] > _RANGE_WARNING:
                    problems.append(
                        f"amax {values['amax']:.4g} is {values['range_used']:.1f}x "
                        "the scale's range (a binade or more saturated)"
                    )
                if problems:
                    lines.append(f"  {layer} {tensor}: {', '.join(problems)}")
        if lines:
            self.print_fn(f"Float8Monitor, epoch {epoch + 1}:\n" + "\n".join(lines))
        if self.csv_path is not None:
            with open(self.csv_path, "a", encoding="utf-8") as file:
                for layer, tensors in figures.items():
                    for tensor, values in tensors.items():
                        cells = [str(epoch + 1), layer, tensor] + [
                            "" if values[key] is None else repr(values[key])
                            for key in self.CSV_COLUMNS[3:]
                        ]
                        file.write(",".join(cells) + "\n")


# Float8 tensor cores: NVIDIA compute capability 8.9 (Ada) and above.
FLOAT8_COMPUTE_CAPABILITY = (8, 9)


def _has_float8_tensor_cores(compute_capability):
    """Whether a GPU of `compute_capability` (`"9.0"`, `(9, 0)` or `None`)
    has float8 tensor cores."""
    if compute_capability is None:
        return False
    if isinstance(compute_capability, str):
        major, _, minor = compute_capability.partition(".")
        compute_capability = (int(major), int(minor or 0))
    return tuple(compute_capability) >= FLOAT8_COMPUTE_CAPABILITY


def _matmul_step(n, float8):
    """`step()`: an `n`x`n` @ `n`x`n` matmul by a `Dense` layer under
    `mixed_bfloat16`, in float8 (Keras' float8 path, inference: inputs and
    kernel quantized to e4m3) or not, compiled by XLA; `step()` returns a
    Python float (the sum of the output), so it waits for the device.

    What `kmp doctor` times on a GPU with float8 tensor cores: XLA rewrites
    the quantize-dequantize around the matmul into one float8 GEMM there.
    """
    inputs = keras.Input((n,), batch_size=n)
    dense = keras.layers.Dense(n, use_bias=False, dtype="mixed_bfloat16")
    outputs = keras.layers.Lambda(lambda y: ops.sum(ops.cast(y, "float32")))(dense(inputs))
    model = keras.Model(inputs, outputs)
    if float8:
        dense.quantize("float8")
    model.compile(jit_compile=True)
    x = np.random.default_rng(0).normal(size=(n, n)).astype("float32")
    return lambda: float(np.asarray(model.predict_on_batch(x)))
