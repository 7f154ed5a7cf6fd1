import keras
import numpy as np
import pytest

from _helpers import DtypeProbe
import kmp
from kmp import policy as policy_module
from kmp.precision import _float32_layers
from kmp.precision import _hardware


@pytest.mark.parametrize(
    "name, compute_dtype, loss_scaling",
    [
        ("float32", "float32", False),
        ("mixed_float16", "float16", True),
        ("mixed_bfloat16", "bfloat16", False),
    ],
)
def test_set_policy_sets_keras_global_and_returns_policy(name, compute_dtype, loss_scaling):
    policy = kmp.set_policy(name)
    assert isinstance(policy, kmp.Policy)
    assert keras.config.dtype_policy().name == name
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
        name,
        compute_dtype,
        "float32",
    )
    assert policy.output_dtype == "float32"
    assert policy.loss_scaling is loss_scaling
    assert kmp.get_policy() == policy
    assert keras.layers.Dense(2).compute_dtype == compute_dtype


def test_unknown_policy_name_lists_valid_names_and_changes_nothing():
    kmp.set_policy("mixed_bfloat16")
    with pytest.raises(ValueError) as error:
        kmp.set_policy("mixed_float64")
    message = str(error.value)
    assert "'mixed_float64'" in message
    for valid in ("float32", "mixed_float16", "mixed_bfloat16", "auto"):
        assert repr(valid) in message
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert kmp.get_policy().name == "mixed_bfloat16"


def test_policy_rejects_auto_and_unknown_names():
    with pytest.raises(ValueError, match="name='auto'"):
        kmp.Policy("auto")
    with pytest.raises(ValueError, match="name='float16'"):
        kmp.Policy("float16")


def test_get_policy_reads_a_policy_set_through_keras():
    keras.config.set_dtype_policy("mixed_float16")
    policy = kmp.get_policy()
    assert policy.name == "mixed_float16" and policy.loss_scaling
    keras.config.set_dtype_policy("bfloat16")
    policy = kmp.get_policy()
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
        "bfloat16",
        "bfloat16",
        "bfloat16",
    )


def test_policy_scope_restores_previous_policy_on_exit_and_on_error():
    kmp.set_policy("mixed_bfloat16")
    with kmp.policy_scope("mixed_float16") as policy:
        assert policy.name == "mixed_float16"
        assert keras.config.dtype_policy().name == "mixed_float16"
    assert kmp.get_policy().name == "mixed_bfloat16"
    with pytest.raises(RuntimeError):
        with kmp.policy_scope("float32"):
            raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    with pytest.raises(ValueError):
        with kmp.policy_scope("fp16"):
            pass
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_policy_config_round_trip():
    policy = kmp.Policy("mixed_float16", reason="because")
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(policy)
    )
    assert isinstance(restored, kmp.Policy)
    assert (restored.name, restored.reason) == ("mixed_float16", "because")


@pytest.mark.parametrize(
    "gpus, flags, expected, words",
    [
        ([(8, 0)], set(), "mixed_bfloat16", "8.0"),
        ([(9, 0), (8, 6)], set(), "mixed_bfloat16", "8.6"),
        ([(7, 5)], {"avx512_bf16"}, "mixed_float16", "7.5"),
        ([(7, 0)], set(), "mixed_float16", "7.0"),
        ([(6, 1)], {"avx512_bf16"}, "float32", "6.1"),
        ([(8, 0), (7, 0)], set(), "mixed_float16", "7.0"),  # slowest GPU decides
        ([], {"avx512f", "avx512_bf16"}, "mixed_bfloat16", "avx512_bf16"),
        ([], {"amx_bf16"}, "mixed_bfloat16", "amx_bf16"),
        ([], {"avx2", "avx512f"}, "float32", "neither"),
    ],
)
def test_auto_rule(gpus, flags, expected, words):
    name, reason = _hardware._choose_auto_policy(gpus, flags)
    assert name == expected
    assert words in reason


