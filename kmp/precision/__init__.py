"""Precision: which dtype each layer computes and stores in, settled once.

The public side is `kmp/policy.py` (`kmp.Policy`, `"auto"`, `keep_float32`)
and `kmp.convert`/`kmp.summary` (`kmp/convert.py`); this folder holds what
they and `kmp.Model` share:

- `_hardware.py`: the hardware behind policy `"auto"` (GPUs, CPU flags).
- `_float32_layers.py`: which layers compute in float32 in a 16-bit model,
  and kmp's `_Float32Policy` for them.
- `_keep_float32.py`: the user's `keep_float32` rules.
- `_settle.py`: a model's precision, settled once on its own layers.
- `_token_ids.py`: token ids that reach an embedding as 16-bit floats, kept
  exact (`_ExactIdsPolicy`).
- `_layer_dtypes.py`: what `kmp.summary` reports for each layer.
- `_float8_rule.py`: which Dense and EinsumDense layers `kmp.float8` puts in
  float8, and why the others stay in 16 bits (also read by `kmp.summary`).
- `_float8_measure.py`: what float8 does to each float8 layer's tensors and
  output (`kmp.float8.stats`, `compare`).
- `_float8_probe.py`: the tapped copy of a model in which those
  measurements read each float8 layer's inputs, outputs and output
  gradient, at any depth.
- `_float8_formats.py`: the float8 formats' limits and the tensors each
  float8 layer quantizes.
- `_float8_training.py`: a model's float8 layers, and the warning where
  `fit` would run them without `training=True` (read by `kmp.float8.enable`
  and `kmp.Model`).
- `_compensated.py`: any Keras optimizer's update of a bfloat16 variable
  computed in float32 and written with Kahan compensation, within a
  `kmp.LossScaleOptimizer` (docs/design.md, "bfloat16 weights").
- `_float8_matmul.py`: the float8 matmul `kmp doctor` times, and which GPUs
  run it natively.
"""
