"""kmp: mixed precision for Keras 3 on TensorFlow and JAX, in one line.

```python
import kmp
kmp.set_policy("mixed_float16")
```
"""

from kmp import _command

# `kmp doctor` must start when TensorFlow is missing or broken, to say so
# (kmp/_command.py); every other `import kmp` fails here as before.
_BACKENDS = ("tensorflow", "jax")


def _check_backend(backend):
    if backend not in _BACKENDS:
        raise ImportError(
            "kmp supports the TensorFlow and JAX backends of Keras. Received: "
            f"backend={backend!r}. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax "
            "before importing keras"
        )


with _command.keep_import_error():
    import os as _os
    import sys as _sys

    if "keras" not in _sys.modules and _os.environ.get("KERAS_BACKEND"):
        # Before Keras imports a backend it may not have (torch).
        _check_backend(_os.environ["KERAS_BACKEND"])
    try:
        import keras as _keras
    except ModuleNotFoundError as _error:
        # keras.json names a backend kmp does not support, which is not
        # installed (torch): say so, not "No module named 'torch'".
        if _command.requested_backend() not in _BACKENDS:
            _check_backend(_command.requested_backend())
        # Keras on TensorFlow, its default, without TensorFlow (a JAX-only
        # install that forgot KERAS_BACKEND): say what to do, not
        # "No module named 'tensorflow'".
        if not _command.is_tensorflow_missing(_error):
            raise
        raise _command.tensorflow_not_installed() from None

    _check_backend(_keras.backend.backend())

    from kmp import callbacks
    from kmp import float8
    from kmp.convert import convert
    from kmp.convert import summary
    from kmp.diagnose import DiagnosisReport
    from kmp.diagnose import diagnose
    from kmp.export import export
    from kmp.export import load_model
    from kmp.loss_scale import LossScaleOptimizer
    from kmp.model import Model
    from kmp.policy import Policy
    from kmp.policy import get_policy
    from kmp.policy import policy_scope
    from kmp.policy import set_policy

    # Every kmp class is registered with Keras by now (kmp/_registered.py).
    from kmp import _registered

    _registered.remember()

__version__ = "0.1.0"

__all__ = [
    "DiagnosisReport",
    "LossScaleOptimizer",
    "Model",
    "Policy",
    "callbacks",
    "convert",
    "diagnose",
    "export",
    "float8",
    "get_policy",
    "load_model",
    "policy_scope",
    "set_policy",
    "summary",
]