def test_set_policy_auto_uses_detected_hardware(monkeypatch, caplog):
    monkeypatch.setattr(_hardware, "_gpu_compute_capabilities", lambda: [(7, 5)])
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: set())
    with caplog.at_level("INFO", logger="kmp"):
        policy = kmp.set_policy("auto")
    assert policy.name == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert "7.5" in policy.reason
    assert "mixed_float16" in caplog.text
    assert kmp.get_policy().reason == policy.reason

    monkeypatch.setattr(_hardware, "_gpu_compute_capabilities", lambda: [])
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: {"avx2"})
    assert kmp.set_policy("auto").name == "float32"


def test_auto_on_this_machine_matches_its_cpu_flags():
    flags = _hardware._cpu_flags()
    policy = kmp.set_policy("auto")
    gpus = _hardware._gpu_compute_capabilities()
    if gpus:  # the GPU decides
        assert policy.name == _hardware._choose_auto_policy(gpus, flags)[0]
    elif {"avx512_bf16", "amx_bf16"} & flags and keras.backend.backend() == "tensorflow":
        assert policy.name == "mixed_bfloat16"
    else:
        assert policy.name == "float32"
    assert policy.reason


def test_cpu_flags_parses_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert _hardware._cpu_flags(str(cpuinfo)) == {"fpu", "avx512f", "avx512_bf16"}
    assert _hardware._cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize(
    "gpus, flags, native",
    [
        ([(8, 0)], set(), True),
        ([(9, 0), (7, 5)], set(), False),  # slowest GPU decides
        ([(7, 5)], {"avx512_bf16"}, False),  # a GPU decides, not the CPU
        ([], {"amx_bf16"}, True),
        ([], {"avx512f"}, False),
    ],
)
def test_one_bfloat16_rule_for_auto_diagnose_and_doctor(monkeypatch, gpus, flags, native):
    from kmp.diagnosis import _probe as _diagnose_probe

    assert _hardware._runs_bfloat16(gpus, flags) is native
    # "auto" and kmp.diagnose's probe both read the hardware in kmp/precision/_hardware.py.
    monkeypatch.setattr(_hardware, "_gpu_compute_capabilities", lambda: gpus)
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: flags)
    assert _diagnose_probe.hardware_has_bfloat16() is native
    # On JAX without a GPU, auto picks float32 whatever the CPU (test_jax.py).
    native_here = native and (bool(gpus) or keras.backend.backend() == "tensorflow")
    assert (kmp.set_policy("auto").name == "mixed_bfloat16") is native_here


