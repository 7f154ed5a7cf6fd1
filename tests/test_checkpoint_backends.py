"""kmp/backends/{tensorflow,jax}/checkpoint.py: the same functions, and the
same answers for one process (BackupAndRestore's own tests cover clusters)."""

import ast
import inspect
import pathlib

import keras

import kmp
from kmp import backends

_BACKENDS = pathlib.Path(kmp.__file__).parent / "backends"


def _public_functions(backend):
    """`{name: argument names}` of a backend's checkpoint module, read
    without importing it (the other backend's library may be missing)."""
    tree = ast.parse((_BACKENDS / backend / "checkpoint.py").read_text())
    return {
        node.name: [arg.arg for arg in node.args.args]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }


def test_both_backends_offer_the_same_checkpoint_functions():
    tensorflow, jax = _public_functions("tensorflow"), _public_functions("jax")
    assert tensorflow == jax
    assert set(tensorflow) == {"this_worker", "gather_from_workers"}
    running = backends.get("checkpoint")
    assert {
        name: list(inspect.signature(getattr(running, name)).parameters)
        for name in tensorflow
    } == tensorflow


def test_one_process_is_no_cluster_and_gathers_its_own_value():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    # What BackupAndRestore passes: no `distribute_strategy` on JAX, the
    # default strategy on TensorFlow.
    strategy = getattr(model, "distribute_strategy", None)
    checkpoint = backends.get("checkpoint")
    assert checkpoint.this_worker(strategy) is None
    gathered = checkpoint.gather_from_workers(strategy, "worker-0", True)
    assert gathered == {"worker-0": 1} and type(gathered["worker-0"]) is int
    assert checkpoint.gather_from_workers(strategy, "chief-0", 7) == {"chief-0": 7}
