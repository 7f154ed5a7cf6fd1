"""Writes tests/data/saved_at_fa9caf1.keras (and its predictions, .npy) with kmp at
fa9caf1, before kmp/ moved into folders: `python tests/data/make_saved_at_fa9caf1.py
tests/data/saved_at_fa9caf1.keras` in a checkout of that commit."""
import os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np, keras, kmp
keras.utils.set_random_seed(1)
kmp.set_policy("mixed_float16")
inputs = keras.Input((4,), dtype="float32", name="ids")
x = keras.layers.Embedding(16, 3, name="embed")(inputs)
x = keras.layers.UnitNormalization(name="norm")(x)
x = keras.layers.Flatten()(x)
outputs = keras.layers.Dense(2, activation="softmax", name="head")(x)
model = kmp.Model(inputs, outputs)
model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10, growth_interval=3), loss="sparse_categorical_crossentropy")
ids = np.array([[1, 2, 3, 15], [0, 5, 9, 12]], "float32")
model.fit(ids, np.array([0, 1]), epochs=2, verbose=0)
for layer in model.layers:
    print(layer.name, type(layer.dtype_policy).__module__, type(layer.dtype_policy).__name__)
print(type(model), type(model.optimizer))
model.save(sys.argv[1])
np.save(sys.argv[1].replace(".keras", ".npy"), model.predict(ids, verbose=0))
