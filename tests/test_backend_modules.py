"""One core, one module per backend (issue 32), checked on the sources.

`kmp.backends.get("devices")` returns the running backend's module, so each
module under kmp/backends/tensorflow/ has a namesake under kmp/backends/jax/
offering the same public functions and constants; and a backend-neutral core
module imports neither TensorFlow nor JAX (not even inside a function) and
does not branch on `keras.backend.backend()`. Read with `ast`, so the test
holds whichever backends are installed.
"""

import ast
import pathlib

import pytest

KMP = pathlib.Path(__file__).resolve().parents[1] / "kmp"
BACKENDS = ("tensorflow", "jax")

# Core modules already free of TensorFlow and JAX; every core module joins
# this list as issue 32 moves its backend code into kmp/backends/.
NEUTRAL_CORE = (
    "policy.py",
    "_hardware.py",
    "_keep_float32.py",
    "_float32_layers.py",
    "cli.py",
    "_command.py",
)


def _public_names(path):
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {name for name in names if not name.startswith("_")}


def _backend_modules(backend):
    return {
        path.name: path
        for path in (KMP / "backends" / backend).glob("*.py")
        if path.name != "__init__.py"
    }


def test_each_backend_module_has_a_namesake_with_the_same_public_names():
    modules = {backend: _backend_modules(backend) for backend in BACKENDS}
    assert sorted(modules["tensorflow"]) == sorted(modules["jax"])
    assert "devices.py" in modules["tensorflow"]
    for name, path in modules["tensorflow"].items():
        assert _public_names(path) == _public_names(modules["jax"][name]), name


def _backend_uses(tree):
    """`(line, what)` for each import of tensorflow or jax and each comparison
    with `keras.backend.backend()` in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        for module in modules:
            if module.split(".")[0] in BACKENDS:
                found.append((node.lineno, f"import {module}"))
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if "backend.backend()" in ast.unparse(side):
                    found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("name", NEUTRAL_CORE)
def test_core_module_imports_no_backend_and_does_not_branch_on_it(name):
    assert _backend_uses(ast.parse((KMP / name).read_text())) == []


def test_the_check_sees_imports_inside_functions_and_backend_branches():
    source = (
        "def f():\n"
        "    import tensorflow as tf\n"
        "    from jax import numpy\n"
        "    if keras.backend.backend() == 'jax':\n"
        "        pass\n"
    )
    assert [line for line, _ in _backend_uses(ast.parse(source))] == [2, 3, 4]
