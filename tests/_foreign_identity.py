"""What kmp changes in TensorFlow and Keras: run as a script, in a fresh process.

`python tests/_foreign_identity.py` records the identity of every attribute of
every TensorFlow and Keras class loaded (its whole MRO, and `__bases__`) and of
every function and class in their modules (public and private), then imports
kmp and runs what users run: `fit` (one device and a MirroredStrategy), a
custom `train_step` with two optimizers and `scale_loss`, a GradientTape loop
with `kmp.LossScaleOptimizer`, `kmp.convert`, `kmp.export` and `kmp.diagnose`.
After each it records again and names what changed since before the import.
A plain `keras.Model` trained before the import and again at the end must
have the same instance attributes (its layers and optimizer too), so must the
models handed to kmp.convert (and their layers) after the converted models
trained, and no user object kmp does not own may carry a `_kmp_*` attribute.

It prints one JSON object on its last line (tests/test_foreign.py reads it):
    {"control": [...], "stages": {"import kmp": [...], "fit": [...], ...},
     "plain_model": [...], "convert_argument": [...],
     "kmp_attributes_on_foreign_objects": [...]}
every list empty when kmp changes nothing outside its own objects. "control"
is what a plain Keras fit changed before kmp was imported: it shows the
snapshot itself does not change under ordinary use.
"""

import inspect
import json
import os
import sys
import tempfile

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

FOREIGN_ROOTS = ("keras", "tensorflow", "tf_keras")
# Python fills these in lazily (`__slotnames__` on the first copy or pickle).
LAZY = {"__annotations__", "__dict__", "__weakref__", "__doc__", "__module__", "__slotnames__",
        "__abstractmethods__", "_abc_impl"}


def _is_foreign_module(name):
    # Protobuf's generated message classes (`*_pb2`) get their nested types
    # as class attributes when first used (a SavedModel export brings
    # `FunctionSpec.JitCompile`): protobuf's doing, not a patch.
    return name.split(".")[0] in FOREIGN_ROOTS and not name.endswith("_pb2")


def _tracked(value):
    """Module attributes that are code: functions, classes, methods, anything
    callable. (Module-level data - caches, counters, the current graph -
    changes under any use; a submodule is tracked by its own dict.)"""
    return callable(value) or isinstance(value, (classmethod, staticmethod, property))


def snapshot():
    """{key: {name: value}}: one entry per foreign class (its own dict and
    `__bases__`) and per foreign module (its functions and classes). It holds
    the values themselves, so that a replaced one cannot free its id for the
    replacement."""
    modules = [(name, module) for name, module in list(sys.modules.items())
               if module is not None and _is_foreign_module(name)]
    out = {}
    classes = {}
    for name, module in modules:
        try:
            namespace = dict(vars(module))
        except TypeError:
            continue
        entries = {}
        for attribute, value in namespace.items():
            if inspect.ismodule(value) or type(value).__name__ in ("LazyLoader", "KerasLazyLoader"):
                continue
            if _tracked(value):
                entries[attribute] = value
            if inspect.isclass(value):
                for klass in value.__mro__:
                    if _is_foreign_module(getattr(klass, "__module__", "") or ""):
                        classes[id(klass)] = klass
        out[f"module {name}"] = entries
    # The user's own Keras classes (this script's): kmp.convert's argument's class.
    for value in list(vars(sys.modules["__main__"]).values()):
        if inspect.isclass(value) and issubclass(value, keras.Model):
            classes[id(value)] = value
    for klass in classes.values():
        entries = {name: value for name, value in list(vars(klass).items()) if name not in LAZY}
        entries["__bases__"] = klass.__bases__  # the same tuple until someone assigns new bases
        out[f"class {klass.__module__}.{klass.__qualname__} at {id(klass):#x}"] = entries
    return out


_MISSING = object()


def changed(before, after):
    """`module m: name` / `class C: name` for each attribute of a module or class
    present in both snapshots that was replaced, added or removed."""
    found = []
    for key in sorted(set(before) & set(after)):
        old, new = before[key], after[key]
        label = key.rsplit(" at ", 1)[0]
        found += [f"{label}: {name}" for name in sorted(set(old) | set(new))
                  if old.get(name, _MISSING) is not new.get(name, _MISSING)]
    return found


# What users run ---------------------------------------------------------------

def _data(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _plain_model():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LayerNormalization()(hidden)))


def plain_fit():
    """A plain keras.Model trained as any Keras user does: the instance
    attribute names of the model, its layers, its optimizer and metrics."""
    keras.config.set_dtype_policy("float32")
    model = _plain_model()
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    model.fit(*_data(), batch_size=8, epochs=1, verbose=0)
    objects = {"model": model, "optimizer": model.optimizer}
    objects.update({f"layer {i} {type(layer).__name__}": layer for i, layer in enumerate(model.layers)})
    objects.update({f"metric {i} {type(metric).__name__}": metric for i, metric in enumerate(model.metrics)})
    return {label: sorted(vars(obj)) for label, obj in objects.items()}, list(objects.values())


