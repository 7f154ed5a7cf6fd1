"""`kmp.diagnose`'s measurements: run two copies of the model, compare them layer by layer.

One copy computes in float32, the other in the reduced dtype; both run the
same batches forward and backward (no weight update). Each layer's outputs and
gradients are measured against float16's range, the largest safe loss scale
is searched, and a policy is recommended from what was measured.

The passes themselves run in the backend's `probe` module
(`kmp/backends/<backend>/probe.py`, reached through `kmp.backends.get`);
everything here works on the NumPy arrays they return.
"""

import math

import keras
import numpy as np

from kmp import backends
from kmp._format import format_scale
from kmp.diagnosis._float16 import OVERFLOW_AT
from kmp.diagnosis._float16 import SUBNORMAL_BELOW
from kmp.diagnosis._float16 import ZERO_AT_MOST
from kmp.precision import _hardware

# Scales searched for the recommendation: 2**-24 ... 2**24.
MIN_SCALE_EXPONENT = -24
MAX_SCALE_EXPONENT = 24
# float16 "does not fit" when more gradient values than this would still be
# flushed to zero at the recommended scale.
MAX_ZERO_SHARE = 0.01
# A layer output further than this from float32 (relative L2 error) is
# wrong, not merely rounded: float16 rounds at ~5e-4, bfloat16 at ~4e-3.
MAX_REL_ERROR = 0.1


def measure(float32_model, reduced_model, batches, loss_fns, loss_scale):
    """Runs `batches` through both copies; returns what the report shows of them.

    Args:
        float32_model: The copy computing in float32.
        reduced_model: The copy computing in the reduced dtype (same weights).
        batches: List of `(x, y)` batches.
        loss_fns: List of loss callables, one per model output.
        loss_scale: Float. The scale the reduced pass and the shares of
            gradient overflow and underflow are measured at.

    Returns:
        A dict with the `kmp.DiagnosisReport` fields `loss`, `layers`,
        `first_nonfinite`, `first_inaccurate`, `recommended_loss_scale` and
        `underflow_at_recommended`.
    """
    float32_pass = _Pass(float32_model)
    reduced_pass = _Pass(reduced_model)
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
    recommended = recommend_loss_scale(magnitudes)
    layers = [
        row.result(name, layer)
        for row, name, layer in zip(rows, names, reduced_pass.layers)
    ]
    first_inaccurate = next(
        (
            {"layer": row["name"], "rel_error": row["rel_error"]}
            for row in layers
            if math.isfinite(row["rel_error"]) and row["rel_error"] > MAX_REL_ERROR
        ),
        None,
    )
    return {
        "loss": losses,
        "layers": layers,
        "first_nonfinite": first_nonfinite,
        "first_inaccurate": first_inaccurate,
        "recommended_loss_scale": recommended,
        "underflow_at_recommended": underflow_shares(magnitudes, recommended),
    }


def recommend_loss_scale(gradient_magnitudes):
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
    for exponent in range(MAX_SCALE_EXPONENT, MIN_SCALE_EXPONENT - 1, -1):
        if largest * 2.0**exponent < OVERFLOW_AT:
            return 2.0**exponent
    return None


def underflow_shares(magnitudes, scale):
    if scale is None or magnitudes.size == 0:
        return {"zero": None, "subnormal": None}
    counts = float16_counts(magnitudes, scale)
    return {
        "zero": counts["zero"] / magnitudes.size,
        "subnormal": counts["subnormal"] / magnitudes.size,
    }


def float16_counts(values, scale=1.0):
    """Counts of what float16 does to `values * scale` (exact: scale is 2**k)."""
    scaled = np.abs(np.asarray(values, dtype=np.float64)) * scale
    finite = np.isfinite(scaled)
    nonzero = finite & (scaled > 0)
    return {
        "count": scaled.size,
        "nonfinite": int(scaled.size - finite.sum()),
        "overflow": int((finite & (scaled >= OVERFLOW_AT)).sum()),
        "zero": int((nonzero & (scaled <= ZERO_AT_MOST)).sum()),
        "subnormal": int(
            (nonzero & (scaled > ZERO_AT_MOST) & (scaled < SUBNORMAL_BELOW)).sum()
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
            _merge(self.activation, float16_counts(value32))
            value32 = value32.astype(np.float64)
            value16 = value16.astype(np.float64)
            if not np.all(np.isfinite(value16)):
                self.activation_nonfinite = True
            self.error_squared += float(np.sum((value16 - value32) ** 2))
            self.reference_squared += float(np.sum(value32**2))

    def add_gradients(self, gradients, scale, reduced_gradients):
        for gradient in gradients:
            _merge(self.gradient, float16_counts(gradient, scale))
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
        return backends.get("probe").run_pass(
            self.extractor, self.weights, x, y, loss_fns, scale
        )


def targets_for(predictions, y, loss_fns):
    """The targets of `y`, flat, once there are as many as outputs and losses.

    Args:
        predictions: List of the model's outputs, flat.
        y: The batch's targets.
        loss_fns: List of loss callables, one per model output.

    Returns:
        The list of targets, in the order of `predictions`.

    Raises:
        ValueError: if the outputs, the targets and the losses are not as
            many.
    """
    targets = keras.tree.flatten(y)
    if len(targets) != len(predictions) or len(loss_fns) != len(predictions):
        raise ValueError(
            f"The model has {len(predictions)} output(s); `data` gave "
            f"{len(targets)} target(s) and `loss` {len(loss_fns)} "
            "loss(es). They must match."
        )
    return targets


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


def recommend_policy(target, measured, has_bf16):
    """The policy to train with, and why.

    Args:
        target: String. The reduced policy diagnosed.
        measured: `None` (static checks only), or the dict `measure` returns.
        has_bf16: Bool. Whether the hardware runs bfloat16 fast.

    Returns:
        A tuple `(policy_name, reason)`.
    """
    fallback = (
        ("mixed_bfloat16", "the hardware runs bfloat16, which has float32's range")
        if has_bf16
        else ("float32", "this hardware has no fast bfloat16")
    )
    compute_dtype = keras.DTypePolicy(target).compute_dtype
    if measured is None:
        return target, "static checks only; run with data to measure ranges"
    max_activation = max(
        (row["max_abs_activation"] for row in measured["layers"]), default=0.0
    )
    scale = measured["recommended_loss_scale"]
    zero_share = measured["underflow_at_recommended"]["zero"]
    first_nonfinite = measured["first_nonfinite"]
    first_inaccurate = measured["first_inaccurate"]
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
    if max_activation >= OVERFLOW_AT:
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
    elif zero_share is not None and zero_share > MAX_ZERO_SHARE:
        problems.append(
            f"{zero_share:.1%} of gradient values flush to zero even at the "
            f"largest safe scale {format_scale(scale)}"
        )
    if not problems:
        return target, (
            f"float16's range fits: no activation overflows and loss scale "
            f"{format_scale(scale)} keeps every gradient finite"
        )
    return fallback[0], f"{'; '.join(problems)}; {fallback[1]}"


def hardware_has_bfloat16():
    return _hardware._runs_bfloat16(
        _hardware._gpu_compute_capabilities(), _hardware._cpu_flags()
    )
