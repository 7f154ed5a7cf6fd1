"""Which layers compute in float32 inside a 16-bit model, and their policies.

kmp's lists of layers (those Keras keeps in float32 arithmetic, those kmp
computes in float32 in training, those `kmp.export` serves in float32), the
plan that says which layers of a model become float32 islands and why
(`_plan`; `kmp.policy._float32_plan` adds the global rules), the dtype
policy such a layer gets (`_Float32Policy`), and the casts around them. The policy a model settles is applied by
`kmp/precision/_settle.py`; the rules a user adds come from `kmp/precision/_keep_float32.py`.
"""

import contextlib

import keras

from kmp import _keras_internals
from kmp import backends
from kmp.precision._keep_float32 import _Float32Rules
from kmp.precision._keep_float32 import _layer_label

_16_BIT_DTYPES = ("float16", "bfloat16")


def _keras_layers(*names):
    return tuple(
        cls
        for cls in (getattr(keras.layers, name, None) for name in names)
        if cls is not None
    )


# The layers `kmp.export` runs in float32 when it serves a model in 16 bits
# (issue 4). Training does not use this list: see KEEP_FLOAT32_CLASSES.
FLOAT32_LAYER_CLASSES = _keras_layers(
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "UnitNormalization",
    "RMSNormalization",
    "Normalization",
    "Softmax",
)

# Layers whose arithmetic goes wrong in 16 bits and that Keras leaves in the
# compute dtype: UnitNormalization's sum of squares overflows float16 from
# |x| ~ 32 per element on 64 features, and Normalization subtracts a mean from raw
# features, which float16 rounds to 0.5 at 1000. Inside a kmp.Model they
# compute in float32 and hand the compute dtype on. Batch, Layer, Group and
# RMS normalization are not here: Keras already computes their statistics in
# float32 under mixed policies (and keras-hub's RMS norms do the same).
# Softmax is not here either: TensorFlow's 16-bit softmax is as accurate as a
# float32 softmax cast back to 16 bits, to one 16-bit rounding.
KEEP_FLOAT32_CLASSES = _keras_layers("UnitNormalization", "Normalization")

# Layers Keras itself keeps in float32 arithmetic; `kmp.summary` says so.
_KERAS_FLOAT32_MATH_CLASSES = _keras_layers(
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "RMSNormalization",
)


def _builtin_rules():
    return _Float32Rules(classes=KEEP_FLOAT32_CLASSES)


def _can_change_policy(layer):
    policy = layer.dtype_policy
    return (
        not isinstance(policy, keras.dtype_policies.DTypePolicyMap)
        and policy.quantization_mode is None
    )


@keras.saving.register_keras_serializable(package="kmp")
class _Float32Policy(keras.DTypePolicy):
    """The policy kmp gives a layer it computes in float32 inside a 16-bit model.

    Computes and stores in float32, exactly as `keras.DTypePolicy("float32")`,
    and remembers why and which dtype the layer hands on: so `kmp.summary`,
    a second settling (after `kmp.convert` or loading) and a `.keras` round
    trip all see that kmp chose it, and which layers cast their outputs back.

    Args:
        name: String. Always `"float32"` (taken for Keras' config format).
        hands_on: Optional string. The 16-bit dtype the layer's outputs are
            cast back to (an island), or `None` (a layer inside an island,
            whose outputs stay inside it).
        reason: Optional string. Why the layer computes in float32.
        was: Optional string. The name of the policy it had before
            (`"mixed_float16"`): what a saved config records
            (`_unsettled_config`), so a loaded model settles again from its
            rules.
    """

    def __init__(self, name="float32", hands_on=None, reason=None, was=None):
        if name != "float32":
            raise ValueError(
                "kmp's float32 layer policy computes in float32 only. "
                f"Received: name={name!r}"
            )
        super().__init__("float32")
        self._hands_on = hands_on
        self._reason = reason
        self._was = was

    hands_on = property(lambda self: self._hands_on)
    reason = property(lambda self: self._reason)
    was = property(lambda self: self._was)

    def get_config(self):
        return {
            "name": "float32",
            "hands_on": self._hands_on,
            "reason": self._reason,
            "was": self._was,
        }


def _unsettled_config(config):
    """`config` (a model's) with each layer kmp settled in float32 back on the
    policy it had (`_Float32Policy.was`).

    Keras' `Layer.from_config` keeps only a policy's name, so a saved
    `_Float32Policy` would load as a plain float32 layer that no rule
    matches and that casts nothing back; saved as it was, the loaded model
    settles again from its `keep_float32` rules and kmp's list.
    """
    if isinstance(config, list):
        return [_unsettled_config(item) for item in config]
    if not isinstance(config, dict):
        return config
    if config.get("class_name") == "_Float32Policy":
        was = config.get("config", {}).get("was")
        if was:
            return keras.dtype_policies.serialize(keras.DTypePolicy(was))
    return {key: _unsettled_config(value) for key, value in config.items()}


_PROBABILITY_OUTPUTS = ("softmax", "sigmoid")


def _probability_output(layer, model):
    """Whether `layer` makes a softmax or sigmoid output of functional `model`.

    Such an output computes in float32 on a backend whose cross-entropies
    differentiate the probabilities rather than the logits (JAX: see
    `probability_output_reason` in `kmp/backends/<backend>/losses.py`).
    """
    if not isinstance(model, _keras_internals.Functional):
        return False
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    if name not in _PROBABILITY_OUTPUTS:
        return False
    try:
        produced = {id(tensor) for tensor in keras.tree.flatten(layer.output)}
    except (AttributeError, ValueError):
        return False
    return any(id(output) in produced for output in keras.tree.flatten(model.outputs))


