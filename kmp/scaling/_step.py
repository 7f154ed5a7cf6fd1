"""The parts of one loss-scaled step that both backends share.

Each backend's step (`kmp/backends/<backend>/step.py`) is built from these,
so the math is written once:

- `check`: the finiteness decision from one replica's gradients and loss
  (after unscaling where `min_scale < 1`), with the variables that
  overflowed while a monitor watches;
- `unscale`: the one place kmp divides gradients by the scale;
- `state_after`: the scaler's own variables after a step, by the rule of
  `kmp.scaling._rule` (the TensorFlow step assigns them, `assign_state`);
- `stateless_step`: the whole step as a pure function of values, as Keras'
  JAX trainer calls it (`stateless_apply`):

```
grads, finite = check(grads, loss)
new_weights, new_inner = cond(finite,
    inner_optimizer.stateless_apply(unscale(grads)),   # clips, updates
    (weights, inner))                                  # exactly as they were
own = state_after(scale, counters, finite)             # the same pure rule
```
"""

import collections

import keras
from keras import ops

from kmp.precision import _compensated
from kmp.scaling import _gate
from kmp.scaling import _gradients
from kmp.scaling import _handoff
from kmp import _keras_internals
from kmp.scaling import _rule as _scaling_rule
from kmp.scaling import _spikes
from kmp import backends


def counters_of(value):
    """The `counters` variable's `value` as a dict of scalars by name
    (`kmp.scaling._rule.COUNTERS`), as `LossScaleOptimizer.counters` reads
    it (here without a call into the optimizer's module, once a step)."""
    return dict(zip(_scaling_rule.COUNTERS, ops.unstack(value)))


def accumulation_steps(optimizer):
    """The inner optimizer's `gradient_accumulation_steps`, or `None`."""
    return getattr(optimizer.inner_optimizer, "gradient_accumulation_steps", None) or None


def add_state_variable(optimizer, name, shape, dtype, initial):
    # aggregation="none", as Keras' own scaler: every replica computes the
    # same value and writes its own copy, with no merge_call (see
    # kmp/backends/tensorflow/step.py). Only float32 and int64:
    # TensorFlow keeps int32 resource variables in host memory on a GPU,
    # where XLA cannot read them.
    return optimizer.add_variable(
        shape=shape,
        dtype=dtype,
        initializer=keras.initializers.Constant(initial),
        aggregation="none",
        name=name,
    )


def build_state(optimizer, var_list):
    """Creates the scaler's own variables (`LossScaleOptimizer.build`): its
    scale, its counters, the monitor's flags, and, where used, the
    accumulation window's and the spike rule's state."""
    counter_dtype = _scaling_rule.COUNTER_DTYPE
    counters = _scaling_rule.COUNTERS
    optimizer._kmp_scale = add_state_variable(optimizer, "loss_scale", (), "float32",
                                              optimizer.initial_scale)
    # All the step's counters in one vector (see `COUNTERS`): one read and
    # one write per step, counted on the device.
    initial_counters = [0] * len(counters)
    initial_counters[counters.index("hysteresis_left")] = optimizer.hysteresis
    optimizer._counters = add_state_variable(optimizer, "counters", (len(counters),),
                                             counter_dtype, initial_counters)
    # 1 for each variable whose gradient overflowed at the latest backward
    # overflow; written only while a monitor asks for it.
    optimizer._nonfinite_gradients = add_state_variable(
        optimizer, "nonfinite_gradients", (len(var_list),), counter_dtype, 0)
    # A 16-bit variable's update is computed in float32 and written with
    # Kahan compensation (`kmp.precision._compensated`): its buffer (`None`:
    # rounded stochastically instead).
    optimizer._kmp_compensated = [
        (variable, add_state_variable(optimizer, variable.path.replace("/", "_") + "_compensation",
                                      variable.shape, variable.dtype, 0.0)
         if _compensated.buffered(variable, optimizer.compensation) else None)
        for variable in var_list if _compensated.low_precision(variable)
    ]
    backends.get("step").check_buildable(optimizer)
    if accumulation_steps(optimizer):
        optimizer._accumulation_window = add_state_variable(
            optimizer, "accumulation_window", (2,), counter_dtype, 0)
    if optimizer.skip_spikes is not None:
        # The spike rule's recent losses, and [losses seen, spikes].
        optimizer._spike_window = add_state_variable(
            optimizer, "spike_window", (optimizer.spike_window,), "float32", 0.0)
        optimizer._spike_counts = add_state_variable(
            optimizer, "spike_counts", (2,), counter_dtype, 0)


