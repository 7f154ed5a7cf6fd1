import math
import warnings

import hypothesis
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import strategies as st
from keras import ops

from _helpers import ReferenceScaler
from benchmarks import harness
import kmp
from kmp.loss_scale import LossScaleState
from kmp.loss_scale import update_loss_scale


def _f32(x):
    return float(np.float32(x))


def _state(scale, hysteresis):
    return LossScaleState(
        ops.convert_to_tensor(scale, "float32"),
        ops.convert_to_tensor(0, "int64"),
        ops.convert_to_tensor(hysteresis, "int64"),
        ops.convert_to_tensor(0, "int64"),
    )


_CONFIGS = st.fixed_dictionaries(
    {
        "initial_scale": st.sampled_from([1.0, 3.0, 2.0**10, 2.0**15]),
        "growth_factor": st.sampled_from([1.5, 2.0, 4.0]),
        "backoff_factor": st.sampled_from([0.25, 0.5, 0.9]),
        "growth_interval": st.integers(1, 6),
        "hysteresis": st.integers(1, 4),
        "min_scale": st.sampled_from([2.0**-3, 1.0]),
        "max_scale": st.sampled_from([2.0**15, 2.0**17, 1e6]),
        "dynamic": st.booleans(),
    }
)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(config=_CONFIGS, steps=st.lists(st.booleans(), min_size=1, max_size=300))
def test_pure_rule_matches_reference_over_random_sequences(config, steps):
    reference = ReferenceScaler(**config)
    update = tf.function(
        lambda state, finite: update_loss_scale(
            state, finite, **{k: v for k, v in config.items() if k != "initial_scale"}
        )
    )
    state = _state(config["initial_scale"], config["hysteresis"])
    for finite in steps:
        reference.step(finite)
        state = update(state, tf.constant(finite))
        assert float(state.loss_scale) == _f32(reference.scale)
        assert int(state.good_steps) == reference.good_steps
        assert int(state.hysteresis_left) == reference.hysteresis_left
        assert int(state.skipped_steps) == reference.skipped_steps


def test_scale_stays_within_bounds_and_never_degenerates():
    update = tf.function(
        lambda state, finite: update_loss_scale(
            state, finite, growth_interval=1, min_scale=0.5, max_scale=2.0**20
        )
    )
    state = _state(2.0**10, 1)
    for _ in range(200):
        state = update(state, tf.constant(True))
    assert float(state.loss_scale) == 2.0**20
    for _ in range(500):
        state = update(state, tf.constant(False))
        assert 0.5 <= float(state.loss_scale) <= 2.0**20
    assert float(state.loss_scale) == 0.5
    assert int(state.skipped_steps) == 500


def _adam_model(seed=0):
    rng = np.random.default_rng(seed)
    variables = [
        keras.Variable(rng.normal(size=(3, 2)).astype("float32"), name="kernel"),
        keras.Variable(rng.normal(size=(2,)).astype("float32"), name="bias"),
    ]
    return variables


def _grads(rng, scale=1.0, poison=None):
    grads = [rng.normal(size=(3, 2)).astype("float32"), rng.normal(size=(2,)).astype("float32")]
    if poison is not None:
        grads[1][0] = poison
    return [tf.constant(g * scale) for g in grads]


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(config=_CONFIGS, steps=st.lists(st.booleans(), min_size=1, max_size=25))
def test_optimizer_matches_reference_over_random_sequences(config, steps):
    reference = ReferenceScaler(**config)
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **config)
    variables = _adam_model()
    apply = tf.function(lambda grads: optimizer.apply(grads, variables))
    rng = np.random.default_rng(1)
    for finite in steps:
        apply(_grads(rng, poison=None if finite else np.nan))
        reference.step(finite)
        assert float(optimizer.loss_scale) == _f32(reference.scale)
        assert int(optimizer.skipped_steps) == reference.skipped_steps
        assert int(optimizer.iterations) == reference.applied_steps
        assert int(optimizer._good_steps) == reference.good_steps
        assert int(optimizer._hysteresis_left) == reference.hysteresis_left


