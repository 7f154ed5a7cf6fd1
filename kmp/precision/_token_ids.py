"""Token ids that reach an embedding as 16-bit floats: kept exact, or a warning.

A model that declares its ids as `keras.Input(shape=(maxlen,))` feeds them as
float32. Under a 16-bit policy Keras casts each layer's floating inputs to
the layer's compute dtype before `call` (its "autocast"), so a custom layer
holding a `keras.layers.Embedding` (keras.io's `TokenAndPositionEmbedding`)
gets its ids in float16 or bfloat16, and the embedding casts those to int32.
float16 holds integers exactly only up to 2048, bfloat16 only up to 256: id
2049 becomes 2048 and picks another row, id 19999 becomes 20000 and is out of
range. `Embedding` itself does not autocast (Keras sets `autocast=False`);
the layers around it do.

Settled once, when a `kmp.Model` is first called, converted or loaded
(`settle`, called by `kmp.precision._settle.settle`), on the model's own layers:

```
id layers:  every Embedding (its first argument), and every layer whose
            call() casts one of its arguments to an integer dtype (read from
            its source: `ops.cast(x, "int32")`, `x.astype("int64")`)
holders:    each id layer and each layer holding one (a subclassed model
            included) that computes in 16 bits and autocasts its inputs;
            one that takes one input gets an `_ExactIdsPolicy`: the same
            compute and variable dtypes, but a float32 input is handed on
            as it is, so the ids inside reach the embedding exact
rounded:    an id layer that a functional graph hands 16-bit ids (a layer
            before it cast them): kmp cannot undo that; it warns once, at
            settling (the layer's name, the largest exact id for the dtype,
            the fix: keras.Input(..., dtype="int32"))
```

Nothing is switched per call and no `call` is replaced: a holder keeps its
policy from then on, for every caller. A holder with several inputs keeps
Keras' casts (its float inputs may meet 16-bit tensors in its own code);
`kmp.diagnose` reports ids rounded there.
"""

import ast
import functools
import inspect
import re
import textwrap
import warnings

import keras

from kmp import _keras_internals
from kmp.precision import _float32_layers
from kmp.precision import _keep_float32

# The largest integer below which every integer is exact: 2**(significand
# bits + 1). float16 has 10 stored significand bits, bfloat16 7.
LARGEST_EXACT_INTEGER = {"float16": 2048, "bfloat16": 256}

_INTEGER_DTYPE = re.compile(r"u?int(8|16|32|64)?")

_WARNING = (
    "kmp: layer {layer!r} ({class_name}) casts its input to integer ids, but "
    "the ids reach it as {dtype}, which holds integers exactly only up to "
    "{largest}: a larger id rounds to another ({example}) and silently picks "
    "another embedding row, or one past the vocabulary{vocabulary}. kmp keeps "
    "ids exact only when they reach this layer, or a layer holding it, as "
    "float32; these were cast to {dtype} before. Fix: feed the ids as "
    "integers, with keras.Input(shape=..., dtype=\"int32\")."
)
_ROUNDING_EXAMPLE = {"float16": "2049 becomes 2048", "bfloat16": "257 becomes 256"}


def _standard_dtype(value):
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return None
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:
        return None  # Not a numeric dtype (strings): no ids to round.


def _is_sixteen_bit(value):
    return _standard_dtype(value) in LARGEST_EXACT_INTEGER


def _computes_in_sixteen_bits(layer):
    return keras.backend.standardize_dtype(layer.compute_dtype) in LARGEST_EXACT_INTEGER


@functools.lru_cache(maxsize=None)
def _call_parameters(layer_class):
    """The names of `layer_class.call`'s parameters, `self` left out."""
    try:
        parameters = list(inspect.signature(layer_class.call).parameters)
    except (TypeError, ValueError):
        return ()
    return tuple(parameters[1:])


