"""The loss scaler's settings: each argument checked, clipping forwarded.

`kmp.LossScaleOptimizer`'s constructor and attribute setters call these;
each raises `ValueError` (or `TypeError`) naming the argument, the rule and
the value received, before anything is changed.
"""

import math
import numbers

import keras
import numpy as np

from kmp.scaling import _gradients

# The largest values the state variables hold: the scale is float32, the
# counters (`growth_interval`, `hysteresis` among them) int64.
FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = _gradients.COUNTER_MAX  # int64, or int32 on JAX

DEFAULT_GROWTH_INTERVAL = 2000
# kmp.LossScaleOptimizer's default bounds of a dynamic scale.
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24

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

CLIPPING = ("clipnorm", "global_clipnorm", "clipvalue")
# The spike rule's window is one float32 variable of this many losses at most.
_MAX_SPIKE_WINDOW = 65536
# How a 16-bit weight keeps what rounding its updates loses
# (`kmp.precision._compensated`): `LossScaleOptimizer(compensation=...)`.
COMPENSATIONS = ("kahan", "stochastic")


def check_base_arguments(kwargs):
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
    _check_number(name, value, rule=f"a number in (0, {FLOAT32_MAX:.8g}] (float32)",
                  predicate=lambda v: 0 < v <= FLOAT32_MAX and np.float32(v) > 0)


def _check_integer(name, value, minimum, maximum=_INT64_MAX):
    # A float with an integer value (2.0) is accepted, as Keras and tf.keras do.
    integral = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and float(value).is_integer()  # False for inf, nan
    )
    if isinstance(value, bool) or not integral or not minimum <= value <= maximum:
        raise ValueError(
            f"`{name}` must be an integer in [{minimum}, {maximum}]. Received: {name}={value!r}"
        )


def check_settings(initial_scale, dynamic, growth_factor, backoff_factor, growth_interval,
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


def check_spike_threshold(skip_spikes):
    """Raises `ValueError` unless `skip_spikes` is `None` or a finite number > 0."""
    _check_number("skip_spikes", skip_spikes, allow_none=True)


def check_spike_settings(skip_spikes, spike_window, spike_warmup, inner_optimizer):
    """Raises `ValueError` naming the first spike setting that breaks its rule."""
    check_spike_threshold(skip_spikes)
    _check_integer("spike_window", spike_window, 2, _MAX_SPIKE_WINDOW)
    _check_integer("spike_warmup", spike_warmup, 2)
    steps = getattr(inner_optimizer, "gradient_accumulation_steps", None)
    if skip_spikes is not None and steps:
        raise ValueError(
            "`skip_spikes` judges each step's loss, and an accumulated step's loss is "
            "spread over its micro-batches: it does not combine with the inner "
            "optimizer's `gradient_accumulation_steps`. Received: "
            f"skip_spikes={skip_spikes!r}, gradient_accumulation_steps={steps}"
        )


def check_compensation(compensation):
    """Raises `ValueError` unless `compensation` is one of `COMPENSATIONS`."""
    if compensation not in COMPENSATIONS:
        raise ValueError(
            f"`compensation` must be one of {COMPENSATIONS} (how a 16-bit weight "
            "keeps what rounding its updates loses). Received: "
            f"compensation={compensation!r}"
        )


def forward_clipping(inner_optimizer, clipping):
    """Sets the scaler's clipping on the inner optimizer, which clips the
    unscaled gradients. Raises `ValueError` where it clips otherwise."""
    given = {arg: value for arg, value in clipping.items() if value is not None}
    own = {arg: getattr(inner_optimizer, arg, None) for arg in CLIPPING}
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
    """Sets `inner_optimizer.<name> = value`, one of `CLIPPING`.

    Raises `ValueError` (and sets nothing) for a value that is not a finite
    number > 0 or `None`, or where the inner optimizer has another of the
    three set (Keras' rule: at most one).
    """
    _check_number(name, value, allow_none=True)
    others = {other: getattr(inner_optimizer, other, None) for other in CLIPPING if other != name}
    others = {other: v for other, v in others.items() if v is not None}
    if value is not None and others:
        (other, other_value), = others.items()
        raise ValueError(
            "At most one of `clipnorm`, `global_clipnorm` and `clipvalue` can be set (the "
            f"inner Keras optimizer clips, and takes one): set `{other} = None` first. "
            f"Received: {name}={value!r}, with {other}={other_value!r} set"
        )
    setattr(inner_optimizer, name, value)


def clipping_accessors(name):
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
            # exists; the scaler's own are forwarded by `forward_clipping`.
            if value is not None:
                raise ValueError(
                    f"`{name}` can be set once the inner optimizer is. Received: {name}={value!r}"
                )
            return
        _set_clipping(inner, name, value)

    return get, set_


def from_keras_scaler(scaler):
    """The arguments of a `kmp.LossScaleOptimizer` that keeps the settings
    of `scaler`, a `keras.optimizers.LossScaleOptimizer`.

    Keras' scaler takes `initial_scale` and `dynamic_growth_steps`, and bounds
    its scale by neither a minimum nor a maximum: where its initial scale lies
    outside kmp's default bounds (`DEFAULT_MIN_SCALE`, `DEFAULT_MAX_SCALE`),
    the bound moves to it, so every scale Keras accepts is taken over (one
    beyond float32's range is refused, as Keras would hold it as inf or 0).

    Args:
        scaler: A `keras.optimizers.LossScaleOptimizer`.

    Returns:
        A dict with `initial_scale`, `growth_interval`, `min_scale` and
        `max_scale`.

    Example:

    ```python
    keras_scaler = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2**40)
    from_keras_scaler(keras_scaler)
    # {'initial_scale': 1099511627776.0, 'growth_interval': 2000,
    #  'min_scale': 1.0, 'max_scale': 1099511627776.0}
    ```
    """
    initial_scale = scaler.initial_scale
    _check_scale("initial_scale", initial_scale)
    initial_scale = float(initial_scale)
    return dict(
        initial_scale=initial_scale,
        growth_interval=scaler.dynamic_growth_steps,
        min_scale=min(DEFAULT_MIN_SCALE, initial_scale),
        max_scale=max(DEFAULT_MAX_SCALE, initial_scale),
    )


def resolve_growth_interval(growth_interval, dynamic_growth_steps):
    """`growth_interval`, or Keras' `dynamic_growth_steps` where given."""
    if dynamic_growth_steps is None:
        return growth_interval
    _check_integer("dynamic_growth_steps", dynamic_growth_steps, 1)
    if growth_interval not in (DEFAULT_GROWTH_INTERVAL, dynamic_growth_steps):
        raise ValueError(
            "`dynamic_growth_steps` is Keras' name for `growth_interval`; pass "
            f"one of them. Received: growth_interval={growth_interval!r}, "
            f"dynamic_growth_steps={dynamic_growth_steps!r}"
        )
    return dynamic_growth_steps


def resolve_inner_optimizer(inner_optimizer):
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
