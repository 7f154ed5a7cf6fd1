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

import keras
from keras import ops

from kmp.scaling import _gradients
from kmp.scaling import _handoff
from kmp import _keras_internals
from kmp.scaling import _rule as _scaling_rule
from kmp.scaling import _spikes
from kmp import backends


def accumulation_steps(optimizer):
    """The inner optimizer's `gradient_accumulation_steps`, or `None`."""
    return getattr(optimizer.inner_optimizer, "gradient_accumulation_steps", None) or None


def add_state_variable(optimizer, name, shape, dtype, initial):
    # aggregation="none", as Keras' own scaler: every replica computes the
    # same value and writes its own copy, with no merge_call (see
    # kmp/backends/tensorflow/replicas.py). Only float32 and int64:
    # TensorFlow keeps int32 resource variables in host memory on a GPU,
    # where XLA cannot read them.
    return optimizer.add_variable(
        shape=shape,
        dtype=dtype,
        initializer=keras.initializers.Constant(initial),
        aggregation="none",
        name=name,
    )


def unscale(optimizer, grads, variables=None, scale=None):
    """`grads` divided by the loss scale (`scale`, or the current one): the
    one place kmp unscales.

    Variables Keras overwrites with their "gradient" (a BatchNormalization
    moving statistic under some layers) take it as it is, as in Keras' scaler;
    they are judged by the variable, not its value (keras-team/keras#21706).
    """
    keep = None if variables is None else [
        _keras_internals.overwrites_with_gradient(optimizer, v) for v in variables
    ]
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
    return _scaling_rule.Decision(finite, loss_finite, nonfinite, retry, spike, loss)


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


def assign_state(optimizer, decision, variables=()):
    """Assigns `state_after` the current state to the scaler's variables,
    and moves the float8 gradient state among `variables` (the step's
    trainable variables) to the new scale (`float8_gradient_state`)."""
    scale = optimizer._kmp_scale.value
    pairs = float8_gradient_state(variables)
    if pairs:
        # Read now: on TensorFlow a variable's `value` is read where it is
        # used, which would be after the assignments below.
        snapshot = backends.get("step").snapshot
        scale = snapshot(scale)
        values = [(snapshot(variables[h].value), snapshot(variables[s].value)) for h, s in pairs]
    own = state_after(optimizer, scale, optimizer.counters, decision)
    for variable in optimizer.variables:
        if id(variable) in own:
            variable.assign(own[id(variable)])
    if pairs:
        rescaled = rescale_float8(values, own[id(optimizer._kmp_scale)], scale)
        for (h, s), (history, float8_scale) in zip(pairs, rescaled):
            variables[h].assign(history)
            variables[s].assign(float8_scale)


# Keras' float8 layers (`layer.quantize("float8")` on Dense and EinsumDense)
# name the amax history and the scale of their output gradient so.
_FLOAT8_GRADIENT = ("outputs_grad_amax_history", "outputs_grad_scale")


def float8_gradient_state(variables):
    """`[(history_index, scale_index), ...]`: where in `variables` each float8
    layer's output-gradient amax history and scale are.

    Under a loss scale these record gradients of the scaled loss, so they
    carry the scale: when it changes, `rescale_float8` moves them with it.
    """
    layers = {}
    for index, variable in enumerate(variables):
        name = getattr(variable, "name", None)
        if name in _FLOAT8_GRADIENT:
            layers.setdefault(variable.path.rpartition("/")[0], {})[name] = index
    return [
        (found[_FLOAT8_GRADIENT[0]], found[_FLOAT8_GRADIENT[1]])
        for found in layers.values()
        if len(found) == 2
    ]


