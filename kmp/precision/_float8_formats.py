"""The two float8 formats Keras uses, and the three tensors a float8 layer quantizes."""

import ml_dtypes

# The largest finite values of the two float8 formats Keras uses.
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
E5M2_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)  # 57344
# The smallest positive (subnormal) values: anything below half of them
# rounds to zero.
E4M3_TINY = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).smallest_subnormal)  # 2**-9
E5M2_TINY = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).smallest_subnormal)  # 2**-16

# Each float8 tensor of a layer: its format, and the layer's (public)
# attributes for its amax history and its scale.
TENSORS = (
    ("inputs", "e4m3", "inputs_amax_history", "inputs_scale"),
    ("kernel", "e4m3", "kernel_amax_history", "kernel_scale"),
    ("outputs_grad", "e5m2", "outputs_grad_amax_history", "outputs_grad_scale"),
)
FORMAT_LIMITS = {"e4m3": (E4M3_MAX, E4M3_TINY), "e5m2": (E5M2_MAX, E5M2_TINY)}
