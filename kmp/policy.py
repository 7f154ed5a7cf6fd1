"""Precision policies: which dtype layers compute in, and which stay float32.

A kmp policy is a thin, documented view of Keras' global dtype policy. Setting
one sets Keras' (so every layer created afterwards picks it up); reading one
reads Keras' (so a policy set through `keras.config.set_dtype_policy` is seen
too). kmp adds three things Keras does not have: `"auto"`, which picks the
fastest safe policy for the hardware; the rule that normalization layers,
`Softmax` and model outputs stay float32 inside a `kmp.Model`; and a
`loss_scaling` flag that `kmp.Model.compile` reads.
"""

import contextlib
import logging

import keras

_LOGGER = logging.getLogger("kmp")

POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16")
_SET_POLICY_NAMES = POLICY_NAMES + ("auto",)

# Layers whose arithmetic loses too much in 16 bits (sums of squares,
# exponentials): they compute in float32 inside a kmp.Model whatever the policy.
FLOAT32_LAYER_CLASSES = tuple(
    cls
    for cls in (
        getattr(keras.layers, name, None)
        for name in (
            "BatchNormalization",
            "LayerNormalization",
            "GroupNormalization",
            "UnitNormalization",
            "RMSNormalization",
            "Normalization",
            "Softmax",
        )
    )
    if cls is not None
)


@keras.saving.register_keras_serializable(package="kmp")
class Policy:
    """A precision policy: compute, variable and output dtypes.

    Variables and model outputs are always float32; only the compute dtype
    changes. Normalization layers and `Softmax` compute in float32 inside a
    `kmp.Model` whatever the policy.

    Args:
        name: String. One of `"float32"`, `"mixed_float16"`,
            `"mixed_bfloat16"`. (`"auto"` is resolved by `kmp.set_policy`.)
        reason: Optional string. Why this policy was chosen; `"auto"` fills
            it in. Defaults to `None`.

    Attributes:
        name: The policy's name.
        compute_dtype: `"float32"`, `"float16"` or `"bfloat16"`.
        variable_dtype: Always `"float32"`.
        output_dtype: Always `"float32"`.
        loss_scaling: `True` exactly when `compute_dtype` is `"float16"`
            (bfloat16 has float32's exponent range and needs no loss scaling).
        reason: Why this policy is active, or `None`.

    Raises:
        ValueError: if `name` is not one of the three policy names.

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
        return {"name": self.name, "reason": self.reason}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


# The policy kmp set last; its `reason` is kept for as long as Keras' global
# policy still has its name.
_active_policy = None


def set_policy(name):
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

    Args:
        name: String or `kmp.Policy`. One of `"float32"`, `"mixed_float16"`,
            `"mixed_bfloat16"` or `"auto"`.

    Returns:
        The active `kmp.Policy`.

    Raises:
        ValueError: if `name` is not a valid policy name. Nothing is changed.

    Example:

    >>> policy = kmp.set_policy("mixed_float16")
    >>> keras.config.dtype_policy().name
    'mixed_float16'
    >>> _ = kmp.set_policy("float32")
    """
    global _active_policy
    if isinstance(name, Policy):
        policy = name
    elif name == "auto":
        policy = _resolve_auto()
        _LOGGER.info(
            'kmp: policy "auto" resolved to %s: %s', policy.name, policy.reason
        )
    elif isinstance(name, str) and name in POLICY_NAMES:
        policy = Policy(name, reason=f"set explicitly with set_policy({name!r})")
    else:
        raise ValueError(
            "Unknown policy name. `name` must be one of "
            f"{', '.join(map(repr, _SET_POLICY_NAMES))}. Received: name={name!r}"
        )
    keras.config.set_dtype_policy(policy.name)
    _active_policy = policy
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
def policy_scope(name):
    """Context manager that sets a policy and restores the previous one on exit.

    The previous policy is restored even when the block raises.

    Args:
        name: String or `kmp.Policy`, as for `kmp.set_policy`.

    Yields:
        The `kmp.Policy` active inside the block.

    Raises:
        ValueError: if `name` is not a valid policy name (nothing is changed).

    Example:

    >>> with kmp.policy_scope("mixed_float16") as policy:
    ...     layer = keras.layers.Dense(4)
    >>> layer.compute_dtype, kmp.get_policy().name
    ('float16', 'float32')
    """
    global _active_policy
    previous_keras_policy = keras.config.dtype_policy()
    previous_active = _active_policy
    policy = set_policy(name)
    try:
        yield policy
    finally:
        keras.config.set_dtype_policy(previous_keras_policy)
        _active_policy = previous_active


def _choose_auto_policy(gpu_compute_capabilities, cpu_flags):
    """The `"auto"` rule as a pure function of what the hardware reports.

    Args:
        gpu_compute_capabilities: List of `(major, minor)` tuples, one per
            NVIDIA GPU (empty when there is none).
        cpu_flags: Set of CPU feature flags (as in `/proc/cpuinfo`).

    Returns:
        `(policy_name, reason)`.
    """
    if gpu_compute_capabilities:
        major, minor = min(gpu_compute_capabilities)
        capability = f"{major}.{minor}"
        if major >= 8:
            return "mixed_bfloat16", (
                f"NVIDIA GPU with compute capability {capability} (>= 8.0) "
                "runs bfloat16 on tensor cores"
            )
        if major == 7:
            return "mixed_float16", (
                f"NVIDIA GPU with compute capability {capability} (7.x) runs "
                "float16 on tensor cores but has no bfloat16 support"
            )
        return "float32", (
            f"NVIDIA GPU with compute capability {capability} (< 7.0) has no "
            "fast 16-bit math"
        )
    fast_bf16_flags = sorted({"avx512_bf16", "amx_bf16"} & set(cpu_flags))
    if fast_bf16_flags:
        return "mixed_bfloat16", (
            f"no GPU; the CPU advertises {' and '.join(fast_bf16_flags)}, so "
            "bfloat16 runs natively"
        )
    return "float32", (
        "no GPU and the CPU advertises neither avx512_bf16 nor amx_bf16: "
        "16-bit math would be emulated and slower than float32"
    )


def _gpu_compute_capabilities():
    import tensorflow as tf

    capabilities = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        capability = details.get("compute_capability")
        if capability:
            capabilities.append(tuple(capability))
    return capabilities


def _cpu_flags(cpuinfo_path="/proc/cpuinfo"):
    try:
        with open(cpuinfo_path) as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass  # Not Linux: no flags known, so "auto" stays with float32.
    return set()


def _resolve_auto():
    name, reason = _choose_auto_policy(_gpu_compute_capabilities(), _cpu_flags())
    return Policy(name, reason=f"auto: {reason}")


def _keep_float32_layers(model):
    """Makes every normalization and Softmax layer of `model` compute in float32."""
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if (
            isinstance(layer, FLOAT32_LAYER_CLASSES)
            and layer.compute_dtype != "float32"
        ):
            layer.dtype_policy = "float32"
