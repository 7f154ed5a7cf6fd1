"""The devices JAX sees, for policy `"auto"`, `kmp.diagnose` and `kmp doctor`.

Read from `jax.devices()`: asking TensorFlow would take the GPU's memory.
"""

import jax


def gpus():
    """`(device_name, details)` for each GPU JAX sees.

    Returns:
        List of `(device_name, details)`, `details` in the form TensorFlow's
        `tf.config.experimental.get_device_details` gives them:
        `"device_name"`, and `"compute_capability"` as `(major, minor)` on
        CUDA.
    """
    found = []
    for device in jax.devices():
        if device.platform != "gpu":
            continue
        details = {"device_name": getattr(device, "device_kind", str(device))}
        capability = getattr(device, "compute_capability", None)  # "9.0" on CUDA
        if capability:
            details["compute_capability"] = tuple(int(part) for part in str(capability).split("."))
        found.append((str(device), details))
    return found


def cpu_bfloat16_slower():
    """Why a bfloat16 step on this backend's CPU is slower than float32
    whatever the CPU, or `None` when the CPU's flags decide.

    On JAX, always: XLA's CPU backend computes bfloat16 by converting to
    float32. Measured on an AVX-512 BF16 CPU (docs/jax.md), a bfloat16 step
    ran at 0.70-0.88x the float32 one, for Keras' own policy too.

    Returns:
        String, the reason policy `"auto"` gives for float32.
    """
    return (
        "no GPU, and JAX's CPU backend (XLA) computes bfloat16 by converting "
        "to float32, which is slower than float32 itself"
    )
