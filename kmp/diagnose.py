"""Diagnosis: which layer overflows in 16 bits, in which direction, and what to change.

`diagnose` runs a few forward and backward passes of a copy of the model in
float32 and in the reduced compute dtype (no weight update), measures every
layer against float16's range, and checks the model's code for the usual
hazards (tiny epsilons, -1e9 masks, exponentials and sums of squares in
float16, 16-bit outputs) without any data.
"""

import ast
import inspect
import json
import math
import textwrap

import keras
import numpy as np
import tensorflow as tf

from kmp import _keras_internals
from kmp import loss_scale as loss_scale_module
from kmp import policy as policy_module

FLOAT16_MAX = 65504.0
# The smallest normal float16; below it values are subnormal (fewer bits).
FLOAT16_SMALLEST_NORMAL = 2.0**-14
# Round to nearest even: |x| >= 65520 becomes inf, |x| <= 2**-25 becomes 0,
# and |x| < 2**-14 - 2**-25 becomes a subnormal.
_OVERFLOW_AT = 65520.0
_ZERO_AT_MOST = 2.0**-25
_SUBNORMAL_BELOW = 2.0**-14 - 2.0**-25

# Scales searched for the recommendation: 2**-24 ... 2**24.
_MIN_SCALE_EXPONENT = -24
_MAX_SCALE_EXPONENT = 24
# float16 "does not fit" when more gradient values than this would still be
# flushed to zero at the recommended scale.
_MAX_ZERO_SHARE = 0.01
# A layer output further than this from float32 (relative L2 error) is
# wrong, not merely rounded: float16 rounds at ~5e-4, bfloat16 at ~4e-3.
_MAX_REL_ERROR = 0.1

# Keras layers that add their epsilon in float32 whatever their compute dtype
# (their statistics are computed in at least float32).
_FLOAT32_STATISTICS_LAYERS = tuple(
    cls
    for cls in (
        getattr(keras.layers, name, None)
        for name in (
            "BatchNormalization",
            "LayerNormalization",
            "GroupNormalization",
            "RMSNormalization",
        )
    )
    if cls is not None
)

_EXP_CALLS = {"exp", "expm1", "softmax", "log_softmax", "logsumexp"}
_NORM_CALLS = {"norm", "l2_normalize", "normalize", "rsqrt", "moments", "var", "std"}
_SQUARE_CALLS = {"square", "power", "pow"}
_SUM_CALLS = {"sum", "mean", "reduce_sum", "reduce_mean"}


