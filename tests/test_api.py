import doctest
import importlib

import keras
import pytest
from keras import ops

import kmp

_PUBLIC = [
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


_PUBLIC_CALLBACKS = ["BackupAndRestore", "LossScaleMonitor", "ModelCheckpoint"]


def test_public_names_are_pinned():
    assert sorted(kmp.__all__) == sorted(_PUBLIC)
    for name in kmp.__all__:
        assert getattr(kmp, name) is not None
    assert sorted(kmp.callbacks.__all__) == _PUBLIC_CALLBACKS


@pytest.mark.parametrize("name", _PUBLIC_CALLBACKS)
def test_every_public_callback_is_a_documented_keras_callback(name):
    callback = getattr(kmp.callbacks, name)
    assert issubclass(callback, keras.callbacks.Callback)
    assert callback.__doc__ and len(callback.__doc__.strip()) > 40


@pytest.mark.parametrize("name", _PUBLIC)
def test_every_public_name_is_documented(name):
    obj = getattr(kmp, name)
    assert obj.__doc__ and len(obj.__doc__.strip()) > 40, name


@pytest.mark.parametrize("name", ["LossScaleOptimizer", "Model", "Policy"])
def test_configurable_classes_are_registered(name):
    cls = getattr(kmp, name)
    assert keras.saving.get_registered_name(cls) == f"kmp>{name}"
    assert keras.saving.get_registered_object(f"kmp>{name}") is cls


@pytest.mark.parametrize(
    "module_name",
    # kmp.float8's stats and compare are defined, with their examples, in
    # kmp/precision/_float8_measure.py: doctest runs a module's own functions.
    ["kmp.policy", "kmp.loss_scale", "kmp.convert", "kmp.float8", "kmp.precision._float8_measure"],
)
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    kmp.set_policy("float32")
    result = doctest.testmod(
        module,
        extraglobs={"kmp": kmp, "keras": keras, "ops": ops, **vars(module)},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    assert result.attempted > 0
    assert result.failed == 0


def test_keras_internals_are_imported_in_one_module_only():
    # Each `keras.src` name is a break waiting for the next Keras release:
    # kmp/_keras_internals.py is the one place that may use them.
    import ast
    import pathlib

    package = pathlib.Path(kmp.__file__).parent
    paths = sorted(package.rglob("*.py"))  # the subfolders too
    assert len(paths) >= 85, [path.name for path in paths]  # a glob that finds nothing fails
    offenders = []
    for path in paths:
        if path == package / "_keras_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute) and node.attr == "src":
                if isinstance(node.value, ast.Name) and node.value.id == "keras":
                    names = ["keras.src"]
            offenders += [
                f"{path.relative_to(package)}:{node.lineno} {name}"
                for name in names
                if name == "keras.src" or name.startswith("keras.src.")
            ]
    assert offenders == []
    from kmp import _keras_internals

    for name in _keras_internals.__all__:
        assert getattr(_keras_internals, name) is not None
