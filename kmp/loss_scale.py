"""Loss scaling: the scaling rule and the optimizer that applies it.

One order of operations, written once (`_step`):

    scale loss -> gradients -> finite check (each replica its own; the
    replicas agree on the flags) -> apply: unscale, clip the whole batch's
    unscaled gradient, then the inner optimizer sums over replicas and
    updates; or skip -> update the scale

The rule is one pure function, `update_loss_scale`; the optimizer keeps its
state and runs the step. Clipping is the inner optimizer's own: `clipnorm`,
`global_clipnorm` and `clipvalue` of the scaler are the inner optimizer's
attributes (read and written there). Under a `tf.distribute` strategy with
several replicas, Keras' optimizer would clip each replica's share before it
sums them; kmp clips the sum instead, as on one replica (see `_step`).

The contract between a train step and its scaler lives on the optimizer, in
`_StepRecord` (one per replica thread: MirroredStrategy traces each replica
in its own thread). `scale_loss` records the loss; `apply` reads and clears
that record, and writes what it decided (applied, finite, retry, loss), which
`kmp.Model`'s train step reads back. Gradients of a loss that did not go
through `scale_loss`:

- inside `kmp.Model`'s train step (a custom `train_step` that forgot it), are
  applied undivided, with one warning naming the line to add;
- anywhere else (a `GradientTape` loop, Keras' own tests scaling by hand),
  are divided, as Keras' LossScaleOptimizer divides them, with one warning.

With an inner optimizer built with `gradient_accumulation_steps=n`, each
micro-batch is unscaled and summed by the inner optimizer, and the step is
decided once per window: a window with an overflow anywhere is discarded
whole and counted once, and the scale changes only between windows.
"""

import collections
import contextlib
import math
import numbers
import os
import sys
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from kmp import _gradients
from kmp import _keras_internals
from kmp import _replicas
from kmp._gradients import all_finite  # noqa: F401  (public in this module)

# The largest values the state variables hold: the scale is float32, the
# counters (`growth_interval`, `hysteresis` among them) int64.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = _gradients.COUNTER_MAX  # int64, or int32 on JAX
_COUNTER_DTYPE = _gradients.COUNTER_DTYPE

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
_COUNTERS = (
    "good_steps",
    "hysteresis_left",
    "skipped_steps",
    "forward_overflows",
    "consecutive_skips",
    "consecutive_forward_overflows",
    "retries",
)

# One step's decision, the same on every replica: whether the gradients are
# finite, whether the unscaled loss is, and (only while a monitor watches)
# int64 flags of the variables whose gradient is not.
# `retry` (a boolean, or `None` when the step cannot be retried): the
# gradients overflowed, the loss did not, and the caller will redo the batch
# at a lower scale, so it is not a skip.
_Decision = collections.namedtuple(
    "_Decision", ["finite", "loss_finite", "nonfinite_gradients", "retry"], defaults=(None,)
)

_UNSCALED_WARNING = (
    "kmp.LossScaleOptimizer '{name}'{held_as} received gradients of a loss that was "
    "not scaled: `scale_loss` did not run for this optimizer in this train step. "
    "They are applied as they are (not divided by the loss scale) and non-finite "
    "steps are still skipped, but small float16 gradients can underflow to zero. "
    "{add_line} (keep `loss` for your metrics)."
)

_DIVIDED_WARNING = (
    "kmp.LossScaleOptimizer '{name}' divided gradients by the loss scale although "
    "`scale_loss` did not run for it since its last `apply`, as Keras' "
    "LossScaleOptimizer does: right for gradients scaled by hand, too small by the "
    "scale for gradients of a loss that was not scaled. Outside `kmp.Model`'s train "
    "step kmp cannot tell them apart. {add_line}."
)

# The line a warning asks for, on each backend (JAX's steps are stateless).
_ADD_LINE = {
    "tensorflow": "Add one line inside the tape, `scaled_loss = {attribute}.scale_loss(loss)`, "
                  "and take `tape.gradient(scaled_loss, ...)`",
    "jax": "Add one line in the function you differentiate, `scaled_loss = "
           "{attribute}.scale_loss(loss)` (in a `jax.grad` loop of your own, outside "
           "kmp.Model's train step: `scaled_loss = {attribute}.stateless_scale_loss("
           "optimizer_variables, loss)`), and differentiate `scaled_loss`",
}

_DEFAULT_GROWTH_INTERVAL = 2000

# Base-optimizer settings in the configs of Keras' LossScaleOptimizer before
# 3.4, at the values it wrote (see `LossScaleOptimizer.from_config`).
_KERAS_BASE_DEFAULTS = {
    "weight_decay": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}

_CLIPPING = ("clipnorm", "global_clipnorm", "clipvalue")


def _check_base_arguments(kwargs):
    """Refuses what the constructor does not take, as Keras' scaler does.

    The base optimizer's other arguments are accepted at their defaults (a
    config of Keras' scaler from before Keras 3.4 carries them all) and
    otherwise refused with a `ValueError` that says where they belong; any
    other name is refused with the list of them.
    """
    for key, default in _KERAS_BASE_DEFAULTS.items():
        if key not in kwargs:
            continue
        value = kwargs.pop(key)
        if value != default:
            raise ValueError(
                f"kmp.LossScaleOptimizer does not take `{key}`: set it on the "
                f"inner optimizer. Received: {key}={value!r}"
            )
    if kwargs:
        raise ValueError(
            "kmp.LossScaleOptimizer does not take the arguments "
            + ", ".join(f"`{key}`" for key in kwargs)
            + ". Received: " + ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
        )

# Where kmp, Keras and TensorFlow live: a warning about the user's code points
# at the first line outside them (`apply_gradients` reaches `apply` through
# Keras, and a train step through Keras' trainer).
_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep for path in (__file__, keras.__file__, tf.__file__)
)