def apply_told(optimizer, grads, trainable_variables, *, divide, loss, retries_left=None):
    """`LossScaleOptimizer._kmp_apply`: one step, told what it is given.

    Args:
        optimizer: The `kmp.LossScaleOptimizer`.
        grads: List of gradients (`None` entries are left out).
        trainable_variables: List of variables, or `None` for the ones the
            optimizer was built with.
        divide: Bool. Whether `grads` carry the loss scale (false where
            the scaler does not scale: `LossScaleOptimizer.scaling`).
        loss: The unscaled loss, or `None` where unknown.
        retries_left: Int tensor, or `None`: the retries the caller allows
            this batch (`kmp.scaling._retry`).

    Returns:
        The `kmp.scaling._handoff.StepAnswer`.
    """
    trainable_variables = list(
        _keras_internals.built_variables(optimizer) if trainable_variables is None
        else trainable_variables
    )
    if not optimizer.built:
        # Built outside any tf.function: built inside one, in a replica of
        # MirroredStrategy, the variables' initializers are left as
        # placeholders in a cond, as Keras' own Adam's are.
        with backends.get("step").outside_functions(), keras.name_scope(
                optimizer.name, caller=optimizer):
            optimizer.build(trainable_variables)
        optimizer.built = True
    grads, trainable_variables = _keras_internals.filter_empty_gradients(
        optimizer, list(grads), trainable_variables
    )
    if not optimizer.enabled:
        optimizer.inner_optimizer.apply(grads, trainable_variables)
        return _handoff.StepAnswer(ops.convert_to_tensor(True))
    steps = accumulation_steps(optimizer)
    if retries_left is not None and steps:
        raise ValueError(
            "`overflow_retries` cannot be combined with the inner optimizer's "
            "`gradient_accumulation_steps` (a retry would redo one micro-batch "
            f"of a window). Received: gradient_accumulation_steps={steps}"
        )
    return backends.get("step").apply(
        optimizer, grads, trainable_variables, divide=divide, loss=loss,
        retries_left=retries_left, window=steps,
    )


def unscale(optimizer, grads, variables=None, scale=None):
    """`grads` divided by the loss scale (`scale`, or the current one): the
    one place kmp unscales.

    Variables Keras overwrites with their "gradient" (a BatchNormalization
    moving statistic under some layers) take it as it is, as in Keras' scaler;
    they are judged by the variable, not its value (keras-team/keras#21706).
    """
    keep = None if variables is None else _keras_internals.overwritten_with_gradient(
        optimizer, variables)
    if keep is not None and len(keep) != len(grads):
        keep = None
    if scale is None:
        scale = optimizer.loss_scale  # one read of the scale, not one per gradient
    return _gradients.divide(grads, scale, keep)


def check(optimizer, grads, variables, loss, *, divide, scale=None):
    """The finiteness decision of one replica's step.

    With `min_scale < 1` the gradients are unscaled before the check
    (dividing by less than 1 can overflow); otherwise later, in the branch
    that applies, as in Keras' scaler.

    Args:
        optimizer: The `kmp.LossScaleOptimizer`.
        grads, variables: This replica's gradients and their variables.
        loss: The unscaled loss, or `None` when unknown.
        divide: Bool. Whether `grads` are scaled and must be divided.
        scale: The scale they carry, or `None` for the current one.

    Returns:
        `(grads, divide, finite, loss_finite, nonfinite)`: the gradients
        (unscaled already when `divide` came back `False` from `True`), the
        boolean scalars (`finite`: the gradients and the loss), and the int
        flags of the variables whose gradient overflowed (`None` unless a
        monitor watches).
    """
    grads = list(grads)
    if divide and optimizer.min_scale < 1.0:
        grads, divide = unscale(optimizer, grads, variables, scale), False
    flags = _gradients.finite_flags(grads)
    finite = _gradients.all_true(flags)
    loss_finite = ops.convert_to_tensor(True)
    if loss is not None:
        # A step whose loss is not finite is skipped too, whatever its
        # gradients (a NaN loss term no weight depends on would still
        # poison the epoch's logs).
        loss_finite = ops.all(ops.isfinite(loss))
        finite = ops.logical_and(finite, loss_finite)
    nonfinite = None
    if optimizer._monitored:
        indices = [_keras_internals.variable_index(optimizer, v) for v in variables]
        nonfinite = _gradients.nonfinite_indicator(
            flags, indices, len(_keras_internals.built_variables(optimizer))
        )
    return grads, divide, finite, loss_finite, nonfinite


