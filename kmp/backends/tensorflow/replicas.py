"""Replica handling for the loss-scaled step under `tf.distribute`.

A step runs in one of two places, and `run_step` hides which:

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
replicas, `clip_summed` first sums them once more, so that the clip applies
to the whole batch's gradient, as on one replica.

kmp's own variables use `aggregation="none"`, like Keras' scaler: every
replica computes the same values and writes its own copy, so no assignment
needs a `merge_call` (which TensorFlow refuses inside a `cond` on the
no-merge-call path).
"""

import tensorflow as tf
from keras import ops

from kmp.scaling import _gradients
from kmp import _keras_internals


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


# `run_step`'s `replicas` where per-replica work runs inline.
IN_REPLICA = _InReplica


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


def run_step(step, *args):
    """Calls `step(replicas, *args)` where the current strategy lets it branch.

    Args:
        step: Callable taking `replicas`, an object with `run(fn, *args)`
            (runs `fn` on every replica, returning per-replica results) and
            `first(value)` (one replica's value of a per-replica result),
            then `args`. What it returns, `run_step` returns.
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


def num_replicas():
    """The number of replicas in sync (1 outside a strategy)."""
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def all_reduce_sum(tensors):
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


def clip_summed(grads, clip):
    """Each replica's share of `clip(grads summed over replicas)`.

    Keras' optimizer clips each replica's gradients, then sums them over
    replicas: with two replicas a whole-batch gradient of 4 clipped at 2
    would step by 4. Here the replicas' gradients are summed first (one
    `all_reduce_sum`), the sum is clipped once with `clip`, and each replica
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
    replicas = num_replicas()
    if replicas == 1:
        return grads
    clipped = clip(all_reduce_sum(grads))
    return _gradients.map_gradients(lambda t: t / ops.cast(replicas, t.dtype), clipped)


def summable(grads):
    """`grads` as the inner Keras optimizer can sum them over replicas.

    Keras' optimizer sums all gradients in one `all_reduce`, which TensorFlow
    refuses for mixed dtypes (a float16 variable's gradient beside float32
    ones): with several replicas such gradients are handed over in float32
    (each Keras update step casts its gradient to its variable's dtype).
    """
    dtypes = {g.dtype for g in _gradients.values_of(grads) if g is not None}
    if len(dtypes) < 2 or num_replicas() == 1:
        return grads
    return _gradients.map_gradients(lambda t: ops.cast(t, "float32"), grads)
