"""bfloat16 weights that train: a small Transformer and a keras-hub backbone.

    python -m benchmarks.bfloat16_weights            # the tables in docs/policies.md (~10 min on 2 cores)
    python -m benchmarks.bfloat16_weights --smoke    # about a minute, for the test suite
    python -m benchmarks.bfloat16_weights --out results/bfloat16_weights.json

Transformer: scikit-learn's digits (the quickstart's data, its split), each
8x8 image as 8 tokens (its rows) of 8 features; a Dense projection to 32,
learned positions, 2 blocks (MultiHeadAttention with 2 heads of 16,
LayerNormalization, a gelu feed-forward of 64), average pooling and a Dense
head. Trained 12 epochs at batch 32 by Adam(3e-3), AdamW(3e-3, weight decay
1e-2) and SGD(0.05, momentum 0.9), seeds 0, 1 and 2, under:

- float32 (a `kmp.Model`);
- `mixed_bfloat16` (a `kmp.Model`: float32 weights, bfloat16 compute);
- `bfloat16` (a `kmp.Model`: bfloat16 weights whose updates kmp computes in
  float32 and writes with Kahan compensation, Adam's moments in bfloat16);
- `bfloat16 stochastic`: the same, compiled with `compensation="stochastic"`
  (stochastic rounding, no buffer);
- `bfloat16 float32 moments`: `bfloat16` with the optimizer's slots (Adam's
  moments, SGD's momentum) in float32 instead, what the moments' dtype costs
  (12 bytes a parameter with Adam, as mixed_bfloat16: not a setting kmp offers);
- Keras' own bfloat16 weights (a `keras.Model` built under
  `keras.config.set_dtype_policy("bfloat16")`, its optimizer Keras' own).

It reports test accuracy (the quickstart's 20% split, 360 images).

keras-hub backbone: a random-init `BertBackbone` (2 layers, hidden 64, 2
heads, feed-forward 128, dropout 0) with a Dense head on its pooled output,
reading each digit as 64 tokens (its pixels' intensities, 0 to 16), every
weight trained by Adam(1e-3) for 6 epochs, seed 0: converted by
`kmp.convert(model, policy)` to `bfloat16` and to `mixed_bfloat16`, beside
Keras' own bfloat16 weights. It reports the training loss of every epoch and
the test accuracy.

Every run starts from the same weights for a seed (drawn under float32 and
set on the 16-bit models), so the columns differ only by precision.
"""

import argparse
import json
import os
import platform
import subprocess
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import kmp  # noqa: E402

PRECISIONS = ("float32", "mixed_bfloat16", "bfloat16", "bfloat16 stochastic",
              "bfloat16 float32 moments", "keras bfloat16")
# kmp's policy and compile's `compensation` for the kmp precisions that are
# not a policy's name.
_KMP = {"bfloat16 stochastic": ("bfloat16", "stochastic"),
        "bfloat16 float32 moments": ("bfloat16", "kahan")}


def _policy(precision):
    """The kmp policy a kmp precision trains under."""
    return _KMP.get(precision, (precision,))[0]
OPTIMIZERS = {
    "Adam(3e-3)": lambda: keras.optimizers.Adam(3e-3),
    "AdamW(3e-3, weight_decay=1e-2)": lambda: keras.optimizers.AdamW(3e-3, weight_decay=1e-2),
    "SGD(0.05, momentum=0.9)": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}
_MODES = {
    "full": dict(seeds=(0, 1, 2), epochs=12, hub_epochs=6, rows=None, optimizers=tuple(OPTIMIZERS),
                 backbone=("mixed_bfloat16", "bfloat16", "bfloat16 stochastic",
                           "keras bfloat16")),
    "smoke": dict(seeds=(0,), epochs=1, hub_epochs=1, rows=96, optimizers=("Adam(3e-3)",),
                  backbone=("mixed_bfloat16", "bfloat16")),
}


