"""kmp.Model's train step: what kmp adds around Keras' own.

- `reporting_scalers` wraps the `train_step` of the kmp.Model being trained
  (set once on the instance): the logs carry each loss scaler that applied
  (`loss_scale`, `skipped_steps`; `d_optimizer_loss_scale`, ... for several).
- `run_train_step` runs Keras' step so that a skipped step's loss and metrics
  stay out of the epoch's logs, and, with `overflow_retries`, redoes a batch
  whose gradients overflowed at a lower scale.
- `wrap_optimizers` makes every optimizer a model holds a loss scaler before
  the first step is traced.
- `held_models_return_float32` makes the Keras models a custom step calls
  (a GAN's generator and discriminator) return float32, as kmp.Model does.
"""

import contextlib
import functools

import keras
import tensorflow as tf
from keras import ops

from kmp import _keras_internals
from kmp import _optimizers
from kmp import distribute as distribute_module
from kmp import loss_scale as loss_scale_module
from kmp import policy as policy_module

# Log keys that carry kmp.callbacks.LossScaleMonitor's per-step values out of
# the train function; kmp.Model's `make_train_function` removes them.
MONITOR_LOG_PREFIX = "_kmp_monitor_"


def reporting_scalers(model, train_step, own):
    """Wraps `model`'s `train_step` so that its logs carry the loss scalers' state.

    Set once on the model instance by `kmp.Model.make_train_function` (a
    subclass's own step, a GAN's or a VAE's, with no change to the user's
    code; no class is changed). Before the step, each scaler the model holds
    learns that it runs inside kmp.Model's train step (so gradients of a loss
    that skipped `scale_loss` are applied undivided); after it, the logs
    carry each scaler that applied (`loss_scale`, `skipped_steps`;
    `d_optimizer_loss_scale`, ... for several).

    Args:
        model: The `kmp.Model`.
        train_step: The function of its class, called with `(model, data)`.
        own: Bool. Whether it is kmp.Model's own, where `overflow_retries`
            applies.

    Returns:
        A function of `data`, to be set as the instance's `train_step`.
    """
    @functools.wraps(train_step)
    def train_step_with_scaler_logs(data):
        if _asked_retries(model) not in ("auto", 0) and not own:
            raise ValueError(
                "`overflow_retries` redoes batches in kmp.Model's own train_step; "
                f"{type(model).__name__} overrides `train_step`, whose metrics and "
                "optimizers kmp cannot roll back. Compile it with "
                "overflow_retries=0. Received: overflow_retries="
                f"{model._kmp_overflow_retries}"
            )
        with inside_model_step(model, own) as scalers:
            logs = train_step(model, data)
        applied = [optimizer for optimizer in scalers if optimizer._kmp_record.applied]
        if applied and isinstance(logs, dict):
            retrying = own and retries_on(model, model.optimizer)
            logs = dict(logs, **scaler_logs(model, applied, retrying))
        return logs

    return train_step_with_scaler_logs


@contextlib.contextmanager
def inside_model_step(model, own):
    """Runs a kmp.Model's train step with its scalers told so; yields them.

    Each loss scaler the model holds learns that it runs inside kmp.Model's
    train step (gradients of a loss that skipped `scale_loss` are applied
    undivided, with a warning) until the step returns; a subclass's own step
    (`own=False`) first gets its held models returning float32.
    """
    if not own:
        held_models_return_float32(model)
    scalers = list(_optimizers.scaling_optimizers(model).values())
    for optimizer in scalers:
        optimizer._kmp_record.begin_model_step()
    try:
        yield scalers
    finally:
        for optimizer in scalers:
            optimizer._kmp_record.in_model_step = False


def held_models_return_float32(model):
    """Makes each Keras model `model` holds as an attribute return float32.

    A custom train_step mixes its sub-models' outputs with float32 data
    (keras.io's GAN guide: `tf.concat([self.generator(z), real_images])`;
    WGAN-GP: `fake_images - real_images`), which TensorFlow refuses for a
    float16 tensor; Keras' own mixed precision fails there. kmp.Model returns
    float32 under every policy, and so do the models it holds, from the
    first step on: their `call` casts floating outputs to float32 (the next
    layer casts them back to its compute dtype; a float32 output is left as
    it is). Done once per model.
    """
    for name, value in list(vars(model).items()):
        if (
            name.startswith("_")
            or not isinstance(value, keras.Model)
            or getattr(value, "_kmp_returns_float32", False)
        ):
            continue
        # object.__setattr__: an instance attribute Keras does not track.
        object.__setattr__(value, "call", _returning_float32(value.call))
        object.__setattr__(value, "_kmp_returns_float32", True)


