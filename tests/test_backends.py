"""kmp/backends/: one package per Keras backend, the same modules and
functions in each, and a core that reaches them only through
`kmp.backends.get` (so that `import kmp` on JAX imports no TensorFlow)."""

import ast
import inspect
import pathlib
import re

import keras

import kmp
from kmp import backends

_KMP = pathlib.Path(kmp.__file__).parent
_BACKENDS = _KMP / "backends"
# At least this many modules in the core and in each backend: a glob that
# stops finding them (a move into folders) fails instead of checking nothing.
_CORE_MODULES = 61
_BACKEND_MODULES = 10


def _core():
    """Every module of the core, in its subfolders too: kmp/ but kmp/backends/."""
    paths = [path for path in sorted(_KMP.rglob("*.py")) if _BACKENDS not in path.parents]
    assert len(paths) >= _CORE_MODULES, [path.name for path in paths]
    return paths


def _backend(name):
    """Every module of one backend's package."""
    paths = sorted((_BACKENDS / name).rglob("*.py"))
    assert len(paths) >= _BACKEND_MODULES, [path.name for path in paths]
    return paths


def _public(backend, module):
    """`{name: argument names}` of a backend module's public functions and
    `{name}` of its constants, read without importing it (the other
    backend's library may be missing)."""
    tree = ast.parse((_BACKENDS / backend / f"{module}.py").read_text())
    functions = {
        node.name: [arg.arg for arg in node.args.args + node.args.kwonlyargs]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }
    constants = {
        target.id
        for node in tree.body if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id.isupper() and not target.id.startswith("_")
    }
    return functions, constants


def _modules_the_core_asks_for():
    """The names the core passes to `backends.get`, read from its source."""
    names = set()
    for path in _core():
        names.update(re.findall(r'backends\.get\("(\w+)"\)', path.read_text()))
    return names


def test_each_module_the_core_asks_for_is_in_both_backends_with_the_same_names():
    asked = _modules_the_core_asks_for()
    assert {"step", "trainer", "gradients", "workers", "probe"} <= asked
    for module in sorted(asked):
        tensorflow, jax = _public("tensorflow", module), _public("jax", module)
        # Keras' own JAX train step takes `state` before `data`: names, not arguments.
        assert set(tensorflow[0]) == set(jax[0]), module
        assert tensorflow[1] == jax[1], module
        running = backends.get(module)
        assert running.__name__ == f"kmp.backends.{keras.backend.backend()}.{module}"
        for name, arguments in _public(keras.backend.backend(), module)[0].items():
            assert list(inspect.signature(getattr(running, name)).parameters) == arguments


# The one module that holds the private names kmp uses (tests/test_boundary.py):
# its three TensorFlow functions import TensorFlow when they are called, and
# only kmp/backends/tensorflow/ calls them.
_BOUNDARY = _KMP / "_keras_internals.py"


def test_the_core_imports_no_backend_library_and_branches_on_no_backend():
    for path in _core():
        source = path.read_text()
        if path != _BOUNDARY:
            assert not re.search(r"^\s*(import|from) (tensorflow|jax)\b", source, re.M), path.relative_to(_KMP)
        assert not re.search(r"backend\(\) *[!=]=", source), path.relative_to(_KMP)
        # A backend module is reached through `backends.get`, never imported.
        assert not re.search(r"^\s*from kmp\.backends\.\w+ import|import kmp\.backends\.\w+",
                             source, re.M), path.relative_to(_KMP)


def test_one_process_is_no_cluster_and_gathers_its_own_value():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    # What BackupAndRestore passes: no `distribute_strategy` on JAX, the
    # default strategy on TensorFlow.
    strategy = getattr(model, "distribute_strategy", None)
    workers = backends.get("workers")
    assert workers.this_worker(strategy) is None
    gathered = workers.gather_from_workers(strategy, "worker-0", True)
    assert gathered == {"worker-0": 1} and type(gathered["worker-0"]) is int
    assert workers.gather_from_workers(strategy, "chief-0", 7) == {"chief-0": 7}


