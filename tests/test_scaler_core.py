"""The scaler core under every strategy path: the peer-suite bugs of issue 15,
variables safe without merge_call, accumulation traffic, the pass-through
switch and gradients of a loss that was never scaled."""

import inspect
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from _helpers import EPSILON
from _helpers import float32_compute_dtype
from benchmarks import harness
import kmp
from kmp.backends.tensorflow import step as _tf_step


_needs_multi_optimizer = pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason=f"keras.optimizers.MultiOptimizer is newer than this Keras ({keras.__version__})",
)


def _multi_optimizer(learning_rate=0.1):
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(default_optimizer=keras.optimizers.SGD(learning_rate))
    )


def _distributed_sgd_step(strategy, optimizer, scaled):
    """w = 2; each replica's loss is 0.5 * w / replicas (Keras' convention), so
    the summed gradient is 0.5; returns w after one step."""
    with strategy.scope():
        w = keras.Variable(2.0)

    def step():
        # Eager: Keras' own MultiOptimizer fails inside a tf.function under
        # MirroredStrategy (a placeholder left in its cond); fit traces it
        # its own way (see the compiled test below).
        def replica_step():
            with tf.GradientTape() as tape:
                loss = 0.5 * w / strategy.num_replicas_in_sync
                if scaled:
                    loss = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(loss, [w]), [w])

        strategy.run(replica_step)

    step()
    return float(w.numpy())



@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_built_lazily_inside_a_tf_function_under_mirrored(mirrored_strategy, inner):
    # tf-keras' scaler tests build the optimizer in its first apply_gradients,
    # inside tf.function(strategy.run(step)). Keras' own Adam fails there on
    # two replicas (its slots' initializers are left as placeholders); kmp
    # builds its state and the inner optimizer's outside the function.
    replicas = mirrored_strategy.num_replicas_in_sync
    with mirrored_strategy.scope():
        w = tf.Variable([1.0, 2.0])
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.get(inner), initial_scale=2.0, growth_interval=1
        )
        optimizer.inner_optimizer.learning_rate = 1.0

    def replica_step():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_sum(w * 2.0) / replicas)
        grads = tape.gradient(loss, [w])
        optimizer.apply_gradients(zip(grads, [w]))

    step = tf.function(lambda: mirrored_strategy.run(replica_step))
    step()
    step()
    # Gradient 2 per element each step: SGD moves by 2, Adam by its learning rate 1.
    expected = [-3.0, -2.0] if inner == "sgd" else [-1.0, 0.0]
    np.testing.assert_allclose(w.numpy(), expected, atol=1e-4)
    assert float(optimizer.loss_scale) == 8.0  # grew after each finite step
    assert int(optimizer.iterations.numpy()) == 2 and int(optimizer.skipped_steps) == 0


@_needs_multi_optimizer
def test_multi_optimizer_under_mirrored_equals_the_unwrapped_run(mirrored_strategy):
    with mirrored_strategy.scope():
        bare = _multi_optimizer()
        wrapped = kmp.LossScaleOptimizer(_multi_optimizer(), initial_scale=10.0)
    expected = _distributed_sgd_step(mirrored_strategy, bare, scaled=False)
    assert expected == pytest.approx(2.0 - 0.1 * 0.5)
    assert _distributed_sgd_step(mirrored_strategy, wrapped, scaled=True) == pytest.approx(expected)


