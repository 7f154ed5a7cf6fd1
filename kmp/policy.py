"""Precision policies: which dtype layers compute in, and which stay float32.

A kmp policy is a thin, documented view of Keras' global dtype policy. Setting
one sets Keras' (so every layer created afterwards picks it up); reading one
reads Keras' (so a policy set through `keras.config.set_dtype_policy` is seen
too). kmp adds three things Keras does not have: `"auto"`, which picks the
fastest safe policy for the hardware; float32 "islands", layers that compute
in float32 inside a `kmp.Model` and hand the compute dtype on (settled
when the model is built, see `kmp/precision/_settle.py`); and a `loss_scaling` flag that `kmp.Model.compile` reads.

This module holds the policies and their global state; `"auto"`'s hardware
rule is in `kmp/precision/_hardware.py`, the `keep_float32` rules in
`kmp/precision/_keep_float32.py`, and which layers compute in float32 in
`kmp/precision/_float32_layers.py`.
"""

import contextlib
import logging

import keras

from kmp import _registered
from kmp.precision import _hardware
from kmp.precision._float32_layers import _builtin_rules
from kmp.precision._float32_layers import _plan as _plan_float32_layers
from kmp.precision._keep_float32 import _Float32Rules

# Public names of this module since 0.1, defined with the float32 layers.
from kmp.precision._float32_layers import FLOAT32_LAYER_CLASSES  # noqa: F401
from kmp.precision._float32_layers import KEEP_FLOAT32_CLASSES  # noqa: F401


_LOGGER = logging.getLogger("kmp")

POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16")
_SET_POLICY_NAMES = POLICY_NAMES + ("auto",)


@keras.saving.register_keras_serializable(package="kmp")
class Policy:
    """A precision policy: compute, variable and output dtypes.

    Model outputs are always float32, and variables too but under
    `"bfloat16"`, which keeps them in bfloat16 (half their memory): there
    `compile`'s `kmp.LossScaleOptimizer` computes each update in float32 and
    writes it with Kahan compensation, so that it is not rounded away. Inside a `kmp.Model`, `UnitNormalization`, `Normalization` and
    the layers named with `keep_float32=` compute in float32 whatever the
    policy, and hand the compute dtype on.

    Args:
        name: String. One of `"float32"`, `"mixed_float16"`,
            `"mixed_bfloat16"`, `"bfloat16"`. (`"auto"` is resolved by
            `kmp.set_policy`.)
        reason: Optional string. Why this policy was chosen; `"auto"` fills
            it in. Defaults to `None`.

    Attributes:
        name: The policy's name.
        compute_dtype: `"float32"`, `"float16"` or `"bfloat16"`.
        variable_dtype: `"float32"`, or `"bfloat16"` under `"bfloat16"`.
        output_dtype: Always `"float32"`.
        loss_scaling: `True` exactly when `compute_dtype` is `"float16"`
            (bfloat16 has float32's exponent range and needs no loss scaling).
        reason: Why this policy is active, or `None`.

    Raises:
        ValueError: if `name` is not one of the four policy names.

    Example:

    >>> policy = kmp.Policy("mixed_float16")
    >>> policy.compute_dtype, policy.variable_dtype, policy.loss_scaling
    ('float16', 'float32', True)
    """

    def __init__(self, name, reason=None):
        if name not in POLICY_NAMES:
            raise ValueError(
                f"`name` must be one of {', '.join(map(repr, POLICY_NAMES))}. "
                f"Received: name={name!r}"
            )
        keras_policy = keras.DTypePolicy(name)
        self._name = name
        self._compute_dtype = keras_policy.compute_dtype
        self._variable_dtype = keras_policy.variable_dtype
        self._reason = reason

    @classmethod
    def _from_keras(cls, keras_policy, reason):
        """Describes a Keras policy kmp does not set itself (e.g. "float16")."""
        policy = cls.__new__(cls)
        policy._name = keras_policy.name
        policy._compute_dtype = keras_policy.compute_dtype
        policy._variable_dtype = keras_policy.variable_dtype
        policy._reason = reason
        return policy

    name = property(lambda self: self._name)
    compute_dtype = property(lambda self: self._compute_dtype)
    variable_dtype = property(lambda self: self._variable_dtype)
    output_dtype = property(lambda self: "float32")
    loss_scaling = property(lambda self: self._compute_dtype == "float16")
    reason = property(lambda self: self._reason)

    def __eq__(self, other):
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return (
            f"<kmp.Policy {self.name!r}: compute={self.compute_dtype}, "
            f"variables={self.variable_dtype}, outputs={self.output_dtype}, "
            f"loss_scaling={self.loss_scaling}>"
        )

    def get_config(self):
        _registered.keep()  # what saving it writes, loading it must find
        return {"name": self.name, "reason": self.reason}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