class DiagnosisReport:
    """What `kmp.diagnose` found: per-layer ranges, the first failure, advice.

    Prints as a table; `to_dict()` gives the same content as plain Python
    values and `to_json(path)` writes it.

    Attributes:
        policy: String. The reduced-precision policy diagnosed.
        loss_scale: Float. The loss scale the shares of gradient underflow
            and overflow are measured at.
        steps: Int. How many batches were run (0 for static checks only).
        loss: Dict with the loss in `"float32"` and in the reduced dtype.
        layers: List of dicts, one per layer in execution order (see
            `kmp.diagnose` for the keys).
        first_nonfinite: `None`, or a dict with `"layer"`, `"tensor"` and
            `"direction"` (`"forward"` or `"backward"`): where the reduced
            pass first stopped being finite.
        direction: `None`, `"forward"` or `"backward"`.
        first_inaccurate: `None`, or a dict with `"layer"` and `"rel_error"`:
            the first layer, in execution order, whose reduced output is
            finite but more than 10% off float32 (an overflow inside the
            layer that its output hides, such as `x / sqrt(inf)` = 0).
        recommended_loss_scale: Float or `None`: the largest power of two at
            which no float32 gradient overflows float16 (`None` when none in
            `[2**-24, 2**24]` does).
        underflow_at_recommended: Dict with the shares of gradient values that
            still become zero (`"zero"`) or subnormal (`"subnormal"`) there.
        recommended_policy: String. The policy to train with.
        policy_reason: String. Why.
        findings: List of dicts (`"check"`, `"layer"`, `"message"`, `"fix"`)
            from the static checks.
    """

    def __init__(self, **fields):
        self.policy = fields["policy"]
        self.loss_scale = fields["loss_scale"]
        self.steps = fields["steps"]
        self.loss = fields["loss"]
        self.layers = fields["layers"]
        self.first_nonfinite = fields["first_nonfinite"]
        self.first_inaccurate = fields["first_inaccurate"]
        self.recommended_loss_scale = fields["recommended_loss_scale"]
        self.underflow_at_recommended = fields["underflow_at_recommended"]
        self.recommended_policy = fields["recommended_policy"]
        self.policy_reason = fields["policy_reason"]
        self.findings = fields["findings"]

    @property
    def direction(self):
        return self.first_nonfinite["direction"] if self.first_nonfinite else None

    def layer(self, name):
        """Returns the per-layer dict of the layer called `name`.

        Args:
            name: String. The layer's name.

        Returns:
            A dict with the keys listed in `kmp.diagnose`'s `Returns:`.

        Raises:
            KeyError: if the report has no layer called `name`.
        """
        for row in self.layers:
            if row["name"] == name:
                return row
        raise KeyError(
            f"No layer named {name!r} in the report. Layers: "
            f"{', '.join(row['name'] for row in self.layers)}"
        )

    def to_dict(self):
        """Returns the report as a dict of plain Python values (JSON-ready)."""
        return {
            "policy": self.policy,
            "loss_scale": self.loss_scale,
            "steps": self.steps,
            "loss": dict(self.loss),
            "first_nonfinite": (
                dict(self.first_nonfinite) if self.first_nonfinite else None
            ),
            "direction": self.direction,
            "first_inaccurate": (
                dict(self.first_inaccurate) if self.first_inaccurate else None
            ),
            "recommended_loss_scale": self.recommended_loss_scale,
            "underflow_at_recommended": dict(self.underflow_at_recommended),
            "recommended_policy": self.recommended_policy,
            "policy_reason": self.policy_reason,
            "layers": [dict(row) for row in self.layers],
            "findings": [dict(finding) for finding in self.findings],
        }

    def to_json(self, path=None, indent=2):
        """Returns the report as JSON, and writes it to `path` if given.

        Infinities and NaNs are written as the strings `"inf"` and `"nan"`,
        so the file is strict JSON.

        Args:
            path: Optional string or path-like. Where to write. Defaults to
                `None` (only return the string).
            indent: Int. JSON indentation. Defaults to `2`.

        Returns:
            The JSON string.
        """
        text = json.dumps(_json_safe(self.to_dict()), indent=indent)
        if path is not None:
            with open(path, "w") as file:
                file.write(text + "\n")
        return text

    def __repr__(self):
        return (
            f"<kmp.DiagnosisReport policy={self.policy!r} "
            f"direction={self.direction!r} "
            f"recommended_loss_scale={_format_scale(self.recommended_loss_scale)} "
            f"recommended_policy={self.recommended_policy!r}>"
        )

    def __str__(self):
        lines = [
            f"kmp.diagnose: {self.policy} against float32, {self.steps} "
            f"step(s), loss scale {_format_scale(self.loss_scale)}"
        ]
        if self.steps:
            lines.append(
                f"loss: float32 {_format_number(self.loss['float32'])}, "
                f"{self.policy} {_format_number(self.loss['reduced'])}"
            )
            lines.append("")
            lines.extend(_table(self.layers))
            lines.append("")
            lines.append(
                "ovf%: share of values that overflow float16 (|x| >= 65520); "
                "zero%/sub%: share flushed to zero / made subnormal; "
                "gradients at the loss scale above; rel err: "
                "||y - y_float32|| / ||y_float32||."
            )
            if self.first_nonfinite:
                where = self.first_nonfinite
                lines.append(
                    f"First non-finite: {where['layer']} ({where['tensor']}), "
                    f"{where['direction']}."
                )
            else:
                lines.append("First non-finite: none, every value was finite.")
            if self.first_inaccurate:
                lines.append(
                    f"First inaccurate: {self.first_inaccurate['layer']}, "
                    f"finite but {self.first_inaccurate['rel_error']:.0%} off "
                    "float32 (above 10% it is wrong, not rounded)."
                )
            underflow = self.underflow_at_recommended
            if self.recommended_loss_scale is None:
                lines.append(
                    "Recommended loss scale: none; the float32 gradients "
                    "overflow float16 at every scale down to 2**-24."
                )
            else:
                lines.append(
                    "Recommended loss scale: "
                    f"{_format_scale(self.recommended_loss_scale)} (no gradient "
                    f"overflows; {underflow['zero']:.2%} of gradient values "
                    f"still flush to zero, {underflow['subnormal']:.2%} are "
                    "subnormal)."
                )
        lines.append(
            f"Recommended policy: {self.recommended_policy} ({self.policy_reason})."
        )
        if self.findings:
            lines.append("Static checks:")
            for finding in self.findings:
                lines.append(
                    f"- [{finding['check']}] {finding['layer']}: "
                    f"{finding['message']} Fix: {finding['fix']}"
                )
        else:
            lines.append("Static checks: no hazards found.")
        return "\n".join(lines)


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

    The float32 gradients of all `steps` batches are held in host memory
    (one float32 copy) to measure the underflow at the recommended scale:
    diagnose on a few batches, not an epoch.

    Static checks run with or without data: epsilons below float16's
    smallest normal (6.1e-5) in layers that add them in float16, constants
    that overflow float16 (a `-1e9` mask) in custom layers, custom layers
    that compute an exponential, softmax, norm or sum of squares in float16
    without a cast to float32, and model outputs that are not float32.

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

    Raises:
        ValueError: if `steps` < 1, `model` is not a built functional or
            Sequential model, `data` is not one of the forms above, no loss
            is given for an uncompiled model, or `policy` is not a 16-bit
            policy.

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
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}")
    _check_model(model)
    target = _target_policy(model, policy)
    keep_own_dtypes = policy is None and _has_16bit_layers(model)
    reduced = _clone(model, lambda layer: _reduced_dtype(layer, target, model, keep_own_dtypes))
    findings = _static_findings(model, reduced)
    if loss_scale is None:
        loss_scale = _current_loss_scale(model, target)
    loss_scale = float(loss_scale)
    has_bf16 = _hardware_has_bfloat16()
    if data is None:
        name, reason = _recommend_policy(target, None, has_bf16)
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
    float32_pass = _Pass(full)
    reduced_pass = _Pass(reduced)
    names = [layer.name for layer in float32_pass.layers]
    rows = [_Accumulator() for _ in names]
    gradient_magnitudes = []  # Every float32 gradient value, for the recommendation.
    first_nonfinite = None
    losses = {"float32": 0.0, "reduced": 0.0}
    for x, y in batches:
        loss32, outputs32, output_grads32, weight_grads32 = float32_pass.run(
            x, y, loss_fns, 1.0
        )
        loss16, outputs16, output_grads16, weight_grads16 = reduced_pass.run(
            x, y, loss_fns, loss_scale
        )
        losses["float32"] += loss32 / len(batches)
        losses["reduced"] += loss16 / len(batches)
        for index, row in enumerate(rows):
            row.add_activations(outputs32[index], outputs16[index])
            gradients = output_grads32[index] + weight_grads32[index]
            row.add_gradients(
                gradients, loss_scale, output_grads16[index] + weight_grads16[index]
            )
            gradient_magnitudes.extend(np.abs(g).ravel() for g in gradients)
        if first_nonfinite is None:
            first_nonfinite = _first_nonfinite(
                names, outputs16, loss16, output_grads16, weight_grads16,
                reduced_pass,
            )
    magnitudes = np.concatenate(gradient_magnitudes or [np.zeros(0)])
    recommended = _recommend_loss_scale(magnitudes)
    underflow = _underflow_shares(magnitudes, recommended)
    layers = [
        row.result(name, layer)
        for row, name, layer in zip(rows, names, reduced_pass.layers)
    ]
    max_activation = max((row["max_abs_activation"] for row in layers), default=0.0)
    first_inaccurate = next(
        (
            {"layer": row["name"], "rel_error": row["rel_error"]}
            for row in layers
            if math.isfinite(row["rel_error"]) and row["rel_error"] > _MAX_REL_ERROR
        ),
        None,
    )
    name, reason = _recommend_policy(
        target,
        (max_activation, recommended, underflow["zero"], first_nonfinite, first_inaccurate),
        has_bf16,
    )
    return DiagnosisReport(
        policy=target, loss_scale=loss_scale, steps=len(batches), loss=losses,
        layers=layers, first_nonfinite=first_nonfinite,
        first_inaccurate=first_inaccurate,
        recommended_loss_scale=recommended, underflow_at_recommended=underflow,
        recommended_policy=name, policy_reason=reason, findings=findings,
    )


