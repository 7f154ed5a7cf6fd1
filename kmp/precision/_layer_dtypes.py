"""What `kmp.summary` reports: each layer's compute and variable dtype while
the model runs, why it has them, and the table that shows them."""

import keras

from kmp import _keras_internals
from kmp import model as model_module
from kmp import policy as policy_module
from kmp.precision import _float32_layers
from kmp.precision import _float8_rule
from kmp.precision import _keep_float32


def _float32_reasons(model):
    """`{id(layer): (role, reason, hands_on)}` for the layers a `kmp.Model`
    computes in float32 (kmp's list, `keep_float32`); `{}` for another model."""
    rules = getattr(model, "_kmp_keep_float32", None)
    plan = {}
    if isinstance(model, model_module.Model):
        plan = {
            id(layer): (role, reason, hands_on)
            for layer, role, reason, hands_on in policy_module._float32_plan(model, rules)
        }
    return plan


def _is_model_output(layer, model):
    """Whether `layer`'s outputs are outputs of `model`, a functional model:
    `kmp.Model` hands them on in float32, with no cast back (see
    `kmp.precision._settle._output_leaves_keras`)."""
    if not isinstance(model, _keras_internals.Functional):
        return False
    try:
        produced = {id(tensor) for tensor in keras.tree.flatten(layer.output)}
    except (AttributeError, ValueError):  # called more than once, or never
        return False
    return any(id(output) in produced for output in keras.tree.flatten(model.outputs))


def layer_rows(model):
    """The rows of `kmp.summary(model)`: one dict per layer (see its `Returns:`)."""
    plan = _float32_reasons(model)
    float8_plan = _float8_rule.summary_reasons(model)
    model_policy = getattr(model.dtype_policy, "name", None)
    rows, seen = [], set()
    for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True):
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        compute_dtype = keras.backend.standardize_dtype(layer.compute_dtype)
        policy_name = getattr(layer.dtype_policy, "name", str(layer.dtype_policy))
        float8 = layer.dtype_policy.quantization_mode == "float8"
        if float8:
            source = policy_name.split("_from_", 1)[-1]
            reason = (
                "float8 matmuls (e4m3 inputs and kernel, e5m2 output gradients), "
                f"policy {source} otherwise"
            )
        elif id(layer) in plan:
            role, reason, hands_on = plan[id(layer)]
            if role == "island":
                reason += (
                    "; outputs float32 (a model output)" if _is_model_output(layer, model)
                    else f"; outputs cast back to {hands_on}"
                )
            compute_dtype = "float32"
        elif isinstance(layer, keras.layers.InputLayer):
            compute_dtype = keras.backend.standardize_dtype(layer.output.dtype)
            reason = "model input (the data's dtype)"
        elif not keras.backend.is_float_dtype(compute_dtype):
            reason = f"policy {policy_name} (not floating point)"
        elif policy_name != model_policy:
            reason = f"dtype= on the layer ({policy_name}), kept"
        else:
            reason = f"policy {policy_name}"
            if isinstance(layer, _float32_layers._KERAS_FLOAT32_MATH_CLASSES) and (
                compute_dtype != "float32"
            ):
                reason += "; Keras computes its statistics in float32"
        if not float8 and float8_plan.get(id(layer)) is not None:
            reason += f"; not float8: {float8_plan[id(layer)]}"
        rows.append(
            {
                "layer": _keep_float32._layer_label(layer),
                "float8": float8,
                "class": type(layer).__name__,
                "compute_dtype": compute_dtype,
                "variable_dtype": (
                    keras.backend.standardize_dtype(layer.variable_dtype)
                    if layer.weights
                    else "-"
                ),
                "reason": reason,
            }
        )
    return rows


def format_table(model, rows):
    """The text `kmp.summary` prints: the model's policy, then one line per row."""
    model_policy = getattr(model.dtype_policy, "name", None)
    header = ("layer", "class", "compute", "variables", "why")
    cells = [header] + [
        (r["layer"], r["class"], r["compute_dtype"], r["variable_dtype"], r["reason"])
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in cells) for i in range(4)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row[:4], widths))
        + "  "
        + row[4]
        for row in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    return f"Model {model.name!r}, policy {model_policy}\n" + "\n".join(lines)
