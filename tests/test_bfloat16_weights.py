"""bfloat16 weights that train (issue 48): a `kmp.Model` built under
`kmp.set_policy("bfloat16")` keeps its weights in bfloat16, and compile's
`kmp.LossScaleOptimizer` computes any Keras optimizer's update in float32 and
writes it with Kahan compensation (`kmp/precision/_compensated.py`).

Backend-neutral: every fit runs eagerly, as a graph and under XLA.
"""

import os

import keras
import numpy as np
import pytest

import kmp

BACKEND = keras.backend.backend()
MODES = {
    "eager": {"run_eagerly": True},
    "graph": {"jit_compile": False},
    "xla": {"jit_compile": True},
}


def _regression(rows=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def _mlp(policy, model_class=kmp.Model, start=None):
    """Dense(16, relu) -> Dense(1) under `policy` (kmp's, or a Keras
    layer dtype for `keras.Model`), from the weights `start` if given."""
    keras.utils.set_random_seed(0)
    dtype = None if model_class is kmp.Model else policy
    with kmp.policy_scope(policy if model_class is kmp.Model else "float32"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu", dtype=dtype)(inputs)
        model = model_class(inputs, keras.layers.Dense(1, dtype=dtype)(hidden))
    if start is not None:
        model.set_weights(start)
    return model


def _start():
    return _mlp("float32").get_weights()


def _fit(model, x, y, mode, epochs=3, optimizer=None):
    model.compile(optimizer or keras.optimizers.Adam(1e-2), "mse", **MODES[mode])
    return model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)


def _state(model):
    """Weights and every optimizer variable but the scaler's counters, as float32."""
    optimizer = model.optimizer
    state = [v for v in model.weights] + [
        v for v in optimizer.variables if "counters" not in v.path]
    return [np.asarray(keras.ops.cast(v, "float32")) for v in state]


def _assert_same_state(model, other):
    for ours, theirs in zip(_state(model), _state(other), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_weights_train_as_mixed_bfloat16_and_keras_own_do_not(mode):
    x, y = _regression()
    start = _start()
    model = _mlp("bfloat16", start=start)
    history = _fit(model, x, y, mode)
    assert {keras.backend.standardize_dtype(v.dtype) for v in model.trainable_variables} == {
        "bfloat16"}
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
    # One compensation buffer per weight, in its dtype: 2 bytes a parameter.
    buffers = [v for v in model.optimizer.variables if "compensation" in v.path]
    assert [(tuple(b.shape), b.dtype) for b in buffers] == [
        (tuple(v.shape), v.dtype) for v in model.trainable_variables]
    # Ends within 2% of mixed_bfloat16 (float32 weights) from the same start.
    mixed = _fit(_mlp("mixed_bfloat16", start=start), x, y, mode)
    assert abs(history.history["loss"][-1] - mixed.history["loss"][-1]) <= (
        0.02 * mixed.history["loss"][-1])
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    # Keras' own bfloat16 model, the same start: Adam never moves it.
    keras_model = _mlp("bfloat16", keras.Model, start=start)
    keras_history = _fit(keras_model, x, y, mode)
    assert len(set(keras_history.history["loss"])) == 1
    for ours, theirs in zip(keras_model.get_weights(), start):
        np.testing.assert_array_equal(np.asarray(ours, "float32"),
                                      np.asarray(keras.ops.cast(theirs, "bfloat16"), "float32"))


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_record_leaves_weights_buffers_and_moments_as_without_its_batch(mode):
    x, y = _regression(64)
    x[37] = np.nan  # the third batch of 16
    start = _start()
    model = _mlp("bfloat16", start=start)
    model.compile(keras.optimizers.Adam(1e-2), "mse", **MODES[mode])
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert history.history["skipped_steps"] == [1, 2]
    clean = _mlp("bfloat16", start=start)
    clean.compile(keras.optimizers.Adam(1e-2), "mse", **MODES[mode])
    keep = np.r_[0:32, 48:64]
    clean.fit(x[keep], y[keep], batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_state(model, clean)


def test_a_keras_file_resumes_bit_for_bit_buffers_included(tmp_path):
    x, y = _regression()
    start = _start()
    path = os.fspath(tmp_path / "model.keras")
    first = _mlp("bfloat16", start=start)
    _fit(first, x, y, "graph", epochs=1)
    buffers = [v for v in first.optimizer.variables if "compensation" in v.path]
    assert len(buffers) == 4 and any(np.any(np.asarray(keras.ops.cast(b, "float32")))
                                     for b in buffers)
    first.save(path)
    resumed = keras.saving.load_model(path)
    resumed.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    through = _mlp("bfloat16", start=start)
    _fit(through, x, y, "graph", epochs=2)
    _assert_same_state(resumed, through)


@pytest.mark.parametrize("mode", MODES)
def test_stochastic_rounding_trains_with_no_buffer_the_same_in_every_mode(mode):
    # compile(compensation="stochastic"): no buffer (weights and Adam's two
    # moments in bfloat16: 6 bytes a parameter, against Kahan's 8), within
    # 5% of mixed_bfloat16 from the same start, and the same run twice gives
    # the same weights bit for bit (its rounding is seeded by the step and
    # the variable), in every mode.
    x, y = _regression()
    start = _start()
    model = _mlp("bfloat16", start=start)
    model.compile(keras.optimizers.Adam(1e-2), "mse", compensation="stochastic", **MODES[mode])
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert model.optimizer.compensation == "stochastic"
    assert not [v for v in model.optimizer.variables if "compensation" in v.path]
    state = [v for v in model.optimizer.variables if v.shape == model.trainable_variables[0].shape]
    assert len(state) == 2 and {keras.backend.standardize_dtype(v.dtype) for v in state} == {
        "bfloat16"}
    mixed = _fit(_mlp("mixed_bfloat16", start=start), x, y, mode)
    assert abs(history.history["loss"][-1] - mixed.history["loss"][-1]) <= (
        0.05 * mixed.history["loss"][-1])
    again = _mlp("bfloat16", start=start)
    again.compile(keras.optimizers.Adam(1e-2), "mse", compensation="stochastic", **MODES[mode])
    again.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), again.get_weights(), strict=True):
        np.testing.assert_array_equal(np.asarray(ours, "float32"), np.asarray(theirs, "float32"))


def test_stochastic_rounding_skips_a_nan_record_and_resumes_from_a_keras_file(tmp_path):
    # A NaN record: the run ends as one that never saw its batch (the steps
    # after it are seeded as that run's); a .keras file keeps the setting
    # and resumes bit for bit.
    x, y = _regression(64)
    x[37] = np.nan
    start = _start()
    compile_args = dict(optimizer=keras.optimizers.Adam(1e-2), loss="mse",
                        compensation="stochastic")
    model = _mlp("bfloat16", start=start)
    model.compile(**compile_args)
    assert model.fit(x, y, batch_size=16, epochs=1, shuffle=False,
                     verbose=0).history["skipped_steps"] == [1]
    path = os.fspath(tmp_path / "model.keras")
    model.save(path)
    resumed = keras.saving.load_model(path)
    assert resumed.optimizer.compensation == "stochastic"
    resumed.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    clean = _mlp("bfloat16", start=start)
    clean.compile(**dict(compile_args, optimizer=keras.optimizers.Adam(1e-2)))
    keep = np.r_[0:32, 48:64]
    clean.fit(x[keep], y[keep], batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_same_state(resumed, clean)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_trains_bfloat16_weights_as_mixed_bfloat16(mode):
    # Adam accumulating 2 micro-batches of 16: within 2% of mixed_bfloat16's
    # epoch losses from the same start, with as many applied steps. (On JAX
    # kmp's scaler refuses accumulation, under every policy, with a clear error.)
    x, y = _regression()
    start = _start()
    if BACKEND == "jax":
        model = _mlp("bfloat16", start=start)
        model.compile(keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2), "mse",
                      **MODES[mode])
        with pytest.raises(ValueError, match="Received: gradient_accumulation_steps=2"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        return
    histories, iterations = [], []
    for policy in ("bfloat16", "mixed_bfloat16"):
        model = _mlp(policy, start=start)
        model.compile(keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2), "mse",
                      **MODES[mode])
        histories.append(model.fit(x, y, batch_size=16, epochs=3, shuffle=False,
                                   verbose=0).history["loss"])
        iterations.append(int(model.optimizer.iterations))
    np.testing.assert_allclose(histories[0], histories[1], rtol=0.02)
    assert iterations == [24, 24] and histories[0][-1] < 0.5 * histories[0][0]


def test_skip_nonfinite_false_is_refused_where_only_the_scaler_trains_16_bit_weights():
    # Keras' own Adam leaves bfloat16 weights as they are: compile says so
    # and changes nothing, rather than train nothing silently.
    model = _mlp("bfloat16")
    model.compile("adam", "mse")
    before = model.optimizer
    with pytest.raises(ValueError, match=r"Received: skip_nonfinite=False, with the weights of "
                                         r"layer 'dense' stored in 16 bits"):
        model.compile("adam", "mse", skip_nonfinite=False)
    assert model.optimizer is before
    float32_weights = _mlp("mixed_bfloat16")
    float32_weights.compile("adam", "mse", skip_nonfinite=False)
    assert isinstance(float32_weights.optimizer, keras.optimizers.Adam)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="JAX jit-compiles every step")