def _digits(rows=None):
    """The quickstart's split of the digits: `(x_train, x_test, y_train, y_test)`,
    images scaled to [0, 1]; the first `rows` of each part where given."""
    digits = load_digits()
    parts = train_test_split(
        digits.images.astype("float32"), digits.target, test_size=0.2, random_state=0,
        stratify=digits.target,
    )
    return [part[:rows] for part in parts] if rows else parts


def _transformer(model_class):
    inputs = keras.Input((8, 8))
    hidden = keras.layers.Dense(32)(inputs)
    positions = keras.layers.Embedding(8, 32)(keras.ops.arange(8)[None])
    hidden = hidden + positions
    for _ in range(2):
        attention = keras.layers.MultiHeadAttention(2, 16)(hidden, hidden)
        hidden = keras.layers.LayerNormalization()(hidden + attention)
        forward = keras.layers.Dense(64, activation="gelu")(hidden)
        hidden = keras.layers.LayerNormalization()(hidden + keras.layers.Dense(32)(forward))
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return model_class(inputs, keras.layers.Dense(10)(hidden))


def _under(precision, build):
    """`build(model_class)` under `precision`: kmp's policy for a kmp.Model,
    Keras' global policy for Keras' own bfloat16."""
    if precision == "keras bfloat16":
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("bfloat16")
        try:
            return build(keras.Model)
        finally:
            keras.config.set_dtype_policy(previous)
    with kmp.policy_scope(_policy(precision)):
        return build(kmp.Model)


def _compile(model, precision, optimizer):
    """`model.compile` with `optimizer` as `precision` asks (its
    `compensation`, or float32 slots)."""
    if precision == "bfloat16 float32 moments":
        made = optimizer.add_variable_from_reference

        def float32_slot(reference_variable, name=None, initializer="zeros"):
            if keras.backend.standardize_dtype(reference_variable.dtype) != "bfloat16":
                return made(reference_variable, name=name, initializer=initializer)
            return optimizer.add_variable(
                reference_variable.shape, initializer=initializer, dtype="float32",
                name=f"{reference_variable.path.replace('/', '_')}_{name}")
        optimizer.add_variable_from_reference = float32_slot  # this instance only
    extra = {} if precision not in _KMP else {"compensation": _KMP[precision][1]}
    model.compile(optimizer, _loss(), metrics=["accuracy"], **extra)


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def bytes_per_parameter(model):
    """The bytes of `model`'s trainable weights and its optimizer's
    variables (slots, buffers and the scaler's few counters) over its
    trainable parameters."""
    def size(variables):
        return sum(int(np.prod(v.shape)) * np.dtype(
            keras.backend.standardize_dtype(v.dtype)).itemsize for v in variables)
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    return (size(model.trainable_weights) + size(model.optimizer.variables)) / parameters


def transformer_accuracy(data, precision, optimizer, seed, epochs):
    """Test accuracy of the Transformer trained under `precision`, and
    its `bytes_per_parameter`."""
    x_train, x_test, y_train, y_test = data
    keras.utils.set_random_seed(seed)
    with kmp.policy_scope("float32"):
        start = _transformer(keras.Model).get_weights()
    model = _under(precision, _transformer)
    model.set_weights(start)
    _compile(model, precision, OPTIMIZERS[optimizer]())
    model.fit(x_train / 16.0, y_train, batch_size=32, epochs=epochs, verbose=0)
    return float(model.evaluate(x_test / 16.0, y_test, verbose=0)[1]), bytes_per_parameter(model)


def _bert_classifier():
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=17, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=128,
        max_sequence_length=64, dropout=0.0,
    )
    return keras.Model(backbone.input, keras.layers.Dense(10)(backbone.output["pooled_output"]))


def _bert_inputs(images):
    tokens = images.reshape(len(images), 64).astype("int32")  # intensities 0..16
    return {"token_ids": tokens, "segment_ids": np.zeros_like(tokens),
            "padding_mask": np.ones_like(tokens)}


