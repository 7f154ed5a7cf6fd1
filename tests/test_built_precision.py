"""Precision is a property of the built model (issue 23), and what
`kmp.convert` and a `.keras` file hand back (issue 22).

- two threads calling one float16 model (a float32 layer, float token ids)
  get the single-threaded results, every time;
- kmp's modules import each other without a cycle, imports inside
  functions counted;
- `kmp.convert` of a built model is built and lists the original's layers;
- a `keep_float32` pattern that would backtrack for ever is refused at once,
  also from a `.keras` file.
"""

import ast
import pathlib
import threading
import time

import keras
import numpy as np
import pytest
from keras import layers

import kmp
from kmp import _keras_internals
from kmp import policy as policy_module

_VOCABULARY, _MAXLEN, _WIDTH = 5000, 4, 64


class _TokenEmbedding(layers.Layer):
    """keras.io's TokenAndPositionEmbedding shape: an Embedding inside."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(_VOCABULARY, _WIDTH)

    def call(self, ids):
        return self.token_emb(ids)


def _threaded_model():
    """float16 everywhere but a UnitNormalization (kmp's float32 list), fed
    float ids above 2048, which float16 would round."""
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((_MAXLEN,))
    embedded = _TokenEmbedding(name="embed")(inputs)
    # Near 300, so that the sum of 64 squares (~6e6) overflows float16: only
    # a float32 UnitNormalization gives finite, non-zero outputs.
    scaled = layers.Rescaling(30.0, offset=300.0)(embedded)
    normalized = layers.UnitNormalization(name="norm")(scaled)
    outputs = layers.Dense(3)(layers.Flatten()(normalized))
    return kmp.Model(inputs, [embedded, outputs])


def test_two_threads_calling_one_model_get_the_single_threaded_results():
    model = _threaded_model()
    ids = np.array([[2049, 4097, 3001, 7], [4999, 2051, 1, 2500]], "float32")
    reference_rows, reference_outputs = (np.asarray(t) for t in model(ids))
    table = model.get_layer("embed").token_emb.embeddings.numpy()
    # Exact ids (rows 2049, not 2048) and a float32 norm (finite, not 0).
    np.testing.assert_array_equal(
        reference_rows, table[ids.astype(int)].astype("float16").astype("float32")
    )
    assert np.all(np.isfinite(reference_outputs)) and np.any(reference_outputs != 0)
    policies = {
        layer.name: layer.dtype_policy
        for layer in model._flatten_layers(include_self=True, recursive=True)
    }

    results, errors = [], []
    start = threading.Barrier(2)

    def call_many_times():
        try:
            start.wait()
            for _ in range(40):
                rows, outputs = model(ids)
                results.append((np.asarray(rows), np.asarray(outputs)))
        except Exception as error:  # reported below, with the thread's result
            errors.append(error)

    threads = [threading.Thread(target=call_many_times) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == 80
    for rows, outputs in results:
        np.testing.assert_array_equal(rows, reference_rows)
        np.testing.assert_array_equal(outputs, reference_outputs)
    # Nothing was switched: every layer has the policy it was settled with.
    for layer in model._flatten_layers(include_self=True, recursive=True):
        assert layer.dtype_policy is policies[layer.name], layer.name
    rows, outputs = model(ids)
    np.testing.assert_array_equal(np.asarray(outputs), reference_outputs)


def _kmp_imports():
    """Module -> the kmp modules it imports, also inside functions, each by
    its dotted path (`kmp.backends.jax.step`), in the subfolders too."""
    package = pathlib.Path(kmp.__file__).parent  # the kmp under test
    paths = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    assert len(paths) >= 85, sorted(paths)  # a glob that finds nothing fails

    def module_of(dotted):
        """The longest prefix of `dotted` that is a kmp module."""
        parts = dotted.split(".")
        while parts and ".".join(parts) not in paths:
            parts.pop()
        return ".".join(parts)

    edges = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kmp":
                found |= {module_of(f"{node.module}.{alias.name}") for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {module_of(alias.name) for alias in node.names if alias.name.startswith("kmp.")}
        edges[name] = found - {name, ""}
    return edges


def test_no_import_cycle_between_kmp_modules():
    edges = _kmp_imports()
    # policy imported _token_ids inside a function, and _token_ids policy.
    assert "kmp.precision._token_ids" not in edges["kmp.policy"]
    cycles = []

    def visit(module, path):
        for imported in sorted(edges.get(module, ())):
            if imported in path:
                cycles.append(path[path.index(imported):] + [imported])
            elif len(path) < 12:
                visit(imported, path + [imported])

    for module in sorted(edges):
        visit(module, [module])
    assert cycles == []


class _NoConfig(layers.Layer):
    """A custom layer Keras cannot rebuild: its argument is not serializable."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def call(self, x):
        return x * self.scale()


class _Registered(layers.Layer):
    def call(self, x):
        return x * 2.0


@pytest.mark.filterwarnings("ignore:kmp.convert could not rebuild")
@pytest.mark.parametrize("custom", ["unrebuildable", "rebuildable"])
def test_converting_a_built_sequential_gives_a_built_model_with_its_layers(custom, tmp_path):
    layer = _NoConfig(lambda: 3.0) if custom == "unrebuildable" else _Registered()
    model = keras.Sequential([keras.Input((3,)), layer, layers.Dense(1)])
    assert model.built
    with keras.saving.custom_object_scope({"_Registered": _Registered}):
        converted = kmp.convert(model, "mixed_float16", compile=False)
    assert converted.built
    assert [type(layer).__name__ for layer in converted.layers] == [
        type(layer).__name__ for layer in model.layers
    ]
    if custom == "unrebuildable":
        assert converted.layers == model.layers  # the very layers: wrapped
    x = np.ones((2, 3), "float32")
    np.testing.assert_allclose(
        np.asarray(converted(x)), np.asarray(model(x)), rtol=1e-2, atol=1e-2
    )
    # Keras' BackupAndRestore refuses an unbuilt model ("must be built").
    converted.compile("sgd", "mse")
    history = converted.fit(
        x, np.zeros((2, 1), "float32"), epochs=2, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))],
    )
    assert len(history.history["loss"]) == 2


