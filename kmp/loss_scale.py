"""Loss scaling: the scaling rule and the optimizer that applies it.

One order of operations, here and nowhere else:

    scale loss -> gradients -> sum over replicas -> finite check -> unscale ->
    clip the unscaled gradients -> apply or skip -> update the scale

(The finite check reads the scaled gradients: for a scale >= 1 dividing by
it cannot change which values are finite. With `min_scale < 1` the gradients
are unscaled first.) The rule is one pure function, `update_loss_scale`; the
optimizer keeps its state and runs the step. Gradient helpers live in
`kmp/_gradients.py`, replica handling in `kmp/_replicas.py`, gradient
accumulation in `kmp/_accumulation.py`, and how a step's gradients were
made (scaled or not) in `kmp/_loss_record.py`.

Gradients of a loss that was not scaled are never divided. Where a
`tf.GradientTape` computed the gradients and `scale_loss` did not run for the
optimizer in that step (a custom `train_step` or loop that forgot it), they
are applied as they are, non-finite steps are still skipped, and one warning
names the line to add. Gradients made without a tape are taken to be scaled
by hand, as Keras takes them.

With an inner optimizer built with `gradient_accumulation_steps=n`, each
micro-batch is unscaled and summed by the inner optimizer, and the step is
decided once per window: a window with an overflow anywhere is discarded
whole and counted once, and the scale changes only between windows. Clip on
the inner optimizer then.
"""

import collections
import math
import numbers
import os
import sys
import warnings

import keras
import tensorflow as tf
from keras import ops

from kmp import _accumulation
from kmp import _gradients
from kmp import _keras_internals
from kmp import _loss_record
from kmp import _replicas
from kmp._gradients import all_finite  # noqa: F401  (public in this module)
from kmp._gradients import clip_gradients  # noqa: F401  (public in this module)

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
# "skipped_steps" on, the order is the one `_monitor_state` hands the monitor.
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
# gradients overflowed, the loss did not, and `kmp.Model` will redo the batch
# at a lower scale (`compile(overflow_retries=...)`), so it is not a skip.
_Decision = collections.namedtuple(
    "_Decision", ["finite", "loss_finite", "nonfinite_gradients", "retry"], defaults=(None,)
)

_UNSCALED_WARNING = (
    "kmp.LossScaleOptimizer '{name}'{held_as} received gradients of a loss that was "
    "not scaled: a GradientTape computed them, but `scale_loss` did not run "
    "for this optimizer in this step. They are applied as they are (not "
    "divided by the loss scale) and non-finite steps are still skipped, but "
    "small float16 gradients can underflow to zero. Add one line inside the "
    "tape, `scaled_loss = {attribute}.scale_loss(loss)`, and take "
    "`tape.gradient(scaled_loss, ...)` (keep `loss` for your metrics)."
)


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


def _warn_unscaled(optimizer):
    """Warns that `optimizer` got gradients of an unscaled loss, at the user's line.

    Names the model attribute that holds it (a GAN's `d_optimizer`, set by
    kmp.Model): in a traced step, the warning's line is AutoGraph's.
    """
    attribute = getattr(optimizer, "_kmp_attribute", None)
    message = _UNSCALED_WARNING.format(
        name=optimizer.name,
        held_as=f" (the model's `{attribute}`)" if attribute else "",
        attribute=f"self.{attribute}" if attribute else "optimizer",
    )
    warnings.warn(message, stacklevel=_user_stacklevel())


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
        forward_overflows=counters["forward_overflows"] + ops.cast(forward, "int64"),
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
        new["retries"] = counters["retries"] + ops.cast(decision.retry, "int64")
        loss_scale = ops.where(
            decision.retry,
            ops.maximum(loss_scale_before * rule["backoff_factor"], rule["min_scale"]),
            loss_scale,
        )
    counters = new
    return (
        ops.cast(loss_scale, "float32"),
        {name: ops.cast(v, "int64") for name, v in counters.items()},
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


def _check_integer(name, value, minimum):
    # A float with an integer value (2.0) is accepted, as Keras and tf.keras do.
    integral = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and float(value).is_integer()  # False for inf, nan
    )
    if isinstance(value, bool) or not integral or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")


