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

While a `kmp.Model` runs (`keep_exact`, entered by
`kmp.policy._float32_islands`):

```
id layers:  every Embedding (its first argument), and every layer whose
            call() casts one of its arguments to an integer dtype (read from
            its source: `ops.cast(x, "int32")`, `x.astype("int64")`)
holders:    each id layer and each layer holding one (the model included)
            that computes in 16 bits; its dtype policy is swapped for one
            that casts exactly as before but remembers, for each 16-bit
            tensor it makes, the wider tensor it made it from
id layer:   an id argument that is such a 16-bit tensor is replaced by the
            wider one, so the ids are cast to integers from float32;
            any other 16-bit id argument was rounded before kmp saw it:
            warn once per layer (its name, the largest exact id for the
            dtype, the fix: keras.Input(..., dtype="int32"))
```

Nothing else changes: the holders still get 16-bit inputs and compute in 16
bits; only the id layers' ids come in wide. Policies and `call`s are
restored on exit, as for float32 islands.
"""

import ast
import contextlib
import functools
import inspect
import re
import textwrap
import warnings

import keras

from kmp import _keras_internals
from kmp import policy as policy_module

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
        for sublayer in layer._flatten_layers(include_self=True, recursive=True)
        if isinstance(sublayer, keras.layers.Embedding)
    ]
    return max(sizes, default=None)


def can_round(layer, dtype):
    """Whether `dtype` can round an id that `layer`, or a layer inside it, takes.

    Embeddings say how many ids they take (`input_dim`); any other layer
    that casts to integers does not, so it can always be rounded.
    """
    for sublayer in layer._flatten_layers(include_self=True, recursive=True):
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
            for sublayer in layer._flatten_layers(include_self=False, recursive=False)
        )
    return memo[key]


def warning_message(layer, dtype):
    """What kmp warns when ids reach `layer` already rounded to `dtype`."""
    size = vocabulary_size(layer)
    return _WARNING.format(
        layer=policy_module._layer_label(layer),
        class_name=type(layer).__name__,
        dtype=dtype,
        largest=LARGEST_EXACT_INTEGER[dtype],
        example=_ROUNDING_EXAMPLE[dtype],
        vocabulary=f" ({size} ids)" if size is not None else "",
    )


class _RecordingPolicy(keras.DTypePolicy):
    """A layer's policy, remembering the wider tensor behind each 16-bit input.

    Casts exactly as the policy it stands in for (same name, so same compute
    and variable dtypes); `wide_sources` maps `id(cast)` to `(cast, source)`
    for each floating input it narrows to 16 bits.
    """

    def __init__(self, name, wide_sources):
        super().__init__(name)
        self._wide_sources = wide_sources

    def convert_input(self, x, autocast, dtype):
        converted = super().convert_input(x, autocast, dtype)
        source_dtype = _standard_dtype(x)
        if (
            converted is not x
            and _is_sixteen_bit(converted)
            and source_dtype is not None
            and keras.backend.is_float_dtype(source_dtype)
            and source_dtype not in LARGEST_EXACT_INTEGER
        ):
            # Keep `converted` alive with its entry: its id is not reused.
            self._wide_sources[id(converted)] = (converted, x)
        return converted


def _exact_ids_call(layer, call, names, wide_sources):
    """`call`, with each id argument a recorded 16-bit cast replaced by its source."""
    signature = inspect.signature(type(layer).call)

    def call_with_exact_ids(*args, **kwargs):
        try:
            bound = signature.bind(layer, *args, **kwargs)
        except TypeError:
            return call(*args, **kwargs)  # Let the layer raise its own error.
        if bound.arguments.get("reverse") is True:
            # ReversibleEmbedding(reverse=True) maps hidden states to logits.
            return call(*args, **kwargs)
        for name in names:
            value = bound.arguments.get(name)
            if not _is_sixteen_bit(value):
                continue
            entry = wide_sources.get(id(value))
            if entry is not None and entry[0] is value:
                bound.arguments[name] = entry[1]
            else:
                _warn_once(layer, _standard_dtype(value))
        return call(*bound.args[1:], **bound.kwargs)

    return call_with_exact_ids


def _warn_once(layer, dtype):
    if (
        getattr(layer, "_kmp_warned_token_ids", False)
        or _keras_internals.in_symbolic_scope()  # Shapes only, no values yet.
        or not can_round(layer, dtype)
    ):
        return
    # object.__setattr__: Keras would track the flag as layer state.
    object.__setattr__(layer, "_kmp_warned_token_ids", True)
    warnings.warn(warning_message(layer, dtype), stacklevel=4)


def _plan(model):
    """`(holders, id_layers)` of `model`, as the module docstring says."""
    memo, holders, id_layers, seen = {}, [], {}, set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
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
            and policy_module._can_change_policy(layer)
        ):
            holders.append(layer)
    return holders, id_layers


@contextlib.contextmanager
def keep_exact(model):
    """Runs a block with `model`'s token ids kept exact where they can be.

    See the module docstring. A model with no layer in 16 bits is left as it
    is.
    """
    layers = model._flatten_layers(include_self=True, recursive=True)
    if not any(_computes_in_sixteen_bits(layer) for layer in layers):
        yield
        return
    holders, id_layers = _plan(model)
    wide_sources = {}
    policies = {
        layer: _RecordingPolicy(layer.dtype_policy.name, wide_sources)
        for layer in holders
    }
    wrappers = {
        layer: functools.partial(
            _exact_ids_call, layer, names=names, wide_sources=wide_sources
        )
        for layer, names in id_layers.items()
    }
    try:
        with policy_module._layer_policies(policies), policy_module._wrapped_calls(wrappers):
            yield
    finally:
        wide_sources.clear()
