"""kmp.convert and kmp.summary: bring any Keras model under a precision policy.

`kmp.summary`'s rows (each layer's dtypes, and why) and the table it prints
come from `kmp/precision/_layer_dtypes.py`.
"""

import contextlib
import functools
import inspect
import warnings

import keras

from kmp import _keras_internals
from kmp import float8 as float8_module
from kmp import model as model_module
from kmp import policy as policy_module
from kmp.precision import _float32_layers
from kmp.precision import _layer_dtypes
from kmp.precision import _settle as _precision

@contextlib.contextmanager
def _keras_policy(name):
    # Keras' global policy only: kmp's own state (keep_float32) is left alone.
    # `None`: as it is.
    if name is None:
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _serialized_policy_name(dtype):
    """The policy name a serialized `dtype` entry holds, or `None`."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, dict) and dtype.get("class_name") == "DTypePolicy":
        return dtype.get("config", {}).get("name")
    return None


def _repolicied(config, source, target):
    """`config` with every `dtype` entry equal to `source` set to `target`.

    Entries that differ from `source` are the user's per-layer choices
    (`dtype=` on a layer, a `DTypePolicyMap`) and are kept. Input layers keep
    theirs: it is the dtype of the data, not a policy.
    """
    if isinstance(config, list):
        return [_repolicied(item, source, target) for item in config]
    if not isinstance(config, dict):
        return config
    if config.get("class_name") == "InputLayer":
        return config
    result = {}
    for key, value in config.items():
        if key == "dtype" and _serialized_policy_name(value) == source:
            result[key] = target
        else:
            result[key] = _repolicied(value, source, target)
    return result


def _copy_weights(source, destination):
    weights = source.get_weights()
    shapes = [tuple(w.shape) for w in weights]
    expected = [tuple(v.shape) for v in destination.weights]
    if shapes != expected:
        raise ValueError(
            f"kmp.convert rebuilt {source.name!r} from its config but the "
            f"weights differ: {len(shapes)} weights of shapes {shapes[:4]}... "
            f"in the original, {len(expected)} of shapes {expected[:4]}... in "
            "the rebuilt model. The model's get_config() does not describe it "
            "fully."
        )
    destination.set_weights(weights)


def _rebuild(model, source, target):
    """A new model of `model`'s class from its config, under `target`."""
    config = model.get_config()
    try:
        clone = type(model).from_config(_repolicied(config, source, target))
    except Exception:
        if not isinstance(model, _keras_internals.Functional) or _own_training_methods(model):
            # A plain functional model would not have the model's own
            # training methods: better wrap the original, which has them.
            raise
        # A functional subclass whose __init__ does not take its config:
        # its graph is rebuilt as a plain functional model.
        config = _keras_internals.Functional.get_config(model)
        clone = _keras_internals.Functional.from_config(_repolicied(config, source, target))
    if model.built and not clone.built:
        clone.build_from_config(model.get_build_config())
    if model.weights:
        _copy_weights(model, clone)
    return clone


@keras.saving.register_keras_serializable(package="kmp", name="WrappedModel")
class _WrappedModel(model_module.Model):
    """A `kmp.Model` whose call is another model's, under a policy.

    `policy` is `None` when the wrapped model was built under the policy
    already (a clone); otherwise the wrapped model's layers that follow its
    own policy are set to `policy` here, once (they are the wrapper's layers
    now). A built model gives a built wrapper, and `layers` lists the
    wrapped model's layers, as the model itself does.
    """

    def __init__(self, model, policy=None, **kwargs):
        kwargs.setdefault("name", model.name)
        super().__init__(**kwargs)
        self.wrapped = model
        self._kmp_wrapped_policy = policy
        if policy is not None:
            for layer, target in _following_layers(model, policy).items():
                layer.dtype_policy = target
        if model.built:
            # Built when its model is (fit's BackupAndRestore, Keras'
            # included, refuses an unbuilt model), from the same shapes, which
            # export reads.
            self._build_like(model)

    def _build_like(self, model):
        try:
            # A graph's inputs give the shapes and dtypes; a symbolic call
            # builds the wrapper as a first call would (export reads it).
            specs = keras.tree.map_structure(
                lambda tensor: keras.KerasTensor(tensor.shape, dtype=tensor.dtype),
                model.input,
            )
        except (AttributeError, ValueError):
            specs = None  # no graph: a subclassed model
        try:
            if specs is not None:
                self(specs)
            elif model.get_build_config():
                self.build_from_config(model.get_build_config())
        except Exception:  # a model whose build Keras cannot replay
            pass
        if not self.built:
            self.built = True  # nothing of its own to build

    @property
    def layers(self):
        return self.wrapped.layers

    def call(self, inputs, training=None):
        if _keras_internals.call_takes_training(self.wrapped):
            return self.wrapped(inputs, training=training)
        return self.wrapped(inputs)

    def get_config(self):
        return model_module._with_keep_float32({
            "model": _float32_layers._unsettled_config(
                keras.saving.serialize_keras_object(self.wrapped)
            ),
            "model_policy": self.wrapped.dtype_policy.name,
            # Its layers were set to the policy when it was wrapped, so their
            # configs carry it: nothing is left to set when it is loaded.
            "policy": None,
            "name": self.name,
        }, self)

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        entries = config.pop("keep_float32", None)
        # Loaded under the global policy it was built under (a copy: the
        # converted policy): a subclassed model's layers take the global
        # policy of the moment, which its config does not record.
        with _keras_policy(config.pop("model_policy", None)):
            model = keras.saving.deserialize_keras_object(config.pop("model"))
        # Not `cls`: a wrapper that keeps the model's own training methods
        # has a class made for the model's class (see `_wrapper_class`).
        return model_module._restore_keep_float32(
            _wrapper_class(model)(model, **config), entries
        )


