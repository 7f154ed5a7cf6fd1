"""Backups that were damaged after they were written are refused."""

import hashlib
import json
import os

import keras
import numpy as np
import pytest

import kmp


def _model():
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")


def _backed_up(backup_dir):
    """Two epochs with a backup kept after training."""
    model = _model()
    x, y = _data()
    backup = kmp.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[backup])
    with open(backup_dir / "training_metadata.json") as f:
        metadata = json.load(f)
    return model, metadata


def test_metadata_records_the_weights_files_sha256(tmp_path):
    _, metadata = _backed_up(tmp_path / "backup")
    weights = tmp_path / "backup" / metadata["weights"]
    assert metadata["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()


def test_a_flipped_bit_is_refused_naming_the_file_before_any_epoch(tmp_path):
    model, metadata = _backed_up(tmp_path / "backup")
    weights = tmp_path / "backup" / metadata["weights"]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the middle of the file
    weights.write_bytes(bytes(data))
    resumed = _model()
    epochs = []
    x, y = _data()
    with pytest.raises(ValueError, match=r"is damaged: its SHA-256 checksum differs from the one") as info:
        resumed.fit(
            x, y, batch_size=8, epochs=4, verbose=0,
            callbacks=[
                kmp.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False),
                keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, l: epochs.append(e)),
            ],
        )
    assert str(weights) in str(info.value)
    # The digest recorded is named; the digest of what is at that name now is
    # not (the file may not be one kmp wrote).
    assert metadata["sha256"] in str(info.value)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() not in str(info.value)
    assert epochs == []  # refused before any epoch was trained


def test_an_intact_backup_resumes_and_one_without_checksums_still_does(tmp_path):
    model, metadata = _backed_up(tmp_path / "backup")
    x, y = _data()
    path = tmp_path / "backup" / "training_metadata.json"
    for drop_checksum in (False, True):
        metadata = json.loads(path.read_text())
        if drop_checksum:  # a backup written before checksums were kept
            metadata.pop("sha256")
            path.write_text(json.dumps(metadata))
        resumed = _model()
        history = resumed.fit(
            x, y, batch_size=8, epochs=metadata["epoch"] + 1, verbose=0,
            callbacks=[kmp.callbacks.BackupAndRestore(str(tmp_path / "backup"),
                                                      delete_checkpoint=False)],
        )
        assert len(history.history["loss"]) == 1  # resumed at the last epoch
        assert os.path.exists(tmp_path / "backup" / "training_metadata.json")