@pytest.mark.parametrize("name", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_resolve_policy_accepts_each_name_and_a_policy(name):
    policy = policy_module._resolve_policy(name, "policy", caller="kmp.convert")
    assert (policy.name, policy.reason) == (
        name,
        f"set explicitly with kmp.convert(policy={name!r})",
    )
    given = kmp.Policy(name, reason="mine")
    assert policy_module._resolve_policy(given, "policy", caller="kmp.convert") is given


def test_resolve_policy_resolves_auto_and_logs_it(monkeypatch, caplog):
    monkeypatch.setattr(_hardware, "_gpu_compute_capabilities", lambda: [(8, 6)])
    with caplog.at_level("INFO", logger="kmp"):
        policy = policy_module._resolve_policy("auto", "inference_policy", caller="kmp.export")
    assert policy.name == "mixed_bfloat16"
    assert policy.reason.startswith("auto: ") and "8.6" in policy.reason
    assert 'policy "auto" resolved to mixed_bfloat16' in caplog.text


def test_resolve_policy_takes_none_only_where_the_caller_gives_it_a_meaning():
    assert (
        policy_module._resolve_policy(None, "policy", "kmp.convert", none_means="the active kmp policy")
        is None
    )
    with pytest.raises(ValueError) as error:
        policy_module._resolve_policy(None, "name", caller="kmp.set_policy")
    assert str(error.value) == (
        "Unknown policy name. `name` must be one of 'float32', 'mixed_float16', "
        "'mixed_bfloat16', 'bfloat16', 'auto' or a kmp.Policy. Received: name=None"
    )
    with pytest.raises(ValueError) as error:
        policy_module._resolve_policy(
            "fp16", "inference_policy", "kmp.export", none_means="the model's own policy"
        )
    assert str(error.value) == (
        "Unknown policy name. `inference_policy` must be one of 'float32', "
        "'mixed_float16', 'mixed_bfloat16', 'bfloat16', 'auto', a kmp.Policy or None (the "
        "model's own policy). Received: inference_policy='fp16'"
    )


def test_every_policy_argument_names_itself_and_the_bad_value(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    calls = [
        ("name", lambda bad: kmp.set_policy(bad)),
        ("policy", lambda bad: kmp.convert(model, policy=bad)),
        ("inference_policy", lambda bad: kmp.export(model, tmp_path / "x", inference_policy=bad)),
        ("policy", lambda bad: kmp.load_model(tmp_path / "missing.keras", policy=bad)),
    ]
    for argument, call in calls:
        with pytest.raises(ValueError) as error:
            call("float64")
        message = str(error.value)
        assert message.startswith(f"Unknown policy name. `{argument}` must be one of ")
        assert message.endswith(f"Received: {argument}='float64'")
        for allowed in ("'float32'", "'mixed_float16'", "'mixed_bfloat16'", "'auto'"):
            assert allowed in message
    assert "None (the policies in the file)" in message  # kmp.load_model's
    assert not (tmp_path / "x").exists()
    assert kmp.get_policy().name == "float32"


def test_layer_policies_switches_and_restores_also_when_the_block_raises():
    first = keras.layers.Dense(2, dtype="mixed_float16")
    second = keras.layers.Dense(2, dtype="mixed_bfloat16")
    with pytest.raises(RuntimeError, match="boom"):
        with _float32_layers._layer_policies({first: "float32", second: "mixed_float16"}):
            assert (first.compute_dtype, second.compute_dtype) == ("float32", "float16")
            raise RuntimeError("boom")
    assert (first.dtype_policy.name, second.dtype_policy.name) == (
        "mixed_float16",
        "mixed_bfloat16",
    )


def test_layer_policies_restores_the_layers_switched_before_a_bad_policy():
    first = keras.layers.Dense(2, dtype="mixed_float16")
    second = keras.layers.Dense(2, dtype="mixed_float16")
    with pytest.raises(ValueError):
        with _float32_layers._layer_policies({first: "float32", second: "no_such_policy"}):
            pass  # pragma: no cover - never entered
    assert first.dtype_policy.name == "mixed_float16"
    assert second.dtype_policy.name == "mixed_float16"


def test_float32_layers_are_settled_once_at_the_first_call_not_switched_per_call():
    kmp.set_policy("mixed_float16")
    inputs, outputs, probe = _unit_normalization_model()
    model = kmp.Model(inputs, outputs)
    norm = model.layers[1]
    assert isinstance(norm, keras.layers.UnitNormalization)
    assert norm.compute_dtype == "float16"  # not settled before the first call
    x = np.full((1, 64), 300.0, "float32")
    first = model(x)
    settled = norm.dtype_policy
    assert isinstance(settled, _float32_layers._Float32Policy)
    assert (settled.compute_dtype, settled.hands_on) == ("float32", "float16")
    # The probe takes its input as it comes (as third-party code does), so
    # the outputs are cast back to float16: by a call set once, at settling.
    cast_back = vars(norm)["call"]
    second = model(x)
    assert norm.dtype_policy is settled and vars(norm)["call"] is cast_back
    assert probe.seen[-1] == "float16"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(first), 0.125, rtol=1e-3)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(first), keras.ops.convert_to_numpy(second)
    )
    # The layer computes in float32 outside the model's calls too.
    direct = norm(x)
    assert keras.backend.standardize_dtype(direct.dtype) == "float16"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(direct), 0.125, rtol=1e-3)


