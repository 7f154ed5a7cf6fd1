"""The devices TensorFlow sees, for policy `"auto"`, `kmp.diagnose` and `kmp doctor`."""

import tensorflow as tf


def gpus():
    """`(device_name, details)` for each GPU TensorFlow sees.

    Returns:
        List of `(device_name, details)`, `details` as
        `tf.config.experimental.get_device_details` gives them
        (`"compute_capability"` as `(major, minor)`, `"device_name"`; empty
        for a non-NVIDIA GPU).
    """
    return [
        (gpu.name, tf.config.experimental.get_device_details(gpu))
        for gpu in tf.config.list_physical_devices("GPU")
    ]


def cpu_bfloat16_slower():
    """Why a bfloat16 step on this backend's CPU is slower than float32
    whatever the CPU, or `None` when the CPU's flags decide.

    On TensorFlow, `None`: oneDNN runs bfloat16 natively on a CPU with
    AVX-512 BF16 or AMX, so policy `"auto"` follows the CPU's flags.

    Returns:
        `None`.
    """
    return None
