"""Diagnosis: which layer overflows in 16 bits, in which direction, and what to change.

`diagnose` runs a few forward and backward passes of a copy of the model in
float32 and in the reduced compute dtype (no weight update), measures every
layer against float16's range, and checks the model's code for the usual
hazards (tiny epsilons, -1e9 masks, exponentials and sums of squares in
float16, float token ids rounded by a 16-bit cast, 16-bit outputs) without
any data.

This module checks the arguments and copies the model; the measurements are
in `kmp/diagnosis/_probe.py` (its forward and backward passes in the backend's
`kmp/backends/<backend>/probe.py`), the static checks in
`kmp/diagnosis/_static.py` and the report in `kmp/diagnosis/_report.py`.
"""

import keras

from kmp import _keras_internals
from kmp import backends
from kmp import policy as policy_module
from kmp.diagnosis import _probe as _diagnose_probe
from kmp.diagnosis._float16 import FLOAT16_MAX  # noqa: F401 (this module's name since 0.1)
from kmp.diagnosis._float16 import FLOAT16_SMALLEST_NORMAL  # noqa: F401
from kmp.diagnosis._report import DiagnosisReport
from kmp.diagnosis._static import static_findings
from kmp.precision import _float8_measure
from kmp.precision import _float8_probe
from kmp.precision._float8_formats import TENSORS as _FLOAT8_TENSORS
from kmp.precision._float8_training import float8_layers
from kmp.precision._float8_rule import without_float8


