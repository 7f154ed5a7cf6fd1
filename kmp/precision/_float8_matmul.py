"""The float8 matmul `kmp doctor` times, and the GPUs that run it natively."""

import keras
import numpy as np
from keras import ops

# Float8 tensor cores: NVIDIA compute capability 8.9 (Ada) and above.
FLOAT8_COMPUTE_CAPABILITY = (8, 9)


def has_float8_tensor_cores(compute_capability):
    """Whether a GPU of `compute_capability` (`"9.0"`, `(9, 0)` or `None`)
    has float8 tensor cores."""
    if compute_capability is None:
        return False
    if isinstance(compute_capability, str):
        major, _, minor = compute_capability.partition(".")
        compute_capability = (int(major), int(minor or 0))
    return tuple(compute_capability) >= FLOAT8_COMPUTE_CAPABILITY


def matmul_step(n, float8):
    """`step()`: an `n`x`n` @ `n`x`n` matmul by a `Dense` layer under
    `mixed_bfloat16`, in float8 (Keras' float8 path, inference: inputs and
    kernel quantized to e4m3) or not, compiled by XLA; `step()` returns a
    Python float (the sum of the output), so it waits for the device.

    What `kmp doctor` times on a GPU with float8 tensor cores: XLA rewrites
    the quantize-dequantize around the matmul into one float8 GEMM there.
    """
    inputs = keras.Input((n,), batch_size=n)
    dense = keras.layers.Dense(n, use_bias=False, dtype="mixed_bfloat16")
    outputs = keras.layers.Lambda(lambda y: ops.sum(ops.cast(y, "float32")))(dense(inputs))
    model = keras.Model(inputs, outputs)
    if float8:
        dense.quantize("float8")
    model.compile(jit_compile=True)
    x = np.random.default_rng(0).normal(size=(n, n)).astype("float32")
    return lambda: float(np.asarray(model.predict_on_batch(x)))
