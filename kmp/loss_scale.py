"""Loss scaling: the scaling rule and the optimizer that applies it.

One order of operations, here and nowhere else:

    scale loss -> gradients -> finite check -> unscale -> clip the unscaled
    gradients -> apply or skip -> update the scale

(The finite check reads the scaled gradients: for a scale >= 1 dividing by
it cannot change which values are finite. With `min_scale < 1` the gradients
are unscaled first.)
"""

import collections
import math
import numbers
import threading

import keras
import tensorflow as tf
from keras import ops

from kmp import _keras_internals

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
)


def _map_gradient(fn, gradient):
    """Applies `fn` to a dense gradient or to the values of a sparse one."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            fn(gradient.values), gradient.indices, gradient.dense_shape
        )
    return fn(gradient)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def all_finite(gradients):
    """Returns a boolean scalar: whether every gradient is free of inf and NaN.

    Args:
        gradients: List of tensors (dense or `tf.IndexedSlices`); `None`
            entries are ignored.

    Returns:
        Boolean scalar tensor.
    """
    return _all_true(_finite_flags(gradients))


def _finite_flags(gradients):
    """One boolean scalar per gradient (`None` for a missing gradient)."""
    return [
        None if g is None else ops.all(ops.isfinite(_values(g))) for g in gradients
    ]


def _all_true(flags):
    flags = [f for f in flags if f is not None]
    if not flags:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(flags))


def _squared_norm(gradient):
    return ops.sum(ops.square(ops.cast(_values(gradient), "float32")))


def clip_gradients(gradients, clipvalue=None, clipnorm=None, global_clipnorm=None):
    """Clips gradients by value, then by per-tensor or global norm.

    Both kinds of clipping only shrink values, so the result meets every
    bound that was asked for. `None` entries pass through.

    Args:
        gradients: List of tensors (dense or `tf.IndexedSlices`) or `None`.
        clipvalue: Optional float > 0. Each element is clipped to
            `[-clipvalue, clipvalue]`.
        clipnorm: Optional float > 0. Each tensor whose L2 norm exceeds it is
            rescaled to that norm.
        global_clipnorm: Optional float > 0. All tensors are rescaled together
            when their joint L2 norm exceeds it.

    Returns:
        The list of clipped gradients.
    """
    if clipvalue is not None:
        gradients = [
            None
            if g is None
            else _map_gradient(lambda v: ops.clip(v, -clipvalue, clipvalue), g)
            for g in gradients
        ]
    if clipnorm is not None:
        gradients = [
            None
            if g is None
            else _map_gradient(
                lambda v: v
                * ops.cast(
                    clipnorm / ops.maximum(ops.sqrt(_squared_norm(v)), clipnorm),
                    v.dtype,
                ),
                g,
            )
            for g in gradients
        ]
    if global_clipnorm is not None:
        present = [g for g in gradients if g is not None]
        if present:
            norm = ops.sqrt(ops.sum(ops.stack([_squared_norm(g) for g in present])))
            factor = global_clipnorm / ops.maximum(norm, global_clipnorm)
            gradients = [
                None
                if g is None
                else _map_gradient(lambda v: v * ops.cast(factor, v.dtype), g)
                for g in gradients
            ]
    return gradients


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
        raise ValueError(
            f"`{name}` must be {rule}{none_note}. Received: {name}={value!r}"
        )


def _check_integer(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )


def _zero_where(condition, gradients):
    """`gradients`, with zeros in place of every value when `condition` is true."""
    return [
        None
        if g is None
        else _map_gradient(lambda t: ops.where(condition, ops.zeros_like(t), t), g)
        for g in gradients
    ]


def _can_skip_inner_all_reduce(inner_optimizer):
    """Whether `inner_optimizer`'s own all-reduce can be turned off (see
    `LossScaleOptimizer._apply_inner`): Keras' TensorFlow optimizers do it in
    `_all_reduce_sum_gradients`. Should Keras rename it, kmp falls back to
    dividing the summed gradients by the number of replicas."""
    return callable(getattr(type(inner_optimizer), "_all_reduce_sum_gradients", None))


_gradients_already_reduced = threading.local()


def _install_all_reduce_switch(inner_optimizer):
    """Makes `inner_optimizer` skip its all-reduce while kmp applies with it."""
    if "_all_reduce_sum_gradients" in vars(inner_optimizer):
        return
    keras_all_reduce = inner_optimizer._all_reduce_sum_gradients

    def all_reduce_sum_gradients(grads_and_vars):
        if getattr(_gradients_already_reduced, "active", False):
            return list(grads_and_vars)
        return keras_all_reduce(grads_and_vars)

    inner_optimizer._all_reduce_sum_gradients = all_reduce_sum_gradients


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


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """An optimizer that scales the loss, skips non-finite steps and clips.

    It wraps any Keras optimizer. `scale_loss(loss)` multiplies the loss by
    the current scale so that small float16 gradients do not underflow;
    `apply(grads, variables)` and `apply_gradients(grads_and_vars)` take the
    resulting **scaled** gradients and run, once per step:

    ```
    grads = all_reduce_sum(grads)            # under a tf.distribute strategy
    finite = all(isfinite(g) for g in grads) # on the scaled gradients: same
                                             # answer as on unscaled ones for a
                                             # scale >= 1, and on every replica
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
    division by less than 1 can overflow). The scale and every counter are
    a float32 variable and one int64 vector variable: checkpoints and
    `.keras` files carry them, and nothing kmp adds lives in host memory on
    a GPU.

    With `dynamic=True` the scale follows the Megatron-LM rule: after
    `hysteresis` consecutive non-finite steps it is multiplied by
    `backoff_factor`, and after `growth_interval` consecutive finite steps by
    `growth_factor`, always clamped to `[min_scale, max_scale]`. With
    `dynamic=False` the scale stays fixed but non-finite steps are still
    skipped and counted.

    With an inner optimizer built with `gradient_accumulation_steps=n`, each
    micro-batch's gradients are checked and unscaled before the inner
    optimizer sums them; an overflow in any micro-batch discards the whole
    accumulated step (counted once in `skipped_steps`, and no inf or NaN
    enters the accumulators), and the scale changes only after a window's
    last micro-batch (see `_accumulate`). Clip on the inner optimizer then.

    It is a subclass of `keras.optimizers.LossScaleOptimizer`, so Keras'
    `fit` on a plain `keras.Model` calls `scale_loss` and `apply_gradients`
    and does not wrap it a second time.

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
        name: Optional string. The optimizer's name.

    Raises:
        TypeError: if `inner_optimizer` is not a Keras optimizer.
        ValueError: if `inner_optimizer` is itself a loss-scale optimizer, or
            any other argument breaks its rule. Nothing is changed then.

    Example:

    >>> optimizer = kmp.LossScaleOptimizer("sgd", initial_scale=8.0,
    ...                                    growth_interval=2)
    >>> w = keras.Variable([1.0])
    >>> optimizer.apply([ops.array([8.0 * 0.5])], [w])  # scaled gradient
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
        growth_interval=2000,
        hysteresis=1,
        min_scale=1.0,
        max_scale=2.0**24,
        clipnorm=None,
        global_clipnorm=None,
        clipvalue=None,
        name=None,
    ):
        inner_optimizer = _resolve_inner_optimizer(inner_optimizer)
        for arg, value in (
            ("initial_scale", initial_scale),
            ("min_scale", min_scale),
            ("max_scale", max_scale),
        ):
            _check_number(arg, value)
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                "The scales must satisfy `min_scale <= initial_scale <= "
                f"max_scale`. Received: min_scale={min_scale!r}, "
                f"initial_scale={initial_scale!r}, max_scale={max_scale!r}"
            )
        if not isinstance(dynamic, bool):
            raise ValueError(f"`dynamic` must be True or False. Received: dynamic={dynamic!r}")
        _check_number("growth_factor", growth_factor, rule="a finite number > 1",
                      predicate=lambda v: v > 1)
        _check_number("backoff_factor", backoff_factor,
                      rule="a number with 0 < backoff_factor < 1",
                      predicate=lambda v: 0 < v < 1)
        _check_integer("growth_interval", growth_interval, 1)
        _check_integer("hysteresis", hysteresis, 1)
        for arg, value in (
            ("clipnorm", clipnorm),
            ("global_clipnorm", global_clipnorm),
            ("clipvalue", clipvalue),
        ):
            _check_number(arg, value, allow_none=True)
        if clipnorm is not None and global_clipnorm is not None:
            raise ValueError(
                "At most one of `clipnorm` and `global_clipnorm` can be set. "
                f"Received: clipnorm={clipnorm!r}, global_clipnorm={global_clipnorm!r}"
            )

        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=int(growth_interval),
            name=name,
        )
        self.dynamic = dynamic
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.clipnorm = clipnorm
        self.global_clipnorm = global_clipnorm
        self.clipvalue = clipvalue
        # Set while a kmp.callbacks.LossScaleMonitor watches training: only
        # then does a traced step record which variables overflowed.
        self._monitored = False

    @_keras_internals.no_automatic_dependency_tracking
    def build(self, var_list):
        # Every replica computes the same values, so any replica's will do.
        # Only float32 and int64 variables: TensorFlow keeps int32 resource
        # variables in host memory on a GPU, where an XLA cluster cannot read
        # them.
        self._loss_scale = self.add_variable(
            shape=(),
            dtype="float32",
            initializer=keras.initializers.Constant(self.initial_scale),
            aggregation="only_first_replica",
            name="loss_scale",
        )
        # All the step's counters in one vector (see `_COUNTERS`): one read
        # and one write per step. Besides the scaling rule's own state, the
        # diagnostics kmp.callbacks.LossScaleMonitor reads; they are counted
        # on the device so that they stay exact when one call to the train
        # function runs several steps (steps_per_execution > 1).
        initial_counters = [0] * len(_COUNTERS)
        initial_counters[_COUNTERS.index("hysteresis_left")] = self.hysteresis
        self._counters = self.add_variable(
            shape=(len(_COUNTERS),),
            dtype="int64",
            initializer=keras.initializers.Constant(initial_counters),
            aggregation="only_first_replica",
            name="counters",
        )
        # 1 for each variable whose gradient overflowed at the latest
        # backward overflow; written only while a monitor asks for it.
        self._nonfinite_gradients = self.add_variable(
            shape=(len(var_list),),
            dtype="int64",
            initializer="zeros",
            aggregation="only_first_replica",
            name="nonfinite_gradients",
        )
        if self._accumulation_steps():
            # Whether the current accumulation window has seen a non-finite
            # gradient, and a non-finite loss (see `_accumulate`).
            self._accumulation_window = self.add_variable(
                shape=(2,),
                dtype="int64",
                initializer="zeros",
                aggregation="only_first_replica",
                name="accumulation_window",
            )
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    # -- read-only state ---------------------------------------------------

    @property
    def loss_scale(self):
        """Float32 scalar: the current loss scale."""
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        return tf.identity(self._loss_scale.value)

    @property
    def skipped_steps(self):
        """Integer scalar: how many steps were skipped in total."""
        return self._counter("skipped_steps")

    def _counter(self, name):
        if not self.built:
            initial = self.hysteresis if name == "hysteresis_left" else 0
            return ops.convert_to_tensor(initial, "int64")
        return self._counters.value[_COUNTERS.index(name)]

    _good_steps = property(lambda self: self._counter("good_steps"))
    _hysteresis_left = property(lambda self: self._counter("hysteresis_left"))
    _forward_overflows = property(lambda self: self._counter("forward_overflows"))

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
        """Returns `loss` multiplied by the current loss scale (in float32 or wider)."""
        return ops.multiply(loss, self.loss_scale)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "kmp.LossScaleOptimizer supports the TensorFlow backend, which "
            "does not call `stateless_apply`."
        )

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None, *, loss=None):
        """Checks `grads`, then unscales, clips and applies them, or skips the step.

        Args:
            grads: List of **scaled** gradients, as computed from
                `scale_loss(loss)`.
            trainable_variables: List of variables, or `None` for the ones the
                optimizer was built with.
            loss: Optional tensor: the step's **unscaled** loss. Only used to
                tell a skipped step's cause apart (see `_update_state`);
                `kmp.Model` passes it. Defaults to `None`.
        """
        grads = list(grads)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads, trainable_variables = self._filter_empty_gradients(
            grads, trainable_variables
        )
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError(
                "`apply()` must be called in a replica context (inside "
                "`strategy.run`), not in a cross-replica context."
            )
        if (
            tf.distribute.has_strategy()
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            tf.distribute.get_replica_context().merge_call(
                self._apply_cross_replica, args=(grads, trainable_variables, loss)
            )
            return
        grads, unscaled, finite, loss_finite, nonfinite_gradients = self._check(
            grads, trainable_variables, loss
        )
        if self._accumulation_steps():
            self._accumulate(
                finite,
                loss_finite,
                nonfinite_gradients,
                lambda zero_out: self._apply_inner(
                    self._unscale_and_clip(
                        _zero_where(zero_out, grads), trainable_variables, unscaled
                    ),
                    trainable_variables,
                ),
            )
            return
        ops.cond(
            finite,
            lambda: self._apply_inner(
                self._unscale_and_clip(grads, trainable_variables, unscaled),
                trainable_variables,
            ),
            lambda: None,
        )
        self._update_state(finite, loss_finite, nonfinite_gradients)

    def _check(self, grads, trainable_variables, loss=None):
        """Per replica: reduce over replicas, then decide whether to apply.

        Returns `(grads, unscaled, finite, loss_finite, nonfinite_gradients)`:
        the (reduced) gradients, whether they are already unscaled, whether
        all are finite, whether `loss` is finite on every replica (`True`
        without a loss), and, only while a monitor asks for it
        (`_monitored`), an int64 vector with a 1 for each of the optimizer's
        variables whose gradient is not finite (else `None`).
        """
        num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        loss_nonfinite = None
        if loss is not None:
            loss_nonfinite = ops.cast(
                ops.logical_not(ops.all(ops.isfinite(loss))), "float32"
            )
        if num_replicas > 1:
            # Decide on the gradients the update will use (the sum over
            # replicas), so that every replica reaches the same decision.
            # The loss flag rides along: one more collective of its own could
            # be ordered differently on each replica.
            extra = [] if loss_nonfinite is None else [loss_nonfinite]
            reduced = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, list(grads) + extra
            )
            grads = reduced[: len(grads)]
            if extra:
                loss_nonfinite = reduced[-1]
        loss_finite = (
            ops.convert_to_tensor(True)
            if loss_nonfinite is None
            else ops.equal(loss_nonfinite, 0.0)
        )
        # Dividing by a scale >= 1 cannot turn a finite value into inf or
        # NaN, nor the reverse: the scaled gradients decide, and unscaling
        # waits for the branch that applies them (as Keras does: no unscaled
        # copy of every gradient outside it). A scale below 1 could overflow
        # while unscaling, so then the unscaled gradients decide.
        unscaled = self.min_scale < 1.0
        if unscaled:
            grads = self._unscale(grads, trainable_variables)
        finite_flags = _finite_flags(grads)
        finite = _all_true(finite_flags)
        nonfinite_gradients = None
        if self._monitored:
            # Which variables overflowed, for the monitor: assembled from the
            # decision's own per-gradient flags, only on skipped steps.
            nonfinite_gradients = ops.cond(
                finite,
                lambda: ops.zeros((len(self._trainable_variables),), "int64"),
                lambda: self._nonfinite_gradient_flags(
                    finite_flags, trainable_variables
                ),
            )
        return grads, unscaled, finite, loss_finite, nonfinite_gradients

    def _unscale(self, grads, trainable_variables, divisor=1):
        scale = self._loss_scale * divisor
        return [
            g
            if self._overwrite_variable_with_gradient(v)
            else _map_gradient(lambda t: t / ops.cast(scale, t.dtype), g)
            for g, v in zip(grads, trainable_variables)
        ]

    def _unscale_and_clip(self, grads, trainable_variables, unscaled=False):
        """The gradients the inner optimizer applies, computed in its branch."""
        num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        if _can_skip_inner_all_reduce(self.inner_optimizer):
            # The inner optimizer will not sum over replicas again (see
            # `_apply_inner`): the reduced gradients are its gradients.
            num_replicas = 1
        clipping = (self.clipvalue, self.clipnorm, self.global_clipnorm) != (None,) * 3
        if not unscaled:
            # Without clipping, one division unscales and, where the inner
            # optimizer sums over replicas again, averages over them.
            divisor = 1 if clipping else num_replicas
            grads = self._unscale(grads, trainable_variables, divisor)
            if not clipping:
                return grads
        grads = clip_gradients(
            grads,
            clipvalue=self.clipvalue,
            clipnorm=self.clipnorm,
            global_clipnorm=self.global_clipnorm,
        )
        if num_replicas > 1:
            grads = [_map_gradient(lambda t: t / num_replicas, g) for g in grads]
        return grads

    def _apply_cross_replica(self, distribution, grads, trainable_variables, loss=None):
        # A strategy that needs merge_call cannot run a cond whose branch calls
        # merge_call (the inner optimizer's apply does) in a replica context:
        # decide here, in the cross-replica context, as Keras does.
        grads, unscaled, finite_per_replica, loss_finite_per_replica, nonfinite = (
            distribution.extended.call_for_each_replica(
                self._check, args=(grads, trainable_variables, loss)
            )
        )
        # Every replica checked the same all-reduced gradients.
        finite, loss_finite = (
            distribution.experimental_local_results(per_replica)[0]
            for per_replica in (finite_per_replica, loss_finite_per_replica)
        )
        if nonfinite is not None:
            nonfinite = distribution.experimental_local_results(nonfinite)[0]

        def apply_on_each_replica():
            def apply_on_replica(grads, trainable_variables):
                self._apply_inner(
                    self._unscale_and_clip(grads, trainable_variables, unscaled),
                    trainable_variables,
                )

            distribution.extended.call_for_each_replica(
                apply_on_replica, args=(grads, trainable_variables)
            )

        if self._accumulation_steps():

            def accumulate_on_each_replica(zero_out):
                def accumulate_on_replica(grads, trainable_variables):
                    self._apply_inner(
                        self._unscale_and_clip(
                            _zero_where(zero_out, grads), trainable_variables, unscaled
                        ),
                        trainable_variables,
                    )

                distribution.extended.call_for_each_replica(
                    accumulate_on_replica, args=(grads, trainable_variables)
                )

            self._accumulate(finite, loss_finite, nonfinite, accumulate_on_each_replica)
            return
        ops.cond(finite, apply_on_each_replica, lambda: None)
        self._update_state(finite, loss_finite, nonfinite)

    # -- gradient accumulation ----------------------------------------------

    def _accumulation_steps(self):
        """The inner optimizer's `gradient_accumulation_steps`, or `None`."""
        steps = getattr(self.inner_optimizer, "gradient_accumulation_steps", None)
        if steps and (
            self.clipvalue is not None
            or self.clipnorm is not None
            or self.global_clipnorm is not None
        ):
            raise ValueError(
                "kmp.LossScaleOptimizer's clipping would clip each micro-batch, "
                "not the accumulated gradients, when the inner optimizer has "
                "`gradient_accumulation_steps`. Set `clipnorm`, "
                "`global_clipnorm` or `clipvalue` on the inner optimizer "
                "instead: it clips the accumulated, unscaled gradients. "
                f"Received: gradient_accumulation_steps={steps}, "
                f"clipvalue={self.clipvalue}, clipnorm={self.clipnorm}, "
                f"global_clipnorm={self.global_clipnorm}"
            )
        return steps

    def _accumulate(self, finite, loss_finite, nonfinite_gradients, apply_inner):
        """One micro-batch of an accumulated step (`gradient_accumulation_steps`).

        ```
        window_finite = finite and no earlier micro-batch of the window overflowed
        if boundary (the window's last micro-batch):
            if window_finite: inner optimizer adds this micro-batch and updates
            else: accumulators reset, inner step count back to the window's start
            state = update_loss_scale(state, window_finite)  # once per window
        else:
            inner optimizer adds this micro-batch (zeros once the window
            overflowed: no inf or NaN ever reaches the accumulators)
        ```

        So the scale is the same for every micro-batch of a window, a window
        with an overflow anywhere is discarded whole and counted once, and
        `iterations` counts applied windows only.

        Args:
            finite, loss_finite, nonfinite_gradients: This micro-batch's
                decision, as from `_check`.
            apply_inner: Callable of a boolean tensor `zero_out`: gives the
                micro-batch's gradients (zeros where `zero_out`) to the inner
                optimizer.
        """
        inner = self.inner_optimizer
        steps = inner.gradient_accumulation_steps
        micro_steps = inner._iterations
        boundary = ops.equal((micro_steps + 1) % steps, 0)
        window = self._accumulation_window.value
        window_finite = ops.logical_and(ops.cast(finite, "bool"), ops.equal(window[0], 0))
        window_loss_finite = ops.logical_and(
            ops.cast(loss_finite, "bool"), ops.equal(window[1], 0)
        )

        def discard():
            inner._backend_reset_gradient_accumulators()
            micro_steps.assign(micro_steps - (steps - 1))

        ops.cond(
            ops.logical_and(boundary, ops.logical_not(window_finite)),
            discard,
            lambda: apply_inner(ops.logical_not(window_finite)),
        )
        ops.cond(
            boundary,
            lambda: self._update_state(window_finite, window_loss_finite, nonfinite_gradients),
            lambda: None,
        )
        self._accumulation_window.assign(
            ops.where(
                boundary,
                ops.zeros((2,), "int64"),
                ops.cast(
                    ops.stack(
                        [ops.logical_not(window_finite), ops.logical_not(window_loss_finite)]
                    ),
                    "int64",
                ),
            )
        )

    def _apply_inner(self, grads, trainable_variables):
        """`inner_optimizer.apply` on gradients already summed over replicas.

        Keras' TensorFlow optimizers all-reduce the gradients in `apply`; kmp
        has done so already (the skip decision needs the sum), so that second
        all-reduce would only cost a round trip. It is turned off for this
        call where Keras allows it (see `_can_skip_inner_all_reduce`);
        otherwise `_unscale_and_clip` divides by the number of replicas so
        that the second sum gives the same gradients.
        """
        inner = self.inner_optimizer
        if not _can_skip_inner_all_reduce(inner):
            inner.apply(grads, trainable_variables)
            return
        _install_all_reduce_switch(inner)
        # Thread-local: MirroredStrategy traces each replica in its own thread.
        _gradients_already_reduced.active = True
        try:
            inner.apply(grads, trainable_variables)
        finally:
            _gradients_already_reduced.active = False

    def _nonfinite_gradient_flags(self, finite_flags, trainable_variables):
        """Int64 vector: 1 at the index of each variable whose gradient is not finite.

        Built from `_finite_flags` (no second pass over the gradients) and
        indexed like the variables the optimizer was built with, so the
        monitor can name them; variables without a gradient count as finite.
        """
        flags = [ops.convert_to_tensor(0, "int64")] * len(self._trainable_variables)
        for finite, variable in zip(finite_flags, trainable_variables):
            if finite is not None:
                flags[self._get_variable_index(variable)] = ops.cast(
                    ops.logical_not(finite), "int64"
                )
        if not flags:
            return ops.zeros((0,), "int64")
        return ops.stack(flags)

    def _update_state(self, finite, loss_finite=True, nonfinite_gradients=None):
        counters = dict(zip(_COUNTERS, ops.unstack(self._counters.value)))
        new_state = update_loss_scale(
            LossScaleState(
                self._loss_scale.value,
                counters["good_steps"],
                counters["hysteresis_left"],
                counters["skipped_steps"],
            ),
            finite,
            dynamic=self.dynamic,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
        )
        skipped = ops.logical_not(ops.cast(finite, "bool"))
        # A forward overflow: the unscaled loss itself was not finite (broken
        # data or model; a lower scale cannot help). Any other skip is a
        # backward overflow: the scale was too high for the gradients.
        forward = ops.logical_and(skipped, ops.logical_not(loss_finite))
        counters.update(
            good_steps=new_state.good_steps,
            hysteresis_left=new_state.hysteresis_left,
            skipped_steps=new_state.skipped_steps,
            forward_overflows=counters["forward_overflows"] + ops.cast(forward, "int64"),
            consecutive_skips=ops.where(skipped, counters["consecutive_skips"] + 1, 0),
            consecutive_forward_overflows=ops.where(
                forward, counters["consecutive_forward_overflows"] + 1, 0
            ),
        )
        self._loss_scale.assign(new_state.loss_scale)
        self._counters.assign(
            ops.stack([ops.cast(counters[name], "int64") for name in _COUNTERS])
        )
        if nonfinite_gradients is not None:
            # Kept from the latest backward overflow, so that with
            # steps_per_execution > 1 the monitor still sees where it was
            # (after a forward overflow every gradient is non-finite anyway).
            self._nonfinite_gradients.assign(
                ops.where(
                    ops.logical_and(skipped, ops.logical_not(forward)),
                    nonfinite_gradients,
                    self._nonfinite_gradients,
                )
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
        monitored = ops.concatenate([ops.reshape(step, (1,)), counters[skipped:]])
        return monitored, tf.identity(self._nonfinite_gradients.value)

    # -- serialization -------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
            "dynamic": self.dynamic,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "clipnorm": self.clipnorm,
            "global_clipnorm": self.global_clipnorm,
            "clipvalue": self.clipvalue,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner_optimizer = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)