def test_scale_in_closed_form_after_growths_and_skips():
    # As torch's GradScaler tests: init * growth**n_grown * backoff**n_skipped.
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**8, growth_interval=3
    )
    variables = _adam_model()
    rng = np.random.default_rng(0)
    pattern = [True] * 7 + [False] + [True] * 3 + [False, False] + [True] * 6
    for finite in pattern:
        optimizer.apply(_grads(rng, poison=None if finite else np.inf), variables)
    # Growths: after steps 3 and 6, then 3 finite after the skip, then 6 -> 2.
    assert float(optimizer.loss_scale) == 2.0**8 * 2.0**5 * 0.5**3
    assert int(optimizer.skipped_steps) == 3
    assert int(optimizer.iterations) == len(pattern) - 3


@pytest.mark.parametrize("poison", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_skipped_step_leaves_weights_slots_and_iterations_untouched(poison, mode):
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=4.0)
    variables = _adam_model()
    def apply(grads):
        optimizer.apply(grads, variables)

    if mode != "eager":
        apply = tf.function(apply, jit_compile=mode == "xla")
    rng = np.random.default_rng(0)
    for _ in range(3):
        apply(_grads(rng, scale=4.0))
    before = [v.numpy().copy() for v in variables + optimizer.inner_optimizer.variables]
    apply(_grads(rng, scale=4.0, poison=poison))
    after = [v.numpy() for v in variables + optimizer.inner_optimizer.variables]
    for old, new in zip(before, after):
        np.testing.assert_array_equal(old, new)
    assert int(optimizer.iterations) == 3
    assert int(optimizer.skipped_steps) == 1
    assert float(optimizer.loss_scale) == 2.0


def test_scaled_gradients_update_like_unscaled_ones_in_the_inner_optimizer():
    scaled_vars, control_vars = _adam_model(), _adam_model()
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**12)
    control = keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(3)
    for _ in range(5):
        grads = _grads(rng)
        optimizer.apply([g * 2.0**12 for g in grads], scaled_vars)
        control.apply(grads, control_vars)
    for scaled, plain in zip(scaled_vars, control_vars):
        np.testing.assert_array_equal(scaled.numpy(), plain.numpy())
    assert int(optimizer.iterations) == 5


def _clip_reference(grads, clipvalue=None, clipnorm=None, global_clipnorm=None):
    grads = [np.asarray(g, np.float64) for g in grads]
    if clipvalue is not None:
        grads = [np.clip(g, -clipvalue, clipvalue) for g in grads]
    if clipnorm is not None:
        grads = [g * min(1.0, clipnorm / np.linalg.norm(g)) for g in grads]
    if global_clipnorm is not None:
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
        grads = [g * min(1.0, global_clipnorm / norm) for g in grads]
    return grads


@pytest.mark.parametrize(
    "clip",
    [
        {"clipvalue": 0.3},
        {"clipnorm": 0.5},
        {"global_clipnorm": 0.5},
    ],
)
def test_clipping_applies_to_unscaled_gradients(clip):
    # With scale 2**10 the scaled gradients are ~1000x the clip bounds: clipping
    # them before unscaling would shrink the update another 1000 times.
    scale = 2.0**10
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=scale, **clip
    )
    variables = _adam_model()
    start = [v.numpy().astype(np.float64) for v in variables]
    rng = np.random.default_rng(7)
    grads = _grads(rng)
    optimizer.apply([g * scale for g in grads], variables)
    expected_steps = _clip_reference([g.numpy() for g in grads], **clip)
    for variable, initial, step in zip(variables, start, expected_steps):
        np.testing.assert_allclose(variable.numpy(), initial - step, rtol=1e-6, atol=1e-6)
    # The inner optimizer clips (issue 23): kmp forwards, as Keras asks.
    (name, value), = clip.items()
    assert getattr(optimizer.inner_optimizer, name) == value


