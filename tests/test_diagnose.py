"""kmp.diagnose: the layer, the tensor and the direction of a 16-bit failure."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmp
from kmp.diagnosis import _probe as _diagnose_probe


def _dense_model(names, units, policy="float32"):
    with kmp.policy_scope(policy):
        inputs = keras.Input((4,))
        hidden = inputs
        for name, width in zip(names, units):
            hidden = keras.layers.Dense(width, name=name)(hidden)
        return keras.Model(inputs, hidden)


def _float32_gradients(model, x, y):
    """Gradients of the mse loss w.r.t. every layer output and weight, in float64."""
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    extractor = keras.Model(model.input, [layer.output for layer in layers])
    with tf.GradientTape() as tape:
        outputs = extractor(x)
        loss = tf.reduce_mean(tf.square(tf.cast(outputs[-1], "float32") - y))
    gradients = tape.gradient(loss, outputs + model.trainable_weights)
    return np.concatenate([np.ravel(g.numpy()).astype(np.float64) for g in gradients])


def _brute_force_scale(gradients):
    """Largest 2**k (|k| <= 24) at which TensorFlow's float16 cast keeps every gradient finite."""
    for exponent in range(24, -25, -1):
        scaled = tf.constant(gradients * 2.0**exponent, tf.float32)
        if np.all(np.isfinite(tf.cast(scaled, tf.float16).numpy())):
            return 2.0**exponent
    return None


def test_forward_overflow_names_the_layer():
    model = _dense_model(["small", "big", "head"], [8, 8, 1], "mixed_float16")
    # "small" passes the four ones through; each output of "big" is
    # 4 * 2e4 = 80000 > 65504.
    model.get_layer("small").kernel.assign(np.eye(4, 8, dtype="float32"))
    model.get_layer("big").kernel.assign(np.full((8, 8), 2e4, "float32"))
    x = np.ones((2, 4), "float32")
    y = np.zeros((2, 1), "float32")

    report = kmp.diagnose(model, (x, y), loss="mse")

    assert report.first_nonfinite == {
        "layer": "big", "tensor": "output", "direction": "forward"
    }
    assert report.direction == "forward"
    big = report.layer("big")
    assert big["activation_overflow"] == 1.0
    assert big["max_abs_activation"] == pytest.approx(8e4)
    assert big["rel_error"] == float("inf")
    assert report.layer("small")["activation_overflow"] == 0.0
    expected = "mixed_bfloat16" if _diagnose_probe.hardware_has_bfloat16() else "float32"
    assert report.recommended_policy == expected
    assert "65504" in report.policy_reason
    assert "big (output), forward" in str(report)


def test_backward_overflow_at_the_default_scale():
    # Output 100 on a finite forward pass; d(mse)/d(output) = 200, and
    # 200 * 2**15 overflows float16.
    model = _dense_model(["hidden", "out"], [4, 1])
    model.get_layer("hidden").kernel.assign(np.eye(4, dtype="float32"))
    model.get_layer("out").kernel.assign(np.full((4, 1), 25.0, "float32"))
    x = np.ones((1, 4), "float32")
    y = np.zeros((1, 1), "float32")

    report = kmp.diagnose(model, (x, y), loss="mse", policy="mixed_float16")

    assert report.loss_scale == 2.0**15
    assert report.direction == "backward"
    assert report.first_nonfinite["layer"] == "out"
    assert all(not row["activation_nonfinite"] for row in report.layers)
    assert report.layer("out")["gradient_nonfinite"]
    assert report.layer("out")["gradient_overflow"] > 0
    assert report.layer("out")["max_abs_gradient"] == pytest.approx(200.0)
    # The recommendation is the brute-force answer on independent gradients.
    gradients = _float32_gradients(model, x, y)
    assert report.recommended_loss_scale == _brute_force_scale(gradients)
    # The largest gradient is "hidden"'s, 200 * 25 = 5000: 5000 * 8 < 65520.
    assert report.recommended_loss_scale == 2.0**3
    assert report.recommended_policy == "mixed_float16"