def backbone_run(data, precision, epochs, seed=0):
    """`{"loss": [per epoch], "accuracy": test accuracy, "weights": dtypes}`
    of the keras-hub classifier trained under `precision`."""
    x_train, x_test, y_train, y_test = data
    keras.utils.set_random_seed(seed)
    with kmp.policy_scope("float32"):
        float32_model = _bert_classifier()
    if precision == "keras bfloat16":
        model = _under(precision, lambda model_class: _bert_classifier())
        model.set_weights(float32_model.get_weights())
    else:
        model = kmp.convert(float32_model, _policy(precision), compile=False)
    _compile(model, precision, keras.optimizers.Adam(1e-3))
    history = model.fit(_bert_inputs(x_train), y_train, batch_size=32, epochs=epochs, verbose=0)
    return {
        "loss": [float(value) for value in history.history["loss"]],
        "accuracy": float(model.evaluate(_bert_inputs(x_test), y_test, verbose=0)[1]),
        "weights": sorted({keras.backend.standardize_dtype(v.dtype)
                           for v in model.trainable_weights}),
    }


def _commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=10,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(mode="full", log=print):
    """Runs every table's training; returns the results as a dict."""
    settings = _MODES[mode]
    data = _digits(settings["rows"])
    started = time.perf_counter()
    transformer, memory = {}, {}
    for optimizer in settings["optimizers"]:
        for precision in PRECISIONS:
            runs = [
                transformer_accuracy(data, precision, optimizer, seed, settings["epochs"])
                for seed in settings["seeds"]
            ]
            accuracies = [accuracy for accuracy, _ in runs]
            transformer.setdefault(optimizer, {})[precision] = accuracies
            memory.setdefault(optimizer, {})[precision] = runs[0][1]
            log(f"[{time.perf_counter() - started:5.0f}s] transformer {optimizer:32s} "
                f"{precision:15s} {' '.join(f'{a:.4f}' for a in accuracies)}")
    backbone = {}
    for precision in settings["backbone"]:
        backbone[precision] = backbone_run(data, precision, settings["hub_epochs"])
        log(f"[{time.perf_counter() - started:5.0f}s] keras-hub BertBackbone {precision:15s} "
            f"loss {' '.join(f'{v:.3f}' for v in backbone[precision]['loss'])}, "
            f"accuracy {backbone[precision]['accuracy']:.4f}")
    return {
        "mode": mode,
        "seeds": list(settings["seeds"]),
        "epochs": settings["epochs"],
        "hub_epochs": settings["hub_epochs"],
        "transformer": transformer,
        "bytes_per_parameter": memory,
        "backbone": backbone,
        "seconds": time.perf_counter() - started,
        "machine": platform.processor() or platform.machine(),
        "backend": keras.backend.backend(),
        "keras": keras.__version__,
        "commit": _commit(),
    }


def markdown(results):
    """The two Markdown tables of `results`."""
    lines = [
        "| optimizer | " + " | ".join(PRECISIONS) + " |",
        "|---|" + "---|" * len(PRECISIONS),
    ]
    for optimizer, row in results["transformer"].items():
        lines.append(f"| {optimizer} | " + " | ".join(
            ", ".join(f"{a:.4f}" for a in row[precision]) for precision in PRECISIONS) + " |")
    for optimizer, row in results["bytes_per_parameter"].items():
        lines.append(f"| {optimizer}: bytes a parameter | " + " | ".join(
            f"{row[precision]:.2f}" for precision in PRECISIONS) + " |")
    lines += ["", "| BertBackbone, Adam(1e-3) | weights | loss by epoch | test accuracy |",
              "|---|---|---|---:|"]
    for precision, figures in results["backbone"].items():
        lines.append(
            f"| {precision} | {', '.join(figures['weights'])} | "
            f"{' '.join(f'{v:.3f}' for v in figures['loss'])} | {figures['accuracy']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bfloat16_weights", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="Adam only, one seed, one epoch, 96 images: about a minute, "
                             "for the test suite")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    results = run("smoke" if args.smoke else "full")
    if args.out:
        with open(args.out, "w") as output:
            json.dump(results, output, indent=1)
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