@pytest.mark.parametrize(
    "scaler, inner",
    [
        ({"clipvalue": 0.4, "clipnorm": 0.5}, {}),  # Keras' inner optimizer takes one
        ({"clipnorm": 0.5}, {"global_clipnorm": 1.0}),
        ({"clipnorm": 0.5}, {"clipnorm": 1.0}),
    ],
)
def test_conflicting_clipping_is_refused_naming_both(scaler, inner):
    with pytest.raises(ValueError, match="Received: clip") as error:
        kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0, **inner), **scaler)
    for name in {**scaler, **inner}:
        assert name in str(error.value)
    # The same clipping on both is one clipping.
    same = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0, clipnorm=0.5), clipnorm=0.5)
    assert same.inner_optimizer.clipnorm == 0.5


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("clip_type", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_set_after_construction_clips_the_next_step(clip_type, traced):
    # tf-keras' testClipping (mixed_precision/loss_scale_optimizer_test.py):
    # `setattr(opt, clip_type, 3.0)` changes the clip of the next step. The
    # scaler's three attributes are the inner optimizer's (issue 30).
    var = keras.Variable([5.0])
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(2.0), initial_scale=2.0,
                                       growth_interval=1, **{clip_type: 2.0})

    def step(loss_fn):
        def run():
            with tf.GradientTape() as tape:
                loss = optimizer.scale_loss(loss_fn())
            optimizer.apply(tape.gradient(loss, [var]), [var])
        # A traced step reads the clip when it is traced, as Keras' own
        # optimizers do: each run traces its own function.
        (tf.function(run) if traced else run)()

    step(lambda: var * 4.0)
    assert var.numpy().tolist() == [1.0]  # 5 - 2.0 * clip(4 -> 2)
    assert float(optimizer.loss_scale) == 4.0
    setattr(optimizer, clip_type, 3.0)
    assert getattr(optimizer, clip_type) == getattr(optimizer.inner_optimizer, clip_type) == 3.0
    assert optimizer.get_config()[clip_type] == 3.0
    step(lambda: var * 4.0)
    assert var.numpy().tolist() == [-5.0]  # 1 - 2.0 * clip(4 -> 3)
    assert float(optimizer.loss_scale) == 8.0
    step(lambda: var * float("inf"))  # skipped, not clipped
    assert var.numpy().tolist() == [-5.0]
    assert float(optimizer.loss_scale) == 4.0
    # Set on the inner optimizer, read on the scaler; `None` turns it off.
    setattr(optimizer.inner_optimizer, clip_type, 1.0)
    assert getattr(optimizer, clip_type) == 1.0
    setattr(optimizer, clip_type, None)
    assert getattr(optimizer.inner_optimizer, clip_type) is None
    step(lambda: var * 4.0)
    assert var.numpy().tolist() == [-13.0]  # unclipped: -5 - 2.0 * 4


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("clipnorm", 0.0, r"`clipnorm` must be a finite number > 0 or None. Received: clipnorm=0.0"),
        ("clipvalue", -1.0, r"Received: clipvalue=-1.0"),
        ("global_clipnorm", float("nan"), r"Received: global_clipnorm=nan"),
        ("clipnorm", "2", r"Received: clipnorm='2'"),
        ("clipnorm", 3.0,
         r"set `global_clipnorm = None` first. Received: clipnorm=3.0, with global_clipnorm=2.0"),
    ],
)
def test_setting_clipping_follows_the_constructor_rules_and_changes_nothing(name, value, message):
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), global_clipnorm=2.0)
    with pytest.raises(ValueError, match=message):
        setattr(optimizer, name, value)
    assert [getattr(optimizer.inner_optimizer, n) for n in ("clipnorm", "global_clipnorm", "clipvalue")
            ] == [None, 2.0, None]
    # Replacing the clip that is set, or clearing it first, is allowed.
    optimizer.global_clipnorm = 4.0
    optimizer.global_clipnorm = None
    optimizer.clipnorm = 3.0
    assert optimizer.inner_optimizer.clipnorm == 3.0


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_none_gradient_leaves_its_variable_alone_as_keras_scaler_does(traced):
    # Keras' `apply` drops a variable whose gradient is None (issue 30).
    def run(make_optimizer):
        variables = [keras.Variable([1.0, 2.0]), keras.Variable([3.0]), keras.Variable([4.0, 5.0])]
        optimizer = make_optimizer(keras.optimizers.SGD(0.5, momentum=0.9), initial_scale=8.0)
        apply = lambda grads: optimizer.apply(grads, variables)  # noqa: E731
        apply = tf.function(apply) if traced else apply
        for grads in ([8.0, 16.0], None, [8.0, 8.0]), ([8.0, 8.0], [4.0], None), \
                ([np.inf, 0.0], None, [1.0, 1.0]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Keras' "Gradients do not exist" and kmp's
                apply([None if g is None else tf.constant(g) for g in grads])
        return variables, optimizer

    ours, ours_optimizer = run(kmp.LossScaleOptimizer)
    theirs, theirs_optimizer = run(keras.optimizers.LossScaleOptimizer)
    for a, b in zip(ours + ours_optimizer.inner_optimizer.variables,
                    theirs + theirs_optimizer.inner_optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert float(ours_optimizer.loss_scale) == float(theirs_optimizer.dynamic_scale) == 4.0
    assert ours[1].numpy().tolist() == [3.0 - 0.5 * 0.5]  # one step, at the second apply


def test_clipping_never_hides_a_non_finite_gradient():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=2.0, global_clipnorm=1.0
    )
    variables = _adam_model()
    before = [v.numpy().copy() for v in variables]
    optimizer.apply(_grads(np.random.default_rng(0), poison=np.inf), variables)
    for old, variable in zip(before, variables):
        np.testing.assert_array_equal(old, variable.numpy())
    assert int(optimizer.skipped_steps) == 1


def test_dynamic_false_keeps_the_scale_but_skips_and_counts():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=128.0, dynamic=False, growth_interval=1
    )
    variables = _adam_model()
    rng = np.random.default_rng(0)
    for finite in [True, False, True, True, False]:
        optimizer.apply(_grads(rng, poison=None if finite else np.nan), variables)
        assert float(optimizer.loss_scale) == 128.0
    assert int(optimizer.skipped_steps) == 2
    assert int(optimizer.iterations) == 3