def test_underflowing_layer_is_named():
    model = _dense_model(["first", "tiny"], [4, 1])
    model.get_layer("first").kernel.assign(np.eye(4, dtype="float32"))
    # d(mse)/d(output) = -0.5 per sample, so "tiny"'s kernel gradient is -1
    # (finite at 2**15) while the gradients reaching "first" are
    # 0.5 * 1e-13 * 2**15 ~ 1.6e-9, far below 2**-25: flushed to zero.
    model.get_layer("tiny").kernel.assign(np.full((4, 1), 1e-13, "float32"))
    x = np.ones((2, 4), "float32")
    y = np.full((2, 1), 0.5, "float32")

    report = kmp.diagnose(model, (x, y), loss="mse", policy="mixed_float16")

    assert report.direction is None
    first = report.layer("first")
    assert first["gradient_zero"] > 0.5  # its output and kernel gradients
    assert report.layer("tiny")["gradient_zero"] < first["gradient_zero"]
    gradients = _float32_gradients(model, x, y)
    scale = _brute_force_scale(gradients)
    assert report.recommended_loss_scale == scale
    flushed = tf.cast(tf.constant(gradients * scale, tf.float32), tf.float16).numpy()
    expected_zero = np.mean((gradients != 0) & (flushed == 0))
    assert report.underflow_at_recommended["zero"] == pytest.approx(expected_zero)
    # 80% of the gradient values lost even at the largest safe scale.
    expected = "mixed_bfloat16" if _diagnose_probe.hardware_has_bfloat16() else "float32"
    assert report.recommended_policy == expected
    assert "flush to zero" in report.policy_reason


def test_float16_counts_match_tensorflows_cast():
    boundaries = np.array(
        [2.0**-25, 2.0**-25 * 1.0001, 2.0**-24, 2.0**-14 - 2.0**-25,
         2.0**-14 - 2.0**-24, 2.0**-14, 1.0, 65504.0, 65519.99, 65520.0, 1e6, 0.0],
        dtype=np.float32,
    )
    values = np.concatenate([boundaries, -boundaries,
                             np.random.default_rng(0).lognormal(-10, 8, 2000).astype(np.float32)])
    for scale in (1.0, 2.0**-3, 2.0**15):
        counts = _diagnose_probe.float16_counts(values, scale)
        cast = tf.cast(tf.constant(values * scale), tf.float16).numpy().astype(np.float64)
        assert counts["overflow"] == np.sum(np.isinf(cast))
        assert counts["zero"] == np.sum((values != 0) & (cast == 0))
        assert counts["subnormal"] == np.sum((cast != 0) & (np.abs(cast) < 2.0**-14))


@pytest.mark.parametrize("largest", [0.0, 1e-9, 0.37, 1.0, 65504.0, 65520.0, 3e8, 1e13])
def test_recommended_scale_matches_brute_force(largest):
    gradients = np.array([largest, largest / 3, 1e-6], dtype=np.float32)
    assert _diagnose_probe.recommend_loss_scale(gradients) == _brute_force_scale(
        gradients.astype(np.float64)
    )


def test_the_users_model_is_not_changed():
    model = _dense_model(["a", "b"], [4, 1], "mixed_float16")
    model.compile(kmp.LossScaleOptimizer("sgd", initial_scale=2.0**10), loss="mse")
    model.optimizer.build(model.trainable_variables)
    weights = [w.copy() for w in model.get_weights()]
    policies = [layer.dtype_policy.name for layer in model.layers]
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.ones((4, 4), "float32"), np.zeros((4, 1), "float32"))
    ).batch(2)

    report = kmp.diagnose(model, dataset, steps=2)  # the compiled loss

    assert report.steps == 2
    assert report.loss_scale == 2.0**10  # the optimizer's current scale
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    assert [layer.dtype_policy.name for layer in model.layers] == policies
    assert int(model.optimizer.iterations) == 0
    assert float(model.optimizer.loss_scale) == 2.0**10
    assert kmp.get_policy().name == "float32"


class _PlainRMSNorm(keras.layers.Layer):
    def __init__(self, epsilon=1e-7, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def call(self, x):
        return x / ops.sqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + self.epsilon)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}


class _Masked(keras.layers.Layer):
    def call(self, x):
        return ops.where(x > 0, x, -1e9)


