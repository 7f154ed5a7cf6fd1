"""`kmp.float8`'s measurements: what float8 does to each float8 layer.

The formats' limits, `stats` (each quantized tensor's amax, scale and the
shares saturated or flushed to zero) and `compare` (each float8 layer's
output against its 16-bit and float32 output), re-exported by
`kmp/float8.py`; `Float8Monitor` (`kmp/monitor/_float8.py`) and
`kmp.diagnose` read them.
"""

import keras
import ml_dtypes
import numpy as np
from keras import ops

from kmp.precision import _keep_float32
from kmp.precision._float8_rule import float8_layers

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
