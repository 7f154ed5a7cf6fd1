"""kmp.convert and kmp.summary: bring any Keras model under a precision policy."""

import contextlib
import warnings

import keras

from kmp import _keras_internals
from kmp import model as model_module
from kmp import policy as policy_module

@contextlib.contextmanager
def _keras_policy(name):
    # Keras' global policy only: kmp's own state (keep_float32) is left alone.
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
        if not isinstance(model, _keras_internals.Functional):
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
    already (a clone); otherwise its layers that follow its own policy are
    switched to `policy` for each call and switched back after.
    """

    def __init__(self, model, policy=None, **kwargs):
        kwargs.setdefault("name", model.name)
        super().__init__(**kwargs)
        self.wrapped = model
        self._kmp_wrapped_policy = policy

    def compile(self, optimizer="rmsprop", *args, loss_scale="auto", **kwargs):
        # "auto" reads the layers' dtypes, which are the policy's only while
        # the model runs when the layers are the original's.
        if loss_scale == "auto" and self._kmp_wrapped_policy == "mixed_float16":
            loss_scale = "dynamic"
        super().compile(optimizer, *args, loss_scale=loss_scale, **kwargs)

    def call(self, inputs, training=None):
        with contextlib.ExitStack() as stack:
            if self._kmp_wrapped_policy is not None:
                stack.enter_context(
                    policy_module._layer_policies(
                        _following_layers(self.wrapped, self._kmp_wrapped_policy)
                    )
                )
                # Planned after the switch: before it, the layers kmp keeps in
                # float32 may not have been 16-bit at all.
                stack.enter_context(
                    policy_module._float32_islands(
                        self.wrapped, getattr(self, "_kmp_keep_float32", None)
                    )
                )
            if self.wrapped._call_has_training_arg:
                return self.wrapped(inputs, training=training)
            return self.wrapped(inputs)

    def get_config(self):
        return model_module._with_keep_float32({
            "model": keras.saving.serialize_keras_object(self.wrapped),
            "policy": self._kmp_wrapped_policy,
            "name": self.name,
        }, self)

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        entries = config.pop("keep_float32", None)
        config["model"] = keras.saving.deserialize_keras_object(config["model"])
        return model_module._restore_keep_float32(cls(**config), entries)


def _following_layers(model, policy):
    """Each layer of `model` that follows the model's own policy, mapped to `policy`.

    A layer with a policy of its own (`dtype=` on the layer, a quantized or
    a `DTypePolicyMap` one) and the input layers are left out.
    """
    source = model.dtype_policy.name
    return {
        layer: policy
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if policy_module._can_change_policy(layer)
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
            return model_module.Model(inputs[0], outputs[0], name=clone.name)
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
    converted.compile(optimizer=optimizer, loss_scale=loss_scale, **config)


def _check_convertible(model):
    """Raises for a model kmp.convert cannot bring along as it is.

    A model without `call()` cannot run under kmp's model; one with its own
    `train_step` (a GAN, a VAE) or, when it is not functional, its own
    `compile` would lose them in kmp's. Both are one change away: derive the
    class from `kmp.Model` instead of `keras.Model`.
    """
    cls = type(model)
    fix = (
        f"Derive it from kmp.Model instead: `class {cls.__name__}(kmp.Model): ...` "
        "and call kmp.set_policy(...) before building it. kmp then wraps every "
        "optimizer it holds and reports each; add "
        "`loss = self.<optimizer>.scale_loss(loss)` inside each GradientTape."
    )
    functional = isinstance(model, (_keras_internals.Functional, keras.Sequential))
    if not functional and cls.call is keras.Model.call:
        raise TypeError(
            f"kmp.convert runs the model it converts, but {cls.__name__} "
            f"({model.name!r}) defines no call(): it trains only through its own "
            f"train_step. {fix}"
        )
    if isinstance(model, model_module.Model):
        return  # rebuilt as its own class: its train_step and compile stay
    own = [
        name for name in ("train_step", "compile")
        if getattr(cls, name) is not getattr(keras.Model, name)
        and (name == "train_step" or not functional)
    ]
    if own:
        raise TypeError(
            f"kmp.convert would replace {cls.__name__}'s own "
            f"{' and '.join(f'`{name}`' for name in own)} with kmp.Model's, and "
            f"{cls.__name__}'s training would no longer be its own. {fix}"
        )


def convert(model, policy=None, keep_float32=None, compile=True):
    """Returns a `kmp.Model` that is `model` under a precision policy.

    One call, as fastai's `to_fp16()` or Apex's `amp.initialize`:
    `kmp.convert(model).compile(...).fit(...)` trains `model`'s architecture
    in mixed precision with loss scaling and float32 outputs. How:

    ```
    functional, Sequential, keras-hub model, kmp.Model:
        rebuild from get_config() with every layer that followed the model's
        policy now on `policy` (a layer with its own dtype= keeps it),
        copy the weights, return a functional kmp.Model over the new graph
    subclassed model:
        rebuild from get_config() and copy the weights if it can be;
        otherwise WRAP IT: a kmp.Model whose call runs the original with its
        layers switched to `policy` for the call. The wrapper shares the
        original's weights (training one trains the other); kmp warns.
    compiled model (unless compile=False):
        compile the result with the same loss, metrics and optimizer
        configuration: a fresh optimizer, wrapped for loss scaling when the
        result computes in float16
    ```
    The model passed in is never changed.

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

    Returns:
        A `kmp.Model`.

    Raises:
        TypeError: if `model` is not a `keras.Model`, or an entry of
            `keep_float32` is neither a string nor a layer class.
        ValueError: if `policy` is not a policy, a name in `keep_float32`
            (or in `kmp.set_policy`'s) is no layer of `model` (the message
            lists the names there are), or the compile configuration cannot
            be copied.

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
    _check_convertible(model)
    source = getattr(model.dtype_policy, "name", None)
    with _keras_policy(target.name):
        if isinstance(model, (_keras_internals.Functional, keras.Sequential)):
            try:
                converted = _as_kmp_model(_rebuild(model, source, target.name))
            except Exception as error:  # not rebuildable from its config: wrap it
                warnings.warn(
                    f"kmp.convert could not rebuild {model.name!r} faithfully "
                    f"from its config ({type(error).__name__}: {error}); the "
                    "result wraps it and shares its weights, so training the "
                    "result trains the original. Register its custom layers "
                    "(@keras.saving.register_keras_serializable()) to get a copy."
                )
                converted = _WrappedModel(model, policy=target.name)
        else:
            try:
                clone = _rebuild(model, source, target.name)
                converted = (
                    clone if isinstance(clone, model_module.Model) else _WrappedModel(clone)
                )
            except Exception as error:  # no usable get_config(): wrap it
                warnings.warn(
                    f"kmp.convert could not rebuild {model.name!r} from its "
                    f"config ({type(error).__name__}: {error}); the result wraps "
                    "it and shares its weights, so training the result trains "
                    "the original. Implement get_config() to get a copy."
                )
                converted = _WrappedModel(model, policy=target.name)
    # object.__setattr__: Keras would track the rules as state.
    object.__setattr__(converted, "_kmp_keep_float32", rules)
    if compile and getattr(model, "compiled", False):
        _compile_like(converted, model)
    return converted


