"""kmp.Model's train step on JAX, and its train function.

JAX traces a train step once and runs it as a pure function of its state:
Keras' JAX trainer passes every variable's value in and takes the new values
out (`stateless_apply`), and a branch (`jax.lax.cond`) must return what it
changes instead of assigning it. So the loss-scaled step is
`kmp.scaling._step.stateless_step`, a function of values:

```
finite = all(isfinite(grads))                  # one program over all devices
new_trainable, new_inner = cond(finite,
    inner_optimizer.stateless_apply(unscale(grads)),  # clips, updates
    (trainable, inner))                               # exactly as they were
own = state_after(scale, counters, finite)            # the same pure rule
```

Under `keras.distribution.DataParallel` the jitted step is one program over
all devices, whose gradients are already the global ones: one decision, one
skip counted, weights identical on every device, with no collective of kmp's.

Here, with the same names as `kmp/backends/tensorflow/trainer.py`:
`train_step` is kmp.Model's step on JAX (Keras' own, plus the unscaled loss
for the check and a skipped step kept out of the metrics); `reporting_step`
wraps any `train_step(state, data)` so that its logs carry `loss_scale` and
`skipped_steps`.
"""

import contextlib
import functools
import sys

import jax
import keras
from keras import ops

from kmp import _keras_internals
from kmp.scaling import _model_step
from kmp.scaling import _optimizers
from kmp.scaling import _retry
from kmp.scaling import _step as _scaling_step
from kmp import loss_scale as loss_scale_module
from kmp.backends.jax import unsupported

# `jax.jit` keeps its traces by the Python function: a new reporting wrapper
# for each train function (see `kmp.Model.make_train_function`).
REWRAP_EACH_TRAIN_FUNCTION = True


def check_compile(model, overflow_retries):
    """Refuses a `tf.distribute` strategy, which is TensorFlow's."""
    if _tf_strategy_in_use():
        raise unsupported(
            "A tf.distribute strategy",
            "On JAX, set keras.distribution.DataParallel (or another keras.distribution) "
            "before building the model instead.",
        )


def strategy_scope(model):
    return contextlib.nullcontext()


def train_function(model, own_step):
    """Keras' train function, whose logs lose the monitor's values; where
    kmp.Model's own step can redo a batch (`_model_step.retries`), kmp's
    own (`_RetryingFunction`)."""
    retries = _model_step.retries(model, own_step)
    if retries is not None:
        return _RetryingFunction(model, retries)
    return _without_monitor_logs(model, model.train_function)


def test_function(model):
    return model.test_function


def build_from_iterator(model, iterator, strategy):
    """Keras builds the model (no multi-worker strategy on JAX)."""
    return False


class _RetryingFunction:
    """fit's train function where kmp.Model's own step can redo a batch:
    TensorFlow's `distribute.RetryingFunction` in JAX's terms.

    ```
    def train_function(state, iterator):
        for each of steps_per_execution batches:   # as Keras' own JAX loop
            batch = next(iterator)
            logs = retries.run(                    # kmp.scaling._retry
                lambda left: step(state, batch, left), ...)   # state carried
        return logs, state
    ```

    The step is `model.train_step` jitted as Keras jits it (its state
    donated, the distribution's shardings kept), taking the batch's
    `retries_left` as an argument: one trace for every budget.
    """

    def __init__(self, model, retries):
        self._model, self._retries = model, retries
        step = model.train_step
        if not model.run_eagerly and model.jit_compile:
            out_shardings = None
            if keras.distribution.distribution() is not None:
                out_shardings = (None, _state_shardings(model))
            step = jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
        self._step = step

    def __call__(self, state, iterator):
        logs = None
        for _ in range(self._model.steps_per_execution):
            try:
                data = next(iterator)
            except StopIteration:
                if logs is None:
                    raise
                break
            carried = [state]

            def attempt(retries_left, data=data, carried=carried):
                logs, carried[0] = self._step(carried[0], data, retries_left)
                return logs

            logs = self._retries.run(attempt, attempt)
            state = carried[0]
        if isinstance(logs, dict):
            object.__setattr__(self._model, "_kmp_monitor_logs", _model_step.pop_monitor_logs(logs))
        return logs, state


def _state_shardings(model):
    """The shardings of Keras' JAX state, as Keras' own train function keeps them."""
    optimizer = getattr(model, "optimizer", None)
    return tuple(
        [v.value.sharding for v in variables]
        for variables in (model.trainable_variables, model.non_trainable_variables,
                          optimizer.variables if optimizer is not None else [],
                          model.metrics_variables)
    )