@pytest.mark.parametrize("policy, compiled", [("bfloat16", 1), ("mixed_bfloat16", 0)])
def test_without_xla_the_update_of_bfloat16_weights_alone_is_compiled(policy, compiled):
    # In a graph without XLA the compensated update is a dozen element-wise
    # passes over every weight (0.66x mixed_bfloat16's step on benchmarks'
    # mlp): it runs as one XLA-compiled function, and nothing else does;
    # float32 weights keep Keras' update.
    import tensorflow as tf

    x, y = _regression(64)
    model = _mlp(policy)
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    function = kmp.backends.tensorflow.distribute.make_function(model, model.train_step)
    graph = function.get_concrete_function(iter(dataset)).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    assert sum(n.attr["_XlaMustCompile"].b for n in nodes if "_XlaMustCompile" in n.attr) == (
        compiled)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is TensorFlow's")
@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_bfloat16_weights_train_alike_on_every_replica_of_a_mirrored_strategy(
        mirrored_strategy, compensation):
    # Each replica's update is kmp's (the optimizer hands it each replica's
    # own variable): the run ends within 2% of one replica's, and every
    # replica holds the same weights and buffers. Keras' own update, which
    # each replica ran before, left the loss flat.
    x, y = _regression()
    start = _start()
    alone = _mlp("bfloat16", start=start)
    alone.compile(keras.optimizers.Adam(1e-2), "mse", compensation=compensation)
    expected = alone.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    with mirrored_strategy.scope():
        model = _mlp("bfloat16", start=start)
        model.compile(keras.optimizers.Adam(1e-2), "mse", compensation=compensation)
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    assert abs(history.history["loss"][-1] - expected.history["loss"][-1]) <= (
        0.02 * expected.history["loss"][-1])
    for variable in list(model.trainable_variables) + list(model.optimizer.variables):
        first, *others = mirrored_strategy.experimental_local_results(variable.value)
        for other in others:
            np.testing.assert_array_equal(np.asarray(keras.ops.cast(first, "float32")),
                                          np.asarray(keras.ops.cast(other, "float32")))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a tf.GradientTape loop is TensorFlow's")
