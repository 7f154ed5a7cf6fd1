"""Loss scaling with the inner optimizer's `gradient_accumulation_steps`.

The inner optimizer sums each micro-batch's unscaled gradients and updates
the weights on a window's last micro-batch, summing over replicas once
then, as Keras does. kmp decides once per window too:

```
window_bad |= this micro-batch is not finite     # per replica, no collective
if boundary (the window's last micro-batch):
    window_finite = all_reduce(window_bad) == 0  # the window's one collective
    if window_finite: the inner optimizer adds this micro-batch and updates
    else: accumulators reset, inner step count back to the window's start
    state = update_loss_scale(state, window_finite)
    window_bad = 0
else:
    the inner optimizer adds this micro-batch
    if window_bad: accumulators reset (the window is lost anyway)
```

So a finite window pays one finite check per micro-batch and nothing more
(no collective, no pass over the gradients), the scale is the same for every
micro-batch of a window, a window with an overflow anywhere is discarded
whole and counted once, no inf or NaN stays in the accumulators between
steps, and `iterations` counts applied windows only.
"""

from keras import ops

from kmp import _replicas


def steps(optimizer):
    """The inner optimizer's `gradient_accumulation_steps`, or `None`.

    Raises:
        ValueError: if `optimizer` also clips: it would clip each
            micro-batch, not the accumulated gradients.
    """
    steps = getattr(optimizer.inner_optimizer, "gradient_accumulation_steps", None)
    if steps and (optimizer.clipvalue, optimizer.clipnorm, optimizer.global_clipnorm) != (None,) * 3:
        raise ValueError(
            "kmp.LossScaleOptimizer's clipping would clip each micro-batch, "
            "not the accumulated gradients, when the inner optimizer has "
            "`gradient_accumulation_steps`. Set `clipnorm`, "
            "`global_clipnorm` or `clipvalue` on the inner optimizer "
            "instead: it clips the accumulated, unscaled gradients. "
            f"Received: gradient_accumulation_steps={steps}, "
            f"clipvalue={optimizer.clipvalue}, clipnorm={optimizer.clipnorm}, "
            f"global_clipnorm={optimizer.global_clipnorm}"
        )
    return steps


def refuse_retries(optimizer):
    """Raises `ValueError` if `optimizer` accumulates: a retry would redo one
    micro-batch of a window (`kmp.Model.compile(overflow_retries=...)`)."""
    if steps(optimizer):
        raise ValueError(
            "`overflow_retries` cannot be combined with the inner optimizer's "
            "`gradient_accumulation_steps` (a retry would redo one micro-batch "
            "of a window). Received: gradient_accumulation_steps="
            f"{steps(optimizer)}"
        )


def step(optimizer, replicas, decision, apply_on_replicas):
    """One micro-batch of an accumulated step (see the module docstring).

    Args:
        optimizer: The `kmp.LossScaleOptimizer`.
        replicas: Where per-replica work runs (see `kmp._replicas.run_step`).
        decision: This micro-batch's per-replica decision, from gradients
            that were not summed over replicas.
        apply_on_replicas: Callable: gives this micro-batch's unscaled
            gradients to the inner optimizer on every replica.
    """
    inner = optimizer.inner_optimizer
    window_length = inner.gradient_accumulation_steps
    micro_steps = inner._iterations
    boundary = ops.equal((micro_steps + 1) % window_length, 0)
    window = optimizer._accumulation_window

    def note(decision):
        bad = ops.cast(
            ops.stack([ops.logical_not(decision.finite), ops.logical_not(decision.loss_finite)]),
            "int64",
        )
        bad = ops.maximum(window.value, bad)
        window.assign(bad)
        return bad

    local_bad = replicas.run(note, decision)

    # The window's one collective, on its last micro-batch only.
    window_bad = ops.cond(
        boundary,
        lambda: replicas.first(replicas.run(_sum_over_replicas, local_bad)),
        lambda: ops.zeros((2,), "float32"),
    )
    finite = ops.equal(window_bad[0], 0.0)
    discard = ops.logical_and(boundary, ops.logical_not(finite))
    # One dispatch, so the inner optimizer's apply is traced once; a
    # discarded window only rewinds the inner step count to its start.
    def rewind():
        micro_steps.assign(micro_steps - (window_length - 1))

    ops.cond(discard, rewind, apply_on_replicas)
    # One reset for both cases: a discarded window, and a micro-batch with
    # an overflow (now or earlier) mid-window (the window is lost anyway,
    # and no inf or NaN stays in the accumulators).
    replicas.run(
        lambda bad: ops.cond(
            ops.logical_or(
                discard, ops.logical_and(ops.logical_not(boundary), ops.greater(bad[0], 0))
            ),
            inner._backend_reset_gradient_accumulators,
            lambda: None,
        ),
        local_bad,
    )

    def end_window():
        optimizer._update_state(
            replicas.first(decision)._replace(
                finite=finite, loss_finite=ops.equal(window_bad[1], 0.0)
            )
        )
        window.assign(ops.zeros((2,), "int64"))

    ops.cond(boundary, end_window, lambda: None)


def _sum_over_replicas(window_bad):
    return _replicas.all_reduce_sum([ops.cast(window_bad, "float32")])[0]