def _recommend_loss_scale(gradient_magnitudes):
    """The largest power of two at which no gradient overflows float16.

    ```
    S = largest 2**k, -24 <= k <= 24, with max |g| * S < 65520
    ```
    (65520 is where float16 rounds to inf.) Non-finite values are ignored.

    Args:
        gradient_magnitudes: Array of float32 gradient values (unscaled).

    Returns:
        The scale as a float, or `None` when no power of two in
        `[2**-24, 2**24]` keeps every value finite.
    """
    values = np.abs(np.asarray(gradient_magnitudes, dtype=np.float64))
    values = values[np.isfinite(values)]
    largest = float(values.max()) if values.size else 0.0
    for exponent in range(_MAX_SCALE_EXPONENT, _MIN_SCALE_EXPONENT - 1, -1):
        if largest * 2.0**exponent < _OVERFLOW_AT:
            return 2.0**exponent
    return None


def _underflow_shares(magnitudes, scale):
    if scale is None or magnitudes.size == 0:
        return {"zero": None, "subnormal": None}
    counts = _float16_counts(magnitudes, scale)
    return {
        "zero": counts["zero"] / magnitudes.size,
        "subnormal": counts["subnormal"] / magnitudes.size,
    }


def _float16_counts(values, scale=1.0):
    """Counts of what float16 does to `values * scale` (exact: scale is 2**k)."""
    scaled = np.abs(np.asarray(values, dtype=np.float64)) * scale
    finite = np.isfinite(scaled)
    nonzero = finite & (scaled > 0)
    return {
        "count": scaled.size,
        "nonfinite": int(scaled.size - finite.sum()),
        "overflow": int((finite & (scaled >= _OVERFLOW_AT)).sum()),
        "zero": int((nonzero & (scaled <= _ZERO_AT_MOST)).sum()),
        "subnormal": int(
            (nonzero & (scaled > _ZERO_AT_MOST) & (scaled < _SUBNORMAL_BELOW)).sum()
        ),
        "max_abs": float(scaled[finite].max() / scale) if finite.any() else 0.0,
    }