def _is_integer_dtype(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(_INTEGER_DTYPE.fullmatch(node.value))
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return bool(name and _INTEGER_DTYPE.fullmatch(name))


def _parameter_cast(node, parameters):
    """The parameter `node` (`x`, `x[..., 0]`) is, or `None`."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name) and node.id in parameters:
        return node.id
    return None


@functools.lru_cache(maxsize=None)
def _cast_arguments(layer_class):
    """Names of `layer_class.call`'s parameters its source casts to integers.

    `ops.cast(x, "int32")`, `tf.cast(x[..., 0], tf.int64)`,
    `x.astype("int32")`, for `x` a parameter of `call`. A mask cast to
    integers (`attention_mask`) is 0 and 1, exact in any dtype: left out.
    Empty when the source cannot be read (a REPL, C).
    """
    try:
        source = textwrap.dedent(inspect.getsource(layer_class.call))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return ()
    parameters = set(_call_parameters(layer_class))
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(
            node.func, (ast.Attribute, ast.Name)
        ):
            continue
        function = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        dtypes = list(node.args[1:2]) + [k.value for k in node.keywords if k.arg == "dtype"]
        if function == "cast" and node.args:
            casted = node.args[0]
        elif function == "astype" and isinstance(node.func, ast.Attribute):
            casted = node.func.value
            dtypes = list(node.args[:1]) + dtypes
        else:
            continue
        name = _parameter_cast(casted, parameters)
        integer = any(_is_integer_dtype(dtype) for dtype in dtypes)
        if name is not None and "mask" not in name and integer:
            names.add(name)
    return tuple(name for name in _call_parameters(layer_class) if name in names)


def id_arguments(layer):
    """The arguments of `layer`'s call that it casts to integer ids.

    Args:
        layer: A Keras layer.

    Returns:
        A tuple of parameter names of `type(layer).call`: the first one for
        an `Embedding` (and subclasses, which may not cast themselves), those
        `_cast_arguments` reads from the source for any other layer.
    """
    if isinstance(layer, keras.layers.Embedding):
        return _call_parameters(type(layer))[:1]
    if isinstance(layer, (keras.layers.InputLayer, keras.Model)):
        return ()  # A model's layers are looked at one by one.
    return _cast_arguments(type(layer))


def vocabulary_size(layer):
    """The most rows of any `Embedding` in `layer` (itself included), or `None`."""
    sizes = [
        sublayer.input_dim
        for sublayer in _keras_internals.nested_layers(layer, include_self=True, recursive=True)
        if isinstance(sublayer, keras.layers.Embedding)
    ]
    return max(sizes, default=None)


def can_round(layer, dtype):
    """Whether `dtype` can round an id that `layer`, or a layer inside it, takes.

    Embeddings say how many ids they take (`input_dim`); any other layer
    that casts to integers does not, so it can always be rounded.
    """
    for sublayer in _keras_internals.nested_layers(layer, include_self=True, recursive=True):
        if id_arguments(sublayer) and not isinstance(sublayer, keras.layers.Embedding):
            return True
    size = vocabulary_size(layer)
    return size is None or size - 1 > LARGEST_EXACT_INTEGER[dtype]


def holds_id_layer(layer, memo=None):
    """Whether `layer` or a layer inside it casts its input to integer ids."""
    memo = {} if memo is None else memo
    key = id(layer)
    if key not in memo:
        memo[key] = False  # A layer reachable from itself is not an id layer.
        memo[key] = bool(id_arguments(layer)) or any(
            holds_id_layer(sublayer, memo)
            for sublayer in _keras_internals.nested_layers(
                layer, include_self=False, recursive=False
            )
        )
    return memo[key]


def warning_message(layer, dtype):
    """What kmp warns when ids reach `layer` already rounded to `dtype`."""
    size = vocabulary_size(layer)
    return _WARNING.format(
        layer=_keep_float32._layer_label(layer),
        class_name=type(layer).__name__,
        dtype=dtype,
        largest=LARGEST_EXACT_INTEGER[dtype],
        example=_ROUNDING_EXAMPLE[dtype],
        vocabulary=f" ({size} ids)" if size is not None else "",
    )


@keras.saving.register_keras_serializable(package="kmp")
class _ExactIdsPolicy(keras.DTypePolicy):
    """A holder's policy: casts as Keras does, but hands wide floats on as they are.

    Same name, so the same compute and variable dtypes as the policy it
    stands in for; only `convert_input`, Keras' autocast of the layer's
    inputs, differs: a float32 (or wider) input is not narrowed to 16 bits,
    so the ids in it reach the layer's embedding exact. Given to a layer
    that holds an id layer and takes one input (see `settle`).
    """

    def convert_input(self, x, autocast, dtype):
        if autocast and keras.backend.standardize_dtype(dtype) in LARGEST_EXACT_INTEGER:
            source = _standard_dtype(x)
            if (
                source is not None
                and keras.backend.is_float_dtype(source)
                and source not in LARGEST_EXACT_INTEGER
            ):
                return super().convert_input(x, autocast, "float32")
        return super().convert_input(x, autocast, dtype)


_CONTEXT_ARGUMENTS = ("training", "mask")


def _takes_one_input(layer):
    """Whether `layer.call` takes one input (besides `training` and `mask`).

    Keras casts every floating leaf of a layer's arguments with one policy
    call each, not knowing which argument it came from: only a layer whose
    one input holds the ids can keep its floats wide without widening other
    inputs its own code may mix with 16-bit tensors.
    """
    try:
        parameters = list(inspect.signature(type(layer).call).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    inputs = [
        parameter
        for parameter in parameters
        if parameter.name not in _CONTEXT_ARGUMENTS
        and parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        and parameter.default is parameter.empty
    ]
    return len(inputs) == 1


def _plan(model):
    """`(holders, id_layers)` of `model`, as the module docstring says."""
    memo, holders, id_layers, seen = {}, [], {}, set()
    for layer in _keras_internals.nested_layers(model, include_self=True, recursive=True):
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        names = id_arguments(layer)
        if names:
            id_layers[layer] = names
        if (
            holds_id_layer(layer, memo)
            and layer.autocast
            and _computes_in_sixteen_bits(layer)
            and _float32_layers._can_change_policy(layer)
            # A functional model does not cast its inputs; its layers do.
            and not isinstance(layer, _keras_internals.Functional)
        ):
            holders.append(layer)
    return holders, id_layers


def settle(model):
    """Keeps `model`'s token ids exact where they can be, once; warns where not.

    See the module docstring. A model with no layer in 16 bits is left as it
    is. Called by `kmp.precision._settle.settle`.
    """
    layers = _keras_internals.nested_layers(model, include_self=True, recursive=True)
    if not any(_computes_in_sixteen_bits(layer) for layer in layers):
        return
    holders, _ = _plan(model)
    for layer in holders:
        if not isinstance(layer.dtype_policy, _ExactIdsPolicy) and _takes_one_input(layer):
            layer.dtype_policy = _ExactIdsPolicy(layer.dtype_policy.name)
    for layer, dtype in _rounded_in_graph(model):
        warnings.warn(warning_message(layer, dtype), stacklevel=5)


def _rounded_in_graph(model):
    """`(layer, dtype)` for each id layer a functional graph of `model` hands
    16-bit ids to (a layer before it narrowed them), where `dtype` can round
    one of its ids."""
    found, seen = [], set()
    for graph in _keras_internals.nested_layers(model, include_self=True, recursive=True):
        if not isinstance(graph, _keras_internals.Functional):
            continue
        for layer in graph.layers:
            if id(layer) in seen or not id_arguments(layer):
                continue
            try:
                inputs = keras.tree.flatten(layer.input)
            except (AttributeError, ValueError):
                continue  # Called more than once: no one input to read.
            arriving = _standard_dtype(inputs[0]) if inputs else None
            if arriving in LARGEST_EXACT_INTEGER and can_round(layer, arriving):
                seen.add(id(layer))
                found.append((layer, arriving))
    return found