@_needs_multi_optimizer
def test_compiled_multi_optimizer_under_mirrored_equals_plain_sgd(mirrored_strategy):
    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    weights = {}
    for kind in ("sgd", "multi"):
        keras.utils.set_random_seed(0)
        with mirrored_strategy.scope():
            inputs = keras.Input((4,))
            model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
            optimizer = keras.optimizers.SGD(0.1) if kind == "sgd" else _multi_optimizer()
            # 2**8: no float16 overflow on this data, so both runs apply every step.
            model.compile(kmp.LossScaleOptimizer(optimizer, initial_scale=2.0**8), "mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights[kind] = [np.asarray(v) for v in model.weights]
        assert int(model.optimizer.skipped_steps) == 0
    for sgd, multi in zip(weights["sgd"], weights["multi"]):
        np.testing.assert_allclose(multi, sgd, rtol=1e-6, atol=1e-7)


def _mixed_dtype_model():
    """out = x @ (w16 + w32): one float16 kernel beside a float32 one."""
    inputs = keras.Input((2,))
    half = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", dtype="float16")
    full = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    outputs = keras.layers.Add(dtype="float32")(
        [keras.layers.Activation("linear", dtype="float32")(half(inputs)), full(inputs)]
    )
    return kmp.Model(inputs, outputs), half, full


def test_mixed_dtype_gradients_train_under_mirrored_and_match_hand_computed(mirrored_strategy):
    kmp.set_policy("mixed_float16")
    x = np.array([[1.0, 2.0], [0.5, -1.0], [2.0, 0.0], [-1.0, 1.0]], "float32")
    y = np.zeros((4, 1), "float32")
    with mirrored_strategy.scope():
        model, half, full = _mixed_dtype_model()
        # A scale that keeps the float16 kernel's scaled gradient (~2**5) finite.
        model.compile(kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**4), "mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # float64 by hand: pred = x @ 2, d mse / d w = 2 * mean(pred * x), the
    # same for both kernels.
    pred = x.astype("float64") @ np.array([[2.0], [2.0]])
    grad = 2.0 * (pred * x).mean(axis=0)
    expected = 1.0 - 0.01 * grad
    assert half.kernel.dtype == "float16"
    np.testing.assert_allclose(np.asarray(full.kernel)[:, 0], expected, rtol=1e-6)
    # One float16 rounding of the update.
    np.testing.assert_allclose(
        np.asarray(half.kernel, "float64")[:, 0], expected, rtol=2**-10, atol=2**-11
    )
    assert int(model.optimizer.skipped_steps) == 0


def test_all_reduce_sum_groups_by_dtype_and_keeps_order(mirrored_strategy):
    def replica_values():
        values = (
            tf.constant([1.0, 2.0], "float16"),
            None,
            tf.constant(3.0, "float32"),
            tf.constant([4.0], "float16"),
        )
        return _tf_step._all_reduce_sum(values)

    result = tf.function(lambda: mirrored_strategy.run(replica_values))()
    local = [
        None if r is None else mirrored_strategy.experimental_local_results(r)[0].numpy()
        for r in result
    ]
    assert local[1] is None
    np.testing.assert_array_equal(local[0], [2.0, 4.0])
    assert local[2] == 6.0 and local[0].dtype == np.float16
    np.testing.assert_array_equal(local[3], [8.0])


# -- 16-bit layer losses ------------------------------------------------------


@keras.saving.register_keras_serializable(package="kmp_tests")
class RegularizedModel(kmp.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(1e-3))
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def _regularized(kind):
    if kind == "subclassed":
        return RegularizedModel()
    layers = [
        keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(1),
    ]
    if kind == "sequential":
        return kmp.convert(keras.Sequential([keras.Input((4,))] + layers), compile=False)
    inputs = keras.Input((4,))
    return kmp.Model(inputs, layers[1](layers[0](inputs)))


# A Latin square of model kind x policy in the fast tier (each kind and
# each policy once), the other six in the slow tier (tests/conftest.py).
@pytest.mark.parametrize(("kind", "policy"), [
    pytest.param(kind, policy, marks=() if row == column else pytest.mark.slow)
    for row, kind in enumerate(("functional", "sequential", "subclassed"))
    for column, policy in enumerate(("float32", "mixed_float16", "mixed_bfloat16"))
])
def test_16_bit_layer_losses_train_save_and_load(policy, kind, tmp_path):
    kmp.set_policy(policy)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    model = _regularized(kind)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert all(np.isfinite(history["loss"]))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(
        np.asarray(loaded.predict(x, verbose=0)), np.asarray(model.predict(x, verbose=0)),
        rtol=1e-6,
    )
    assert np.isfinite(loaded.fit(x, y, batch_size=8, verbose=0).history["loss"][0])


def test_16_bit_layer_losses_train_under_mirrored(mirrored_strategy):
    kmp.set_policy("mixed_float16")
    x = np.ones((16, 4), "float32")
    y = np.zeros((16, 1), "float32")
    with mirrored_strategy.scope():
        model = _regularized("functional")
        model.compile(keras.optimizers.SGD(0.01), "mse")
    assert np.isfinite(model.fit(x, y, batch_size=8, verbose=0).history["loss"][0])


# -- variables and the no-merge-call path ----------------------------------


def test_kmp_variables_need_no_merge_call_to_assign():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(gradient_accumulation_steps=2), initial_scale=4.0
    )
    optimizer.build([keras.Variable(1.0)])
    own = [
        optimizer._kmp_scale, optimizer._counters, optimizer._nonfinite_gradients,
        optimizer._accumulation_window,
    ]
    for variable in own:
        assert variable.aggregation == "none", variable.name
        assert variable.dtype in ("float32", "int64"), variable.name


