"""Precision policies: which dtype layers compute in, and which stay float32.

A kmp policy is a thin, documented view of Keras' global dtype policy. Setting
one sets Keras' (so every layer created afterwards picks it up); reading one
reads Keras' (so a policy set through `keras.config.set_dtype_policy` is seen
too). kmp adds three things Keras does not have: `"auto"`, which picks the
fastest safe policy for the hardware; float32 "islands", layers that compute
in float32 inside a `kmp.Model` and hand the compute dtype on (settled
when the model is built, see `kmp/_precision.py`); and a `loss_scaling` flag that `kmp.Model.compile` reads.
"""

import contextlib
import logging
import re

import keras

from kmp import _keras_internals

_LOGGER = logging.getLogger("kmp")

POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16")
_SET_POLICY_NAMES = POLICY_NAMES + ("auto",)
_16_BIT_DTYPES = ("float16", "bfloat16")


def _keras_layers(*names):
    return tuple(
        cls
        for cls in (getattr(keras.layers, name, None) for name in names)
        if cls is not None
    )


# The layers `kmp.export` runs in float32 when it serves a model in 16 bits
# (issue 4). Training does not use this list: see KEEP_FLOAT32_CLASSES.
FLOAT32_LAYER_CLASSES = _keras_layers(
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "UnitNormalization",
    "RMSNormalization",
    "Normalization",
    "Softmax",
)

# Layers whose arithmetic goes wrong in 16 bits and that Keras leaves in the
# compute dtype: UnitNormalization's sum of squares overflows float16 from
# |x| ~ 32 per element on 64 features, and Normalization subtracts a mean from raw
# features, which float16 rounds to 0.5 at 1000. Inside a kmp.Model they
# compute in float32 and hand the compute dtype on. Batch, Layer, Group and
# RMS normalization are not here: Keras already computes their statistics in
# float32 under mixed policies (and keras-hub's RMS norms do the same).
# Softmax is not here either: TensorFlow's 16-bit softmax is as accurate as a
# float32 softmax cast back to 16 bits, to one 16-bit rounding.
KEEP_FLOAT32_CLASSES = _keras_layers("UnitNormalization", "Normalization")

# Layers Keras itself keeps in float32 arithmetic; `kmp.summary` says so.
_KERAS_FLOAT32_MATH_CLASSES = _keras_layers(
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "RMSNormalization",
)