def test_sparse_gradients_are_unscaled_checked_and_skipped():
    kmp.set_policy("float32")
    embedding = keras.layers.Embedding(10, 3)
    embedding.build((None,))
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=8.0)
    start = embedding.embeddings.numpy().copy()

    @tf.function
    def step(poison):
        with tf.GradientTape() as tape:
            out = embedding(tf.constant([1, 2]))
            loss = tf.reduce_sum(out) * poison
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, embedding.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        optimizer.apply(grads, embedding.trainable_variables)

    step(tf.constant(1.0))
    expected = start.copy()
    expected[[1, 2]] -= 1.0
    np.testing.assert_allclose(embedding.embeddings.numpy(), expected, rtol=1e-6)
    step(tf.constant(np.inf, tf.float32))
    np.testing.assert_allclose(embedding.embeddings.numpy(), expected, rtol=1e-6)
    assert int(optimizer.skipped_steps) == 1


def test_properties_before_and_after_build_and_learning_rate_proxy():
    inner = keras.optimizers.Adam(0.25)
    optimizer = kmp.LossScaleOptimizer(inner, initial_scale=64.0)
    assert float(optimizer.loss_scale) == 64.0
    assert int(optimizer.skipped_steps) == 0
    assert optimizer.inner_optimizer is inner
    assert float(optimizer.learning_rate) == 0.25
    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate) == 0.5
    assert float(optimizer.scale_loss(ops.convert_to_tensor(3.0))) == 192.0
    assert optimizer.iterations is inner.iterations
    with pytest.raises(AttributeError):
        optimizer.loss_scale = 1.0
    with pytest.raises(AttributeError):
        optimizer.skipped_steps = 1


def test_scale_loss_of_float16_loss_does_not_overflow():
    optimizer = kmp.LossScaleOptimizer("sgd", initial_scale=2.0**20)
    scaled = optimizer.scale_loss(ops.convert_to_tensor(1000.0, "float16"))
    assert np.isfinite(float(scaled)) and float(scaled) == 1000.0 * 2.0**20


