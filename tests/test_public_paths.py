"""Every public path keeps working wherever kmp's private modules live.

kmp's core moves between private modules and folders; what users import, the
command they run and the names in the `.keras` files they saved must not.
"""

import importlib
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import kmp
from _helpers import assert_close_to_float16_rounding

_ROOT = pathlib.Path(__file__).parent.parent
_DATA = pathlib.Path(__file__).parent / "data"

# Public dotted paths outside `kmp.__all__` (tests/test_api.py pins that):
# users import these, the docs name them.
_PUBLIC_PATHS = [
    "kmp.callbacks.LossScaleMonitor",
    "kmp.callbacks.BackupAndRestore",
    "kmp.callbacks.ModelCheckpoint",
    "kmp.checkpoint.BackupAndRestore",
    "kmp.checkpoint.ModelCheckpoint",
    "kmp.checkpoint.write_atomically",
    "kmp.loss_scale.LossScaleOptimizer",
    "kmp.loss_scale.LossScaleState",
    "kmp.loss_scale.update_loss_scale",
    "kmp.loss_scale.all_finite",
    "kmp.policy.POLICY_NAMES",
    "kmp.policy.FLOAT32_LAYER_CLASSES",
    "kmp.policy.KEEP_FLOAT32_CLASSES",
    "kmp.model.Model",
    "kmp.model.FunctionalModel",
    "kmp.diagnose.FLOAT16_MAX",
    "kmp.diagnose.FLOAT16_SMALLEST_NORMAL",
    "kmp.cli.main",
]

# What `.keras` files name kmp's classes by: Keras finds a registered class by
# this name, never by its module, so a class may move but not be renamed.
_REGISTERED = {
    "kmp>Policy": "kmp.policy.Policy",
    "kmp>LossScaleOptimizer": "kmp.loss_scale.LossScaleOptimizer",
    "kmp>Model": "kmp.model.Model",
    "kmp>FunctionalModel": "kmp.model.FunctionalModel",
    "kmp>WrappedModel": "kmp.convert._WrappedModel",
    "kmp>LossScaleMonitor": "kmp.callbacks.LossScaleMonitor",
    "kmp>Float8Monitor": "kmp.float8.Float8Monitor",
    "kmp>_Float32Policy": None,  # private classes: found by name alone
    "kmp>_ExactIdsPolicy": None,
}


def _resolve(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", _PUBLIC_PATHS)
def test_public_path_resolves(path):
    assert _resolve(path) is not None


def test_public_paths_are_the_objects_kmp_exports():
    assert kmp.callbacks.BackupAndRestore is kmp.checkpoint.BackupAndRestore
    assert kmp.LossScaleOptimizer is kmp.loss_scale.LossScaleOptimizer
    assert kmp.Model is kmp.model.Model
    assert kmp.policy.POLICY_NAMES == ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16")


@pytest.mark.parametrize("name", sorted(_REGISTERED))
def test_registered_names_are_unchanged(name):
    cls = keras.saving.get_registered_object(name)
    assert cls is not None, name
    assert keras.saving.get_registered_name(cls) == name
    if _REGISTERED[name] is not None:
        assert _resolve(_REGISTERED[name]) is cls


def test_the_console_script_and_python_m_kmp_reach_the_cli():
    pyproject = (_ROOT / "pyproject.toml").read_text()
    assert 'kmp = "kmp.cli:main"' in pyproject
    result = subprocess.run(
        [sys.executable, "-m", "kmp", "--help"], capture_output=True, text=True, timeout=120, cwd=_ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "doctor" in result.stdout


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the file was saved on TensorFlow")
def test_a_keras_file_saved_before_the_move_into_folders_loads():
    # Saved by tests/data/make_saved_at_fa9caf1.py with kmp at fa9caf1 (kmp/ flat).
    kmp.set_policy("mixed_float16")
    model = keras.models.load_model(_DATA / "saved_at_fa9caf1.keras")
    assert isinstance(model, kmp.model.FunctionalModel)
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    assert model.optimizer.growth_interval == 3
    ids = np.array([[1, 2, 3, 15], [0, 5, 9, 12]], "float32")
    # Its softmax output now computes in float32 (saved: float16, then cast):
    # the same probabilities, to a float16 rounding.
    assert_close_to_float16_rounding(model.predict(ids, verbose=0),
                                     np.load(_DATA / "saved_at_fa9caf1.npy"), roundings=1)
    # Settled on its first call, as when it was saved.
    assert type(model.get_layer("norm").dtype_policy).__name__ == "_Float32Policy"
    model.fit(ids, np.array([0, 1]), epochs=1, verbose=0)