def _user_stacklevel():
    """The `stacklevel` for `warnings.warn` that names the caller's own line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _warn_once(optimizer, template):
    """Warns once per optimizer and message, at the user's line.

    Names the model attribute that holds it (a GAN's `d_optimizer`, set by
    kmp.Model): in a traced step, the warning's line is AutoGraph's.
    """
    if template in optimizer._warned:
        return
    optimizer._warned.add(template)
    attribute = getattr(optimizer, "_kmp_attribute", None)
    attribute = f"self.{attribute}" if attribute else "optimizer"
    add_line = _ADD_LINE.get(keras.backend.backend(), _ADD_LINE["tensorflow"])
    message = template.format(
        name=optimizer.name,
        held_as=f" (the model's `{attribute[5:]}`)" if attribute != "optimizer" else "",
        add_line=add_line.format(attribute=attribute),
    )
    warnings.warn(message, stacklevel=_user_stacklevel())


class _StepRecord(threading.local):
    """What one replica's train step and its scaler tell each other.

    Thread-local and owned by one optimizer: MirroredStrategy traces each
    replica in its own thread, so each replica's step has its own record.

    Written before `apply`: `loss` and `scaled` (by `scale_loss`), `divided`
    (by `get_unscaled_gradients`), `in_model_step`, `retries_left` and
    `defer` (by `kmp.Model`'s train step). `apply` reads and clears the first
    three and writes `applied`, `finite` (boolean tensor: the gradients were
    finite, and applied unless deferred), `retry` (boolean tensor or `None`),
    `last_loss` (the unscaled loss) and, with `defer`, `deferred` (the
    `_DeferredApply` the step applies after its retry loop).
    """

    def __init__(self):
        self.scaled, self.loss, self.divided = False, None, False
        self.in_model_step, self.retries_left = False, None
        self.applied, self.finite, self.retry, self.last_loss = False, None, None, None
        self.defer, self.deferred = False, None

    def __reduce__(self):
        return _StepRecord, ()  # a copy starts with a fresh record

    def begin_model_step(self):
        """Called by `kmp.Model`'s train step before the user's step runs."""
        self.in_model_step, self.applied = True, False

    def take(self):
        """`(scaled, divided, loss)` of the step so far; clears them for the next."""
        taken = (self.scaled, self.divided, _usable_here(self.loss))
        self.scaled, self.loss, self.divided = False, None, False
        return taken


def _usable_here(loss):
    # A loss recorded in another trace (a `tf.function` traced again) is not.
    if loss is None or not tf.is_symbolic_tensor(loss):
        return loss
    graph = _keras_internals.default_graph()
    while graph is not None:
        if graph is loss.graph:
            return loss
        graph = getattr(graph, "outer_graph", None)
    return None


_RULE_SETTINGS = ("dynamic", "growth_factor", "backoff_factor", "growth_interval",
                  "hysteresis", "min_scale", "max_scale")


def _next_state(loss_scale_before, counters, decision, rule):
    """The scale and every counter after one step (a pure function).

    `update_loss_scale` for the rule's state, plus the diagnostics the
    monitor reads: a forward overflow is a skip whose unscaled loss itself
    was not finite (broken data or model; a lower scale cannot help); any
    other skip is a backward overflow (the scale was too high).

    Returns:
        `(loss_scale, counters)`: the float32 scale and a dict of int64
        scalars keyed by `_COUNTERS`.
    """
    state = update_loss_scale(
        LossScaleState(loss_scale_before, counters["good_steps"], counters["hysteresis_left"],
                       counters["skipped_steps"]),
        decision.finite,
        **rule,
    )
    skipped = ops.logical_not(ops.cast(decision.finite, "bool"))
    forward = ops.logical_and(skipped, ops.logical_not(decision.loss_finite))
    new = dict(
        counters,
        good_steps=state.good_steps,
        hysteresis_left=state.hysteresis_left,
        skipped_steps=state.skipped_steps,
        forward_overflows=counters["forward_overflows"] + ops.cast(forward, _COUNTER_DTYPE),
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
        new["retries"] = counters["retries"] + ops.cast(decision.retry, _COUNTER_DTYPE)
        loss_scale = ops.where(
            decision.retry,
            ops.maximum(loss_scale_before * rule["backoff_factor"], rule["min_scale"]),
            loss_scale,
        )
    counters = new
    return (
        ops.cast(loss_scale, "float32"),
        {name: ops.cast(v, _COUNTER_DTYPE) for name, v in counters.items()},
    )


def _check_number(name, value, *, allow_none=False, rule="a finite number > 0",
                  predicate=lambda v: v > 0):
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not predicate(value)
    ):
        none_note = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be {rule}{none_note}. Received: {name}={value!r}")


def _check_scale(name, value):
    # Held in a float32 variable: beyond float32's range it would become inf
    # or 0, and the scaler would divide by it.
    _check_number(name, value, rule=f"a number in (0, {_FLOAT32_MAX:.8g}] (float32)",
                  predicate=lambda v: 0 < v <= _FLOAT32_MAX and np.float32(v) > 0)


def _check_integer(name, value, minimum, maximum=_INT64_MAX):
    # A float with an integer value (2.0) is accepted, as Keras and tf.keras do.
    integral = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and float(value).is_integer()  # False for inf, nan
    )
    if isinstance(value, bool) or not integral or not minimum <= value <= maximum:
        raise ValueError(
            f"`{name}` must be an integer in [{minimum}, {maximum}]. Received: {name}={value!r}"
        )


def _check_settings(initial_scale, dynamic, growth_factor, backoff_factor, growth_interval,
                    hysteresis, min_scale, max_scale, clipping, enabled):
    """Raises `ValueError` naming the first argument that breaks its rule."""
    for arg, value in (
        ("initial_scale", initial_scale), ("min_scale", min_scale), ("max_scale", max_scale)
    ):
        _check_scale(arg, value)
    if not min_scale <= initial_scale <= max_scale:
        raise ValueError(
            "The scales must satisfy `min_scale <= initial_scale <= max_scale`. "
            f"Received: min_scale={min_scale!r}, initial_scale={initial_scale!r}, "
            f"max_scale={max_scale!r}"
        )
    for arg, value in (("dynamic", dynamic), ("enabled", enabled)):
        if not isinstance(value, bool):
            raise ValueError(f"`{arg}` must be True or False. Received: {arg}={value!r}")
    _check_number("growth_factor", growth_factor, rule="a finite number > 1",
                  predicate=lambda v: v > 1)
    _check_number("backoff_factor", backoff_factor,
                  rule="a number with 0 < backoff_factor < 1", predicate=lambda v: 0 < v < 1)
    # Both reach the int64 counters.
    _check_integer("growth_interval", growth_interval, 1)
    _check_integer("hysteresis", hysteresis, 1)
    for arg, value in clipping.items():
        _check_number(arg, value, allow_none=True)
    given = {arg: value for arg, value in clipping.items() if value is not None}
    if len(given) > 1:
        # The inner Keras optimizer clips, and takes one of them (Keras' rule).
        raise ValueError(
            "At most one of `clipnorm`, `global_clipnorm` and `clipvalue` can be set "
            "(the inner Keras optimizer clips, and takes one). Received: "
            + ", ".join(f"{arg}={value!r}" for arg, value in given.items())
        )


def _forward_clipping(inner_optimizer, clipping):
    """Sets the scaler's clipping on the inner optimizer, which clips the
    unscaled gradients. Raises `ValueError` where it clips otherwise."""
    given = {arg: value for arg, value in clipping.items() if value is not None}
    own = {arg: getattr(inner_optimizer, arg, None) for arg in _CLIPPING}
    own = {arg: value for arg, value in own.items() if value is not None}
    if given and own and own != given:
        raise ValueError(
            "The inner optimizer clips already; set clipping on one of the two. Received: "
            + ", ".join(f"{arg}={value!r}" for arg, value in given.items())
            + ", inner_optimizer "
            + ", ".join(f"{arg}={value!r}" for arg, value in own.items())
        )
    for arg, value in given.items():
        setattr(inner_optimizer, arg, value)


def _set_clipping(inner_optimizer, name, value):
    """Sets `inner_optimizer.<name> = value`, one of `_CLIPPING`.

    Raises `ValueError` (and sets nothing) for a value that is not a finite
    number > 0 or `None`, or where the inner optimizer has another of the
    three set (Keras' rule: at most one).
    """
    _check_number(name, value, allow_none=True)
    others = {other: getattr(inner_optimizer, other, None) for other in _CLIPPING if other != name}
    others = {other: v for other, v in others.items() if v is not None}
    if value is not None and others:
        (other, other_value), = others.items()
        raise ValueError(
            "At most one of `clipnorm`, `global_clipnorm` and `clipvalue` can be set (the "
            f"inner Keras optimizer clips, and takes one): set `{other} = None` first. "
            f"Received: {name}={value!r}, with {other}={other_value!r} set"
        )
    setattr(inner_optimizer, name, value)


def _clipping_accessors(name):
    """Getter and setter of the scaler's `name`: the inner optimizer's own,
    one source of truth (a value set after construction clips the next
    traced step, as on a plain Keras optimizer)."""

    def get(self):
        inner = vars(self).get("inner_optimizer")
        return None if inner is None else getattr(inner, name, None)

    def set_(self, value):
        inner = vars(self).get("inner_optimizer")
        if inner is None:
            # Keras' base constructor sets `None` before the inner optimizer
            # exists; the scaler's own are forwarded by `_forward_clipping`.
            if value is not None:
                raise ValueError(
                    f"`{name}` can be set once the inner optimizer is. Received: {name}={value!r}"
                )
            return
        _set_clipping(inner, name, value)

    return get, set_


def _growth_interval(growth_interval, dynamic_growth_steps):
    """`growth_interval`, or Keras' `dynamic_growth_steps` where given."""
    if dynamic_growth_steps is None:
        return growth_interval
    _check_integer("dynamic_growth_steps", dynamic_growth_steps, 1)
    if growth_interval not in (_DEFAULT_GROWTH_INTERVAL, dynamic_growth_steps):
        raise ValueError(
            "`dynamic_growth_steps` is Keras' name for `growth_interval`; pass "
            f"one of them. Received: growth_interval={growth_interval!r}, "
            f"dynamic_growth_steps={dynamic_growth_steps!r}"
        )
    return dynamic_growth_steps


def _resolve_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, str):
        inner_optimizer = keras.optimizers.get(inner_optimizer)
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a loss-scale optimizer "
            f"({type(inner_optimizer).__name__}); scaling twice would square "
            "the scale. Pass its `inner_optimizer` instead. Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance "
            "or the name of one (e.g. 'adam'). Received: "
            f"inner_optimizer={inner_optimizer!r} of type "
            f"{type(inner_optimizer).__name__}"
        )
    return inner_optimizer


