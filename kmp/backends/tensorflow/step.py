"""The loss-scaled step on TensorFlow: variables assigned in place, under
`tf.distribute` strategies, with gradient accumulation and retries.

The same names as `kmp/backends/jax/step.py`: `apply` (the scaler's
`apply`), `snapshot`, `outside_functions`, `usable_here`, `traced`,
`read_once`, `check_buildable` and `ADD_LINE`. The math shared with JAX (the finiteness decision,
unscaling, the next scale and counters) is `kmp.scaling._step`'s.
"""

import tensorflow as tf
from keras import ops

from kmp.precision import _compensated
from kmp.scaling import _gate
from kmp.scaling import _handoff
from kmp import _keras_internals
from kmp.scaling import _rule as _scaling_rule
from kmp.scaling import _step as _scaling_step
from kmp.scaling._settings import CLIPPING
from kmp.backends.tensorflow import replicas as replicas_module

# The line a warning asks for (`kmp.scaling._handoff`).
ADD_LINE = ("Add one line inside the tape, `scaled_loss = {attribute}.scale_loss(loss)`, "
            "and take `tape.gradient(scaled_loss, ...)`")

def snapshot(value):
    """A variable's value that later assignments leave as it is."""
    return tf.identity(value)


def outside_functions():
    """Where variables are created outside any `tf.function` being traced."""
    return tf.init_scope()


def usable_here(loss):
    """`loss`, or `None` where it was recorded in another trace (a
    `tf.function` traced again)."""
    if not tf.is_symbolic_tensor(loss):
        return loss
    graph = _keras_internals.default_graph()
    while graph is not None:
        if graph is loss.graph:
            return loss
        graph = getattr(graph, "outer_graph", None)
    return None


def traced(value):
    """Whether `value` (a tensor or `IndexedSlices`) is a symbolic tensor of
    a `tf.function` being traced: code that computed it runs again on later
    calls without its Python."""
    return tf.is_symbolic_tensor(getattr(value, "values", value))


def read_once(loss, scale):
    """Never on TensorFlow: a traced function reads a variable at each call."""
    return False


def check_buildable(optimizer):
    """Every inner optimizer combines with the scaler on TensorFlow."""
    # A body AutoGraph can convert (a docstring alone it cannot).
    return None


def apply(optimizer, grads, variables, *, divide, loss, retries_left):
    """`LossScaleOptimizer.apply` on TensorFlow (see `_step`).

    Returns:
        The `kmp.scaling._handoff.StepAnswer`.
    """
    finite, retry = replicas_module.run_step(
        lambda replicas, *args: _step(optimizer, replicas, *args, divide=divide,
                                      retries_left=retries_left),
        grads, variables, loss,
    )
    return _handoff.StepAnswer(finite, retry, loss)