def test_a_float32_layer_whose_consumers_cast_is_not_wrapped():
    # A Dense after it casts its inputs itself: the policy is all kmp sets.
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((64,))
    norm = keras.layers.UnitNormalization()
    dense = keras.layers.Dense(1, kernel_initializer="ones")
    model = kmp.Model(inputs, dense(norm(inputs)))
    result = model(np.full((1, 64), 300.0, "float32"))
    assert isinstance(norm.dtype_policy, _float32_layers._Float32Policy)
    assert "call" not in vars(norm)
    assert dense.compute_dtype == "float16"
    # 64 outputs of 1/8 summed: 8, where float16 norms would give 0.
    np.testing.assert_allclose(keras.ops.convert_to_numpy(result), 8.0, rtol=1e-2)


_KERAS_FLOAT32_MATH_LAYERS = [
    lambda: keras.layers.BatchNormalization(),
    lambda: keras.layers.LayerNormalization(),
    lambda: keras.layers.GroupNormalization(groups=2),
    lambda: keras.layers.RMSNormalization(),
    lambda: keras.layers.Softmax(),
]


@pytest.mark.parametrize("make_layer", _KERAS_FLOAT32_MATH_LAYERS)
def test_layers_keras_keeps_accurate_are_left_as_keras_made_them(make_layer):
    # Keras computes these layers' statistics in float32 and returns the
    # compute dtype; kmp adds nothing, so the next layer (or a residual add
    # in third-party code) sees the compute dtype.
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4)(inputs)
    special = make_layer()
    probe = DtypeProbe()
    outputs = keras.layers.Dense(2)(probe(special(hidden)))
    model = kmp.Model(inputs, outputs)
    result = model(np.ones((3, 4), "float32"))
    assert probe.seen[-1] == "bfloat16"
    assert special.dtype_policy.name == "mixed_bfloat16"
    assert keras.backend.standardize_dtype(result.dtype) == "float32"
    assert all(v.dtype == "float32" for v in model.weights)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_16_bit_softmax_sums_in_float32_so_kmp_leaves_it_alone(dtype, jit_compile):
    # Why Softmax is not on kmp's float32 list: 8192 equal logits sum to
    # 2048 in float16 arithmetic (2048 + 1 rounds to 2048) and each output
    # would be 1/2048; TensorFlow (kernels and XLA) and JAX accumulate in float32.
    softmax = keras.layers.Softmax(dtype=f"mixed_{dtype}")
    if keras.backend.backend() == "jax":
        import jax

        call = jax.jit(softmax) if jit_compile else softmax
    else:
        import tensorflow as tf

        call = tf.function(softmax, jit_compile=jit_compile)
    outputs = keras.ops.convert_to_numpy(call(np.zeros((2, 8192), "float32")))
    assert keras.backend.standardize_dtype(outputs.dtype) == dtype
    np.testing.assert_array_equal(outputs.astype("float64") * 8192, 1.0)


def _unit_normalization_model():
    inputs = keras.Input((64,))
    probe = DtypeProbe()
    outputs = probe(keras.layers.UnitNormalization()(inputs))
    return inputs, outputs, probe


def test_unit_normalization_computes_in_float32_and_hands_float16_on():
    # What kmp's float32 buys: the sum of squares of 64 values of 300 is
    # 5.8e6, past float16's 65504, so Keras' float16 UnitNormalization
    # returns zeros; kmp's returns 1/8 (the exact answer).
    kmp.set_policy("mixed_float16")
    x = np.full((2, 64), 300.0, "float32")
    inputs, outputs, _ = _unit_normalization_model()
    keras_result = keras.Model(inputs, outputs)(x)
    inputs, outputs, probe = _unit_normalization_model()
    kmp_result = kmp.Model(inputs, outputs)(x)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras_result), 0.0)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(kmp_result), 0.125, rtol=1e-3)
    assert probe.seen[-1] == "float16"


