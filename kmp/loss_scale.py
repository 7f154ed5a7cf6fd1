"""Loss scaling: the scaling rule and the optimizer that applies it.

One order of operations, written once:

    scale loss -> gradients -> finite check (each replica its own; the
    replicas agree on the flags) -> apply: unscale, clip the whole batch's
    unscaled gradient, then the inner optimizer sums over replicas and
    updates; or skip -> update the scale

This module holds what a user sees: the rule, `update_loss_scale` (a pure
function; `kmp.scaling._rule`), and `LossScaleOptimizer`, which keeps the
scaler's state in its variables and hands each `apply` to the backend's step
(`kmp/backends/<backend>/step.py`, built from the parts both backends share
in `kmp.scaling._step`). What a train step tells the scaler and what the
scaler answers is `kmp.scaling._handoff`'s, in one place; the constructor's checks
are `kmp.scaling._settings`'.

Clipping is the inner optimizer's own: `clipnorm`, `global_clipnorm` and
`clipvalue` of the scaler are the inner optimizer's attributes (read and
written there). Under a `tf.distribute` strategy with several replicas,
Keras' optimizer would clip each replica's share before it sums them; kmp
clips the sum instead, as on one replica.

With an inner optimizer built with `gradient_accumulation_steps=n`, each
micro-batch is unscaled and summed by the inner optimizer, and the step is
decided once per window: a window with an overflow anywhere is discarded
whole and counted once, and the scale changes only between windows.
"""

import keras
from keras import ops

from kmp import _keras_internals
from kmp import _registered
from kmp import backends
from kmp.scaling import _handoff
from kmp.scaling import _rule as _scaling_rule
from kmp.scaling import _settings as settings
from kmp.scaling import _spikes
from kmp.scaling import _step as _scaling_step
from kmp.scaling._gradients import all_finite  # noqa: F401  (public in this module)
from kmp.scaling._rule import LossScaleState  # noqa: F401  (public in this module)
from kmp.scaling._rule import update_loss_scale  # noqa: F401  (public in this module)