def _add_state_variable(optimizer, name, shape, dtype, initial):
    # aggregation="none", as Keras' own scaler: every replica computes the
    # same value and writes its own copy, with no merge_call (see
    # kmp/_replicas.py). Only float32 and int64: TensorFlow keeps int32
    # resource variables in host memory on a GPU, where XLA cannot read them.
    return optimizer.add_variable(
        shape=shape,
        dtype=dtype,
        initializer=keras.initializers.Constant(initial),
        aggregation="none",
        name=name,
    )


def _accumulation_steps(optimizer):
    """The inner optimizer's `gradient_accumulation_steps`, or `None`."""
    return getattr(optimizer.inner_optimizer, "gradient_accumulation_steps", None) or None


def _unscale(optimizer, grads, variables=None, scale=None):
    """`grads` divided by the loss scale (`scale`, or the current one): the
    one place kmp unscales.

    Variables Keras overwrites with their "gradient" (a BatchNormalization
    moving statistic under some layers) take it as it is, as in Keras' scaler.
    """
    keep = None if variables is None else [
        _keras_internals.overwrites_with_gradient(optimizer, v) for v in variables
    ]
    if scale is None:
        scale = optimizer.loss_scale  # one read of the scale, not one per gradient
    return _gradients.divide(grads, scale, keep)


