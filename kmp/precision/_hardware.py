"""The hardware behind policy `"auto"`: GPUs, compute capabilities, CPU flags.

`"auto"`, `kmp.diagnose` and `kmp doctor` all read the hardware here and
decide with one rule, a pure function of what the hardware reports
(`_choose_auto_policy`). What differs per backend (how GPUs are listed, and
whether the backend's CPU step gains from bfloat16 at all) comes from
`kmp/backends/<backend>/devices.py`.
"""

from kmp import backends

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
    (`"compute_capability"`, `"device_name"`; empty for a non-NVIDIA GPU),
    on every backend (`kmp/backends/<backend>/devices.py`).
    """
    return backends.get("devices").gpus()


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


def _auto_policy():
    """What `"auto"` picks on this machine and backend.

    With no NVIDIA GPU, a backend whose CPU step is slower in bfloat16
    whatever the CPU (JAX) stays in float32; otherwise `_choose_auto_policy`
    decides.

    Returns:
        `(policy_name, reason)`.
    """
    gpus = _gpu_compute_capabilities()
    if not gpus:
        slower = backends.get("devices").cpu_bfloat16_slower()
        if slower is not None:
            return "float32", slower
    return _choose_auto_policy(gpus, _cpu_flags())