# The methods a model's author writes to train it their own way (keras.io's
# GAN and VAE override `compile` and `train_step`). A wrapper keeps them.
_TRAINING_METHODS = (
    "compile",
    "train_step",
    "test_step",
    "predict_step",
    "compute_loss",
    "compute_metrics",
)
# What makes a wrapper a wrapper (how it is made, called, built and saved),
# whichever class of the model defines it: the model's own `call` runs on the
# wrapped model, never on the wrapper.
_WRAPPER_STRUCTURE = (
    "__new__",
    "__init__",
    "call",
    "build",
    "get_config",
    "from_config",
    "get_build_config",
    "build_from_config",
    "compute_output_shape",
    "compute_output_spec",
)
# Packages whose model classes are Keras', not the user's training code.
_LIBRARY_PACKAGES = ("keras", "keras_hub", "kmp", "tensorflow", "tf_keras")
# Attributes every Keras model sets on itself by `compile` or `fit`: a
# wrapper that has none yet does not take the wrapped model's.
_KERAS_TRAINING_ATTRIBUTES = ("optimizer", "loss", "compiled", "history", "stop_training")


def _is_library_class(klass):
    return klass is object or klass.__module__.split(".")[0] in _LIBRARY_PACKAGES


def _own_training_methods(model):
    """The `_TRAINING_METHODS` that `model`'s own (non-Keras) classes define."""
    return [
        name
        for name in _TRAINING_METHODS
        if any(
            name in vars(klass)
            for klass in type(model).__mro__
            if not _is_library_class(klass)
        )
    ]


def _wrapped_attribute(self, name):
    # Reached only when normal lookup fails: the model's own methods, run on
    # the wrapper, find the wrapped model's attributes (a GAN's train_step
    # reads `self.generator`; a callback reads `self.model.generator`).
    if name.startswith("_") or name in _KERAS_TRAINING_ATTRIBUTES:
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    try:
        wrapped = object.__getattribute__(self, "wrapped")
    except AttributeError:
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
        ) from None
    return getattr(wrapped, name)


