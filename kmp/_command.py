"""How `kmp doctor` starts without a working backend (standard library only).

`python -m kmp doctor` and the `kmp` console script both import the `kmp`
package, which imports Keras and its backend (TensorFlow or JAX), before any
command runs. When the backend is missing or broken that import fails; for the command line
(and only for it) the failure is kept in `import_error` so that `kmp doctor`
can report it with its own exit code instead of a traceback.
"""

import contextlib
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