def _step(optimizer, replicas, grads, variables, loss, *, divide, retries_left):
    """One step (or one micro-batch of an accumulated step).

    ```
    bad = [not all(isfinite(grads)), not isfinite(loss)]  # each replica its own
    if accumulating:
        bad = window_bad = max(window_bad, bad)
    if not accumulating or the window's last micro-batch:
        bad = agree(bad)         # over all replicas (see below)
    else:
        bad = 0                  # mid-window: the inner optimizer accumulates
    if bad == 0:
        grads = unscale(grads)
        if clipping and replicas > 1 and not accumulating:
            total = all_reduce_sum(grads)      # one more collective
            grads = inner_optimizer.clip(total) / replicas
        inner_optimizer.apply(grads)  # clips (a share: no-op), sums, updates
    # else: nothing is applied (a window's accumulators are dropped)
    if not accumulating or the window's last micro-batch:
        state = update_loss_scale(state, bad == 0)
    ```

    Each replica checks its own gradients and only the flags are shared:
    read from every local replica on one machine, as Keras' scaler reads
    them (no collective), or summed in one small collective across workers
    and without `merge_call`. The inner optimizer sums the gradients over
    replicas itself, as it does without kmp, so nothing of Keras' is switched
    off. Keras' optimizer clips before it sums, that is each replica's share;
    where it clips and there are several replicas, kmp sums the unscaled
    gradients once more, clips that sum with the inner optimizer's own rule
    and hands each replica `clipped / replicas`, which the inner optimizer's
    clip leaves as it is and its sum turns back into the clipped whole-batch
    gradient: the step clips as on one replica, at the cost of one more
    all-reduce of the gradients (only then; variables Keras overwrites with
    their "gradient" are left out, as Keras leaves them out of clipping).
    With gradient accumulation the inner optimizer clips each replica's
    accumulated window (Keras' order: no micro-batch holds the window's sum).

    Args:
        optimizer: The `LossScaleOptimizer`.
        replicas: Where per-replica work runs (see `replicas.run_step`).
        grads, variables, loss: This replica's gradients, their variables and
            the unscaled loss (`None` when unknown).
        divide: Bool. Whether the gradients are scaled and must be divided.
        retries_left: Int tensor, or `None`: the retries this batch has left.

    Returns:
        `(applied, retry)`: boolean tensors (`retry` is `None` without
        retries).
    """
    inner = optimizer.inner_optimizer
    window = _scaling_step.accumulation_steps(optimizer)
    divide_later = divide and not optimizer.min_scale < 1.0
    monitored = optimizer._monitored
    counter_dtype = _scaling_rule.COUNTER_DTYPE
    # The spike rule judges the batch's loss: every replica's, summed.
    spikes = optimizer.skip_spikes is not None and loss is not None

    def check(grads, variables, loss):
        grads, _, finite, loss_finite, nonfinite = _scaling_step.check(
            optimizer, grads, variables, loss, divide=divide
        )
        if window:
            seen = ops.maximum(
                optimizer._accumulation_window.value,
                ops.cast(ops.logical_not(ops.stack([finite, loss_finite])), counter_dtype),
            )
            optimizer._accumulation_window.assign(seen)
            finite, loss_finite = ops.equal(seen[0], 0), ops.equal(seen[1], 0)
        local = (finite, loss_finite)
        if spikes:
            local += (ops.cast(loss, "float32"),)
        if monitored:
            # Which variables overflowed: this micro-batch's own flags.
            local += (nonfinite,)
        return grads, local

    def agree(local):
        # Per replica: the step's one collective, of the flags (and the
        # loss, for the spike rule) only; none with one replica, and none
        # where all replicas are local (see `replicas`).
        if replicas_module.num_replicas() == 1:
            return local
        summed = replicas_module.all_reduce_sum(
            [ops.cast(ops.logical_not(local[0]), "float32"),
             ops.cast(ops.logical_not(local[1]), "float32")]
            + [ops.cast(value, "float32") for value in local[2:]]
        )
        losses = tuple(summed[2:3]) if spikes else ()
        return (ops.equal(summed[0], 0.0), ops.equal(summed[1], 0.0)) + losses + tuple(
            ops.cast(ops.greater(flags, 0.0), counter_dtype) for flags in summed[2 + len(losses):]
        )

    grads, local = replicas.run(check, grads, variables, loss)
    reduce = lambda: replicas.agree(local, agree)  # noqa: E731
    # Under XLA, in each replica, the step's branches are selects (see
    # `_apply_or_keep`), a window's included.
    select = replicas is replicas_module.IN_REPLICA and _keras_internals.in_xla_context()
    if window:
        boundary = ops.equal((_keras_internals.micro_steps(inner) + 1) % window, 0)
        # Mid-window every replica adds its micro-batch: "finite" until the end.
        mid_window = lambda: tuple(  # noqa: E731
            ops.ones_like(v) if i < 2 else v for i, v in enumerate(replicas.first(local))
        )
        if select:
            agreed = tuple(ops.where(boundary, at_end, mid)
                           for at_end, mid in zip(reduce(), mid_window()))
        else:
            agreed = ops.cond(boundary, reduce, mid_window)
    else:
        agreed = reduce()
    decision = _scaling_step.decide(
        optimizer, agreed[0], agreed[1], agreed[-1] if monitored else None,
        agreed[2] if spikes else None, retries_left=retries_left,
    )
    applied = _scaling_rule.applied(decision)

    # Accumulating, the inner optimizer clips the window's sum, which no
    # single micro-batch holds.
    clip_summed = not window and _clips(inner)

    def apply_unscaled(grads, variables):
        if divide_later:
            grads = _scaling_step.unscale(optimizer, grads, variables, optimizer._kmp_scale.value)
        grads = replicas_module.summable(grads)  # before clipping: Keras' global
        if clip_summed:                           # norm refuses mixed dtypes
            grads = _clip_summed(inner, grads, variables)
        with _compensated.around_inner_apply(optimizer):
            inner.apply(grads, variables)

    if select and not window:
        _apply_if(applied, lambda: apply_unscaled(grads, variables), inner, variables, grads,
                  gate=True)
        _scaling_step.assign_state(optimizer, decision)
        return applied, decision.retry
    if select and window:
        _window_step_by_selects(optimizer, decision, boundary, local[0],
                                lambda: apply_unscaled(grads, variables), variables, grads, window)
        return decision.finite, decision.retry

    def skip():
        if window:  # only reached on a window's last micro-batch: back to its start
            micro_steps = _keras_internals.micro_steps(inner)
            micro_steps.assign(micro_steps - (window - 1))

    ops.cond(applied, lambda: replicas.run(apply_unscaled, grads, variables), skip)
    if not window:
        _scaling_step.assign_state(optimizer, decision)
        return applied, decision.retry
    discard = ops.logical_not(decision.finite)
    # A discarded window, and a micro-batch with an overflow (now or earlier)
    # mid-window (the window is lost anyway): no inf or NaN stays in the
    # accumulators.
    replicas.run(
        lambda local: ops.cond(
            ops.logical_or(
                discard, ops.logical_and(ops.logical_not(boundary), ops.logical_not(local[0]))
            ),
            lambda: _keras_internals.reset_gradient_accumulators(inner),
            lambda: None,
        ),
        local,
    )

    def end_window():
        _scaling_step.assign_state(optimizer, decision)
        optimizer._accumulation_window.assign(ops.zeros((2,), counter_dtype))

    ops.cond(boundary, end_window, lambda: None)
    return decision.finite, decision.retry