class _DeferredApply:
    """A step's update, checked and decided but not applied yet.

    Under XLA kmp.Model's retry loop (`kmp._train_step._retry_overflows`)
    sets `defer` on the record: each attempt then checks its gradients,
    decides and moves the scale, and leaves its gradients here; the step
    applies the last attempt's once, after the loop. The loop so carries
    gradients (temporaries of every step) instead of the variables: XLA
    gives a loop's and a conditional's outputs buffers of their own, and a
    loop or branch that may write the variables copies them, on every step.

    Attributes:
        grads: List of this replica's gradients, as `apply` received them
            (scaled, unless `min_scale < 1` unscaled them for the check).
        scale: Float32 scalar: the scale they carry.
    """

    def __init__(self, grads, scale, apply):
        self.grads, self.scale, self._apply = grads, scale, apply

    def apply_if(self, finite, grads, scale):
        """Applies `grads` (carrying `scale`) where `finite`: unscaled,
        clipped and applied by the inner optimizer, as `_step` applies.
        The skip is a conditional's empty branch: only there does XLA copy
        the variables."""
        ops.cond(finite, lambda: self._apply(list(grads), scale), lambda: None)


def _step(optimizer, replicas, grads, variables, loss, *, divide, retries_left):
    """One step (or one micro-batch of an accumulated step), written once.

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
    With `min_scale < 1` the gradients are unscaled before the check
    (dividing by less than 1 can overflow); otherwise in the branch that
    applies, as in Keras' scaler.

    Args:
        optimizer: The `LossScaleOptimizer`.
        replicas: Where per-replica work runs (see `kmp._replicas.run_step`).
        grads, variables, loss: This replica's gradients, their variables and
            the unscaled loss (`None` when unknown).
        divide: Bool. Whether the gradients are scaled and must be divided.
        retries_left: Int tensor, or `None`: the retries this batch has left.

    Returns:
        `(finite, retry)`: boolean tensors; `retry` is `None` without retries.
    """
    inner = optimizer.inner_optimizer
    window = _accumulation_steps(optimizer)
    unscale_first = divide and optimizer.min_scale < 1.0
    divide_later = divide and not unscale_first
    monitored = optimizer._monitored
    indices = [_keras_internals.variable_index(optimizer, v) for v in variables] if monitored else []

    def check(grads, variables, loss):
        if unscale_first:
            grads = _unscale(optimizer, grads, variables)
        flags = _gradients.finite_flags(grads)
        finite = _gradients.all_true(flags)
        loss_finite = (ops.convert_to_tensor(True) if loss is None
                       else ops.all(ops.isfinite(loss)))
        if window:
            seen = ops.maximum(
                optimizer._accumulation_window.value,
                ops.cast(ops.logical_not(ops.stack([finite, loss_finite])), _COUNTER_DTYPE),
            )
            optimizer._accumulation_window.assign(seen)
            finite, loss_finite = ops.equal(seen[0], 0), ops.equal(seen[1], 0)
        if not monitored:
            return grads, (finite, loss_finite)
        # Which variables overflowed: this micro-batch's own flags.
        indicator = _gradients.nonfinite_indicator(
            flags, indices, len(_keras_internals.built_variables(optimizer))
        )
        return grads, (finite, loss_finite, indicator)

    def agree(local):
        # Per replica: the step's one collective, of the flags only; none with
        # one replica, and none where all replicas are local (see
        # `kmp._replicas`).
        if _replicas.num_replicas() == 1:
            return local
        bad = _replicas.all_reduce_sum(
            [ops.cast(ops.logical_not(local[0]), "float32"),
             ops.cast(ops.logical_not(local[1]), "float32")]
            + [ops.cast(flags, "float32") for flags in local[2:]]
        )
        return (ops.equal(bad[0], 0.0), ops.equal(bad[1], 0.0)) + tuple(
            ops.cast(ops.greater(flags, 0.0), _COUNTER_DTYPE) for flags in bad[2:]
        )

    grads, local = replicas.run(check, grads, variables, loss)
    reduce = lambda: replicas.agree(local, agree)  # noqa: E731
    if window:
        boundary = ops.equal((_keras_internals.micro_steps(inner) + 1) % window, 0)
        # Mid-window every replica adds its micro-batch: "finite" until the end.
        agreed = ops.cond(boundary, reduce, lambda: tuple(
            ops.ones_like(v) if i < 2 else v for i, v in enumerate(replicas.first(local))
        ))
    else:
        agreed = reduce()
    decision = _Decision(agreed[0], agreed[1], agreed[2] if monitored else None)
    if retries_left is not None and optimizer.dynamic:
        decision = decision._replace(retry=ops.logical_and(
            ops.logical_and(ops.logical_not(decision.finite), decision.loss_finite),
            ops.logical_and(retries_left > 0, optimizer._kmp_scale.value > optimizer.min_scale),
        ))

    # Accumulating, the inner optimizer clips the window's sum, which no
    # single micro-batch holds.
    clip_summed = not window and _clips(inner)

    def apply_unscaled(grads, variables, scale=None):
        if divide_later:
            grads = _unscale(optimizer, grads, variables, scale)
        grads = _replicas.summable(grads)  # before clipping: Keras' global
        if clip_summed:                     # norm refuses mixed dtypes
            grads = _clip_summed(inner, grads, variables)
        inner.apply(grads, variables)

    record = optimizer._kmp_record
    if record.defer and not window:
        # The train step applies once, after its retry loop (see
        # `_DeferredApply`): the scale these gradients carry is kept for it.
        scale = _snapshot(optimizer._kmp_scale.value)
        record.deferred = _DeferredApply(
            list(grads), scale,
            lambda grads, scale: replicas.run(
                lambda grads, variables: apply_unscaled(grads, variables, scale),
                grads, variables,
            ),
        )
        _update_state(optimizer, decision)
        return decision.finite, decision.retry

    def skip():
        if window:  # only reached on a window's last micro-batch: back to its start
            micro_steps = _keras_internals.micro_steps(inner)
            micro_steps.assign(micro_steps - (window - 1))

    ops.cond(decision.finite, lambda: replicas.run(apply_unscaled, grads, variables), skip)
    if not window:
        _update_state(optimizer, decision)
        return decision.finite, decision.retry
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
        _update_state(optimizer, decision)
        optimizer._accumulation_window.assign(ops.zeros((2,), _COUNTER_DTYPE))

    ops.cond(boundary, end_window, lambda: None)
    return decision.finite, decision.retry