def _returning_float32(call):
    @functools.wraps(call)
    def call_returning_float32(*args, **kwargs):
        return policy_module._to_float32(call(*args, **kwargs))

    return call_returning_float32


def run_train_step(model, data, keras_train_step):
    """Keras' own step (`keras_train_step`), with a skipped step kept out of
    the epoch's logs.

    Keras' step calls `optimizer.scale_loss(loss)` and
    `optimizer.apply_gradients`, which is all kmp's scaler needs. Keras
    would also count a skipped step's loss and metrics (one poisoned
    batch would make the epoch's loss NaN, and `TerminateOnNaN` or
    `EarlyStopping` react to a step that never happened): kmp restores
    the metrics to what they were before a skipped step and counts its
    loss apart; an epoch in which no step was applied logs the mean loss
    of its skipped steps.
    """
    optimizer = model.optimizer
    skipped_losses = getattr(model, "_kmp_skipped_losses", None)
    if (
        not isinstance(optimizer, loss_scale_module.LossScaleOptimizer)
        or not optimizer.enabled
        or skipped_losses is None
        # Keras' step applies nothing then (it warns that the model has no
        # trainable weights): no step to skip or redo.
        or not model.trainable_weights
    ):
        logs = keras_train_step(data)
        if getattr(model, "_kmp_attempt", None) is not None and isinstance(logs, dict):
            logs = dict(logs, **{distribute_module.RETRY_LOG: ops.convert_to_tensor(False)})
        return logs
    retries = retry_budget(model, optimizer)
    attempt = getattr(model, "_kmp_attempt", None)
    retry = None
    if retries is not None and attempt is not None:
        # kmp's train function redoes the batch around this compiled step
        # (see `kmp.distribute.make_function`): one attempt here.
        optimizer._kmp_record.retries_left = retries - attempt
        try:
            _, retry = _one_attempt(model, data, optimizer, keras_train_step)
        finally:
            optimizer._kmp_record.retries_left = None
    elif retries is not None:
        _retry_overflows(model, data, optimizer, retries, keras_train_step)
    else:
        _one_attempt(model, data, optimizer, keras_train_step)
    logs = dict(model.get_metrics_result())
    if "loss" in logs:
        logs["loss"] = ops.where(
            _keras_internals.loss_tracker(model).count > 0, logs["loss"], skipped_losses.result()
        )
    if attempt is not None:
        logs[distribute_module.RETRY_LOG] = (
            ops.convert_to_tensor(False) if retry is None else ops.cast(retry, "bool")
        )
    return logs

def _one_attempt(model, data, optimizer, keras_train_step):
    """Keras' step on one batch; a skipped step leaves the metrics as they were.

    Returns:
        `(loss, retry)`: the unscaled loss and whether the optimizer asks
        for the batch again (`None` without retries).
    """
    metric_variables = list(model.metrics_variables)
    before = [tf.identity(v.value) for v in metric_variables]
    optimizer._kmp_record.finite = None
    keras_train_step(data)
    record = optimizer._kmp_record
    finite, loss, retry = record.finite, record.last_loss, record.retry
    if finite is None or loss is None:
        return loss, retry

    # Selects, not a cond: on a CPU a cond costs more than a few scalar
    # assigns, and the metric variables are a handful of scalars.
    finite = ops.cast(finite, "bool")
    for variable, value in zip(metric_variables, before):
        variable.assign(ops.where(finite, variable.value, value))
    # Only a dropped batch's loss counts as lost (not one about to be retried).
    dropped = ops.logical_not(finite)
    if retry is not None:
        dropped = ops.logical_and(dropped, ops.logical_not(retry))
    model._kmp_skipped_losses.update_state(
        ops.where(dropped, ops.cast(loss, "float32"), 0.0)
        * model.distribute_strategy.num_replicas_in_sync,
        sample_weight=ops.cast(dropped, "float32"),
    )
    return loss, retry


# `overflow_retries="auto"`: retries for the first batch, until its gradients
# are finite or the scale reaches `min_scale` (2**24 to 1 takes 24 halvings),
# so that no batch is lost while the scale settles; then one per batch, so a
# rare overflowing batch is redone once at the backed-off scale instead of
# dropped (the scale moves as it would have for the skip).
_SETTLING_RETRIES = 32
_AUTO_RETRIES = 1


def _asked_retries(model):
    return getattr(model, "_kmp_overflow_retries", "auto")


def is_users_scaler(model, optimizer):
    """Whether `optimizer` is a loss scaler the user passed to `model.compile`
    (kmp's, or Keras' that kmp took over), not one kmp made."""
    return optimizer is not None and optimizer is getattr(model, "_kmp_users_scaler", None)