def _scaler_logs(model, optimizer_values, retrying=False):
    """`_model_step.scaler_logs`, the logs TensorFlow's step adds, read
    from a step's new optimizer values."""
    optimizer = model.optimizer
    if not isinstance(optimizer, loss_scale_module.LossScaleOptimizer) or not optimizer.enabled:
        return {}
    if not optimizer.built or len(optimizer_values) != len(optimizer.variables):
        return {}
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_values))):
        return _model_step.scaler_logs(model, [optimizer], retrying)


def train_step(model, state, data, keras_train_step, retries_left=None):
    """kmp.Model's train step on JAX: Keras' own, with the loss-scaled step.

    As Keras' `JAXTrainer.train_step`, except that the scaler also gets the
    unscaled loss (a skip whose loss is not finite is a forward overflow),
    and a skipped step leaves the metrics as they were (one poisoned batch
    does not make the epoch's loss NaN), and the state the forward pass
    wrote (a BatchNormalization's moving statistics). Given `retries_left`
    (by kmp's train function), the logs say whether to redo the batch and
    whether it was applied (`kmp.scaling._retry`).
    """
    trainable, non_trainable, optimizer_values, metrics_values = state
    optimizer = model.optimizer
    if not (isinstance(optimizer, loss_scale_module.LossScaleOptimizer) and optimizer.enabled):
        logs, state = keras_train_step(state, data)
        if retries_left is not None and isinstance(logs, dict):
            logs = dict(logs, **_retry.attempt_logs(None, True))
        return logs, state

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
    (_, aux), grads = grad_fn(
        trainable, non_trainable, metrics_values, x, y, sample_weight,
        training=True, optimizer_variables=optimizer_values,
    )
    unscaled_loss, y_pred, new_non_trainable, new_metrics = aux
    # Keras' `compute_loss_and_updates` scaled the loss (`scale_loss`, which
    # notes it for code kmp does not own); this step knows it, by value.
    optimizer._kmp_record.clear()
    trainable, optimizer_values, finite, retry = _scaling_step.stateless_step(
        optimizer, optimizer_values, grads, trainable, loss=unscaled_loss,
        divide=optimizer.scaling, retries_left=retries_left,
    )
    logs, new_metrics = _keras_internals.update_metrics_variables(
        model, new_metrics, unscaled_loss, x, y, y_pred, sample_weight
    )
    kept = [ops.where(finite, new, old) for new, old in zip(new_metrics, metrics_values)]
    # What the forward pass wrote (a BatchNormalization's moving statistics,
    # a seed generator's state) is kept only by a step that counts; a
    # variable it did not write is the same value on both sides, which XLA
    # folds away.
    non_trainable = [
        new if new is old else ops.where(finite, new, old)
        for new, old in zip(new_non_trainable, non_trainable)
    ]
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, kept))):
        kept_logs = model.get_metrics_result()
        steps_counted = _keras_internals.loss_tracker(model).count.value
    own = logs  # this step counted, before a skipped one is put back
    logs = {
        key: ops.where(finite, value, kept_logs[key]) if key in kept_logs else value
        for key, value in logs.items()
    }
    if "loss" in logs:
        # No step applied yet this epoch: the loss and metrics of the skipped one.
        logs = _model_step.uncounted_epoch_logs(logs, steps_counted > 0, own)
    if retries_left is not None:
        logs.update(_retry.attempt_logs(retry, finite))
    if optimizer._monitored:
        logs.update(_monitor_logs(optimizer, optimizer_values, unscaled_loss))
    return logs, (trainable, non_trainable, optimizer_values, kept)


def _monitor_logs(optimizer, optimizer_values, loss):
    """kmp.callbacks.LossScaleMonitor's values of this step, read from its new
    optimizer values, as kmp.Model's TensorFlow step returns them.

    Outputs of the step: JAX never donates them to the next one, so the
    monitor may keep them until it processes the step (a variable's value
    read during fit is an input of the next step, whose buffer JAX reuses).
    """
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_values))):
        return _model_step.monitor_logs(optimizer, loss)