class _Exp(keras.layers.Layer):
    def call(self, x):
        return ops.exp(x) / ops.sum(ops.exp(x), axis=-1, keepdims=True)


class _SafeExp(keras.layers.Layer):
    def call(self, x):
        return ops.cast(ops.exp(ops.cast(x, "float32")), self.compute_dtype)


def _hazard_model(model_class=keras.Model, policy="mixed_float16"):
    with kmp.policy_scope(policy):
        inputs = keras.Input((4,))
        hidden = _PlainRMSNorm(name="rms")(inputs)
        hidden = keras.layers.LayerNormalization(epsilon=1e-7, name="keras_ln")(hidden)
        hidden = _Masked(name="masked")(hidden)
        hidden = _Exp(name="softmaxish")(hidden)
        hidden = _SafeExp(name="safe_exp")(hidden)
        outputs = keras.layers.Dense(1, name="head")(hidden)
        return model_class(inputs, outputs)


def test_static_checks_name_the_layer_and_the_fix():
    report = kmp.diagnose(_hazard_model())  # no data: static checks only

    assert report.steps == 0
    found = {(f["check"], f["layer"]) for f in report.findings}
    assert ("epsilon", "rms") in found
    assert ("float16 math", "rms") in found  # sum of squares and a norm
    assert ("constant", "masked") in found
    assert ("float16 math", "softmaxish") in found
    assert ("output dtype", "head") in found
    # Keras' LayerNormalization adds its epsilon in float32 whatever its
    # dtype, and _SafeExp casts to float32 first: nothing to report.
    assert not any(f["layer"] in ("keras_ln", "safe_exp") for f in report.findings)
    masked = next(f for f in report.findings if f["check"] == "constant")
    assert "-1e+09" in masked["message"] and masked["fix"]
    assert "[epsilon] rms" in str(report)


def test_static_checks_follow_the_policy_layers_run_in():
    # A kmp.Model casts its outputs to float32.
    kmp_findings = kmp.diagnose(_hazard_model(kmp.Model)).findings
    assert not any(f["check"] == "output dtype" for f in kmp_findings)
    # Under bfloat16 nothing runs in float16: only the bfloat16 output is left.
    bf16_findings = kmp.diagnose(_hazard_model(policy="mixed_bfloat16")).findings
    assert [(f["check"], f["layer"]) for f in bf16_findings] == [("output dtype", "head")]


def _weights_in(dtype, optimizer=None):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", dtype=dtype)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype=dtype)(hidden))
    if optimizer is not None:
        model.compile(optimizer, "mse")
    return model


def _weight_findings(model):
    return [f for f in kmp.diagnose(model).findings if f["check"] == "16-bit weights"]


def test_weights_stored_in_bfloat16_are_named_with_the_optimizer_that_cannot_move_them():
    # Keras' Adam never moves bfloat16 weights (tests/test_compensated.py
    # shows it): the finding says so, names the weights and gives the line.
    (finding,) = _weight_findings(_weights_in("bfloat16", keras.optimizers.Adam()))
    assert "4 of the model's 4 trainable weights are stored in bfloat16" in finding["message"]
    assert "dense/kernel" in finding["message"]
    assert "Adam's step is 0 (beta_2=0.999 rounds to 1 in bfloat16)" in finding["message"]
    assert "kmp.convert(model, 'bfloat16')" in finding["fix"]
    assert "kmp.set_policy('mixed_bfloat16')" in finding["fix"]
    # Behind a MultiOptimizer (Keras 3.15), the sub-optimizer is named.
    if hasattr(keras.optimizers, "MultiOptimizer"):
        multi = keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            keras.optimizers.Adam(), {".*bias": keras.optimizers.SGD()}))
        (finding,) = _weight_findings(_weights_in("bfloat16", multi))
        assert ("the step of Adam (beta_2=0.999) behind the MultiOptimizer is 0 (beta_2 rounds "
                "to 1 in bfloat16), so the weights it updates never change") in finding["message"]
    # SGD moves them, but loses what is below half a step.
    (finding,) = _weight_findings(_weights_in("bfloat16", keras.optimizers.SGD()))
    assert "is lost." in finding["message"] and "never" not in finding["message"]
    # float16 holds 0.999: Adam moves float16 weights, small updates still round away.
    (finding,) = _weight_findings(_weights_in("float16", keras.optimizers.Adam()))
    assert "2**-12 to 2**-11" in finding["message"] and "never" not in finding["message"]
    # Weights in float32 (mixed precision), or a kmp.Model under bfloat16,
    # whose compiled optimizer compensates (the fixes): nothing to report.
    assert _weight_findings(_weights_in("mixed_bfloat16", keras.optimizers.Adam())) == []
    converted = kmp.convert(_weights_in("float32"), "bfloat16")
    assert {v.dtype for v in converted.trainable_variables} == {"bfloat16"}
    assert _weight_findings(converted) == []
    converted.compile(keras.optimizers.Adam(), "mse")
    assert isinstance(converted.optimizer, kmp.LossScaleOptimizer)
    assert _weight_findings(converted) == []


