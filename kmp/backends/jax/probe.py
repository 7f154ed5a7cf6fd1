"""`kmp.diagnose`'s probe on JAX: not available, said in one clear error.

The probe needs the gradient of the loss with respect to every layer's
output. TensorFlow's tape gives it for the tensors a functional model
returns; under JAX it would mean re-running the model's graph layer by
layer with a perturbation added at each output, which Keras offers no
public way to do. So `kmp.diagnose` runs on TensorFlow only, and says how
to get there from a JAX process.
"""

from kmp.backends.jax import unsupported

_INSTEAD = (
    "Save the model (`model.save('model.keras')`) and run kmp.diagnose on it in a "
    "process started with KERAS_BACKEND=tensorflow; training on JAX reports which "
    "layer overflows through kmp.callbacks.LossScaleMonitor."
)


def check_supported():
    """Raises the error that says `kmp.diagnose` needs TensorFlow.

    Raises:
        NotImplementedError: always, naming the running backend and what to
            do instead.
    """
    raise unsupported("kmp.diagnose", _INSTEAD)


def run_pass(extractor, weights, x, y, loss_fns, scale):
    """As on TensorFlow (`kmp/backends/tensorflow/probe.py`); not available on JAX.

    Raises:
        NotImplementedError: always, as `check_supported`.
    """
    check_supported()