# The policy kmp set last; its `reason` is kept for as long as Keras' global
# policy still has its name.
_active_policy = None

# The user's additions to KEEP_FLOAT32_CLASSES, from `set_policy(...,
# keep_float32=...)`: a `_Float32Rules`.
_global_keep_float32 = None


def set_policy(name, keep_float32=None):
    """Sets the global precision policy and returns it.

    Sets Keras' global dtype policy, so every layer created afterwards
    computes in the policy's compute dtype with float32 variables.

    `"auto"` picks from the hardware found:
    ```
    NVIDIA GPU, compute capability >= 8.0  -> mixed_bfloat16
    NVIDIA GPU, compute capability 7.x     -> mixed_float16
    NVIDIA GPU, older                      -> float32
    no GPU, CPU has avx512_bf16 or amx_bf16 -> mixed_bfloat16
    no GPU, otherwise                      -> float32 (float16 is emulated)
    ```
    The returned policy names what `"auto"` resolved to, and its `reason`
    says why (the same sentence is logged to the `"kmp"` logger).

    `keep_float32` adds layers to those that compute in float32 inside every
    `kmp.Model` (`UnitNormalization` and `Normalization` always do): such a
    layer computes in float32 and hands the compute dtype on, so code around
    it sees no dtype change. It is read when a model settles its precision
    (its first call, or `kmp.convert`): a model called before keeps what it
    settled. Names can only be checked against a model: a `kmp.Model` warns
    when it settles, for each name none of its layers has (the layer meant
    stays in 16 bits), and `kmp.convert` raises for it.

    Args:
        name: String or `kmp.Policy`. One of `"float32"`, `"mixed_float16"`,
            `"mixed_bfloat16"` or `"auto"`.
        keep_float32: Optional list of layer classes, layer names or name
            patterns (`"re:.*attention.*"`, matched in full against a layer's
            name and path, up to 256 characters). A pattern must match in
            bounded time: no repeat or alternation inside a repeat
            (`(a+)+`, `(a|aa)*`), no backreference, at most 3 repeats and
            200 characters. Replaces the list set by the previous call.
            Defaults to `None` (none beyond kmp's own).

    Returns:
        The active `kmp.Policy`.

    Raises:
        ValueError: if `name` is not a valid policy name, or a pattern of
            `keep_float32` is not a valid regular expression or could match
            slowly. Nothing is changed.
        TypeError: if an entry of `keep_float32` is neither a string nor a
            layer class. Nothing is changed.

    Example:

    >>> policy = kmp.set_policy("mixed_float16")
    >>> keras.config.dtype_policy().name
    'mixed_float16'
    >>> _ = kmp.set_policy("float32")
    """
    global _active_policy, _global_keep_float32
    rules = _Float32Rules.parse(keep_float32)
    policy = _resolve_policy(name, "name", caller="kmp.set_policy")
    keras.config.set_dtype_policy(policy.name)
    _active_policy = policy
    _global_keep_float32 = rules
    return policy


def get_policy():
    """Returns the active global precision policy.

    Reads Keras' global dtype policy, so a policy set with
    `keras.config.set_dtype_policy` is reported too.

    Returns:
        A `kmp.Policy`.

    Example:

    >>> with kmp.policy_scope("mixed_bfloat16"):
    ...     kmp.get_policy().compute_dtype
    'bfloat16'
    """
    keras_policy = keras.config.dtype_policy()
    if _active_policy is not None and _active_policy.name == keras_policy.name:
        return _active_policy
    reason = "Keras' global dtype policy"
    if keras_policy.name in POLICY_NAMES:
        return Policy(keras_policy.name, reason=reason)
    return Policy._from_keras(keras_policy, reason=reason)


