"""Keras' ModelCheckpoint tests, on `kmp.callbacks.ModelCheckpoint` and a
`kmp.Model`.

Ported from keras-team/keras, keras/src/callbacks/model_checkpoint_test.py
(`ModelCheckpointTest.test_model_checkpoint_options` and
`test_model_checkpoint_loading`, as of Keras 3.15): the same cases, numbered
as there, and the same data sizes (30 training and 30 test samples of 3
features in 3 classes, drawn around one centre per class as Keras'
`test_utils.get_test_data` draws them). The models are the original's
Sequential and functional models as functional `kmp.Model`s; files saved
load with `kmp.load_model` / `keras.saving.load_model`.
"""

import os
import warnings

import keras
import numpy as np
import pytest
from keras import layers
from keras import metrics

import kmp

TRAIN_SAMPLES = TEST_SAMPLES = 30
NUM_CLASSES = INPUT_DIM = 3
NUM_HIDDEN = 5
BATCH_SIZE = 5


def get_test_data(random_seed=42):
    """Samples drawn around one random centre per class (Keras' recipe)."""
    rng = np.random.default_rng(random_seed)
    samples = TRAIN_SAMPLES + TEST_SAMPLES
    y = np.arange(samples) % NUM_CLASSES
    rng.shuffle(y)
    centres = rng.random((NUM_CLASSES, INPUT_DIM))
    x = (centres[y] + rng.normal(0, 0.5, (samples, INPUT_DIM))).astype("float32")
    y = keras.utils.to_categorical(y, NUM_CLASSES)
    return (x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]), (x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:])


def _model(batch_size=None):
    inputs = keras.Input((INPUT_DIM,), batch_size=batch_size)
    hidden = layers.Dense(NUM_HIDDEN, activation="relu")(inputs)
    model = kmp.Model(inputs, layers.Dense(NUM_CLASSES, activation="softmax")(hidden))
    model.compile(loss="categorical_crossentropy", optimizer="sgd",
                  metrics=[metrics.Accuracy("acc")])
    return model


