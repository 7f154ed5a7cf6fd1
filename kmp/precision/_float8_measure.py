"""`kmp.float8`'s measurements: what float8 does to each float8 layer.

`stats` (each quantized tensor's amax, scale and the shares saturated or
flushed to zero; the output gradient's through the probe step of
`_float8_probe.py`) and `compare` (each float8 layer's output against its
16-bit and float32 output), re-exported by `kmp/float8.py`;
`Float8Monitor` (`kmp/monitor/_float8.py`) and `kmp.diagnose` read them.
"""

import keras
import numpy as np
from keras import ops

from kmp.precision import _float8_probe
from kmp.precision import _keep_float32
from kmp.precision._float8_formats import FORMAT_LIMITS
from kmp.precision._float8_formats import TENSORS
from kmp.precision._float8_rule import float8_layers


def _quantized_shares(values, scale, fmt):
    """`(saturated, flushed)`: the shares of `values` that quantizing with
    `scale` to `fmt` clips at its maximum, or rounds to zero (nonzero values
    only), exactly as Keras' `quantize_and_dequantize` does."""
    largest, tiny = FORMAT_LIMITS[fmt]
    scaled = np.abs(np.asarray(values, np.float64)) / float(scale)
    count = max(scaled.size, 1)
    saturated = float(np.count_nonzero(scaled > largest)) / count
    # Below half the smallest subnormal, round-to-nearest-even gives zero.
    flushed = float(np.count_nonzero((scaled > 0) & (scaled <= tiny / 2))) / count
    return saturated, flushed


def _layer_inputs(model, layers, x):
    """The values each of `layers` received from `model` on `x`; `None` for
    every layer without `x`, and for a layer whose inputs the model's graph
    does not hold: in a model without a graph, a float8 layer inside
    another layer (called by that layer's own `call`), a layer called more
    than once."""
    if x is None:
        return [None] * len(layers)
    tensors = {}
    for index, layer in enumerate(layers):
        try:
            # Raises unless the layer's one input is reachable from the model's.
            keras.Model(model.inputs, layer.input)
        except (AttributeError, ValueError):
            continue
        tensors[index] = layer.input
    if not tensors:
        return [None] * len(layers)
    values = keras.Model(model.inputs, list(tensors.values())).predict(x, verbose=0)
    if not isinstance(values, (list, tuple)):
        values = [values]
    found = dict(zip(tensors, values))
    return [found.get(index) for index in range(len(layers))]


def stats(model, x=None, y=None, loss=None):
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
    `saturated` and `flushed` are measured, with the current scales, as
    Keras quantizes:

    - `kernel`: always, on the kernel itself.
    - `inputs`: when `x` is given to a functional or Sequential model, on
      the layer's inputs from `x`, read from the model's graph: not for a
      float8 layer inside another layer (a `MultiHeadAttention`'s
      projections), whose inputs the graph does not hold.
    - `outputs_grad`: when `x` and `y` are given to a compiled (or given
      `loss`) functional or Sequential model, by a probe training step on
      `(x, y)`: one step of a copy of the model (the model itself is not
      changed) whose loss is multiplied by the current loss scale, as the
      scaled step's is, and which counts the gradient each float8 layer's
      matmul output receives against its `outputs_grad_scale`. The loss
      averages over the batch, so give a batch of the training batch size:
      a larger one has smaller gradients. Float8 layers inside another
      layer (a `MultiHeadAttention`'s projections, the Dense layers of a
      custom layer) are measured too: the probe taps every float8 layer
      of its copy, at any depth.

    `None` where not measured. Without the probe, the output gradient's
    `amax` and `range_used` (from its history) say whether the last step
    saturated and how far below the range it fell, not which share.

    Args:
        model: A `keras.Model`.
        x: Optional batch of inputs to measure the layers' inputs (and, with
            `y`, the output gradients) on. Defaults to `None`.
        y: Optional targets of `x`, for the output gradients. Defaults to
            `None`.
        loss: Optional loss for the probe step, as `compile` takes it.
            Defaults to `None`: the model's compiled loss.

    Returns:
        A dict: layer path -> tensor name -> dict of the figures above
        (Python floats, or `None` where not measured).

    Raises:
        ValueError: if `y` is given without `x`, or the probe step cannot
            run (the model has no loss, or cannot be copied).

    Example:

    >>> inputs = keras.Input((32,))
    >>> hidden = keras.layers.Dense(32, name="hidden")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    >>> _ = kmp.float8.enable(model, skip_small=False)
    >>> figures = kmp.float8.stats(model)["hidden"]["kernel"]
    >>> figures["saturated"], figures["amax"]
    (0.0, 0.0)
    """
    if y is not None and x is None:
        raise ValueError(
            "kmp.float8.stats measures the output gradients on a batch `(x, y)`: "
            "`y` needs `x`. Received: x=None and y given"
        )
    probe = _float8_probe.OutputGradientProbe(model, loss) if y is not None else None
    return measure(model, x, y, probe)


def measure(model, x, y, probe):
    """`stats(model, x, y)`, the output gradients measured by `probe` (an
    `OutputGradientProbe` of `model`, kept by a caller that measures
    again), or not measured when `probe` is `None`."""
    layers = float8_layers(model)
    inputs = _layer_inputs(model, layers, x) if layers else []
    gradients = probe.measure(x, y) if probe is not None and layers else {}
    report = {}
    for layer, layer_inputs in zip(layers, inputs):
        label = _keep_float32._layer_label(layer)
        tensors = {}
        for name, fmt, history_attribute, scale_attribute in TENSORS:
            largest = FORMAT_LIMITS[fmt][0]
            history = ops.convert_to_numpy(getattr(layer, history_attribute))
            scale = float(ops.convert_to_numpy(getattr(layer, scale_attribute)))
            amax = float(history[0])
            if name == "outputs_grad":
                saturated, flushed = gradients.get(label, (None, None))
            else:
                values = layer_inputs if name == "inputs" else ops.convert_to_numpy(layer.kernel)
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
        report[label] = tensors
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
            no graph to read its layers' inputs from (a subclassed model),
            or a float8 layer's inputs are not in it (one inside another
            layer, or called more than once).

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
    if getattr(model, "inputs", None) is None:
        raise ValueError(
            "kmp.float8.compare reads each float8 layer's inputs from the model's "
            f"graph, and {model.name!r} has none (a subclassed model). Received: "
            f"model of type {type(model).__name__}"
        )
    unread = [_keep_float32._layer_label(layer)
              for layer, value in zip(layers, inputs) if value is None]
    if unread:
        raise ValueError(
            "kmp.float8.compare reads each float8 layer's inputs from the model's "
            "graph, which does not hold them for a float8 layer inside another "
            "layer (a MultiHeadAttention's projections) or one called more than "
            "once; `kmp.float8.stats(model, x, y)` measures their output "
            f"gradients. Received: such float8 layers {unread}"
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
