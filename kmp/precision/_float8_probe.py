"""A tapped copy of the model: each float8 layer's calls and output gradient.

Two things a float8 layer does are out of the model's reach: the output
gradient it quantizes to e5m2 exists only inside the train step's backward
pass (outside it, only its absolute maximum is kept, the newest entry of
`outputs_grad_amax_history`), and a float8 layer inside another layer (a
`MultiHeadAttention`'s projections) receives inputs that no graph holds.
`Float8Probe` makes a copy of the model whose float8 layers, at any depth,
are tapped, and reads both there, backend-neutral:

```
copy = the model, each layer made again from its config (the float8
       layers inside another layer, a MultiHeadAttention's projections,
       quantized as in the model); a subclassed model made again from
       its own config, built on the first row of x, its layers paired
       with the model's in tracking order
for each float8 layer L of the copy, at any depth:
    L computes its float8 matmul and bias -> tap -> L's activation
    (the tap passes values through; its gradient, the gradient L's
    matmul output receives, is what L quantizes to e5m2: bias-add does
    not change it)
before each reading: copy's weights <- the model's (float8 scales and
    histories included)

layer_calls(x): one forward pass of the copy on x (training=False),
    compiled by Keras' own `predict_on_batch`, whose outputs are each L's
    inputs, as its matmul receives them (in its compute dtype), and its
    output, per call
output_gradients(x, y):
    loss = the model's loss * the current loss scale   (as the scaled step's)
    one step of SGD(learning_rate=0) on (x, y), through Keras' own
    `train_on_batch`:
        each tap's gradient counts, against its layer's current
        `outputs_grad_scale`:
            saturated: |g| / scale > e5m2's maximum (57344)
            flushed:   0 < |g| / scale <= half e5m2's smallest subnormal
        and writes the counts into a variable of the probe's
        (`overwrite_with_gradient`, as Keras' float8 histories are written)
```
The model itself, its optimizer and its float8 state are not touched.

Keras calls a float8 layer's `quantized_call` (from `__call__`, and from
`stateless_call` on JAX), which runs its `_float8_call`: matmul, the e5m2
quantization of the output gradient, bias, activation. A float8 layer
inside another layer is called by that layer's own `call`, where no layer
of the probe's can stand between the matmul and the activation; so the tap
goes into the float8 layer itself, for top-level and nested layers alike:
on the copy's instance, never on the model's nor on a Keras class, the
probe sets `activation` to `None` and `quantized_call` to a function that
calls the class's `quantized_call`, then the tap, then the activation; in
`layer_calls`' forward pass it keeps the call's inputs and output instead
of tapping, and that pass returns them. The counts live in a layer held,
beside the copy, by the model the probe step trains (`_ProbeStep`), which
makes them variables of that step.

A float8 layer called more than once has all its calls read, and counts
the gradients of all of them together; one the copy does not call on `x`
(a branch the model skips) has no calls and receives no gradient.
"""

import warnings

import keras
from keras import ops

from kmp import _keras_internals
from kmp import loss_scale as loss_scale_module
from kmp.precision._float8_formats import FORMAT_LIMITS
from kmp.precision._float8_formats import TENSORS
from kmp.precision import _keep_float32
from kmp.precision._float8_training import float8_layers


def current_loss_scale(model):
    """The loss scale of `model`'s scaling optimizer (kmp's or Keras' own,
    built), as a float; `None` when it has none."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, loss_scale_module.LossScaleOptimizer):
        return float(ops.convert_to_numpy(optimizer.loss_scale))
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and optimizer.built:
        return float(ops.convert_to_numpy(optimizer.dynamic_scale))
    return None


class CopyError(ValueError):
    """The probe cannot copy the model (a layer, or a subclassed model,
    that `from_config(get_config())` does not make again)."""


class _TapCounts(keras.layers.Layer):
    """One variable per tapped float8 layer: `(saturated, flushed, values)`
    of its output gradient, written by its tap's gradient."""

    def __init__(self, count, **kwargs):
        super().__init__(dtype="float32", **kwargs)
        self.rows = [
            self.add_weight(
                shape=(3,), initializer="zeros", dtype="float32", autocast=False,
                overwrite_with_gradient=True, name="output_gradient_counts",
            )
            for _ in range(count)
        ]
        self.built = True