@pytest.mark.gpu
def test_all_gpu_mirrored_strategy_under_xla_trains_and_skips():
    # TensorFlow takes its no-merge_call path only here (every device a GPU,
    # the step compiled with XLA): replica-context assigns inside conds.
    gpus = tf.config.list_logical_devices("GPU")
    strategy = tf.distribute.MirroredStrategy([d.name for d in gpus])
    kmp.set_policy("mixed_float16")
    x = np.ones((32, 4), "float32")
    x[8:16] = 1e30  # step 1's batch overflows: skipped on every replica
    y = np.zeros((32, 1), "float32")
    with strategy.scope():
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(0.01), "mse", loss_scale="dynamic", jit_compile=True)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.skipped_steps) == 1
    assert int(model.optimizer.iterations) == 3
    assert float(model.optimizer.loss_scale) == 2.0**14


def _count_decision_reductions(monkeypatch):
    calls = []
    all_reduce_sum = _tf_step._all_reduce_sum

    def counting(tensors):
        calls.append(len([t for t in tensors if t is not None]))
        return all_reduce_sum(tensors)

    monkeypatch.setattr(_tf_step, "_all_reduce_sum", counting)
    return calls


# Accumulation under a strategy in a raw tf.function fails in Keras itself
# (its accumulation cond holds the gradients' all-reduce): tested through fit
# in test_accumulation.py.
@pytest.mark.parametrize("accumulation", [None, 4])
def test_the_decision_adds_no_collective_on_one_machine(
    accumulation, monkeypatch, mirrored_strategy
):
    # Each replica checks its own gradients; on one machine the replicas'
    # flags are read in the cross-replica context, as Keras' scaler does, so
    # kmp adds no collective; the inner optimizer sums the gradients itself,
    # as without kmp (issue 23: nothing of Keras' is switched off). Across
    # workers the two flags travel in one collective (test_distribute.py's
    # multi-worker tests).
    calls = _count_decision_reductions(monkeypatch)
    strategy = tf.distribute.get_strategy() if accumulation else mirrored_strategy
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        variables = [keras.Variable(np.ones((3,), "float32")) for _ in range(5)]
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=accumulation),
            initial_scale=4.0,
        )
        optimizer.build(variables)

    def replica_step(poison):
        with tf.GradientTape() as tape:
            loss = ops.sum(ops.stack([ops.sum(v) for v in variables])) * poison / replicas
            loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(loss, variables), variables)

    step = tf.function(lambda poison: strategy.run(replica_step, args=(poison,)))
    for poison in (1.0, 1.0, 1.0, 1.0, np.inf, 1.0, 1.0, 1.0):
        step(tf.constant(poison))
    assert calls == []
    if accumulation:
        assert int(optimizer.iterations.numpy()) == 1 and int(optimizer.skipped_steps) == 1
        np.testing.assert_allclose(np.asarray(variables[0]), 1.0 - 0.1)
        for accumulator in optimizer.inner_optimizer._accumulated_gradients:
            assert np.all(np.isfinite(np.asarray(accumulator)))
    else:
        assert int(optimizer.iterations.numpy()) == 7 and int(optimizer.skipped_steps) == 1
        np.testing.assert_allclose(variables[0].numpy(), 1.0 - 7 * 0.1, rtol=1e-6)
    calls.clear()
    single = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    w = keras.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = single.scale_loss(2.0 * w[0])
    single.apply(tape.gradient(loss, [w]), [w])
    assert calls == [] and float(w[0]) == pytest.approx(0.8)


def _graph_ops(graph):
    """Every op of `graph` and of the functions it calls (cond branches)."""
    found = list(graph.get_operations())
    for function in graph._functions.values():
        found.extend(_graph_ops(function.graph))
    return found


