"""kmp's train step under XLA (`jit_compile=True`, Keras' default on a GPU).

XLA gives the outputs of a `conditional` and of a `while` loop buffers of
their own: a branch or loop body that may write a variable copies it, even
when it does not run. These tests read the optimized HLO of the step (the
same passes a GPU runs, read on a CPU), count what it copies on a step where
nothing overflows and how often the model's matmuls were compiled, beside
Keras' own mixed precision; then check that under XLA the step still skips
and retries as it does without it.

Two ways a step reaches XLA:
- `fit`'s train function (kmp's own, `kmp.backends.tensorflow.distribute.make_function`): the
  compiled step is one attempt, and the train function redoes an
  overflowing batch by calling it again: compiled once, copies only in the
  skip branch;
- a function of the user's own (`tf.function(model.train_step,
  jit_compile=True)`): the retry loop runs inside the compiled step and
  carries gradients, not variables (`kmp.backends.tensorflow.trainer._retry_overflows_compiled`).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

_WIDTH = 128
_DEPTH = 3


def _mlp(model_class):
    inputs = keras.Input((_WIDTH,))
    x = inputs
    for _ in range(_DEPTH):
        x = keras.layers.Dense(_WIDTH, activation="relu")(x)
    return model_class(inputs, keras.layers.Dense(4)(x))


def _data(rows=16):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, _WIDTH)).astype("float32"),
            rng.normal(size=(rows, 4)).astype("float32"))


def _compiled(api, **compile_kwargs):
    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if api == "keras":
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("mixed_float16")
        try:
            model = _mlp(keras.Model)
        finally:
            keras.config.set_dtype_policy(previous)
    else:
        with kmp.policy_scope("mixed_float16"):
            model = _mlp(kmp.Model)
    model.compile(optimizer, "mse", jit_compile=True, **compile_kwargs)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # builds the optimizer's slots
    return model, (tf.constant(x), tf.constant(y))


def _optimized_hlo(model, data):
    step = model.train_step  # kmp.Model's instance step, with the scalers' logs
    function = tf.function(lambda batch: step(batch), jit_compile=True)
    return function.experimental_get_compiler_ir(data)(stage="optimized_hlo")


def _computations(text):
    """`{name: body}` of every computation of an HLO module, and ENTRY's name."""
    computations, entry, name, lines = {}, None, None, []
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            name, lines = header.group(2), []
            if header.group(1):
                entry = name
        elif line.startswith("}") and name is not None:
            computations[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    return computations, entry


def _normal_path(text):
    """The HLO that runs on a step where nothing overflows.

    ENTRY and what it calls (fusions, calls, a while loop's condition), with
    each `conditional` followed into its true branch only (kmp's conditionals
    apply the step when their predicate holds: the false branch is the skip)
    and no while body (kmp's only loop redoes an overflowing batch).
    """
    computations, entry = _computations(text)
    seen, stack, bodies = set(), [entry], []
    while stack:
        name = stack.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        body = computations[name]
        bodies.append(body)
        for line in body.splitlines():
            if " conditional(" in line:
                stack += re.findall(r"true_computation=%?([\w.\-]+)", line)
            elif " while(" in line:
                stack += re.findall(r"condition=%?([\w.\-]+)", line)
            else:
                stack += re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line)
    return "\n".join(bodies)


def _hlo_counts(text):
    """Copies of a kernel-sized buffer on the normal path and in the whole
    module, dot ops and conditionals in `text`."""
    copy = rf"(?:f32|f16)\[{_WIDTH},{_WIDTH}\]\{{[0-9,]*\}} copy\("
    return {
        "normal_path_kernel_copies": len(re.findall(copy, _normal_path(text))),
        "kernel_copies": len(re.findall(copy, text)),
        "dots": len(re.findall(r"\bdot\(", text)),
        "conditionals": len(re.findall(r"\bconditional\(", text)),
    }


@pytest.fixture(scope="module")
def keras_counts():
    model, data = _compiled("keras")
    return _hlo_counts(_optimized_hlo(model, data))


def _skip_branches(text):
    """The HLO of every conditional's false branch (kmp's skips)."""
    computations, _ = _computations(text)
    names = set(re.findall(r"false_computation=%?([\w.\-]+)", text))
    return "\n".join(computations[name] for name in names if name in computations)


