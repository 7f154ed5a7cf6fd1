"""Diagnosis: what `kmp.diagnose` measures and reads from a model.

The public side is `kmp/diagnose.py` (`kmp.diagnose`, `kmp.DiagnosisReport`);
its TensorFlow tape is the backend's `probe` (`kmp/backends/tensorflow/`):

- `_float16.py`: float16's range, and where it rounds to inf, 0 or a subnormal.
- `_probe.py`: the measurements: two copies of the model, layer by layer.
- `_static.py`: the static checks, read from the model without data.
- `_report.py`: `kmp.DiagnosisReport`, as a table, a dict or JSON.
"""