def _plan(model, rules):
    """Which layers of `model` compute in float32, and why.

    A layer matched by `rules` and computing in 16 bits becomes an island:
    it and every layer inside it compute in float32, and its outputs are cast
    back to its compute dtype. So does a softmax or sigmoid output of a
    functional model where the backend asks for it (`_probability_output`).
    A layer kmp settled in float32 already (a `_Float32Policy`) keeps its
    role, so planning a settled model again gives the same plan.

    Args:
        model: A Keras model.
        rules: `_Float32Rules`, all that apply: kmp's list, the global
            `keep_float32` and the model's own (`kmp.policy._float32_plan`
            joins them).

    Returns:
        List of `(layer, role, reason, hands_on)`, `role` being `"island"`
        (hands `hands_on` on) or `"inside"` (a sublayer of an island,
        `hands_on` `None`).
    """
    probability_reason = backends.get("losses").probability_output_reason()
    plan, seen = [], set()

    def visit(parent, inside):
        for layer in _keras_internals.nested_layers(parent, include_self=False, recursive=False):
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            settled = layer.dtype_policy if isinstance(layer.dtype_policy, _Float32Policy) else None
            sixteen_bit = (
                keras.backend.standardize_dtype(layer.compute_dtype) in _16_BIT_DTYPES
                and _can_change_policy(layer)
            )
            if inside is not None:
                if sixteen_bit or settled is not None:
                    plan.append((layer, "inside", f"inside float32 layer {inside!r}", None))
                visit(layer, inside)
                continue
            if settled is not None and settled.hands_on is not None:
                plan.append((layer, "island", settled.reason, settled.hands_on))
                visit(layer, _layer_label(layer))
                continue
            entry = rules.match(layer)
            if (
                entry is None
                and sixteen_bit
                and probability_reason is not None
                and parent is model
                and _probability_output(layer, model)
            ):
                hands_on = keras.backend.standardize_dtype(layer.compute_dtype)
                plan.append((layer, "island", probability_reason, hands_on))
                visit(layer, _layer_label(layer))
            elif entry is not None and sixteen_bit:
                source = (
                    "kmp's float32 list"
                    if isinstance(layer, KEEP_FLOAT32_CLASSES)
                    else "keep_float32"
                )
                hands_on = keras.backend.standardize_dtype(layer.compute_dtype)
                plan.append((layer, "island", f"{source}: {entry}", hands_on))
                visit(layer, _layer_label(layer))
            else:
                visit(layer, None)

    visit(model, None)
    return plan


def _cast_floats(structure, dtype):
    def cast(x):
        if (
            hasattr(x, "dtype")
            and keras.backend.is_float_dtype(x.dtype)
            and keras.backend.standardize_dtype(x.dtype) != dtype
        ):
            # Keeps the logits behind a softmax output, which Keras'
            # cross-entropies differentiate from (see keep_logits), and the
            # mask Keras' loss and metrics weight by (see keep_mask).
            result = _keras_internals.keep_logits(x, keras.ops.cast(x, dtype))
            return _keras_internals.keep_mask(x, result)
        return x

    return keras.tree.map_structure(cast, structure)


def _to_float32(structure):
    """`structure` with its floating-point tensors cast to float32.

    What a `kmp.Model` returns and what `kmp.export` serves: outputs are
    float32 under every policy.
    """
    return _cast_floats(structure, "float32")


def _computes_in(model, dtypes):
    """Whether any layer of `model` computes in one of `dtypes` (float16:
    it needs loss scaling; bfloat16 too: the guard by default)."""
    # The layers decide, not the model's own policy: a model loaded (or built)
    # while the global policy was mixed_float16 has that policy even when all
    # its layers compute in float32.
    layers = list(_keras_internals.nested_layers(model, include_self=False, recursive=True))
    if not layers:
        return model.dtype_policy.compute_dtype in dtypes
    return any(layer.compute_dtype in dtypes for layer in layers)


def _stores_in(model, dtypes):
    """The name of the first layer of `model` whose weights are stored in
    one of `dtypes`, or `None`."""
    layers = list(_keras_internals.nested_layers(model, include_self=False, recursive=True))
    return next((layer.name for layer in layers or [model]
                 if layer.dtype_policy.variable_dtype in dtypes and layer.weights), None)


def _computes_in_float16(model):
    """Whether any layer of `model` computes in float16 (so needs loss scaling)."""
    return _computes_in(model, ("float16",))


@contextlib.contextmanager
def _layer_policies(layers_to_policy):
    """Runs a block with layers switched to other dtype policies, then restores them.

    The one place kmp changes layers' policies for a while: `kmp.export`
    traces the model in its inference precision and puts the trained
    policies back. A model's own precision is settled once instead (see
    `kmp/precision/_settle.py`). The previous policies come back in the reverse
    order, also when the block raises or a switch fails halfway.

    Args:
        layers_to_policy: Dict from layer to the dtype policy (a name or a
            `keras.DTypePolicy`) it computes under inside the block.

    Example:

    >>> dense = keras.layers.Dense(2, dtype="mixed_float16")
    >>> with _layer_policies({dense: "float32"}):
    ...     dense.compute_dtype
    'float32'
    >>> dense.compute_dtype
    'float16'
    """
    previous = []
    try:
        for layer, policy in layers_to_policy.items():
            previous.append((layer, layer.dtype_policy))
            layer.dtype_policy = policy
        yield
    finally:
        for layer, policy in reversed(previous):
            layer.dtype_policy = policy
