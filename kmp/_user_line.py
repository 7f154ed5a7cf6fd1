"""Which line a kmp warning names: the user's, not kmp's, Keras' or the backend's.

A warning raised inside a callback hook or a model's first call would name
a line in Keras' `callback_list.py` or `trainer.py` with a fixed
`stacklevel`; `stacklevel()` counts the frames up to the first line outside
these libraries instead.
"""

import os
import sys

import keras

_KMP_AND_KERAS = tuple(os.path.dirname(path) + os.sep for path in (__file__, keras.__file__))
# The backends' own frames (a traced step, jax.jit), where they are imported.
_BACKEND_MODULES = ("tensorflow", "jax", "jaxlib")


def _library_dirs():
    dirs = list(_KMP_AND_KERAS)
    for name in _BACKEND_MODULES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(path) + os.sep)
    return tuple(dirs)


def stacklevel():
    """The `stacklevel` for `warnings.warn`, called from the function that
    warns, that names the first line outside kmp, Keras and the backend
    (the caller's own line where kmp is called directly)."""
    libraries = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(libraries):
        frame, level = frame.f_back, level + 1
    return level