def test_only_the_tensorflow_backend_calls_the_boundarys_tensorflow_functions():
    tensorflow_only = ("supports_no_merge_call", "in_xla_context", "default_graph")
    for path in _core():
        if path != _BOUNDARY:
            for name in tensorflow_only:
                assert f"_keras_internals.{name}" not in path.read_text(), (path.relative_to(_KMP), name)
    used = "".join(p.read_text() for p in _backend("tensorflow"))
    assert all(f"_keras_internals.{name}" in used for name in tensorflow_only)


# The cycles that `backends.get` closes, each an inversion on purpose: the core
# asks the backend for what differs, and the backend module builds on the core
# module that asked (docs/design.md draws them). A new one fails here.
_INVERSIONS = {
    # The hand-off asks the step module where a traced loss lives and what
    # line a warning asks for; the scaling step asks it for `snapshot`; the
    # step modules build on both.
    frozenset({"kmp.scaling._handoff", "kmp.scaling._step",
               "kmp.backends.tensorflow.step", "kmp.backends.jax.step"}),
    # diagnose's probe asks the backend for the forward and backward pass,
    # which takes the loss targets from the probe (`targets_for`).
    frozenset({"kmp.diagnosis._probe", "kmp.backends.tensorflow.probe"}),
}


def _module_name(path):
    parts = path.relative_to(_KMP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """`{module: modules it imports or asks backends.get for}`, read with
    ast (imports inside functions included; `kmp` itself left out: every
    submodule's import goes through the package)."""
    paths = {_module_name(p): p for p in _KMP.rglob("*.py")}

    def known(name):
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kmp"):
                targets.update(known(f"{node.module}.{alias.name}") for alias in node.names)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "get" and isinstance(node.func.value, ast.Name)
                  and node.func.value.id == "backends" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                targets.update(f"kmp.backends.{backend}.{node.args[0].value}"
                               for backend in ("tensorflow", "jax"))
        graph[module] = {t for t in targets if t in paths and t not in (module, "kmp")}
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.add(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for module in graph:
        if module not in index:
            visit(module)
    return set(found)


def test_the_only_cycles_through_backends_get_are_the_drawn_inversions():
    graph = _import_graph()
    assert len(graph) >= _CORE_MODULES + 2 * _BACKEND_MODULES
    assert _cycles(graph) == _INVERSIONS
    # What the check relies on: an import back from a core module is found.
    graph["kmp.policy"] = graph["kmp.policy"] | {"kmp.model"}
    assert any("kmp.policy" in cycle for cycle in _cycles(graph))


def _kmp_file_changes_in_one_fit_step():
    """How often one eager fit step passes from one kmp file to another:
    each call into kmp code (comprehensions included) whose file is not the
    previous call's, from kmp.Model's `train_step` on."""
    import sys

    import numpy as np

    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", run_eagerly=True)
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # built, the scale settled
    files = []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(str(_KMP)):
            files.append((path, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    finally:
        sys.setprofile(None)
    start = next(i for i, (_, name) in enumerate(files) if name == "train_step")
    step = [path for path, _ in files[start:]]
    return sum(1 for a, b in zip(step, step[1:]) if a != b), len(set(step))


def test_one_fit_step_changes_kmp_file_at_most_40_times():
    # A step that jumps between many files is read in as many (issue 47:
    # 78 changes of file at ed5fbdd, 66 on TensorFlow and 55 on JAX before
    # the step's replicas joined it; 40 and 39 at 324298b). Counted with
    # sys.setprofile over a second fit of one batch, run eagerly.
    changes, files = _kmp_file_changes_in_one_fit_step()
    assert changes <= 40, (changes, files)
    assert files >= 10  # the count saw the step: its model, scaler, rule, backend...
