"""The loss-scaled step on TensorFlow: variables assigned in place, under
`tf.distribute` strategies, with gradient accumulation and retries.

The same names as `kmp/backends/jax/step.py`: `apply` (the scaler's
`apply`), `snapshot`, `outside_functions`, `usable_here`, `traced`,
`read_once`, `check_buildable` and `ADD_LINE`. The math shared with JAX (the finiteness decision,
unscaling, the next scale and counters) is `kmp.scaling._step`'s.

Under `tf.distribute` a step runs in one of two places, and `_run_step`
hides which:

- in the replica context: with no strategy, or a strategy that needs no
  `merge_call` (MirroredStrategy on GPUs under XLA). Per-replica work runs
  inline and each replica decides for itself (on all-reduced values, so all
  decide alike);
- in the cross-replica context: strategies that need `merge_call`
  (MirroredStrategy elsewhere, MultiWorkerMirroredStrategy). A `cond` whose
  branch calls `merge_call` (every optimizer's `apply` does) cannot run in a
  replica context there, so the step decides in the cross-replica context,
  as Keras' own LossScaleOptimizer does, and runs per-replica work through
  `call_for_each_replica`.

Each replica checks its own gradients, and the replicas agree on the flags
alone (`agree`): read from every local replica in the cross-replica context
on one machine (as Keras' own scaler does), summed in one small collective
across workers or without `merge_call`. The gradients themselves are summed
by the inner Keras optimizer, as it does without kmp; where it clips
(`clipnorm`, `global_clipnorm`, `clipvalue`) and there are several
replicas, `_shares_of_clipped_sum` first sums them once more, so that the
clip applies to the whole batch's gradient, as on one replica.

kmp's own variables use `aggregation="none"`, like Keras' scaler: every
replica computes the same values and writes its own copy, so no assignment
needs a `merge_call` (which TensorFlow refuses inside a `cond` on the
no-merge-call path).

Under XLA the step's branches are selects (`kmp.backends.tensorflow.selects`).
"""

import tensorflow as tf
from keras import ops

from kmp.precision import _compensated
from kmp.scaling import _gradients
from kmp.scaling import _handoff
from kmp import _keras_internals
from kmp.scaling import _rule as _scaling_rule
from kmp.scaling import _step as _scaling_step
from kmp.scaling._settings import CLIPPING
from kmp.backends.tensorflow import selects

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


def apply(optimizer, grads, variables, *, divide, loss, retries_left, window):
    """`LossScaleOptimizer.apply` on TensorFlow (see `_step`).

    Returns:
        The `kmp.scaling._handoff.StepAnswer`.
    """
    finite, retry = _run_step(
        lambda replicas, *args: _step(optimizer, replicas, *args, divide=divide,
                                      retries_left=retries_left, window=window),
        grads, variables, loss,
    )
    return _handoff.StepAnswer(finite, retry, loss)


