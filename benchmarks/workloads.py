"""The benchmark workloads: models and in-memory data, sized per run mode.

Each workload builds the same functional graph for every configuration; only
the model class (`keras.Model` or `kmp.Model`) and the global policy at build
time differ. A full run on a GPU uses GPU-sized models (`GPU_WORKLOAD_NAMES`,
`_GPU_SIZES`): a wide MLP, ResNet50 and a BERT-base-sized encoder.
"""

import dataclasses

import keras
import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark model: how to build it and the batch it trains on.

    Attributes:
        name: Short identifier (`mlp`, `convnet`, ...).
        title: What the workload exercises, for the report.
        build: Callable `(model_class, sizes) -> model`, not compiled.
        data: Callable `(sizes, rng) -> (x, y)` numpy arrays, one batch.
        sizes: Dict of size parameters for this run mode.
    """

    name: str
    title: str
    build: object
    data: object
    sizes: dict


def _mlp(model_class, s):
    inputs = keras.Input((s["features"],))
    x = inputs
    for _ in range(s["layers"]):
        x = keras.layers.Dense(s["width"], activation="relu")(x)
    outputs = keras.layers.Dense(s["classes"])(x)
    return model_class(inputs, outputs)


def _mlp_data(s, rng):
    x = rng.standard_normal((s["batch"], s["features"]), dtype=np.float32)
    y = rng.integers(0, s["classes"], (s["batch"],))
    return x, y


def _convnet(model_class, s):
    inputs = keras.Input((s["image"], s["image"], 3))
    x = inputs
    for i, filters in enumerate(s["filters"]):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        if i < len(s["filters"]) - 1:
            x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(s["classes"])(x)
    return model_class(inputs, outputs)


def _convnet_data(s, rng):
    x = rng.standard_normal((s["batch"], s["image"], s["image"], 3), dtype=np.float32)
    y = rng.integers(0, s["classes"], (s["batch"],))
    return x, y


def _fused_attention_runs_float16():
    """Whether Keras' fused attention (`ops.dot_product_attention`) runs in float16 here.

    Not on JAX's CPU: XLA's CPU `dot_general` has no float16 kernel that
    accumulates in float32, which JAX's attention asks for, so Keras' own
    `MultiHeadAttention` fails under mixed_float16 there ("The precision
    'F16_F16_F32' is not supported by dot_general on CPU").
    """
    if keras.backend.backend() != "jax":
        return True
    import jax

    return jax.default_backend() != "cpu"


def _transformer(model_class, s):
    # Where the fused attention cannot run float16, every configuration takes
    # MultiHeadAttention's other path (einsum, softmax, einsum), which
    # `return_attention_scores=True` selects; the scores go unused.
    explicit = not _fused_attention_runs_float16()
    inputs = keras.Input((s["seq"],), dtype="int32")
    x = keras.layers.Embedding(s["vocab"], s["dim"])(inputs)
    for _ in range(s["blocks"]):
        attention = keras.layers.MultiHeadAttention(
            s["heads"], s["dim"] // s["heads"]
        )(x, x, return_attention_scores=explicit)
        if explicit:
            attention, _ = attention
        x = keras.layers.LayerNormalization()(x + attention)
        hidden = keras.layers.Dense(s["ff"], activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(s["dim"])(hidden))
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(s["classes"])(x)
    return model_class(inputs, outputs)


def _transformer_data(s, rng):
    x = rng.integers(0, s["vocab"], (s["batch"], s["seq"])).astype(np.int32)
    y = rng.integers(0, s["classes"], (s["batch"],))
    return x, y


def _resnet50(model_class, s):
    # Built under the policy in force, like the others; re-wrapped so that the
    # model class is the configuration's (keras.Model or kmp.Model).
    base = keras.applications.ResNet50(
        weights=None,
        input_shape=(s["image"], s["image"], 3),
        classes=s["classes"],
        classifier_activation=None,
    )
    return model_class(base.inputs, base.outputs)


def _many_variables(model_class, s):
    inputs = keras.Input((s["width"],))
    x = inputs
    for _ in range(s["blocks"]):
        x = keras.layers.Dense(s["width"], activation="relu")(x)
        x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(s["classes"])(x)
    return model_class(inputs, outputs)


def _many_variables_data(s, rng):
    x = rng.standard_normal((s["batch"], s["width"]), dtype=np.float32)
    y = rng.integers(0, s["classes"], (s["batch"],))
    return x, y


def _large_state(model_class, s):
    inputs = keras.Input((s["tokens"],), dtype="int32")
    x = keras.layers.Embedding(s["vocab"], s["dim"])(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(s["classes"])(x)
    return model_class(inputs, outputs)


def _large_state_data(s, rng):
    x = rng.integers(0, s["vocab"], (s["batch"], s["tokens"])).astype(np.int32)
    y = rng.integers(0, s["classes"], (s["batch"],))
    return x, y


# Sizes per mode. float16 is emulated on CPUs without native float16 math and
# runs several times slower than float32, which bounds how large these can be.
_SIZES = {
    "mlp": {
        "full": dict(batch=256, features=512, width=1024, layers=3, classes=10),
        "quick": dict(batch=128, features=256, width=512, layers=2, classes=10),
        "smoke": dict(batch=16, features=32, width=32, layers=1, classes=4),
    },
    "convnet": {
        "full": dict(batch=64, image=32, filters=(32, 64, 128), classes=10),
        "quick": dict(batch=32, image=16, filters=(16, 32), classes=10),
        "smoke": dict(batch=4, image=8, filters=(4,), classes=4),
    },
    "transformer": {
        "full": dict(batch=32, seq=64, vocab=1000, dim=128, heads=4, ff=512, blocks=2, classes=10),
        "quick": dict(batch=16, seq=32, vocab=500, dim=64, heads=2, ff=128, blocks=1, classes=10),
        "smoke": dict(batch=4, seq=8, vocab=50, dim=16, heads=2, ff=16, blocks=1, classes=4),
    },
    "resnet50": {
        # Not in the CPU run by default (--workloads resnet50): 32x32 is the
        # smallest input ResNet50 takes.
        "full": dict(batch=16, image=64, classes=10),
        "quick": dict(batch=8, image=32, classes=10),
        "smoke": dict(batch=2, image=32, classes=4),
    },
    "large_state": {
        # Much state, little compute: a step's cost is mostly reading and
        # writing the 200000 x 64 table and its slots, so a copy of a
        # variable shows in its time.
        "full": dict(batch=32, tokens=8, vocab=200000, dim=64, classes=10),
        "quick": dict(batch=32, tokens=8, vocab=50000, dim=64, classes=10),
        "smoke": dict(batch=4, tokens=2, vocab=1000, dim=8, classes=4),
    },
    "many_variables": {
        # 50 blocks = 100 Dense/LayerNorm layers (+ the output Dense), 202
        # variables. Tracing time grows with the layer count, so --quick
        # uses fewer.
        "full": dict(batch=64, width=32, blocks=50, classes=10),
        "quick": dict(batch=64, width=32, blocks=6, classes=10),
        "smoke": dict(batch=8, width=8, blocks=2, classes=4),
    },
}

# Full-run sizes on a GPU: large enough that the step is compute-bound there,
# the shapes of common models. The quick and smoke runs keep their CPU sizes.
_GPU_SIZES = {
    "mlp": dict(batch=4096, features=1024, width=8192, layers=4, classes=1000),
    "resnet50": dict(batch=128, image=224, classes=1000),
    # BERT-base: 12 blocks, hidden 768, 12 heads, feed-forward 3072, seq 128.
    "transformer": dict(batch=64, seq=128, vocab=30522, dim=768, heads=12, ff=3072,
                        blocks=12, classes=2),
    "convnet": dict(batch=256, image=32, filters=(64, 128, 256), classes=10),
    "many_variables": dict(batch=256, width=256, blocks=50, classes=10),
    "large_state": dict(batch=256, tokens=16, vocab=2000000, dim=128, classes=10),
}

_DEFINITIONS = {
    "mlp": ("dense MLP (compute-bound)", _mlp, _mlp_data),
    "convnet": ("convnet with BatchNorm", _convnet, _convnet_data),
    "transformer": ("Transformer encoder (attention + LayerNorm)", _transformer, _transformer_data),
    "many_variables": ("many small variables (Dense + LayerNorm blocks)", _many_variables, _many_variables_data),
    "resnet50": ("ResNet50 (keras.applications, BatchNorm)", _resnet50, _convnet_data),
    "large_state": ("large state, little compute (one Embedding table)", _large_state,
                    _large_state_data),
}

# What a run covers unless `--workloads` says otherwise.
WORKLOAD_NAMES = ("mlp", "convnet", "transformer", "many_variables", "large_state")
GPU_WORKLOAD_NAMES = ("mlp", "resnet50", "transformer")
ALL_WORKLOAD_NAMES = tuple(_DEFINITIONS)


def get_workload(name, mode, gpu=False):
    """Returns the `Workload` called `name`, sized for `mode`.

    Args:
        name: String. One of `ALL_WORKLOAD_NAMES`.
        mode: String. `"full"`, `"quick"` or `"smoke"`.
        gpu: Bool. Whether the run is on a GPU: a full run there uses
            GPU-sized models. Defaults to `False`.

    Raises:
        ValueError: if `name` or `mode` is unknown.
    """
    if name not in _DEFINITIONS:
        raise ValueError(
            f"Unknown workload. `name` must be one of {', '.join(ALL_WORKLOAD_NAMES)}. "
            f"Received: name={name!r}"
        )
    if mode not in _SIZES[name]:
        raise ValueError(
            f"`mode` must be one of full, quick, smoke. Received: mode={mode!r}"
        )
    title, build, data = _DEFINITIONS[name]
    sizes = _GPU_SIZES[name] if gpu and mode == "full" else _SIZES[name][mode]
    if gpu and mode == "full" and name == "transformer":
        title = "BERT-base-sized Transformer encoder (attention + LayerNorm)"
    if name == "transformer" and not _fused_attention_runs_float16():
        title += (
            "; attention without Keras' fused kernel (on JAX's CPU it has no float16 "
            "version), through MultiHeadAttention's einsum path in every configuration"
        )
    return Workload(name, title, build, data, sizes)
