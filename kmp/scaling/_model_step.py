"""kmp.Model's train step, what both backends share.

- `inside_model_step` runs a step with each loss scaler the model holds told
  so (`kmp.scaling._handoff`: gradients of a loss that skipped `scale_loss` are then
  applied undivided).
- `retries`: whether and how often a batch whose gradients overflowed is
  redone (`overflow_retries`; the loop is `kmp.scaling._retry`'s).
- `scaler_logs`: the logs a step adds (`loss_scale`, `skipped_steps`, ...).
- `wrap_optimizers` makes every optimizer a model holds a loss scaler before
  the first step is traced.
- `held_models_return_float32` makes the Keras models a custom step calls
  (a GAN's generator and discriminator) return float32, as kmp.Model does.

The step itself, and how it is wrapped into Keras' train function, are the
backend's (`kmp/backends/<backend>/trainer.py`).
"""

import contextlib
import functools

import keras
from keras import ops

from kmp import _keras_internals
from kmp.precision import _float32_layers
from kmp.scaling import _optimizers
from kmp.scaling import _retry
from kmp.scaling import _step as _scaling_step
from kmp import loss_scale as loss_scale_module

# Log keys that carry kmp.callbacks.LossScaleMonitor's per-step values out of
# the train function; kmp.Model's train function removes them.
MONITOR_LOG_PREFIX = "_kmp_monitor_"


@contextlib.contextmanager
def inside_model_step(model, own):
    """Runs a kmp.Model's train step with its scalers told so; yields them.

    Each loss scaler the model holds learns that it runs inside kmp.Model's
    train step (`StepRecord.model_step`: gradients of a loss that skipped
    `scale_loss` are applied undivided, with a warning) until the step
    returns; a subclass's own step (`own=False`) first gets its held models
    returning float32.
    """
    if not own:
        held_models_return_float32(model)
    scalers = list(_optimizers.scaling_optimizers(model).values())
    with contextlib.ExitStack() as stack:
        for optimizer in scalers:
            stack.enter_context(optimizer._kmp_record.model_step())
        yield scalers


def applied(scalers):
    """The scalers whose `apply` ran in this model step."""
    return [optimizer for optimizer in scalers if optimizer._kmp_record.answer is not None]


def all_applied(applied_scalers):
    """Whether every scaler of `applied(scalers)` applied its step: a
    boolean tensor, or `None` where none answered whether (no `apply`, or
    only with `enabled=False`). A custom step that skips puts back what its
    forward pass wrote (a BatchNormalization's moving statistics), as
    kmp.Model's own step does."""
    answers = [optimizer._kmp_record.answer for optimizer in applied_scalers]
    finite = [ops.cast(answer.finite, "bool") for answer in answers if answer.finite is not None]
    return functools.reduce(ops.logical_and, finite) if finite else None


def pop_monitor_logs(logs):
    """Takes the monitor's per-step values out of `logs` (in place), so that
    the progress bar, History, TensorBoard and CSVLogger, which show every key,
    never see them; returns them by their short names."""
    return {
        key[len(MONITOR_LOG_PREFIX):]: logs.pop(key)
        for key in list(logs)
        if key.startswith(MONITOR_LOG_PREFIX)
    }


def check_overflow_retries(model, own):
    """Refuses `overflow_retries` for a subclass's own `train_step`."""
    if _asked_retries(model) not in ("auto", 0) and not own:
        raise ValueError(
            "`overflow_retries` redoes batches in kmp.Model's own train_step; "
            f"{type(model).__name__} overrides `train_step`, whose metrics and "
            "optimizers kmp cannot roll back. Compile it with "
            "overflow_retries=0. Received: overflow_retries="
            f"{model._kmp_overflow_retries}"
        )


