import keras
import numpy as np
import pytest

import kmp
from kmp import policy as policy_module


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
    name, reason = policy_module._choose_auto_policy(gpus, flags)
    assert name == expected
    assert words in reason


def test_set_policy_auto_uses_detected_hardware(monkeypatch, caplog):
    monkeypatch.setattr(policy_module, "_gpu_compute_capabilities", lambda: [(7, 5)])
    monkeypatch.setattr(policy_module, "_cpu_flags", lambda: set())
    with caplog.at_level("INFO", logger="kmp"):
        policy = kmp.set_policy("auto")
    assert policy.name == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert "7.5" in policy.reason
    assert "mixed_float16" in caplog.text
    assert kmp.get_policy().reason == policy.reason

    monkeypatch.setattr(policy_module, "_gpu_compute_capabilities", lambda: [])
    monkeypatch.setattr(policy_module, "_cpu_flags", lambda: {"avx2"})
    assert kmp.set_policy("auto").name == "float32"


def test_auto_on_this_machine_matches_its_cpu_flags():
    flags = policy_module._cpu_flags()
    policy = kmp.set_policy("auto")
    if {"avx512_bf16", "amx_bf16"} & flags:
        assert policy.name == "mixed_bfloat16"
    else:
        assert policy.name == "float32"
    assert policy.reason


def test_cpu_flags_parses_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert policy_module._cpu_flags(str(cpuinfo)) == {"fpu", "avx512f", "avx512_bf16"}
    assert policy_module._cpu_flags(str(tmp_path / "missing")) == set()


class _DtypeProbe(keras.layers.Layer):
    """Records the dtype of what it receives, without casting it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._convert_input_args = False
        self.seen = []

    def call(self, x):
        self.seen.append(keras.backend.standardize_dtype(x.dtype))
        return x


_FLOAT32_LAYERS = [
    lambda: keras.layers.BatchNormalization(),
    lambda: keras.layers.LayerNormalization(),
    lambda: keras.layers.GroupNormalization(groups=2),
    lambda: keras.layers.UnitNormalization(),
    lambda: keras.layers.RMSNormalization(),
    lambda: keras.layers.Softmax(),
]


@pytest.mark.parametrize("make_layer", _FLOAT32_LAYERS)
def test_normalization_and_softmax_compute_in_float32_inside_functional_model(make_layer):
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4)(inputs)
    special = make_layer()
    probe = _DtypeProbe()
    outputs = keras.layers.Dense(2)(probe(special(hidden)))
    model = kmp.Model(inputs, outputs)
    assert special.compute_dtype == "float32"
    assert model.layers[1].compute_dtype == "bfloat16"
    result = model(np.ones((3, 4), "float32"))
    assert probe.seen[-1] == "float32"
    assert keras.backend.standardize_dtype(result.dtype) == "float32"
    assert all(v.dtype == "float32" for v in model.weights)


def test_float32_layers_in_subclassed_and_nested_models():
    kmp.set_policy("mixed_bfloat16")
    inner_inputs = keras.Input((4,))
    inner = keras.Model(inner_inputs, keras.layers.LayerNormalization()(inner_inputs))

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
            h = self.attention(h[:, None, :], h[:, None, :])[:, 0, :]
            return self.out(h)

    net = Net()
    net(np.ones((2, 4), "float32"))  # builds the attention's Softmax lazily
    result = net(np.ones((2, 4), "float32"))
    assert keras.backend.standardize_dtype(result.dtype) == "float32"
    assert net.norm.compute_dtype == "float32"
    assert inner.layers[1].compute_dtype == "float32"
    assert net.attention._softmax.compute_dtype == "float32"
    assert net.dense.compute_dtype == "bfloat16"
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(result)))
