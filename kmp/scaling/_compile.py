"""What `kmp.Model.compile` decides about loss scaling and the guard.

- `check_settings`: `loss_scale`, `overflow_retries`, `skip_nonfinite` and
  `skip_spikes`, each checked before anything changes.
- `scaler_for`: the optimizer a model trains with for those settings: a
  dynamic `kmp.LossScaleOptimizer` where the model computes in float16, the
  guard (a scale fixed at 1, which scales nothing and skips non-finite steps)
  where it computes in bfloat16 or `skip_nonfinite=True` (or `skip_spikes`)
  asks for it, the optimizer as given otherwise.
- `users_scaler`, `continue_scaling`: whose scaler it is, and a recompile's
  scaler going on from the last one.
- `with_settings`, `compile_from_config`: the settings in Keras' compile
  config, and back.
"""

import numbers

import keras
import numpy as np

from kmp import backends
from kmp import loss_scale as loss_scale_module
from kmp.precision import _compensated
from kmp.precision._float32_layers import _computes_in, _stores_in
from kmp.scaling import _settings

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_LOSS_SCALE_CHOICES = (
    f"'auto', 'dynamic', a number in (0, {_FLOAT32_MAX:.8g}] (float32), or None"
)
# `overflow_retries` counts down in an int32 tensor.
_INT32_MAX = int(np.iinfo(np.int32).max)
# A scale fixed at 1: the guard alone.
_GUARD = dict(initial_scale=1.0, dynamic=False, min_scale=1.0, max_scale=1.0)


def check_settings(loss_scale, overflow_retries, skip_nonfinite, skip_spikes,
                   compensation="kahan"):
    """Raises `ValueError` naming the first of compile's scaling arguments
    that is not one of its choices."""
    if loss_scale not in (None, "auto", "dynamic") and (
        # A fixed scale is held in a float32 variable: beyond float32's range
        # it would become inf (or 0), and every step would be skipped.
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, numbers.Real)
        or not (0 < loss_scale <= _FLOAT32_MAX)
        or np.float32(loss_scale) == 0
    ):
        raise ValueError(
            f"`loss_scale` must be {_LOSS_SCALE_CHOICES}. Received: loss_scale={loss_scale!r}"
        )
    if overflow_retries != "auto" and (
        isinstance(overflow_retries, bool)
        or not isinstance(overflow_retries, numbers.Integral)
        or not 0 <= overflow_retries <= _INT32_MAX
    ):
        raise ValueError(
            f"`overflow_retries` must be 'auto' or an integer in [0, {_INT32_MAX}] (0: a "
            "batch whose gradients overflow is dropped at once). Received: "
            f"overflow_retries={overflow_retries!r}"
        )
    if not (skip_nonfinite == "auto" or isinstance(skip_nonfinite, bool)):
        raise ValueError(
            "`skip_nonfinite` must be 'auto' (skip under a 16-bit policy), True or False. "
            f"Received: skip_nonfinite={skip_nonfinite!r}"
        )
    _settings.check_spike_threshold(skip_spikes)
    _settings.check_compensation(compensation)
    if skip_nonfinite is False and skip_spikes is not None:
        raise ValueError(
            "`skip_spikes` skips steps through the same guard that skips non-finite ones: "
            "it cannot be combined with skip_nonfinite=False. Received: "
            f"skip_nonfinite=False, skip_spikes={skip_spikes!r}"
        )


def _refuse_unguarded_scaling(received):
    raise ValueError(
        "Loss scaling skips the steps whose scaled gradients overflow, to find its scale: "
        "`skip_nonfinite=False` needs `loss_scale=None` and an optimizer that is not a "
        f"LossScaleOptimizer. Received: skip_nonfinite=False, {received}"
    )


def _refuse_keras_own_update_of_16_bit_weights(model):
    layer = _stores_in(model, _compensated.LOW_PRECISION)
    if layer is not None:
        raise ValueError(
            "`skip_nonfinite=False` leaves the update to Keras' own optimizer, which does not "
            "train 16-bit weights (Adam's step, and any update below half a step of the "
            "weight, rounds to 0): keep `skip_nonfinite='auto'` (kmp's scaler computes the "
            "update in float32 and skips only non-finite steps), or keep the weights in "
            "float32 ('mixed_bfloat16'). Received: skip_nonfinite=False, with the weights of "
            f"layer '{layer}' stored in 16 bits"
        )