def test_a_gradient_tape_loop_trains_bfloat16_weights_with_the_scaler_it_wraps_in():
    import tensorflow as tf

    x, y = _regression()
    start = _start()
    results = {}
    for name, optimizer in (
        ("kmp", kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))),  # the one line
        ("keras", keras.optimizers.Adam(1e-2)),
    ):
        model = _mlp("bfloat16", keras.Model, start=start)

        @tf.function
        def train_step(xb, yb, model=model, optimizer=optimizer):
            with tf.GradientTape() as tape:
                out = keras.ops.cast(model(xb, training=True), "float32")
                loss = keras.ops.mean(keras.ops.square(out - yb))
                scaled = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(scaled, model.trainable_variables),
                            model.trainable_variables)
            return loss

        losses = [float(train_step(x[i:i + 32], y[i:i + 32]))
                  for _ in range(3) for i in range(0, len(x), 32)]
        results[name] = (losses, model)
    kmp_losses, _ = results["kmp"]
    keras_losses, keras_model = results["keras"]
    assert np.mean(kmp_losses[-8:]) < 0.5 * np.mean(kmp_losses[:8])
    for ours, theirs in zip(keras_model.get_weights(), start):  # Keras' Adam: never moved
        np.testing.assert_array_equal(np.asarray(ours, "float32"),
                                      np.asarray(keras.ops.cast(theirs, "bfloat16"), "float32"))