def test_string_inner_optimizer_is_resolved():
    optimizer = kmp.LossScaleOptimizer("adam")
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"initial_scale": -2.0}, "initial_scale"),
        ({"initial_scale": float("inf")}, "initial_scale"),
        ({"initial_scale": float("nan")}, "initial_scale"),
        ({"initial_scale": "big"}, "initial_scale"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"initial_scale": 0.5}, "min_scale <= initial_scale"),
        ({"initial_scale": 2.0**30}, "initial_scale <= max_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 6.0}, "min_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": float("inf")}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"clipnorm": 0.0}, "clipnorm"),
        ({"global_clipnorm": -1.0}, "global_clipnorm"),
        ({"clipvalue": float("nan")}, "clipvalue"),
        ({"clipnorm": 1.0, "global_clipnorm": 1.0}, "At most one"),
        ({"initial_scale": 1e39, "max_scale": 1e39}, "initial_scale"),  # beyond float32
        ({"max_scale": 1e39}, "max_scale"),
        ({"min_scale": 1e-46, "initial_scale": 1.0}, "min_scale"),  # 0 in float32
        ({"growth_interval": 2**63}, "growth_interval"),  # beyond int64
        ({"hysteresis": 2**63}, "hysteresis"),
        ({"dynamic_growth_steps": 2**63}, "dynamic_growth_steps"),
        ({"dynamic": "yes"}, "dynamic"),
        ({"dynamic_growth_steps": 0}, "dynamic_growth_steps"),
        ({"dynamic_growth_steps": 2, "growth_interval": 3}, "pass one of them"),
        ({"skip_spikes": 0.0}, "`skip_spikes` must be a finite number > 0 or None"),
        ({"skip_spikes": float("inf")}, "skip_spikes=inf"),
        ({"skip_spikes": "6"}, "skip_spikes='6'"),
        ({"spike_window": 1}, "`spike_window` must be an integer in [2, 65536]"),
        ({"spike_window": 2**17}, "spike_window=131072"),
        ({"spike_warmup": 1}, "`spike_warmup` must be an integer in [2, "),
        ({"compensation": "Kahan"}, "`compensation` must be one of ('kahan', 'stochastic')"),
        ({"compensation": None}, "compensation=None"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(kwargs, argument):
    inner = keras.optimizers.SGD()
    inner.loss_scale_factor = 3.0
    with pytest.raises(ValueError) as error:
        kmp.LossScaleOptimizer(inner, **kwargs)
    assert argument in str(error.value)
    assert "Received" in str(error.value)
    assert inner.loss_scale_factor == 3.0  # nothing changed by a call that raised


def test_inner_optimizer_must_be_a_plain_keras_optimizer():
    with pytest.raises(TypeError, match="inner_optimizer"):
        kmp.LossScaleOptimizer(object())
    with pytest.raises(ValueError, match="already a loss-scale optimizer"):
        kmp.LossScaleOptimizer(kmp.LossScaleOptimizer("sgd"))
    with pytest.raises(ValueError, match="already a loss-scale optimizer"):
        kmp.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError):
        kmp.LossScaleOptimizer("not_an_optimizer")


def test_spikes_are_refused_with_gradient_accumulation():
    inner = keras.optimizers.SGD(gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"Received: skip_spikes=6.0, gradient_accumulation_steps=4"):
        kmp.LossScaleOptimizer(inner, skip_spikes=6.0)
    assert kmp.LossScaleOptimizer(inner).skip_spikes is None


def test_config_round_trip_keeps_every_argument():
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.Adam(0.003),
        initial_scale=512.0,
        dynamic=False,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=17,
        hysteresis=3,
        min_scale=0.5,
        max_scale=4096.0,
        global_clipnorm=2.5,
        skip_spikes=4.5,
        spike_window=16,
        spike_warmup=9,
        compensation="stochastic",
        name="my_scaler",
    )
    config = optimizer.get_config()
    assert (config["skip_spikes"], config["spike_window"], config["spike_warmup"]) == (4.5, 16, 9)
    assert config["compensation"] == "stochastic"
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(optimizer)
    )
    assert type(restored) is kmp.LossScaleOptimizer
    assert restored.get_config() == config
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    assert float(restored.inner_optimizer.learning_rate) == pytest.approx(0.003)
    assert config["name"] == "my_scaler" and config["clipnorm"] is None
    assert restored.inner_optimizer.global_clipnorm == 2.5
    other = kmp.LossScaleOptimizer("sgd", clipvalue=1.5)
    restored = kmp.LossScaleOptimizer.from_config(other.get_config())
    assert restored.clipvalue == restored.inner_optimizer.clipvalue == 1.5


