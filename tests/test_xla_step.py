"""kmp's train step under XLA (`jit_compile=True`, Keras' default on a GPU).

XLA gives the outputs of a `conditional` and of a `while` loop buffers of
their own, and XLA:GPU reads a conditional's predicate on the host in the
middle of the step; a host-side `If` on a step's output makes the host wait
for that step before it can launch the next. These tests read the optimized
HLO and XLA's buffer assignment of the step (the same passes a GPU runs,
read on a CPU) and the train function's graph, beside Keras' own mixed
precision; then check that under XLA the step still skips and retries as it
does without it.

Two ways a step reaches XLA:
- `fit`'s train function (kmp's own, `kmp.backends.tensorflow.distribute.make_function`): the
  compiled step is one attempt, the skip a select, and the train function
  redoes an overflowing batch one call later by calling the compiled step
  again (`distribute.RedoLater`): compiled once, no conditional, no host
  wait;
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


def _compiled(api, accumulation=None, policy="mixed_float16", multi=False, **compile_kwargs):
    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9, gradient_accumulation_steps=accumulation)
    if multi:  # Keras' MultiOptimizer with that one optimizer behind it
        optimizer = keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(default_optimizer=optimizer))
    if api == "keras":
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            model = _mlp(keras.Model)
        finally:
            keras.config.set_dtype_policy(previous)
    else:
        with kmp.policy_scope(policy):
            model = _mlp(kmp.Model)
    model.compile(optimizer, "mse", jit_compile=True, **compile_kwargs)
    x, y = _data()
    _build_by_one_step(model, x, y)
    return model, (tf.constant(x), tf.constant(y))


def _build_by_one_step(model, x, y):
    """One step of `fit`, which builds the optimizer's slots and the
    metrics, run as a graph: the HLO these tests read is of
    `tf.function(model.train_step, jit_compile=True)`, and the step reads
    nothing of `model.jit_compile` (kmp's step asks, while it is traced,
    whether XLA compiles it), so XLA's compile of fit's own train function
    was thrown away (the optimized HLO of every model here is the same
    either way, op for op, 2026-12-06)."""
    model.jit_compile = False
    try:
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    finally:
        model.jit_compile = True


def _optimized_hlo(model, data):
    step = model.train_step  # kmp.Model's instance step, with the scalers' logs
    function = tf.function(lambda batch: step(batch), jit_compile=True)
    return function.experimental_get_compiler_ir(data)(stage="optimized_hlo")


def _hlo_counts(text):
    """Copies of a kernel-sized buffer, dot ops and conditionals in `text`."""
    copy = rf"(?:f32|f16|bf16)\[{_WIDTH},{_WIDTH}\]\{{[0-9,]*\}} copy\("
    return {
        "kernel_copies": len(re.findall(copy, text)),
        "dots": len(re.findall(r"\bdot\(", text)),
        "conditionals": len(re.findall(r"\bconditional\(", text)),
    }


@pytest.fixture(scope="module")
def keras_counts():
    model, data = _compiled("keras")
    return _hlo_counts(_optimized_hlo(model, data))


@pytest.mark.parametrize("overflow_retries", ["auto", 0])
def test_a_train_step_compiled_by_xla_has_no_conditional_and_copies_no_more_than_keras(
        overflow_retries, keras_counts):
    """`tf.function(model.train_step, jit_compile=True)`: the skip is a
    select, as in Keras' own step (XLA turns Keras' cheap conditional into
    selects), so no `conditional` is left and no kernel is copied that
    Keras' step does not copy too."""
    model, data = _compiled("kmp", overflow_retries=overflow_retries)
    assert model.optimizer.__class__ is kmp.LossScaleOptimizer
    counts = _hlo_counts(_optimized_hlo(model, data))
    assert counts["conditionals"] == keras_counts["conditionals"] == 0, counts
    assert counts["kernel_copies"] <= keras_counts["kernel_copies"], (counts, keras_counts)


@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"),
                    reason="keras.optimizers.MultiOptimizer is new in Keras 3.15")
@pytest.mark.parametrize("policy", ["mixed_float16", "bfloat16"])
def test_a_multi_optimizers_step_under_xla_copies_what_its_optimizer_alone_copies(policy):
    """Keras' MultiOptimizer: its sub-optimizer writes the variables, through
    its own `assign` methods, which the skip gates as it gates an optimizer
    alone (`kmp.scaling._gate.writers`): before, those writes escaped the
    gate and were selected after, and XLA copied each momentum to keep it."""
    alone, data = _compiled("kmp", policy=policy)
    model, _ = _compiled("kmp", policy=policy, multi=True)
    alone_counts = _hlo_counts(_optimized_hlo(alone, data))
    counts = _hlo_counts(_optimized_hlo(model, data))
    assert counts == alone_counts, (counts, alone_counts)


