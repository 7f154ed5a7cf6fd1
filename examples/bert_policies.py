"""A keras-hub BERT, converted with kmp.convert, trained under each policy.

The task is small and learnable: does a sequence of 16 random tokens contain
token 7? The classifier is built once in float32 (same initial weights for
every policy), converted to each policy, trained the same steps on the same
batches, and evaluated on held-out sequences.

Run: python examples/bert_policies.py
Needs keras-hub, which needs TensorFlow: `pip install -e ".[tensorflow,examples,hub]"`.
"""

import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import kmp  # noqa: E402

VOCABULARY, SEQUENCE, MARKER = 64, 16, 7
EPOCHS, BATCH = 4, 32


def data(n, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(8, VOCABULARY, size=(n, SEQUENCE))
    labels = np.arange(n) % 2
    positions = rng.integers(0, SEQUENCE, size=n)
    tokens[labels == 1, positions[labels == 1]] = MARKER
    inputs = {
        "token_ids": tokens,
        "segment_ids": np.zeros_like(tokens),
        "padding_mask": np.ones_like(tokens),
    }
    return inputs, labels


def main():
    keras.utils.set_random_seed(0)
    with kmp.policy_scope("float32"):
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=SEQUENCE, dropout=0.0,
        )
        classifier = keras_hub.models.BertTextClassifier(
            backbone, num_classes=2, preprocessor=None, dropout=0.0
        )
    x, y = data(1024, seed=1)
    x_test, y_test = data(512, seed=2)
    print(f"| policy | final train loss | test loss | test accuracy | fit time |")
    print(f"|---|---|---|---|---|")
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        model = kmp.convert(classifier, policy)
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        keras.utils.set_random_seed(1)
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        seconds = time.perf_counter() - start
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)[:2]
        print(
            f"| {policy} | {history.history['loss'][-1]:.6f} | {loss:.6f} | "
            f"{accuracy:.3f} | {seconds:.1f} s |"
        )
    print(f"({EPOCHS} epochs of {len(y) // BATCH} steps, batch {BATCH}, Adam 1e-3)")
    kmp.summary(kmp.convert(classifier, "mixed_float16"))


if __name__ == "__main__":
    main()