def test_keras_dynamic_growth_steps_is_the_growth_interval():
    # Keras' own upscaling test, on kmp: 8 finite steps at 2 steps per growth.
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=2.0, dynamic_growth_steps=2
    )
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    for _ in range(8):
        optimizer.apply([ops.array([1.0, 6.0, 7.0, 2.0])], variables)
    assert float(optimizer.scale_loss(1.0)) == 32.0
    assert optimizer.growth_interval == optimizer.dynamic_growth_steps == 2
    assert optimizer.get_config()["growth_interval"] == 2
    same = kmp.LossScaleOptimizer("sgd", growth_interval=5, dynamic_growth_steps=5)
    assert same.growth_interval == 5
    # tf.keras' tests pass whole floats; Keras' own scaler takes them too.
    assert kmp.LossScaleOptimizer("sgd", dynamic_growth_steps=2.0).growth_interval == 2
    assert kmp.LossScaleOptimizer("sgd", hysteresis=3.0).hysteresis == 3
    keras_scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps=3.0)
    inputs = keras.Input((2,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras_scaler, "mse", loss_scale="dynamic")
    assert model.optimizer.growth_interval == 3


def test_from_config_takes_a_config_of_keras_own_scaler_before_3_4():
    # Keras' backwards-compatibility test: its scaler's configs used to carry
    # the base optimizer's settings, at their defaults.
    config = {
        "name": "loss_scale_optimizer", "weight_decay": None, "clipnorm": None,
        "global_clipnorm": None, "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
        "ema_overwrite_frequency": None, "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
        "inner_optimizer": keras.optimizers.serialize(keras.optimizers.SGD(0.5)),
        "initial_scale": 2.0, "dynamic_growth_steps": 2,
    }
    optimizer = kmp.LossScaleOptimizer.from_config(config)
    assert optimizer.growth_interval == 2 and float(optimizer.loss_scale) == 2.0
    assert float(optimizer.inner_optimizer.learning_rate) == 0.5
    with pytest.raises(ValueError, match=r"set it on the inner optimizer. Received: use_ema=True"):
        kmp.LossScaleOptimizer.from_config({**config, "use_ema": True})


def test_get_scaled_loss_of_a_callable_is_a_callable():
    # tf.keras' get_scaled_loss takes the loss callables its minimize() takes.
    optimizer = kmp.LossScaleOptimizer("sgd", initial_scale=8.0)
    scaled = optimizer.get_scaled_loss(lambda: ops.convert_to_tensor(1.25))
    assert callable(scaled) and float(scaled()) == 10.0
    assert float(optimizer.get_scaled_loss(ops.convert_to_tensor(1.25))) == 10.0


def test_plain_keras_model_uses_it_without_wrapping_again():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(4)(inputs)))
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**30,
                                       max_scale=2.0**30)
    model.compile(optimizer, "mse")
    assert model.optimizer is optimizer
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    # 2**30 overflows float16 gradients: Keras' fit went through our skip logic.
    assert int(optimizer.skipped_steps) >= 1
    assert int(optimizer.iterations) == 4 - int(optimizer.skipped_steps)
    assert float(optimizer.loss_scale) == 2.0**30 * 0.5 ** int(optimizer.skipped_steps)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def _state_values(optimizer):
    return [
        float(optimizer.loss_scale),
        int(optimizer._good_steps),
        int(optimizer._hysteresis_left),
        int(optimizer.skipped_steps),
        int(optimizer.iterations),
    ]


def test_state_survives_keras_file_and_weights_round_trips(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(
        kmp.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**6,
                               growth_interval=4, hysteresis=2),
        "mse",
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)  # 4 finite steps: one growth
    # One skip: hysteresis 2 absorbs it, so the scale stays.
    variables = model.trainable_variables
    model.optimizer.apply([tf.fill(v.shape, np.inf) for v in variables], variables)
    model.fit(x[:2], y[:2], batch_size=2, epochs=1, verbose=0)
    expected = _state_values(model.optimizer)
    assert expected == [2.0**7, 1, 1, 1, 5]

    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored.optimizer) is kmp.LossScaleOptimizer
    assert _state_values(restored.optimizer) == expected
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    weights = tmp_path / "model.weights.h5"
    model.save_weights(weights)
    fresh = keras.models.clone_model(model)
    fresh.compile(kmp.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**6,
                                         growth_interval=4, hysteresis=2), "mse")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(weights)
    assert _state_values(fresh.optimizer) == expected