def _check_settings(initial_scale, dynamic, growth_factor, backoff_factor, growth_interval,
                    hysteresis, min_scale, max_scale, clipnorm, global_clipnorm, clipvalue,
                    enabled):
    """Raises `ValueError` naming the first argument that breaks its rule."""
    for arg, value in (
        ("initial_scale", initial_scale), ("min_scale", min_scale), ("max_scale", max_scale)
    ):
        _check_number(arg, value)
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
    _check_integer("growth_interval", growth_interval, 1)
    _check_integer("hysteresis", hysteresis, 1)
    for arg, value in (
        ("clipnorm", clipnorm), ("global_clipnorm", global_clipnorm), ("clipvalue", clipvalue)
    ):
        _check_number(arg, value, allow_none=True)
    if clipnorm is not None and global_clipnorm is not None:
        raise ValueError(
            "At most one of `clipnorm` and `global_clipnorm` can be set. "
            f"Received: clipnorm={clipnorm!r}, global_clipnorm={global_clipnorm!r}"
        )


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


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """An optimizer that scales the loss, skips non-finite steps and clips.

    It wraps any Keras optimizer. `scale_loss(loss)` multiplies the loss by
    the current scale so that small float16 gradients do not underflow;
    `apply(grads, variables)` and `apply_gradients(grads_and_vars)` then run,
    once per step:

    ```
    grads = all_reduce_sum(grads)            # under a tf.distribute strategy
    finite = all(isfinite(g) for g in grads) # on the summed gradients, so
                                             # every replica decides alike
    if finite:
        grads = grads / loss_scale           # unscale
        grads = clip(grads)                  # clipvalue, then clipnorm or
                                             # global_clipnorm, on unscaled grads
        inner_optimizer.apply(grads)         # updates weights, slots, iterations
    # else: weights, slots and iterations are left exactly as they were
    state = update_loss_scale(state, finite) # see `kmp.loss_scale.update_loss_scale`
    ```

    One finite check and one division per gradient, as Keras'
    LossScaleOptimizer; the division happens only on a step that is applied.
    With `min_scale < 1` the gradients are unscaled before the check (a
    division by less than 1 can overflow).

    With `dynamic=True` the scale follows the Megatron-LM rule: after
    `hysteresis` consecutive non-finite steps it is multiplied by
    `backoff_factor`, and after `growth_interval` consecutive finite steps by
    `growth_factor`, always clamped to `[min_scale, max_scale]`. With
    `dynamic=False` the scale stays fixed but non-finite steps are still
    skipped and counted. Under a bfloat16 or float32 policy it works the same
    way (powers of two scale exactly); `enabled=False` makes it a
    pass-through with no change to the code around it.

    Gradients that a `tf.GradientTape` took of a loss that did not go
    through `scale_loss` are never divided by the scale; gradient
    accumulation is decided once per window (see this module's docstring).

    The scale and the counters are variables that checkpoints and `.keras`
    files carry. As a subclass of `keras.optimizers.LossScaleOptimizer`,
    Keras' `fit` on a plain `keras.Model` uses it as it is.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` instance or name (e.g.
            `"adam"`). The optimizer that updates the weights.
        initial_scale: Float. The starting loss scale. Defaults to `2.0**15`.
        dynamic: Bool. Whether the scale adapts. Defaults to `True`.
        growth_factor: Float > 1. Multiplies the scale after
            `growth_interval` finite steps. Defaults to `2.0`.
        backoff_factor: Float in (0, 1). Multiplies the scale after a
            non-finite step once hysteresis is used up. Defaults to `0.5`.
        growth_interval: Int >= 1. Finite steps between growths. Defaults to
            `2000`.
        hysteresis: Int >= 1. Non-finite steps tolerated before backing off;
            refilled at each growth. Defaults to `1`.
        min_scale: Float > 0. Lower bound of the scale. Defaults to `1.0`.
        max_scale: Float > 0. Upper bound of the scale. Defaults to `2.0**24`.
        clipnorm: Optional float > 0. Per-tensor L2-norm clip of the unscaled
            gradients. Defaults to `None`.
        global_clipnorm: Optional float > 0. Global L2-norm clip of the
            unscaled gradients. Defaults to `None`.
        clipvalue: Optional float > 0. Element-wise clip of the unscaled
            gradients, applied before any norm clip. Defaults to `None`.
        enabled: Bool. `False` turns the optimizer into a pass-through:
            `scale_loss` returns the loss unchanged, `apply` hands the
            gradients to the inner optimizer as they are (nothing is checked
            or skipped) and `loss_scale` reads 1. Its variables still exist,
            so checkpoints keep one layout. Defaults to `True`.
        name: Optional string. The optimizer's name.
        dynamic_growth_steps: Optional int >= 1. Keras' name for
            `growth_interval`, accepted so that code written for
            `keras.optimizers.LossScaleOptimizer` runs unchanged. Defaults
            to `None` (use `growth_interval`).

    Raises:
        TypeError: if `inner_optimizer` is not a Keras optimizer.
        ValueError: if `inner_optimizer` is itself a loss-scale optimizer, or
            any other argument breaks its rule. Nothing is changed then.

    Example:

    >>> optimizer = kmp.LossScaleOptimizer("sgd", initial_scale=8.0,
    ...                                    growth_interval=2)
    >>> w = keras.Variable([1.0])
    >>> with tf.GradientTape() as tape:
    ...     loss = optimizer.scale_loss(0.5 * w[0])
    >>> optimizer.apply(tape.gradient(loss, [w]), [w])
    >>> round(float(w[0]), 6), float(optimizer.loss_scale)
    (0.995, 8.0)
    >>> optimizer.apply([ops.array([float("inf")])], [w])  # skipped
    >>> round(float(w[0]), 6), int(optimizer.skipped_steps), float(optimizer.loss_scale)
    (0.995, 1, 4.0)
    """

    def __init__(
        self,
        inner_optimizer,
        *,
        initial_scale=2.0**15,
        dynamic=True,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=_DEFAULT_GROWTH_INTERVAL,
        hysteresis=1,
        min_scale=1.0,
        max_scale=2.0**24,
        clipnorm=None,
        global_clipnorm=None,
        clipvalue=None,
        enabled=True,
        name=None,
        dynamic_growth_steps=None,
    ):
        growth_interval = _growth_interval(growth_interval, dynamic_growth_steps)
        inner_optimizer = _resolve_inner_optimizer(inner_optimizer)
        _check_settings(initial_scale, dynamic, growth_factor, backoff_factor, growth_interval,
                        hysteresis, min_scale, max_scale, clipnorm, global_clipnorm, clipvalue,
                        enabled)
        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=int(growth_interval),
            name=name,
        )
        self.dynamic, self.enabled = dynamic, enabled
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.clipnorm, self.global_clipnorm, self.clipvalue = clipnorm, global_clipnorm, clipvalue
        # Set while a kmp.callbacks.LossScaleMonitor watches training: only
        # then does a traced step record which variables overflowed.
        self._monitored = False
        self._warned_unscaled = False

    @_keras_internals.no_automatic_dependency_tracking
    def build(self, var_list):
        self._loss_scale = _add_state_variable(self, "loss_scale", (), "float32",
                                               self.initial_scale)
        # All the step's counters in one vector (see `_COUNTERS`): one read
        # and one write per step, counted on the device so that they stay
        # exact when one call runs several steps (steps_per_execution > 1).
        initial_counters = [0] * len(_COUNTERS)
        initial_counters[_COUNTERS.index("hysteresis_left")] = self.hysteresis
        self._counters = _add_state_variable(self, "counters", (len(_COUNTERS),), "int64",
                                             initial_counters)
        # 1 for each variable whose gradient overflowed at the latest
        # backward overflow; written only while a monitor asks for it.
        self._nonfinite_gradients = _add_state_variable(
            self, "nonfinite_gradients", (len(var_list),), "int64", 0
        )
        if _accumulation.steps(self):
            self._accumulation_window = _add_state_variable(
                self, "accumulation_window", (2,), "int64", 0
            )
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    # -- read-only state ---------------------------------------------------

    @property
    def loss_scale(self):
        """Float32 scalar: the current loss scale (1 when not `enabled`)."""
        if not self.enabled:
            return ops.convert_to_tensor(1.0, "float32")
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        return tf.identity(self._loss_scale.value)

    @property
    def skipped_steps(self):
        """Int64 scalar: how many steps were skipped in total."""
        return self.counters["skipped_steps"]

    @property
    def counters(self):
        """Dict of int64 scalars, read from the one `counters` variable.

        `good_steps` (finite steps since the last growth or skip),
        `hysteresis_left`, `skipped_steps` (never resets),
        `forward_overflows` (skips whose unscaled loss was not finite),
        `consecutive_skips`, `consecutive_forward_overflows`, and `retries`
        (overflowing batches that `kmp.Model` redid at a lower scale, see
        `compile(overflow_retries=...)`; not counted as skips).
        """
        if not self.built:
            values = [self.hysteresis if name == "hysteresis_left" else 0 for name in _COUNTERS]
            values = ops.convert_to_tensor(values, "int64")
        else:
            values = self._counters.value
        return dict(zip(_COUNTERS, ops.unstack(values)))

    _good_steps = property(lambda self: self.counters["good_steps"])
    _hysteresis_left = property(lambda self: self.counters["hysteresis_left"])
    _forward_overflows = property(lambda self: self.counters["forward_overflows"])

    @property
    def dynamic_scale(self):
        # The name Keras' LossScaleOptimizer gives its scale variable.
        return self._loss_scale

    @property
    def iterations(self):
        """The inner optimizer's step count: applied steps only."""
        return self.inner_optimizer.iterations

    # -- the step ------------------------------------------------------------

    def scale_loss(self, loss):
        """Returns `loss` multiplied by the current loss scale (in float32 or wider).

        Call it inside the `GradientTape`, once per loss, and take the
        gradients of what it returns; `apply` then knows they are scaled.
        """
        if not self.enabled:
            return loss
        _loss_record.record(self, loss)
        return ops.multiply(loss, self.loss_scale)

    def get_scaled_loss(self, loss):
        """tf.keras' name for `scale_loss`; a callable `loss` gives a callable.

        Args:
            loss: A loss tensor, or a zero-argument callable returning one
                (as tf.keras' `minimize` takes).

        Returns:
            `scale_loss(loss)`, or a callable returning `scale_loss(loss())`.
        """
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Returns `grads` divided by the current loss scale (tf.keras' recipe).

        For code written for tf.keras' `LossScaleOptimizer`:
        `get_scaled_loss` inside the tape, `get_unscaled_gradients` on its
        gradients, then `apply_gradients`, which then checks them, skips a
        non-finite step and updates the scale, but does not divide again.
        `None` entries pass through.
        """
        if not self.enabled:
            return list(grads)
        grads = list(grads)
        _loss_record.record_divided(self)
        return _gradients.divide(grads, self.loss_scale, keep=[g is None for g in grads])

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "kmp.LossScaleOptimizer supports the TensorFlow backend, which "
            "does not call `stateless_apply`."
        )

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Checks `grads`, then unscales, clips and applies them, or skips the step.

        Args:
            grads: List of gradients: of `scale_loss(loss)`, or scaled by
                hand; gradients that a `GradientTape` took of an unscaled
                loss are applied unscaled, with a warning (see the class
                docstring).
            trainable_variables: List of variables, or `None` for the ones the
                optimizer was built with.
        """
        trainable_variables = list(
            self._trainable_variables if trainable_variables is None else trainable_variables
        )
        if not self.built:
            # Built outside any tf.function: built inside one, in a replica of
            # MirroredStrategy, the variables' initializers are left as
            # placeholders in a cond ("You must feed a value for placeholder
            # tensor"), as Keras' own Adam and LossScaleOptimizer are.
            with tf.init_scope(), keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads, trainable_variables = self._filter_empty_gradients(list(grads), trainable_variables)
        how, loss = _loss_record.take(self, trainable_variables)
        if not self.enabled:
            self.inner_optimizer.apply(grads, trainable_variables)
            return
        if how == _loss_record.UNSCALED and not self._warned_unscaled:
            self._warned_unscaled = True
            _warn_unscaled(self)
        scaled = how in (_loss_record.SCALED, _loss_record.BY_HAND)
        retries_left = _loss_record.retries_left(self)
        if retries_left is not None:
            _accumulation.refuse_retries(self)
        finite, retry = _replicas.run_step(
            lambda replicas, *args: self._step(
                replicas, *args, scaled=scaled, retries_left=retries_left
            ),
            grads, trainable_variables, loss,
        )
        _loss_record.note_finite(self, finite, retry)

    def _step(self, replicas, grads, variables, loss, *, scaled, retries_left=None):
        """Reduce and decide, then one apply-or-skip dispatch, then the state update.

        Returns the decision: whether this step's (micro-batch's) gradients
        were finite and applied.
        """
        # Unscale before the check only where dividing could overflow.
        unscale_first = scaled and self.min_scale < 1.0
        divisor = self._loss_scale if scaled and not unscale_first else None
        accumulating = bool(_accumulation.steps(self))
        grads, decision = replicas.run(
            self._decide, grads, variables, loss, not accumulating, unscale_first
        )

        def apply_on_replicas():
            replicas.run(self._apply_unscaled, grads, variables, divisor, not accumulating)

        if accumulating:
            # Decided per window, not per micro-batch: see kmp/_accumulation.py.
            _accumulation.step(self, replicas, decision, apply_on_replicas)
            return replicas.first(decision).finite, None
        decision = replicas.first(decision)
        if retries_left is not None and self.dynamic:
            decision = decision._replace(retry=ops.logical_and(
                ops.logical_and(ops.logical_not(decision.finite), decision.loss_finite),
                ops.logical_and(retries_left > 0, self._loss_scale.value > self.min_scale),
            ))
        ops.cond(decision.finite, apply_on_replicas, lambda: None)
        self._update_state(decision)
        return decision.finite, decision.retry

    def _decide(self, grads, variables, loss, reduce, unscale_first):
        """Per replica: the gradients to apply and the step's `_Decision`.

        With `reduce`, the gradients are summed over replicas first (the loss
        flag rides along in the float32 collective), so every replica
        decides on the same values. Dividing by a scale >= 1 cannot change
        which values are finite, so the scaled gradients decide and
        unscaling waits for the branch that applies them.
        """
        loss_nonfinite = None
        if loss is not None:
            loss_nonfinite = ops.cast(ops.logical_not(ops.all(ops.isfinite(loss))), "float32")
        if reduce:
            *grads, loss_nonfinite = _replicas.all_reduce_sum(list(grads) + [loss_nonfinite])
        if unscale_first:
            grads = _gradients.divide(grads, self._loss_scale, self._kept(variables))
        flags = _gradients.finite_flags(grads)
        finite = _gradients.all_true(flags)
        nonfinite_gradients = None
        if self._monitored:
            # Which variables overflowed, from the decision's own flags.
            nonfinite_gradients = ops.cond(
                finite,
                lambda: ops.zeros((len(self._trainable_variables),), "int64"),
                lambda: _gradients.nonfinite_indicator(
                    flags, [self._get_variable_index(v) for v in variables],
                    len(self._trainable_variables),
                ),
            )
        loss_finite = (
            ops.convert_to_tensor(True) if loss_nonfinite is None else ops.equal(loss_nonfinite, 0.0)
        )
        return grads, _Decision(finite, loss_finite, nonfinite_gradients)

    def _kept(self, variables):
        # Variables Keras overwrites with their "gradient" (e.g. a moving
        # statistic) take it as it is.
        return [self._overwrite_variable_with_gradient(v) for v in variables]

    def _apply_unscaled(self, grads, variables, divisor, reduced):
        """Per replica, in the branch that applies: unscale, clip, apply."""
        _replicas.apply_unscaled(
            self.inner_optimizer, grads, variables, divisor=divisor, summed=reduced,
            keep=self._kept(variables),
            clipping=dict(clipvalue=self.clipvalue, clipnorm=self.clipnorm,
                          global_clipnorm=self.global_clipnorm),
        )

    def _update_state(self, decision):
        """The scaling rule and the counters, after one (applied or skipped) step."""
        rule = {name: getattr(self, name) for name in _RULE_SETTINGS}
        scale, counters = _next_state(self._loss_scale.value, self.counters, decision, rule)
        self._loss_scale.assign(scale)
        self._counters.assign(ops.stack([counters[name] for name in _COUNTERS]))
        if decision.nonfinite_gradients is not None:
            # Kept from the latest backward overflow, so that with
            # steps_per_execution > 1 the monitor still sees where it was.
            backward = ops.logical_and(
                ops.logical_not(decision.finite), decision.loss_finite
            )
            self._nonfinite_gradients.assign(
                ops.where(backward, decision.nonfinite_gradients, self._nonfinite_gradients)
            )

    def _monitor_state(self):
        """The tensors `kmp.callbacks.LossScaleMonitor` reads after each step.

        Returns:
            `(counters, nonfinite_gradients)`: an int64 vector `[step,
            skipped_steps, forward_overflows, consecutive_skips,
            consecutive_forward_overflows]` (`step` counts applied and skipped
            steps), and the int64 per-variable flags of the latest backward
            overflow.
        """
        counters = self._counters.value
        skipped = _COUNTERS.index("skipped_steps")
        step = ops.cast(self.iterations, "int64") + counters[skipped]
        retries = _COUNTERS.index("retries")
        monitored = ops.concatenate([ops.reshape(step, (1,)), counters[skipped:retries]])
        return monitored, tf.identity(self._nonfinite_gradients.value)

    # -- serialization -------------------------------------------------------

    def get_config(self):
        config = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
        }
        names = _RULE_SETTINGS + ("clipnorm", "global_clipnorm", "clipvalue", "enabled")
        return dict(config, **{name: getattr(self, name) for name in names})

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # Keras' LossScaleOptimizer (before 3.4) wrote its base optimizer's
        # settings too; at these defaults they mean nothing and are dropped,
        # as Keras' own from_config does.
        for key, default in _KERAS_BASE_DEFAULTS.items():
            if key in config and config[key] == default:
                del config[key]
            elif key in config:
                raise ValueError(
                    f"kmp.LossScaleOptimizer does not take `{key}`: set it on the "
                    f"inner optimizer. Received: {key}={config[key]!r}"
                )
        inner_optimizer = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)