def _count_output_gradient(outputs, scale, counts):
    """`outputs`, unchanged; its gradient passes unchanged too, and the
    gradient of `counts` is what quantizing it to e5m2 with `scale` does:
    `(saturated, flushed, values)`."""
    largest, tiny = FORMAT_LIMITS["e5m2"]

    @ops.custom_gradient
    def tap(outputs, counts):
        def grad(*args, upstream=None, variables=None):
            if upstream is None:
                (upstream,) = args
            scaled = ops.abs(ops.cast(upstream, "float32")) / scale
            found = ops.stack([
                ops.sum(ops.cast(scaled > largest, "float32")),
                ops.sum(ops.cast((scaled > 0) & (scaled <= tiny / 2), "float32")),
                ops.cast(ops.size(upstream), "float32"),
            ])
            return upstream, found

        return outputs, grad

    return tap(outputs, counts)


class _ProbeStep(keras.Model):
    """The probe's copy and its counts, in one model: `output_gradients`
    trains one step of it, whose variables, and so whose "gradients", are
    the copy's and the counts' (a layer set on a built model after the fact
    is not one of its variables in every Keras kmp admits)."""

    def __init__(self, model_copy, counts, **kwargs):
        super().__init__(**kwargs)
        self.model_copy = model_copy
        self.counts = counts
        self.built = True  # its layers are built

    def call(self, x, training=False):
        if _keras_internals.call_takes_training(self.model_copy):
            return self.model_copy(x, training=training)
        return self.model_copy(x)


class _CallRecord:
    """What one tapped float8 layer of the probe's copy receives and returns
    in `_LayerCalls`' forward pass: `calls` holds `(inputs, outputs)` per
    call while `active`; nothing is kept in the training step."""

    def __init__(self):
        self.active = False
        self.calls = []


class _LayerCalls(keras.Model):
    """The probe's copy, returning what its tapped float8 layers receive and
    return: `{layer path: [(inputs, outputs), ...]}`, one pair per call.

    Its `call` turns the records on, runs the copy, and returns what they
    took: `predict_on_batch` compiles it (`tf.function`, `jax.jit`) into one
    program, made once per input shape, whose outputs are those values. An
    eager forward pass would read them too, op by op (seconds of JAX's
    per-op compiles on a CPU for a Transformer block).
    """

    def __init__(self, model_copy, records, **kwargs):
        super().__init__(**kwargs)
        self.model_copy = model_copy
        self.records = records
        # Its layers are the copy's, built: `predict_on_batch` would
        # otherwise build it by an eager call.
        self.built = True

    def call(self, x, training=False):
        for record in self.records.values():
            record.calls = []
            record.active = True
        try:
            self.model_copy(x, training=False)
        finally:
            for record in self.records.values():
                record.active = False
        return {label: list(record.calls) for label, record in self.records.items()}


def _tap(layer, counts, record):
    """Makes `layer`, a float8 layer of the probe's copy (never of the
    user's model), count its output gradient into the variable `counts`
    and keep its calls in `record`: its float8 matmul and bias, the tap,
    then its activation (see the module's docstring)."""
    float8_call = layer.quantized_call
    activation = layer.activation
    layer.activation = None

    def tapped_call(*args, **kwargs):
        outputs = float8_call(*args, **kwargs)
        if not record.active:  # the probe step: no gradient in `layer_calls`
            scale = ops.stop_gradient(ops.convert_to_tensor(layer.outputs_grad_scale))
            outputs = _count_output_gradient(outputs, scale, ops.convert_to_tensor(counts))
        outputs = outputs if activation is None else activation(outputs)
        if record.active:
            inputs = args[0] if args else kwargs["inputs"]
            record.calls.append((ops.cast(inputs, "float32"), ops.cast(outputs, "float32")))
        return outputs

    layer.quantized_call = tapped_call


