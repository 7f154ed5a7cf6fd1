"""A kmp.Model's precision, settled once on its own layers.

Keras settles precision when a layer is made: `dtype=` on the layer, a
`DTypePolicyMap` for a model; the layer then casts its inputs and variables
itself. kmp's choices go there too, once, when a `kmp.Model` is first called
(or built by `fit`), converted (`kmp.convert`) or loaded; never per call:

```
settle(model):
    float32 islands: each layer of `kmp.policy._float32_plan` (kmp's float32
        classes, keep_float32) gets a `_Float32Policy`: it computes in
        float32 from now on, for every caller
    cast-backs: an island whose outputs reach code Keras does not cast (a
        subclassed layer's `x + residual`, a nested model's outputs) hands
        its outputs on in the dtype it had (`_cast_back`)
    token ids: see `kmp/precision/_token_ids.py` (`settle`)
```

A layer belongs to the model it is settled by: a model that shares it (a
`keras.Model` over the same layers) computes it as the kmp.Model does, as it
shares its weights. Settling again (new `keep_float32` rules) only adds.
"""

import functools
import threading

import keras

from kmp import _keras_internals
from kmp import policy as policy_module
from kmp.precision import _float32_layers
from kmp.precision import _token_ids

# Two threads calling a model for the first time settle it once.
_SETTLING = threading.RLock()


def settle(model, rules=None):
    """Settles `model`'s precision on its layers; see the module docstring.

    Args:
        model: A `kmp.Model`.
        rules: Optional `kmp.policy._Float32Rules`: the model's own
            `keep_float32` (kmp's list and the global ones are added).
    """
    with _SETTLING:
        if policy_module._global_keep_float32:
            policy_module._global_keep_float32.warn_unknown_names(model)
        plan = policy_module._float32_plan(model, rules)
        parents = _parents(model)
        for layer, role, reason, hands_on in plan:
            if not isinstance(layer.dtype_policy, _float32_layers._Float32Policy):
                layer.dtype_policy = _float32_layers._Float32Policy(
                    hands_on=hands_on, reason=reason, was=layer.dtype_policy.name
                )
            if role == "island" and _output_leaves_keras(layer, parents, model):
                _cast_back(layer)
        _token_ids.settle(model)
        # object.__setattr__: Keras would track the flag as layer state.
        object.__setattr__(model, "_kmp_settled", True)


def settle_once(model):
    """Settles `model` at its first call (`kmp.Model.__call__`), with its rules."""
    if not getattr(model, "_kmp_settled", False):
        with _SETTLING:  # checked again: another thread may have settled it
            if not getattr(model, "_kmp_settled", False):
                settle(model, getattr(model, "_kmp_keep_float32", None))


def _parents(model):
    """Each layer of `model` (by id), mapped to the layers that hold it directly."""
    parents = {}
    for parent in _keras_internals.nested_layers(model, include_self=True, recursive=True):
        for child in _keras_internals.nested_layers(parent, include_self=False, recursive=False):
            parents.setdefault(id(child), []).append(parent)
    return parents


def _output_leaves_keras(layer, parents, model):
    """Whether `layer`'s outputs may reach code that does not cast them.

    In a functional graph a consumer that is a Keras layer casting its
    inputs needs no cast-back; a Keras op (`x + y`, which would promote to
    float32 and hand float32 on) or a layer that takes its inputs as they
    come (`autocast=False`, or no input conversion) does, and so does a
    graph output when the graph is held by other code
    (`model`'s own outputs are cast to float32 by `kmp.Model`). Anything
    else (a subclassed layer's `call`) is code kmp cannot see.
    """
    for parent in parents.get(id(layer), ()):
        if not isinstance(parent, _keras_internals.Functional):
            return True
        try:
            produced = {id(tensor) for tensor in keras.tree.flatten(layer.output)}
            if parent is not model and any(
                id(output) in produced for output in keras.tree.flatten(parent.outputs)
            ):
                return True
            for operation in parent.operations:
                if operation is layer:
                    continue
                consumed = keras.tree.flatten(operation.input)
                if any(id(tensor) in produced for tensor in consumed) and not (
                    isinstance(operation, keras.layers.Layer)
                    and operation.autocast
                    and _keras_internals.converts_inputs(operation)
                ):
                    return True
        except (AttributeError, ValueError):
            return True  # Called more than once: which call feeds what is unknown.
    return False


def _cast_back(layer):
    """Makes `layer` hand its floating outputs on as its policy's `hands_on`, once.

    Keras has no hook on a layer's outputs (its policy casts inputs only), so
    an island whose outputs reach code that adds them to 16-bit tensors (a
    residual add in a keras-hub block) gets its `call` wrapped, on this
    instance, once: never its class, never per call. Where a functional
    graph consumes the outputs, nothing is wrapped (see
    `_output_leaves_keras`).
    """
    current = layer.__dict__.get("call")
    if getattr(current, "_kmp_casts_back", False):
        return
    call = layer.call

    @functools.wraps(call)
    def call_casting_back(*args, **kwargs):
        outputs = call(*args, **kwargs)
        # Read from the policy: `kmp.export` and `kmp.load_model` give the
        # layer another one (a plain float32 policy hands float32 on).
        hands_on = getattr(layer.dtype_policy, "hands_on", None)
        return outputs if hands_on is None else _float32_layers._cast_floats(outputs, hands_on)

    call_casting_back._kmp_casts_back = True
    # object.__setattr__: Keras would track the function as layer state.
    object.__setattr__(layer, "call", call_casting_back)