class _Accumulator:
    """Per-layer statistics summed over steps."""

    def __init__(self):
        self.activation = _zero_counts()
        self.gradient = _zero_counts()
        self.error_squared = 0.0
        self.reference_squared = 0.0
        self.activation_nonfinite = False
        self.gradient_nonfinite = False

    def add_activations(self, outputs32, outputs16):
        for value32, value16 in zip(outputs32, outputs16):
            _merge(self.activation, _float16_counts(value32))
            value32 = value32.astype(np.float64)
            value16 = value16.astype(np.float64)
            if not np.all(np.isfinite(value16)):
                self.activation_nonfinite = True
            self.error_squared += float(np.sum((value16 - value32) ** 2))
            self.reference_squared += float(np.sum(value32**2))

    def add_gradients(self, gradients, scale, reduced_gradients):
        for gradient in gradients:
            _merge(self.gradient, _float16_counts(gradient, scale))
        if not all(np.all(np.isfinite(g)) for g in reduced_gradients):
            self.gradient_nonfinite = True

    def result(self, name, reduced_layer):
        def share(counts, key):
            return counts[key] / counts["count"] if counts["count"] else 0.0

        if self.activation_nonfinite or not math.isfinite(self.error_squared):
            rel_error = math.inf
        elif self.reference_squared > 0:
            rel_error = math.sqrt(self.error_squared / self.reference_squared)
        else:
            rel_error = 0.0 if self.error_squared == 0 else math.inf
        return {
            "name": name,
            "class_name": type(reduced_layer).__name__,
            "compute_dtype": reduced_layer.compute_dtype,
            "max_abs_activation": self.activation["max_abs"],
            "activation_overflow": share(self.activation, "overflow"),
            "activation_zero": share(self.activation, "zero"),
            "activation_subnormal": share(self.activation, "subnormal"),
            "max_abs_gradient": self.gradient["max_abs"],
            "gradient_overflow": share(self.gradient, "overflow"),
            "gradient_zero": share(self.gradient, "zero"),
            "gradient_subnormal": share(self.gradient, "subnormal"),
            "rel_error": rel_error,
            "activation_nonfinite": self.activation_nonfinite,
            "gradient_nonfinite": self.gradient_nonfinite,
        }