class Float8Probe:
    """Reads each float8 layer's calls on a batch, and measures its e5m2
    output gradient (see the module's docstring). The copy of the model is
    made at the first reading, and reused: each reading copies the weights
    again.

    Args:
        model: A `keras.Model`; for
            `output_gradients`, compiled with a loss (or given `loss`).
        loss: Optional loss, as `compile` takes it. Defaults to `None`: the
            model's compiled loss.
    """

    def __init__(self, model, loss=None):
        self.model = model
        self.loss = loss
        self._copy = None
        # Made with the copy: {float8 layer's path: its counts variable},
        # {float8 layer's path: its `_CallRecord`}, (layer of the model,
        # its copy) for its layers at any depth, and the copy returning its
        # float8 layers' calls.
        self._counts = {}
        self._records = {}
        self._pairs = []
        self._layer_calls = None
        self._compiled_scale = None
        self._copy_error = None
        self._warned = False

    def _build(self, x):
        if self._copy_error is not None:
            raise self._copy_error  # copying failed once: it fails again
        functional = isinstance(self.model, (_keras_internals.Functional, keras.Sequential))
        # The counts: one row per float8 layer, at any depth.
        counts = _TapCounts(len(float8_layers(self.model)), name="float8_probe_counts")
        try:
            copy, self._pairs = (_functional_copy(self.model) if functional
                                 else _subclassed_copy(self.model, x))
        except Exception as error:
            self._copy_error = CopyError(
                "Measuring float8 layers' inputs and output gradients copies the "
                f"model, and {self.model.name!r} cannot be copied "
                f"({type(error).__name__}: {error}). A functional or Sequential "
                "model whose layers `from_config(get_config())` makes again can, "
                "and a subclassed one that `from_config(get_config())` makes again "
                "with the same layers. "
                f"Received: model of type {type(self.model).__name__}"
            )
            raise self._copy_error from None
        tapped = []
        for layer, copied in self._pairs:
            if layer.dtype_policy.quantization_mode != "float8":
                continue
            # A float8 layer inside a layer made from its config (the
            # EinsumDense layers of a MultiHeadAttention) is made without
            # float8: quantized here, the copy computes what the model does.
            if copied.dtype_policy.quantization_mode is None:
                copied.quantize("float8")
            tapped.append((layer, copied))
        for (layer, copied), row in zip(tapped, counts.rows):
            label = _keep_float32._layer_label(layer)
            self._counts[label] = row
            self._records[label] = _CallRecord()
            _tap(copied, row, self._records[label])
        self._copy = _ProbeStep(copy, counts, name="float8_probe_step")
        self._layer_calls = _LayerCalls(copy, self._records, name="float8_probe_calls")

    def _copy_weights(self, x):
        if self._copy is None:
            self._build(x)
        for layer, copied in self._pairs:
            _copy_variables(layer, copied)

    def layer_calls(self, x, required=True):
        """`{layer path: [(inputs, outputs), ...]}`: what each float8 layer
        receives (in its compute dtype, as its matmul does) and returns on
        the batch `x`, one pair of float32 NumPy arrays per call, in call
        order; `[]` for a layer not called on `x`. Where the model cannot
        be copied, raises `CopyError`, or, unless `required`, warns (once
        per probe) and returns `{}`."""
        try:
            self._copy_weights(x)
        except CopyError as error:
            if required:
                raise
            if not self._warned:
                self._warned = True
                warnings.warn(f"{error} Its float8 layers' input shares are not "
                              "measured (None).", stacklevel=2)
            return {}
        calls = self._layer_calls.predict_on_batch(x)
        return {label: [tuple(pair) for pair in pairs] for label, pairs in calls.items()}

    def output_gradients(self, x, y, copy_weights=True):
        """`{layer path: (saturated, flushed)}`: the shares of each float8
        layer's output gradient on `(x, y)` that its e5m2 quantization, with
        its current `outputs_grad_scale`, clips or rounds to zero;
        `(None, None)` for a layer the step does not reach. `copy_weights`
        False: the copy holds the model's weights already (`layer_calls`
        just copied them, and its forward pass writes no variable)."""
        loss = self.loss if self.loss is not None else getattr(self.model, "loss", None)
        if loss is None:
            raise ValueError(
                "Measuring the float8 output gradients needs a loss: compile "
                f"{self.model.name!r} with one, or pass `loss`. Received: loss=None"
            )
        if copy_weights:
            self._copy_weights(x)
        scale = current_loss_scale(self.model) or 1.0
        if scale != self._compiled_scale:
            # The scale is a constant of the traced step: a new scale, a new trace.
            losses = keras.tree.map_structure(
                lambda item: keras.losses.get(item) if isinstance(item, str) else item, loss
            )
            self._copy.compile(
                optimizer=keras.optimizers.SGD(0.0),
                loss=keras.tree.map_structure(lambda fn: _scaled(fn, scale), losses),
                auto_scale_loss=False,
            )
            self._compiled_scale = scale
        for row in self._counts.values():
            # A layer the step does not reach keeps no counts of an earlier call.
            row.assign(ops.zeros((3,)))
        self._copy.train_on_batch(x, y)
        shares = {}
        for label, row in self._counts.items():
            saturated, flushed, values = (float(v) for v in ops.convert_to_numpy(row))
            shares[label] = (saturated / values, flushed / values) if values else (None, None)
        return shares