def held_models_return_float32(model):
    """Makes each Keras model `model` holds as an attribute return float32,
    and each layer it holds when a custom step calls it itself.

    A custom train_step mixes its sub-models' outputs with float32 data
    (keras.io's GAN guide: `tf.concat([self.generator(z), real_images])`;
    WGAN-GP: `fake_images - real_images`), which TensorFlow refuses for a
    float16 tensor; Keras' own mixed precision fails there. kmp.Model returns
    float32 under every policy, and so do the models it holds, from the
    first step on: their `call` casts floating outputs to float32 (the next
    layer casts them back to its compute dtype; a float32 output is left as
    it is). The step mixes those with what the layers it holds return
    (keras.io's masked autoencoder: `self.encoder(...) + positions` from its
    `PatchEncoder`), so a layer called by the step itself returns float32
    too; called from within another layer's `call` (the model's own), it
    returns what it computes. Done once per model.
    """
    for name, value in list(vars(model).items()):
        if (
            name.startswith("_")
            or not isinstance(value, keras.layers.Layer)
            or value is model
            or getattr(value, "_kmp_returns_float32", False)
        ):
            continue
        # object.__setattr__: an instance attribute Keras does not track.
        object.__setattr__(value, "call", _returning_float32(value, value.call))
        object.__setattr__(value, "_kmp_returns_float32", True)


def _returning_float32(layer, call):
    always = isinstance(layer, keras.Model)

    @functools.wraps(call)
    def call_returning_float32(*args, **kwargs):
        outputs = call(*args, **kwargs)
        if always or _keras_internals.called_alone(layer):
            return _float32_layers._to_float32(outputs)
        return outputs

    return call_returning_float32


def _asked_retries(model):
    return getattr(model, "_kmp_overflow_retries", "auto")


def is_users_scaler(model, optimizer):
    """Whether `optimizer` is a loss scaler the user passed to `model.compile`
    (kmp's, or Keras' that kmp took over), not one kmp made."""
    return optimizer is not None and optimizer is getattr(model, "_kmp_users_scaler", None)


def retries(model, own_step):
    """The `kmp.scaling._retry.Retries` of `model`'s train function, or `None`
    where no batch can be redone.

    `compile(overflow_retries=n)`: `n` retries a batch (`None` for 0).
    `"auto"`: the settling retries, where kmp made the scaler (a dynamic,
    enabled kmp scaler around the optimizer compile was given, without
    gradient accumulation); a scaler the user made keeps Keras' semantics
    (skipped, not redone). Only kmp.Model's own step (`own_step`) redoes a
    batch: a subclass's own step cannot have its metrics and optimizers
    rolled back.
    """
    optimizer = getattr(model, "optimizer", None)
    asked = _asked_retries(model)
    if not own_step or not isinstance(optimizer, loss_scale_module.LossScaleOptimizer):
        return None
    if asked == "auto" and not (
        not is_users_scaler(model, optimizer)
        and optimizer.enabled
        and optimizer.dynamic
        and not _scaling_step.accumulation_steps(optimizer)
    ):
        return None
    if asked == 0:
        return None
    settled = optimizer.built and int(ops.convert_to_numpy(optimizer.iterations)) > 0
    return _retry.Retries(asked, settled)


def uncounted_epoch_logs(logs, counted, own):
    """`logs` of a step whose epoch may have counted no step yet.

    Where `counted` (a boolean tensor: the loss tracker counted a step this
    epoch) is false, every step so far was skipped and the metrics, put back
    after each, hold nothing: Keras would report 0 (a perfect `mae`, which
    `EarlyStopping` and `ModelCheckpoint` take as the best epoch). The logs
    are then this skipped step's own (`own`: the metrics' results before
    they were put back), as Keras' own scaler, which counts a skipped step,
    would report them for the epoch's first step.
    """
    return {
        key: ops.where(counted, value, own[key]) if key in own else value
        for key, value in logs.items()
    }


SCALER_LOG_NAMES = ("loss_scale", "skipped_steps", "retried_steps")


def scaler_log_keys(model):
    """Every key `scaler_logs` can add to `model`'s train-step logs: the
    names alone (one scaler), or after each scaling optimizer's attribute
    name or own name (several)."""
    prefixes = [""]
    for name, optimizer in _optimizers.scaling_optimizers(model).items():
        prefixes += [name + "_", optimizer.name + "_"]
    return {prefix + name for prefix in prefixes for name in SCALER_LOG_NAMES}