def scaler_for(optimizer, model, loss_scale="auto", skip_nonfinite="auto", skip_spikes=None,
               compensation="kahan"):
    """The optimizer `model` trains with under compile's settings.

    ```
    a kmp.LossScaleOptimizer         -> as given
    Keras' LossScaleOptimizer        -> kmp's, with its settings (or, with
                                        loss_scale=None, its inner optimizer)
    loss_scale "auto"                -> "dynamic" if the model computes in
                                        float16, else None
    loss_scale "dynamic" or a number -> kmp's, dynamic or fixed there
    loss_scale None                  -> the guard (a scale fixed at 1) where
                                        skip_nonfinite is True, or "auto" and
                                        the model computes in bfloat16, or
                                        skip_spikes is set; else as given
    ```

    Every scaler made here gets `skip_spikes` and `compensation`.

    Raises:
        ValueError: where `skip_nonfinite=False` meets loss scaling, or
            `skip_spikes` or `compensation` a scaler passed with another
            setting.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, loss_scale_module.LossScaleOptimizer):
        if skip_nonfinite is False:
            _refuse_unguarded_scaling(f"optimizer={type(optimizer).__name__}")
        if skip_spikes is not None and optimizer.skip_spikes != float(skip_spikes):
            raise ValueError(
                "`skip_spikes` is a setting of the kmp.LossScaleOptimizer passed to compile: "
                f"pass `skip_spikes={skip_spikes!r}` to it instead. Received: compile("
                f"skip_spikes={skip_spikes!r}) with its skip_spikes={optimizer.skip_spikes!r}"
            )
        if compensation != "kahan" and optimizer.compensation != compensation:
            raise ValueError(
                "`compensation` is a setting of the kmp.LossScaleOptimizer passed to compile: "
                f"pass `compensation={compensation!r}` to it instead. Received: compile("
                f"compensation={compensation!r}) with its "
                f"compensation={optimizer.compensation!r}"
            )
        return optimizer
    spikes = {"compensation": compensation}
    if skip_spikes is not None:
        spikes["skip_spikes"] = skip_spikes
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # One scaler, never two: take over Keras' settings with kmp's.
        if loss_scale is not None:
            if skip_nonfinite is False:
                _refuse_unguarded_scaling("optimizer=keras.optimizers.LossScaleOptimizer")
            return loss_scale_module.LossScaleOptimizer(
                optimizer.inner_optimizer, **_settings.from_keras_scaler(optimizer), **spikes
            )
        optimizer = optimizer.inner_optimizer
    if loss_scale == "auto":
        loss_scale = "dynamic" if _computes_in(model, ("float16",)) else None
    if loss_scale is None:
        # "auto": where the model computes in bfloat16. Under float16 a loss
        # scale of None (`auto_scale_loss=False`) is the user's choice of
        # Keras' plain step, kept as Keras keeps it.
        guarded = skip_spikes is not None or skip_nonfinite is True or (
            skip_nonfinite == "auto" and _computes_in(model, ("bfloat16",)))
        if not guarded:
            if skip_nonfinite is False:
                _refuse_keras_own_update_of_16_bit_weights(model)
            return optimizer
        return loss_scale_module.LossScaleOptimizer(optimizer, **_GUARD, **spikes)
    if skip_nonfinite is False:
        _refuse_unguarded_scaling(f"loss_scale={loss_scale!r} (float16 computation)"
                                  if loss_scale == "dynamic" else f"loss_scale={loss_scale!r}")
    if loss_scale == "dynamic":
        return loss_scale_module.LossScaleOptimizer(optimizer, **spikes)
    return loss_scale_module.LossScaleOptimizer(
        optimizer, initial_scale=loss_scale, dynamic=False, min_scale=loss_scale,
        max_scale=loss_scale, **spikes,
    )


def users_scaler(given, optimizer, model):
    """The loss scaler `compile` uses, if the user made it; else `None`.

    Args:
        given: The optimizer passed to `compile` (after
            `keras.optimizers.get`).
        optimizer: The optimizer `compile` uses (`scaler_for`'s).
        model: The model being compiled, still holding its previous
            optimizer.

    A scaler the user passed (kmp's, or Keras' that kmp took over) keeps
    Keras' semantics: an overflowing batch is skipped, not redone, unless
    `overflow_retries` asks for retries. The scaler kmp made around a plain
    optimizer stays kmp's when it is compiled again (`compile(
    model.optimizer)`).
    """
    if not (
        isinstance(optimizer, loss_scale_module.LossScaleOptimizer)
        and isinstance(given, keras.optimizers.LossScaleOptimizer)
    ):
        return None
    previous = getattr(model, "optimizer", None)
    if given is previous and previous is not getattr(model, "_kmp_users_scaler", None):
        return None
    return optimizer


def continue_scaling(model, previous, scaler):
    """Starts `scaler` (made by a recompile) at `previous`'s scale and counters.

    A fine-tune compiles again with a new optimizer; a fresh scaler would
    start at 2**15 again and drop the batches that overflow until it has
    backed off to where the last one was. A scaler the user passes starts
    as it was made.
    """
    if not (
        isinstance(previous, loss_scale_module.LossScaleOptimizer)
        and isinstance(scaler, loss_scale_module.LossScaleOptimizer)
        and previous.built
        and previous.dynamic
        and scaler.dynamic
        and model.built
    ):
        return
    with backends.get("trainer").strategy_scope(model):
        if not scaler.built:
            scaler.build(model.trainable_variables)
        scaler._kmp_scale.assign(
            min(max(float(previous.loss_scale), scaler.min_scale), scaler.max_scale)
        )
        scaler._counters.assign(previous._counters.value)


# compile's arguments kmp adds, with their defaults: the names of the
# model's attributes that hold them are `_kmp_<name>`.
SETTINGS = {"loss_scale": "auto", "overflow_retries": "auto", "skip_nonfinite": "auto",
            "skip_spikes": None, "compensation": "kahan"}


def with_settings(model, config, is_users_scaler):
    """`config` (Keras' compile config) with kmp's compile arguments."""
    if config:  # Keras returns {} for a model that was never compiled.
        for name, default in SETTINGS.items():
            config[name] = getattr(model, f"_kmp_{name}", default)
        # Whether the user passed the scaler (no retries by default); the
        # loaded optimizer is passed to compile() again, which would
        # otherwise take it for the user's.
        config["users_scaler"] = is_users_scaler(model, getattr(model, "optimizer", None))
    return config


def compile_from_config(model, config):
    config = keras.saving.deserialize_keras_object(config)
    # Files saved before kmp told the two apart: the scaler kmp made.
    users_scaler = config.pop("users_scaler", False)
    model.compile(**config)
    object.__setattr__(
        model, "_kmp_users_scaler", getattr(model, "optimizer", None) if users_scaler else None
    )
    if getattr(model, "optimizer", None) is not None and model.built:
        model.optimizer.build(model.trainable_variables)
