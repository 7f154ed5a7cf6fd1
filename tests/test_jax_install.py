"""kmp on JAX imports no TensorFlow, and runs where TensorFlow is not installed.

A JAX user installs `pip install -e ".[jax]"`, without TensorFlow (1.9 GB
against JAX's 0.4 GB, and a second CUDA stack in the process on a GPU).
Each test starts a fresh Python with `KERAS_BACKEND=jax`, as a user's script
starts, since this process has imported whatever other tests import: the
first watches `sys.modules` where TensorFlow is installed, the second makes
`import tensorflow` fail, from before `import kmp`, as it does where it is not.
What needs TensorFlow on JAX, a SavedModel export, names it:
test_without_tensorflow.py. `.ci/run` runs kmp's JAX step, callbacks, convert
and export file and these again in an environment without TensorFlow
(`.venv-jax/`).
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
from _helpers import child_env

# Prints, as JSON, whether `tensorflow` is imported after each stage of a
# user's script: import Keras, import kmp, build, fit, evaluate and predict
# one small kmp.Model under mixed_bfloat16.
_STAGES = """
import json
import sys

import numpy as np

def tensorflow_imported():
    return "tensorflow" in sys.modules

report = {"tensorflow": {}}
import keras
report["tensorflow"]["import keras"] = tensorflow_imported()
import kmp
report["tensorflow"]["import kmp"] = tensorflow_imported()
kmp.set_policy("mixed_bfloat16")
inputs = keras.Input((4,))
outputs = keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(inputs))
model = kmp.Model(inputs, outputs)
model.compile("adam", "mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(32, 4)).astype("float32")
y = rng.normal(size=(32, 2)).astype("float32")
report["tensorflow"]["build"] = tensorflow_imported()
history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
report["loss"] = history.history["loss"]
report["evaluate"] = model.evaluate(x, y, batch_size=8, verbose=0)
report["predictions"] = model.predict(x[:4], verbose=0).tolist()
report["tensorflow"]["fit, evaluate, predict"] = tensorflow_imported()
report["backend"] = keras.backend.backend()
report["compute_dtype"] = model.layers[1].compute_dtype
report["variable_dtype"] = model.layers[1].kernel.dtype
print(json.dumps(report))
"""

# Makes `import tensorflow` (and any submodule) fail as where it is not
# installed, whatever this environment has.
_NO_TENSORFLOW = """
import importlib.abc
import sys

class NoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTensorFlow())
"""


def _run(script):
    env = child_env()
    env["KERAS_BACKEND"] = "jax"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_trained(report):
    assert report["backend"] == "jax"
    assert (report["compute_dtype"], report["variable_dtype"]) == ("bfloat16", "float32")
    assert len(report["loss"]) == 2 and np.all(np.isfinite(report["loss"]))
    assert np.isfinite(report["evaluate"])
    assert np.asarray(report["predictions"]).shape == (4, 2)
    assert np.all(np.isfinite(report["predictions"]))


def test_import_kmp_and_a_mixed_bfloat16_fit_on_jax_import_no_tensorflow():
    report = _run(_STAGES)
    _assert_trained(report)
    imported = [stage for stage, imported in report["tensorflow"].items() if imported]
    assert not imported, f"tensorflow in sys.modules on KERAS_BACKEND=jax, after: {imported}"


def test_kmp_trains_saves_and_loads_on_jax_with_tensorflow_unimportable():
    # Also a mixed_float16 fit whose one step overflows (the step is skipped
    # and the loss scale backs off) and a .keras round trip.
    report = _run(_NO_TENSORFLOW + _STAGES + """
import os
import tempfile

kmp.set_policy("mixed_float16")
inputs = keras.Input((4,))
model = kmp.Model(inputs, keras.layers.Dense(2)(inputs))
model.compile(kmp.LossScaleOptimizer("sgd", initial_scale=2.0**24), "mse")
report["scale_before"] = float(model.optimizer.loss_scale)
x16 = x.copy()
x16[0] = 3e4
history = model.fit(x16, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
report["skipped_steps"] = history.history["skipped_steps"]
report["scale_after"] = float(model.optimizer.loss_scale)
path = os.path.join(tempfile.mkdtemp(), "model.keras")
model.save(path)
loaded = kmp.load_model(path)
report["loaded_scale"] = float(loaded.optimizer.loss_scale)
report["round_trip"] = bool(np.array_equal(loaded.predict(x[:4], verbose=0),
                                           model.predict(x[:4], verbose=0)))
print(json.dumps(report))
""")
    _assert_trained(report)
    assert report["skipped_steps"] == [1]
    assert report["scale_after"] == report["scale_before"] / 2 == 2.0**23
    assert report["loaded_scale"] == report["scale_after"]
    assert report["round_trip"]
