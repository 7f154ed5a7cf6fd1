"""`kmp.diagnose`'s static checks: hazards read from the model, without data.

Epsilons below float16's smallest normal, constants that overflow float16
(a `-1e9` mask) in a custom layer's `call()`, exponentials, norms and sums of
squares computed in float16 without a cast to float32, token ids that reach an
embedding as floats and are rounded by a 16-bit cast, model outputs that
are not float32, and trainable weights stored in 16 bits, whose updates Keras'
optimizers round away.
"""

import ast
import inspect
import textwrap

import keras

from kmp import _keras_internals
from kmp.diagnosis._float16 import FLOAT16_SMALLEST_NORMAL
from kmp.diagnosis._float16 import OVERFLOW_AT
from kmp.precision import _token_ids
from kmp.scaling import _gate

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


def static_findings(model, reduced):
    """The hazards in `model`'s layers, read from code and config, not data.

    Args:
        model: The user's model (its layers' classes and `call` sources).
        reduced: Its copy computing in the reduced dtype (which layers run
            in float16, and the dtypes of the outputs).

    Returns:
        A list of dicts with `check`, `layer`, `message` and `fix`.
    """
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
    findings.extend(_token_id_findings(model, reduced))
    findings.extend(_output_findings(model, reduced))
    findings.extend(_weight_dtype_findings(model))
    return findings


def _all_layers(model):
    return [
        layer
        for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True)
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
            and abs(node.value) >= OVERFLOW_AT
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
            layer = _keras_internals.producing_layer(tensor)
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


def _weight_dtype_findings(model):
    """Trainable weights stored in 16 bits: Keras' optimizers compute the
    update in the weight's dtype and round it there."""
    low = {}
    for variable in model.trainable_variables:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        if dtype in ("bfloat16", "float16"):
            low.setdefault(dtype, []).append(variable)
    from kmp.loss_scale import LossScaleOptimizer
    from kmp.model import Model

    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, LossScaleOptimizer) or (isinstance(model, Model) and optimizer is None):
        return []  # kmp's scaler (compile's, under bfloat16) computes their updates in float32.
    findings = []
    for dtype, variables in low.items():
        names = ", ".join(v.path for v in variables[:3]) + (", ..." if len(variables) > 3 else "")
        message = (
            f"{len(variables)} of the model's {len(model.trainable_variables)} trainable weights "
            f"are stored in {dtype} ({names}). Keras' optimizers compute an update in the "
            f"weight's dtype and round it there: an update below half a {dtype} step "
            f"({'2**-9 to 2**-8' if dtype == 'bfloat16' else '2**-12 to 2**-11'} of the weight) is lost")
        message += _stalled_step(optimizer, dtype)
        findings.append(_finding(
            "16-bit weights", model, message + ".",
            f"train it as a kmp.Model, whose optimizer computes each update in float32 and "
            f"writes it with compensation (kmp.convert(model, 'bfloat16'), or build it under "
            f"kmp.set_policy('bfloat16')); or keep the weights in float32: "
            f"kmp.set_policy('mixed_{dtype}') (a layer's dtype='mixed_{dtype}', not '{dtype}')",
        ))
    return findings


def _stalled_step(optimizer, dtype):
    """What a finding adds where an optimizer's step is 0 in `dtype` (Adam's
    `beta_2=0.999` rounds to 1 in bfloat16), for the optimizer itself or
    each of a `keras.optimizers.MultiOptimizer`'s sub-optimizers."""
    if optimizer is None:
        return ""
    stalled = [(writer, writer.beta_2) for writer in _gate.writers(optimizer)
               if isinstance(getattr(writer, "beta_2", None), float)
               and float(keras.ops.cast(writer.beta_2, dtype)) == 1.0]
    if not stalled:
        return ""
    if stalled[0][0] is optimizer:
        return (f", and {type(optimizer).__name__}'s step is 0 (beta_2={stalled[0][1]:g} "
                f"rounds to 1 in {dtype}), so these weights never change")
    names = " and ".join(f"{type(w).__name__} (beta_2={b:g})" for w, b in stalled)
    return (f", and the step of {names} behind the {type(optimizer).__name__} is 0 (beta_2 "
            f"rounds to 1 in {dtype}), so the weights {'it updates' if len(stalled) == 1 else 'they update'} "
            "never change")


def _token_id_findings(model, reduced):
    """Layers of the graph that cast float ids to integers after a 16-bit cast.

    A layer of `reduced`'s graph that is, or holds, a layer casting its input
    to integer ids (`kmp.precision._token_ids.id_arguments`), whose first input is
    floating and either 16-bit already or cast to 16 bits by the layer's own
    autocast. Skipped where every id is exact anyway (an embedding of at
    most 2049 rows in float16, 257 in bfloat16).
    """
    from kmp.model import Model

    findings, memo = [], {}
    for layer in _all_layers(reduced):
        if not _token_ids.holds_id_layer(layer, memo):
            continue
        try:
            inputs = keras.tree.flatten(layer.input)
        except (AttributeError, ValueError):
            continue  # Called inside another layer, not by the graph.
        if not inputs or not hasattr(inputs[0], "dtype"):
            continue
        arriving = keras.backend.standardize_dtype(inputs[0].dtype)
        compute = keras.backend.standardize_dtype(layer.compute_dtype)
        if arriving in _token_ids.LARGEST_EXACT_INTEGER:
            rounded, kmp_keeps = arriving, False
        elif (
            keras.backend.is_float_dtype(arriving)
            and layer.autocast
            and compute in _token_ids.LARGEST_EXACT_INTEGER
        ):
            rounded, kmp_keeps = compute, isinstance(model, Model)
        else:
            continue
        if not _token_ids.can_round(layer, rounded):
            continue
        size = _token_ids.vocabulary_size(layer)
        largest = _token_ids.LARGEST_EXACT_INTEGER[rounded]
        message = (
            "casts its input to integer ids"
            + (f" (an embedding of {size} rows)" if size is not None else "")
            + f", but they arrive as {arriving}"
            + (f" and are cast to {rounded}" if arriving != rounded else "")
            + f", which holds integers exactly only up to {largest}: a larger "
            f"id rounds to another ({largest + 1} becomes {largest}) and picks "
            "another embedding row, or one past the vocabulary."
        )
        if kmp_keeps:
            message += (
                " A kmp.Model hands the float32 ids on to the embedding "
                "unrounded; the same layers in a keras.Model do not."
            )
        findings.append(_finding(
            "token ids", layer, message,
            'feed the ids as integers: keras.Input(shape=..., dtype="int32")',
        ))
    return findings