def retries_on(model, optimizer):
    """Whether a batch of `model`'s own train step can be redone (see `retry_budget`)."""
    asked = _asked_retries(model)
    if asked != "auto":
        return bool(asked)
    return (
        isinstance(optimizer, loss_scale_module.LossScaleOptimizer)
        # A scaler the user made keeps Keras' semantics: skipped, not redone.
        and not is_users_scaler(model, optimizer)
        and optimizer.enabled
        and optimizer.dynamic
        and not getattr(optimizer.inner_optimizer, "gradient_accumulation_steps", None)
        and _keras_internals.supports_no_merge_call()
    )


def retry_budget(model, optimizer):
    """The retries a batch of `model`'s own train step gets, or `None` (none).

    `compile(overflow_retries=n)`: `n` (`None` for 0). `"auto"`: where a retry
    can run and kmp made the scaler (a dynamic kmp scaler around the optimizer
    compile was given, without gradient accumulation, and a step without
    `merge_call`), an int32 tensor: `_SETTLING_RETRIES` until a step
    has been applied, then `_AUTO_RETRIES`; elsewhere `None`.
    """
    asked = _asked_retries(model)
    if asked != "auto":
        return asked or None
    if not retries_on(model, optimizer):
        return None
    settled = ops.greater(optimizer.iterations, 0)
    return ops.cast(ops.where(settled, _AUTO_RETRIES, _SETTLING_RETRIES), "int32")


def _retry_overflows(model, data, optimizer, retries, keras_train_step):
    """Redoes a batch whose gradients overflowed, at a lower scale.

    ```
    attempt = 0
    do:
        loss, retry = one attempt, `retries - attempt` retries left
        attempt += 1
    while retry   # the gradients overflowed, the loss did not, and
                  # retries were left: the scale was backed off
    ```

    The first attempt is straight-line code; a `tf.while_loop` redoes the
    batch only when it overflowed (a `tf.cond`). Under a
    strategy every replica takes the same decision (on all-reduced
    gradients), so all retry together. Under XLA the loop takes another
    shape (`_retry_overflows_compiled`).
    """
    if not _keras_internals.supports_no_merge_call():
        raise ValueError(
            "`overflow_retries` needs the train step to run without "
            "`merge_call`: no strategy, OneDeviceStrategy, or MirroredStrategy "
            "on GPUs with `jit_compile=True`. This strategy "
            f"({type(model.distribute_strategy).__name__}) synchronizes through "
            "merge_call, which TensorFlow refuses inside the retry loop. "
            "Received: overflow_retries=" f"{retries}"
        )

    if _keras_internals.in_xla_context():
        _retry_overflows_compiled(model, data, optimizer, retries, keras_train_step)
        return

    def attempt(count, retry, loss):
        # An input of the scaler's step (see `kmp.loss_scale._step`).
        optimizer._kmp_record.retries_left = retries - count
        try:
            new_loss, new_retry = _one_attempt(model, data, optimizer, keras_train_step)
        finally:
            optimizer._kmp_record.retries_left = None
        return count + 1, new_retry, ops.cast(new_loss, "float32")

    # The first attempt runs as straight-line code: a step inside a
    # `tf.while_loop` runs measurably slower (about 15% on a model of many
    # small variables), so only a batch to redo enters the loop.
    count, retry, loss = attempt(ops.convert_to_tensor(0), None, None)

    # A function TensorFlow does not inline: the branch not taken is then one
    # call op instead of the whole step again (whose skipped ops cost about
    # 10% of a step on a model of many small variables).
    @tf.function(autograph=False,
                 experimental_attributes=_keras_internals.noinline_function_attributes())
    def redo(count, retry, loss):
        return tf.while_loop(lambda count, retry, loss: retry, attempt, (count, retry, loss))[2]

    loss = tf.cond(retry, lambda: redo(count, retry, loss), lambda: loss)
    # The loss of the attempt that counted, for the monitor's logs.
    optimizer._kmp_record.last_loss = loss