def _step(optimizer, replicas, grads, variables, loss, *, divide, retries_left, window):
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
            total = _all_reduce_sum(grads)      # one more collective
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
        replicas: Where per-replica work runs (see `_run_step`).
        grads, variables, loss: This replica's gradients, their variables and
            the unscaled loss (`None` when unknown).
        divide: Bool. Whether the gradients are scaled and must be divided.
        retries_left: Int tensor, or `None`: the retries this batch has left.
        window: Int, or `None`: the inner optimizer's
            `gradient_accumulation_steps`.

    Returns:
        `(applied, retry)`: boolean tensors (`retry` is `None` without
        retries).
    """
    inner = optimizer.inner_optimizer
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
        if _num_replicas() == 1:
            return local
        summed = _all_reduce_sum(
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
    # `kmp.backends.tensorflow.selects`), a window's included.
    in_graph = not tf.executing_eagerly()
    select = replicas is _IN_REPLICA and in_graph and _keras_internals.in_xla_context()
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
    applied = decision.applied

    # Accumulating, the inner optimizer clips the window's sum, which no
    # single micro-batch holds.
    clip_summed = not window and _clips(inner)
    # 16-bit weights in a graph without XLA: their update, computed in
    # float32 and written compensated, is a dozen element-wise passes over
    # every weight, which only XLA fuses; the update alone is compiled
    # (benchmarks' mlp, bfloat16 weights: 0.66x mixed_bfloat16's step
    # without, 1.25x with). Not under a strategy: the optimizer's merge_call
    # cannot run inside a compiled function.
    fused = (bool(optimizer._kmp_compensated) and in_graph and not select
             and replicas is _IN_REPLICA and not tf.distribute.has_strategy())

    def apply_unscaled(grads, variables):
        if divide_later:
            grads = _scaling_step.unscale(optimizer, grads, variables, optimizer._kmp_scale.value)
        grads = _summable(grads)  # before clipping: Keras' global
        if clip_summed:          # norm refuses mixed dtypes
            grads = _clip_summed(inner, grads, variables)
        # 16-bit variables: their updates in float32, written compensated.
        with _compensated.around_inner_apply(optimizer):
            if fused:
                tf.function(lambda grads: inner.apply(grads, variables), jit_compile=True,
                            autograph=False)(grads)
            else:
                inner.apply(grads, variables)

    if select and not window:
        selects.apply_if(applied, lambda: apply_unscaled(grads, variables), inner, variables,
                         grads, gate=True)
        _scaling_step.assign_state(optimizer, decision)
        return applied, decision.retry

    def end_window():  # the scale and counters move at a window's end only
        _scaling_step.assign_state(optimizer, decision)
        optimizer._accumulation_window.assign(ops.zeros((2,), counter_dtype))

    if select and window:
        selects.window_step_by_selects(optimizer, decision, boundary, local[0],
                                       lambda: apply_unscaled(grads, variables), variables,
                                       grads, window, end_window)
        return decision.finite, decision.retry

    def skip():
        if window:  # only reached on a window's last micro-batch: back to its start
            micro_steps = _keras_internals.micro_steps(inner)
            micro_steps.assign(micro_steps - (window - 1))

    if not window and replicas is _IN_REPLICA and not tf.distribute.has_strategy() and in_graph:
        # In one replica's graph the skip is a cond that runs as a function:
        # one op, where lowered it would be a Switch for each tensor it
        # captures (`_keras_internals.functional_conds`).
        with _keras_internals.functional_conds():
            ops.cond(applied, lambda: apply_unscaled(grads, variables), skip)
    else:
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

    ops.cond(boundary, end_window, lambda: None)
    return decision.finite, decision.retry


def _clips(optimizer):
    """Whether `optimizer` clips (Keras' test: a limit set and > 0)."""
    return any((getattr(optimizer, name, None) or 0) > 0 for name in CLIPPING)


def _clip_summed(inner, grads, variables):
    """`grads` whose sum over replicas is the clipped sum (see
    `_shares_of_clipped_sum`); variables Keras overwrites with their
    "gradient" are left as they are, as Keras leaves them out of clipping."""
    overwritten = _keras_internals.overwritten_with_gradient(inner, variables)
    clipped = [i for i, v in enumerate(variables) if not overwritten[i]]
    shares = _shares_of_clipped_sum(
        [grads[i] for i in clipped], lambda total: _keras_internals.clip_gradients(inner, total)
    )
    grads = list(grads)
    for i, share in zip(clipped, shares):
        grads[i] = share
    return grads


# --- where per-replica work runs (see the module docstring) ---


class _InReplica:
    """Per-replica work runs inline; values are this replica's own."""

    @staticmethod
    def run(fn, *args):
        return fn(*args)

    @staticmethod
    def first(value):
        return value

    @staticmethod
    def agree(flags, collective):
        """Every replica's decision from its own `flags` (see `_CrossReplica.agree`)."""
        return collective(flags)


# `_run_step`'s `replicas` where per-replica work runs inline.
_IN_REPLICA = _InReplica


class _CrossReplica:
    """Per-replica work runs on every replica; decisions come from the first."""

    def __init__(self, distribution):
        self._distribution = distribution

    def run(self, fn, *args):
        return self._distribution.extended.call_for_each_replica(fn, args=args)

    def first(self, value):
        # Every replica computed the same value (from all-reduced inputs).
        return tf.nest.map_structure(
            lambda v: self._distribution.experimental_local_results(v)[0], value
        )

    def agree(self, flags, collective):
        """The decision of all replicas from each one's `flags`.

        `flags`: per replica, booleans that must all hold (the gradients and
        the loss are finite), the float32 loss where the spike rule needs it
        (summed), then int64 indicators (which variables overflowed). On one
        machine every replica is local here, in the cross-replica context:
        they are combined without a collective, as Keras' own scaler reads
        them. Across workers, `collective` (run on
        every replica) sums them.
        """
        if isinstance(self._distribution, tf.distribute.MultiWorkerMirroredStrategy):
            return self.first(self.run(collective, flags))
        local = [self._distribution.experimental_local_results(f) for f in flags]
        return tuple(
            ops.all(ops.stack(values)) if values[0].dtype == tf.bool
            # A float (the loss, for the spike rule) is every replica's, summed.
            else ops.sum(ops.stack(values), axis=0) if values[0].dtype.is_floating
            else ops.max(ops.stack(values), axis=0)
            for values in local
        )


def _run_step(step, *args):
    """Calls `step(replicas, *args)` where the current strategy lets it branch.

    Args:
        step: Callable taking `replicas`, an object with `run(fn, *args)`
            (runs `fn` on every replica, returning per-replica results) and
            `first(value)` (one replica's value of a per-replica result),
            then `args`. What it returns, `_run_step` returns.
        *args: This replica's tensors (gradients, variables...). In the
            cross-replica context `step` receives every replica's, merged.

    Raises:
        ValueError: if called in a cross-replica context.
    """
    if not tf.distribute.has_strategy():
        return step(_InReplica, *args)
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "`apply()` must be called in a replica context (inside "
            "`strategy.run`), not in a cross-replica context."
        )
    if _keras_internals.supports_no_merge_call():
        return step(_InReplica, *args)
    return tf.distribute.get_replica_context().merge_call(
        lambda distribution, *merged: step(_CrossReplica(distribution), *merged), args=args
    )