def test_accumulated_step_makes_no_pass_over_the_gradients_beyond_keras():
    # A finite window pays a finite check and a division per gradient, as
    # Keras' scaler: nothing selects or zeroes a micro-batch's gradients
    # (the earlier where() ran over every gradient of every micro-batch).
    def gradient_ops(optimizer):
        variables = [keras.Variable(np.ones((3, 5), "float32")) for _ in range(6)]
        optimizer.build(variables)
        concrete = tf.function(
            lambda grads: optimizer.apply(grads, variables), autograph=False
        ).get_concrete_function([tf.TensorSpec((3, 5), "float32")] * 6)
        counts = {}
        for op in _graph_ops(concrete.graph):
            if any(output.shape == (3, 5) for output in op.outputs):
                counts[op.type] = counts.get(op.type, 0) + 1
        return counts

    kmp_ops = gradient_ops(
        kmp.LossScaleOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=4))
    )
    keras_ops = gradient_ops(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=4))
    )
    assert "SelectV2" not in kmp_ops and "ZerosLike" not in kmp_ops, kmp_ops
    assert kmp_ops["RealDiv"] == keras_ops["RealDiv"]  # unscale, and Keras' mean
    # kmp's finite check is one float32 sum per gradient (`_gradients.finite_flags`),
    # with no boolean tensor of the gradient's size; Keras' is `all(isfinite(g))`.
    assert keras_ops.get("IsFinite") == 6 and "IsFinite" not in kmp_ops, kmp_ops
    passes = lambda counts: sum(n for op, n in counts.items() if op != "Const")  # noqa: E731
    assert passes(kmp_ops) <= passes(keras_ops) - 6, (kmp_ops, keras_ops)


# -- the pass-through switch and explicit scalers ----------------------------


def _train_sgd(optimizer, grads_per_step, scaled=True):
    w = keras.Variable([1.0, 1.0])
    for g in grads_per_step:
        with tf.GradientTape() as tape:
            loss = ops.sum(w * ops.convert_to_tensor(g, "float32"))
            if scaled:
                loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(loss, [w]), [w])
    return np.asarray(w)


def test_enabled_false_is_a_pass_through():
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), enabled=False)
    loss = ops.convert_to_tensor(3.0)
    assert optimizer.scale_loss(loss) is loss
    assert float(optimizer.loss_scale) == 1.0
    weights = _train_sgd(optimizer, [[1.0, 2.0], [1.0, np.inf]])
    # Nothing is checked or skipped: the inner optimizer applies the inf.
    assert weights[0] == 0.0 and weights[1] == -np.inf
    assert int(optimizer.skipped_steps) == 0 and int(optimizer.iterations) == 2
    config = optimizer.get_config()
    assert config["enabled"] is False
    assert kmp.LossScaleOptimizer.from_config(config).enabled is False


def test_enabled_must_be_a_bool():
    with pytest.raises(ValueError, match=r"`enabled` must be True or False. Received: enabled='no'"):
        kmp.LossScaleOptimizer("sgd", enabled="no")


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_explicit_scaler_under_bfloat16_and_float32_scales_exactly(policy):
    kmp.set_policy(policy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    weights = {}
    for loss_scale in (None, "dynamic"):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = kmp.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))
        model.compile(keras.optimizers.SGD(0.1), "mse", loss_scale=loss_scale)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        weights[loss_scale] = [np.asarray(v) for v in model.weights]
        if loss_scale == "dynamic":
            # The docstring: it scales (by a power of two, exactly) and skips nothing.
            assert float(model.optimizer.loss_scale) == 2.0**15
            assert int(model.optimizer.skipped_steps) == 0
    # Scaling by a power of two is exact: on a CPU both runs round alike. On a
    # GPU (an H200 failed 1e-6 here) TensorFlow runs float32 matmuls in TF32
    # (10 mantissa bits), and the two runs are different XLA programs, whose
    # results may differ by TF32 roundings: allowed only where float32 matmuls
    # use TF32.
    compute_dtype = float32_compute_dtype()
    rtol = 1e-6 if compute_dtype == "float32" else 8 * EPSILON[compute_dtype]
    for plain, scaled in zip(weights[None], weights["dynamic"]):
        atol = 1e-7 if compute_dtype == "float32" else rtol * np.abs(plain).max()
        np.testing.assert_allclose(scaled, plain, rtol=rtol, atol=atol)


# -- gradients of a loss that was never scaled ---------------------------


def test_a_loop_without_scale_loss_is_divided_as_in_keras_with_one_warning():
    # Outside kmp.Model's train step kmp cannot tell an unscaled loss's
    # gradients from hand-scaled ones without patching GradientTape (issue
    # 23): it divides, as Keras' scaler, and says so once.
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=4.0)
    with pytest.warns(UserWarning, match=r"scaled_loss = optimizer.scale_loss\(loss\)") as record:
        weights = _train_sgd(optimizer, [[4.0, 8.0], [4.0, 8.0]], scaled=False)
    assert sum("divided gradients" in str(w.message) for w in record) == 1
    np.testing.assert_allclose(weights, [0.0, -1.0])  # 1 - 2 * 0.5 * g / 4
    # An overflow is still skipped; a step with scale_loss does not warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_sgd(optimizer, [[np.inf, 0.0]], scaled=False)
        _train_sgd(kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5)), [[1.0, 1.0]])
    assert int(optimizer.skipped_steps) == 1


