"""Token ids fed as floats stay exact in a 16-bit kmp.Model, or kmp warns.

keras.io's Transformer text classifier declares `keras.Input(shape=(maxlen,))`
(float32 ids); Keras casts them to the compute dtype before its custom
embedding layer, and float16 holds integers exactly only up to 2048 (bfloat16
up to 256). References: the rows the ids name, rounded as the layer rounds
them; the same layers in a plain keras.Model (which round the ids); the
float32 model with the same weights.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras import ops

from _helpers import EPSILON
import kmp
from kmp.precision import _token_ids

MAXLEN, VOCABULARY, WIDTH = 8, 20000, 8
# Each of the first four is rounded by float16 (to 2048, 4096, 8192 and the
# out-of-range 20000); 257 and 300 by bfloat16 too.
IDS = np.array(
    [[2049, 4097, 8193, 19999, 1, 2, 300, 257], [19999, 0, 5, 2049, 257, 3, 4, 6]],
    dtype="float32",
)


@keras.saving.register_keras_serializable(package="test_token_ids")
class TokenAndPositionEmbedding(layers.Layer):
    """keras.io's layer (text_classification_with_transformer), as published."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.vocab_size, self.embed_dim = maxlen, vocab_size, embed_dim
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(0, maxlen, 1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions

    def get_config(self):
        return {
            **super().get_config(),
            "maxlen": self.maxlen,
            "vocab_size": self.vocab_size,
            "embed_dim": self.embed_dim,
        }


def _classifier(model_class=kmp.Model, dtype="float32"):
    """The classifier's shape: (embedded tokens, logits) for float ids."""
    inputs = keras.Input(shape=(MAXLEN,), dtype=dtype)
    embedding = TokenAndPositionEmbedding(MAXLEN, VOCABULARY, WIDTH, name="embed")
    embedded = embedding(inputs)
    pooled = layers.GlobalAveragePooling1D()(embedded)
    logits = layers.Dense(2, name="head")(pooled)
    return model_class(inputs, [embedded, logits])


def _rows(embedding, ids, dtype):
    """What the layer computes from exact ids: rows rounded to `dtype`, summed in `dtype`."""
    tokens = tf.gather(embedding.token_emb.embeddings, ids.astype("int64"))
    positions = embedding.pos_emb.embeddings[: ids.shape[-1]]
    return (tf.cast(tokens, dtype) + tf.cast(positions, dtype)).numpy().astype("float32")


def _float32_twin(model):
    """The float32 classifier with `model`'s weights."""
    with kmp.policy_scope("float32"):
        twin = _classifier()
    twin.set_weights(model.get_weights())
    return twin


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_classifier_with_float_ids_embeds_the_exact_rows(policy):
    kmp.set_policy(policy)
    model = _classifier()
    embedding = model.get_layer("embed")
    dtype = embedding.compute_dtype
    expected = _rows(embedding, IDS, dtype)
    # The hazard is real: the same layers in a keras.Model round the ids.
    plain = keras.Model(model.input, model.outputs)
    if policy == "mixed_float16":
        # 19999 rounds to 20000, one past the vocabulary. A CPU's gather
        # raises; a GPU's returns a row of zeros and raises nothing (what the
        # docs say kmp promises there: it does not check ids).
        past_the_end = np.full((1, MAXLEN), 19999.0, "float32")
        if tf.config.list_physical_devices("GPU"):
            embedded, _ = plain(past_the_end)
            positions = tf.cast(embedding.pos_emb.embeddings[:MAXLEN], dtype)
            assert np.array_equal(np.asarray(embedded)[0], positions.numpy().astype("float32"))
        else:
            with pytest.raises(tf.errors.InvalidArgumentError, match="20000 is not in"):
                plain(past_the_end)
    rounded_rows, _ = plain(np.where(IDS == 19999, 2049, IDS))
    assert np.array_equal(rounded_rows[0, 0], _rows(embedding, np.array([[2048]]), dtype)[0, 0])

    _, twin_logits = _float32_twin(model)(IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kmp keeps these exact: nothing to warn
        for embedded, logits in (model(IDS), model.predict(IDS, verbose=0)):
            assert np.array_equal(np.asarray(embedded), expected)
            np.testing.assert_allclose(
                logits,
                twin_logits,
                rtol=0,
                atol=8 * EPSILON[dtype] * np.abs(twin_logits).max(),
            )


def test_token_ids_are_settled_once_and_kept_through_training():
    kmp.set_policy("mixed_float16")
    classifier = _classifier()
    model = kmp.Model(classifier.input, classifier.outputs[1])
    embedding = model.get_layer("embed")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = model.fit(IDS, np.array([0, 1]), epochs=1, verbose=0)
        # The layer holding the embedding hands float32 ids on: its own
        # policy, set once, with Keras' compute and variable dtypes.
        settled = embedding.dtype_policy
        assert isinstance(settled, _token_ids._ExactIdsPolicy)
        assert (settled.compute_dtype, settled.variable_dtype) == ("float16", "float32")
        history = model.fit(IDS, np.array([0, 1]), epochs=2, verbose=0)
        model.predict(IDS, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert embedding.dtype_policy is settled
    for layer in model._flatten_layers(include_self=True, recursive=True):
        assert "call" not in layer.__dict__
    assert embedding.autocast and not embedding.token_emb.autocast
    # Outside the model too, the layer embeds exact rows.
    expected = _rows(embedding, IDS, "float16")
    assert np.array_equal(np.asarray(embedding(IDS)), expected)


class Classifier(kmp.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = TokenAndPositionEmbedding(MAXLEN, VOCABULARY, WIDTH)
        self.head = layers.Dense(2)

    def call(self, ids):
        embedded = self.embed(ids)
        return embedded, self.head(ops.mean(embedded, axis=1))


@keras.saving.register_keras_serializable(package="test_token_ids")
class KerasClassifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = TokenAndPositionEmbedding(MAXLEN, VOCABULARY, WIDTH)

    def call(self, ids):
        return self.embed(ids)


def test_subclassed_kmp_model_embeds_the_exact_rows():
    kmp.set_policy("mixed_float16")
    model = Classifier()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        embedded, _ = model(IDS)  # numpy float32: the model casts it first
        predicted, _ = model.predict(IDS, verbose=0)
        # Called on symbolic tensors (nested in another model), its layers
        # see placeholders, not ids: nothing to keep exact, nothing to warn.
        inputs = keras.Input(shape=(MAXLEN,))
        keras.Model(inputs, model(inputs))
    expected = _rows(model.embed, IDS, "float16")
    assert np.array_equal(np.asarray(embedded), expected)
    assert np.array_equal(predicted, expected)


# keras.io's layer has no build(); Keras says so when kmp.convert rebuilds it.
@pytest.mark.filterwarnings("ignore:`build\\(\\)` was called on layer")
@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_converted_models_embed_the_exact_rows(kind):
    if kind == "functional":
        source = _classifier(keras.Model)
    else:
        source = KerasClassifier()
        source(IDS)
    model = kmp.convert(source, "mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outputs = model.predict(IDS, verbose=0)
    embedded = outputs[0] if kind == "functional" else outputs
    embedding = next(
        layer
        for layer in model._flatten_layers(recursive=True)
        if isinstance(layer, TokenAndPositionEmbedding)
    )
    assert embedding.compute_dtype == "float16"
    assert np.array_equal(embedded, _rows(embedding, IDS, "float16"))


def _rounded_before_the_embedding(vocabulary):
    """Ids cast to 16 bits by another layer first: kmp cannot undo that."""
    inputs = keras.Input(shape=(MAXLEN,))
    narrowed = layers.Identity(name="narrow")(inputs)
    embedded = layers.Embedding(vocabulary, WIDTH, name="token_embedding")(narrowed)
    return kmp.Model(inputs, layers.Dense(2)(layers.Flatten()(embedded)))


def test_ids_rounded_before_the_embedding_warn_once_with_the_fix():
    kmp.set_policy("mixed_float16")
    model = _rounded_before_the_embedding(VOCABULARY)
    ids = np.where(IDS == 19999, 7, IDS)  # float16 makes 19999 20000: a crash
    with pytest.warns(UserWarning) as caught:
        model.predict(ids, verbose=0)
        model.predict(ids, verbose=0)
        model(ids)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(ids, np.zeros((2, 2)), verbose=0)
    messages = [str(w.message) for w in caught if "token_embedding" in str(w.message)]
    assert messages == [
        "kmp: layer 'token_embedding' (Embedding) casts its input to integer "
        "ids, but the ids reach it as float16, which holds integers exactly "
        "only up to 2048: a larger id rounds to another (2049 becomes 2048) "
        "and silently picks another embedding row, or one past the "
        "vocabulary (20000 ids). kmp keeps ids exact only when they reach "
        "this layer, or a layer holding it, as float32; these were cast to "
        'float16 before. Fix: feed the ids as integers, with '
        'keras.Input(shape=..., dtype="int32").'
    ]


def test_bfloat16_warning_names_its_largest_exact_id():
    kmp.set_policy("mixed_bfloat16")
    model = _rounded_before_the_embedding(500)
    expected = r"bfloat16, which holds integers exactly only up to 256"
    with pytest.warns(UserWarning, match=expected) as caught:
        model(np.full((1, MAXLEN), 257.0, "float32"))
    (message,) = [str(w.message) for w in caught if "257 becomes 256" in str(w.message)]
    assert 'keras.Input(shape=..., dtype="int32")' in message


@pytest.mark.parametrize(
    "policy, vocabulary, input_dtype",
    [
        ("mixed_float16", 2049, "float32"),  # ids 0..2048: all exact
        ("mixed_bfloat16", 257, "float32"),  # ids 0..256: all exact
        ("mixed_float16", VOCABULARY, "int32"),  # integer ids: the fix
        ("float32", VOCABULARY, "float32"),
    ],
)
def test_no_warning_where_every_id_is_exact(policy, vocabulary, input_dtype):
    kmp.set_policy(policy)
    inputs = keras.Input(shape=(MAXLEN,), dtype=input_dtype)
    narrowed = layers.Identity()(inputs) if input_dtype == "float32" else inputs
    outputs = layers.Embedding(vocabulary, WIDTH)(narrowed)
    model = kmp.Model(inputs, outputs)
    ids = np.minimum(IDS, vocabulary - 1).astype(input_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids)


class _Lookup(layers.Layer):
    """A custom table lookup: casts its ids itself, holds no Embedding."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(VOCABULARY, 2), initializer="uniform")

    def call(self, ids):
        ids = ops.cast(ids, "int32")
        return ops.take(self.table, ids, axis=0)


def test_custom_layer_that_casts_its_input_to_integers_gets_exact_ids():
    kmp.set_policy("mixed_float16")
    inputs = keras.Input(shape=(MAXLEN,))
    model = kmp.Model(inputs, _Lookup(name="lookup")(inputs))
    table = model.get_layer("lookup").table.numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        looked_up = model.predict(IDS, verbose=0)
    expected = table[IDS.astype(int)].astype("float16").astype("float32")
    assert np.array_equal(looked_up, expected)


def test_which_call_arguments_are_cast_to_integers():
    assert _token_ids.id_arguments(layers.Embedding(4, 2)) == ("inputs",)
    assert _token_ids.id_arguments(TokenAndPositionEmbedding(2, 4, 2)) == ()
    assert _token_ids.holds_id_layer(TokenAndPositionEmbedding(2, 4, 2))
    assert _token_ids.id_arguments(_Lookup()) == ("ids",)
    assert _token_ids.id_arguments(layers.Dense(2)) == ()
    # A class whose source cannot be read (defined from a string): no guess.
    namespace = {"layers": layers, "ops": ops}
    exec(
        "class Unread(layers.Layer):\n"
        "    def call(self, x):\n"
        "        return ops.cast(x, 'int32')\n",
        namespace,
    )
    assert _token_ids._cast_arguments(namespace["Unread"]) == ()


class _Casts(layers.Layer):
    def call(self, features, ids, tokens, mask, scores):
        first = tf.cast(ids[..., 0], tf.int64)
        second = tokens.astype("int32")
        mask_as_int = ops.cast(mask, "int32")  # 0 and 1: exact, not ids
        threshold = ops.cast(features > 0, "int32")  # a comparison, not ids
        wide = ops.cast(scores, dtype="float32")
        return first, second, mask_as_int, threshold, wide


def test_the_source_reading_finds_ids_not_masks_comparisons_or_floats():
    assert _token_ids._cast_arguments(_Casts) == ("ids", "tokens")


@pytest.mark.parametrize(
    "policy, largest", [("mixed_float16", 2048), ("mixed_bfloat16", 256)]
)
def test_diagnose_lists_float_ids_rounded_by_a_16_bit_cast(policy, largest):
    model = _classifier(keras.Model)
    report = kmp.diagnose(model, policy=policy)
    findings = [f for f in report.findings if f["check"] == "token ids"]
    assert [f["layer"] for f in findings] == ["embed"]
    message = findings[0]["message"]
    assert f"exactly only up to {largest}:" in message
    assert "an embedding of 20000 rows" in message and "arrive as float32" in message
    assert "kmp.Model" not in message
    assert findings[0]["fix"] == 'feed the ids as integers: keras.Input(shape=..., dtype="int32")'


def test_diagnose_says_what_a_kmp_model_keeps_and_skips_integer_ids():
    kmp_findings = kmp.diagnose(_classifier(), policy="mixed_float16").findings
    (finding,) = [f for f in kmp_findings if f["check"] == "token ids"]
    assert "A kmp.Model hands the float32 ids on to the embedding unrounded" in finding["message"]
    rounded_before = kmp.diagnose(
        _rounded_before_the_embedding(VOCABULARY), policy="mixed_float16"
    )
    (finding,) = [f for f in rounded_before.findings if f["check"] == "token ids"]
    assert finding["layer"] == "token_embedding"
    assert "but they arrive as float16, which holds integers exactly only up to 2048" in (
        finding["message"]
    )
    assert "kmp.Model" not in finding["message"]  # kmp cannot undo this one
    integer_model = _classifier(keras.Model, dtype="int32")
    assert not [
        f
        for f in kmp.diagnose(integer_model, policy="mixed_float16").findings
        if f["check"] == "token ids"
    ]


@pytest.mark.skipif(
    not hasattr(keras.layers, "ReversibleEmbedding"),
    reason="keras.layers.ReversibleEmbedding arrived after this Keras",
)
def test_reversible_embedding_maps_hidden_states_back_without_a_warning():
    class TiedLanguageModel(kmp.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embed = keras.layers.ReversibleEmbedding(VOCABULARY, WIDTH)

        def call(self, ids):
            hidden = self.embed(ids)  # 16-bit hidden states...
            return hidden, self.embed(hidden, reverse=True)  # ...not ids

    kmp.set_policy("mixed_float16")
    model = TiedLanguageModel(name="tied")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hidden, logits = model(IDS)
    table = model.embed.embeddings.numpy()
    assert np.array_equal(
        np.asarray(hidden), table[IDS.astype(int)].astype("float16").astype("float32")
    )
    assert logits.shape == (2, MAXLEN, VOCABULARY)