def _zero_counts():
    return {"count": 0, "nonfinite": 0, "overflow": 0, "zero": 0, "subnormal": 0,
            "max_abs": 0.0}


def _merge(total, counts):
    for key in ("count", "nonfinite", "overflow", "zero", "subnormal"):
        total[key] += counts[key]
    total["max_abs"] = max(total["max_abs"], counts["max_abs"])


class _Pass:
    """Forward and backward passes through a copy of the model, layer by layer."""

    def __init__(self, model):
        self.layers = [
            layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)
        ]
        outputs = []
        for layer in self.layers:
            try:
                outputs.append(layer.output)
            except (AttributeError, ValueError) as error:
                raise ValueError(
                    f"`diagnose` needs each layer's output, and layer "
                    f"{layer.name!r} has none it can use ({error}). Shared "
                    "layers (called more than once) are not supported."
                ) from None
        if isinstance(model, keras.Sequential):
            # A Sequential model is never called on its inputs: no `input`.
            inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
        else:
            inputs = model.input
        self.extractor = keras.Model(inputs, [outputs, model.outputs])
        # Each variable counts for the first layer that owns it.
        seen = set()
        self.weights = []
        for layer in self.layers:
            own = [w for w in layer.trainable_weights if id(w) not in seen]
            seen.update(id(w) for w in own)
            self.weights.append(own)

    def run(self, x, y, loss_fns, scale):
        flat_weights = [w for own in self.weights for w in own]
        with tf.GradientTape() as tape:
            layer_outputs, model_outputs = self.extractor(x, training=False)
            layer_outputs = [
                [t for t in keras.tree.flatten(o) if _is_float(t)] for o in layer_outputs
            ]
            predictions = [tf.cast(t, "float32") for t in keras.tree.flatten(model_outputs)]
            targets = keras.tree.flatten(y)
            if len(targets) != len(predictions) or len(loss_fns) != len(predictions):
                raise ValueError(
                    f"The model has {len(predictions)} output(s); `data` gave "
                    f"{len(targets)} target(s) and `loss` {len(loss_fns)} "
                    "loss(es). They must match."
                )
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
        for own in self.weights:
            weight_gradients.append(
                [_numpy(g) / scale for g in gradients[position:position + len(own)]]
            )
            position += len(own)
        outputs = [[_numpy(t) for t in per_layer] for per_layer in layer_outputs]
        return float(loss), outputs, output_gradients, weight_gradients


def _numpy(tensor):
    return np.asarray(tf.cast(tensor, "float32"))


def _is_float(tensor):
    return tensor is not None and tensor.dtype.is_floating


def _first_nonfinite(names, outputs, loss, output_grads, weight_grads, reduced_pass):
    for name, per_layer in zip(names, outputs):
        if not all(np.all(np.isfinite(value)) for value in per_layer):
            return {"layer": name, "tensor": "output", "direction": "forward"}
    if not math.isfinite(loss):
        return {"layer": "loss", "tensor": "loss", "direction": "forward"}
    # Backpropagation runs from the loss backwards: the layer nearest the loss
    # with a non-finite gradient is where it first went wrong.
    for index in reversed(range(len(names))):
        if not all(np.all(np.isfinite(g)) for g in output_grads[index]):
            return {"layer": names[index], "tensor": "output gradient",
                    "direction": "backward"}
        for weight, gradient in zip(reduced_pass.weights[index], weight_grads[index]):
            if not np.all(np.isfinite(gradient)):
                return {"layer": names[index],
                        "tensor": f"gradient of {weight.path}",
                        "direction": "backward"}
    return None