def test_the_divided_warning_points_at_the_users_line_through_apply_gradients():
    # apply_gradients reaches apply through Keras' optimizer: the warning still
    # names the caller's file and line, not kmp's or Keras'.
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    w = keras.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = 2.0 * w[0]
    grads = tape.gradient(loss, [w])
    with pytest.warns(UserWarning, match="divided gradients") as record:
        line = inspect.currentframe().f_lineno + 1
        optimizer.apply_gradients(zip(grads, [w]))
    (warning,) = [w for w in record if "divided gradients" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_hand_scaled_gradients_are_divided_as_in_keras():
    # Keras' own test_finite_step: gradients scaled by hand, no scale_loss.
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    w = keras.Variable([1.0, 2.0, 3.0, 4.0])
    with pytest.warns(UserWarning, match="divided gradients"):
        optimizer.apply([ops.array([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale], [w])
    np.testing.assert_allclose(np.asarray(w), [0.5, -1.0, -0.5, 3.0])


def test_importing_kmp_changes_no_tensorflow_or_keras_attribute():
    # Issue 23: what kmp changed before (GradientTape.gradient on import,
    # Keras optimizers' _all_reduce_sum_gradients when training) stays
    # Keras' and TensorFlow's own, in a fresh process.
    import subprocess
    import sys

    code = (
        "import tensorflow as tf, keras\n"
        "def foreign():\n"
        "    name = '_all_reduce_sum_gradients'\n"
        "    owner = next(k for k in keras.optimizers.SGD.__mro__ if name in vars(k))\n"
        "    return [tf.GradientTape.gradient, vars(owner)[name]]\n"
        "before = foreign()\n"
        "import numpy as np, kmp\n"
        "assert all(a is b for a, b in zip(before, foreign())), 'changed on import'\n"
        "kmp.set_policy('mixed_float16')\n"
        "class Step(kmp.Model):\n"
        "    def train_step(self, data):\n"
        "        return super().train_step(data)\n"
        "steps = [vars(kmp.Model)['train_step'], vars(Step)['train_step']]\n"
        "inputs = keras.Input((2,))\n"
        "model = Step(inputs, keras.layers.Dense(1)(inputs))\n"
        "model.compile('sgd', 'mse')\n"
        "model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)\n"
        "assert all(a is b for a, b in zip(before, foreign())), 'changed by fit'\n"
        "assert steps[0] is vars(kmp.Model)['train_step'], 'kmp.Model.train_step rewrapped'\n"
        "assert steps[1] is vars(Step)['train_step'], 'the subclass train_step rewrapped'\n"
        "print('unchanged')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.stdout.strip().endswith("unchanged"), result.stderr[-2000:]


def test_scaled_and_hand_scaled_gradients_are_divided_in_a_tf_function():
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8.0)
    w = keras.Variable([1.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(2.0 * w[0])
        optimizer.apply(tape.gradient(loss, [w]), [w])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step()
        step()
        np.testing.assert_allclose(np.asarray(w), [-1.0])
    with pytest.warns(UserWarning, match="divided gradients"):
        optimizer.apply([ops.array([8.0 * 2.0])], [w])  # by hand: divided, as in Keras
    np.testing.assert_allclose(np.asarray(w), [-2.0])


def test_gradient_values_go_back_sparse_where_they_were_sparse():
    # The step's math runs on each gradient's values (`values_of`), then puts
    # them back (`with_values`): a sparse gradient stays sparse, with its
    # indices, whether its values changed or came back as they were.
    gradients_module = kmp.backends.get("gradients")
    sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([3]), tf.constant([5, 2]))
    dense = tf.constant([4.0, 8.0])
    grads = [sparse, None, dense]
    values = gradients_module.values_of(grads)
    assert values[0] is sparse.values and values[1] is None and values[2] is dense
    kept = gradients_module.with_values(grads, values)
    assert kept[0] is sparse and kept[1] is None and kept[2] is dense
    halved = gradients_module.with_values(grads, [None if v is None else v / 2 for v in values])
    assert isinstance(halved[0], tf.IndexedSlices)
    np.testing.assert_array_equal(halved[0].values.numpy(), [[0.5, 1.0]])
    np.testing.assert_array_equal(halved[0].indices.numpy(), [3])
    np.testing.assert_array_equal(halved[2].numpy(), [2.0, 4.0])