_COUNTERS = _scaling_rule.COUNTERS
_COUNTER_DTYPE = _scaling_rule.COUNTER_DTYPE


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """An optimizer that scales the loss and skips non-finite steps.

    It wraps any Keras optimizer. `scale_loss(loss)` multiplies the loss by
    the current scale so that small float16 gradients do not underflow;
    `apply(grads, variables)` and `apply_gradients(grads_and_vars)` then run,
    once per step (see `kmp.backends.tensorflow.step`):

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

    With `dynamic=True` the scale follows the Megatron-LM rule: times
    `backoff_factor` after `hysteresis` consecutive non-finite steps, times
    `growth_factor` after `growth_interval` finite ones, within `[min_scale,
    max_scale]`. `dynamic=False` fixes it (non-finite steps are still skipped
    and counted); `enabled=False` makes the optimizer a pass-through.

    Gradients of a loss that skipped `scale_loss` are not divided in kmp.Model's
    step, and divided elsewhere as Keras does, with a warning (`scaling._handoff`).
    `stateless_apply` and `stateless_scale_loss` are the step for JAX.

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
            Set on (and read from) the inner optimizer, which clips the
            unscaled gradients, as Keras' own scaler asks; under a strategy
            the whole batch's gradient is clipped. Defaults to `None`.
        enabled: Bool. `False`: a pass-through (its variables still exist).
            Defaults to `True`.
        skip_spikes: Optional float > 0. Also skip a step whose loss is more
            than this many standard deviations above the mean of the last
            `spike_window` finite losses, once `spike_warmup` were seen
            (OLMo-core's rule), decided on the device. kmp.Model's step passes
            the loss, a custom step `scale_loss`. Defaults to `None` (off).
        spike_window: Int in [2, 65536]. Defaults to `128`.
        spike_warmup: Int >= 2. Defaults to `64`.
        compensation: For 16-bit weights: `"kahan"` (a buffer keeps what
            rounding the float32 update loses) or `"stochastic"` (rounded up
            or down at random, no buffer). Defaults to `"kahan"`.
        name: Optional string. The optimizer's name.
        dynamic_growth_steps: Optional int. Keras' name for `growth_interval`.

    Raises:
        TypeError: if `inner_optimizer` is not a Keras optimizer.
        ValueError: if `inner_optimizer` is itself a loss-scale optimizer, any
            other argument breaks its rule, or an argument is not one of the
            above (the base optimizer's `weight_decay`, `use_ema`, ... other
            than at their defaults: set them on the inner optimizer).

    Example:

    >>> import tensorflow as tf  # the step on Keras' TensorFlow backend
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
                 growth_interval=settings.DEFAULT_GROWTH_INTERVAL, hysteresis=1,
                 min_scale=settings.DEFAULT_MIN_SCALE, max_scale=settings.DEFAULT_MAX_SCALE,
                 clipnorm=None, global_clipnorm=None, clipvalue=None,
                 enabled=True, skip_spikes=None, spike_window=_spikes.DEFAULT_WINDOW,
                 spike_warmup=_spikes.DEFAULT_WARMUP, compensation="kahan", name=None,
                 dynamic_growth_steps=None, **kwargs):
        settings.check_base_arguments(kwargs)
        growth_interval = settings.resolve_growth_interval(growth_interval, dynamic_growth_steps)
        inner_optimizer = settings.resolve_inner_optimizer(inner_optimizer)
        clipping = dict(clipnorm=clipnorm, global_clipnorm=global_clipnorm, clipvalue=clipvalue)
        settings.check_settings(initial_scale, dynamic, growth_factor, backoff_factor, growth_interval,
                        hysteresis, min_scale, max_scale, clipping, enabled)
        settings.check_spike_settings(skip_spikes, spike_window, spike_warmup, inner_optimizer)
        settings.check_compensation(compensation)
        settings.forward_clipping(inner_optimizer, clipping)
        super().__init__(inner_optimizer, initial_scale=float(initial_scale),
                         dynamic_growth_steps=int(growth_interval), name=name)
        self.dynamic, self.enabled = dynamic, enabled
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.skip_spikes = None if skip_spikes is None else float(skip_spikes)
        self.spike_window, self.spike_warmup = int(spike_window), int(spike_warmup)
        self.compensation = compensation
        # Set while a LossScaleMonitor watches: a traced step then flags overflowing variables.
        self._monitored = False
        object.__setattr__(self, "_warned", set())
        object.__setattr__(self, "_kmp_record", _handoff.StepRecord())
        # Values that carry the scale, registered by their owner (`_step.follow_scale`: float8's).
        object.__setattr__(self, "_kmp_scale_followers", ())

    def __setattr__(self, name, value):  # a rate set here is the inner's, tracked there alone
        if name == "learning_rate" and "inner_optimizer" in vars(self):
            return setattr(self.inner_optimizer, name, value)  # (not twice in `variables`)
        super().__setattr__(name, value)

    @_keras_internals.no_automatic_dependency_tracking
    def build(self, var_list):
        _scaling_step.build_state(self, var_list)  # the scale, counters, ...
        if not self.inner_optimizer.built:  # (a user's own optimizer may not check)
            self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def scaling(self):
        """Bool: whether it scales the loss (enabled, its scale not fixed at
        1). A scale fixed at 1 (the guard under bfloat16 and float32) scales
        nothing: only the skip of a non-finite step (or a spike) remains."""
        return self.enabled and (self.dynamic or self.initial_scale != 1.0)

    @property
    def loss_scale(self):
        """Float32 scalar: the current loss scale (1 when not `enabled`)."""
        if not self.enabled:
            return ops.convert_to_tensor(1.0, "float32")
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        return backends.get("step").snapshot(self._kmp_scale.value)

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
    dynamic_scale = property(lambda self: self._kmp_scale)  # Keras' scaler's name for its scale

    clipnorm = property(*settings.clipping_accessors("clipnorm"))  # the inner optimizer's ones
    global_clipnorm = property(*settings.clipping_accessors("global_clipnorm"))
    clipvalue = property(*settings.clipping_accessors("clipvalue"))

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
        if not self.scaling:
            self._kmp_record.note_scaled(loss)  # the loss, for the spike rule
            return loss
        scale = self.loss_scale
        if backends.get("step").read_once(loss, scale):
            raise ValueError(_handoff.read_once_error(self, "scale_loss"))
        self._kmp_record.note_scaled(loss)
        return ops.multiply(loss, scale)

    def get_scaled_loss(self, loss):
        """tf.keras' name for `scale_loss`; a callable `loss` gives a callable."""
        return (lambda: self.scale_loss(loss())) if callable(loss) else self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Returns `grads` divided by the current loss scale (tf.keras' recipe).

        `apply_gradients` then checks them, skips a non-finite step and
        updates the scale, but does not divide again. `None` entries pass.
        """
        grads = list(grads)
        if not self.scaling:
            return grads
        scale = self.loss_scale
        if any(g is not None and backends.get("step").read_once(g, scale) for g in grads):
            raise ValueError(_handoff.read_once_error(self, "get_unscaled_gradients"))
        self._kmp_record.note_divided(grads)
        return _scaling_step.unscale(self, grads)

    def stateless_scale_loss(self, optimizer_variables, loss):
        """`scale_loss`, reading the scale from `optimizer_variables` (the
        values of `self.variables` a stateless JAX step carries): the one
        line of a custom JAX `train_step` or `jax.grad` loss (docs/jax.md)."""
        if not (self.enabled and self.built):
            return self.scale_loss(loss)
        with keras.StatelessScope(state_mapping=list(zip(self.variables, optimizer_variables))):
            return self.scale_loss(loss)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables, *, loss=None):
        """`apply` as a pure function of values, as Keras' JAX trainer calls it.

        Args:
            optimizer_variables, grads, trainable_variables: Lists of values.
            loss: Optional tensor. The unscaled loss: a non-finite one is a
                forward overflow, as in `fit`. Defaults to `None`.

        Returns:
            `(new_trainable_values, new_optimizer_values)`, as given if skipped.
        """
        values = (optimizer_variables, grads, trainable_variables)
        return _scaling_step.stateless_apply(self, *values, loss=loss)

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
        grads = list(grads)
        if not self.enabled:
            self._kmp_record.take()
            return self._kmp_apply(grads, trainable_variables, divide=False, loss=None).finite
        divide, loss = _handoff.take_for_apply(self, grads)
        answer = self._kmp_apply(grads, trainable_variables, divide=divide, loss=loss)
        self._kmp_record.answer = answer
        return answer.finite

    def _kmp_apply(self, grads, trainable_variables, *, divide, loss, retries_left=None):
        """`apply` once it has read the step's record, answering with values
        (`kmp.scaling._step.apply_told`); what kmp.Model's TensorFlow step calls."""
        return _scaling_step.apply_told(self, grads, trainable_variables, loss=loss,
                                        divide=divide and self.scaling, retries_left=retries_left)

    def get_config(self):
        _registered.keep()  # what saving it writes, loading it must find
        config = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
        }
        names = _scaling_rule.RULE_SETTINGS + settings.CLIPPING + (
            "enabled", "skip_spikes", "spike_window", "spike_warmup", "compensation")
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