@pytest.mark.parametrize("overflow_retries", ["auto", 0])
def test_a_train_step_compiled_by_xla_copies_no_variable_where_nothing_overflows(
        overflow_retries, keras_counts):
    """The issue's measure: `tf.function(model.train_step, jit_compile=True)`."""
    model, data = _compiled("kmp", overflow_retries=overflow_retries)
    assert model.optimizer.__class__ is kmp.LossScaleOptimizer
    text = _optimized_hlo(model, data)
    counts = _hlo_counts(text)
    # Not one copy of a kernel on a step that applies (Keras' own step
    # copies each kernel on every step)...
    assert counts["normal_path_kernel_copies"] == 0, counts
    assert keras_counts["normal_path_kernel_copies"] >= _DEPTH
    # ...and the only copies are the skip's: one conditional, whose false
    # branch keeps each kernel and slot as it was.
    skip = len(re.findall(rf"(?:f32|f16)\[{_WIDTH},{_WIDTH}\]\{{[0-9,]*\}} copy\(",
                          _skip_branches(text)))
    assert counts["kernel_copies"] == skip, counts
    assert counts["conditionals"] == 1, counts


_FIT_HLO = """
import glob, os, re, sys
import numpy as np, keras, kmp
kmp.set_policy("mixed_float16")
keras.utils.set_random_seed(0)
inputs = keras.Input(({width},))
x = inputs
for _ in range({depth}):
    x = keras.layers.Dense({width}, activation="relu")(x)
model = kmp.Model(inputs, keras.layers.Dense(4)(x)) if sys.argv[1] == "kmp" else None
if model is None:
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input(({width},))
    x = inputs
    for _ in range({depth}):
        x = keras.layers.Dense({width}, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(4)(x))
model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", jit_compile=True)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, {width})).astype("float32")
y = rng.normal(size=(64, 4)).astype("float32")
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
folder = os.environ["XLA_FLAGS"].split("=", 1)[1]
steps = sorted(glob.glob(os.path.join(folder, "*one_step_on_data*after_optimizations.txt")))
texts = [open(path).read() for path in steps]
buffers = sorted(glob.glob(os.path.join(folder, "*one_step_on_data*buffer-assignment.txt")))
total = int(re.search(r"Total bytes used: (\d+)", open(buffers[0]).read()).group(1))
print(len(texts), sum(len(re.findall(r"\bdot\(", t)) for t in texts), total)
"""


def _fit_compilations(api, tmp_path):
    """`(modules, dots, buffer bytes)` of the steps `fit` compiled, read from
    XLA's dump in a child process (XLA_FLAGS is read once per process)."""
    import subprocess
    import sys

    from _helpers import child_env

    folder = tmp_path / api
    env = dict(child_env(), XLA_FLAGS=f"--xla_dump_to={folder}")
    script = _FIT_HLO.format(width=_WIDTH, depth=_DEPTH)
    result = subprocess.run([sys.executable, "-c", script, api], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    modules, dots, total = (int(v) for v in result.stdout.split()[-3:])
    return modules, dots, total


def test_fit_compiles_the_step_once_and_holds_no_more_than_keras(tmp_path):
    """`fit` with retries on (the default) compiles one step, with Keras'
    number of matmuls, and XLA's buffer assignment gives it no more memory
    than Keras' own mixed-precision step."""
    modules, dots, total = _fit_compilations("kmp", tmp_path)
    keras_modules, keras_dots, keras_total = _fit_compilations("keras", tmp_path)
    assert modules == keras_modules == 1
    assert dots == keras_dots
    assert total <= keras_total, (total, keras_total)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_an_overflowing_step_under_xla_changes_no_weight_slot_or_iteration(optimizer_name):
    """With the skip a select inside the update, a step whose gradients are
    not finite leaves every variable exactly as it was, under XLA."""
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(2)(inputs))
    optimizer = (keras.optimizers.SGD(0.01, momentum=0.9) if optimizer_name == "sgd"
                 else keras.optimizers.Adam(0.01))
    model.compile(optimizer, "mse", jit_compile=True, overflow_retries=0)
    x = np.ones((4, 4), "float32")
    model.fit(x, np.ones((4, 2), "float32"), batch_size=4, verbose=0)
    before = [np.array(v) for v in model.optimizer.variables + model.trainable_variables]
    iterations = int(model.optimizer.iterations)
    # An inf target: the loss and every gradient are not finite.
    history = model.fit(x, np.full((4, 2), np.inf, "float32"), batch_size=4, verbose=0)
    after = model.optimizer.variables + model.trainable_variables
    scale_index = [v.path for v in model.optimizer.variables].index(model.optimizer._kmp_scale.path)
    for index, (old, new) in enumerate(zip(before, after)):
        if index == scale_index or new is model.optimizer._counters:
            continue
        np.testing.assert_array_equal(np.array(new), old, err_msg=new.path)
    assert int(model.optimizer.iterations) == iterations
    assert history.history["skipped_steps"] == [1]
    assert float(model.optimizer.loss_scale) == 2.0**14