def _clips(optimizer):
    """Whether `optimizer` clips (Keras' test: a limit set and > 0)."""
    return any((getattr(optimizer, name, None) or 0) > 0 for name in _CLIPPING)


def _clip_summed(inner, grads, variables):
    """`grads` whose sum over replicas is the clipped sum (see
    `kmp._replicas.clip_summed`); variables Keras overwrites with their
    "gradient" are left as they are, as Keras leaves them out of clipping."""
    clipped = [i for i, v in enumerate(variables)
               if not _keras_internals.overwrites_with_gradient(inner, v)]
    shares = _replicas.clip_summed(
        [grads[i] for i in clipped], lambda total: _keras_internals.clip_gradients(inner, total)
    )
    grads = list(grads)
    for i, share in zip(clipped, shares):
        grads[i] = share
    return grads


def _update_state(optimizer, decision):
    """The scaling rule and the counters, after one (applied or skipped) step."""
    rule = {name: getattr(optimizer, name) for name in _RULE_SETTINGS}
    scale, counters = _next_state(optimizer._kmp_scale.value, optimizer.counters, decision, rule)
    optimizer._kmp_scale.assign(scale)
    optimizer._counters.assign(ops.stack([counters[name] for name in _COUNTERS]))
    if decision.nonfinite_gradients is not None:
        # Kept from the latest backward overflow, so that with
        # steps_per_execution > 1 the monitor still sees where it was.
        backward = ops.logical_and(ops.logical_not(decision.finite), decision.loss_finite)
        flags = optimizer._nonfinite_gradients
        flags.assign(ops.where(backward, decision.nonfinite_gradients, flags))


_ON_TENSORFLOW = keras.backend.backend() == "tensorflow"


# --- JAX: the step as a pure function of values ---------------------------

def _values(variables):
    return [v.value for v in variables]


def _check_jax_buildable(optimizer):
    steps = _accumulation_steps(optimizer)
    if steps:
        raise ValueError(
            "On the JAX backend kmp.LossScaleOptimizer does not combine with the inner "
            "optimizer's `gradient_accumulation_steps` (a window with an overflow cannot be "
            "discarded whole there). Use the TensorFlow backend, or a larger batch. "
            f"Received: gradient_accumulation_steps={steps}"
        )