def _recommend_policy(target, measured, has_bf16):
    fallback = (
        ("mixed_bfloat16", "the hardware runs bfloat16, which has float32's range")
        if has_bf16
        else ("float32", "this hardware has no fast bfloat16")
    )
    compute_dtype = keras.DTypePolicy(target).compute_dtype
    if measured is None:
        return target, "static checks only; run with data to measure ranges"
    max_activation, scale, zero_share, first_nonfinite, first_inaccurate = measured
    inaccurate = (
        f"{first_inaccurate['layer']}'s output is "
        f"{first_inaccurate['rel_error']:.0%} off float32 (compute that layer in float32)"
        if first_inaccurate
        else None
    )
    if compute_dtype == "bfloat16":
        if first_nonfinite:
            return "float32", "the model is not finite even in bfloat16"
        if inaccurate:
            return "float32", inaccurate
        return target, "every value was finite in bfloat16"
    if compute_dtype != "float16":
        return target, f"{target} was diagnosed"
    problems = []
    if max_activation >= _OVERFLOW_AT:
        problems.append(
            f"activations reach {max_activation:.3g}, beyond float16's 65504"
        )
    elif first_nonfinite and first_nonfinite["direction"] == "forward":
        problems.append(
            f"the float16 forward pass is not finite from "
            f"{first_nonfinite['layer']} on, though its float32 output fits: "
            "it overflows inside (compute it in float32)"
        )
    elif inaccurate:
        problems.append(inaccurate)
    if scale is None or scale < 1:
        problems.append("the gradients need a loss scale below 1")
    elif zero_share is not None and zero_share > _MAX_ZERO_SHARE:
        problems.append(
            f"{zero_share:.1%} of gradient values flush to zero even at the "
            f"largest safe scale {_format_scale(scale)}"
        )
    if not problems:
        return target, (
            f"float16's range fits: no activation overflows and loss scale "
            f"{_format_scale(scale)} keeps every gradient finite"
        )
    return fallback[0], f"{'; '.join(problems)}; {fallback[1]}"


def _hardware_has_bfloat16():
    return policy_module._runs_bfloat16(
        policy_module._gpu_compute_capabilities(), policy_module._cpu_flags()
    )


# --- model copies --------------------------------------------------------


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
        for layer in model._flatten_layers(include_self=False, recursive=True)
    )


def _target_policy(model, policy):
    if policy is None:
        dtypes = {
            layer.compute_dtype
            for layer in model._flatten_layers(include_self=False, recursive=True)
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
    copy.set_weights(model.get_weights())
    return copy


def _current_loss_scale(model, target):
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, loss_scale_module.LossScaleOptimizer):
        return float(optimizer.loss_scale)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and optimizer.built:
        return float(optimizer.dynamic_scale)
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


# --- static checks ---------------------------------------------------------


def _static_findings(model, reduced):
    findings = []
    original = {layer.name: layer for layer in _all_layers(model)}
    for layer in _all_layers(reduced):
        user_layer = original.get(layer.name, layer)
        in_float16 = layer.compute_dtype == "float16"
        custom = not type(user_layer).__module__.startswith("keras")
        source = _call_source(user_layer) if custom else None
        upcasts = source is not None and "float32" in source
        syntax = ast.parse(source) if source is not None else None
        epsilon = _epsilon(user_layer)
        if epsilon is None and syntax is not None:
            # A literal such as `+ 1e-8` in call().
            epsilon = min(_small_constants(syntax), default=None)
        if (
            in_float16
            and epsilon is not None
            and 0 < epsilon < FLOAT16_SMALLEST_NORMAL
            and not isinstance(user_layer, _FLOAT32_STATISTICS_LAYERS)
            and not upcasts
        ):
            findings.append(_finding(
                "epsilon", layer,
                f"epsilon={epsilon:g} is below float16's smallest normal "
                "(6.1e-05): in float16 it is subnormal or zero, so "
                "`x / (norm + epsilon)` can divide by zero.",
                "use epsilon >= 1e-4 (or 6.1e-5), or compute this layer in "
                "float32 (dtype='float32')",
            ))
        if source is None:
            continue
        for value in _large_constants(syntax):
            if in_float16:
                findings.append(_finding(
                    "constant", layer,
                    f"the constant {value:g} in call() overflows float16 "
                    "(largest finite: 65504) and becomes inf: `mask * -1e9` "
                    "gives NaN where the mask is 0 (0 * inf), and a fully "
                    "masked softmax row gives NaN (-inf - -inf).",
                    "use a constant float16 can hold, e.g. "
                    "keras.ops.where(mask, x, -3e4), or compute this layer "
                    "in float32 (dtype='float32')",
                ))
        if in_float16 and not upcasts:
            risky = _risky_calls(syntax)
            if risky:
                findings.append(_finding(
                    "float16 math", layer,
                    f"call() computes {', '.join(risky)} in float16, which "
                    "overflows above 65504: exp(x) for x > 11.1, x**2 for "
                    "|x| > 256.",
                    "cast the inputs to float32 first "
                    "(keras.ops.cast(x, 'float32')) and the result back, or "
                    "give the layer dtype='float32'",
                ))
    findings.extend(_output_findings(model, reduced))
    return findings


