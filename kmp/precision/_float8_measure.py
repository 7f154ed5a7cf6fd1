"""`kmp.float8`'s measurements: what float8 does to each float8 layer.

`stats` (each quantized tensor's amax, scale and the shares saturated or
flushed to zero) and `compare` (each float8 layer's output against its
16-bit and float32 output), re-exported by `kmp/float8.py`; what a float8
layer receives and returns, and its output gradient, are read at any depth
in the tapped copy of `_float8_probe.py`. `Float8Monitor`
(`kmp/monitor/_float8.py`) and `kmp.diagnose` read them.
"""

import keras
import numpy as np
from keras import ops

from kmp.precision import _float8_probe
from kmp.precision import _keep_float32
from kmp.precision._float8_formats import FORMAT_LIMITS
from kmp.precision._float8_formats import TENSORS
from kmp.precision._float8_training import float8_layers


def _quantized_shares(values, scale, fmt):
    """`(saturated, flushed)`: the shares of `values` that quantizing with
    `scale` to `fmt` clips at its maximum, or rounds to zero (nonzero values
    only), exactly as Keras' `quantize_and_dequantize` does (a scale of 0
    clips every nonzero value)."""
    largest, tiny = FORMAT_LIMITS[fmt]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.abs(np.asarray(values, np.float64)) / float(scale)
    count = max(scaled.size, 1)
    saturated = float(np.count_nonzero(scaled > largest)) / count
    # Below half the smallest subnormal, round-to-nearest-even gives zero.
    flushed = float(np.count_nonzero((scaled > 0) & (scaled <= tiny / 2))) / count
    return saturated, flushed


def probe_for(model, x, y, loss=None):
    """The `Float8Probe` that measures `stats(model, x, y)`: `None` without
    `x`."""
    if x is None:
        return None
    return _float8_probe.Float8Probe(model, loss)


def _inputs_of(calls):
    """The inputs of all of a layer's calls, flattened into one array;
    `None` for a layer not called."""
    if not calls:
        return None
    return np.concatenate([np.ravel(inputs) for inputs, _ in calls])


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
    - `inputs`: when `x` is given, on what the layer's matmul receives
      from `x` (in its compute dtype), all its calls together: read in a
      forward pass of a copy of the model
      (the model itself is not changed) whose float8 layers, at any depth,
      keep their inputs, so the layers inside another layer (a
      `MultiHeadAttention`'s projections, the Dense layers of a custom
      layer) are measured as the others are.
    - `outputs_grad`: when `x` and `y` are given to a compiled (or given
      `loss`) model, by a probe training step on `(x, y)`: one step of the
      same copy whose loss is multiplied by the
      current loss scale, as the scaled step's is, and which counts the
      gradient each float8 layer's matmul output receives against its
      `outputs_grad_scale`, at any depth. The loss averages over the
      batch, so give a batch of the training batch size: a larger one has
      smaller gradients.

    The copy is made by `keras.models.clone_model` (a functional or
    Sequential model, each layer from its config), or, for a subclassed
    model, from the model's config, built on the first row of `x`, its
    layers paired with the model's in the order the model tracks them.
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
        ValueError: if `y` is given without `x`, the model cannot be
            copied and `y` is given (with `x` alone its inputs' shares are
            `None`, with a warning), or the probe step has no loss.

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
    return measure(model, x, y, probe_for(model, x, y, loss))


def measure(model, x, y, probe):
    """`stats(model, x, y)`, the inputs and output gradients measured by
    `probe` (`probe_for(model, x, y)`, kept by a caller that measures
    again), or not measured when `probe` is `None`."""
    layers = float8_layers(model)
    # Without `y` only the inputs are asked for, which kmp read from the
    # model's graph before it read them in a copy: a model the probe cannot
    # copy gets them as not measured, with a warning, rather than an error
    # (at every epoch's end of a Float8Monitor's fit).
    calls = probe.layer_calls(x, required=y is not None) if probe is not None and layers else {}
    # `layer_calls` copied the weights into the probe's copy: once per reading.
    gradients = (
        probe.output_gradients(x, y, copy_weights=False)
        if probe is not None and y is not None and layers else {}
    )
    report = {}
    for layer in layers:
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
                values = (
                    _inputs_of(calls.get(label)) if name == "inputs"
                    else ops.convert_to_numpy(layer.kernel)
                )
                saturated, flushed = (
                    _quantized_shares(values, scale, fmt) if values is not None else (None, None)
                )
            tensors[name] = {
                "amax": amax,
                "scale": scale,
                "range_used": _range_used(amax, scale * largest),
                "saturated": saturated,
                "flushed": flushed,
            }
        report[label] = tensors
    return report


def _range_used(amax, top):
    """`amax / top`; with a scale of 0 (Keras' float8 layer on JAX after a
    step that did not record: its scale overwritten with a zero
    "gradient"), infinite, or NaN where the amax is 0 too."""
    if top:
        return amax / top
    return float("inf") if amax else float("nan")


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

    For each float8 layer of a model, at any depth
    (a `MultiHeadAttention`'s projections, the Dense layers of a custom
    layer included), on the inputs its matmul receives from `x` (in its
    compute dtype): its output as trained (float8, with the scales it has
    now), the same layer computed without float8 in its policy's compute
    dtype, and in float32. The inputs and float8 outputs are read in a
    forward pass of a copy of the model whose float8 layers keep them (the
    model itself is not changed). The errors are relative to the float32
    output, over all the layer's calls together:

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
        model: A `keras.Model` with float8 layers (functional, Sequential,
            or subclassed and made again by `from_config(get_config())`).
        x: A batch of the model's inputs.
        tolerance: Float > 0. The float8 error above which a layer is
            flagged. Defaults to `0.1`.

    Returns:
        A list of dicts, one per float8 layer called on `x`: `layer`,
        `float8_error`, `sixteen_bit_error`, `flagged`.

    Raises:
        ValueError: if `tolerance` is not a positive number, or `model`
            cannot be copied (a layer, or a subclassed model, that
            `from_config(get_config())` does not make again).

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
    if not float8_layers(model):
        return []
    return compare_calls(model, _float8_probe.Float8Probe(model).layer_calls(x), tolerance)


def compare_calls(model, calls, tolerance=0.1):
    """`compare`'s rows from `calls`, `Float8Probe(model).layer_calls(x)`."""
    rows = []
    for layer in float8_layers(model):
        label = _keep_float32._layer_label(layer)
        if not calls.get(label):
            continue
        # Squared Frobenius norms, summed over the layer's calls.
        reference_norm = float8_norm = sixteen_bit_norm = 0.0
        for inputs, float8 in calls[label]:
            reference = _unquantized_output(layer, inputs, "float32")
            sixteen_bit = _unquantized_output(layer, inputs, layer.compute_dtype)
            reference_norm += float(np.sum(np.square(reference)))
            float8_norm += float(np.sum(np.square(float8.astype(np.float64) - reference)))
            sixteen_bit_norm += float(np.sum(np.square(sixteen_bit - reference)))
        norm = max(np.sqrt(reference_norm), np.finfo(np.float64).tiny)
        float8_error = float(np.sqrt(float8_norm) / norm)
        rows.append({
            "layer": label,
            "float8_error": float8_error,
            "sixteen_bit_error": float(np.sqrt(sixteen_bit_norm) / norm),
            "flagged": float8_error > tolerance,
        })
    return rows