def run_fit(kmp, strategy):
    kmp.set_policy("mixed_float16")
    x, y = _data()
    ids = np.arange(16 * 3).reshape(16, 3) % 10
    token_ids = keras.Input((3,), dtype="int32")
    features = keras.Input((6,))
    embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(token_ids))
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([embedded, features]))
    model = kmp.Model([token_ids, features], keras.layers.Dense(1)(keras.layers.LayerNormalization()(hidden)))
    model.compile("adam", "mse")
    model.fit([ids, x], y, batch_size=8, epochs=1, verbose=0)
    model.predict([ids, x], verbose=0)
    with strategy.scope():
        mirrored = kmp.Model(features, keras.layers.Dense(1)(features))
        mirrored.compile(keras.optimizers.SGD(0.01), "mse")
    mirrored.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return [strategy, strategy.extended]


def run_custom_train_step(kmp):
    kmp.set_policy("mixed_float16")

    class GAN(kmp.Model):
        def __init__(self):
            super().__init__()
            self.discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
            self.generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(6)])

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
            self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

        def train_step(self, data):
            real, latent = data
            n = ops.shape(real)[0]
            combined = ops.concatenate([ops.cast(self.generator(latent), "float32"), real], axis=0)
            labels = ops.concatenate([ops.ones((n, 1)), ops.zeros((n, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
                scaled = self.d_optimizer.scale_loss(d_loss)
            grads = tape.gradient(scaled, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(ops.zeros((n, 1)), self.discriminator(self.generator(latent)))
                scaled = self.g_optimizer.scale_loss(g_loss)
            grads = tape.gradient(scaled, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            return {"d_loss": d_loss, "g_loss": g_loss}

        def call(self, latent):
            return self.generator(latent)

    x, _ = _data()
    latent = np.ones((16, 3), "float32")
    gan = GAN()
    gan.compile(keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.01))
    gan.fit(tf.data.Dataset.from_tensor_slices((x, latent)).batch(8), epochs=1, verbose=0)
    return []


def run_gradient_tape_loop(kmp):
    kmp.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    tapes = []

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(ops.cast(model(x), "float32") - y))
            scaled = optimizer.scale_loss(loss)
        tapes.append(tape)
        grads = tape.gradient(scaled, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    x, y = _data(8)
    step(x, y)
    tf.function(step)(x, y)
    return tapes


class Subclassed(keras.Model):
    """A user's model without get_config: kmp.convert wraps it. At module
    level, so that the snapshot covers the user's class too."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.dense(inputs))


def instance_attributes(objects):
    return {f"{i} {type(obj).__name__}": sorted(vars(obj)) for i, obj in enumerate(objects)}


def attribute_changes(before, after):
    return [f"{label}: {sorted(set(after.get(label, [])) ^ set(before.get(label, [])))}"
            for label in sorted(set(before) | set(after)) if before.get(label) != after.get(label)]


def run_convert(kmp, result):
    kmp.set_policy("float32")
    x, y = _data()
    functional = _plain_model()
    functional.compile("adam", "mse")
    subclassed = Subclassed()
    subclassed(x[:1])
    subclassed.compile("adam", "mse")
    arguments = [functional, subclassed, *functional.layers, *subclassed.layers]
    before = instance_attributes(arguments)
    for model in (functional, subclassed):
        converted = kmp.convert(model, policy="mixed_float16")
        converted.fit(x, y, batch_size=8, epochs=1, verbose=0)
        converted.predict(x, verbose=0)
    result["convert_argument"] = attribute_changes(before, instance_attributes(arguments))
    return arguments


def run_export(kmp, folder):
    kmp.set_policy("mixed_float16")
    model = kmp.Model(*_functional_graph())
    model.compile("adam", "mse")
    model.fit(*_data(), batch_size=8, epochs=1, verbose=0)
    kmp.export(model, os.path.join(folder, "served"), inference_policy="float32", verbose=False)
    return []


def run_diagnose(kmp):
    kmp.set_policy("float32")
    model = _plain_model()
    model.compile("adam", "mse")
    kmp.diagnose(model, data=_data(8), policy="mixed_float16")
    return [model, *model.layers]


def _functional_graph():
    inputs = keras.Input((6,))
    return inputs, keras.layers.Dense(1)(keras.layers.Dense(4)(inputs))


def kmp_attributes(objects):
    return sorted({f"{type(obj).__module__}.{type(obj).__qualname__}: {name}"
                   for obj in objects for name in getattr(obj, "__dict__", {}) if name.startswith("_kmp")})


def main():
    # Two logical CPUs for MirroredStrategy: before TensorFlow initializes devices.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    start = snapshot()
    reference_attributes, _ = plain_fit()
    before = snapshot()
    result = {"control": changed(start, before), "stages": {}}

    import kmp

    seen = set()

    def record(stage):
        found = [entry for entry in changed(before, snapshot()) if entry not in seen]
        seen.update(found)
        result["stages"][stage] = found

    record("import kmp")
    foreign_objects = []
    with tempfile.TemporaryDirectory() as folder:
        for stage, run in [
            ("fit", lambda: run_fit(kmp, strategy)),
            ("custom train_step", lambda: run_custom_train_step(kmp)),
            ("GradientTape loop", lambda: run_gradient_tape_loop(kmp)),
            ("kmp.convert", lambda: run_convert(kmp, result)),
            ("kmp.export", lambda: run_export(kmp, folder)),
            ("kmp.diagnose", lambda: run_diagnose(kmp)),
        ]:
            foreign_objects += run()
            record(stage)
    attributes, plain_objects = plain_fit()
    result["plain_model"] = attribute_changes(reference_attributes, attributes)
    result["kmp_attributes_on_foreign_objects"] = kmp_attributes(foreign_objects + plain_objects)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