def test_model_checkpoint_options(tmp_path):
    """Original: `test_model_checkpoint_options`, cases 1 to 15."""
    model = _model()
    (x_train, y_train), (x_test, y_test) = get_test_data()
    data = dict(validation_data=(x_test, y_test), verbose=0)

    def fit(callback, batch_size=BATCH_SIZE, epochs=1, **kwargs):
        model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
                  callbacks=[callback], **dict(data, **kwargs))

    # A subdirectory: ModelCheckpoint creates it.
    filepath = str(tmp_path / "subdir" / "checkpoint.keras")
    # Cases 1 to 4: val_loss in auto and min mode, val_acc in max mode, then
    # save_best_only: each epoch's file is written.
    for monitor, mode, save_best_only in (("val_loss", "auto", False), ("val_loss", "min", False),
                                          ("val_acc", "max", False), ("val_acc", "max", True)):
        fit(kmp.callbacks.ModelCheckpoint(filepath, monitor=monitor,
                                          save_best_only=save_best_only, mode=mode))
        assert os.path.exists(filepath), (monitor, mode, save_best_only)
        os.remove(filepath)

    # Case 5: a monitor that is not logged warns, and the file is written.
    with pytest.warns(UserWarning):
        fit(kmp.callbacks.ModelCheckpoint(filepath, monitor="unknown", save_best_only=True,
                                          mode="min"))
    assert os.path.exists(filepath)

    # Case 6: an unknown mode warns.
    with warnings.catch_warnings(record=True) as warning_logs:
        warnings.simplefilter("always")
        kmp.callbacks.ModelCheckpoint(filepath, monitor="val_acc", save_best_only=True,
                                      mode="unknown")
    assert "ModelCheckpoint mode 'unknown' is unknown" in str(warning_logs[-1].message)

    # Case 8a: save_freq=15 with 5 batches an epoch: epochs 3, 6, 9 of 10.
    pattern = str(tmp_path / "checkpoint.epoch{epoch:02d}.keras")
    assert not os.path.exists(pattern.format(epoch=3))
    fit(kmp.callbacks.ModelCheckpoint(pattern, monitor="val_acc", save_best_only=False,
                                      mode="max", save_freq=15), batch_size=6, epochs=10)
    saved = [epoch for epoch in range(1, 11) if os.path.exists(pattern.format(epoch=epoch))]
    assert saved == [3, 6, 9]
    for epoch in saved:
        os.remove(pattern.format(epoch=epoch))

    # Case 8b: the same with save_weights_only.
    pattern = str(tmp_path / "checkpoint.epoch{epoch:02d}.weights.h5")
    fit(kmp.callbacks.ModelCheckpoint(pattern, monitor="val_acc", save_freq=15,
                                      save_weights_only=True), batch_size=6, epochs=10)
    saved = [epoch for epoch in range(1, 11) if os.path.exists(pattern.format(epoch=epoch))]
    assert saved == [3, 6, 9]

    # Case 9: save_freq is "epoch" or an integer.
    with pytest.raises(ValueError, match="Unrecognized save_freq"):
        kmp.callbacks.ModelCheckpoint(pattern, monitor="val_acc", save_weights_only=True,
                                      mode="max", save_freq="invalid_save_freq")
    for save_freq in ("epoch", 3):
        kmp.callbacks.ModelCheckpoint(pattern, monitor="val_acc", save_weights_only=True,
                                      mode="max", save_freq=save_freq)

    # Cases 10a and 10b: save_freq=1 with {batch} in the name: 2 batches of
    # 15 an epoch, 5 epochs, whole models and weights.
    for suffix, weights_only in ((".keras", False), (".weights.h5", True)):
        pattern = str(tmp_path / f"checkpoint.epoch{{epoch:02d}}batch{{batch:02d}}{suffix}")
        fit(kmp.callbacks.ModelCheckpoint(pattern, monitor="val_acc", save_freq=1,
                                          save_weights_only=weights_only),
            batch_size=15, epochs=5, verbose=1)
        for epoch in range(1, 6):
            for batch in (1, 2):
                assert os.path.exists(pattern.format(epoch=epoch, batch=batch)), (suffix, epoch, batch)

    # Cases 11 to 14: initial_value_threshold. Saved where the first epoch
    # beats it (val_acc > -0.01; no threshold), not where it cannot (val_loss
    # below 0, in min and in auto mode).
    filepath = str(tmp_path / "checkpoint.keras")
    for monitor, mode, threshold, written in (("val_acc", "max", -0.01, True),
                                              ("val_loss", "auto", None, True),
                                              ("val_loss", "min", 0, False),
                                              ("val_loss", "auto", 0, False)):
        fit(kmp.callbacks.ModelCheckpoint(filepath, monitor=monitor, save_best_only=True,
                                          initial_value_threshold=threshold, mode=mode))
        assert os.path.exists(filepath) is written, (monitor, mode, threshold)
        if written:
            os.remove(filepath)

    # Case 15: auto mode takes "max" for AUC; nothing beats a threshold of 1.
    callback = kmp.callbacks.ModelCheckpoint(filepath, monitor="val_auc", save_best_only=True,
                                             initial_value_threshold=1, mode="auto")
    model.compile(loss="categorical_crossentropy", optimizer="sgd", metrics=[metrics.AUC()])
    fit(callback)
    assert not os.path.exists(filepath)


def test_model_checkpoint_loading(tmp_path):
    """Original: `test_model_checkpoint_loading`: the best model (whole, and
    weights only) loads with the trained weights."""
    (x_train, y_train), (x_test, y_test) = get_test_data()
    fit_kwargs = dict(batch_size=BATCH_SIZE, validation_data=(x_test, y_test), epochs=1,
                      verbose=0)

    model = _model(batch_size=5)
    filepath = str(tmp_path / "checkpoint.model.keras")
    model.fit(x_train, y_train, callbacks=[kmp.callbacks.ModelCheckpoint(
        filepath, monitor="val_loss", save_best_only=True, mode="auto")], **fit_kwargs)
    ref_weights = model.get_weights()
    assert os.path.exists(filepath)
    new_model = keras.saving.load_model(filepath)
    assert isinstance(new_model, kmp.Model)
    new_weights = new_model.get_weights()
    assert len(new_weights) == len(ref_weights)
    for ref_w, w in zip(ref_weights, new_weights):
        np.testing.assert_allclose(w, ref_w)

    model = _model(batch_size=5)
    filepath = str(tmp_path / "checkpoint.weights.h5")
    model.fit(x_train, y_train, callbacks=[kmp.callbacks.ModelCheckpoint(
        filepath, monitor="val_loss", save_best_only=True, save_weights_only=True,
        mode="auto")], **fit_kwargs)
    ref_weights = model.get_weights()
    assert os.path.exists(filepath)
    new_model = _model(batch_size=5)
    new_model.load_weights(filepath)
    new_weights = new_model.get_weights()
    assert len(new_weights) == len(ref_weights)
    for ref_w, w in zip(ref_weights, new_weights):
        np.testing.assert_allclose(w, ref_w)
