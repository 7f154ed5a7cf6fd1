"""The TensorFlow step's branches as selects, under XLA.

Under XLA a `cond` survives as a `conditional` whose outputs get buffers of
their own (a branch that may write the variables copies them, run or not),
and XLA:GPU reads its predicate on the host mid-step. So where
`kmp.backends.tensorflow.step` runs under XLA in one replica, a skipped
step is a select, as Keras' own step is: `apply_if` for a step,
`window_step_by_selects` for an accumulation window's micro-batch, each
write the inner optimizer makes gated by `kmp.scaling._gate`
(`_gated_writes`), and a select after for what the gate cannot reach.
"""

import tensorflow as tf
from keras import ops

from kmp.scaling import _gate
from kmp import _keras_internals


def window_step_by_selects(optimizer, decision, boundary, local_finite, apply, variables,
                           grads, window, end_window):
    """An accumulated step's micro-batch under XLA, the step's window path
    (`kmp.backends.tensorflow.step`) with selects for its branches: the
    inner optimizer accumulates (or, at the window's last micro-batch,
    updates; a `cond` for a sparse gradient, as `apply_if` says); a
    discarded window leaves every variable as it was, its micro-steps back
    at its start and its accumulators zeroed, as do micro-batches after an
    overflow mid-window; the scale and counters move at the window's end
    only (`end_window()`, which writes them)."""
    inner = optimizer.inner_optimizer
    apply_if(decision.finite, apply, inner, variables, grads)
    micro_steps = _keras_internals.micro_steps(inner)
    micro_steps.assign(ops.where(decision.finite, micro_steps.value, micro_steps - (window - 1)))
    discard = ops.logical_not(decision.finite)
    _keep_where(
        ops.logical_or(discard, ops.logical_and(ops.logical_not(boundary),
                                                ops.logical_not(local_finite))),
        lambda: _keras_internals.reset_gradient_accumulators(inner),
        list(inner.variables),
    )
    own = [v for v in optimizer.variables if not any(v is w for w in inner.variables)]
    _keep_where(boundary, end_window, list(variables) + own)


def apply_if(finite, apply, inner, variables, grads, gate=False):
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
    before = [tf.identity(v.value) for v in guarded]
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
