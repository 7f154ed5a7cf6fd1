"""kmp.Model's train step on TensorFlow, and its train function.

The same names as `kmp/backends/jax/trainer.py` (`train_step`,
`reporting_step`, `train_function`, `test_function`, `check_compile`,
`strategy_scope`, `build_from_iterator`):

- `train_step` is kmp.Model's own step: Keras' forward and backward pass,
  the scaler's apply called with values and answering with values, a
  skipped step's loss, metrics and forward-pass state kept out of the
  epoch, and, given `retries_left` (by kmp's train function), whether to
  redo the batch (`kmp.scaling._retry`).
- `train_function` runs each batch through `kmp.scaling._retry.Retries`
  where batches can be redone (`distribute.RetryingFunction`), and takes
  the monitor's values out of the logs.
- `reporting_step` wraps a subclass's own `train_step` (set once on the
  instance): the logs carry each loss scaler that applied.
"""

import functools

import keras
import tensorflow as tf
from keras import ops

from kmp import _keras_internals
from kmp.scaling import _model_step
from kmp.scaling import _retry
from kmp.scaling import _step as _scaling_step
from kmp import loss_scale as loss_scale_module
from kmp.backends.tensorflow import distribute as distribute_module
from kmp.backends.tensorflow import layer_state as layer_state_module


# Set once on the instance: each `tf.function` Keras makes traces it afresh
# (see `kmp.Model.make_train_function`).
REWRAP_EACH_TRAIN_FUNCTION = False


def check_compile(model, overflow_retries):
    """Refuses a `tf.distribute` strategy kmp does not support."""
    distribute_module.check_strategy(model.distribute_strategy)


def strategy_scope(model):
    return model.distribute_strategy.scope()


def train_function(model, own_step):
    """kmp's train function around Keras' `model.train_function`.

    Where kmp.Model's own step can redo a batch (`_model_step.retries_on`),
    one that runs each batch through `kmp.scaling._retry.Retries`
    (`distribute.RetryingFunction`), eagerly, as a graph or under XLA;
    elsewhere multi-worker, one step per call (see
    `distribute.train_or_test_function`). The monitor's values leave the
    logs.
    """
    retries = _model_step.retries(model, own_step)
    return _TrainFunction(model, distribute_module.train_or_test_function(
        model, model.train_step, model.train_function, retries=retries
    ))


class _TrainFunction:
    """What `train_function` returns: `function`, with the monitor's values
    taken out of its logs."""

    def __init__(self, model, function):
        self._model, self._function = model, function

    def __call__(self, iterator):
        logs = self._function(iterator)
        if isinstance(logs, dict):
            # object.__setattr__: Keras would track the dict as part of the
            # model (and take ~10 us a step doing so).
            object.__setattr__(
                self._model, "_kmp_monitor_logs", _model_step.pop_monitor_logs(logs)
            )
        return logs


def test_function(model):
    return distribute_module.train_or_test_function(model, model.test_step, model.test_function)


def build_from_iterator(model, iterator, strategy):
    """Builds `model` from this worker's batch under a multi-worker strategy.

    Keras averages the first batch over replicas just to read its shapes,
    which fails across workers; this worker's batch has them. Returns
    whether it built.
    """
    if not distribute_module.is_multi_worker(strategy):
        return False
    distribute_module.symbolic_build(model, iterator)
    return True


def reporting_step(model, train_step, own):
    """Wraps a subclass's own `train_step` so that its logs carry the loss
    scalers' state; `None` for kmp.Model's own step, which reports itself.

    Set once on the model instance by `kmp.Model.make_train_function` (a
    subclass's own step, a GAN's or a VAE's, with no change to the user's
    code; no class is changed). Before the step, each scaler the model holds
    learns that it runs inside kmp.Model's train step (so gradients of a loss
    that skipped `scale_loss` are applied undivided); after it, the logs
    carry each scaler that applied (`loss_scale`, `skipped_steps`;
    `d_optimizer_loss_scale`, ... for several), read from what each one's
    `apply` recorded (`kmp.scaling._handoff.StepRecord`).

    Args:
        model: The `kmp.Model`.
        train_step: The function of its class, called with `(model, data)`.
        own: Bool. Whether it is kmp.Model's own.

    Returns:
        A function of `data`, to be set as the instance's `train_step`, or
        `None` where `own`.
    """
    if own:
        return None

    @functools.wraps(train_step)
    def train_step_with_scaler_logs(data):
        _model_step.check_overflow_retries(model, own)
        layer_state = layer_state_module.ForwardState(model)
        with _model_step.inside_model_step(model, own) as scalers:
            logs = train_step(model, data)
            applied = _model_step.applied(scalers)
            finite = _model_step.all_applied(applied)
            if finite is not None:  # a skipped step's forward pass wrote nothing
                layer_state.restore_unless(finite)
            if applied and isinstance(logs, dict):
                answer = applied[0]._kmp_record.answer if len(applied) == 1 else None
                logs = dict(logs, **_model_step.scaler_logs(
                    model, applied, loss=None if answer is None else answer.loss
                ))
        return logs

    return train_step_with_scaler_logs


