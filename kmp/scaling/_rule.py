"""The scaling rule, as pure functions: jmp's shape, written once.

`update_loss_scale` is the rule (public as `kmp.loss_scale.update_loss_scale`);
`next_state` applies it to a `kmp.LossScaleOptimizer`'s scale and counters,
with the monitor's diagnostics and retries. Both backends' steps call them:
the TensorFlow step assigns what they return, the JAX step returns it.
Nothing here reads or writes a variable.
"""

import collections

from keras import ops

from kmp.scaling import _gradients

COUNTER_DTYPE = _gradients.COUNTER_DTYPE

LossScaleState = collections.namedtuple(
    "LossScaleState", ["loss_scale", "good_steps", "hysteresis_left", "skipped_steps"]
)
LossScaleState.__doc__ = """The running state of dynamic loss scaling.

Fields:
    loss_scale: float32 scalar. The current scale.
    good_steps: integer scalar. Finite steps since the last growth or skip.
    hysteresis_left: integer scalar. Skips still tolerated before backing off.
    skipped_steps: integer scalar. Steps skipped in total (never resets).
"""


def update_loss_scale(
    state,
    finite,
    *,
    dynamic=True,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    hysteresis=1,
    min_scale=1.0,
    max_scale=2.0**24,
):
    """Returns the loss-scale state after one step (a pure function).

    The Megatron-LM rule, clamped to `[min_scale, max_scale]` so the scale can
    never become 0, inf or NaN:

    ```
    if not finite:
        skipped_steps += 1
        if dynamic:
            good_steps = 0
            hysteresis_left -= 1
            if hysteresis_left <= 0:
                loss_scale = max(loss_scale * backoff_factor, min_scale)
    elif dynamic:
        good_steps += 1
        if good_steps == growth_interval:
            good_steps = 0
            hysteresis_left = hysteresis
            loss_scale = min(loss_scale * growth_factor, max_scale)
    ```

    Written with `keras.ops` and no branches, so it traces into one small
    graph and compiles under XLA.

    Args:
        state: `LossScaleState`. The state before the step.
        finite: Boolean scalar. Whether every gradient of the step was finite.
        dynamic: Bool. When `False` only `skipped_steps` changes. Defaults to
            `True`.
        growth_factor: Float > 1. Defaults to `2.0`.
        backoff_factor: Float in (0, 1). Defaults to `0.5`.
        growth_interval: Int >= 1. Defaults to `2000`.
        hysteresis: Int >= 1. Defaults to `1`.
        min_scale: Float > 0. Defaults to `1.0`.
        max_scale: Float >= min_scale. Defaults to `2.0**24`.

    Returns:
        The next `LossScaleState`, with the same dtypes.

    Example:

    >>> state = LossScaleState(ops.array(8.0), ops.array(0), ops.array(1),
    ...                        ops.array(0))
    >>> state = update_loss_scale(state, ops.array(False))
    >>> float(state.loss_scale), int(state.skipped_steps)
    (4.0, 1)
    """
    finite = ops.cast(finite, "bool")
    skipped_steps = state.skipped_steps + ops.cast(
        ops.logical_not(finite), state.skipped_steps.dtype
    )
    if not dynamic:
        return state._replace(skipped_steps=skipped_steps)
    good_steps = ops.where(finite, state.good_steps + 1, 0)
    grow = ops.logical_and(finite, good_steps >= growth_interval)
    good_steps = ops.where(grow, 0, good_steps)
    hysteresis_left = ops.where(
        finite,
        ops.where(grow, hysteresis, state.hysteresis_left),
        state.hysteresis_left - 1,
    )
    back_off = ops.logical_and(ops.logical_not(finite), hysteresis_left <= 0)
    loss_scale = state.loss_scale
    loss_scale = ops.where(
        grow,
        ops.minimum(loss_scale * growth_factor, max_scale),
        ops.where(
            back_off, ops.maximum(loss_scale * backoff_factor, min_scale), loss_scale
        ),
    )
    return LossScaleState(
        ops.cast(loss_scale, state.loss_scale.dtype),
        ops.cast(good_steps, state.good_steps.dtype),
        ops.cast(hysteresis_left, state.hysteresis_left.dtype),
        skipped_steps,
    )