def _window_step_by_selects(optimizer, decision, boundary, local_finite, apply, variables,
                            grads, window):
    """An accumulated step's micro-batch under XLA, `_step`'s window path
    with selects for its branches: the inner optimizer accumulates (or, at
    the window's last micro-batch, updates; a `cond` for a sparse gradient,
    as `_apply_if` says); a discarded window leaves
    every variable as it was, its micro-steps back at its start and its
    accumulators zeroed, as do micro-batches after an overflow mid-window;
    the scale and counters move at the window's end only."""
    inner = optimizer.inner_optimizer
    counter_dtype = _scaling_rule.COUNTER_DTYPE
    _apply_if(decision.finite, apply, inner, variables, grads)
    micro_steps = _keras_internals.micro_steps(inner)
    micro_steps.assign(ops.where(decision.finite, micro_steps.value, micro_steps - (window - 1)))
    discard = ops.logical_not(decision.finite)
    _keep_where(
        ops.logical_or(discard, ops.logical_and(ops.logical_not(boundary),
                                                ops.logical_not(local_finite))),
        lambda: _keras_internals.reset_gradient_accumulators(inner),
        list(inner.variables),
    )

    def end_window():
        _scaling_step.assign_state(optimizer, decision)
        optimizer._accumulation_window.assign(ops.zeros((2,), counter_dtype))

    own = [v for v in optimizer.variables if not any(v is w for w in inner.variables)]
    _keep_where(boundary, end_window, list(variables) + own)


def _apply_if(finite, apply, inner, variables, grads, gate=False):
    """Under XLA: `apply()` where `finite`, as a select (`_apply_or_keep`)
    or, where a gradient is sparse and no strategy is in use, as a `cond`
    (see there why). `gate`: the inner optimizer's own writes are gated
    (`_gated_writes`), outside a strategy."""
    strategy = tf.distribute.has_strategy()
    if strategy or not any(isinstance(g, tf.IndexedSlices) for g in grads):
        _apply_or_keep(finite, apply, inner, variables, gate=gate and not strategy)
    else:
        ops.cond(finite, apply, lambda: None)


def _apply_or_keep(finite, apply, inner, variables, gate=False):
    """Runs `apply()` (the inner optimizer's update of `variables`), then
    keeps each value it wrote only where `finite`: the skip as a select.

    ```
    before = [v for v in variables + inner.variables]   # values, not copies
    apply()                                  # runs whatever the gradients hold
    for v, old in zip(variables + inner.variables, before):
        v = where(finite, v, old)            # a skipped step changes nothing
    ```

    With `gate`, each write the inner optimizer makes through its own
    `assign`, `assign_add` and `assign_sub` (how Keras' optimizers write
    their slots and variables) is a select instead, `assign(v, where(finite,
    v + delta, v))`, and a variable written only that way needs no
    select after: XLA fuses each into the update that computes it, where
    the select after keeps the old value alive next to the new one and XLA
    copies each slot to do so (`_gated_writes`).

    Under XLA, where kmp uses it, this is the shape of Keras' own step:
    each select fuses into the update that feeds it, and the step has no
    `conditional`. A conditional, even one with an empty branch, survives
    XLA's passes: XLA:GPU reads its predicate on the host in the middle of
    the step, its operands (float32 copies of every gradient) must exist
    before it runs, and, on a strategy's all-GPU path, TensorFlow refuses
    the `merge_call` an optimizer's `apply` makes inside its branch
    (keras-team/keras#21366). Without XLA a `cond` stays cheaper: a graph
    would run the update's ops and every select on each skipped step. So
    does XLA's conditional where a gradient is sparse (an embedding's
    `IndexedSlices`, updated by a scatter in place): a select would keep a
    copy of the whole table and its slots on every step (twice the step's
    time on `benchmarks.xla_step`'s Embedding(200000, 64) on a CPU), and
    XLA keeps Keras' own step's conditional there too. Under a strategy it
    is a select all the same: a `cond` would hold the `merge_call`.

    Args:
        finite: Boolean scalar tensor: keep what `apply` wrote.
        apply: Callable of no arguments that updates `variables`.
        inner: The inner Keras optimizer (its slots, iterations, ...).
        variables: The variables `apply` updates.
        gate: Bool. Whether to gate `inner`'s own writes.
    """
    _keep_where(finite, apply, list(variables) + list(inner.variables),
                gate=inner if gate else None)