@keras.saving.register_keras_serializable(package="kmp")
class Policy:
    """A precision policy: compute, variable and output dtypes.

    Variables and model outputs are always float32; only the compute dtype
    changes. Inside a `kmp.Model`, `UnitNormalization`, `Normalization` and
    the layers named with `keep_float32=` compute in float32 whatever the
    policy, and hand the compute dtype on.

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
    settled. Names can only be checked against a model: `kmp.convert` raises
    for a name no layer of its model has.

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


# What runs bfloat16 natively: NVIDIA GPUs from compute capability 8.0
# (Ampere) on, and x86 CPUs that advertise one of these flags. `"auto"`,
# `kmp.diagnose` and `kmp doctor` all read it through `_choose_auto_policy`.
_BFLOAT16_GPU_MAJOR = 8
_BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


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
        if major >= _BFLOAT16_GPU_MAJOR:
            return "mixed_bfloat16", (
                f"NVIDIA GPU with compute capability {capability} "
                f"(>= {_BFLOAT16_GPU_MAJOR}.0) runs bfloat16 on tensor cores"
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
    fast_bf16_flags = sorted(set(_BFLOAT16_CPU_FLAGS) & set(cpu_flags))
    if fast_bf16_flags:
        return "mixed_bfloat16", (
            f"no GPU; the CPU advertises {' and '.join(fast_bf16_flags)}, so "
            "bfloat16 runs natively"
        )
    return "float32", (
        f"no GPU and the CPU advertises neither {' nor '.join(_BFLOAT16_CPU_FLAGS)}: "
        "16-bit math would be emulated and slower than float32"
    )


def _runs_bfloat16(gpu_compute_capabilities, cpu_flags):
    """Whether the hardware runs bfloat16 natively, by the `"auto"` rule.

    Args and the rule as for `_choose_auto_policy`: the slowest GPU
    decides, and with no GPU the CPU's flags.
    """
    name, _ = _choose_auto_policy(gpu_compute_capabilities, cpu_flags)
    return name == "mixed_bfloat16"


def _gpus():
    """`(device_name, details)` for each GPU the backend sees.

    `details` as `tf.config.experimental.get_device_details` gives them
    (`"compute_capability"`, `"device_name"`; empty for a non-NVIDIA GPU).
    On JAX, from JAX's devices (TensorFlow would take the GPU's memory).
    """
    if keras.backend.backend() == "jax":
        return _jax_gpus()
    import tensorflow as tf

    return [
        (gpu.name, tf.config.experimental.get_device_details(gpu))
        for gpu in tf.config.list_physical_devices("GPU")
    ]


def _jax_gpus():
    import jax

    gpus = []
    for device in jax.devices():
        if device.platform != "gpu":
            continue
        details = {"device_name": getattr(device, "device_kind", str(device))}
        capability = getattr(device, "compute_capability", None)  # "9.0" on CUDA
        if capability:
            details["compute_capability"] = tuple(int(part) for part in str(capability).split("."))
        gpus.append((str(device), details))
    return gpus


def _gpu_compute_capabilities():
    return [
        tuple(details["compute_capability"])
        for _, details in _gpus()
        if details.get("compute_capability")
    ]


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
    gpus = _gpu_compute_capabilities()
    if not gpus and keras.backend.backend() == "jax":
        # Measured on an AVX-512 BF16 CPU (docs/jax.md): a bfloat16 step ran at
        # 0.70-0.88x the float32 one, for Keras' own policy too.
        return Policy("float32", reason=(
            "auto: no GPU, and JAX's CPU backend (XLA) computes bfloat16 by converting "
            "to float32, which is slower than float32 itself"
        ))
    name, reason = _choose_auto_policy(gpus, _cpu_flags())
    return Policy(name, reason=f"auto: {reason}")


# What a `keep_float32` pattern may be, so that matching it cannot stall (a
# `.keras` file carries its model's patterns: loading one must not hang on a
# pattern like `re:(a+)+$`). Python's backtracking matcher is exponential in
# nested repeats (and alternations under a repeat) and polynomial, of degree
# their number, in repeats side by side: three `.*` against 256 characters
# take milliseconds, four against 512 take seconds. So: no repeat or
# alternation inside a repeat, no backreference, at most three repeats of
# more than one character, and names up to 256 characters.
_LONGEST_PATTERN = 200
_MOST_REPEATS = 3
_LONGEST_MATCHED_NAME = 256


def _regex_parser():
    try:
        from re import _parser  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as _parser
    return _parser


def _pattern_problem(parsed, parser, inside_repeat=False, counts=None):
    """Why a parsed pattern could match slowly, or `None`; counts its repeats."""
    repeats = {
        getattr(parser, name)
        for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
        if hasattr(parser, name)
    }
    references = {
        getattr(parser, name)
        for name in ("GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE", "GROUPREF_LOC_IGNORE",
                     "GROUPREF_UNI_IGNORE")
        if hasattr(parser, name)
    }
    counts = [0] if counts is None else counts
    for op, argument in parsed:
        if op in references:
            return "a backreference"
        if op == parser.BRANCH and inside_repeat:
            return "an alternation inside a repeat, e.g. (a|aa)*"
        if op in repeats:
            low, high, subpattern = argument
            if high > 1:
                if inside_repeat:
                    return "a repeat inside a repeat, e.g. (a+)+"
                counts[0] += 1
            problem = _pattern_problem(subpattern, parser, inside_repeat or high > 1, counts)
            if problem:
                return problem
            continue
        for item in argument if isinstance(argument, (tuple, list)) else (argument,):
            for part in item if isinstance(item, list) else (item,):
                if isinstance(part, parser.SubPattern):
                    problem = _pattern_problem(part, parser, inside_repeat, counts)
                    if problem:
                        return problem
    if counts[0] > _MOST_REPEATS:
        return f"{counts[0]} repeats (at most {_MOST_REPEATS})"
    return None


def _check_pattern_is_bounded(entry, argument):
    """Raises `ValueError` for a `re:` entry whose matching could stall."""
    pattern = entry[3:]
    if len(pattern) > _LONGEST_PATTERN:
        problem = f"{len(pattern)} characters (at most {_LONGEST_PATTERN})"
    else:
        parser = _regex_parser()
        problem = _pattern_problem(parser.parse(pattern), parser)
    if problem:
        shown = entry if len(entry) <= 80 else entry[:77] + "..."
        raise ValueError(
            f"Each `{argument}` pattern must match in bounded time: no "
            "repeat or alternation inside a repeat, no backreference, at most "
            f"{_MOST_REPEATS} repeats, at most {_LONGEST_PATTERN} characters. "
            f"This one has {problem}. Name the layers, or write a simpler "
            f"pattern. Received: {argument} entry {shown!r}"
        )


class _Float32Rules:
    """`keep_float32` entries, parsed: layer classes, exact names, patterns."""

    def __init__(self, classes=(), names=(), patterns=()):
        self.classes = tuple(classes)
        self.names = tuple(names)
        self.patterns = tuple(patterns)

    @classmethod
    def parse(cls, keep_float32, argument="keep_float32"):
        """Checks the form of `keep_float32` and returns its rules.

        Raises:
            TypeError: for an entry that is neither a string nor a layer class.
            ValueError: for a `"re:"` pattern that does not compile.
        """
        if keep_float32 is None:
            return cls()
        if isinstance(keep_float32, _Float32Rules):
            return keep_float32
        if isinstance(keep_float32, (str, type)):
            keep_float32 = [keep_float32]
        classes, names, patterns = [], [], []
        for entry in keep_float32:
            if isinstance(entry, type) and issubclass(entry, keras.layers.Layer):
                classes.append(entry)
            elif isinstance(entry, str) and entry.startswith("re:"):
                try:
                    compiled = re.compile(entry[3:])
                except re.error as error:
                    raise ValueError(
                        f"Each `{argument}` pattern must be a valid regular "
                        f"expression after 're:' ({error}). Received: "
                        f"{argument} entry {entry!r}"
                    ) from None
                _check_pattern_is_bounded(entry, argument)
                patterns.append(compiled)
            elif isinstance(entry, str) and entry:
                names.append(entry)
            else:
                raise TypeError(
                    f"Each entry of `{argument}` must be a keras.layers.Layer "
                    "subclass, a layer name, or a name pattern starting with "
                    f"'re:'. Received: {argument} entry {entry!r}"
                )
        return cls(classes, names, patterns)

    def to_config(self):
        """The entries as `parse` takes them back, classes by registered name
        (`"class:..."`): what a `.keras` file stores."""
        return (
            [f"class:{keras.saving.get_registered_name(c)}" for c in self.classes]
            + list(self.names)
            + [f"re:{p.pattern}" for p in self.patterns]
        )

    @classmethod
    def from_config(cls, entries):
        resolved = []
        for entry in entries or ():
            if isinstance(entry, str) and entry.startswith("class:"):
                name = entry[len("class:"):]
                layer_class = keras.saving.get_registered_object(name) or getattr(
                    keras.layers, name, None
                )
                if layer_class is None:
                    raise ValueError(
                        f"keep_float32 names the layer class {name!r}, which is "
                        "not registered: decorate it with "
                        "@keras.saving.register_keras_serializable() before loading."
                    )
                entry = layer_class
            resolved.append(entry)
        return cls.parse(resolved)

    def __bool__(self):
        return bool(self.classes or self.names or self.patterns)

    def __add__(self, other):
        if other is None:
            return self
        return _Float32Rules(
            self.classes + other.classes,
            self.names + other.names,
            self.patterns + other.patterns,
        )

    def match(self, layer):
        """Returns the entry that puts `layer` in float32, as text, or `None`."""
        labels = {layer.name, _layer_label(layer)}
        for cls in self.classes:
            if isinstance(layer, cls):
                return cls.__name__
        for name in self.names:
            if name in labels:
                return repr(name)
        # Bounded: a pattern passed `_check_pattern_is_bounded`, and a label
        # longer than _LONGEST_MATCHED_NAME is never searched.
        searchable = [label for label in labels if len(label) <= _LONGEST_MATCHED_NAME]
        for pattern in self.patterns:
            if any(pattern.fullmatch(label) for label in searchable):
                return repr("re:" + pattern.pattern)
        return None

    def check_names(self, model, argument="keep_float32"):
        """Raises `ValueError` for an exact name no layer of `model` has."""
        layers = list(_keras_internals.nested_layers(model, include_self=False, recursive=True))
        known = {layer.name for layer in layers} | {
            _layer_label(layer) for layer in layers
        }
        unknown = [name for name in self.names if name not in known]
        if unknown:
            raise ValueError(
                f"`{argument}` names layers the model does not have: "
                f"{', '.join(map(repr, unknown))}. Layer names in "
                f"{model.name!r}: {', '.join(sorted(known))}. Use a class or "
                "a 're:' pattern to name layers the model may not have."
            )


def _layer_label(layer):
    # Sublayers without weights have no path; their name is all there is.
    return getattr(layer, "path", None) or layer.name


def _builtin_rules():
    return _Float32Rules(classes=KEEP_FLOAT32_CLASSES)


def _can_change_policy(layer):
    policy = layer.dtype_policy
    return (
        not isinstance(policy, keras.dtype_policies.DTypePolicyMap)
        and policy.quantization_mode is None
    )


@keras.saving.register_keras_serializable(package="kmp")
class _Float32Policy(keras.DTypePolicy):
    """The policy kmp gives a layer it computes in float32 inside a 16-bit model.

    Computes and stores in float32, exactly as `keras.DTypePolicy("float32")`,
    and remembers why and which dtype the layer hands on: so `kmp.summary`,
    a second settling (after `kmp.convert` or loading) and a `.keras` round
    trip all see that kmp chose it, and which layers cast their outputs back.

    Args:
        name: String. Always `"float32"` (taken for Keras' config format).
        hands_on: Optional string. The 16-bit dtype the layer's outputs are
            cast back to (an island), or `None` (a layer inside an island,
            whose outputs stay inside it).
        reason: Optional string. Why the layer computes in float32.
        was: Optional string. The name of the policy it had before
            (`"mixed_float16"`): what a saved config records
            (`_unsettled_config`), so a loaded model settles again from its
            rules.
    """

    def __init__(self, name="float32", hands_on=None, reason=None, was=None):
        if name != "float32":
            raise ValueError(
                "kmp's float32 layer policy computes in float32 only. "
                f"Received: name={name!r}"
            )
        super().__init__("float32")
        self._hands_on = hands_on
        self._reason = reason
        self._was = was

    hands_on = property(lambda self: self._hands_on)
    reason = property(lambda self: self._reason)
    was = property(lambda self: self._was)

    def get_config(self):
        return {
            "name": "float32",
            "hands_on": self._hands_on,
            "reason": self._reason,
            "was": self._was,
        }


def _unsettled_config(config):
    """`config` (a model's) with each layer kmp settled in float32 back on the
    policy it had (`_Float32Policy.was`).

    Keras' `Layer.from_config` keeps only a policy's name, so a saved
    `_Float32Policy` would load as a plain float32 layer that no rule
    matches and that casts nothing back; saved as it was, the loaded model
    settles again from its `keep_float32` rules and kmp's list.
    """
    if isinstance(config, list):
        return [_unsettled_config(item) for item in config]
    if not isinstance(config, dict):
        return config
    if config.get("class_name") == "_Float32Policy":
        was = config.get("config", {}).get("was")
        if was:
            return keras.dtype_policies.serialize(keras.DTypePolicy(was))
    return {key: _unsettled_config(value) for key, value in config.items()}


_PROBABILITY_OUTPUTS = ("softmax", "sigmoid")
_PROBABILITY_OUTPUT_REASON = (
    "a softmax/sigmoid model output on JAX: Keras' cross-entropy differentiates the "
    "probabilities there (TensorFlow carries the logits), whose 16-bit gradient "
    "overflows at the usual loss scales"
)


def _probability_output(layer, model):
    """On JAX, whether `layer` makes a softmax or sigmoid output of `model`.

    Keras' cross-entropies take the logits behind a softmax output where the
    output tensor carries them (TensorFlow); a JAX array cannot, so the loss
    differentiates `log(p)`, whose gradient `scale / p` overflows float16 at
    the usual scales. Computed in float32, the probabilities' gradient
    reaches the 16-bit layers below as `scale * (p - y)`.
    """
    if keras.backend.backend() != "jax" or not isinstance(model, _keras_internals.Functional):
        return False
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    if name not in _PROBABILITY_OUTPUTS:
        return False
    try:
        produced = {id(tensor) for tensor in keras.tree.flatten(layer.output)}
    except (AttributeError, ValueError):
        return False
    return any(id(output) in produced for output in keras.tree.flatten(model.outputs))


def _float32_plan(model, rules=None):
    """Which layers of `model` compute in float32, and why.

    A layer matched by kmp's list, the global `keep_float32` or `rules`, and
    computing in 16 bits, becomes an island: it and every layer inside it
    compute in float32, and its outputs are cast back to its compute dtype.
    A layer kmp settled in float32 already (a `_Float32Policy`) keeps its
    role, so planning a settled model again gives the same plan.

    Returns:
        List of `(layer, role, reason, hands_on)`, `role` being `"island"`
        (hands `hands_on` on) or `"inside"` (a sublayer of an island,
        `hands_on` `None`).
    """
    all_rules = _builtin_rules() + _global_keep_float32 + rules
    plan, seen = [], set()

    def visit(parent, inside):
        for layer in _keras_internals.nested_layers(parent, include_self=False, recursive=False):
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            settled = layer.dtype_policy if isinstance(layer.dtype_policy, _Float32Policy) else None
            sixteen_bit = (
                keras.backend.standardize_dtype(layer.compute_dtype) in _16_BIT_DTYPES
                and _can_change_policy(layer)
            )
            if inside is not None:
                if sixteen_bit or settled is not None:
                    plan.append((layer, "inside", f"inside float32 layer {inside!r}", None))
                visit(layer, inside)
                continue
            if settled is not None and settled.hands_on is not None:
                plan.append((layer, "island", settled.reason, settled.hands_on))
                visit(layer, _layer_label(layer))
                continue
            entry = all_rules.match(layer)
            if entry is None and sixteen_bit and parent is model and _probability_output(layer, model):
                hands_on = keras.backend.standardize_dtype(layer.compute_dtype)
                plan.append((layer, "island", _PROBABILITY_OUTPUT_REASON, hands_on))
                visit(layer, _layer_label(layer))
            elif entry is not None and sixteen_bit:
                source = (
                    "kmp's float32 list"
                    if isinstance(layer, KEEP_FLOAT32_CLASSES)
                    else "keep_float32"
                )
                hands_on = keras.backend.standardize_dtype(layer.compute_dtype)
                plan.append((layer, "island", f"{source}: {entry}", hands_on))
                visit(layer, _layer_label(layer))
            else:
                visit(layer, None)

    visit(model, None)
    return plan


def _cast_floats(structure, dtype):
    def cast(x):
        if (
            hasattr(x, "dtype")
            and keras.backend.is_float_dtype(x.dtype)
            and keras.backend.standardize_dtype(x.dtype) != dtype
        ):
            # Keeps the logits behind a softmax output, which Keras'
            # cross-entropies differentiate from (see keep_logits).
            return _keras_internals.keep_logits(x, keras.ops.cast(x, dtype))
        return x

    return keras.tree.map_structure(cast, structure)


def _to_float32(structure):
    """`structure` with its floating-point tensors cast to float32.

    What a `kmp.Model` returns and what `kmp.export` serves: outputs are
    float32 under every policy.
    """
    return _cast_floats(structure, "float32")


def _computes_in_float16(model):
    """Whether any layer of `model` computes in float16 (so needs loss scaling)."""
    # The layers decide, not the model's own policy: a model loaded (or built)
    # while the global policy was mixed_float16 has that policy even when all
    # its layers compute in float32.
    layers = list(_keras_internals.nested_layers(model, include_self=False, recursive=True))
    if not layers:
        return model.dtype_policy.compute_dtype == "float16"
    return any(layer.compute_dtype == "float16" for layer in layers)


@contextlib.contextmanager
def _layer_policies(layers_to_policy):
    """Runs a block with layers switched to other dtype policies, then restores them.

    The one place kmp changes layers' policies for a while: `kmp.export`
    traces the model in its inference precision and puts the trained
    policies back. A model's own precision is settled once instead (see
    `kmp/_precision.py`). The previous policies come back in the reverse
    order, also when the block raises or a switch fails halfway.

    Args:
        layers_to_policy: Dict from layer to the dtype policy (a name or a
            `keras.DTypePolicy`) it computes under inside the block.

    Example:

    >>> dense = keras.layers.Dense(2, dtype="mixed_float16")
    >>> with _layer_policies({dense: "float32"}):
    ...     dense.compute_dtype
    'float32'
    >>> dense.compute_dtype
    'float16'
    """
    previous = []
    try:
        for layer, policy in layers_to_policy.items():
            previous.append((layer, layer.dtype_policy))
            layer.dtype_policy = policy
        yield
    finally:
        for layer, policy in reversed(previous):
            layer.dtype_policy = policy