def decide(optimizer, finite, loss_finite, nonfinite, loss=None, *, retries_left=None,
           scale=None, spike_state=None):
    """The step's `kmp.scaling._rule.Decision` from its agreed flags.

    Args:
        optimizer: The `kmp.LossScaleOptimizer`.
        finite, loss_finite, nonfinite: `check`'s, agreed over replicas.
        loss: Every replica's unscaled loss summed (the batch's loss), or
            `None` where unknown: then no step is a spike.
        retries_left: Int tensor, or `None`: the retries this batch has
            left (the decision says `retry` only then, on a dynamic scale).
        scale: The scale before the step, or `None` to read it.
        spike_state: `(window, counts)` values of the spike rule's
            variables, or `None` to read them.
    """
    spike = None
    if optimizer.skip_spikes is not None and loss is not None:
        window, counts = spike_state or (optimizer._spike_window.value,
                                         optimizer._spike_counts.value)
        spike = _spikes.is_spike(window, counts[0], loss, optimizer.skip_spikes,
                                 optimizer.spike_warmup)
    else:
        loss = None
    retry = None
    if retries_left is not None and optimizer.dynamic:
        scale = optimizer._kmp_scale.value if scale is None else scale
        retry = ops.logical_and(
            ops.logical_and(ops.logical_not(finite), loss_finite),
            ops.logical_and(retries_left > 0, scale > optimizer.min_scale),
        )
    applied = finite if spike is None else ops.logical_and(finite, ops.logical_not(spike))
    return _scaling_rule.Decision(finite, loss_finite, nonfinite, retry, spike, loss, applied)


def state_after(optimizer, scale, counters, decision, flags_before=None, spike_state=None):
    """The scaler's own variables after one (applied or skipped) step.

    Args:
        optimizer: The `kmp.LossScaleOptimizer`.
        scale, counters: Its scale and `counters` dict before the step.
        decision: The step's `kmp.scaling._rule.Decision`.
        flags_before: The `nonfinite_gradients` value before the step, or
            `None` to read it (only needed while a monitor watches).
        spike_state: `(window, counts)` values of the spike rule's
            variables before the step, or `None` to read them.

    Returns:
        Dict `{id(variable): new value}`.
    """
    rule = {name: getattr(optimizer, name) for name in _scaling_rule.RULE_SETTINGS}
    new_scale, new_counters = _scaling_rule.next_state(scale, counters, decision, rule)
    own = {
        id(optimizer._kmp_scale): new_scale,
        id(optimizer._counters): ops.stack([new_counters[n] for n in _scaling_rule.COUNTERS]),
    }
    if decision.nonfinite_gradients is not None:
        # Kept from the latest backward overflow, so that with
        # steps_per_execution > 1 the monitor still sees where it was.
        if flags_before is None:
            flags_before = optimizer._nonfinite_gradients.value
        backward = ops.logical_and(ops.logical_not(decision.finite), decision.loss_finite)
        own[id(optimizer._nonfinite_gradients)] = ops.where(
            backward, decision.nonfinite_gradients, flags_before
        )
    if decision.spike is not None:
        window, counts = spike_state or (optimizer._spike_window.value,
                                         optimizer._spike_counts.value)
        window, seen = _spikes.record(window, counts[0], decision.loss)
        spiked = ops.logical_and(decision.finite, decision.spike)
        own[id(optimizer._spike_window)] = window
        own[id(optimizer._spike_counts)] = ops.stack(
            [seen, counts[1] + ops.cast(spiked, counts.dtype)])
    return own