def test_distributed_step_is_decided_on_all_replicas_and_counted_once(mirrored_strategy):
    strategy = mirrored_strategy
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    x[20] = np.inf  # one sample of batch 2 (of 4): it lands on one replica only

    def train(model_class, optimizer, scope):
        with scope:
            keras.utils.set_random_seed(1)
            inputs = keras.Input((4,))
            model = model_class(inputs, keras.layers.Dense(1)(inputs))
            model.compile(optimizer(), "mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model

    ours = train(kmp.Model, lambda: kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05), initial_scale=4.0, global_clipnorm=0.5), strategy.scope())
    assert int(ours.optimizer.skipped_steps) == 1
    assert int(ours.optimizer.iterations.numpy()) == 3
    assert float(ours.optimizer.loss_scale) == 2.0
    # Clipping is the inner optimizer's, applied to the whole batch's
    # gradient (issue 30): the same steps as Keras' own scaler on one device.
    theirs = train(keras.Model, lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, global_clipnorm=0.5), initial_scale=4.0),
        tf.distribute.OneDeviceStrategy("/cpu:0").scope())
    assert int(theirs.optimizer.iterations.numpy()) == 3
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The clip was active: without it the weights differ.
    unclipped = train(keras.Model, lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05), initial_scale=4.0),
        tf.distribute.OneDeviceStrategy("/cpu:0").scope())
    assert any(not np.allclose(a, b, rtol=1e-3, atol=1e-4)
               for a, b in zip(ours.get_weights(), unclipped.get_weights()))


def test_state_survives_a_tensorflow_checkpoint(tmp_path):
    variables = _adam_model()
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=16.0)
    rng = np.random.default_rng(0)
    optimizer.apply(_grads(rng), variables)
    optimizer.apply(_grads(rng, poison=np.inf), variables)
    path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / "ckpt"))
    restored = kmp.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=16.0)
    restored.build(variables)
    tf.train.Checkpoint(optimizer=restored).restore(path).assert_existing_objects_matched()
    assert _state_values(restored) == _state_values(optimizer) == [8.0, 0, 0, 1, 1]


def test_a_step_checks_and_divides_each_gradient_once_like_keras():
    # Per gradient, the step does what Keras' LossScaleOptimizer does (one
    # finite check, one division, in the branch that applies) and no more
    # ops; beyond that, a fixed number of ops for the state Keras does not
    # keep (hysteresis, skip and overflow counters). Issue 8 measured an 11%
    # slower BERT step on a GPU when kmp unscaled every gradient outside the
    # branch and assembled per-variable overflow flags on every step.
    # Plain Adam's ops, traced once per variable count (each trace of 4 or
    # 12 variables takes as long as the scalers' own); 4 and 12 variables
    # tell a per-gradient op from a fixed one as 8 and 24 did.
    variables = {n: [keras.Variable(np.ones((3, 2), "float32")) for _ in range(n)] for n in (4, 12)}
    adam = {n: sum(harness.count_apply_ops(keras.optimizers.Adam(), variables[n]).values())
            for n in variables}

    def scaling_ops(optimizer_class, count):
        types = harness.count_apply_ops(optimizer_class(keras.optimizers.Adam()), variables[count])
        return types, sum(types.values()) - adam[count]

    (kmp_types, kmp_4), (_, kmp_12) = (scaling_ops(kmp.LossScaleOptimizer, n) for n in (4, 12))
    (keras_types, keras_4), (_, keras_12) = (
        scaling_ops(keras.optimizers.LossScaleOptimizer, n) for n in (4, 12)
    )
    assert kmp_types["IsFinite"] == keras_types["IsFinite"] == 4
    assert kmp_types["RealDiv"] <= keras_types["RealDiv"]
    assert kmp_12 - kmp_4 <= keras_12 - keras_4  # per gradient
    assert kmp_4 <= keras_4 + 40  # fixed: the state update
    # No int32 variable: TensorFlow would keep it in host memory on a GPU.
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam())
    optimizer.build([keras.Variable(np.ones((3, 2), "float32"))])
    assert {v.dtype for v in optimizer.variables} <= {"float32", "int64"}


def test_a_scale_below_one_is_checked_after_unscaling():
    # Dividing a finite float32 gradient by a scale below 1 can overflow:
    # then the unscaled gradients decide, and the step is skipped.
    optimizer = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=0.25, min_scale=0.25
    )
    w = keras.Variable([1.0, 1.0])
    optimizer.apply([ops.array([1e38, 1.0])], [w])  # unscaled: 4e38 > float32 max
    assert int(optimizer.skipped_steps) == 1 and int(optimizer.iterations) == 0
    np.testing.assert_array_equal(w.numpy(), [1.0, 1.0])
    optimizer.apply([ops.array([0.25, 0.5])], [w])  # unscaled: [1, 2]
    np.testing.assert_array_equal(w.numpy(), [0.0, -1.0])