def _keep_where(keep, run, guarded, gate=None):
    """Runs `run()`, then keeps what it wrote to the `guarded` variables only
    where `keep` (a select per variable; one `run` did not write reads back
    as it was, and XLA drops that select). Given an optimizer, `gate`, the
    writes it makes through its own methods are gated instead, and the
    variables written only so are left as `run` wrote them."""
    before = [snapshot(v.value) for v in guarded]
    if gate is None:
        run()
        gated = set()
    else:
        gated = _gated_writes(gate, keep, run)
    for variable, value in zip(guarded, before):
        if id(variable.value) not in gated:
            variable.assign(ops.where(keep, variable.value, value))


# Ops that take a variable's handle and only read it. Any other op that takes
# one (an assign or scatter outside the gate, a `cond`, `while` or call whose
# body may write) counts as writing it.
_READS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "VariableShape",
                    "ResourceGather", "ResourceGatherNd"})
_GATED = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


def _gated_writes(optimizer, keep, run):
    """Runs `run()` with `optimizer`'s own writes gated by `keep`
    (`kmp.scaling._gate`); returns the `id`s of the `tf.Variable`s every
    write of which in `run` was gated.

    Each gated write runs in a name scope of its own; then every op `run`
    added to the graph that takes a variable's handle and is not a read is
    either a gated write (an assign in such a scope) or another write, which
    leaves that variable to the select after, whatever the gate wrote. A
    scatter (a sparse value) is written as given and selected after.
    """
    graph = _keras_internals.default_graph()
    scopes = {}  # name scope -> id of the tf.Variable written in it

    def around(variable, value, gated, plain):
        if isinstance(value, tf.IndexedSlices):
            return plain()
        with tf.name_scope("kmp_gated_write") as scope:
            scopes[scope] = id(_gate.value_of(variable))
            return gated()

    start = len(graph.get_operations())
    # Keras' TensorFlow optimizer casts what its `assign_add` is given to
    # the variable's dtype, then adds in it.
    with _gate.gated_writes(optimizer, keep, around, casts_before_adding=True):
        run()
    gated_handles, written = {}, set()
    for op in graph.get_operations()[start:]:
        handles = [t.ref() for t in op.inputs if t.dtype == tf.resource]
        if not handles or op.type in _READS:
            continue
        scope = next((s for s in scopes if op.name.startswith(s)), None)
        if scope is not None and op.type in _GATED:
            gated_handles[handles[0]] = scopes[scope]
        else:
            written.update(handles)
    return {variable for handle, variable in gated_handles.items() if handle not in written}


def _clips(optimizer):
    """Whether `optimizer` clips (Keras' test: a limit set and > 0)."""
    return any((getattr(optimizer, name, None) or 0) > 0 for name in CLIPPING)


def _clip_summed(inner, grads, variables):
    """`grads` whose sum over replicas is the clipped sum (see
    `replicas.clip_summed`); variables Keras overwrites with their
    "gradient" are left as they are, as Keras leaves them out of clipping."""
    overwritten = _keras_internals.overwritten_with_gradient(inner, variables)
    clipped = [i for i, v in enumerate(variables) if not overwritten[i]]
    shares = replicas_module.clip_summed(
        [grads[i] for i in clipped], lambda total: _keras_internals.clip_gradients(inner, total)
    )
    grads = list(grads)
    for i, share in zip(clipped, shares):
        grads[i] = share
    return grads