def _num_replicas():
    """The number of replicas in sync (1 outside a strategy)."""
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def _all_reduce_sum(tensors):
    """Sums `tensors` over replicas: one collective per dtype, order kept.

    A single `all_reduce` packs its tensors into one buffer, which fails on
    mixed dtypes (a float16 variable's gradient beside float32 ones); one call
    per dtype keeps the number of collectives at one for the usual model.
    `None` entries pass through.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(tensors)
    groups = {}
    for index, tensor in enumerate(tensors):
        if tensor is not None:
            groups.setdefault(tensor.dtype, []).append(index)
    reduced = list(tensors)
    for indices in groups.values():
        summed = context.all_reduce(
            tf.distribute.ReduceOp.SUM, [tensors[i] for i in indices]
        )
        for i, value in zip(indices, summed):
            reduced[i] = value
    return reduced


def _shares_of_clipped_sum(grads, clip):
    """Each replica's share of `clip(grads summed over replicas)`.

    Keras' optimizer clips each replica's gradients, then sums them over
    replicas: with two replicas a whole-batch gradient of 4 clipped at 2
    would step by 4. Here the replicas' gradients are summed first (one
    `_all_reduce_sum`), the sum is clipped once with `clip`, and each replica
    gets `clipped / num_replicas`: what the inner optimizer then sums is the
    clipped whole-batch gradient, and its own per-replica clip leaves each
    share as it is (a share's norm and values are within the limit).

    Args:
        grads: List of this replica's gradients (no `None`).
        clip: Callable taking and returning a list of gradients: the inner
            optimizer's clipping rule.

    Returns:
        A list of gradients in the same order. With one replica, `grads`
        unchanged (the inner optimizer clips them as they are).
    """
    replicas = _num_replicas()
    if replicas == 1:
        return grads
    clipped = clip(_all_reduce_sum(grads))
    return _gradients.map_values(lambda t: t / ops.cast(replicas, t.dtype), clipped)


def _summable(grads):
    """`grads` as the inner Keras optimizer can sum them over replicas.

    Keras' optimizer sums all gradients in one `all_reduce`, which TensorFlow
    refuses for mixed dtypes (a float16 variable's gradient beside float32
    ones): with several replicas such gradients are handed over in float32
    (each Keras update step casts its gradient to its variable's dtype).
    """
    if _num_replicas() == 1:
        return grads
    dtypes = {g.dtype for g in _gradients.values_of(grads) if g is not None}
    if len(dtypes) < 2:
        return grads
    return _gradients.map_values(lambda t: ops.cast(t, "float32"), grads)