def test_xla_and_graph_steps_train_alike_with_retries():
    """The same overflowing run (the first batches overflow at 2**15) with
    and without XLA: the same retries, the same scale, weights within
    float16's rounding of each other."""
    def run(jit_compile, **compile_kwargs):
        kmp.set_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(1e-4), "mse", jit_compile=jit_compile,
                      **compile_kwargs)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 4)).astype("float32")
        y = (300.0 + rng.normal(size=(32, 1))).astype("float32")
        history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
        return model, history

    graph, graph_history = run(False)
    xla, xla_history = run(True)
    xla_two, xla_two_history = run(True, steps_per_execution=2)
    assert xla_two_history == xla_history
    np.testing.assert_array_equal(xla_two.get_weights()[0], xla.get_weights()[0])
    assert xla_history["skipped_steps"] == graph_history["skipped_steps"] == [0]
    assert xla_history["retried_steps"] == graph_history["retried_steps"]
    assert graph_history["retried_steps"][0] >= 5
    assert float(xla.optimizer.loss_scale) == float(graph.optimizer.loss_scale)
    assert int(xla.optimizer.iterations) == int(graph.optimizer.iterations) == 4
    np.testing.assert_allclose(xla.get_weights()[0], graph.get_weights()[0], rtol=2e-3, atol=1e-4)


def test_a_train_step_the_user_compiles_retries_an_embedding_as_without_xla():
    """The retry loop inside a train step compiled by the user's own jit
    function carries an embedding's sparse gradient: the same retries, scale
    and weights as the same step without XLA."""
    def run(jit_compile):
        kmp.set_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,), dtype="int32")
        x = keras.layers.Embedding(50, 4)(inputs)
        x = keras.layers.GlobalAveragePooling1D()(x)
        model = kmp.Model(inputs, keras.layers.Dense(1)(x))
        model.compile(keras.optimizers.SGD(1e-3, momentum=0.9), "mse")
        # Targets ~3000: the first gradients overflow float16 at 2**15.
        x = np.array([[1, 2, 3], [4, 5, 6]], "int32")
        y = np.full((2, 1), 3000.0, "float32")
        model.fit(x, y, epochs=1, verbose=0)  # builds; retries settle the scale
        model.make_train_function()
        step = model.train_step
        function = tf.function(lambda data: step(data), jit_compile=jit_compile)
        before = int(model.optimizer.counters["retries"])
        for _ in range(3):
            logs = function((tf.constant(x), tf.constant(y * 64)))
        return model, int(model.optimizer.counters["retries"]) - before, logs

    graph, graph_retries, _ = run(False)
    xla, xla_retries, logs = run(True)
    # The 64x larger targets overflow at the settled scale: each step gets
    # its one retry, as without XLA, and the skips are the same.
    assert xla_retries == graph_retries >= 1
    assert int(logs["skipped_steps"]) == int(graph.optimizer.skipped_steps)
    assert float(xla.optimizer.loss_scale) == float(graph.optimizer.loss_scale)
    for xla_weight, graph_weight in zip(xla.get_weights(), graph.get_weights()):
        np.testing.assert_allclose(xla_weight, graph_weight, rtol=2e-3, atol=1e-5)