def _reasons(model):
    rules = getattr(model, "_kmp_keep_float32", None)
    plan = {}
    if isinstance(model, model_module.Model):
        plan = {
            id(layer): (role, reason)
            for layer, role, reason in policy_module._float32_plan(model, rules)
        }
    return plan


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

    Example:

    >>> with kmp.policy_scope("mixed_float16"):
    ...     inputs = keras.Input((4,))
    ...     dense = keras.layers.Dense(4)(inputs)
    ...     model = kmp.Model(inputs, keras.layers.UnitNormalization()(dense))
    ...     rows = kmp.summary(model, print_fn=lambda _: None)
    >>> [(row["class"], row["compute_dtype"]) for row in rows][1:]
    [('Dense', 'float16'), ('UnitNormalization', 'float32')]
    """
    plan = _reasons(model)
    model_policy = getattr(model.dtype_policy, "name", None)
    rows, seen = [], set()
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        compute_dtype = keras.backend.standardize_dtype(layer.compute_dtype)
        policy_name = getattr(layer.dtype_policy, "name", str(layer.dtype_policy))
        if id(layer) in plan:
            role, reason = plan[id(layer)]
            if role == "island":
                reason += f"; outputs cast back to {compute_dtype}"
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
            if isinstance(layer, policy_module._KERAS_FLOAT32_MATH_CLASSES) and (
                compute_dtype != "float32"
            ):
                reason += "; Keras computes its statistics in float32"
        rows.append(
            {
                "layer": policy_module._layer_label(layer),
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
    header = ("layer", "class", "compute", "variables", "why")
    table = [header] + [
        (r["layer"], r["class"], r["compute_dtype"], r["variable_dtype"], r["reason"])
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(4)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row[:4], widths))
        + "  "
        + row[4]
        for row in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    (print_fn or print)(
        f"Model {model.name!r}, policy {model_policy}\n" + "\n".join(lines)
    )
    return rows