def test_kmp_backup_and_restore_resumes_bfloat16_weights_exactly(tmp_path):
    # Interrupted after the first epoch, resumed from kmp's backup: the
    # weights, moments and compensation buffers of a run that never stopped.
    x, y = _regression()
    start = _start()

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise RuntimeError("interrupted")

    backup = kmp.callbacks.BackupAndRestore(os.fspath(tmp_path / "backup"))
    interrupted = _mlp("bfloat16", start=start)
    interrupted.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                        callbacks=[backup, Interrupt()])
    resumed = _mlp("bfloat16", start=start)
    resumed.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
    resumed.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                callbacks=[kmp.callbacks.BackupAndRestore(os.fspath(tmp_path / "backup"))])
    through = _mlp("bfloat16", start=start)
    _fit(through, x, y, "graph", epochs=2)
    _assert_same_state(resumed, through)


# --- It is kept: served and loaded under another policy ------------------------


def _conv_regression(rows=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6, 4)).astype("float32")
    return x, np.stack([x[:, :, 0].sum(axis=1), x[:, :, 1].mean(axis=1)], axis=1)


def _conv_model():
    """Conv1D -> LayerNormalization -> Dense: a convolution refuses bfloat16
    filters with float32 inputs, which a Dense's matmul would promote."""
    inputs = keras.Input((6, 4))
    hidden = keras.layers.Conv1D(8, 3, activation="relu")(inputs)
    hidden = keras.layers.LayerNormalization()(hidden)
    return kmp.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(hidden)))


def _trained_conv_model(path, policy="bfloat16", epochs=2):
    """A kmp.Model made under `policy`, trained by Adam, saved to `path`."""
    x, y = _conv_regression()
    with kmp.policy_scope(policy):
        model = _conv_model()
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    model.save(path)
    return model, x, y


def _trained_bfloat16_conv_model(path):
    """A bfloat16 kmp.Model trained 2 epochs by Adam, saved to `path`."""
    model, x, y = _trained_conv_model(path)
    assert {keras.backend.standardize_dtype(v.dtype) for v in model.weights} == {"bfloat16"}
    return model, x, y


def _float32_reference(model, x):
    """`model`'s bfloat16 weights, exactly, in a float32 twin: float32 math."""
    with kmp.policy_scope("float32"):
        twin = _conv_model()
    twin.set_weights([np.asarray(keras.ops.cast(w, "float32")) for w in model.weights])
    return np.asarray(twin.predict(x, verbose=0))