def diagnose(model, data=None, steps=1, loss=None, policy=None, loss_scale=None):
    """Finds where a model overflows or underflows in 16 bits, and what to change.

    Runs `steps` forward and backward passes (no weight update) of two copies
    of `model`: one computing in float32, one in the reduced compute dtype of
    `policy`. The user's model is never changed (weights, optimizer, dtype
    policies). Layers run with `training=False`, so dropout and batch
    statistics do not differ between the two passes.

    "Gradient" means the gradient of the loss times the loss scale with
    respect to each layer's output and each of its trainable weights; a
    layer's gradient values are both together. Shares of float16 overflow
    (`|x| >= 65520`, the values that round to inf; float16's largest finite
    value is 65504), of values flushed to zero (`0 < |x| <= 2**-25`) and of
    subnormals (`2**-25 < |x| < 2**-14`, after rounding) are measured on the
    float32 values, so they say what float16 would do to the true values:

    ```
    for each layer, in execution order:
        activations: max |y|, share overflowing / zero / subnormal (scale 1)
        gradients:   max |g|, share of |g * loss_scale| overflowing / zero /
                     subnormal
        rel_error:   ||y_reduced - y_float32|| / ||y_float32||
    first_nonfinite: first layer whose reduced output is not finite
                     ("forward"); else, if the loss is finite, the layer
                     nearest the loss with a non-finite gradient ("backward")
    first_inaccurate: first layer whose reduced output is finite but has
                     rel_error > 0.1 (it overflowed inside, e.g. x / sqrt(inf))
    recommended_loss_scale = largest S = 2**k, -24 <= k <= 24, with
                             max |g_float32| * S < 65520
    recommended_policy: the reduced policy if float16's range fits (no
        activation overflows, the float16 forward pass is finite, no layer
        output is more than 10% off float32, S >= 1, at most 1% of gradient
        values flushed to zero at S); else mixed_bfloat16 if the hardware
        runs bfloat16, else float32
    ```

    A model with float8 layers (`kmp.float8`) is measured above in its
    16-bit policy, float8 aside; then each float8 layer, at any depth (a
    `MultiHeadAttention`'s projections included), is compared with
    `kmp.float8.compare` on what its matmul receives from each batch, read
    in a copy of the model (the worst batch kept):

    ```
    for each float8 layer:
        float8_error      = ||y_float8 - y_float32|| / ||y_float32||, with
                            the scales the model holds now
        sixteen_bit_error = the same without float8, in the 16-bit policy
        flagged           = float8_error > 0.1
    float8_fix: "kmp.float8.enable(model, exclude=[<flagged layers>])"
    ```
    Float8's scales come from training (delayed scaling): diagnose a model
    that has trained, at least a few steps, on data like `data`.

    The float32 gradients of all `steps` batches are held in host memory
    (one float32 copy) to measure the underflow at the recommended scale:
    diagnose on a few batches, not an epoch.

    Static checks run with or without data: epsilons below float16's
    smallest normal (6.1e-5) in layers that add them in float16, constants
    that overflow float16 (a `-1e9` mask) in custom layers, custom layers
    that compute an exponential, softmax, norm or sum of squares in float16
    without a cast to float32, token ids fed as floats that a 16-bit cast
    rounds before an embedding (`"token ids"`: float16 holds integers
    exactly only up to 2048, bfloat16 up to 256), and model outputs that are
    not float32.

    Args:
        model: A built functional or `Sequential` `keras.Model` (a
            `kmp.Model(inputs, outputs)` included).
        data: Optional. A tuple `(x, y)` (one batch), or an iterable of
            `(x, y)` or `(x, y, sample_weight)` batches such as a
            `tf.data.Dataset` (sample weights are ignored). Defaults to
            `None`: only the static checks run.
        steps: Int >= 1. How many batches to take from an iterable. Defaults
            to `1`.
        loss: Optional loss: a name, a `keras.losses.Loss` or a callable
            `loss(y_true, y_pred)`; a list for a model with several outputs.
            Defaults to `None`: the loss the model was compiled with.
        policy: Optional policy name (`"mixed_float16"`, `"mixed_bfloat16"`)
            or `kmp.Policy`. Defaults to `None`: the model's own 16-bit layer
            dtypes if it has any, else the active global policy if it is
            16-bit, else `"mixed_float16"`.
        loss_scale: Optional float. The loss scale to measure gradients at.
            Defaults to `None`: the model's `kmp.LossScaleOptimizer`'s
            current scale if it has one, else `2**15` (kmp's initial scale)
            for float16 and `1` otherwise.

    Returns:
        A `kmp.DiagnosisReport`; `print` it for a table.
        `report.layers` rows have the keys `name`, `class_name`,
        `compute_dtype`, `max_abs_activation`, `activation_overflow`,
        `activation_zero`, `activation_subnormal`, `max_abs_gradient`,
        `gradient_overflow`, `gradient_zero`, `gradient_subnormal`,
        `rel_error`, and `activation_nonfinite` and `gradient_nonfinite`
        (whether the reduced pass's outputs, or its gradients at the loss
        scale, were ever non-finite).
        `report.float8` has one row per float8 layer (`layer`,
        `float8_error`, `sixteen_bit_error`, `flagged`) and
        `report.float8_fix` the call that leaves the flagged ones in 16
        bits (`None` when none is flagged, or the model has no float8 layer).

    Raises:
        ValueError: if `steps` < 1, `model` is not a built functional or
            Sequential model, `data` is not one of the forms above, no loss
            is given for an uncompiled model, or `policy` is not a 16-bit
            policy.
        NotImplementedError: on a Keras backend other than TensorFlow.

    Example:

    ```python
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="big")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    model = keras.Model(inputs, outputs)
    model.get_layer("big").kernel.assign(np.full((4, 8), 1e5))
    x, y = np.ones((2, 4)), np.zeros((2, 1))
    report = kmp.diagnose(model, (x, y), loss="mse", policy="mixed_float16")
    print(report)               # the table
    report.first_nonfinite      # {'layer': 'big', 'tensor': 'output', 'direction': 'forward'}
    report.to_json("report.json")
    ```
    """
    # Before anything else, so a backend without the probe (JAX) says so
    # whatever the arguments.
    backends.get("probe").check_supported()
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}")
    _check_model(model)
    target = _target_policy(model, policy)
    keep_own_dtypes = policy is None and _has_16bit_layers(model)
    reduced = _clone(model, lambda layer: _reduced_dtype(layer, target, model, keep_own_dtypes))
    findings = static_findings(model, reduced)
    if loss_scale is None:
        loss_scale = _current_loss_scale(model, target)
    loss_scale = float(loss_scale)
    has_bf16 = _diagnose_probe.hardware_has_bfloat16()
    if data is None:
        name, reason = _diagnose_probe.recommend_policy(target, None, has_bf16)
        return DiagnosisReport(
            policy=target, loss_scale=loss_scale, steps=0,
            loss={"float32": None, "reduced": None}, layers=[],
            first_nonfinite=None, first_inaccurate=None,
            recommended_loss_scale=None,
            underflow_at_recommended={"zero": None, "subnormal": None},
            recommended_policy=name, policy_reason=reason, findings=findings,
        )
    loss_fns = _loss_functions(model, loss)
    batches = _batches(data, steps)
    full = _clone(model, lambda layer: "float32")
    measured = _diagnose_probe.measure(full, reduced, batches, loss_fns, loss_scale)
    name, reason = _diagnose_probe.recommend_policy(target, measured, has_bf16)
    return DiagnosisReport(
        policy=target, loss_scale=loss_scale, steps=len(batches), **measured,
        recommended_policy=name, policy_reason=reason, findings=findings,
        float8=_float8_rows(model, batches),
    )


# --- arguments and model copies --------------------------------------


def _check_model(model):
    functional = _keras_internals.Functional
    if not isinstance(model, (functional, keras.Sequential)):
        raise ValueError(
            "`model` must be a functional or Sequential keras.Model (diagnose "
            "reads each layer's output from the graph). Received: model of "
            f"type {type(model).__name__}"
        )
    if not model.built or not getattr(model, "inputs", None):
        raise ValueError(
            "`model` must be built with known inputs (start it with "
            f"keras.Input). Received: model={model.name!r}, not built"
        )


def _has_16bit_layers(model):
    return any(
        layer.compute_dtype in ("float16", "bfloat16")
        for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True)
    )