def rescale_float8(pairs, new_scale, old_scale):
    """Float8 output-gradient amax histories and scales moved to a new loss scale.

    ```
    ratio = new_scale / old_scale
    for history, scale in pairs:
        history <- history * ratio
        scale <- scale * ratio   if max(history) > 0
                 scale           otherwise (nothing recorded yet: Keras
                                 keeps the initial scale, so does this)
    ```

    Pure, with `keras.ops`: the step calls it once per attempt, after apply
    or skip and the scale's update, with no branch (a ratio of 1, most
    steps, changes nothing, bit for bit). `kmp.float8.rescale_gradient_amax`
    says why.

    Args:
        pairs: List of `(history, scale)` tensors.
        new_scale, old_scale: Scalar tensors or numbers: the loss scale the
            next attempt uses, and the one the values were recorded under.

    Returns:
        A list of `(history, scale)` float32 tensors, in the order given.
    """
    if not pairs:
        return []
    ratio = ops.divide(ops.cast(new_scale, "float32"), ops.cast(old_scale, "float32"))
    rescaled = []
    for history, scale in pairs:
        history = ops.convert_to_tensor(history, "float32")
        scale = ops.convert_to_tensor(scale, "float32")
        recorded = ops.max(history) > 0.0
        rescaled.append((
            ops.multiply(history, ratio),
            ops.where(recorded, ops.multiply(scale, ratio), scale),
        ))
    return rescaled


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
                   divide=True):
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

    Returns:
        `(new_trainable_values, new_optimizer_values, applied)`.
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
        counters = optimizer.counters
        flags_before = optimizer._nonfinite_gradients.value
        spike_state = (None if optimizer.skip_spikes is None else
                       (optimizer._spike_window.value, optimizer._spike_counts.value))
    grads, divide, finite, loss_finite, nonfinite = check(
        optimizer, grads, built, loss, divide=divide, scale=scale
    )
    decision = decide(optimizer, finite, loss_finite, nonfinite, loss, spike_state=spike_state)
    applied = _scaling_rule.applied(decision)
    inner_ids = {id(v) for v in inner.variables}
    inner_values = [value for variable, value in mapping if id(variable) in inner_ids]

    def apply():
        # Unscaled in the branch that applies: XLA fuses the division into
        # the update. Non-finite gradients never get here.
        unscaled = unscale(optimizer, grads, built, scale) if divide else grads
        return inner.stateless_apply(inner_values, unscaled, list(trainable_variables))

    def skip():
        return list(trainable_variables), inner_values

    if backends.get("step").traced(applied):
        new_trainable, new_inner = ops.cond(applied, apply, skip)
    else:
        # Run eagerly (JAX without jit): decided on the host, so the update
        # runs op by op as Keras' own eager step runs it, not as a branch
        # XLA compiles (whose fused arithmetic rounds otherwise).
        new_trainable, new_inner = apply() if bool(applied) else skip()
    own = state_after(optimizer, scale, counters, decision, flags_before, spike_state)
    new_trainable = list(new_trainable)
    pairs = float8_gradient_state(built)
    rescaled = rescale_float8(
        [(new_trainable[h], new_trainable[s]) for h, s in pairs], own[id(optimizer._kmp_scale)], scale
    )
    for (h, s), (history, float8_scale) in zip(pairs, rescaled):
        new_trainable[h], new_trainable[s] = history, float8_scale
    new_inner = iter(new_inner)
    new_values = []
    for variable, value in mapping:
        if id(variable) in inner_ids:
            new_values.append(next(new_inner))
        else:
            new_values.append(own.get(id(variable), value))
    return list(new_trainable), new_values, applied


def as_values(values):
    """`values` with each `keras.Variable` replaced by its value: a pure step
    takes arrays, and Keras' optimizers take `optimizer.variables` as well."""
    return [v.value if isinstance(v, keras.Variable) else v for v in values]


def stateless_apply(optimizer, optimizer_variables, grads, trainable_variables):
    """`LossScaleOptimizer.stateless_apply` (see `stateless_step`)."""
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
    # Applied; no loss kept: one recorded in a traced function must not
    # outlive its trace.
    optimizer._kmp_record.answer = _handoff.StepAnswer()
    new_trainable, new_values, _ = stateless_step(
        optimizer, optimizer_variables, grads, trainable_variables, divide=divide
    )
    return new_trainable, new_values