def reporting_step(model, step, own):
    """Wraps `step(model, state, data)` so that its logs carry the scaler's state.

    As `reporting_step` on TensorFlow: the scalers learn
    they run inside kmp.Model's step (a gradient of a loss that skipped
    `scale_loss` is applied undivided, with a warning); the logs gain
    `loss_scale` and `skipped_steps`, read from the step's new state.

    The step runs with each scaler's own state (its scale and counters)
    mapped to this step's values of it (`keras.StatelessScope`), as Keras'
    JAX trainer maps the optimizer's variables around its `scale_loss`
    call: `self.optimizer.scale_loss(loss)` in a custom step reads the scale
    the step was given, not the one JAX saw when it traced the step (which
    it would then keep, compiled in, for every step after).
    """
    @functools.wraps(step)
    def train_step_with_scaler_logs(state, data, retries_left=None):
        # `retries_left`: kmp's train function passes it to its own step.
        kwargs = {} if retries_left is None else {"retries_left": retries_left}
        # Each scaler forgets what it recorded when the step ends: nothing
        # traced may outlive the trace.
        given = state
        with _model_step.inside_model_step(model, own) as scalers:
            mapping = _scaler_state_mapping(model, scalers, state)
            if not mapping:  # no scaler (float32 without the guard): as Keras runs it
                logs, state = step(model, state, data, **kwargs)
            else:
                with _ScalerState(mapping + _regularized(model, mapping)) as scope:
                    logs, state = step(model, state, data, **kwargs)
                scope.assign_updates()
            finite = None if own else _model_step.all_applied(_model_step.applied(scalers))
        if finite is not None and len(state) == len(given) == 4:
            state = (state[0], _forward_state_unless(model, finite, state[1], given[1]), *state[2:])
        if isinstance(logs, dict) and len(state) == 4:
            logs = dict(logs, **_scaler_logs(model, state[2], retries_left is not None))
        return logs, state

    return train_step_with_scaler_logs


def _scaler_state_mapping(model, scalers, state):
    """`(variable, value)` for each scaler's own state variable in `state`.

    Keras' JAX state carries `model.optimizer.variables` as its third item
    (in that order) and the model's non-trainable variables as its second;
    a scaler's own variables (not its inner optimizer's) found in either are
    mapped to their values there.
    """
    wanted = set()
    for optimizer in scalers:
        if optimizer.built:
            inner = {id(v) for v in optimizer.inner_optimizer.variables}
            wanted.update(id(v) for v in optimizer.variables if id(v) not in inner)
    if not wanted or not isinstance(state, (tuple, list)) or len(state) != 4:
        return []
    carried = [(model.non_trainable_variables, state[1])]
    if getattr(model, "optimizer", None) is not None:
        carried.append((model.optimizer.variables, state[2]))
    mapping = []
    for variables, values in carried:
        if len(variables) == len(values):
            mapping += [(v, value) for v, value in zip(variables, values) if id(v) in wanted]
    return mapping


def _forward_state_unless(model, finite, new, old):
    """A custom step's new non-trainable values, where `finite` is false
    those it was given: what its forward pass wrote (a BatchNormalization's
    moving statistics) as kmp.Model's own step keeps it. The metrics' and
    the optimizers' variables (a scaler's counters) keep the step's values."""
    kept = {id(v) for v in model.metrics_variables}
    for optimizer in _optimizers.optimizers_by_attribute(model).values():
        kept.update(id(v) for v in optimizer.variables)
    variables = model.non_trainable_variables
    if len(variables) != len(new):
        return new
    return [after if after is before or id(v) in kept else ops.where(finite, after, before)
            for v, after, before in zip(variables, new, old)]


def _regularized(model, mapping):
    """`(variable, value)` for the model's regularized trainable variables
    that `mapping` leaves out, each to its value now: inside a stateless
    scope Keras reads a regularizer's variable from the scope (`None` where
    unmapped, which failed in the regularizer), and outside one the
    variable itself, as a custom step that calls `compute_loss` does."""
    mapped = {id(v) for v, _ in mapping}
    return [(v, v.value) for v in model.trainable_variables
            if getattr(v, "regularizer", None) is not None and id(v) not in mapped]


class _ScalerState(keras.StatelessScope):
    """A `keras.StatelessScope` that maps the scalers' state for a user's
    step and otherwise leaves the step as it would run without it.

    It collects the losses layers add (so `model.losses` in the step reads
    them, as outside a scope), and `assign_updates` assigns, once the scope
    is closed, what the step assigned to variables inside it (a scope holds
    such assignments instead of making them).
    """

    def __init__(self, state_mapping):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self._assigned = {}

    def add_update(self, update):
        super().add_update(update)
        variable, value = update
        self._assigned[id(variable)] = (variable, value)

    def assign_updates(self):
        for variable, value in self._assigned.values():
            variable.assign(value)
        self._assigned = {}


def _without_monitor_logs(model, keras_train_function):
    """Keras' `train_function(state, iterator)`, whose logs lose the monitor's
    values (kept on the model, as kmp.Model's TensorFlow train function does)."""
    def train_function(state, iterator):
        logs, state = keras_train_function(state, iterator)
        if isinstance(logs, dict):
            object.__setattr__(model, "_kmp_monitor_logs", _model_step.pop_monitor_logs(logs))
        return logs, state

    return train_function


def _tf_strategy_in_use():
    """Whether a `tf.distribute` strategy's scope is open (no use on JAX).

    Without TensorFlow imported, none can be: it is not imported here."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and tf.distribute.has_strategy()