def assign_state(optimizer, decision):
    """Assigns `state_after` the current state to the scaler's variables,
    and what its followers write for the new scale (`follow_scale`)."""
    scale = optimizer._kmp_scale.value
    if optimizer._kmp_scale_followers:
        # Read now: on TensorFlow a variable's value is read where it is
        # used, which would be after the assignments below.
        scale = backends.get("step").snapshot(scale)
    own = state_after(optimizer, scale, counters_of(optimizer._counters.value), decision)
    for variable in optimizer.variables:
        if id(variable) in own:
            variable.assign(own[id(variable)])
    for variable, value in follow_scale(optimizer, lambda v: v.value, scale,
                                        own[id(optimizer._kmp_scale)]):
        variable.assign(value)


def follow_scale(optimizer, values_of, old_scale, new_scale):
    """What the scaler's followers (`LossScaleOptimizer._kmp_scale_followers`)
    write when the scale moves from `old_scale` to `new_scale`.

    A follower is registered by the code that owns the variables whose
    values carry the loss scale (kmp's float8 support:
    `kmp.precision._float8_training.follow_loss_scale`): a `ScaleFollower`
    of `(history, scale)` variable pairs and the pure function that moves
    their values, called once per attempt, after the scale's update, with
    no branch.

    Args:
        optimizer: The `kmp.LossScaleOptimizer`.
        values_of: Callable of a variable: its value after the apply.
        old_scale, new_scale: Scalar tensors: the scale before and after.

    Returns:
        A list of `(variable, new value)`.
    """
    updates = []
    for follower in optimizer._kmp_scale_followers:
        values = [(values_of(h), values_of(s)) for h, s in follower.pairs]
        moved = follower.rescale(values, new_scale, old_scale)
        for (h, s), (history, scale) in zip(follower.pairs, moved):
            updates += [(h, history), (s, scale)]
    return updates


ScaleFollower = collections.namedtuple("ScaleFollower", ["pairs", "rescale"])


def monitor_state(optimizer):
    """`(counters, nonfinite_gradients)` for `kmp.callbacks.LossScaleMonitor`:
    `[step, skipped_steps, forward_overflows, consecutive_skips,
    consecutive_forward_overflows, loss_spikes]` (`step` counts applied and
    skipped steps), and the per-variable flags of the latest backward
    overflow."""
    counters = optimizer._counters.value
    names = _scaling_rule.COUNTERS
    skipped, retries = names.index("skipped_steps"), names.index("retries")
    dtype = _scaling_rule.COUNTER_DTYPE
    step = ops.cast(optimizer.iterations, dtype) + counters[skipped]
    spikes = (optimizer._spike_counts.value[1:] if optimizer.skip_spikes is not None
              else ops.zeros((1,), dtype))
    monitored = ops.concatenate(
        [ops.reshape(step, (1,)), counters[skipped:retries], ops.cast(spikes, dtype)])
    return monitored, backends.get("step").snapshot(optimizer._nonfinite_gradients.value)