@functools.cache
def _wrapper_keeping(model_class):
    """A wrapper class that is also a `model_class`: kmp's wrapper for what
    makes a model (`_WRAPPER_STRUCTURE`), `model_class`'s for how it trains.

    ```
    class GAN(keras.Model): compile(d_optimizer, ...), train_step, helpers
    wrapper class = GAN + _WrappedModel:
        __init__, call, build, get_config, ...  -> _WrappedModel's
        (call runs the wrapped GAN's own call, under the policy)
        compile, train_step, helpers, metrics   -> GAN's, run on the wrapper
        (super().compile() reaches kmp.Model.compile; the wrapped model's
        layers are under the policy since the wrapper was made; attributes
        the wrapper lacks are the wrapped model's)
    ```
    So `compile(d_optimizer=...)` sets the optimizers on the wrapper, where
    kmp.Model finds and wraps them, and the steps report their scalers.
    """
    own = {
        name
        for klass in model_class.__mro__
        if not _is_library_class(klass)
        for name in vars(klass)
    }
    # Keras' classes on the model's side (Functional, Sequential) describe
    # the wrapped model's structure, not the wrapper's.
    library_side = {
        name
        for klass in model_class.__mro__
        if _is_library_class(klass) and klass not in _WrappedModel.__mro__
        for name in vars(klass)
    }
    namespace = {
        "__module__": __name__,
        "__qualname__": model_class.__qualname__,
        "__doc__": model_class.__doc__,
        "__getattr__": _wrapped_attribute,
    }
    for name in set(_WRAPPER_STRUCTURE) | (library_side - own):
        if name.startswith("__") and name not in _WRAPPER_STRUCTURE:
            continue
        try:
            namespace[name] = inspect.getattr_static(_WrappedModel, name)
        except AttributeError:
            pass
    for name in _TRAINING_METHODS[1:]:
        if name in own:
            # In the new class's own namespace, so that kmp.Model's
            # __init_subclass__ makes its train_step report the scalers.
            namespace[name] = getattr(model_class, name)
    wrapper_class = type(model_class.__name__, (model_class, _WrappedModel), namespace)
    # Saved as a WrappedModel (whose from_config makes this class again from
    # the wrapped model's), and loaded as one: registering this class took
    # the name over, so it is given back.
    keras.saving.register_keras_serializable("kmp", "WrappedModel")(wrapper_class)
    keras.saving.register_keras_serializable("kmp", "WrappedModel")(_WrappedModel)
    return wrapper_class


def _wrapper_class(model):
    """`_WrappedModel`, or a subclass that keeps `model`'s own training methods."""
    if _own_training_methods(model):
        return _wrapper_keeping(type(model))
    return _WrappedModel


def _following_layers(model, policy):
    """Each layer of `model` that follows the model's own policy, mapped to `policy`.

    A layer with a policy of its own (`dtype=` on the layer, a quantized or
    a `DTypePolicyMap` one) and the input layers are left out.
    """
    source = model.dtype_policy.name
    return {
        layer: policy
        for layer in _keras_internals.nested_layers(model, include_self=True, recursive=True)
        if _float32_layers._can_change_policy(layer)
        and layer.dtype_policy.name == source
        and not isinstance(layer, keras.layers.InputLayer)
    }


def _as_kmp_model(clone):
    """A functional `kmp.Model` over `clone`'s graph, or a wrapper if it has none."""
    if isinstance(clone, model_module.Model) and isinstance(clone, _keras_internals.Functional):
        return clone
    if isinstance(clone, _keras_internals.Functional):
        return model_module.Model(clone.input, clone.output, name=clone.name)
    if isinstance(clone, keras.Sequential) and clone.built:
        try:
            inputs, outputs = clone.inputs, clone.outputs
        except (AttributeError, ValueError):
            inputs = None
        if inputs and len(inputs) == 1 and len(outputs) == 1:
            converted = model_module.Model(inputs[0], outputs[0], name=clone.name)
            # `layers` as the Sequential lists them (no input layer), so
            # `model.layers[0]` is the same layer after converting.
            object.__setattr__(converted, "_kmp_sequential_layers", True)
            return converted
    return _WrappedModel(clone)