def scaler_logs(model, applied, retrying=False, loss=None):
    """The logs of the loss scalers that applied in a train step.

    One scaler: `loss_scale` (where it scales) and `skipped_steps` (plus
    `retried_steps` when `retrying`, and, given the step's unscaled `loss`, the monitor's
    per-step values while one watches). Several (a GAN's): each named after
    its attribute, `d_optimizer_loss_scale`, ...
    """
    scalers = [
        opt for opt in applied if isinstance(opt, loss_scale_module.LossScaleOptimizer)
    ]
    names = {} if len(scalers) == 1 else {
        id(opt): name for name, opt in _optimizers.scaling_optimizers(model).items()}
    logs = {}
    for optimizer in scalers:
        prefix = "" if len(scalers) == 1 else names.get(id(optimizer), optimizer.name) + "_"
        counters = optimizer.counters  # one read of the counter vector
        if optimizer.scaling:  # a scale fixed at 1 (the guard alone) says nothing
            # The variable's value after the step, never the variable: Keras'
            # eager multi-step loop carries the logs in a tf.data Optional.
            logs[prefix + "loss_scale"] = optimizer.loss_scale
        logs[prefix + "skipped_steps"] = counters["skipped_steps"]
        if retrying:
            logs[prefix + "retried_steps"] = counters["retries"]
    if (
        len(scalers) == 1
        and loss is not None
        and scalers[0]._monitored
        and model.distribute_strategy.num_replicas_in_sync == 1
    ):
        # For kmp.callbacks.LossScaleMonitor, and only while one watches:
        # returned with the step's outputs (no extra device round trip),
        # then taken out of the logs by `pop_monitor_logs` before any
        # callback sees them. Not with several replicas: Keras would
        # all-reduce each of them, and collectives of different shapes
        # can be ordered differently on each replica; the monitor reads
        # the optimizer instead.
        logs.update(monitor_logs(scalers[0], loss))
    return logs


def monitor_logs(optimizer, loss):
    """The monitor's values of this step, under `MONITOR_LOG_PREFIX`: the
    counters and overflow flags `optimizer` holds now, and the unscaled loss."""
    counters, nonfinite_gradients = _scaling_step.monitor_state(optimizer)
    return {
        MONITOR_LOG_PREFIX + "counters": counters,
        MONITOR_LOG_PREFIX + "nonfinite_gradients": nonfinite_gradients,
        MONITOR_LOG_PREFIX + "loss": ops.cast(loss, "float32"),
    }


def wrap_optimizers(model, scaler_for, compile_settings):
    """Makes every optimizer the model holds a kmp.LossScaleOptimizer.

    `compile` wraps `optimizer`; a GAN's `d_optimizer` and
    `g_optimizer`, set by its own `compile`, are wrapped here, before
    the first step is traced, by the same rule (compile's `scaler_for`,
    given the model's values of `compile_settings`, compile's arguments
    and their defaults, but the retries, which choose no scaler). Both
    are passed in: compile's module reaches the backends, which import
    this one.
    """
    settings = {name: getattr(model, f"_kmp_{name}", default)
                for name, default in compile_settings.items() if name != "overflow_retries"}
    for name, optimizer in _optimizers.optimizers_by_attribute(model).items():
        if name == "optimizer" or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            continue
        wrapped = scaler_for(optimizer, model, **settings)
        if wrapped is not optimizer:
            if optimizer.built and not wrapped.built:
                # Built before fit (what a resumed run needs to get its
                # state back, in Keras too): so is its scaler.
                wrapped.build(_keras_internals.built_variables(optimizer))
            setattr(model, name, wrapped)
    # Each scaler's warnings name the attribute that holds it.
    for name, optimizer in _optimizers.scaling_optimizers(model).items():
        object.__setattr__(optimizer, "_kmp_attribute", name)