def _all_layers(model):
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if not isinstance(layer, (keras.layers.InputLayer, keras.Model))
    ]


def _finding(check, layer, message, fix):
    return {"check": check, "layer": layer.name, "message": message, "fix": fix}


def _epsilon(layer):
    for name in ("epsilon", "eps"):
        value = getattr(layer, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _call_source(layer):
    try:
        return textwrap.dedent(inspect.getsource(type(layer).call))
    except (OSError, TypeError):
        return None  # Defined in a REPL or C: nothing to read.


def _large_constants(tree_):
    # A negative literal is UnaryOp(USub, Constant): report it with its sign.
    negated = {
        id(node.operand)
        for node in ast.walk(tree_)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    }
    values = []
    for node in ast.walk(tree_):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
            and abs(node.value) >= _OVERFLOW_AT
        ):
            values.append(-float(node.value) if id(node) in negated else float(node.value))
    return values


def _small_constants(tree_):
    return [
        float(node.value)
        for node in ast.walk(tree_)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, float)
        and 0 < node.value < FLOAT16_SMALLEST_NORMAL
    ]


def _risky_calls(tree_):
    called = set()
    squares = False
    for node in ast.walk(tree_):
        if isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if name:
                called.add(name)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            squares = True
    risky = []
    if called & _EXP_CALLS:
        risky.append("an exponential (" + ", ".join(sorted(called & _EXP_CALLS)) + ")")
    if called & _NORM_CALLS:
        risky.append("a norm (" + ", ".join(sorted(called & _NORM_CALLS)) + ")")
    if (squares or called & _SQUARE_CALLS) and called & _SUM_CALLS:
        risky.append("a sum of squares")
    return risky


def _output_findings(model, reduced):
    from kmp.model import Model

    if isinstance(model, Model):
        return []  # kmp.Model casts its outputs to float32.
    findings = []
    for tensor in keras.tree.flatten(reduced.outputs):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if dtype != "float32":
            layer = tensor._keras_history.operation
            findings.append(_finding(
                "output dtype", layer,
                f"the model output is {dtype}, so the loss is computed from "
                f"{dtype} predictions (3 significant digits in float16; "
                "probabilities near 0 or 1 round to them, and log(0) "
                "appears).",
                "end the model with keras.layers.Activation('linear', "
                "dtype='float32'), or build it as a kmp.Model",
            ))
    return findings


# --- formatting -------------------------------------------------------------


_COLUMNS = (
    ("layer", "name", "s"),
    ("dtype", "compute_dtype", "s"),
    ("max|act|", "max_abs_activation", "g"),
    ("act ovf%", "activation_overflow", "%"),
    ("act zero%", "activation_zero", "%"),
    ("max|grad|", "max_abs_gradient", "g"),
    ("grad ovf%", "gradient_overflow", "%"),
    ("grad zero%", "gradient_zero", "%"),
    ("grad sub%", "gradient_subnormal", "%"),
    ("rel err", "rel_error", "g"),
)


def _table(rows):
    cells = [[title for title, _, _ in _COLUMNS]]
    for row in rows:
        line = []
        for _, key, kind in _COLUMNS:
            value = row[key]
            if kind == "s":
                line.append(str(value))
            elif kind == "%":
                line.append(f"{100 * value:.2f}")
            else:
                line.append(_format_number(value))
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]

    def render(line):
        return "  ".join(
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths))
        ).rstrip()

    separator = "  ".join("-" * width for width in widths)
    return [render(cells[0]), separator] + [render(line) for line in cells[1:]]


def _format_number(value):
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    return f"{value:.3g}"


def _format_scale(scale):
    if scale is None:
        return "None"
    exponent = math.log2(scale)
    if exponent == int(exponent):
        return f"2**{int(exponent)}"
    return f"{scale:g}"


def _json_safe(value):
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
