"""Keras' BackupAndRestore tests, on `kmp.callbacks.BackupAndRestore` and a
`kmp.Model`.

Ported from keras-team/keras, keras/src/callbacks/backup_and_restore_test.py
(`BackupAndRestoreCallbackTest`, as of Keras 3.15): each test keeps its name
and restates the original's scenario and numbers. The model is the
original's Sequential (a layer counting its calls in a non-trainable weight,
then Dense(1)) as a functional `kmp.Model`. The original checks its
resumption inside `except RuntimeError:`, which passes silently when nothing
is interrupted; here the interruption must happen.

kmp's callback names its weight files `backup-<n>.weights.h5` and lists the
current one in its metadata (kmp/checkpoint.py), where Keras' has fixed
paths: `test_backup_corrupted` corrupts the file the metadata names.
"""

import json
import os

import keras
import numpy as np
import pytest
from keras import layers

import kmp


class InterruptingCallback(keras.callbacks.Callback):
    """Raises after `steps_int` batches or at the end of epoch `epoch_int`."""

    def __init__(self, steps_int, epoch_int):
        super().__init__()
        self.batch_count, self.epoch_count = 0, 0
        self.steps_int, self.epoch_int = steps_int, epoch_int

    def on_epoch_end(self, epoch, log=None):
        self.epoch_count += 1
        if self.epoch_int is not None and self.epoch_count == self.epoch_int:
            raise RuntimeError("EpochInterruption")

    def on_batch_end(self, batch, logs=None):
        self.batch_count += 1
        if self.steps_int is not None and self.batch_count == self.steps_int:
            raise RuntimeError("StepsInterruption")


class CanaryLayer(layers.Layer):
    """Counts the batches it has seen, in a weight the backup carries."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.counter = self.add_weight(shape=(), initializer="zeros", dtype="float32",
                                       trainable=False)

    def call(self, x):
        self.counter.assign_add(1)
        return x


def make_model():
    inputs = keras.Input((3,))
    canary = CanaryLayer()
    model = kmp.Model(inputs, layers.Dense(1)(canary(inputs)))
    model.compile(loss="mse", optimizer="sgd", metrics=["mse"])
    return model, canary


def _data():
    rng = np.random.default_rng(0)
    return rng.random((10, 3)), rng.random((10, 1))


def test_save_freq_unknown_error(tmp_path):
    """Original: `test_save_freq_unknown_error`: `save_freq` "batch" and
    0.15 are refused."""
    for save_freq in ("batch", 0.15):
        with pytest.raises(ValueError, match="Invalid value"):
            kmp.callbacks.BackupAndRestore(backup_dir=str(tmp_path / "b"), save_freq=save_freq)


def test_best_case_step(tmp_path):
    """Original: `test_best_case_step`: saved every batch, interrupted after
    the 2nd of epoch 0 (3 batches an epoch); a 5-epoch fit resumes within
    epoch 0: 2 + 5 * 3 = 17 calls in all."""
    backup_dir = str(tmp_path / "subdir")
    assert not os.path.exists(backup_dir)
    model, canary = make_model()
    cbk = kmp.callbacks.BackupAndRestore(backup_dir, save_freq=1)
    x, y = _data()
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                  callbacks=[cbk, InterruptingCallback(steps_int=2, epoch_int=None)])
    assert os.path.exists(backup_dir)
    assert cbk._current_epoch == 0
    assert cbk._last_batch_seen == 1
    assert int(canary.counter.value) == 2
    hist = model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert cbk._current_epoch == 5
    assert hist.epoch[-1] == 4
    assert int(canary.counter.value) == 17


def test_best_case_epoch(tmp_path):
    """Original: `test_best_case_epoch`: saved every epoch, interrupted at the
    end of the 2nd (6 calls); a 5-epoch fit resumes from there: 5 * 3 = 15
    calls in all."""
    backup_dir = str(tmp_path / "subdir")
    assert not os.path.exists(backup_dir)
    model, canary = make_model()
    assert int(canary.counter.value) == 0
    cbk = kmp.callbacks.BackupAndRestore(backup_dir=backup_dir, save_freq="epoch")
    x, y = _data()
    with pytest.raises(RuntimeError, match="EpochInterruption"):
        model.fit(x, y, batch_size=4, epochs=6, verbose=0,
                  callbacks=[cbk, InterruptingCallback(steps_int=None, epoch_int=2)])
    assert cbk._current_epoch == 2
    assert os.path.exists(backup_dir)
    assert int(canary.counter.value) == 6
    hist = model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert cbk._current_epoch == 5
    # The two epochs done before the interruption are not trained again.
    assert hist.epoch == [2, 3, 4]
    assert int(canary.counter.value) == 5 * 3


def test_backup_corrupted(tmp_path):
    """Original: `test_backup_corrupted`: with `double_checkpoint=True`, after
    the latest weights file is overwritten, the next fit falls back to the
    previous backup and ends as an uninterrupted run: 15 calls."""
    backup_dir = str(tmp_path / "subdir")
    assert not os.path.exists(backup_dir)
    model, canary = make_model()
    cbk = kmp.callbacks.BackupAndRestore(backup_dir=backup_dir, save_freq="epoch",
                                         double_checkpoint=True)
    x, y = _data()
    with pytest.raises(RuntimeError, match="EpochInterruption"):
        model.fit(x, y, batch_size=4, epochs=6, verbose=0,
                  callbacks=[cbk, InterruptingCallback(steps_int=None, epoch_int=2)])
    assert cbk._current_epoch == 2
    assert os.path.exists(backup_dir)
    metadata_path = os.path.join(backup_dir, "training_metadata.json")
    with open(metadata_path) as f:
        metadata = json.load(f)
    latest = os.path.join(backup_dir, metadata["weights"])
    assert os.path.exists(latest)
    assert metadata.get("previous"), "double_checkpoint keeps the previous backup"
    assert os.path.exists(os.path.join(backup_dir, metadata["previous"]["weights"]))
    assert int(canary.counter.value) == 6
    with open(latest, "w") as f:  # the original's corruption
        f.write("0")
    with pytest.warns(UserWarning):
        hist = model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert cbk._current_epoch == 5
    assert hist.epoch[-1] == 4
    assert int(canary.counter.value) == 5 * 3


def test_model_deleted_case_epoch(tmp_path):
    """Original: `test_model_deleted_case_epoch`: a fit that ends deletes the
    backup folder."""
    backup_dir = str(tmp_path / "subdir")
    model, _ = make_model()
    cbk = kmp.callbacks.BackupAndRestore(backup_dir, save_freq="epoch")
    x, y = _data()
    model.fit(x, y, batch_size=4, callbacks=[cbk], epochs=2, verbose=0)
    assert not os.path.exists(backup_dir)


def test_backup_dir_empty_error():
    """Original: `test_backup_dir_empty_error`."""
    with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
        kmp.callbacks.BackupAndRestore(backup_dir="", save_freq="epoch")


def test_backup_dir_none_error():
    """Original: `test_backup_dir_none_error`."""
    with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
        kmp.callbacks.BackupAndRestore(backup_dir=None, save_freq="epoch")
