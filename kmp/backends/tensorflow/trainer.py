"""kmp.Model's train step on TensorFlow, and its train function.

The same names as `kmp/backends/jax/trainer.py` (`train_step`,
`reporting_step`, `train_function`, `test_function`, `check_compile`,
`strategy_scope`, `can_retry`, `build_from_iterator`, `finish_epoch`):

- `train_step` is kmp.Model's own step: Keras' forward and backward pass,
  the scaler's apply called with values and answering with values, a
  skipped step's loss and metrics kept out of the epoch's logs, and, with
  `overflow_retries`, a batch whose gradients overflowed redone at a lower
  scale (`_retry_overflows`; under XLA `_retry_overflows_compiled`, or kmp's
  train function around the compiled step,
  `kmp.backends.tensorflow.distribute.make_function`).
- `reporting_step` wraps a subclass's own `train_step` (set once on the
  instance): the logs carry each loss scaler that applied.
"""

import functools

import keras
import tensorflow as tf
from keras import ops

from kmp import _keras_internals
from kmp.scaling import _handoff
from kmp.scaling import _model_step
from kmp import loss_scale as loss_scale_module
from kmp.backends.tensorflow import distribute as distribute_module
from kmp.backends.tensorflow import layer_state as layer_state_module


# Set once on the instance: each `tf.function` Keras makes traces it afresh
# (see `kmp.Model.make_train_function`).
REWRAP_EACH_TRAIN_FUNCTION = False


def can_retry():
    """Whether a batch can be redone here: a step without `merge_call`."""
    return _keras_internals.supports_no_merge_call()


def check_compile(model, overflow_retries):
    """Refuses a `tf.distribute` strategy kmp does not support."""
    distribute_module.check_strategy(model.distribute_strategy)


def strategy_scope(model):
    return model.distribute_strategy.scope()


def train_function(model, own_step):
    """kmp's train function around Keras' `model.train_function`.

    Multi-worker, one step per call (see `distribute.train_or_test_function`)
    and, under XLA, the retry around the compiled step
    (`distribute.make_function`); the monitor's values leave the logs.
    """
    retries = bool(
        model.jit_compile and own_step
        and _model_step.retries_on(model, model.optimizer, can_retry())
    )
    return _TrainFunction(model, distribute_module.train_or_test_function(
        model, model.train_step, model.train_function, retries=retries
    ))


class _TrainFunction:
    """What `train_function` returns: `function`, with the monitor's values
    taken out of its logs, and the epoch's end (`finish_epoch`)."""

    def __init__(self, model, function):
        self._model, self._function = model, function

    def __call__(self, iterator):
        return self._without_monitor_logs(self._function(iterator))

    def finish_epoch(self, logs):
        """The epoch's last logs once nothing is pending (`distribute.RedoLater`)."""
        finish = getattr(self._function, "finish_epoch", None)
        last = None if finish is None else finish()
        return logs if last is None else self._without_monitor_logs(last)

    def _without_monitor_logs(self, logs):
        if isinstance(logs, dict):
            # object.__setattr__: Keras would track the dict as part of the
            # model (and take ~10 us a step doing so).
            object.__setattr__(
                self._model, "_kmp_monitor_logs", _model_step.pop_monitor_logs(logs)
            )
        return logs


def finish_epoch(model, logs):
    """The logs `fit` reads at an epoch's end: `logs`, or those of the
    overflowing batches kmp's train function redid after them."""
    function = model.train_function
    return function.finish_epoch(logs) if isinstance(function, _TrainFunction) else logs


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
        with _model_step.inside_model_step(model, own) as scalers:
            logs = train_step(model, data)
            applied = _model_step.applied(scalers)
            if applied and isinstance(logs, dict):
                answer = applied[0]._kmp_record.answer if len(applied) == 1 else None
                logs = dict(logs, **_model_step.scaler_logs(
                    model, applied, loss=None if answer is None else answer.loss
                ))
        return logs

    return train_step_with_scaler_logs