def test_the_bfloat16_guard_under_xla_is_a_select_as_float16s_skip():
    """The guard under mixed_bfloat16 skips as float16's scaler does, with a
    select inside each of the optimizer's writes (`kmp.scaling._gate`): no
    conditional, and no more kernel copies than Keras' bfloat16 step, which
    checks nothing (a select after the update made XLA copy each slot)."""
    keras_model, data = _compiled("keras", policy="mixed_bfloat16")
    model, _ = _compiled("kmp", policy="mixed_bfloat16")
    assert not model.optimizer.scaling
    keras_bf16 = _hlo_counts(_optimized_hlo(keras_model, data))
    counts = _hlo_counts(_optimized_hlo(model, data))
    assert counts["conditionals"] == keras_bf16["conditionals"] == 0, counts
    assert counts["kernel_copies"] <= keras_bf16["kernel_copies"], (counts, keras_bf16)
    assert counts["dots"] == keras_bf16["dots"]


def test_compensated_bfloat16_weights_under_xla_are_updated_in_place():
    """bfloat16 weights (kmp's compensated update,
    `kmp.precision._compensated`):
    the weight's write follows its buffer's, so XLA updates both in place;
    with both computed from the old weight alone, XLA copied every kernel
    each step to keep it for whichever write came second. From
    TensorFlow 2.20 Keras' own bfloat16 step (whose update does not count)
    copies none either."""
    keras_model, data = _compiled("keras", policy="bfloat16")
    model, _ = _compiled("kmp", policy="bfloat16")
    assert len(model.optimizer._kmp_compensated) == 2 * (_DEPTH + 1)
    keras_bf16 = _hlo_counts(_optimized_hlo(keras_model, data))
    counts = _hlo_counts(_optimized_hlo(model, data))
    if keras_bf16["kernel_copies"] == 0:  # TensorFlow 2.20 and later
        assert counts["kernel_copies"] == 0, (counts, keras_bf16)
    else:
        # TensorFlow 2.19's XLA copies Keras' own slots too (3 here), and
        # every kernel-shaped variable kmp writes (weight, moment, buffer)
        # once, whichever way the writes are ordered: at most that.
        assert counts["kernel_copies"] <= 3 * _DEPTH, (counts, keras_bf16)
    assert counts["conditionals"] == 0, counts


def test_an_accumulated_step_under_xla_has_no_more_conditionals_than_keras():
    """With the inner optimizer's gradient accumulation the window's
    branches (apply or discard, the micro-steps' rewind, the accumulators'
    reset, the window's end) are selects too: no conditional, as Keras'."""
    keras_model, data = _compiled("keras", accumulation=4)
    kmp_model, _ = _compiled("kmp", accumulation=4, overflow_retries=0)
    keras_counts = _hlo_counts(_optimized_hlo(keras_model, data))
    counts = _hlo_counts(_optimized_hlo(kmp_model, data))
    assert counts["conditionals"] <= keras_counts["conditionals"] == 0, (counts, keras_counts)
    assert counts["kernel_copies"] <= keras_counts["kernel_copies"], (counts, keras_counts)


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
temp = int(re.search(r"size (\d+), preallocated-temp", open(buffers[0]).read()).group(1))
print(len(texts), sum(len(re.findall(r"\bdot\(", t)) for t in texts),
      sum(len(re.findall(r"\bconditional\(", t)) for t in texts), temp)