# The layout of `LossScaleOptimizer`'s int64 counter vector. From
# "skipped_steps" on, the order is the one `monitor_state` hands the monitor.
COUNTERS = (
    "good_steps",
    "hysteresis_left",
    "skipped_steps",
    "forward_overflows",
    "consecutive_skips",
    "consecutive_forward_overflows",
    "retries",
)

# One step's decision, the same on every replica: whether the gradients and
# the unscaled loss are finite (`finite`), whether the loss is (`loss_finite`),
# and (only while a monitor watches) int64 flags of the variables whose
# gradient is not.
# `retry` (a boolean, or `None` when the step cannot be retried): the
# gradients overflowed, the loss did not, and the caller will redo the batch
# at a lower scale, so it is not a skip.
# `spike` (a boolean, or `None` without `skip_spikes`): the loss was a finite
# outlier (`kmp.scaling._spikes`), so the step is skipped although finite.
# `loss`: the loss the spike rule judged (every replica's sum), recorded in
# its window after the step; `None` without `skip_spikes`.
# `applied`: whether the step is applied: finite, and not a spike.
Decision = collections.namedtuple(
    "Decision",
    ["finite", "loss_finite", "nonfinite_gradients", "retry", "spike", "loss", "applied"],
)


RULE_SETTINGS = ("dynamic", "growth_factor", "backoff_factor", "growth_interval",
                  "hysteresis", "min_scale", "max_scale")


def next_state(loss_scale_before, counters, decision, rule):
    """The scale and every counter after one step (a pure function).

    `update_loss_scale` for the rule's state, plus the diagnostics the
    monitor reads: a forward overflow is a skip whose unscaled loss itself
    was not finite (broken data or model; a lower scale cannot help); any
    other skip is a backward overflow (the scale was too high).

    Returns:
        `(loss_scale, counters)`: the float32 scale and a dict of int64
        scalars keyed by `COUNTERS`.
    """
    state = update_loss_scale(
        LossScaleState(loss_scale_before, counters["good_steps"], counters["hysteresis_left"],
                       counters["skipped_steps"]),
        decision.finite,
        **rule,
    )
    overflow = ops.logical_not(ops.cast(decision.finite, "bool"))
    forward = ops.logical_and(overflow, ops.logical_not(decision.loss_finite))
    skipped_steps = state.skipped_steps
    skipped = overflow
    if decision.spike is not None:
        # A spike's gradients were finite: the scale takes it as a good step,
        # but the step is skipped and counted.
        spiked = ops.logical_and(ops.logical_not(overflow), decision.spike)
        skipped_steps = skipped_steps + ops.cast(spiked, COUNTER_DTYPE)
        skipped = ops.logical_or(overflow, spiked)
    new = dict(
        counters,
        good_steps=state.good_steps,
        hysteresis_left=state.hysteresis_left,
        skipped_steps=skipped_steps,
        forward_overflows=counters["forward_overflows"] + ops.cast(forward, COUNTER_DTYPE),
        consecutive_skips=ops.where(skipped, counters["consecutive_skips"] + 1, 0),
        consecutive_forward_overflows=ops.where(
            forward, counters["consecutive_forward_overflows"] + 1, 0
        ),
    )
    loss_scale = state.loss_scale
    if decision.retry is not None:
        # A retried batch is not dropped: no skip is counted, hysteresis is
        # left as it was, and the scale backs off at once so that the retry
        # can pass.
        for name in ("skipped_steps", "hysteresis_left", "consecutive_skips"):
            new[name] = ops.where(decision.retry, counters[name], new[name])
        new["retries"] = counters["retries"] + ops.cast(decision.retry, COUNTER_DTYPE)
        loss_scale = ops.where(
            decision.retry,
            ops.maximum(loss_scale_before * rule["backoff_factor"], rule["min_scale"]),
            loss_scale,
        )
    counters = new
    return (
        ops.cast(loss_scale, "float32"),
        {name: ops.cast(v, COUNTER_DTYPE) for name, v in counters.items()},
    )
