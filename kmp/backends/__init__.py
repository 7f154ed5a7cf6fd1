"""What differs between Keras' backends: one package per backend.

kmp's core (policies, the scaling rule and the scaler, `kmp.Model`, the
callbacks and checkpoints, `kmp.convert`) imports neither TensorFlow nor JAX.
What differs lives in `kmp/backends/tensorflow/` and `kmp/backends/jax/`, in
modules of the same names that offer the same functions (the step and the
train step, gradients, the workers a checkpoint agrees with, the devices,
`diagnose`'s probe, `kmp doctor`'s ops; `replicas` and `distribute`, for
`tf.distribute`, are TensorFlow's alone). The core reaches the
running backend's module with `backends.get("step")`: the backend is chosen
once, from `keras.backend.backend()`, and a module is imported the first time
it is asked for, so `import kmp` under `KERAS_BACKEND=jax` imports no
TensorFlow.

A backend module may import the core; the core imports a backend module only
through `get`, inside the function that needs it (`kmp.scaling._gradients` takes
`gradients`, which imports nothing of kmp's, at import).
"""

import functools
import sys

import keras

NAME = keras.backend.backend()


# Cached: a step asks for the same modules at every trace and, run eagerly,
# at every step; a cached answer costs no Python call.
@functools.cache
def get(module):
    """Returns the running backend's module `module` ("step", "devices", ...)."""
    name = f"{__name__}.{NAME}.{module}"
    loaded = sys.modules.get(name)
    if loaded is None:
        # The builtin, not importlib: `get` runs inside steps AutoGraph
        # converts, which would try to convert importlib's functions too.
        __import__(name)
        loaded = sys.modules[name]
    return loaded