def test_normalization_computes_in_float32_and_hands_float16_on():
    # Raw features near 1000 with a spread of 0.1: float16 rounds them to
    # multiples of 0.5 before subtracting the mean, so Keras' float16
    # Normalization gives steps of 5 standard deviations; kmp's is exact to
    # float16's rounding of the result.
    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = (1000.0 + 0.1 * rng.normal(size=(256, 1))).astype("float32")
    expected = (x - x.mean()) / x.std()

    def build(model_class):
        inputs = keras.Input((1,))
        normalization = keras.layers.Normalization()
        normalization.adapt(x)
        probe = DtypeProbe()
        return model_class(inputs, probe(normalization(inputs))), probe

    keras_model, _ = build(keras.Model)
    kmp_model, probe = build(kmp.Model)
    keras_error = np.max(np.abs(keras.ops.convert_to_numpy(keras_model(x)) - expected))
    kmp_error = np.max(np.abs(keras.ops.convert_to_numpy(kmp_model(x)) - expected))
    assert keras_error > 1.0
    assert kmp_error < 1e-2
    assert probe.seen[-1] == "float16"


def test_a_model_sharing_a_kmp_models_layers_computes_them_as_settled():
    # Precision belongs to the layers, as their weights do: settled once by
    # the kmp.Model, it holds for every model that calls them, whichever ran
    # last (before, kmp switched them per call and a shared layer's
    # precision depended on who called it). So the keras.Model over the same
    # layers gets the exact float32 UnitNormalization too, not float16 zeros.
    kmp.set_policy("mixed_float16")
    inputs, outputs, _ = _unit_normalization_model()
    original = keras.Model(inputs, outputs)
    x = np.full((2, 64), 300.0, "float32")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(original(x)), 0.0)
    wrapped = kmp.Model(original.input, original.output)
    wrapped(x)
    assert [type(layer).__name__ for layer in original.layers][1:] == [
        "UnitNormalization",
        "DtypeProbe",
    ]
    assert [layer.dtype_policy.name for layer in original.layers][1:] == [
        "float32",  # settled by `wrapped`
        "mixed_float16",
    ]
    for _ in range(2):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(original(x)), 0.125, rtol=1e-3
        )
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(wrapped(x)), 0.125, rtol=1e-3
        )


def test_float32_layers_in_subclassed_and_nested_models():
    kmp.set_policy("mixed_bfloat16")
    inner_inputs = keras.Input((4,))
    inner = keras.Model(inner_inputs, keras.layers.UnitNormalization()(inner_inputs))
    seen = []

    class Net(kmp.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)
            self.norm = keras.layers.BatchNormalization()
            self.inner = inner
            self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2)
            self.out = keras.layers.Dense(3)

        def call(self, x, training=False):
            h = self.inner(self.norm(self.dense(x), training=training))
            seen.append(keras.backend.standardize_dtype(h.dtype))
            h = h + self.dense(x)  # a raw add, where Keras does not autocast
            h = self.attention(h[:, None, :], h[:, None, :])[:, 0, :]
            return self.out(h)

    net = Net()
    net(np.ones((2, 4), "float32"))
    result = net(np.ones((2, 4), "float32"))
    assert keras.backend.standardize_dtype(result.dtype) == "float32"
    assert seen[-1] == "bfloat16"
    # Settled on the layer itself (the nested model is net's), and its
    # outputs cast back: `net.call` adds them to bfloat16 tensors.
    assert isinstance(inner.layers[1].dtype_policy, _float32_layers._Float32Policy)
    assert inner.layers[1].dtype_policy.hands_on == "bfloat16"
    assert net.norm.compute_dtype == "bfloat16"
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(result)))


