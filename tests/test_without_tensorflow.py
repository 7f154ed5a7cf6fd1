"""kmp on JAX where TensorFlow is not installed: what needs it says so by name.

A child process runs with `KERAS_BACKEND=jax` and `sys.modules["tensorflow"]
= None`, which makes every `import tensorflow` raise `ModuleNotFoundError`
as on a machine without it. Writing a SavedModel needs TensorFlow on every
backend (Keras builds its graph with `jax2tf` on JAX): `kmp.export` and
`kmp.Model.export` must say so, with the command that installs it, and
leave the model as it was; `kmp.diagnose` must give its own error, not an
import error.

The child hides TensorFlow before it imports Keras and kmp, as on a JAX-only
install (`tests/test_jax_install.py` trains, saves and loads there).
`tests/conftest.py` runs this file in the JAX pass.
"""

import json
import subprocess
import sys

import pytest
from _helpers import child_env

CHILD = r"""
import json
import os
import sys

sys.modules["tensorflow"] = None  # as if not installed

import keras
import numpy as np

import kmp

kmp.set_policy("mixed_float16")
inputs = keras.Input((4,))
hidden = keras.layers.Dense(8, name="hidden")(inputs)
plain = keras.Model(inputs, keras.layers.Dense(2, name="last")(hidden))
inputs = keras.Input((4,))
hidden = keras.layers.Dense(8, name="hidden")(inputs)
ours = kmp.Model(inputs, keras.layers.Dense(2, name="last")(hidden))


def policies(model):
    return [layer.dtype_policy.name for layer in model.layers]


calls = {
    "kmp.export": (plain, lambda path: kmp.export(plain, path, inference_policy="float32")),
    "Model.export": (ours, lambda path: ours.export(path, format="tf_saved_model")),
}
result = {}
for name, (model, call) in calls.items():
    path = os.path.join(sys.argv[1], name)
    before = policies(model)
    try:
        call(path)
        result[name] = {"raised": None}
    except Exception as error:
        result[name] = {"raised": type(error).__name__, "message": str(error)}
    result[name]["written"] = os.path.exists(path)
    result[name]["policies_kept"] = policies(model) == before
try:
    kmp.diagnose(plain, (np.ones((2, 4), "float32"), np.zeros((2, 2), "float32")), loss="mse")
    result["diagnose"] = {"raised": None}
except Exception as error:
    result["diagnose"] = {"raised": type(error).__name__, "message": str(error)}
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def child_result(tmp_path_factory):
    env = child_env()
    env["KERAS_BACKEND"] = "jax"
    folder = tmp_path_factory.mktemp("without_tensorflow")
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder)],
        env=env, cwd=str(folder), capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert completed.returncode == 0 and lines, completed.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("call", ["kmp.export", "Model.export"])
def test_a_saved_model_export_without_tensorflow_names_it_and_the_install_command(
    child_result, call
):
    result = child_result[call]
    assert result["raised"] == "ImportError", result
    message = result["message"]
    assert message.startswith(
        'Exporting a SavedModel (format="tf_saved_model", the default) needs '
        'TensorFlow: pip install -e ".[tensorflow]" in your clone of kmp.'
    ), message
    assert "KERAS_BACKEND='jax'" in message
    assert message.endswith('Received: format="tf_saved_model"'), message
    # Nothing changed by a call that raises: no artifact, the trained policies.
    assert result["written"] is False
    assert result["policies_kept"] is True


def test_diagnose_without_tensorflow_is_its_own_error_not_an_import_error(child_result):
    result = child_result["diagnose"]
    assert result["raised"] == "NotImplementedError", result
    assert result["message"].startswith(
        "kmp.diagnose needs the TensorFlow backend of Keras; this process runs "
        "KERAS_BACKEND='jax'. Save the model"
    ), result["message"]
    assert "kmp.callbacks.LossScaleMonitor" in result["message"]


# Keras runs on TensorFlow when KERAS_BACKEND is unset: a JAX-only install
# that forgot it ended in Keras' bare "No module named 'tensorflow'", and
# `kmp doctor` said "pip install tensorflow" (issue 38).
IMPORT_CHILD = r"""
import json
import sys

sys.modules["tensorflow"] = None  # as if not installed
if sys.argv[1] == "hide jax":
    sys.modules["jax"] = None
try:
    import kmp
    print("RESULT " + json.dumps({"raised": None}))
except ImportError as error:
    print("RESULT " + json.dumps({
        "raised": type(error).__name__, "message": str(error),
        "chained": error.__cause__ is not None or not error.__suppress_context__,
    }))
"""

DOCTOR_CHILD = r"""
import sys

sys.modules["tensorflow"] = None  # as if not installed
sys.argv = ["kmp", "doctor", "--json"]  # the console script
from kmp.cli import main

sys.exit(main())
"""


def _without_keras_backend(tmp_path):
    env = child_env()
    del env["KERAS_BACKEND"]
    env["KERAS_HOME"] = str(tmp_path)  # no keras.json naming a backend
    return env


def _import_result(tmp_path, how):
    completed = subprocess.run(
        [sys.executable, "-c", IMPORT_CHILD, how], env=_without_keras_backend(tmp_path),
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert completed.returncode == 0 and lines, completed.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_import_kmp_with_only_jax_and_no_keras_backend_names_keras_backend_jax(tmp_path):
    result = _import_result(tmp_path, "keep jax")
    assert result["raised"] == "BackendNotInstalled", result
    assert result["message"] == (
        "kmp runs on Keras' TensorFlow or JAX backend. KERAS_BACKEND is not set, so Keras runs "
        "on TensorFlow (its default, or the backend keras.json names) and TensorFlow is not "
        "installed. JAX is installed: "
        "set KERAS_BACKEND=jax before importing kmp (`export KERAS_BACKEND=jax`), or install "
        'TensorFlow: `pip install -e ".[tensorflow]" in your clone of kmp`.'
    )
    assert result["chained"] is False  # kmp's message is what the user reads


def test_import_kmp_with_no_backend_installed_names_both_extras(tmp_path):
    result = _import_result(tmp_path, "hide jax")
    assert result["raised"] == "BackendNotInstalled", result
    assert result["message"].endswith(
        'Install TensorFlow: `pip install -e ".[tensorflow]" in your clone of kmp`; or JAX: '
        '`pip install -e ".[jax]"` and set KERAS_BACKEND=jax.'
    ), result["message"]


def test_kmp_doctor_with_only_jax_and_no_keras_backend_gives_the_same_advice(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-c", DOCTOR_CHILD], env=_without_keras_backend(tmp_path),
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 3, completed.stderr[-3000:]  # cli.EXIT_NO_BACKEND
    report = json.loads(completed.stdout)
    assert report["exit_code"] == 3
    assert report["error"] == _import_result(tmp_path, "keep jax")["message"]
    assert "KERAS_BACKEND=jax" in completed.stderr and "Traceback" not in completed.stderr
