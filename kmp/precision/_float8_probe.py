"""The output gradients float8 quantizes to e5m2, measured by a probe step.

A float8 layer quantizes its output gradient inside the train step's
backward pass; outside it, only the gradient's absolute maximum is kept (the
newest entry of `outputs_grad_amax_history`). To count the values that
saturate or flush to zero, `OutputGradientProbe` runs one training step of
a copy of the model, backend-neutral, through Keras' own `train_on_batch`:

```
copy = the model, each float8 layer L replaced by
       L without its activation -> tap -> L's activation
       (the tap passes values through; its gradient, the gradient L's
       matmul output receives, is what L quantizes to e5m2: bias-add does
       not change it)
copy's weights <- the model's (float8 scales and histories included)
loss = the model's loss * the current loss scale   (as the scaled step's)
one step of SGD(learning_rate=0) on (x, y):
    the tap's gradient counts, against L's current `outputs_grad_scale`:
        saturated: |g| / scale > e5m2's maximum (57344)
        flushed:   0 < |g| / scale <= half e5m2's smallest subnormal
    and writes the counts into a variable of its own
    (`overwrite_with_gradient`, as Keras' float8 histories are written)
```
The model itself, its optimizer and its float8 state are not touched.
"""

import keras
from keras import ops

from kmp import _keras_internals
from kmp import loss_scale as loss_scale_module
from kmp.precision._float8_formats import FORMAT_LIMITS
from kmp.precision import _keep_float32
from kmp.precision._float8_rule import float8_layers
from kmp.precision._float8_rule import without_float8