def train_step(model, data, keras_train_step, retries_left=None):
    """kmp.Model's own train step: Keras' step, with the loss-scaled apply
    and a skipped step kept out of the epoch's logs.

    ```
    x, y, sample_weight = data
    with GradientTape() as tape:              # as Keras' own train_step
        loss = compute_loss(x, y, model(x, training=True), sample_weight)
        scaled = loss * loss_scale            # where the scaler scales
    answer = scaler._kmp_apply(tape.gradient(scaled, weights), loss=loss,
                               retries_left=retries_left)
    compute_metrics(...)                      # then restored where not applied
    logs = metrics + scaler_logs(answer.loss) # + the attempt's (kmp.scaling._retry)
    ```

    Keras would count a skipped step's loss and metrics (one poisoned batch
    would make the epoch's loss NaN, and `TerminateOnNaN` or `EarlyStopping`
    react to a step that never happened): kmp restores the metrics to what
    they were before a skipped step and counts its loss out of the epoch's
    mean; in an epoch in which no step was applied yet the logs carry the
    (skipped) step's own loss, as on JAX. Without a loss scaler (or with
    one not `enabled`, or no trainable weight) Keras' own step runs
    (`keras_train_step`).

    Args:
        retries_left: Int tensor, or `None`: the retries kmp's train
            function allows this batch. Given, the logs say whether to redo
            it and whether it was applied (`kmp.scaling._retry`).
    """
    optimizer = model.optimizer
    if (
        not isinstance(optimizer, loss_scale_module.LossScaleOptimizer)
        or not optimizer.enabled
        # Keras' step applies nothing then (it warns that the model has no
        # trainable weights): no step to skip or redo.
        or not model.trainable_weights
    ):
        logs = keras_train_step(data)
        if retries_left is not None and isinstance(logs, dict):
            logs = dict(logs, **_retry.attempt_logs(None, True))
        return logs
    answer, own = _attempt(model, data, optimizer, retries_left)
    logs = dict(model.get_metrics_result())
    if "loss" in logs:
        # No step applied yet this epoch: the loss and metrics of this
        # skipped one, as on JAX (Keras' mean of no step would be 0).
        logs = _model_step.uncounted_epoch_logs(
            logs, _keras_internals.loss_tracker(model).count > 0, own)
    # `retried_steps` where batches can be redone.
    logs.update(_model_step.scaler_logs(
        model, [optimizer], retries_left is not None, loss=answer.loss))
    if retries_left is not None:
        logs.update(_retry.attempt_logs(answer.retry, answer.finite))
    return logs


def _attempt(model, data, optimizer, retries_left=None):
    """Keras' train step on one batch, with kmp's scaled apply; a step that
    is not applied (skipped, or to be redone) leaves the metrics and the
    state its forward pass wrote (a BatchNormalization's moving statistics)
    as they were.

    Returns:
        `(answer, own)`: the scaler's `kmp.scaling._handoff.StepAnswer`
        (`loss`: the unscaled loss), and the metrics' results with this
        attempt counted (before one that is not applied is put back), by
        name.
    """
    metric_variables = list(model.metrics_variables)
    before = [tf.identity(v.value) for v in metric_variables]
    # What the forward pass writes (BatchNormalization's moving statistics):
    # an attempt that does not count leaves it as it was, too.
    layer_state = layer_state_module.ForwardState(model)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True) if _keras_internals.call_takes_training(model) else model(x)
        loss = _keras_internals.compute_loss(model, x, y, y_pred, sample_weight)
        _keras_internals.loss_tracker(model).update_state(
            _keras_internals.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0],
        )
        scaling = optimizer.scaling
        if scaling:
            scale = optimizer._kmp_scale.value if optimizer.built else optimizer.initial_scale
            loss_to_differentiate = ops.multiply(loss, scale)
        else:
            loss_to_differentiate = loss
    trainable_weights = model.trainable_weights
    answer = _scaling_step.apply_told(
        optimizer, tape.gradient(loss_to_differentiate, trainable_weights), trainable_weights,
        divide=scaling, loss=loss, retries_left=retries_left,
    )
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    own = {key: ops.convert_to_tensor(value) for key, value in model.get_metrics_result().items()}
    # Selects, not a cond: on a CPU a cond costs more than a few scalar
    # assigns, and the metric variables are a handful of scalars.
    finite = ops.cast(answer.finite, "bool")
    for variable, value in zip(metric_variables, before):
        variable.assign(ops.where(finite, variable.value, value))
    if tf.executing_eagerly() and not bool(finite):
        # Run eagerly, the compiled metrics are made by the first step's
        # `compute_metrics` (a traced step is traced again once they exist):
        # those made by this attempt go back to their start.
        known = {id(v) for v in metric_variables}
        for metric in model.metrics:
            if metric.variables and not any(id(v) in known for v in metric.variables):
                metric.reset_state()
    layer_state.restore_unless(finite)
    return answer, own