@contextlib.contextmanager
def policy_scope(name, keep_float32=None):
    """Context manager that sets a policy and restores the previous one on exit.

    The previous policy is restored even when the block raises.

    Args:
        name: String or `kmp.Policy`, as for `kmp.set_policy`.
        keep_float32: Optional list, as for `kmp.set_policy`. Defaults to
            `None`.

    Yields:
        The `kmp.Policy` active inside the block.

    Raises:
        ValueError: if `name` or `keep_float32` is not valid (nothing is
            changed).

    Example:

    >>> with kmp.policy_scope("mixed_float16") as policy:
    ...     layer = keras.layers.Dense(4)
    >>> layer.compute_dtype, kmp.get_policy().name
    ('float16', 'float32')
    """
    global _active_policy, _global_keep_float32
    previous_keras_policy = keras.config.dtype_policy()
    previous_active = _active_policy
    previous_keep_float32 = _global_keep_float32
    policy = set_policy(name, keep_float32=keep_float32)
    try:
        yield policy
    finally:
        keras.config.set_dtype_policy(previous_keras_policy)
        _active_policy = previous_active
        _global_keep_float32 = previous_keep_float32


def _resolve_policy(value, argument, caller, none_means=None):
    """The `Policy` a policy argument asks for, `"auto"` resolved here.

    The one reading of a policy argument: `set_policy`, `kmp.convert`,
    `kmp.export` and `kmp.load_model` all call it, each with its own
    argument name, so that the error names what the user wrote.

    Args:
        value: String or `Policy`. A name of `POLICY_NAMES` or `"auto"`
            (resolved by the `"auto"` rule and logged to the `"kmp"`
            logger), or `None` where `none_means` allows it.
        argument: String. The caller's argument name, e.g. `"policy"`.
        caller: String. The public function called, e.g. `"kmp.convert"`;
            it goes into the `reason` of a policy named explicitly.
        none_means: Optional string. What `None` means to the caller (e.g.
            `"the model's own policy"`): `None` is then returned as it is,
            and listed among the allowed values. Defaults to `None`: `None`
            is not allowed.

    Returns:
        A `Policy`, or `None` for `None` when `none_means` is given.

    Raises:
        ValueError: for any other value; the message names `argument`, the
            value received and the allowed values.
    """
    if value is None and none_means is not None:
        return None
    if isinstance(value, Policy):
        return value
    if isinstance(value, str) and value == "auto":
        policy = _resolve_auto()
        _LOGGER.info('kmp: policy "auto" resolved to %s: %s', policy.name, policy.reason)
        return policy
    if isinstance(value, str) and value in POLICY_NAMES:
        return Policy(value, reason=f"set explicitly with {caller}({argument}={value!r})")
    allowed = [repr(name) for name in _SET_POLICY_NAMES] + ["a kmp.Policy"]
    if none_means is not None:
        allowed.append(f"None ({none_means})")
    raise ValueError(
        f"Unknown policy name. `{argument}` must be one of "
        f"{', '.join(allowed[:-1])} or {allowed[-1]}. "
        f"Received: {argument}={value!r}"
    )



def _resolve_auto():
    """The `Policy` `"auto"` picks here; its `reason` says why
    (`kmp/precision/_hardware.py` holds the rule)."""
    name, reason = _hardware._auto_policy()
    return Policy(name, reason=f"auto: {reason}")


def _float32_plan(model, rules=None):
    """Which layers of `model` compute in float32, and why: the plan of
    `kmp/precision/_float32_layers.py` under kmp's list, the global `keep_float32`
    (from `set_policy`) and `rules` (a model's own `_Float32Rules`, or
    `None`)."""
    return _plan_float32_layers(model, _builtin_rules() + _global_keep_float32 + rules)