def _served(path, x):
    import tensorflow as tf

    served = tf.saved_model.load(os.fspath(path))
    outputs = served.serve(x)
    assert outputs.dtype == tf.float32
    signature = served.signatures["serving_default"].structured_input_signature[1]
    assert [spec.dtype for spec in signature.values()] == [tf.float32]
    return np.asarray(outputs)


def _matmul_dtypes(path):
    """The dtypes of the SavedModel's matmuls and convolutions (TensorFlow's
    graph; a JAX export is one XlaCallModule op)."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        saved_model.ParseFromString(f.read())
    dtypes = set()
    for meta_graph in saved_model.meta_graphs:
        for function in meta_graph.graph_def.library.function:
            for node in function.node_def:
                if node.op in ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv1D"):
                    dtypes.add(tf.as_dtype(node.attr["T"].type).name)
    return dtypes


def test_export_of_bfloat16_weights_serves_float32_in_and_out(tmp_path):
    pytest.importorskip("tensorflow", reason="a SavedModel is a TensorFlow graph on every backend")
    from _helpers import assert_close_to_float16_rounding

    model, x, _ = _trained_bfloat16_conv_model(tmp_path / "model.keras")
    predictions = np.asarray(model.predict(x, verbose=0))
    reference = _float32_reference(model, x)
    policies = [layer.dtype_policy for layer in model.layers]
    for inference_policy in (None, "bfloat16", "mixed_bfloat16", "float32"):
        path = tmp_path / f"served_{inference_policy}"
        model.export(path, inference_policy=inference_policy, verbose=False)
        served = _served(path, x)
        if inference_policy == "float32":
            # float32 math over the bfloat16 weights: the float32 twin's
            # outputs to float32 rounding, and predict's to bfloat16's
            # (2 roundings a layer, 3 layers).
            np.testing.assert_allclose(served, reference, rtol=1e-5, atol=1e-5)
            assert_close_to_float16_rounding(served, predictions, roundings=6, dtype="bfloat16")
            assert np.max(np.abs(served - predictions)) > 1e-3  # not predict's bfloat16 math
        elif BACKEND == "tensorflow":
            # The same bfloat16 math as predict, by the same kernels.
            np.testing.assert_array_equal(served, predictions)
        else:
            # The same bfloat16 math by two engines (JAX's jit, TensorFlow's
            # XLA through jax2tf): 2 roundings a layer apart at most.
            assert_close_to_float16_rounding(served, predictions, roundings=6, dtype="bfloat16")
        if BACKEND == "tensorflow":
            assert _matmul_dtypes(path) == (
                {"float32"} if inference_policy == "float32" else {"bfloat16"})
    # The model is left as it was: its policies, its bfloat16 weights.
    assert [layer.dtype_policy for layer in model.layers] == policies
    assert {keras.backend.standardize_dtype(v.dtype) for v in model.weights} == {"bfloat16"}
    np.testing.assert_array_equal(model.predict(x, verbose=0), predictions)


def _optimizer_state(model):
    """Every optimizer variable by its name (a path's scopes differ between
    an optimizer built in `fit` and one built in `load_model`), as float32."""
    state = {"/".join(v.path.split("/")[-2:]): np.asarray(keras.ops.cast(v, "float32"))
             for v in model.optimizer.variables}
    assert len(state) == len(model.optimizer.variables)
    return state


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_load_model_under_another_policy_keeps_the_files_bfloat16_weights_and_trains_on(
        tmp_path, policy):
    path = tmp_path / "model.keras"
    model, x, y = _trained_bfloat16_conv_model(path)
    loaded = kmp.load_model(path, policy=policy)
    # The weights and the optimizer's state as the file holds them: bfloat16,
    # bit for bit, the compensation buffers and the moments included.
    assert [(v.path, keras.backend.standardize_dtype(v.dtype)) for v in loaded.weights] == [
        (v.path, "bfloat16") for v in model.weights]
    for saved, restored in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(keras.ops.cast(restored, "float32")),
                                      np.asarray(keras.ops.cast(saved, "float32")))
    saved_state = _optimizer_state(model)
    assert _optimizer_state(loaded).keys() == saved_state.keys()
    for name, value in _optimizer_state(loaded).items():
        np.testing.assert_array_equal(value, saved_state[name], err_msg=name)
    assert sum("compensation" in name for name in saved_state) == 6
    compute = {layer.name: layer.compute_dtype for layer in loaded.layers[1:]}
    if policy == "float32":
        assert set(compute.values()) == {"float32"}
        np.testing.assert_allclose(loaded.predict(x, verbose=0), _float32_reference(model, x),
                                   rtol=1e-5, atol=1e-5)
    else:
        assert compute["conv1d"] == compute["dense"] == "bfloat16"
        assert compute["layer_normalization"] == "float32"
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))

    # Training goes on from the file's state: the updates still counted in
    # float32 and compensated, the weights still bfloat16.
    iterations = int(loaded.optimizer.iterations)
    history = loaded.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations) == iterations + 8
    assert history.history["skipped_steps"] == [0, 0]
    assert {keras.backend.standardize_dtype(v.dtype) for v in loaded.weights} == {"bfloat16"}
    moved = _optimizer_state(loaded)
    for name, value in saved_state.items():
        if "momentum" in name or "velocity" in name or "compensation" in name:
            assert np.any(moved[name] != value), name
    for saved, trained in zip(model.weights, loaded.weights, strict=True):
        assert np.any(np.asarray(keras.ops.cast(saved, "float32"))
                      != np.asarray(keras.ops.cast(trained, "float32"))), saved.path
    on = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # bfloat16 math
    if policy == "mixed_bfloat16":  # the very same math: bit for bit
        assert history.history["loss"] == on.history["loss"]
        for ours, theirs in zip(loaded.weights, model.weights, strict=True):
            np.testing.assert_array_equal(np.asarray(keras.ops.cast(ours, "float32")),
                                          np.asarray(keras.ops.cast(theirs, "float32")))
    else:
        assert history.history["loss"][-1] < history.history["loss"][0]
        assert abs(history.history["loss"][-1] - on.history["loss"][-1]) <= (
            0.05 * on.history["loss"][-1])

    # Saved again, the file still holds bfloat16 weights and their state:
    # Keras alone loads it as it was trained, computing in bfloat16.
    loaded.save(tmp_path / "again.keras")
    again = keras.saving.load_model(tmp_path / "again.keras")
    assert {keras.backend.standardize_dtype(v.dtype) for v in again.weights} == {"bfloat16"}
    assert again.get_layer("conv1d").compute_dtype == "bfloat16"
    for name, value in _optimizer_state(again).items():
        np.testing.assert_array_equal(value, _optimizer_state(loaded)[name], err_msg=name)


def test_a_float32_weights_file_loaded_under_bfloat16_computes_in_bfloat16(tmp_path):
    # Loading never converts the weights: float32 ones stay float32 and are
    # read as bfloat16 (as under mixed_bfloat16), not left in float32 math.
    model, x, _ = _trained_conv_model(tmp_path / "mixed.keras", "mixed_bfloat16", epochs=1)
    loaded = kmp.load_model(tmp_path / "mixed.keras", policy="bfloat16")
    assert {keras.backend.standardize_dtype(v.dtype) for v in loaded.weights} == {"float32"}
    assert loaded.get_layer("conv1d").compute_dtype == "bfloat16"
    assert keras.backend.standardize_dtype(
        loaded.get_layer("conv1d")(x).dtype) == "bfloat16"
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    if BACKEND == "tensorflow":
        model.export(tmp_path / "served", inference_policy="bfloat16", verbose=False)
        assert _matmul_dtypes(tmp_path / "served") == {"bfloat16"}


def test_normalization_weights_train_under_bfloat16():
    # Keras' Layer/Batch/GroupNormalization make gamma and beta with
    # autocast=False: their update is computed in float32 all the same
    # (Keras' own bfloat16 Adam leaves them at 1 and 0).
    x, y = _conv_regression()
    with kmp.policy_scope("bfloat16"):
        model = _conv_model()
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    norm = model.layers[2]
    assert isinstance(norm, keras.layers.LayerNormalization)
    # Adam's first steps move each weight by about the learning rate, 1e-2
    # (Keras' own bfloat16 Adam leaves every one exactly at 1 and 0).
    gamma = np.asarray(keras.ops.cast(norm.gamma, "float32"))
    beta = np.asarray(keras.ops.cast(norm.beta, "float32"))
    assert np.all(gamma != 1.0) and np.all(beta != 0.0)
    assert np.max(np.abs(gamma - 1.0)) > 5e-3 and np.max(np.abs(beta)) > 5e-3


def _multi_optimizer(optimizer_map=None):
    return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
        default_optimizer=keras.optimizers.Adam(1e-2), optimizer_map=optimizer_map))


def _compensated_state(model):
    """Weights, compensation buffers and Adam's moments, as float32, in order."""
    kept = ("compensation", "momentum", "velocity")
    variables = list(model.weights) + [
        v for v in model.optimizer.variables if any(word in v.name for word in kept)]
    return [np.asarray(keras.ops.cast(v, "float32")) for v in variables]