def test_report_converts_to_dict_json_and_a_table(tmp_path):
    model = _dense_model(["small", "big"], [8, 1], "mixed_float16")
    model.get_layer("big").kernel.assign(np.full((8, 1), 1e5, "float32"))
    report = kmp.diagnose(model, (np.ones((2, 4), "float32"), np.zeros((2, 1), "float32")),
                          loss="mse")

    as_dict = report.to_dict()
    assert [row["name"] for row in as_dict["layers"]] == ["small", "big"]
    assert as_dict["direction"] == "forward"
    path = tmp_path / "report.json"
    text = report.to_json(path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(text)
    assert loaded["layer" + "s"][1]["rel_error"] == "inf"  # strict JSON
    assert loaded["recommended_policy"] == as_dict["recommended_policy"]
    table = str(report)
    assert "max|act|" in table and "small" in table and "big (output), forward" in table


def test_invalid_arguments_are_named():
    model = _dense_model(["a"], [1])
    data = (np.ones((1, 4), "float32"), np.ones((1, 1), "float32"))
    with pytest.raises(ValueError, match="`steps` must be an integer >= 1. Received: steps=0"):
        kmp.diagnose(model, data, steps=0, loss="mse")
    with pytest.raises(ValueError, match="`loss` is needed"):
        kmp.diagnose(model, data)
    with pytest.raises(ValueError, match="`policy` must be"):
        kmp.diagnose(model, data, loss="mse", policy="float32")

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="functional or Sequential"):
        kmp.diagnose(Subclassed(), data, loss="mse")


def test_kmp_model_runs_kmp_float32_layers_in_float32_and_sequential_works():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="dense")(inputs)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    hidden = keras.layers.UnitNormalization(name="unit")(hidden)
    model = kmp.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    data = (np.ones((2, 4), "float32"), np.zeros((2, 1), "float32"))

    report = kmp.diagnose(model, data, loss="mse", policy="mixed_float16")

    # As inside kmp.Model: Keras' LayerNormalization keeps the compute dtype
    # (its statistics are float32 already); kmp's list runs in float32.
    dtypes = {row["name"]: row["compute_dtype"] for row in report.layers}
    assert dtypes == {
        "dense": "float16", "norm": "float16", "unit": "float32", "head": "float16"
    }
    assert report.findings == []  # kmp.Model: float32 outputs
    assert all(layer.compute_dtype == "float32" for layer in model.layers)

    # A user's keep_float32 (here from kmp.convert) is honoured too.
    converted = kmp.convert(model, "float32", keep_float32=["head"])
    report = kmp.diagnose(converted, data, loss="mse", policy="mixed_float16")
    dtypes = {row["name"]: row["compute_dtype"] for row in report.layers}
    assert dtypes["head"] == "float32" and dtypes["dense"] == "float16"

    keras.utils.set_random_seed(0)
    sequential = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, name="s1"), keras.layers.Dense(8, name="s2")]
    )
    # Many outputs of random inputs: a relative error without cancellation.
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(32, 4)).astype("float32"), np.zeros((32, 8), "float32"))
    report = kmp.diagnose(sequential, data, loss="mse", policy="mixed_bfloat16")
    assert [row["name"] for row in report.layers] == ["s1", "s2"]
    assert {row["compute_dtype"] for row in report.layers} == {"bfloat16"}
    assert 0 < report.layer("s2")["rel_error"] < 0.05
    assert report.recommended_policy == "mixed_bfloat16"


