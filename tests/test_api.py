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


@pytest.mark.parametrize("module_name", ["kmp.policy", "kmp.loss_scale", "kmp.convert"])
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