"""


def _fit_compilations(api, tmp_path):
    """`(modules, dots, conditionals, temporary bytes)` of the steps `fit`
    compiled, read from XLA's dump in a child process (XLA_FLAGS is read
    once per process)."""
    import subprocess
    import sys

    from _helpers import child_env

    folder = tmp_path / api
    env = dict(child_env(), XLA_FLAGS=f"--xla_dump_to={folder}")
    script = _FIT_HLO.format(width=_WIDTH, depth=_DEPTH)
    result = subprocess.run([sys.executable, "-c", script, api], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return tuple(int(v) for v in result.stdout.split()[-4:])


# XLA packs a step's temporaries into one buffer (scalars 64-byte aligned),
# and values that live at different times share it. kmp's step materializes
# one more unscaled kernel gradient than Keras' (XLA fuses one of Keras'
# into its update), which shares space with others, and its few scalars (the
# scale read once, the counters, a finite flag per gradient) pack
# differently: on this model 408,513 bytes against Keras' 407,236 (at a1cd5e9), on a
# 4xDense(1024) MLP 33,681,921 against 33,669,316 (+0.04%), 2026-11-28.
# The bound allows that much: a vector a layer and scalars, no kernel.
_PACKING_BYTES = (_DEPTH + 1) * _WIDTH * 4 + 64 * 32


def test_fit_compiles_one_step_without_a_conditional_and_holds_what_keras_holds(tmp_path):
    """`fit` with retries on (the default) compiles one step, with Keras'
    number of matmuls and, like Keras' step, no `conditional`; XLA's buffer
    assignment gives its temporaries what it gives Keras' own
    mixed-precision step's."""
    modules, dots, conditionals, temp = _fit_compilations("kmp", tmp_path)
    keras_modules, keras_dots, keras_conditionals, keras_temp = _fit_compilations("keras", tmp_path)
    assert modules == keras_modules == 1
    assert dots == keras_dots
    assert conditionals == keras_conditionals == 0
    assert temp <= keras_temp + _PACKING_BYTES, (temp, keras_temp)


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


def test_a_train_step_the_user_compiles_skips_an_embedding_as_without_xla():
    """A train step compiled by the user's own jit function: kmp's train
    function, which redoes batches, is not there, so an overflowing step is
    skipped (the scale backs off), with an embedding's sparse gradient: the
    same skips, scale and weights as the same step without XLA."""
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
        before = int(model.optimizer.skipped_steps)
        for _ in range(3):
            logs = function((tf.constant(x), tf.constant(y * 64)))
        return model, int(model.optimizer.skipped_steps) - before, logs

    graph, graph_skips, _ = run(False)
    xla, xla_skips, logs = run(True)
    # The 64x larger targets overflow at the settled scale: skipped alike.
    assert xla_skips == graph_skips >= 1
    assert int(logs["skipped_steps"]) == int(graph.optimizer.skipped_steps)
    assert float(xla.optimizer.loss_scale) == float(graph.optimizer.loss_scale)
    for xla_weight, graph_weight in zip(xla.get_weights(), graph.get_weights()):
        np.testing.assert_allclose(xla_weight, graph_weight, rtol=2e-3, atol=1e-5)


def _retrying_model(**compile_kwargs):
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=True, **compile_kwargs)
    return model