class _RMSScale(keras.layers.Layer):
    def call(self, x):
        return x / ops.sqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + 1e-8)


def test_an_overflow_hidden_inside_a_layer_is_named():
    # The amplifier's outputs (~4000) fit float16; their squares do not, and
    # x / sqrt(inf) = 0 is finite but wrong.
    with kmp.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(4, name="amplifier")(inputs)
        hidden = _RMSScale(name="rms")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    model.get_layer("amplifier").kernel.assign(np.full((4, 4), 1000.0, "float32"))
    data = (np.ones((2, 4), "float32"), np.zeros((2, 1), "float32"))

    report = kmp.diagnose(model, data, loss="mse")

    assert report.layer("amplifier")["max_abs_activation"] == pytest.approx(4000.0)
    assert report.first_nonfinite is None
    assert report.first_inaccurate["layer"] == "rms"
    assert report.first_inaccurate["rel_error"] == pytest.approx(1.0)
    assert report.recommended_policy != "mixed_float16"
    assert "rms's output is 100% off float32" in report.policy_reason
    found = {(f["check"], f["layer"]) for f in report.findings}
    assert {("epsilon", "rms"), ("float16 math", "rms")} <= found  # the 1e-8 literal


def _embedding_model(policy):
    with kmp.policy_scope(policy):
        inputs = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(50, 4, name="embed")(inputs)
        hidden = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
        return keras.Model(inputs, keras.layers.Dense(1, name="head", dtype="float32")(hidden))


def test_a_model_with_an_embedding_is_diagnosed_on_its_data():
    # An Embedding's weight gradient is an IndexedSlices, not a tensor.
    model = _embedding_model("mixed_float16")
    ids = np.arange(12, dtype="int32").reshape(2, 6)
    y = np.ones((2, 1), "float32")

    report = kmp.diagnose(model, (ids, y), loss="mse")

    reference = _embedding_model("float32")
    reference.set_weights(model.get_weights())
    extractor = keras.Model(reference.input, reference.get_layer("embed").output)
    with tf.GradientTape() as tape:
        embedded = extractor(ids)
        loss = tf.reduce_mean(tf.square(reference.get_layer("head")(
            reference.get_layer("pool")(embedded)) - y))
    table = reference.get_layer("embed").embeddings
    output_gradient, table_gradient = tape.gradient(loss, [embedded, table])
    expected = max(np.abs(output_gradient.numpy()).max(),
                   np.abs(tf.convert_to_tensor(table_gradient).numpy()).max())
    embed = report.layer("embed")
    assert embed["max_abs_gradient"] == pytest.approx(float(expected), rel=1e-5)
    assert embed["gradient_overflow"] == 0.0
    assert report.first_nonfinite is None