def _retry_overflows_compiled(model, data, optimizer, retries, keras_train_step):
    """`_retry_overflows` under XLA: the loop carries gradients, not variables.

    ```
    grads, finite, retry = attempt(0)    # forward, backward, check, scale;
    while retry:                         # nothing applied yet
        grads, finite, retry = attempt(count)
    if finite:
        apply(grads)                     # once, after the loop
    ```

    XLA compiles both branches of a conditional and every loop body, and
    gives their outputs buffers of their own: a loop or a branch that may
    write the variables (a whole step redone) copies every weight and slot
    on every step, even when it does not run (a `tf.cond` around the retry
    loop copied each kernel and slot twice per step). Here no loop or branch
    writes a variable but the apply, whose skip branch alone copies them.
    Without XLA, where a branch not taken costs its ops and no copies,
    `_retry_overflows` keeps the loop that redoes whole steps.
    """
    record = optimizer._kmp_record

    def attempt(count):
        # Inputs of the scaler's step (see `kmp.loss_scale._step`).
        record.retries_left, record.defer, record.deferred = retries - count, True, None
        try:
            loss, retry = _one_attempt(model, data, optimizer, keras_train_step)
            deferred, finite = record.deferred, record.finite
        finally:
            record.retries_left, record.defer, record.deferred = None, False, None
        if deferred is None:  # the step applied no gradients through this scaler
            raise ValueError(
                "`overflow_retries` redoes batches whose gradients the model's optimizer "
                f"applies; this train step applied none through {optimizer.name}. "
                "Compile it with overflow_retries=0."
            )
        return count + 1, retry, ops.cast(loss, "float32"), finite, deferred

    count, retry, loss, finite, deferred = attempt(ops.convert_to_tensor(0))
    # A sparse gradient (an embedding's `IndexedSlices`) enters the loop as
    # its values and indices: its dense shape stays the first attempt's
    # constant, which XLA needs to compile the sparse update.
    dense_shapes = [getattr(g, "dense_shape", None) for g in deferred.grads]

    def parts(grads):
        return [(g.values, g.indices) if isinstance(g, tf.IndexedSlices) else g for g in grads]

    def redo(count, retry, loss, finite, grads, scale):
        count, retry, loss, finite, again = attempt(count)
        return count, retry, loss, finite, parts(again.grads), again.scale

    _, _, loss, finite, grads, scale = tf.while_loop(
        lambda count, retry, *_: retry,
        redo,
        (count, retry, loss, finite, parts(deferred.grads), deferred.scale),
    )
    grads = [g if shape is None else tf.IndexedSlices(g[0], g[1], shape)
             for g, shape in zip(grads, dense_shapes)]
    deferred.apply_if(finite, grads, scale)
    # The loss of the attempt that counted, for the monitor's logs.
    record.last_loss = loss


def scaler_logs(model, applied, retrying=False):
    """The logs of the loss scalers that applied in a train step.

    One scaler: `loss_scale` and `skipped_steps` (plus `retried_steps` when
    `retrying`, and the monitor's per-step values while one watches).
    Several (a GAN's): each named after its attribute,
    `d_optimizer_loss_scale`, ...
    """
    names = {id(opt): name for name, opt in _optimizers.scaling_optimizers(model).items()}
    scalers = [
        opt for opt in applied if isinstance(opt, loss_scale_module.LossScaleOptimizer)
    ]
    logs = {}
    for optimizer in scalers:
        prefix = "" if len(scalers) == 1 else names.get(id(optimizer), optimizer.name) + "_"
        logs[prefix + "loss_scale"] = optimizer.loss_scale
        logs[prefix + "skipped_steps"] = optimizer.skipped_steps
        if retrying:
            logs[prefix + "retried_steps"] = optimizer.counters["retries"]
    loss = scalers[0]._kmp_record.last_loss if len(scalers) == 1 else None
    if (
        loss is not None
        and scalers[0]._monitored
        and model.distribute_strategy.num_replicas_in_sync == 1
    ):
        # For kmp.callbacks.LossScaleMonitor, and only while one watches:
        # returned with the step's outputs (no extra device round trip),
        # then taken out of the logs by `make_train_function` before any
        # callback sees them. Not with several replicas: Keras would
        # all-reduce each of them, and collectives of different shapes
        # can be ordered differently on each replica; the monitor reads
        # the optimizer instead.
        counters, nonfinite_gradients = loss_scale_module.monitor_state(scalers[0])
        logs[MONITOR_LOG_PREFIX + "counters"] = counters
        logs[MONITOR_LOG_PREFIX + "nonfinite_gradients"] = nonfinite_gradients
        logs[MONITOR_LOG_PREFIX + "loss"] = ops.cast(loss, "float32")
    return logs

def wrap_optimizers(model, loss_scale_optimizer):
    """Makes every optimizer the model holds a kmp.LossScaleOptimizer.

    `compile` wraps `optimizer`; a GAN's `d_optimizer` and
    `g_optimizer`, set by its own `compile`, are wrapped here, before
    the first step is traced, by the same rule (`loss_scale`).
    """
    loss_scale = getattr(model, "_kmp_loss_scale", "auto")
    for name, optimizer in _optimizers.optimizers_by_attribute(model).items():
        if name == "optimizer" or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            continue
        wrapped = loss_scale_optimizer(optimizer, loss_scale, model)
        if wrapped is not optimizer:
            setattr(model, name, wrapped)
    # Each scaler's warnings name the attribute that holds it.
    for name, optimizer in _optimizers.scaling_optimizers(model).items():
        object.__setattr__(optimizer, "_kmp_attribute", name)