def test_fits_train_function_under_xla_has_no_host_wait_on_the_step():
    """With the defaults, once the scale has settled, nothing in fit's train
    function under XLA is fed by the compiled step's outputs, with one step
    per call or several: the host launches the next step without waiting
    for this one (`benchmarks.xla_step.host_control_flow_on_step` reads
    it). The retries' loop is on the host, in Python, and runs only while
    the scale settles (`kmp.scaling._retry`)."""
    from benchmarks import xla_step

    x, y = np.full((16, 4), 0.1, "float32"), np.zeros((16, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    # With several steps per call, the loop over them (Keras' own shape,
    # `distribute.make_function`) carries the last step's logs as loop
    # variables; its condition reads only the step count and whether a
    # batch is left, not the step's outputs: nothing waits for them.
    for steps, expected in ((1, []), (2, ["While"])):
        model = _retrying_model(steps_per_execution=steps)
        model.fit(dataset, epochs=1, verbose=0)
        graph = xla_step.train_function_graph(model, iter(dataset))
        found = xla_step.host_control_flow_on_step(graph)
        assert sorted({flow.op for flow in found}) == expected, found


def _overflowing_fit(bad_batch, batches=6, **compile_kwargs):
    """`fit` over `batches` batches of 8 rows whose targets make batch
    `bad_batch` overflow float16 at the scale 2**15 but not at 2**14 (the
    bias gradient is `scale * 2 * mean(pred - y)`, pred ~0)."""
    x = np.full((8 * batches, 4), 0.1, "float32")
    y = np.full((8 * batches, 1), 0.1, "float32")
    y[8 * bad_batch: 8 * (bad_batch + 1)] = 1.5
    model = _retrying_model(**compile_kwargs)
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    return model, history, (x, y)


def _sgd_reference(x, y, order):
    """The six SGD updates in float32, batch by batch in `order`; the loss
    each batch logged."""
    w, b, losses = np.zeros((4, 1)), 0.0, []
    for index in order:
        xb, yb = x[8 * index: 8 * index + 8], y[8 * index: 8 * index + 8]
        error = xb @ w + b - yb
        losses.append(float(np.mean(error**2)))
        w -= 0.01 * 2 * xb.T @ error / 8
        b -= 0.01 * 2 * float(np.mean(error))
    return w, b, losses


@pytest.mark.parametrize("bad_batch", [3, 5], ids=["mid_epoch", "last_batch"])
def test_an_overflowing_batch_under_xla_is_redone_at_once_when_asked(bad_batch):
    """With `overflow_retries=1`, after the first step, an overflowing batch
    is redone at once (the host reads each step's flag): every batch
    applied in order, none skipped, one retry in the epoch's logs, the scale
    backed off once; the loss logged is the mean over all six batches. Under
    `"auto"` the settled scale skips it, as Keras does."""
    model, history, (x, y) = _overflowing_fit(bad_batch, overflow_retries=1)
    assert int(model.optimizer.iterations) == 6
    assert history["skipped_steps"] == [0]
    assert history["retried_steps"] == [1]
    assert history["loss_scale"] == [2.0**14]
    w, b, losses = _sgd_reference(x, y, range(6))
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel, w, rtol=1e-2, atol=1e-4)
    np.testing.assert_allclose(bias, [b], rtol=1e-2, atol=1e-4)
    np.testing.assert_allclose(history["loss"][0], np.mean(losses), rtol=1e-2)

    model, history, (x, y) = _overflowing_fit(bad_batch)
    assert int(model.optimizer.iterations) == 5
    assert history["skipped_steps"] == [1] and history["retried_steps"] == [0]
    assert history["loss_scale"] == [2.0**14]
    w, b, _ = _sgd_reference(x, y, [i for i in range(6) if i != bad_batch])
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel, w, rtol=1e-2, atol=1e-4)


def test_mirrored_strategys_all_gpu_path_under_xla_trains_and_skips_once():
    """TensorFlow's path for MirroredStrategy when every device is a GPU and
    the step is compiled (no `merge_call`: each replica decides, and an
    optimizer's `apply` may not sit inside a `cond`), reached on a CPU. The
    step trains, skips the overflowing batch on every replica and counts it
    once (Keras' own scaler fails here: keras-team/keras#21366)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    strategy.extended._use_merge_call = lambda: False
    # XLA compiles no collective on a CPU (b/194942685); one replica's sum
    # over replicas is its own value.
    strategy.extended._replica_ctx_all_reduce = lambda reduce_op, value, options=None: value
    kmp.set_policy("mixed_float16")
    x = np.ones((32, 4), "float32")
    x[8:16] = 1e30  # batch 1 overflows float16 in the forward pass: skipped
    y = np.zeros((32, 1), "float32")
    with strategy.scope():
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
        model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=True)
        assert tf.__internal__.distribute.strategy_supports_no_merge_call()
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    assert history["skipped_steps"] == [1]
    assert history["retried_steps"] == [0]  # a forward overflow is not redone
    assert int(model.optimizer.iterations.numpy()) == 3
    assert float(model.optimizer.loss_scale.numpy()) == 2.0**14
    assert np.isfinite(history["loss"][0])


def test_the_guards_decision_is_one_scalar_however_many_variables_it_checks():
    """With many variables (here 50) the step's decision reaches each gated
    write as one computed scalar: XLA copied the chain of per-gradient flags,
    and every gradient's sum as an operand, into each write's kernel (~50
    operands in each of ~150 kernels), so the optimized program grows with
    the square of the variables where Keras' grows with their number."""
    def build(model_class):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        x = inputs
        for _ in range(25):
            x = keras.layers.Dense(8, activation="relu")(x)
        return model_class(inputs, x)

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        keras_model = build(keras.Model)
    finally:
        keras.config.set_dtype_policy(previous)
    with kmp.policy_scope("mixed_bfloat16"):
        model = build(kmp.Model)
    x = np.ones((16, 8), "float32")
    for net in (keras_model, model):
        net.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
        _build_by_one_step(net, x, x)
    assert len(model.trainable_variables) == 50
    data = (tf.constant(x), tf.constant(x))
    operands = {name: _optimized_hlo(net, data).count(" parameter(")
                for name, net in (("keras", keras_model), ("kmp", model))}
    assert operands["kmp"] <= 2 * operands["keras"], operands