@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"),
                    reason="keras.optimizers.MultiOptimizer is new in Keras 3.15")
@pytest.mark.parametrize("mode", MODES)
def test_each_optimizer_of_a_multi_optimizer_trains_its_bfloat16_weights(mode):
    # Keras' MultiOptimizer hands each variable to a sub-optimizer, whose own
    # update_step and writes update it: each gets the float32 update and the
    # compensated write (before, the Adam behind it left its weights exactly
    # as they were). One Adam behind it is the Adam alone, bit for bit, a
    # skipped NaN record included (beside an SGD no variable maps to, which
    # Keras never builds).
    x, y = _regression(64)
    x[37] = np.nan  # the third batch of 16
    start = _start()
    states, skipped = [], []
    unmapped = {"no_such_layer/.*": keras.optimizers.SGD(1e-2)}
    for optimizer in (keras.optimizers.Adam(1e-2), _multi_optimizer(unmapped)):
        model = _mlp("bfloat16", start=start)
        model.compile(optimizer, "mse", **MODES[mode])
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        states.append(_compensated_state(model))
        skipped.append(history.history["skipped_steps"])
    assert skipped == [[1, 2], [1, 2]]
    assert len(states[0]) == 4 + 4 + 8  # weights, buffers, moments
    for ours, alone in zip(states[1], states[0], strict=True):
        np.testing.assert_array_equal(ours, alone)

    # Adam on the hidden layer, SGD on the output: every weight moves, and the
    # model ends within 2% of the same split over float32 weights.
    x, y = _regression()
    losses = {}
    for policy in ("bfloat16", "mixed_bfloat16"):
        model = _mlp(policy, start=start)
        split = _multi_optimizer({model.layers[-1].path + "/.*": keras.optimizers.SGD(1e-2)})
        losses[policy] = _fit(model, x, y, mode, optimizer=split).history["loss"]
        if policy == "bfloat16":
            for weight, first in zip(model.trainable_weights, start, strict=True):
                moved = np.asarray(keras.ops.cast(weight, "float32")) != np.asarray(
                    keras.ops.cast(keras.ops.cast(first, "bfloat16"), "float32"))
                assert moved.any(), weight.path
    assert abs(losses["bfloat16"][-1] - losses["mixed_bfloat16"][-1]) <= (
        0.02 * losses["mixed_bfloat16"][-1]), losses