def _functional_copy(model):
    """`(copy, pairs)`: `model` (functional or Sequential) made again by
    `clone_model`, each layer from its config, and `(layer, its copy)` for
    each of its layers at any depth, but its inputs."""

    def clone_layer(layer):
        if isinstance(layer, keras.Model):
            return keras.models.clone_model(layer, clone_function=clone_layer)
        return layer.__class__.from_config(layer.get_config())

    copy = keras.models.clone_model(model, clone_function=clone_layer)
    pairs = [
        pair
        for layer, copied in _layer_pairs(model, copy)
        for pair in [(layer, copied)] + _inner_pairs(layer, copied)
    ]
    return copy, pairs


def _subclassed_copy(model, x):
    """`(copy, pairs)` of a subclassed `model`: made again from its config
    (as `clone_model` copies one), built by a call on the first row of
    `x`, and its layers paired with the model's in tracking order, which must
    match class for class and weight shape for weight shape (a float8
    layer's own variables aside: `quantize` adds those to the copy later).

    Raises:
        ValueError: if the copy's layers are not the model's.
    """
    copy = model.__class__.from_config(model.get_config())
    # Keras drops `training` where `call` takes none (as `_LayerCalls` relies on).
    copy(keras.tree.map_structure(lambda array: array[:1], x), training=False)
    mine = _keras_internals.nested_layers(model, include_self=False, recursive=True)
    theirs = _keras_internals.nested_layers(copy, include_self=False, recursive=True)
    pairs = list(zip(mine, theirs))
    if len(mine) != len(theirs) or any(
        type(layer) is not type(copied) or _shapes(layer) != _shapes(copied)
        for layer, copied in pairs
    ):
        raise ValueError(
            "its copy from `from_config(get_config())` does not hold the same layers "
            f"({len(theirs)} against the model's {len(mine)}, or of other classes or shapes)"
        )
    return copy, pairs


def _shapes(layer):
    """The shapes of the variables `layer` holds itself but a float8
    layer's own, which a quantized layer has and its copy does not yet."""
    return sorted(
        (name, tuple(variable.shape))
        for name, variable in _own_variables(layer).items()
        if name not in _FLOAT8_VARIABLES
    )


# The names of the variables `quantize("float8")` adds to a layer.
_FLOAT8_VARIABLES = frozenset(name for row in TENSORS for name in row[2:])


def _layer_pairs(model, copy):
    """`(layer, its copy)` for each layer of `model` but its inputs (the
    layers of the models nested in it too, not the models), found by name:
    `clone_model` keeps the names, and they are unique within a model."""
    copies = {layer.name: layer for layer in copy.layers}
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue  # no variables; `clone_model` names its inputs anew
        if isinstance(layer, keras.Model):
            yield from _layer_pairs(layer, copies[layer.name])
        else:
            yield layer, copies[layer.name]


def _inner_pairs(layer, copied):
    """The layers inside `layer` and inside its copy, paired in tracking order."""
    return list(zip(
        _keras_internals.nested_layers(layer, include_self=False, recursive=True),
        _keras_internals.nested_layers(copied, include_self=False, recursive=True),
    ))


def _own_variables(layer):
    """`{name: variable}` of the variables `layer` holds itself, not through
    a layer inside it."""
    inner = {
        id(variable)
        for sublayer in _keras_internals.nested_layers(layer, include_self=False, recursive=True)
        for variable in sublayer.weights
    }
    return {variable.name: variable for variable in layer.weights if id(variable) not in inner}


def _copy_variables(layer, copied):
    """Assigns the variables `layer` holds itself to those of its copy, by
    name: a float8 layer made from its config creates its variables in
    another order than one `quantize` made."""
    into = _own_variables(copied)
    for name, variable in _own_variables(layer).items():
        if name not in into:
            raise ValueError(
                f"The probe's copy of layer {layer.name!r} has no variable "
                f"{name!r}: was the model changed since the probe was made? "
                f"Received: a layer with variables {sorted(_own_variables(layer))}"
            )
        # A copy of the value, never the array itself: JAX's compiled
        # step donates the copy's buffers, which would delete the model's.
        into[name].assign(ops.convert_to_numpy(variable))


def _scaled(loss_fn, scale):
    """`loss_fn` times the loss scale: the loss the scaled step differentiates."""

    def scaled_loss(y_true, y_pred):
        return ops.multiply(loss_fn(y_true, y_pred), scale)

    return scaled_loss