def stateless_step(optimizer, optimizer_variables, grads, trainable_variables, *, loss=None,
                   divide=True, retries_left=None):
    """One loss-scaled step as a pure function of values.

    Args:
        optimizer: The built `kmp.LossScaleOptimizer`.
        optimizer_variables: Values of `optimizer.variables`, in order.
        grads: Gradients of the scaled loss (or unscaled, `divide=False`).
        trainable_variables: Values of the variables the optimizer was built
            with, in order.
        loss: Optional unscaled loss: a skip whose loss is not finite is a
            forward overflow (for the monitor).
        divide: Bool. Whether `grads` are scaled and must be divided.
        retries_left: Int, or `None`: the retries the caller allows this
            batch (`kmp.scaling._retry`).

    Returns:
        `(new_trainable_values, new_optimizer_values, applied, retry)`
        (`retry` `None` where `retries_left` is).
    """
    inner = optimizer.inner_optimizer
    variables = list(optimizer.variables)
    if len(optimizer_variables) != len(variables):
        raise ValueError(
            "`optimizer_variables` must hold one value per variable of "
            f"`optimizer.variables` ({len(variables)}). Received: "
            f"{len(optimizer_variables)} values"
        )
    built = _keras_internals.built_variables(optimizer)
    mapping = list(zip(variables, optimizer_variables))
    with keras.StatelessScope(state_mapping=mapping):
        scale = optimizer._kmp_scale.value
        counters = counters_of(optimizer._counters.value)
        flags_before = optimizer._nonfinite_gradients.value
        spike_state = (None if optimizer.skip_spikes is None else
                       (optimizer._spike_window.value, optimizer._spike_counts.value))
    grads, divide, finite, loss_finite, nonfinite = check(
        optimizer, grads, built, loss, divide=divide, scale=scale
    )
    decision = decide(optimizer, finite, loss_finite, nonfinite, loss, retries_left=retries_left,
                      scale=scale, spike_state=spike_state)
    applied = decision.applied
    # `optimizer.variables` is Keras' scaler's list: its own, then its inner
    # optimizer's. Split by position, which holds even where one variable
    # is in both lists (matching by id gave the inner optimizer one value
    # too many then).
    own_count = len(variables) - len(inner.variables)
    inner_values = list(optimizer_variables[own_count:])

    unscaled = unscale(optimizer, grads, built, scale) if divide else grads
    buffers = {id(buffer) for _, buffer in optimizer._kmp_compensated if buffer is not None}
    extra = [(variable, value) for variable, value in mapping if id(variable) in buffers]
    new_extra = {}
    if backends.get("step").traced(applied) or optimizer._kmp_compensated:
        # The skip inside each write (`kmp.scaling._gate`): no conditional,
        # and no copy of a slot beside its update. (With 16-bit variables
        # eagerly too: only here is their update computed in float32 and
        # written compensated, and their buffers are the scaler's.)
        new_trainable, new_inner, new_extra = _gate.gated_stateless_apply(
            inner, applied, inner_values, unscaled, list(trainable_variables), extra=extra,
            inside=lambda: _compensated.around_inner_apply(optimizer))
    elif bool(applied):
        # Run eagerly (JAX without jit): decided on the host, so the update
        # runs op by op as Keras' own eager step runs it.
        new_trainable, new_inner = inner.stateless_apply(
            inner_values, unscaled, list(trainable_variables))
    else:
        new_trainable, new_inner = list(trainable_variables), inner_values
    own = state_after(optimizer, scale, counters, decision, flags_before, spike_state)
    own.update(new_extra)
    new_trainable = list(new_trainable)
    position = {id(v): i for i, v in enumerate(built)}
    for variable, value in follow_scale(optimizer, lambda v: new_trainable[position[id(v)]],
                                        scale, own[id(optimizer._kmp_scale)]):
        new_trainable[position[id(variable)]] = value
    new_values = [own.get(id(variable), value) for variable, value in mapping[:own_count]]
    return list(new_trainable), new_values + list(new_inner), applied, decision.retry


def as_values(values):
    """`values` with each `keras.Variable` replaced by its value: a pure step
    takes arrays, and Keras' optimizers take `optimizer.variables` as well."""
    return [v.value if isinstance(v, keras.Variable) else v for v in values]


def stateless_apply(optimizer, optimizer_variables, grads, trainable_variables, loss=None):
    """`LossScaleOptimizer.stateless_apply` (see `stateless_step`): `loss`,
    the unscaled loss where the caller gives it, judged with the gradients."""
    if not optimizer.built:
        raise ValueError(
            f"To call `stateless_apply`, {type(optimizer).__name__} must be built: "
            "call `optimizer.build(trainable_variables)` first."
        )
    optimizer_variables = as_values(optimizer_variables)
    trainable_variables = as_values(trainable_variables)
    if not optimizer.enabled:
        own = len(optimizer.variables) - len(optimizer.inner_optimizer.variables)
        new_trainable, new_inner = optimizer.inner_optimizer.stateless_apply(
            list(optimizer_variables[own:]), grads, trainable_variables
        )
        return new_trainable, list(optimizer_variables[:own]) + list(new_inner)
    divide, _ = _handoff.take_for_apply(optimizer, grads)
    new_trainable, new_values, finite, _ = stateless_step(
        optimizer, optimizer_variables, grads, trainable_variables, loss=loss, divide=divide
    )
    # Applied; no loss kept, and whether it was finite only in kmp.Model's
    # step, whose end forgets it: nothing traced may outlive its trace.
    record = optimizer._kmp_record
    record.answer = _handoff.StepAnswer(finite if record.in_model_step else None)
    return new_trainable, new_values