@pytest.mark.parametrize(
    "pattern",
    [r"re:(a+)+$", r"re:(a|aa)*b", r"re:(.*)*x", r"re:(\w+)\1", "re:" + ".*" * 6 + "x"],
)
def test_a_backtracking_keep_float32_pattern_is_refused_at_once(pattern):
    started = time.perf_counter()
    with pytest.raises(ValueError, match="bounded time.*Received: keep_float32 entry"):
        kmp.set_policy("float32", keep_float32=[pattern])
    assert time.perf_counter() - started < 1.0


def test_a_keras_file_with_a_backtracking_pattern_cannot_stall_loading(tmp_path):
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.convert(
        keras.Model(inputs, layers.Dense(2, name="head")(inputs)),
        keep_float32=["re:he.*"],
        compile=False,
    )
    path = tmp_path / "model.keras"
    model.save(path)
    # A file from elsewhere: the same model with a pattern that backtracks.
    import json
    import zipfile

    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(entries["config.json"])
    assert config["config"]["keep_float32"] == ["re:he.*"]
    config["config"]["keep_float32"] = ["re:(a+)+$"]
    entries["config.json"] = json.dumps(config).encode()
    planted = tmp_path / "planted.keras"
    with zipfile.ZipFile(planted, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    started = time.perf_counter()
    with pytest.raises(Exception, match="bounded time"):
        kmp.load_model(planted)
    assert time.perf_counter() - started < 5.0


def test_patterns_are_matched_against_bounded_names():
    # Three repeats are allowed, and cubic: against 2500 characters Python's
    # matcher takes seconds (0.7 s at 1200). Names past 256 characters are
    # not matched by patterns.
    rules = policy_module._Float32Rules.parse(["re:.*x.*x.*z"])
    started = time.perf_counter()
    assert rules.match(layers.Dense(1, name="x" * 2500)) is None
    assert time.perf_counter() - started < 1.0
    assert rules.match(layers.Dense(1, name="x_x_z")) == repr("re:.*x.*x.*z")
    assert rules.match(layers.Dense(1, name="x" * 250 + "z")) is not None


def test_a_functional_subclass_is_made_without_rewriting_its_class():
    kmp.set_policy("mixed_float16")

    class Net(kmp.Model):
        def __init__(self):
            inputs = keras.Input((4,))
            super().__init__(inputs, layers.Dense(2)(inputs), name="net")

    class Plain(kmp.Model):  # not functional: stays as it is written
        def call(self, x):
            return x

    net = Net()
    # Keras rewrites a keras.Model subclass's bases to add Functional; kmp
    # makes a class of its own for the instance and leaves Net as written.
    assert Net.__bases__ == (kmp.Model,)
    # kmp.Model's base is the thin class holding its one Keras override.
    assert kmp.Model.__bases__ == (_keras_internals.ModelBase,)
    assert _keras_internals.ModelBase.__bases__ == (keras.Model,)
    assert isinstance(net, Net) and isinstance(net, kmp.model.FunctionalModel)
    assert type(net).__name__ == "Net" and type(net) is not Net
    assert type(Net()) is type(net)  # one class per subclass
    assert not isinstance(Plain(), kmp.model.FunctionalModel)
    result = net(np.ones((3, 4), "float32"))
    assert keras.backend.standardize_dtype(result.dtype) == "float32"
    assert net.layers[-1].compute_dtype == "float16"