def _target_policy(model, policy):
    if policy is None:
        dtypes = {
            layer.compute_dtype
            for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True)
        }
        if "float16" in dtypes:
            return "mixed_float16"
        if "bfloat16" in dtypes:
            return "mixed_bfloat16"
        active = policy_module.get_policy()
        if active.compute_dtype in ("float16", "bfloat16"):
            return (
                "mixed_float16" if active.compute_dtype == "float16" else "mixed_bfloat16"
            )
        return "mixed_float16"
    name = policy.name if isinstance(policy, policy_module.Policy) else policy
    if name not in ("mixed_float16", "mixed_bfloat16"):
        raise ValueError(
            "`policy` must be 'mixed_float16', 'mixed_bfloat16' or None. "
            f"Received: policy={policy!r}"
        )
    return name


def _reduced_dtype(layer, target, model, keep_own_dtypes):
    if keep_own_dtypes:
        # A float8 layer is measured in its 16-bit policy: float8 is compared
        # apart (`_float8_rows`).
        if layer.dtype_policy.quantization_mode == "float8":
            return without_float8(layer.dtype_policy)
        return None
    if _computes_in_float32_in_kmp(layer, model):
        return "float32"
    return target


def _computes_in_float32_in_kmp(layer, model):
    """Whether a `kmp.Model` runs `layer` in float32 (kmp's list, `keep_float32`)."""
    from kmp.model import Model

    if not isinstance(model, Model):
        return False
    rules = (
        policy_module._builtin_rules()
        + policy_module._global_keep_float32
        + getattr(model, "_kmp_keep_float32", None)
    )
    return rules.match(layer) is not None


def _clone(model, dtype_for):
    """A copy of `model` with the weights copied and each layer's dtype chosen."""

    def clone_layer(layer):
        if isinstance(layer, keras.Model):
            return keras.models.clone_model(layer, clone_function=clone_layer)
        config = layer.get_config()
        dtype = dtype_for(layer)
        if dtype is not None:
            config["dtype"] = dtype
        try:
            return layer.__class__.from_config(config)
        except Exception as error:
            raise ValueError(
                f"`diagnose` copies the model and cannot copy layer "
                f"{layer.name!r} ({type(layer).__name__}) from its config: "
                f"{error}. Give the layer a `get_config` that returns its "
                "constructor arguments."
            ) from None

    with policy_module.policy_scope("float32"):
        copy = keras.models.clone_model(model, clone_function=clone_layer)
    copy.set_weights(_weights_without_float8_state(model))
    return copy


def _weights_without_float8_state(model):
    """`model.get_weights()` but the float8 layers' scales and amax
    histories: the copies compute without float8."""
    state = {
        id(getattr(layer, attribute))
        for layer in float8_layers(model)
        for _, _, history, scale in _FLOAT8_TENSORS
        for attribute in (history, scale)
    }
    return [keras.ops.convert_to_numpy(w) for w in model.weights if id(w) not in state]


def _float8_rows(model, batches):
    """`kmp.float8.compare` on each batch's inputs: the worst row per float8
    layer, read in one copy of the model."""
    if not float8_layers(model):
        return []
    probe = _float8_probe.Float8Probe(model)
    worst = {}
    for x, _ in batches:
        for row in _float8_measure.compare_calls(model, probe.layer_calls(x)):
            kept = worst.get(row["layer"])
            if kept is None or row["float8_error"] > kept["float8_error"]:
                worst[row["layer"]] = row
    return list(worst.values())


def _current_loss_scale(model, target):
    scale = _float8_probe.current_loss_scale(model)
    if scale is not None:
        return scale
    if keras.DTypePolicy(target).compute_dtype == "float16":
        return 2.0**15
    return 1.0


def _loss_functions(model, loss):
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(
                "`loss` is needed: the model was not compiled with one. Pass "
                "e.g. loss='mse'. Received: loss=None"
            )
    if isinstance(loss, dict):
        raise ValueError(
            "`loss` must be one loss or a list in the order of the model's "
            f"outputs, not a dict. Received: loss={loss!r}"
        )
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    return [keras.losses.get(item) if isinstance(item, str) else item for item in losses]


def _batches(data, steps):
    if isinstance(data, tuple):
        if len(data) not in (2, 3):
            raise ValueError(
                "`data` must be a tuple (x, y), or an iterable of such batches. "
                f"Received: a tuple of {len(data)} items"
            )
        return [(data[0], data[1])]
    batches = []
    try:
        iterator = iter(data)
    except TypeError:
        raise ValueError(
            "`data` must be a tuple (x, y), or an iterable of such batches. "
            f"Received: data of type {type(data).__name__}"
        ) from None
    for batch in iterator:
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
            raise ValueError(
                "Each batch of `data` must be (x, y) or (x, y, sample_weight). "
                f"Received: a batch of type {type(batch).__name__}"
            )
        batches.append((batch[0], batch[1]))
        if len(batches) == steps:
            break
    if not batches:
        raise ValueError("`data` must hold at least one batch. Received: none")
    return batches
