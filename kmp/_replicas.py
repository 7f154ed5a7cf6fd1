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

kmp's own variables use `aggregation="none"`, like Keras' scaler: every
replica computes the same values and writes its own copy, so no assignment
needs a `merge_call` (which TensorFlow refuses inside a `cond` on the
no-merge-call path).
"""

import threading

import tensorflow as tf

from kmp import _gradients


class _InReplica:
    """Per-replica work runs inline; values are this replica's own."""

    @staticmethod
    def run(fn, *args):
        return fn(*args)

    @staticmethod
    def first(value):
        return value


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
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
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


# Keras' TensorFlow optimizers sum gradients over replicas in
# `_all_reduce_sum_gradients`, called from `apply`. kmp has summed them
# already (the skip decision needs the sum), so while kmp applies them that
# method passes them through. Thread-local: MirroredStrategy traces each
# replica in its own thread.
_ALL_REDUCE_METHOD = "_all_reduce_sum_gradients"
_already_reduced = threading.local()


def _passes_through_when_reduced(keras_all_reduce):
    def all_reduce_sum_gradients(self, grads_and_vars):
        if getattr(_already_reduced, "active", False):
            return list(grads_and_vars)
        return keras_all_reduce(self, grads_and_vars)

    all_reduce_sum_gradients._kmp_switch = True
    return all_reduce_sum_gradients


def _optimizers_within(optimizer):
    """`optimizer` and those it delegates to (a MultiOptimizer's optimizers)."""
    found = [optimizer]
    for inner in getattr(optimizer, "optimizers", None) or ():
        if inner is not optimizer:
            found.extend(_optimizers_within(inner))
    return found


def can_skip_all_reduce(optimizer):
    """Whether `optimizer`'s own all-reduce can be turned off for `apply_reduced`.

    True when every optimizer that `optimizer.apply` reaches (itself, and a
    `keras.optimizers.MultiOptimizer`'s sub-optimizers, which sum again on
    their own) takes its sum from a class method named
    `_all_reduce_sum_gradients`; that method is then switched once per class.
    Should Keras rename it, the caller divides the summed gradients by the
    number of replicas instead, so that the second sum gives the same values.
    """
    owners = []
    for inner in _optimizers_within(optimizer):
        owner = next(
            (klass for klass in type(inner).__mro__ if _ALL_REDUCE_METHOD in vars(klass)),
            None,
        )
        if owner is None or _ALL_REDUCE_METHOD in vars(inner):
            return False
        owners.append(owner)
    for owner in owners:
        method = vars(owner)[_ALL_REDUCE_METHOD]
        if not getattr(method, "_kmp_switch", False):
            setattr(owner, _ALL_REDUCE_METHOD, _passes_through_when_reduced(method))
    return True


def apply_reduced(optimizer, grads, variables):
    """`optimizer.apply(grads, variables)` on gradients already summed over replicas.

    Call `can_skip_all_reduce(optimizer)` first: only where it is true does
    the optimizer skip its own sum.
    """
    _already_reduced.active = True
    try:
        optimizer.apply(grads, variables)
    finally:
        _already_reduced.active = False


def apply_unscaled(optimizer, grads, variables, *, divisor, summed, keep, clipping):
    """Unscales, clips and applies one replica's gradients with `optimizer`.

    Args:
        optimizer: The inner optimizer.
        grads: This replica's gradients: summed over replicas already
            (`summed`), or its own (the inner optimizer sums them).
        variables: The variables they belong to.
        divisor: The loss scale to divide by, or `None` when the gradients
            are unscaled already (or were never scaled).
        summed: Bool. Whether `grads` are sums over replicas.
        keep: List of booleans: gradients to leave undivided (see
            `kmp._gradients.divide`).
        clipping: Dict of `clipvalue`, `clipnorm`, `global_clipnorm`.
    """
    replicas = num_replicas() if summed else 1
    pass_through = replicas > 1 and can_skip_all_reduce(optimizer)
    if pass_through:
        replicas = 1  # the inner optimizer will not sum again
    clips = any(value is not None for value in clipping.values())
    if divisor is not None:
        # Without clipping one division unscales and, where the inner
        # optimizer sums over replicas again, averages over them too.
        grads = _gradients.divide(grads, divisor * (1 if clips else replicas), keep)
        replicas = replicas if clips else 1
    grads = _gradients.clip_gradients(grads, **clipping)
    if replicas > 1:
        grads = _gradients.divide(grads, replicas)
    if pass_through:
        apply_reduced(optimizer, grads, variables)
    else:
        optimizer.apply(grads, variables)
