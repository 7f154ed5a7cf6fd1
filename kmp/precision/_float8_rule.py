"""`kmp.float8`'s rule: which Dense and EinsumDense layers run float8 matmuls.

One place for the rule (`FILTER_RULE`), read by `kmp.float8.plan` and
`enable`, which apply it, and by `kmp.summary` (`kmp/_layer_dtypes.py`),
which says why a layer does not run float8.
"""

import math

import keras

from kmp import _keras_internals
from kmp import model as model_module
from kmp import policy as policy_module
from kmp.precision import _keep_float32
from kmp.precision._float8_training import float8_layers

# Float8 tensor cores take matrices whose dimensions are multiples of 16.
DIMENSION_MULTIPLE = 16
# A matmul is small, and left in 16 bits, when its kernel has at most this
# many input features AND at most this many output features: torchao's
# tensorwise rule (`_auto_filter_for_tensorwise`, from its H100 benchmarks,
# where quantizing costs more than the faster matmul saves below this size).
SMALL_INPUT_FEATURES = 1024
SMALL_OUTPUT_FEATURES = 4096

FILTER_RULE = f"""\
A Dense or EinsumDense layer runs float8 matmuls unless:
  it is a subclass (Keras quantizes Dense and EinsumDense themselves only),
    has LoRA enabled, or is quantized already;
  it computes in float32 (kmp's float32 layers, keep_float32, dtype= on the
    layer), or its policy is not the model's;
  it is named by `exclude`;
  it is an output layer: its output is a model output, directly or through
    layers without weights (an Activation, a Softmax);
  its kernel's input or output features (K, N; an EinsumDense's contracted
    and output kernel axes, multiplied) are not multiples of {DIMENSION_MULTIPLE};
  its matmul is small: K <= {SMALL_INPUT_FEATURES} and N <= {SMALL_OUTPUT_FEATURES}
    (torchao's tensorwise rule; `skip_small=False` turns this off)."""

_MATMUL_CLASSES = (keras.layers.Dense, keras.layers.EinsumDense)


def without_float8(policy):
    """The name of the policy a layer of `policy` has without float8:
    `"mixed_bfloat16"` for `float8_from_mixed_bfloat16`; `policy`'s own name
    for a policy without quantization."""
    if policy.quantization_mode is None:
        return policy.name
    if policy.compute_dtype == policy.variable_dtype:
        return policy.compute_dtype
    return f"mixed_{policy.compute_dtype}"


def matmul_features(layer):
    """`(K, N)`: the kernel's input and output features, as a matmul sees them."""
    shape = tuple(int(d) for d in layer.kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        inputs_spec, rest = layer.equation.split(",")
        kernel_spec, output_spec = rest.split("->")
        contracted = math.prod(
            d for axis, d in zip(kernel_spec, shape)
            if axis in inputs_spec and axis not in output_spec
        )
        kept = math.prod(d for axis, d in zip(kernel_spec, shape) if axis in output_spec)
        return contracted, kept
    return shape[0], shape[-1]


def output_layers(model):
    """The ids of the layers whose output is a model output, directly or
    through layers without weights; for a model without a graph, the last
    Dense or EinsumDense it tracks."""
    try:
        outputs = keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):
        outputs = None
    if not outputs:
        matmuls = [
            layer
            for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True)
            if isinstance(layer, _MATMUL_CLASSES)
        ]
        return {id(matmuls[-1])} if matmuls else set()
    found, pending = set(), list(outputs)
    while pending:
        tensor = pending.pop()
        layer = _keras_internals.producing_layer(tensor)
        if layer is None or id(layer) in found:
            continue
        found.add(id(layer))
        if not layer.weights and not isinstance(layer, keras.layers.InputLayer):
            # An Activation, a Softmax, a Reshape: the layer before is the output's.
            pending.extend(_keras_internals.producing_inputs(tensor))
    return found


def not_float8_reason(layer, model_policy, in_float32, outputs, exclude, skip_small):
    """Why `layer` does not run float8 matmuls by `FILTER_RULE`, or `None` if it should."""
    if type(layer) not in _MATMUL_CLASSES:
        base = next(cls for cls in _MATMUL_CLASSES if isinstance(layer, cls))
        return (
            f"{type(layer).__name__} subclasses {base.__name__}: Keras quantizes "
            "Dense and EinsumDense only"
        )
    mode = layer.dtype_policy.quantization_mode
    if mode is not None:
        return f"quantized already ({mode})"
    if getattr(layer, "lora_enabled", False):
        return "LoRA enabled (Keras' float8 matmul does not take it)"
    if id(layer) in in_float32:
        return f"computes in float32 ({in_float32[id(layer)]})"
    policy = getattr(layer.dtype_policy, "name", None)
    if policy != model_policy:
        return f"dtype= on the layer ({policy}), kept"
    entry = exclude.match(layer)
    if entry is not None:
        return f"excluded by exclude={entry}"
    if id(layer) in outputs:
        return "the model's output layer"
    k, n = matmul_features(layer)
    if k % DIMENSION_MULTIPLE or n % DIMENSION_MULTIPLE:
        return f"K={k}, N={n}: not both multiples of {DIMENSION_MULTIPLE}"
    if skip_small and k <= SMALL_INPUT_FEATURES and n <= SMALL_OUTPUT_FEATURES:
        return (
            f"small matmul: K={k} <= {SMALL_INPUT_FEATURES} and "
            f"N={n} <= {SMALL_OUTPUT_FEATURES}"
        )
    return None


def float32_reasons(model):
    """`{id(layer): why it computes in float32}` for a `kmp.Model`'s float32
    layers (kmp's list, `keep_float32`); `{}` for another model."""
    if not isinstance(model, model_module.Model):
        return {}
    rules = getattr(model, "_kmp_keep_float32", None)
    return {
        id(layer): reason
        for layer, _, reason, _ in policy_module._float32_plan(model, rules)
    }


def decisions(model, rules, skip_small):
    """`[(layer, reason)]` for each Dense and EinsumDense layer of `model`,
    once: `reason` is why it does not run float8 by `FILTER_RULE`, `None`
    for a float8 layer or one the rule makes float8."""
    in_float32 = float32_reasons(model)
    outputs = output_layers(model)
    model_policy = getattr(model.dtype_policy, "name", None)
    found, seen = [], set()
    for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True):
        if id(layer) in seen or not isinstance(layer, _MATMUL_CLASSES):
            continue
        seen.add(id(layer))
        if layer.dtype_policy.quantization_mode == "float8":
            reason = None
        else:
            reason = not_float8_reason(
                layer, model_policy, in_float32, outputs, rules, skip_small
            )
        found.append((layer, reason))
    return found


def summary_reasons(model):
    """`{id(layer): why it does not run float8}` for the Dense and EinsumDense
    layers of a model that has float8 layers (`kmp.summary`); `{}` otherwise.

    A layer the rule would make float8 but that is not was named by
    `exclude`; small matmuls made float8 mean `skip_small=False` was given.
    """
    chosen = float8_layers(model)
    if not chosen:
        return {}
    skip_small = not any(
        matmul_features(layer)[0] <= SMALL_INPUT_FEATURES
        and matmul_features(layer)[1] <= SMALL_OUTPUT_FEATURES
        for layer in chosen
    )
    reasons = {}
    for layer, reason in decisions(model, _keep_float32._Float32Rules(), skip_small):
        if layer.dtype_policy.quantization_mode != "float8":
            reasons[id(layer)] = reason or "left out by `exclude` when float8 was enabled"
    return reasons