def test_set_policy_keep_float32_checks_its_entries_and_changes_nothing_on_error():
    kmp.set_policy("mixed_bfloat16", keep_float32=[keras.layers.Dense])
    with pytest.raises(TypeError, match="keep_float32.*Received: keep_float32 entry 3"):
        kmp.set_policy("float32", keep_float32=["head", 3])
    with pytest.raises(ValueError, match="regular expression.*'re:\\('"):
        kmp.set_policy("float32", keep_float32=["re:("])
    with pytest.raises(TypeError, match="`keep_float32` must be None.*Received: keep_float32=5"):
        kmp.set_policy("float32", keep_float32=5)
    assert kmp.get_policy().name == "mixed_bfloat16"
    inputs = keras.Input((4,))
    dense = keras.layers.Dense(2)
    probe = DtypeProbe()
    model = kmp.Model(inputs, probe(dense(inputs)))
    model(np.ones((1, 4), "float32"))
    assert probe.seen[-1] == "bfloat16"  # float32 inside, bfloat16 handed on
    assert isinstance(dense.dtype_policy, _float32_layers._Float32Policy)
    assert dense.dtype_policy.hands_on == "bfloat16"


def test_policy_scope_restores_keep_float32():
    kmp.set_policy("mixed_bfloat16", keep_float32=["re:head.*"])
    with kmp.policy_scope("float32", keep_float32=[keras.layers.Dense]):
        assert kmp.policy._global_keep_float32.classes == (keras.layers.Dense,)
    assert [p.pattern for p in kmp.policy._global_keep_float32.patterns] == ["head.*"]


def _head_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    return kmp.Model(inputs, keras.layers.Dense(2, name="head")(hidden), name="net")


def test_a_keep_float32_name_no_layer_has_is_warned_at_the_users_line():
    # A typo ("haed" for "head") left the head in float16 without a word;
    # kmp.convert raises for the same mistake (issue 38).
    kmp.set_policy("mixed_float16", keep_float32=["haed", "re:no_such_.*"])
    model = _head_model()
    with pytest.warns(UserWarning) as record:
        model(np.ones((1, 4), "float32"))
    (warning,) = [w for w in record if "keep_float32" in str(w.message)]
    message = str(warning.message)
    assert "'haed'" in message and "'re:no_such_.*'" not in message  # patterns may match nothing
    assert "Layer names in 'net': " in message and "head" in message and "hidden" in message
    assert warning.filename == __file__
    assert model.get_layer("head").compute_dtype == "float16"


def test_a_keep_float32_name_that_matches_warns_nothing(recwarn):
    kmp.set_policy("mixed_float16", keep_float32=["head"])
    model = _head_model()
    model(np.ones((1, 4), "float32"))
    assert not [w for w in recwarn if "keep_float32" in str(w.message)]
    assert isinstance(model.get_layer("head").dtype_policy, _float32_layers._Float32Policy)


def test_summary_says_a_float32_output_layer_hands_on_float32():
    # kmp.summary said "outputs cast back to float16" of a float32 layer whose
    # outputs are the model's: nothing casts them back (issue 38).
    kmp.set_policy("mixed_float16", keep_float32=["head", "hidden"])
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    after = keras.layers.Dense(8, name="after")(hidden)
    model = kmp.Model(inputs, keras.layers.Dense(2, name="head")(after), name="net")
    rows = {row["layer"]: row for row in kmp.summary(model, print_fn=lambda _: None)}
    assert rows["head"]["reason"] == "keep_float32: 'head'; outputs float32 (a model output)"
    assert rows["hidden"]["reason"] == "keep_float32: 'hidden'; outputs cast back to float16"
    assert keras.backend.standardize_dtype(model(np.ones((1, 4), "float32")).dtype) == "float32"
    # What the head hands on, before kmp.Model's own cast of its outputs.
    probe = keras.Model(inputs, model.get_layer("head").output)
    assert keras.backend.standardize_dtype(probe(np.ones((1, 4), "float32")).dtype) == "float32"