def _compile_like(converted, model):
    try:
        config = keras.saving.deserialize_keras_object(model.get_compile_config())
    except Exception as error:
        raise ValueError(
            f"kmp.convert could not copy how {model.name!r} was compiled "
            f"({type(error).__name__}: {error}). Pass compile=False and call "
            "compile() on the converted model."
        ) from None
    optimizer = config.pop("optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # The new policy decides on loss scaling, not the old one.
        optimizer = optimizer.inner_optimizer
    # A kmp.Model's compile config carries its loss_scale choice; any other
    # model gets kmp's default, scaling exactly when it computes in float16.
    loss_scale = config.pop("loss_scale", "auto")
    # The scaler is made anew for the new policy: kmp's, not the user's.
    config.pop("users_scaler", None)
    converted.compile(optimizer=optimizer, loss_scale=loss_scale, **config)


def convert(model, policy=None, keep_float32=None, compile=True, float8=False):
    """Returns a `kmp.Model` that is `model` under a precision policy.

    One call, as fastai's `to_fp16()` or Apex's `amp.initialize`:
    `kmp.convert(model).compile(...).fit(...)` trains `model`'s architecture
    in mixed precision with loss scaling and float32 outputs. How:

    ```
    rebuild `model` from get_config() with every layer that followed its
    policy now on `policy` (a layer with its own dtype= keeps it), and copy
    the weights:
        functional, Sequential, keras-hub model -> a functional kmp.Model
                                                   over the new graph
        kmp.Model subclass                      -> the copy itself
        other subclassed model                  -> a kmp.Model wrapping the copy
    if the config does not rebuild it faithfully (no get_config(), a custom
    layer Keras cannot locate, weights the config does not describe, as
    with LoRA enabled):
        WRAP IT: a kmp.Model whose call runs the original, whose layers are
        set to `policy` once, when it is wrapped. The wrapper shares the
        original's layers and weights (training one trains the other, and
        the original computes under `policy` too); kmp warns.
    a model whose class overrides compile, train_step, test_step,
    predict_step, compute_loss or compute_metrics (a GAN, a VAE):
        the wrapper is also of that class and keeps those methods: the
        model compiles with its own arguments, every optimizer it sets on
        itself gets loss scaling as in a kmp.Model; attributes the wrapper
        lacks (a GAN's `generator`) are the wrapped model's
    compiled model (unless compile=False):
        compile the result with the same loss, metrics and optimizer
        configuration: a fresh optimizer, wrapped for loss scaling when the
        result computes in float16 (a model that overrides compile is left
        for you to compile; kmp warns)
    ```
    The result's precision (float32 layers, token ids) is settled on its
    layers once, here (see `kmp/precision/_settle.py`), not switched per call.
    The model passed in is never changed, unless it is wrapped: then the
    result shares its layers and weights, and so their policy. A built
    model gives a built result whose `layers` lists what the model's
    `layers` lists. A functional result or a wrapper keeps its policy,
    `keep_float32` and loss scaling through a `.keras` file (a `kmp.Model`
    subclass keeps what its own `get_config()` holds).

    Args:
        model: A `keras.Model`, built or not: functional, `Sequential`,
            subclassed, a keras-hub `Backbone` or `Task`, or a `kmp.Model`.
        policy: `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`,
            `"auto"` or a `kmp.Policy`. Defaults to `None`: the active kmp
            policy.
        keep_float32: Optional list of layer classes, layer names or name
            patterns (`"re:.*attention.*"`), added to kmp's float32 layers
            and those of `kmp.set_policy(..., keep_float32=...)`. Each
            computes in float32 and hands the compute dtype on. Defaults to
            `None`.
        compile: Boolean. Whether to compile the result as `model` was
            compiled. Defaults to `True` (no effect on an uncompiled model).
        float8: Boolean. Whether the result's Dense and EinsumDense layers
            run float8 matmuls, by `kmp.float8.enable`'s rule (its
            `keep_float32` layers stay out). Defaults to `False`. To name
            more layers to leave out, call `kmp.float8.enable(result,
            exclude=[...])` instead. A wrapped model (see above) shares its
            layers with the result: they run float8 in both.

    Returns:
        A `kmp.Model`.

    Raises:
        TypeError: if `model` is not a `keras.Model`, has no `call()` (a
            VAE that only trains through its `train_step`: define `call()`,
            or subclass `kmp.Model` instead of converting), an entry of
            `keep_float32` is neither a string nor a layer class, or
            `float8` is not a boolean.
        ValueError: if `policy` is not a policy, a name in `keep_float32`
            (or in `kmp.set_policy`'s) is no layer of `model` (the message
            lists the names there are), the compile configuration cannot
            be copied, or `float8=True` for a model that is not built.

    Example:

    ```python
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=8)
    model = kmp.convert(backbone, "mixed_float16", keep_float32=["re:.*_norm"])
    kmp.summary(model)
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model (functional, Sequential, subclassed "
            f"or a keras-hub model). Received: model of type {type(model).__name__}"
        )
    _check_has_call(model)
    if not isinstance(float8, bool):
        raise TypeError(f"`float8` must be True or False. Received: float8={float8!r}")
    if float8 and not model.built:
        raise ValueError(
            "kmp.convert(..., float8=True) needs a built model: which layers run "
            "float8 depends on their kernels' shapes. Build it first "
            "(model.build(input_shape), or call it on a batch). Received: an "
            f"unbuilt model {model.name!r}"
        )
    target = policy_module._resolve_policy(
        policy, "policy", caller="kmp.convert", none_means="the active kmp policy"
    )
    if target is None:
        target = policy_module.get_policy()
    rules = policy_module._Float32Rules.parse(keep_float32)
    rules.check_names(model)
    if policy_module._global_keep_float32 is not None:
        policy_module._global_keep_float32.check_names(
            model, argument="keep_float32 of kmp.set_policy"
        )
    source = getattr(model.dtype_policy, "name", None)
    with _keras_policy(target.name):
        converted = _converted(model, source, target.name)
    # object.__setattr__: Keras would track the rules as state.
    object.__setattr__(converted, "_kmp_keep_float32", rules)
    _precision.settle(converted, rules)
    if float8:
        float8_module.enable(converted)
    if compile and getattr(model, "compiled", False):
        if "compile" in _own_training_methods(model):
            warnings.warn(
                f"kmp.convert did not compile the result as {model.name!r} was "
                f"compiled: {type(model).__name__} overrides compile(), whose "
                "arguments kmp cannot read back. Call its compile() on the "
                "result as you did on the original; pass compile=False to "
                "kmp.convert to silence this warning.",
                stacklevel=2,
            )
        else:
            _compile_like(converted, model)
    return converted


def _converted(model, source, target):
    """`model` under `target`: a copy where its config rebuilds it faithfully,
    else a wrapper around it (with a warning)."""
    try:
        clone = _rebuild(model, source, target)
    except Exception as error:  # no faithful config: wrap the original
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        if len(reason) > 300:  # Keras' messages can hold a whole config
            reason = reason[:300] + " ..."
        # A layer has one policy, and Keras cannot copy a model without a
        # config (copy.deepcopy goes through get_config too): the wrapper
        # must share the original's layers, so the warning says what that
        # changes in the original.
        unscaled = (
            " (trained directly, outside the result, it would compute in "
            "float16 without loss scaling: compile and fit the result)"
            if policy_module.Policy(target).compute_dtype == "float16"
            else ""
        )
        warnings.warn(
            f"kmp.convert could not rebuild {model.name!r} faithfully from "
            f"its config ({reason}); "
            "the result wraps it and shares its weights and layers, so "
            "training the result trains the original, and the original's "
            f"layers compute under {target} from now on{unscaled}. For a copy "
            "instead, give each custom "
            "layer and model a get_config() that describes it fully and "
            "register its class (@keras.saving.register_keras_serializable()).",
            stacklevel=3,
        )
        return _wrapper_class(model)(model, policy=target)
    if isinstance(clone, model_module.Model):
        return clone  # its class is kmp's and, for a subclass, the user's
    if _own_training_methods(clone):
        return _wrapper_class(clone)(clone)
    return _as_kmp_model(clone)


def _check_has_call(model):
    """Raises for a model without `call()`, which kmp's model cannot run."""
    cls = type(model)
    if cls.call is keras.Model.call:
        raise TypeError(
            f"kmp.convert runs the model it converts, but {cls.__name__} "
            f"({model.name!r}) defines no call(). Define call() with the model's "
            "forward pass, or derive the class from kmp.Model instead: `class "
            f"{cls.__name__}(kmp.Model): ...` and call kmp.set_policy(...) "
            "before building it. kmp then wraps every optimizer it holds and "
            "reports each; add `scaled_loss = self.<optimizer>.scale_loss(loss)` "
            "inside each GradientTape and take the gradients of `scaled_loss`."
        )


def summary(model, print_fn=None):
    """Prints each layer's compute and variable dtype, and why.

    The dtypes are those a layer has while the model runs: inside a
    `kmp.Model`, float32 layers (kmp's, and `keep_float32`'s) compute in
    float32 and hand their compute dtype on. The reasons:
    `"kmp's float32 list: ..."`, `"keep_float32: ..."`, `"inside float32
    layer ..."`, `"dtype= on the layer"` (a policy other than the model's,
    kept), or `"policy <name>"` (with a note where Keras computes the
    layer's statistics in float32 itself).

    Args:
        model: A `keras.Model`.
        print_fn: Optional callable taking one string. Defaults to `print`.

    Returns:
        A list of dicts, one per layer: `layer` (path or name), `class`,
        `compute_dtype`, `variable_dtype`, `reason`.

    Raises:
        TypeError: if `model` is not a `keras.Model`.

    Example:

    >>> with kmp.policy_scope("mixed_float16"):
    ...     inputs = keras.Input((4,))
    ...     dense = keras.layers.Dense(4)(inputs)
    ...     model = kmp.Model(inputs, keras.layers.UnitNormalization()(dense))
    ...     rows = kmp.summary(model, print_fn=lambda _: None)
    >>> [(row["class"], row["compute_dtype"]) for row in rows][1:]
    [('Dense', 'float16'), ('UnitNormalization', 'float32')]
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model={model!r} of "
                        f"type {type(model).__name__}")
    rows = _layer_dtypes.layer_rows(model)
    (print_fn or print)(_layer_dtypes.format_table(model, rows))
    return rows