def _stateless_step(optimizer, optimizer_variables, grads, trainable_variables, *, loss=None,
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
        `(new_trainable_values, new_optimizer_values, finite)`.
    """
    inner = optimizer.inner_optimizer  # built: `build` refused accumulation on JAX
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
    grads, divide, flags, decision = _stateless_check(optimizer, grads, built, scale, loss, divide)
    inner_ids = {id(v) for v in inner.variables}
    inner_values = [value for variable, value in mapping if id(variable) in inner_ids]

    def apply():
        # Unscaled in the branch that applies (as in `_step`): XLA fuses the
        # division into the update. Non-finite gradients never get here.
        unscaled = _stateless_divide(optimizer, grads, built, scale) if divide else grads
        return inner.stateless_apply(inner_values, unscaled, list(trainable_variables))

    def skip():
        return list(trainable_variables), inner_values

    new_trainable, new_inner = ops.cond(decision.finite, apply, skip)
    own = _stateless_state(optimizer, scale, counters, flags_before, decision)
    new_inner = iter(new_inner)
    new_values = []
    for variable, value in mapping:
        if id(variable) in inner_ids:
            new_values.append(next(new_inner))
        else:
            new_values.append(own.get(id(variable), value))
    return list(new_trainable), new_values, decision.finite


def _stateless_check(optimizer, grads, built, scale, loss, divide):
    """The finiteness decision of a step, from values.

    Returns:
        `(grads, divide, flags, decision)`: the gradients (unscaled already
        where `min_scale < 1`, and then `divide` is `False`), the
        per-gradient finite flags and the step's `_Decision`.
    """
    grads = list(grads)
    if optimizer.min_scale < 1.0 and divide:
        # Dividing by less than 1 can overflow: check after unscaling.
        grads, divide = _stateless_divide(optimizer, grads, built, scale), False
    flags = _gradients.finite_flags(grads)
    finite = _gradients.all_true(flags)
    loss_finite = ops.convert_to_tensor(True) if loss is None else ops.all(ops.isfinite(loss))
    nonfinite = None
    if optimizer._monitored:
        indices = [_keras_internals.variable_index(optimizer, v) for v in built]
        nonfinite = _gradients.nonfinite_indicator(flags, indices, len(built))
    return grads, divide, flags, _Decision(finite, loss_finite, nonfinite)


def _stateless_state(optimizer, scale, counters, flags_before, decision):
    """The scaler's own variables after a step: `{id(variable): new value}`."""
    rule = {name: getattr(optimizer, name) for name in _RULE_SETTINGS}
    new_scale, new_counters = _next_state(scale, counters, decision, rule)
    own = {
        id(optimizer._kmp_scale): new_scale,
        id(optimizer._counters): ops.stack([new_counters[name] for name in _COUNTERS]),
    }
    if optimizer._monitored:
        backward = ops.logical_and(ops.logical_not(decision.finite), decision.loss_finite)
        own[id(optimizer._nonfinite_gradients)] = ops.where(
            backward, decision.nonfinite_gradients, flags_before
        )
    return own


def _stateless_divide(optimizer, grads, variables, scale):
    # Variables Keras overwrites with their "gradient" are judged by the
    # variable, not its value (keras-team/keras#21706).
    keep = [_keras_internals.overwrites_with_gradient(optimizer, v) for v in variables]
    if len(keep) != len(grads):
        keep = None
    return _gradients.divide(grads, scale, keep)


def _jax_apply(optimizer, grads, trainable_variables, divide):
    """`LossScaleOptimizer.apply` on JAX: the pure step, then assigned.

    The step runs over every variable the optimizer was built with; those
    not among `trainable_variables` (or whose gradient was `None`, filtered
    out before) get a `None` gradient, which the inner optimizer leaves
    alone, as Keras' `apply` leaves them.

    Returns:
        Boolean scalar: whether the step was applied.
    """
    built = _keras_internals.built_variables(optimizer)
    positions = {id(v): i for i, v in enumerate(built)}
    unknown = [v for v in trainable_variables if id(v) not in positions]
    if unknown:
        raise ValueError(
            "kmp.LossScaleOptimizer.apply takes only variables it was built with. "
            f"Received: {len(unknown)} other variable(s), the first "
            f"{getattr(unknown[0], 'path', unknown[0])!r}; built with {len(built)}"
        )
    all_grads = [None] * len(built)
    for grad, variable in zip(grads, trainable_variables):
        all_grads[positions[id(variable)]] = grad
    if not _traced(all_grads):
        return _jax_apply_eagerly(optimizer, all_grads, built, trainable_variables, divide)
    new_trainable, new_values, finite = _stateless_step(
        optimizer, _values(optimizer.variables), all_grads, _values(built), divide=divide,
    )
    for variable in trainable_variables:
        variable.assign(new_trainable[positions[id(variable)]])
    for variable, value in zip(optimizer.variables, new_values):
        variable.assign(value)
    return finite


def _traced(values):
    import jax

    return any(isinstance(value, jax.core.Tracer) for value in values)


def _jax_apply_eagerly(optimizer, all_grads, built, trainable_variables, divide):
    """`apply` on JAX outside a trace: decided on the host, then the inner
    optimizer's own `apply` updates the variables, as Keras' scaler does (a
    sparse gradient then reaches the inner optimizer's `assign_sub` as it
    is); the scaler's own variables take the same rule as the pure step."""
    scale = optimizer._kmp_scale.value
    grads, divide, _, decision = _stateless_check(
        optimizer, all_grads, built, scale, None, divide
    )
    finite = bool(decision.finite)
    if finite:
        unscaled = _stateless_divide(optimizer, grads, built, scale) if divide else grads
        by_id = {id(v): g for v, g in zip(built, unscaled)}
        optimizer.inner_optimizer.apply(
            [by_id[id(v)] for v in trainable_variables], trainable_variables
        )
    own = _stateless_state(
        optimizer, scale, optimizer.counters, optimizer._nonfinite_gradients.value, decision
    )
    for variable in optimizer.variables:
        if id(variable) in own:
            variable.assign(own[id(variable)])
    return ops.convert_to_tensor(finite)


def _snapshot(value):
    """A variable's value that later assignments leave as it is."""
    return tf.identity(value) if _ON_TENSORFLOW else value  # JAX arrays never change


def _outside_functions():
    return tf.init_scope() if _ON_TENSORFLOW else contextlib.nullcontext()


def monitor_state(optimizer):
    """`(counters, nonfinite_gradients)` for `kmp.callbacks.LossScaleMonitor`:
    `[step, skipped_steps, forward_overflows, consecutive_skips,
    consecutive_forward_overflows]` (`step` counts applied and skipped
    steps), and the per-variable flags of the latest backward overflow."""
    counters = optimizer._counters.value
    skipped, retries = _COUNTERS.index("skipped_steps"), _COUNTERS.index("retries")
    step = ops.cast(optimizer.iterations, _COUNTER_DTYPE) + counters[skipped]
    monitored = ops.concatenate([ops.reshape(step, (1,)), counters[skipped:retries]])
    return monitored, _snapshot(optimizer._nonfinite_gradients.value)


def _take_record(optimizer):
    """`(divide, loss)` from what `scale_loss` recorded since the last apply.

    Clears the record; warns once where no loss went through `scale_loss`:
    inside kmp.Model's train step such gradients are applied undivided,
    elsewhere divided (as Keras' LossScaleOptimizer divides them).
    """
    record = optimizer._kmp_record
    scaled, divided, loss = record.take()
    record.applied, record.last_loss = True, loss
    if not (scaled or divided):
        _warn_once(optimizer, _UNSCALED_WARNING if record.in_model_step else _DIVIDED_WARNING)
    return not divided and (scaled or not record.in_model_step), loss


def _as_values(values):
    """`values` with each `keras.Variable` replaced by its value: a pure step
    takes arrays, and Keras' optimizers take `optimizer.variables` as well."""
    return [v.value if isinstance(v, keras.Variable) else v for v in values]


def _stateless_apply(optimizer, optimizer_variables, grads, trainable_variables):
    """`LossScaleOptimizer.stateless_apply` (see `_stateless_step`)."""
    if not optimizer.built:
        raise ValueError(
            f"To call `stateless_apply`, {type(optimizer).__name__} must be built: "
            "call `optimizer.build(trainable_variables)` first."
        )
    optimizer_variables = _as_values(optimizer_variables)
    trainable_variables = _as_values(trainable_variables)
    if not optimizer.enabled:
        return _stateless_pass_through(optimizer, optimizer_variables, grads, trainable_variables)
    divide, _ = _take_record(optimizer)
    # A loss recorded in a traced function must not outlive its trace.
    optimizer._kmp_record.last_loss = None
    new_trainable, new_values, _ = _stateless_step(
        optimizer, optimizer_variables, grads, trainable_variables, divide=divide
    )
    return new_trainable, new_values


def _stateless_pass_through(optimizer, optimizer_variables, grads, trainable_variables):
    """`stateless_apply` of a scaler with `enabled=False`: the inner optimizer's."""
    own = len(optimizer.variables) - len(optimizer.inner_optimizer.variables)
    new_trainable, new_inner = optimizer.inner_optimizer.stateless_apply(
        list(optimizer_variables[own:]), grads, trainable_variables
    )
    return new_trainable, list(optimizer_variables[:own]) + list(new_inner)


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """An optimizer that scales the loss and skips non-finite steps.

    It wraps any Keras optimizer. `scale_loss(loss)` multiplies the loss by
    the current scale so that small float16 gradients do not underflow;
    `apply(grads, variables)` and `apply_gradients(grads_and_vars)` then run,
    once per step (see `kmp.loss_scale._step`):

    ```
    finite = all(isfinite(g) for g in grads) # on every replica, agreed in
                                             # one small collective
    if finite:
        grads = grads / loss_scale
        if clipping and replicas > 1:        # tf.distribute, several replicas
            grads = clip(all_reduce_sum(grads)) / replicas  # one collective more
        inner_optimizer.apply(grads)         # clips, sums over replicas,
                                             # updates weights, slots, iterations
    # else: weights, slots and iterations are left exactly as they were
    state = update_loss_scale(state, finite) # see `update_loss_scale`
    ```

    With `dynamic=True` the scale follows the Megatron-LM rule: after
    `hysteresis` consecutive non-finite steps it is multiplied by
    `backoff_factor`, and after `growth_interval` consecutive finite steps by
    `growth_factor`, clamped to `[min_scale, max_scale]`. With
    `dynamic=False` the scale stays fixed but non-finite steps are still
    skipped and counted. `enabled=False` makes it a pass-through.

    Gradients of a loss that did not go through `scale_loss` are never
    divided inside `kmp.Model`'s train step, and divided as Keras divides
    them elsewhere, with a warning either way (see this module's docstring).
    On JAX, `stateless_apply` and `stateless_scale_loss` are the same step as
    pure functions of values. Checkpoints and `.keras` files carry the state.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` instance or name (e.g.
            `"adam"`). The optimizer that updates the weights.
        initial_scale: Float in (0, float32 max]. The starting loss scale.
            Defaults to `2.0**15`.
        dynamic: Bool. Whether the scale adapts. Defaults to `True`.
        growth_factor: Float > 1. Defaults to `2.0`.
        backoff_factor: Float in (0, 1). Defaults to `0.5`.
        growth_interval: Int in [1, 2**63 - 1]. Finite steps between growths.
            Defaults to `2000`.
        hysteresis: Int in [1, 2**63 - 1]. Non-finite steps tolerated before
            backing off; refilled at each growth. Defaults to `1`.
        min_scale: Float in (0, float32 max]. Defaults to `1.0`.
        max_scale: Float in (0, float32 max]. Defaults to `2.0**24`.
        clipnorm, global_clipnorm, clipvalue: Optional float > 0, at most one.
            Set on the inner optimizer, which clips the unscaled gradients
            (Keras' own scaler asks for them there); the scaler's attributes
            of these names read and write the inner optimizer's. Under a
            strategy with several replicas the whole batch's gradient is
            clipped, as on one replica. Defaults to `None`.
        enabled: Bool. `False`: `scale_loss` returns the loss unchanged and
            `apply` hands the gradients to the inner optimizer as they are;
            the variables still exist. Defaults to `True`.
        name: Optional string. The optimizer's name.
        dynamic_growth_steps: Optional int. Keras' name for `growth_interval`.

    Raises:
        TypeError: if `inner_optimizer` is not a Keras optimizer.
        ValueError: if `inner_optimizer` is itself a loss-scale optimizer, any
            other argument breaks its rule, or an argument is not one of the
            above (the base optimizer's `weight_decay`, `use_ema`, ... other
            than at their defaults: set them on the inner optimizer).

    Example:

    >>> optimizer = kmp.LossScaleOptimizer("sgd", initial_scale=8.0,
    ...                                    growth_interval=2)
    >>> w = keras.Variable([1.0])
    >>> with tf.GradientTape() as tape:
    ...     loss = optimizer.scale_loss(0.5 * w[0])
    >>> bool(optimizer.apply(tape.gradient(loss, [w]), [w]))  # applied
    True
    >>> round(float(w[0]), 6), float(optimizer.loss_scale)
    (0.995, 8.0)
    >>> with tf.GradientTape() as tape:
    ...     loss = optimizer.scale_loss(w[0] * float("inf"))
    >>> bool(optimizer.apply(tape.gradient(loss, [w]), [w]))  # skipped
    False
    >>> round(float(w[0]), 6), int(optimizer.skipped_steps), float(optimizer.loss_scale)
    (0.995, 1, 4.0)
    """

    def __init__(self, inner_optimizer, *, initial_scale=2.0**15, dynamic=True,
                 growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=_DEFAULT_GROWTH_INTERVAL, hysteresis=1, min_scale=1.0,
                 max_scale=2.0**24, clipnorm=None, global_clipnorm=None, clipvalue=None,
                 enabled=True, name=None, dynamic_growth_steps=None, **kwargs):
        _check_base_arguments(kwargs)
        growth_interval = _growth_interval(growth_interval, dynamic_growth_steps)
        inner_optimizer = _resolve_inner_optimizer(inner_optimizer)
        clipping = dict(clipnorm=clipnorm, global_clipnorm=global_clipnorm, clipvalue=clipvalue)
        _check_settings(initial_scale, dynamic, growth_factor, backoff_factor, growth_interval,
                        hysteresis, min_scale, max_scale, clipping, enabled)
        _forward_clipping(inner_optimizer, clipping)
        super().__init__(inner_optimizer, initial_scale=float(initial_scale),
                         dynamic_growth_steps=int(growth_interval), name=name)
        self.dynamic, self.enabled = dynamic, enabled
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        # Set while a kmp.callbacks.LossScaleMonitor watches training: only
        # then does a traced step record which variables overflowed.
        self._monitored = False
        object.__setattr__(self, "_warned", set())
        object.__setattr__(self, "_kmp_record", _StepRecord())

    @_keras_internals.no_automatic_dependency_tracking
    def build(self, var_list):
        self._kmp_scale = _add_state_variable(self, "loss_scale", (), "float32",
                                               self.initial_scale)
        # All the step's counters in one vector (see `_COUNTERS`): one read
        # and one write per step, counted on the device.
        initial_counters = [0] * len(_COUNTERS)
        initial_counters[_COUNTERS.index("hysteresis_left")] = self.hysteresis
        self._counters = _add_state_variable(self, "counters", (len(_COUNTERS),), _COUNTER_DTYPE,
                                             initial_counters)
        # 1 for each variable whose gradient overflowed at the latest
        # backward overflow; written only while a monitor asks for it.
        self._nonfinite_gradients = _add_state_variable(
            self, "nonfinite_gradients", (len(var_list),), _COUNTER_DTYPE, 0
        )
        if not _ON_TENSORFLOW:
            _check_jax_buildable(self)
        if _accumulation_steps(self):
            self._accumulation_window = _add_state_variable(
                self, "accumulation_window", (2,), _COUNTER_DTYPE, 0
            )
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def loss_scale(self):
        """Float32 scalar: the current loss scale (1 when not `enabled`)."""
        if not self.enabled:
            return ops.convert_to_tensor(1.0, "float32")
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        return _snapshot(self._kmp_scale.value)

    @property
    def skipped_steps(self):
        """Int64 scalar: how many steps were skipped in total."""
        return self.counters["skipped_steps"]

    @property
    def counters(self):
        """Dict of int64 scalars, read from the one `counters` variable.

        `good_steps`, `hysteresis_left`, `skipped_steps` (never resets),
        `forward_overflows` (skips whose unscaled loss was not finite),
        `consecutive_skips`, `consecutive_forward_overflows`, and `retries`
        (overflowing batches redone at a lower scale; not counted as skips).
        """
        if not self.built:
            values = [self.hysteresis if name == "hysteresis_left" else 0 for name in _COUNTERS]
            values = ops.convert_to_tensor(values, _COUNTER_DTYPE)
        else:
            values = self._counters.value
        return dict(zip(_COUNTERS, ops.unstack(values)))

    _good_steps = property(lambda self: self.counters["good_steps"])
    _hysteresis_left = property(lambda self: self.counters["hysteresis_left"])
    _forward_overflows = property(lambda self: self.counters["forward_overflows"])
    # The name Keras' LossScaleOptimizer gives its scale variable.
    dynamic_scale = property(lambda self: self._kmp_scale)

    # The inner optimizer's, read and written there (`_clipping_accessors`).
    clipnorm = property(*_clipping_accessors("clipnorm"))
    global_clipnorm = property(*_clipping_accessors("global_clipnorm"))
    clipvalue = property(*_clipping_accessors("clipvalue"))

    @property
    def iterations(self):
        """The inner optimizer's step count: applied steps only."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        """Returns `loss` times the current loss scale (in float32 or wider).

        Call it inside the `GradientTape`, once per loss, and take the
        gradients of what it returns; `apply` then knows they are scaled.
        """
        if not self.enabled:
            return loss
        self._kmp_record.scaled, self._kmp_record.loss = True, loss
        return ops.multiply(loss, self.loss_scale)

    def get_scaled_loss(self, loss):
        """tf.keras' name for `scale_loss`; a callable `loss` gives a callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Returns `grads` divided by the current loss scale (tf.keras' recipe).

        `apply_gradients` then checks them, skips a non-finite step and
        updates the scale, but does not divide again. `None` entries pass.
        """
        if not self.enabled:
            return list(grads)
        self._kmp_record.divided = True
        return _unscale(self, list(grads))

    def stateless_scale_loss(self, optimizer_variables, loss):
        """`scale_loss`, reading the scale from `optimizer_variables` (the
        values of `self.variables` a stateless JAX step carries): the one
        line of a custom JAX `train_step` or `jax.grad` loss (docs/jax.md)."""
        if not (self.enabled and self.built):
            return self.scale_loss(loss)
        with keras.StatelessScope(state_mapping=list(zip(self.variables, optimizer_variables))):
            return self.scale_loss(loss)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """`apply` as a pure function of values, as Keras' JAX trainer calls it.

        Returns `(new_trainable_values, new_optimizer_values)`; a skipped step
        gives the weights and the inner optimizer's values back as they were.
        """
        return _stateless_apply(self, optimizer_variables, grads, trainable_variables)

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Checks `grads`, then unscales and applies them, or skips the step.

        Args:
            grads: List of gradients of `scale_loss(loss)` (or scaled by hand).
            trainable_variables: List of variables, or `None` for the ones the
                optimizer was built with.

        Returns:
            Boolean scalar tensor: whether the step was applied. A loop can
            redo a skipped batch (the scale has backed off already):
            `if not optimizer.apply(grads): ...`.
        """
        trainable_variables = list(
            _keras_internals.built_variables(self) if trainable_variables is None else trainable_variables
        )
        if not self.built:
            # Built outside any tf.function: built inside one, in a replica of
            # MirroredStrategy, the variables' initializers are left as
            # placeholders in a cond, as Keras' own Adam's are.
            with _outside_functions(), keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads, trainable_variables = _keras_internals.filter_empty_gradients(
            self, list(grads), trainable_variables
        )
        if not self.enabled:
            self._kmp_record.take()
            self.inner_optimizer.apply(grads, trainable_variables)
            return ops.convert_to_tensor(True)
        record = self._kmp_record
        divide, loss = _take_record(self)
        retries_left = record.retries_left
        if retries_left is not None and _accumulation_steps(self):
            raise ValueError(
                "`overflow_retries` cannot be combined with the inner optimizer's "
                "`gradient_accumulation_steps` (a retry would redo one micro-batch "
                f"of a window). Received: gradient_accumulation_steps={_accumulation_steps(self)}"
            )
        if not _ON_TENSORFLOW:  # one pure step, then assigned (see `_stateless_step`)
            record.finite, record.retry = _jax_apply(self, grads, trainable_variables, divide), None
            return record.finite
        record.finite, record.retry = _replicas.run_step(
            lambda replicas, *args: _step(self, replicas, *args, divide=divide,
                                          retries_left=retries_left),
            grads, trainable_variables, loss,
        )
        return record.finite

    def get_config(self):
        config = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
        }
        names = _RULE_SETTINGS + _CLIPPING + ("enabled",)
        return dict(config, **{name: getattr(self, name) for name in names})

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # Keras' LossScaleOptimizer (before 3.4) wrote its base optimizer's
        # settings too; at these defaults they mean nothing and are dropped,
        # as Keras' own from_config does.
        inner_optimizer = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)