def current_loss_scale(model):
    """The loss scale of `model`'s scaling optimizer (kmp's or Keras' own,
    built), as a float; `None` when it has none."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, loss_scale_module.LossScaleOptimizer):
        return float(ops.convert_to_numpy(optimizer.loss_scale))
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and optimizer.built:
        return float(ops.convert_to_numpy(optimizer.dynamic_scale))
    return None


class _GradientTap(keras.layers.Layer):
    """A float8 matmul layer without its activation, then a tap, then the
    activation: the tap counts what the matmul's e5m2 quantization does to
    the gradient it receives (see the module's docstring)."""

    def __init__(self, matmul, activation, **kwargs):
        # The policy without float8: Keras sends a float8 policy's layers to
        # their `_float8_call`.
        super().__init__(name=matmul.name, dtype=without_float8(matmul.dtype_policy), **kwargs)
        self.matmul = matmul
        self.activation = activation

    def build(self, input_shape):
        self.matmul.build(input_shape)
        # (saturated, flushed, values): the gradient written by the tap.
        self.counts = self.add_weight(
            shape=(3,), initializer="zeros", dtype="float32", autocast=False,
            overwrite_with_gradient=True, name="output_gradient_counts",
        )

    def call(self, inputs):
        outputs = self.matmul(inputs)
        scale = ops.stop_gradient(ops.convert_to_tensor(self.matmul.outputs_grad_scale))
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

        outputs = tap(outputs, ops.convert_to_tensor(self.counts))
        return outputs if self.activation is None else self.activation(outputs)

    def compute_output_shape(self, input_shape):
        return self.matmul.compute_output_shape(input_shape)


class OutputGradientProbe:
    """Measures each float8 layer's e5m2 output gradient on a batch (see the
    module's docstring). The copy of the model is made and compiled at the
    first `measure`, and reused: each call copies the weights again.

    Args:
        model: A functional or Sequential `keras.Model`, compiled with a loss
            (or given `loss`).
        loss: Optional loss, as `compile` takes it. Defaults to `None`: the
            model's compiled loss.
    """

    def __init__(self, model, loss=None):
        self.model = model
        self.loss = loss
        self._copy = None
        # Made with the copy: {layer path: its tap in the copy}, and
        # (layer of the model, the layer holding its variables in the copy).
        self._taps = {}
        self._pairs = []
        self._compiled_scale = None

    def _build(self):
        loss = self.loss if self.loss is not None else getattr(self.model, "loss", None)
        if loss is None:
            raise ValueError(
                "Measuring the float8 output gradients needs a loss: compile "
                f"{self.model.name!r} with one, or pass `loss`. Received: loss=None"
            )
        targets = {id(layer) for layer in float8_layers(self.model)}

        def clone_layer(layer):
            if isinstance(layer, keras.Model):
                return keras.models.clone_model(layer, clone_function=clone_layer)
            config = layer.get_config()
            if id(layer) not in targets:
                return layer.__class__.from_config(config)
            activation = layer.activation
            config["activation"] = None
            return _GradientTap(layer.__class__.from_config(config), activation)

        try:
            copy = keras.models.clone_model(self.model, clone_function=clone_layer)
        except Exception as error:
            raise ValueError(
                "Measuring the float8 output gradients copies the model, and "
                f"{self.model.name!r} cannot be copied ({type(error).__name__}: "
                f"{error}). A functional or Sequential model can. Received: model "
                f"of type {type(self.model).__name__}"
            ) from None
        pairs = list(_layer_pairs(self.model, copy))
        self._taps = {
            _keep_float32._layer_label(layer): copied
            for layer, copied in pairs
            if isinstance(copied, _GradientTap)
        }
        # A tapped layer's variables are its matmul's.
        self._pairs = [
            (layer, copied.matmul if isinstance(copied, _GradientTap) else copied)
            for layer, copied in pairs
        ]
        self._copy = keras.Model(copy.inputs, copy.outputs)
        self._losses = keras.tree.map_structure(
            lambda item: keras.losses.get(item) if isinstance(item, str) else item, loss
        )
        # Float8 layers inside a layer copied whole from its config (the
        # EinsumDense layers of a MultiHeadAttention) are quantized as in the
        # model: the copy computes what the model computes. The probe does
        # not tap them.
        for layer, copied in self._pairs:
            for inner, inner_copy in _inner_pairs(layer, copied):
                if (inner.dtype_policy.quantization_mode == "float8"
                        and inner_copy.dtype_policy.quantization_mode is None):
                    inner_copy.quantize("float8")

    def measure(self, x, y):
        """`{layer path: (saturated, flushed)}`: the shares of each float8
        layer's output gradient on `(x, y)` that its e5m2 quantization, with
        its current `outputs_grad_scale`, clips or rounds to zero."""
        if self._copy is None:
            self._build()
        scale = current_loss_scale(self.model) or 1.0
        if scale != self._compiled_scale:
            # The scale is a constant of the traced step: a new scale, a new trace.
            self._copy.compile(
                optimizer=keras.optimizers.SGD(0.0),
                loss=keras.tree.map_structure(lambda fn: _scaled(fn, scale), self._losses),
                auto_scale_loss=False,
            )
            self._compiled_scale = scale
        for layer, copied in self._pairs:
            _copy_variables(layer, copied)
        self._copy.train_on_batch(x, y)
        shares = {}
        for label, tap in self._taps.items():
            saturated, flushed, values = (float(v) for v in ops.convert_to_numpy(tap.counts))
            shares[label] = (saturated / values, flushed / values) if values else (None, None)
        return shares


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
    """Assigns `layer`'s variables, and those of the layers inside it, to
    their copies, by name: a float8 layer made from its config creates its
    variables in another order than one `quantize` made."""
    for source, target in [(layer, copied)] + _inner_pairs(layer, copied):
        into = _own_variables(target)
        for name, variable in _own_variables(source).items():
            if name not in into:
                raise ValueError(
                    f"The probe's copy of layer {source.name!r} has no variable "
                    f"{name!r}: was the model changed since the probe was made? "
                    f"Received: a layer with variables {sorted(_own_variables(source))}"
                )
            # A copy of the value, never the array itself: JAX's compiled
            # step donates the copy's buffers, which would delete the model's.
            into[name].assign(ops.convert_to_numpy(variable))


def _scaled(loss_fn, scale):
    """`loss_fn` times the loss scale: the loss the scaled step differentiates."""

    def scaled_loss(y_true, y_pred):
        return ops.multiply(loss_fn(y_true, y_pred), scale)

    return scaled_loss