def train_step(model, data, keras_train_step, attempt=None):
    """kmp.Model's own train step: Keras' step, with the loss-scaled apply
    and a skipped step kept out of the epoch's logs.

    ```
    x, y, sample_weight = data
    with GradientTape() as tape:              # as Keras' own train_step
        loss = compute_loss(x, y, model(x, training=True), sample_weight)
        scaled = loss * loss_scale
    answer = scaler._kmp_apply(tape.gradient(scaled, weights), loss=loss, request)
    compute_metrics(...)                      # then restored where not answer.finite
    logs = metrics + scaler_logs(answer.loss) # + the retry flag (`attempt`)
    ```

    Keras would count a skipped step's loss and metrics (one poisoned batch
    would make the epoch's loss NaN, and `TerminateOnNaN` or `EarlyStopping`
    react to a step that never happened): kmp restores the metrics to what
    they were before a skipped step and counts its loss out of the epoch's
    mean; in an epoch in which no step was applied yet the logs carry the
    (skipped) step's own loss, as on JAX. Without a loss scaler (or with
    one not `enabled`, or no trainable weight) Keras' own step runs
    (`keras_train_step`).

    With `overflow_retries` a batch whose gradients overflowed is redone at
    a lower scale: in this step (`_retry_overflows`; under XLA
    `_retry_overflows_compiled`), or, where kmp's train function redoes it
    around this step compiled by XLA
    (`kmp.backends.tensorflow.distribute.make_function`), one `attempt` (an
    int tensor) per call, with `retries - attempt` retries left, whose logs
    say whether to redo the batch (`distribute.RETRY_LOG`).
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
        if attempt is not None and isinstance(logs, dict):
            logs = dict(logs, **{distribute_module.RETRY_LOG: ops.convert_to_tensor(False)})
        return logs
    retries = _model_step.retry_budget(model, optimizer, can_retry())
    retry = None
    if retries is not None and attempt is not None:
        answer, own = _attempt(model, data, optimizer, retries_left=retries - attempt)
        loss, retry = answer.loss, answer.retry
    elif retries is not None:
        loss, own = _retry_overflows(model, data, optimizer, retries)
    else:
        answer, own = _attempt(model, data, optimizer)
        loss = answer.loss
    logs = dict(model.get_metrics_result())
    if "loss" in logs:
        # No step applied yet this epoch: the loss and metrics of this
        # skipped one, as on JAX (Keras' mean of no step would be 0).
        logs = _model_step.uncounted_epoch_logs(
            logs, _keras_internals.loss_tracker(model).count > 0, own)
    if attempt is not None:
        logs[distribute_module.RETRY_LOG] = (
            ops.convert_to_tensor(False) if retry is None else ops.cast(retry, "bool")
        )
    # `retried_steps` where batches can be redone (`retry_budget` not `None`).
    logs.update(_model_step.scaler_logs(model, [optimizer], retries is not None, loss=loss))
    return logs


def _attempt(model, data, optimizer, retries_left=None, defer=False):
    """Keras' train step on one batch, with kmp's scaled apply; a skipped
    step leaves the metrics and the state its forward pass wrote (a
    BatchNormalization's moving statistics) as they were.

    Returns:
        `(answer, own)`: the scaler's `kmp.scaling._handoff.StepAnswer`
        (`loss`: the unscaled loss), and the metrics' results with this
        attempt counted (before a skipped one is put back), by name.
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
        scaled = ops.multiply(loss, optimizer.loss_scale) if optimizer.scaling else loss
    trainable_weights = model.trainable_weights
    answer = optimizer._kmp_apply(
        tape.gradient(scaled, trainable_weights), trainable_weights, divide=optimizer.scaling,
        loss=loss,
        request=_handoff.StepRequest(retries_left=retries_left, defer=defer),
    )
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    own = {key: ops.convert_to_tensor(value) for key, value in model.get_metrics_result().items()}
    # Selects, not a cond: on a CPU a cond costs more than a few scalar
    # assigns, and the metric variables are a handful of scalars.
    finite = ops.cast(answer.finite, "bool")
    for variable, value in zip(metric_variables, before):
        variable.assign(ops.where(finite, variable.value, value))
    layer_state.restore_unless(finite)
    return answer, own


def _retry_overflows(model, data, optimizer, retries):
    """Redoes a batch whose gradients overflowed, at a lower scale.

    ```
    attempt = 0
    do:
        answer = one attempt, `retries - attempt` retries left
        attempt += 1
    while answer.retry   # the gradients overflowed, the loss did not, and
                         # retries were left: the scale was backed off
    ```

    The first attempt is straight-line code; a `tf.while_loop` redoes the
    batch only when it overflowed (a `tf.cond`). Under a
    strategy every replica takes the same decision (on all-reduced
    gradients), so all retry together. Under XLA the loop takes another
    shape (`_retry_overflows_compiled`).

    Returns:
        `(loss, own)`: the unscaled loss of the last attempt and its
        metrics' results (`_attempt`'s `own`).
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
        return _retry_overflows_compiled(model, data, optimizer, retries)

    def attempt(count, retry, loss, own):
        answer, own = _attempt(model, data, optimizer, retries_left=retries - count)
        return count + 1, answer.retry, ops.cast(answer.loss, "float32"), own

    # The first attempt runs as straight-line code: a step inside a
    # `tf.while_loop` runs measurably slower (about 15% on a model of many
    # small variables), so only a batch to redo enters the loop.
    count, retry, loss, own = attempt(ops.convert_to_tensor(0), None, None, None)

    # A function TensorFlow does not inline: the branch not taken is then one
    # call op instead of the whole step again (whose skipped ops cost about
    # 10% of a step on a model of many small variables).
    @tf.function(autograph=False,
                 experimental_attributes=_keras_internals.noinline_function_attributes())
    def redo(count, retry, loss, own):
        return tf.while_loop(lambda count, retry, *_: retry, attempt,
                             (count, retry, loss, own))[2:]

    return tf.cond(retry, lambda: redo(count, retry, loss, own), lambda: (loss, own))


def _retry_overflows_compiled(model, data, optimizer, retries):
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
    writes a variable but the apply, whose skip is a select
    (`kmp.backends.tensorflow.step.DeferredApply`). Without XLA, where a
    branch not taken costs its ops and no copies, `_retry_overflows` keeps
    the loop that redoes whole steps.
    """
    def attempt(count):
        answer, own = _attempt(model, data, optimizer, retries_left=retries - count, defer=True)
        return (count + 1, answer.retry, ops.cast(answer.loss, "float32"), answer.finite,
                answer.deferred, own)

    count, retry, loss, finite, deferred, own = attempt(ops.convert_to_tensor(0))
    # A sparse gradient (an embedding's `IndexedSlices`) enters the loop as
    # its values and indices: its dense shape stays the first attempt's
    # constant, which XLA needs to compile the sparse update.
    dense_shapes = [getattr(g, "dense_shape", None) for g in deferred.grads]

    def parts(grads):
        return [(g.values, g.indices) if isinstance(g, tf.IndexedSlices) else g for g in grads]

    def redo(count, retry, loss, finite, grads, scale, own):
        count, retry, loss, finite, again, own = attempt(count)
        return count, retry, loss, finite, parts(again.grads), again.scale, own

    _, _, loss, finite, grads, scale, own = tf.while_loop(
        lambda count, retry, *_: retry,
        redo,
        (count, retry, loss, finite, parts(deferred.grads), deferred.scale, own),
    )
    grads = [g if shape is None else tf.IndexedSlices(g[0], g[1], shape)
             for g, shape in zip(grads, dense_shapes)]
    deferred.apply_if(finite, grads, scale)
    return loss, own
