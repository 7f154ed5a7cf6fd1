"""How `kmp doctor` starts without a working backend (standard library only).

`python -m kmp doctor` and the `kmp` console script both import the `kmp`
package, which imports Keras and its backend (TensorFlow or JAX), before any
command runs. When the backend is missing or broken that import fails; for the command line
(and only for it) the failure is kept in `import_error` so that `kmp doctor`
can report it with its own exit code instead of a traceback.

It also says what to do where Keras' default backend, TensorFlow, is not
installed (`BackendNotInstalled`): `import kmp` raises it, and `kmp doctor`
prints it.
"""

import contextlib
import importlib.util
import json
import os
import sys

# The exception that stopped `import kmp` when started as the command line.
import_error = None

# Python options that take a value as the next argument.
_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def started_as_command(orig_argv=None, argv0=None):
    """Whether this process is `python [options] -m kmp ...` or the `kmp` script."""
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    argv0 = (sys.argv[0] if sys.argv else "") if argv0 is None else argv0
    arguments = iter(orig_argv[1:])
    for argument in arguments:
        if argument == "-m":
            return next(arguments, None) in ("kmp", "kmp.cli")
        if argument.startswith("-m"):
            return argument[2:] in ("kmp", "kmp.cli")
        if argument in _OPTIONS_WITH_VALUE:
            next(arguments, None)
        elif not argument.startswith("-") or argument == "-c":
            break  # A script or -c: not the kmp command.
    return os.path.basename(argv0) in ("kmp", "kmp.exe", "kmp-script.py")


class BackendNotInstalled(ImportError):
    """Keras' backend is not installed; the message says which to install,
    or which `KERAS_BACKEND` to set."""


def requested_backend():
    """The Keras backend this process asks for, read as Keras reads it
    (`KERAS_BACKEND`, then `keras.json`, else TensorFlow) without importing
    Keras."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    try:
        with open(keras_json()) as config:
            return json.load(config).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def keras_json():
    """The path of the `keras.json` Keras reads (in `KERAS_HOME`, else
    `~/.keras`)."""
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(keras_home, "keras.json")


# Where Keras checks keras.json as it is imported: a private module, read
# as a path (Keras cannot be imported to ask). Should it move, `kmp doctor`
# says "<backend> is missing or broken" again, with Keras' error in it.
_KERAS_CONFIG_FILE = "keras/src/backend/config.py"


def raised_by_keras_config(error):
    """Whether `error` was raised while Keras read its configuration (an
    invalid `keras.json`), not by the backend."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:  # the frame that raised
        traceback = traceback.tb_next
    return traceback.tb_frame.f_code.co_filename.replace(os.sep, "/").endswith(_KERAS_CONFIG_FILE)


def _installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # a module hidden as `sys.modules[module] = None`
        return False


def tensorflow_not_installed():
    """A `BackendNotInstalled` for Keras on TensorFlow without TensorFlow.

    With JAX installed and `KERAS_BACKEND` unset (Keras then runs on
    TensorFlow, its default), the answer is `KERAS_BACKEND=jax`; installing
    TensorFlow is the other.
    """
    chosen = (
        "KERAS_BACKEND=tensorflow" if os.environ.get("KERAS_BACKEND")
        else "KERAS_BACKEND is not set, so Keras runs on TensorFlow (its default, or the "
        "backend keras.json names)"
    )
    install = 'pip install -e ".[tensorflow]" in your clone of kmp'
    if _installed("jax"):
        advice = (
            "JAX is installed: set KERAS_BACKEND=jax before importing kmp "
            f"(`export KERAS_BACKEND=jax`), or install TensorFlow: `{install}`."
        )
    else:
        advice = (
            f"Install TensorFlow: `{install}`; or JAX: "
            '`pip install -e ".[jax]"` and set KERAS_BACKEND=jax.'
        )
    return BackendNotInstalled(
        f"kmp runs on Keras' TensorFlow or JAX backend. {chosen} and TensorFlow "
        f"is not installed. {advice}"
    )


def is_tensorflow_missing(error):
    """Whether `error`, raised by `import keras` for Keras' TensorFlow
    backend, says TensorFlow is not installed (not broken: a broken
    TensorFlow raises its own error)."""
    wanted = requested_backend()
    return (
        wanted == "tensorflow"
        and isinstance(error, ModuleNotFoundError)
        and (error.name or "").split(".")[0] == "tensorflow"
    )


@contextlib.contextmanager
def keep_import_error():
    """Lets `import kmp` finish without its heavy parts for the command line.

    Anywhere else the exception propagates, exactly as without this guard.
    """
    global import_error
    try:
        yield
    except Exception as error:
        if not started_as_command():
            raise
        import_error = error
