"""kmp changes nothing in TensorFlow or Keras: no class, function or module
attribute, and no attribute on objects it was never handed.

tests/_foreign_identity.py runs in a fresh process (this one imported kmp in
conftest.py already): it records the identity of every attribute of every
TensorFlow and Keras class and module, imports kmp, runs fit, a custom
train_step, a GradientTape loop, kmp.convert, kmp.export and kmp.diagnose, and
reports what changed after each.
"""

import json
import os
import subprocess
import sys

import keras
import pytest
from _helpers import child_env

import _foreign_identity

STAGES = ["import kmp", "fit", "custom train_step", "GradientTape loop", "kmp.convert", "kmp.export",
          "kmp.diagnose"]


@pytest.fixture(scope="module")
def report():
    script = os.path.join(os.path.dirname(__file__), "_foreign_identity.py")
    result = subprocess.run([sys.executable, script], env=child_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_snapshot_does_not_change_under_plain_keras(report):
    # A plain Keras fit before kmp is imported changes nothing the snapshot
    # records: what a later stage reports, kmp did.
    assert report["control"] == []


@pytest.mark.parametrize("stage", STAGES)
def test_kmp_changes_no_tensorflow_or_keras_attribute(report, stage):
    changed = report["stages"][stage]
    assert changed == [], f"{stage} changed {len(changed)} TensorFlow/Keras attributes:\n" + "\n".join(changed)


def test_a_plain_keras_model_beside_kmp_is_as_without_kmp(report):
    # Trained after all of the above, a plain keras.Model, its layers,
    # optimizer and metrics have the instance attributes they had before kmp.
    assert report["plain_model"] == []


def test_models_handed_to_convert_keep_their_attributes(report):
    # kmp.convert leaves its argument untouched: after the converted models
    # trained (the wrapped one shares the original's layers), the original
    # models and their layers have the instance attributes they had.
    assert report["convert_argument"] == []


def test_objects_kmp_was_not_given_to_keep_carry_no_kmp_attribute(report):
    # The plain model, the models handed to kmp.convert and kmp.diagnose (and
    # their layers), the user's GradientTapes and the MirroredStrategy.
    assert report["kmp_attributes_on_foreign_objects"] == []


# The snapshot itself, in this process.


def test_changed_names_a_replaced_method_an_added_attribute_and_new_bases(monkeypatch):
    before = _foreign_identity.snapshot()
    monkeypatch.setattr(keras.layers.Dense, "call", lambda self, inputs: inputs)
    monkeypatch.setattr(keras.layers.Layer, "_planted", 1, raising=False)
    monkeypatch.setattr(sys.modules["keras.src.ops.numpy"], "planted", lambda x: x, raising=False)
    bases = keras.layers.Dropout.__bases__
    keras.layers.Dropout.__bases__ = tuple(list(bases))  # the same bases, assigned anew
    try:
        after = _foreign_identity.snapshot()
    finally:
        keras.layers.Dropout.__bases__ = bases
    assert _foreign_identity.changed(before, after) == [
        "class keras.src.layers.core.dense.Dense: call",
        "class keras.src.layers.layer.Layer: _planted",
        "class keras.src.layers.regularization.dropout.Dropout: __bases__",
        "module keras.src.ops.numpy: planted",
    ]


def test_kmp_attributes_lists_each_kmp_attribute_by_class():
    layer = keras.layers.Dense(1)
    layer._kmp_switched = True
    assert _foreign_identity.kmp_attributes([layer, keras.layers.Dense(2)]) == [
        "keras.src.layers.core.dense.Dense: _kmp_switched"
    ]