@pytest.mark.parametrize("outlier", [False, True])
def test_float8_layers_that_lose_accuracy_are_named_with_the_fix(outlier):
    """A float8 model under mixed_bfloat16 whose scales two SGD(0) steps set
    from the data (weights unchanged). With an input feature of 1e6 that
    `hidden` ignores (its kernel row is 0), hidden's input scale is
    1e6 / 448: e4m3's smallest step is then 4.4, the other inputs (normal,
    |x| < 2.2 for 97% of them) flush to zero, and its float8 output is more
    than 50% off float32 while bfloat16's is under 1%. diagnose names it, with the call that leaves it in 16 bits;
    the 16-bit table measures the layers without float8. Without the
    outlier no layer is flagged."""
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(32, name="hidden")(inputs)
    mid = keras.layers.Dense(32, name="mid")(hidden)
    model = kmp.Model(inputs, keras.layers.Dense(16, name="head")(mid))
    kmp.float8.enable(model, skip_small=False)
    kernel = ops.convert_to_numpy(model.get_layer("hidden").kernel)
    kernel[0, :] = 0.0
    model.get_layer("hidden").kernel.assign(kernel)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype("float32")
    if outlier:
        x[:, 0] = 1e6
    y = rng.integers(0, 16, size=64)
    model.compile(optimizer=keras.optimizers.SGD(0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)

    report = kmp.diagnose(model, (x[:32], y[:32]))

    rows = {row["layer"]: row for row in report.float8}
    assert set(rows) == {"hidden", "mid"}
    assert rows == {row["layer"]: row for row in kmp.float8.compare(model, x[:32])}
    assert all(row["sixteen_bit_error"] < 0.01 for row in rows.values())
    # The 16-bit table: the layers without float8, as accurate as bfloat16 is.
    assert report.layer("hidden")["rel_error"] < 0.01
    assert not rows["mid"]["flagged"] and rows["mid"]["float8_error"] < 0.1
    text = str(report)
    assert "Float8 layers against mixed_bfloat16" in text
    if outlier:
        assert rows["hidden"]["float8_error"] > 0.5 and rows["hidden"]["flagged"]
        assert report.float8_fix == "kmp.float8.enable(model, exclude=['hidden'])"
        assert ("Float8 loses accuracy in hidden: leave it in 16 bits: build the model again "
                "and call kmp.float8.enable(model, exclude=['hidden']) before training.") in text
    else:
        assert 0.01 < rows["hidden"]["float8_error"] < 0.1 and not rows["hidden"]["flagged"]
        assert report.float8_fix is None
        assert "Float8: every float8 layer stays within 10% of float32." in text
    as_dict = json.loads(report.to_json())
    assert as_dict["float8_fix"] == report.float8_fix
    assert [row["layer"] for row in as_dict["float8"]] == ["hidden", "mid"]


def test_a_float8_attention_projection_that_loses_accuracy_is_named_with_the_fix():
    """A MultiHeadAttention (2 heads of 16, on 8 tokens of 32) whose four
    projections run float8 under mixed_bfloat16; the value projection's
    bias is 1e6 on one feature, whose output-projection kernel row is zero.
    Two SGD(0) steps set the scales: the output projection's input scale
    is then 1e6 / 448, its other inputs below 2.2 flush to zero (nearly
    all), and its float8 output is more than 99% off. diagnose reads the
    projections' inputs inside the layer (no graph holds them), names that
    one with the call that leaves it in 16 bits, agrees with
    kmp.float8.compare, and leaves the model as it was."""
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((8, 32))
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16, name="attention")
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(attention(inputs, inputs))
    model = kmp.Model(inputs, keras.layers.Dense(16, name="head")(pooled))
    kmp.float8.enable(model, skip_small=False)
    value_bias = np.zeros((2, 16), "float32")
    value_bias[0, 0] = 1e6
    attention.value_dense.bias.assign(value_bias)
    output_kernel = ops.convert_to_numpy(attention.output_dense.kernel)
    output_kernel[0, 0, :] = 0.0
    attention.output_dense.kernel.assign(output_kernel)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8, 32)).astype("float32")
    y = rng.integers(0, 16, size=64)
    model.compile(optimizer=keras.optimizers.SGD(0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    weights = [ops.convert_to_numpy(weight).copy() for weight in model.weights]
    own = [dict(vars(layer)) for layer in kmp.float8.float8_layers(model)]

    report = kmp.diagnose(model, (x[:32], y[:32]))

    rows = {row["layer"]: row for row in report.float8}
    assert rows == {row["layer"]: row for row in kmp.float8.compare(model, x[:32])}
    projections = ["attention/attention_output", "attention/key", "attention/query",
                   "attention/value"]
    assert sorted(rows) == projections
    assert rows["attention/attention_output"]["float8_error"] > 0.99
    assert [name for name in projections if rows[name]["flagged"]] == ["attention/attention_output"]
    assert all(0.0 < rows[name]["float8_error"] < 0.1 for name in projections[1:])
    assert all(row["sixteen_bit_error"] < 0.01 for row in rows.values())
    assert report.float8_fix == "kmp.float8.enable(model, exclude=['attention/attention_output'])"
    assert ("Float8 loses accuracy in attention/attention_output: leave it in 16 bits: build "
            "the model again and call kmp.float8.enable(model, exclude=["
            "'attention/attention_output']) before training.") in str(report)
    for weight, value in zip(model.weights, weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(weight), value, err_msg=weight.path)
    assert [dict(vars(layer)) for layer in kmp.float8.float8_layers(model)] == own
