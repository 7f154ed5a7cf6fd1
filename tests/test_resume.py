"""Crash-safe resume: SIGKILL mid-epoch and mid-save, checkpoints that reload."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import keras
import numpy as np
import pytest

import kmp
from _helpers import child_env
from _helpers import free_ports
from kmp import checkpoint as checkpoint_module

# A training run in its own process, so that it can be killed by a real
# signal. It pauses (writes `--marker`, then sleeps) at a chosen batch or in
# the middle of a chosen backup write, and the test sends SIGKILL.
_WORKER = textwrap.dedent(
    """
    import argparse, os, sys, time
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    parser = argparse.ArgumentParser()
    parser.add_argument("--backup")
    parser.add_argument("--dump")
    parser.add_argument("--marker")
    parser.add_argument("--callback", default="kmp")
    parser.add_argument("--pause-at-batch", default="")  # "epoch,batch"
    parser.add_argument("--pause-in-save", type=int, default=0)  # n-th backup
    args = parser.parse_args()

    import numpy as np
    import keras
    import tensorflow as tf
    import kmp

    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    kmp.set_policy("mixed_bfloat16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6)).astype("float32")
    # Large targets: the first scaled loss overflows float32.
    y = 30 * rng.normal(size=(48, 2)).astype("float32")
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = kmp.Model(inputs, keras.layers.Dense(2)(hidden))
    # A first scale that overflows, so the skip counter and the backed-off
    # scale are part of the state to restore; then growth every 4 steps.
    model.compile(
        optimizer=kmp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0**127,
            max_scale=2.0**127, backoff_factor=2.0**-100, growth_interval=4,
        ),
        loss="mse",
        overflow_retries=0,  # the first steps are skipped, not redone: state to restore
    )

    def dump(name):
        optimizer = model.optimizer
        np.savez(
            os.path.join(args.dump, name),
            *[v.numpy() for v in model.weights],
            *[v.numpy() for v in optimizer.variables],
            *[v.numpy() for v in optimizer.inner_optimizer.variables],
            loss_scale=float(optimizer.loss_scale),
            skipped_steps=int(optimizer.skipped_steps),
            iterations=int(optimizer.iterations),
            initial_epoch=int(getattr(model, "_initial_epoch", None) or 0),
        )

    def pause():
        with open(args.marker, "w") as f:
            f.write("paused")
        time.sleep(600)

    if args.pause_in_save:
        from keras.src.saving import saving_lib
        original_save_state = saving_lib._save_state
        saves = [0]

        def save_state(saveable, weights_store, assets_store, inner_path,
                       visited_saveables):
            if inner_path == "":
                saves[0] += 1
            if saves[0] == args.pause_in_save and "optimizer" in inner_path:
                # The layers are written, the optimizer is not. Flushing is
                # what HDF5 does by itself once its buffers fill up; without
                # it the partial file may be unreadable instead of partial.
                weights_store.h5_file.flush()
                pause()
            return original_save_state(
                saveable, weights_store, assets_store, inner_path,
                visited_saveables)

        saving_lib._save_state = save_state

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            dump("restored.npz")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if args.pause_at_batch == f"{self.epoch},{batch}":
                pause()

        def on_epoch_end(self, epoch, logs=None):
            dump(f"epoch{epoch + 1}.npz")

    if args.callback == "kmp":
        backup = kmp.callbacks.BackupAndRestore(args.backup)
    else:
        backup = keras.callbacks.BackupAndRestore(args.backup)
    model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
              callbacks=[backup, Probe()])
    dump("final.npz")
    """
)


# Workers still running when a test ends (it failed): killed at teardown.
_running = []


@pytest.fixture(autouse=True)
def _kill_leftover_workers():
    yield
    while _running:
        process = _running.pop()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)


def _start(tmp_path, name, *args):
    """Starts a worker; returns (process, marker path, dump directory)."""
    dump = tmp_path / name
    dump.mkdir()
    marker = tmp_path / f"{name}.paused"
    # On the CPU: runs compared with each other bit for bit must run the same
    # kernels, and none needs a GPU.
    env = child_env(gpu=False)
    process = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "worker.py"),
            "--dump", str(dump),
            "--marker", str(marker),
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _running.append(process)
    return process, marker, dump


def _finish(process):
    _, stderr = process.communicate(timeout=240)
    if process.returncode != 0:
        # pytest.fail, not assert: an xfail(raises=AssertionError) below must
        # not pass for a worker that crashed.
        pytest.fail(f"The worker failed (exit {process.returncode}):\n{stderr[-3000:]}")


def _kill_when_paused(process, marker):
    deadline = time.monotonic() + 240
    while not marker.exists():
        if process.poll() is not None:
            pytest.fail("The worker ended before pausing:\n" + process.stderr.read()[-3000:])
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("The worker never paused.")
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    if process.returncode != -signal.SIGKILL:
        pytest.fail(f"The worker was not killed: exit {process.returncode}")
    process.stdout.close()
    process.stderr.close()


def _assert_same_state(expected_path, actual_path, keys=None):
    expected, actual = np.load(expected_path), np.load(actual_path)
    keys = keys or [k for k in expected.files if k != "initial_epoch"]
    for key in keys:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.fixture
def worker(tmp_path):
    (tmp_path / "worker.py").write_text(_WORKER)
    return tmp_path


class _ReferenceRun:
    """A worker run never killed, started once and read by every test that
    compares with it: the worker, its arguments and its seeds are the same
    in each, and it runs on the CPU with deterministic ops, so its dumps are
    too."""

    def __init__(self, process, dump):
        self._process, self._dump, self._failure = process, dump, None

    def dump(self):
        """The run's dump directory, once the run has ended; fails each test
        that reads it if the run failed."""
        if self._process is not None:
            process, self._process = self._process, None
            try:
                _finish(process)
            except pytest.fail.Exception as failure:
                self._failure = str(failure)
        if self._failure is not None:
            pytest.fail(self._failure)
        return self._dump

    def kill(self):
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=60)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run, started as the first test that needs it begins
    (it trains beside that test's own first run) and waited for when a test
    first reads it."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "worker.py").write_text(_WORKER)
    process, _, dump = _start(folder, "reference", "--backup", str(folder / "ref"))
    # Not a test's leftover: `_kill_leftover_workers` leaves it to this fixture.
    _running.remove(process)
    run = _ReferenceRun(process, dump)
    yield run
    run.kill()


def test_sigkill_mid_save_then_mid_epoch_resumes_bit_identical(worker, reference_run):
    backup = worker / "backup"
    # Run 1 dies inside the third backup (end of epoch 3), half-way through
    # writing it: layers written, optimizer not.
    first, marker, _ = _start(worker, "first", "--backup", str(backup), "--pause-in-save", "3")
    _kill_when_paused(first, marker)
    metadata = json.loads((backup / "training_metadata.json").read_text())
    assert metadata["epoch"] == 2
    assert (backup / metadata["weights"]).exists()
    assert any(".partial" in name for name in os.listdir(backup))
    reference_dump = reference_run.dump()
    reference_final = np.load(reference_dump / "final.npz")
    assert int(reference_final["skipped_steps"]) >= 1  # the state is not trivial
    assert float(reference_final["loss_scale"]) != 2.0**127

    # Run 2 restores the epoch-2 backup, then dies mid-epoch 4.
    second, marker, second_dump = _start(
        worker, "second", "--backup", str(backup), "--pause-at-batch", "3,2"
    )
    _kill_when_paused(second, marker)
    _assert_same_state(reference_dump / "epoch2.npz", second_dump / "restored.npz")
    assert int(np.load(second_dump / "restored.npz")["initial_epoch"]) == 2

    # Run 3 restores the epoch-3 backup and finishes.
    third, _, third_dump = _start(worker, "third", "--backup", str(backup))
    _finish(third)
    _assert_same_state(reference_dump / "epoch3.npz", third_dump / "restored.npz")
    _assert_same_state(reference_dump / "final.npz", third_dump / "final.npz")
    assert not backup.exists()  # delete_checkpoint=True once training ends


_KERAS_WRITES_IN_PLACE = (
    "Keras 3.15 writes checkpoints in place: BackupAndRestore._save_model calls "
    "model.save_weights(overwrite=True) on the very file training_metadata.json "
    "points to, and saving_lib.save_model opens the .keras path with "
    'open(filepath, "wb"). A save cut short destroys the previous checkpoint; '
    "BackupAndRestore then resumes from the epoch in the old metadata with the "
    "layers written before the kill and a fresh optimizer (iterations 0, loss "
    "scale 2**127): a state that never existed. kmp.callbacks fixes both."
)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=_KERAS_WRITES_IN_PLACE)
def test_keras_backup_killed_mid_save_resumes_from_the_last_complete_backup(
    worker, reference_run
):
    """What kmp.callbacks.BackupAndRestore does (see the test above), asked of Keras' own."""
    backup = worker / "backup"
    first, marker, _ = _start(
        worker, "first", "--callback", "keras", "--backup", str(backup),
        "--pause-in-save", "3",
    )
    _kill_when_paused(first, marker)
    reference_dump = reference_run.dump()
    resumed, _, resumed_dump = _start(
        worker, "resumed", "--callback", "keras", "--backup", str(backup)
    )
    _finish(resumed)
    # The run died writing epoch 3's backup: epoch 2's must be resumed, all of
    # it (layers, Adam's slots and step, loss scale and skip counter).
    assert int(np.load(resumed_dump / "restored.npz")["initial_epoch"]) == 2
    _assert_same_state(reference_dump / "epoch2.npz", resumed_dump / "restored.npz")


def _bfloat16_model():
    kmp.set_policy("mixed_bfloat16")
    inputs = keras.Input((6,))
    model = kmp.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(inputs)))
    model.compile(
        optimizer=kmp.LossScaleOptimizer("adam", initial_scale=8.0, growth_interval=3),
        loss="mse",
    )
    return model


def _regression_data():
    rng = np.random.default_rng(1)
    return (
        rng.normal(size=(24, 6)).astype("float32"),
        rng.normal(size=(24, 2)).astype("float32"),
    )


def test_model_checkpoint_reloads_and_continues_with_the_same_loss_scale(tmp_path):
    model = _bfloat16_model()
    x, y = _regression_data()
    path = tmp_path / "run.keras"
    model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
        callbacks=[kmp.callbacks.ModelCheckpoint(str(path), save_weights_only=False)],
    )
    assert float(model.optimizer.loss_scale) == 8.0 * 2**2

    restored = kmp.load_model(path)
    assert float(restored.optimizer.loss_scale) == float(model.optimizer.loss_scale)
    assert int(restored.optimizer.iterations) == int(model.optimizer.iterations) == 6
    for original, loaded in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(original.numpy(), loaded.numpy())

    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    restored_history = restored.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert restored_history.history["loss_scale"] == history.history["loss_scale"]
    for original, loaded in zip(model.weights, restored.weights):
        np.testing.assert_allclose(original.numpy(), loaded.numpy(), rtol=1e-6)


def _fail_half_way_through_saving(monkeypatch):
    """Makes the next save die after the layers and before the optimizer."""
    from keras.src.saving import saving_lib

    original = saving_lib._save_state

    def save_state(saveable, weights_store, assets_store, inner_path, visited_saveables):
        if "optimizer" in inner_path:
            raise KeyboardInterrupt("killed while saving")
        return original(saveable, weights_store, assets_store, inner_path, visited_saveables)

    monkeypatch.setattr(saving_lib, "_save_state", save_state)


@pytest.mark.parametrize(
    "callback_class",
    [
        pytest.param(
            keras.callbacks.ModelCheckpoint,
            marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                    reason=_KERAS_WRITES_IN_PLACE),
        ),
        kmp.callbacks.ModelCheckpoint,
    ],
)
def test_checkpoint_interrupted_while_saving_keeps_the_previous_one(
    tmp_path, monkeypatch, callback_class
):
    model = _bfloat16_model()
    x, y = _regression_data()
    path = tmp_path / "latest.keras"
    callback = callback_class(str(path), save_weights_only=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    good = path.read_bytes()

    _fail_half_way_through_saving(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    monkeypatch.undo()

    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["latest.keras"]  # no partial file left
    restored = kmp.load_model(path)
    assert int(restored.optimizer.iterations) == 3


def test_loading_an_archive_whose_save_was_interrupted_says_why(tmp_path):
    model = _bfloat16_model()
    model.save(tmp_path / "good.keras")
    # What an exception while writing the weights leaves: the zip is closed
    # (its directory written) without the weights entry.
    with zipfile.ZipFile(tmp_path / "good.keras") as good, zipfile.ZipFile(
        tmp_path / "cut.keras", "w"
    ) as cut:
        names = good.namelist()
        assert "model.weights.h5" in names
        for name in names:
            if name != "model.weights.h5":
                cut.writestr(name, good.read(name))
    # Keras itself says "Expected a model.weights.h5 or model.weights.npz
    # file."; kmp says what happened and what to do.
    with pytest.raises(ValueError, match=r"not a complete .keras archive.*only the entries"):
        kmp.load_model(tmp_path / "cut.keras")
    assert kmp.load_model(tmp_path / "good.keras").built


def test_restore_refuses_a_backup_without_the_optimizer_state(tmp_path):
    model = _bfloat16_model()
    x, y = _regression_data()
    uncompiled = kmp.Model.from_config(model.get_config())
    (tmp_path / "backup").mkdir()
    weights_file = tmp_path / "backup" / "backup-000000.weights.h5"
    uncompiled.save_weights(weights_file)
    (tmp_path / "backup" / "training_metadata.json").write_text(json.dumps({
        "epoch": 1, "batch": 0, "weights": weights_file.name,
        "sha256": hashlib.sha256(weights_file.read_bytes()).hexdigest(),
    }))
    with pytest.raises(ValueError, match="backup-000000.weights.h5.*does not match"):
        model.fit(x, y, epochs=2, verbose=0,
                  callbacks=[kmp.callbacks.BackupAndRestore(str(tmp_path / "backup"))])

    (tmp_path / "backup" / "training_metadata.json").write_text('{"epoch": 1, "ba')
    with pytest.raises(ValueError, match="not valid JSON"):
        model.fit(x, y, epochs=2, verbose=0,
                  callbacks=[kmp.callbacks.BackupAndRestore(str(tmp_path / "backup"))])


def test_write_atomically_removes_the_partial_file_on_error(tmp_path):
    target = tmp_path / "model.weights.h5"
    target.write_bytes(b"good")

    def write(path):
        assert path.endswith(".weights.h5") and ".partial" in path
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint_module.write_atomically(target, write)
    assert target.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["model.weights.h5"]


def test_write_atomically_onto_a_folder_raises_before_writing(tmp_path):
    (tmp_path / "run.keras").mkdir()
    calls = []
    with pytest.raises(IsADirectoryError, match="`filepath` must be the path of a file, not a "
                       f"folder: '{tmp_path / 'run.keras'}'"):
        checkpoint_module.write_atomically(tmp_path / "run.keras", calls.append)
    assert calls == [] and os.listdir(tmp_path) == ["run.keras"]


def test_monitor_state_is_backed_up_and_restored(tmp_path):
    x, y = _regression_data()

    def run(epochs, backup_dir):
        keras.utils.set_random_seed(3)
        model = _bfloat16_model()
        # mode="max" on a falling loss: the best stays at epoch 0 and `wait`
        # counts up, which a restart without the monitor state would reset.
        early_stopping = keras.callbacks.EarlyStopping(
            monitor="loss", mode="max", patience=100
        )
        backup = kmp.callbacks.BackupAndRestore(
            str(backup_dir), delete_checkpoint=False, monitors=[early_stopping]
        )
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[backup, early_stopping])
        return early_stopping

    uninterrupted = run(3, tmp_path / "uninterrupted")
    run(2, tmp_path / "interrupted")  # "dies" after its second backup
    resumed = run(3, tmp_path / "interrupted")
    assert (uninterrupted.best_epoch, uninterrupted.wait) == (0, 2)
    assert (resumed.best_epoch, resumed.wait) == (0, 2)
    assert resumed.best == uninterrupted.best

    with pytest.raises(TypeError, match="monitors"):
        kmp.callbacks.BackupAndRestore(str(tmp_path / "b"), monitors=["early_stopping"])


def test_loading_a_truncated_checkpoint_fails_with_a_clear_error(tmp_path):
    model = _bfloat16_model()
    x, y = _regression_data()
    model.fit(x, y, batch_size=24, verbose=0)
    model.save(tmp_path / "good.keras")
    data = (tmp_path / "good.keras").read_bytes()
    # What a SIGKILL during Keras' in-place write leaves behind.
    (tmp_path / "cut.keras").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.keras.*") as error:
        kmp.load_model(tmp_path / "cut.keras", policy="float32")
    assert "not a complete .keras archive" in str(error.value)
    assert kmp.load_model(tmp_path / "good.keras", policy="float32").built


def test_double_checkpoint_falls_back_to_the_previous_backup(tmp_path):
    x, y = _regression_data()
    backup_dir = tmp_path / "backup"
    model = _bfloat16_model()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        kmp.callbacks.BackupAndRestore(str(backup_dir), double_checkpoint=True,
                             delete_checkpoint=False)])
    metadata = json.loads((backup_dir / "training_metadata.json").read_text())
    assert metadata["epoch"] == 2 and metadata["previous"]["epoch"] == 1
    # A disk error in the latest backup.
    (backup_dir / metadata["weights"]).write_bytes(b"\0" * 64)

    resumed = _bfloat16_model()
    probe = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: probe.seen.append(int(resumed.optimizer.iterations))
    )
    probe.seen = []
    with pytest.warns(UserWarning, match=r"previous backup .*\(epoch 1\).*is damaged"):
        resumed.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
            kmp.callbacks.BackupAndRestore(str(backup_dir), double_checkpoint=True), probe])
    assert probe.seen == [3]  # the epoch-1 backup: 3 steps
    assert int(resumed.optimizer.iterations) == 6


def _run_with_backup(backup_dir, epochs, **kwargs):
    """Trains a fresh model with a backup in `backup_dir`; returns the model and
    the epochs `fit` began, or the model and the error `fit` raised."""
    x, y = _regression_data()
    keras.utils.set_random_seed(5)
    model = _bfloat16_model()
    began = []
    probe = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: began.append(epoch))
    try:
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[
            kmp.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False, **kwargs),
            probe])
    except ValueError as error:
        assert began == []  # raised before any epoch was trained
        return model, error
    return model, began


def test_a_flipped_bit_in_a_backup_is_an_error_naming_the_file(tmp_path):
    backup_dir = tmp_path / "backup"
    _, began = _run_with_backup(backup_dir, 2)
    uninterrupted, _ = _run_with_backup(tmp_path / "uninterrupted", 3)
    metadata = json.loads((backup_dir / "training_metadata.json").read_text())
    assert metadata["weights"] == "backup-000001.weights.h5"
    weights_file = backup_dir / metadata["weights"]
    assert metadata["sha256"] == hashlib.sha256(weights_file.read_bytes()).hexdigest()
    original = _flip_one_bit_of_a_weight(weights_file)

    model, error = _run_with_backup(backup_dir, 3)
    assert str(error).startswith(
        f"The backup file {str(weights_file)!r} is damaged: its SHA-256 checksum "
        f"differs from the one {str(backup_dir / 'training_metadata.json')!r} "
        f"recorded ({metadata['sha256']})"
    ), error
    assert int(model.optimizer.iterations) == 0  # nothing restored either

    # The intact file resumes epoch 3 and ends as the uninterrupted run.
    weights_file.write_bytes(original)
    resumed, began = _run_with_backup(backup_dir, 3)
    assert began == [2]
    for a, b in zip(resumed.weights + resumed.optimizer.variables,
                    uninterrupted.weights + uninterrupted.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_backup_without_checksums_restores_with_a_warning(tmp_path):
    # What kmp wrote before it recorded checksums: the same, without "sha256".
    backup_dir = tmp_path / "backup"
    _run_with_backup(backup_dir, 2)
    metadata_path = backup_dir / "training_metadata.json"
    metadata = json.loads(metadata_path.read_text())
    del metadata["sha256"]
    metadata_path.write_text(json.dumps(metadata))
    with pytest.warns(UserWarning, match=r"backup-000001.weights.h5' has no checksum"):
        model, began = _run_with_backup(backup_dir, 3)
    assert began == [2] and int(model.optimizer.iterations) == 9
    # The next backup records one again.
    assert "sha256" in json.loads(metadata_path.read_text())


class _RaiseAtEpochEnd(keras.callbacks.Callback):
    """A crash in a callback listed after the backup, at the end of epoch
    `epoch` (0-based), once the backup has handled that epoch's end."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("crashed at the end of the epoch")


@pytest.mark.parametrize("crash_epoch", [0, 1])
def test_a_crash_in_a_later_callback_resumes_where_keras_own_backup_resumes(
    tmp_path, crash_epoch
):
    """Keras' own `BackupAndRestore` is the reference: the same run, crashed
    by a later callback at an epoch's end, then resumed, trains the same
    epochs and ends with the same weights and optimizer state, bit for bit."""
    x, y = _regression_data()

    def crash_then_resume(callback_class, backup_dir):
        keras.utils.set_random_seed(5)
        model = _bfloat16_model()
        with pytest.raises(RuntimeError, match="crashed at the end"):
            model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                      callbacks=[callback_class(str(backup_dir)), _RaiseAtEpochEnd(crash_epoch)])
        keras.utils.set_random_seed(5)
        resumed = _bfloat16_model()
        history = resumed.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                              callbacks=[callback_class(str(backup_dir))])
        return resumed, history.epoch

    reference, reference_epochs = crash_then_resume(
        keras.callbacks.BackupAndRestore, tmp_path / "keras")
    model, epochs = crash_then_resume(kmp.callbacks.BackupAndRestore, tmp_path / "kmp")
    assert reference_epochs == list(range(crash_epoch + 1, 4))
    assert epochs == reference_epochs
    for a, b in zip(model.weights + model.optimizer.variables,
                    reference.weights + reference.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_what_a_later_callback_changes_is_rewritten_into_the_epochs_backup(
    tmp_path, monkeypatch
):
    """Callbacks after the backup change the state after it was written at
    the epoch's end: a learning rate (`_HalveLearningRate`, every epoch) and
    a monitor's counters (`EarlyStopping`). The backup is brought up to date
    at the next epoch's start: a new save when the variables changed, a hard
    link to the file just written when only counters did. `double_checkpoint`
    keeps the previous epoch's backup, not the replaced one."""
    x, y = _regression_data()
    saves = []
    save_weights = keras.Model.save_weights

    def counted_save_weights(self, filepath, *args, **kwargs):
        saves.append(os.path.basename(str(filepath)))
        return save_weights(self, filepath, *args, **kwargs)

    monkeypatch.setattr(kmp.Model, "save_weights", counted_save_weights, raising=False)

    def run(backup_dir, epochs, halve):
        model = _bfloat16_model()
        stopping = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=100)
        later = [_HalveLearningRate()] if halve else []
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[
            kmp.callbacks.BackupAndRestore(str(backup_dir), double_checkpoint=True,
                                           delete_checkpoint=False, monitors=[stopping]),
            *later, stopping])
        return model, stopping

    # Only the counters change: one save per epoch, the rewrites are links.
    model, stopping = run(tmp_path / "counters", 3, halve=False)
    assert len(saves) == 3
    metadata = json.loads((tmp_path / "counters" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 3 and metadata["previous"]["epoch"] == 2
    assert metadata["monitors"] == [{"best": stopping.best, "wait": stopping.wait,
                                     "best_epoch": stopping.best_epoch,
                                     "stopped_epoch": stopping.stopped_epoch}]
    assert stopping.wait == 2
    # The previous epoch's backup is itself a rewrite (counters of epoch 2).
    assert metadata["previous"]["monitors"][0]["wait"] == 1

    # The learning rate changes too: a second save per epoch.
    saves.clear()
    model, _ = run(tmp_path / "rate", 3, halve=True)
    assert len(saves) == 6
    folder = tmp_path / "rate"
    metadata = json.loads((folder / "training_metadata.json").read_text())
    assert metadata["epoch"] == 3 and metadata["previous"]["epoch"] == 2
    assert sorted(os.listdir(folder)) == sorted(
        [metadata["weights"], metadata["previous"]["weights"], "training_metadata.json"])
    # Restored from it: the learning rate of the run's end, 3 halvings.
    resumed = _bfloat16_model()
    resumed.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
        kmp.callbacks.BackupAndRestore(str(folder))])
    initial = float(_bfloat16_model().optimizer.learning_rate)
    assert float(resumed.optimizer.learning_rate) == initial / 8
    assert float(model.optimizer.learning_rate) == initial / 8
    for a, b in zip(resumed.weights + resumed.optimizer.variables,
                    model.weights + model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


class _FakeCluster:
    """Stands in for the all-gathers of `BackupAndRestore` across workers: this
    process is the chief, "worker-0"; `others` are the other workers' values,
    one dict per gather."""

    def __init__(self, monkeypatch, *others):
        self.others, self.sent = list(others), []
        monkeypatch.setattr(checkpoint_module, "_this_worker", lambda strategy: ("worker-0", True))
        monkeypatch.setattr(checkpoint_module, "_gather_from_workers", self.gather)

    def gather(self, strategy, task, value):
        assert task == "worker-0"
        self.sent.append(int(value))
        return {"worker-0": int(value), **self.others.pop(0)}


def test_workers_resume_from_the_newest_backup_they_all_hold(tmp_path, monkeypatch):
    backup_dir = tmp_path / "backup"
    metadata_path = backup_dir / "training_metadata.json"
    # Worker 1 was killed in its third save: it holds backup 1 (epoch 2) and
    # backup 0 (epoch 1). One gather of latest backups, one of previous ones,
    # one of whether each restore succeeded.
    cluster = _FakeCluster(
        monkeypatch,
        {"worker-1": -1}, {"worker-1": -1}, {"worker-1": 1},
        {"worker-1": 1}, {"worker-1": 0}, {"worker-1": 1},
    )
    _run_with_backup(backup_dir, 3)
    assert cluster.sent == [-1, -1, 1]  # nothing to restore, then "restored"
    assert json.loads(metadata_path.read_text())["previous"]["epoch"] == 2
    model, began = _run_with_backup(backup_dir, 3)
    # Backup 2 (epoch 3) is worker 0's latest; both resume backup 1 (epoch 2).
    assert cluster.sent == [-1, -1, 1, 2, 1, 1]
    assert began == [2] and int(model.optimizer.iterations) == 9
    metadata = json.loads(metadata_path.read_text())
    assert (metadata["epoch"], metadata["weights"]) == (3, "backup-000002.weights.h5")
    assert metadata["previous"]["weights"] == "backup-000001.weights.h5"


def test_workers_stop_together_when_their_backups_disagree_or_one_fails(tmp_path, monkeypatch):
    backup_dir = tmp_path / "backup"
    _FakeCluster(monkeypatch, {"worker-1": -1}, {"worker-1": -1}, {"worker-1": 1})
    _run_with_backup(backup_dir, 3)
    # Worker 1 has no backup at all: not the same run.
    _FakeCluster(monkeypatch, {"worker-1": -1}, {"worker-1": -1})
    _, error = _run_with_backup(backup_dir, 3)
    assert "have no backup in common" in str(error)
    assert "worker-0 holds backup 2 and backup 1, worker-1 holds none" in str(error)
    # Worker 1 holds backups 4 and 3: not the same run either.
    _FakeCluster(monkeypatch, {"worker-1": 4}, {"worker-1": 3})
    _, error = _run_with_backup(backup_dir, 3)
    assert "worker-0 holds backup 2 and backup 1, worker-1 holds backup 4 and backup 3" in str(error)
    # Worker 1 could not read its metadata, or restore its own backup 2:
    # worker 0 stops too, rather than wait for worker 1 in a collective.
    unreadable = checkpoint_module._UNREADABLE
    _FakeCluster(monkeypatch, {"worker-1": unreadable}, {"worker-1": unreadable})
    _, error = _run_with_backup(backup_dir, 4)
    assert str(error).startswith("worker-1 could not read its backup metadata under")
    _FakeCluster(monkeypatch, {"worker-1": 2}, {"worker-1": 1}, {"worker-1": 0})
    _, error = _run_with_backup(backup_dir, 4)
    assert str(error).startswith("worker-1 could not restore backup 2 under")
    assert "Every worker stops" in str(error)


class _HalveLearningRate(keras.callbacks.Callback):
    """Stands in for `ReduceLROnPlateau` listed after the backup: lowers the
    learning rate in its own `on_epoch_end`, after the backup was written."""

    def on_epoch_end(self, epoch, logs=None):
        rate = self.model.optimizer.learning_rate
        rate.assign(rate * 0.5)


def test_workers_resume_the_same_backup_when_one_died_before_its_rewrite(
    tmp_path, monkeypatch
):
    """A later callback changed the state, so each worker rewrites its
    epoch backup at the next epoch's start. Worker 0 rewrote its last one
    (it holds backup 3, the rewrite of epoch 2, and backup 1, epoch 1's);
    worker 1 died before its rewrite (it holds backup 2, epoch 2 as it was
    at the epoch's end, and backup 1): both resume backup 1."""
    backup_dir = tmp_path / "backup"
    _FakeCluster(monkeypatch, {"worker-1": -1}, {"worker-1": -1}, {"worker-1": 1})
    x, y = _regression_data()
    model = _bfloat16_model()
    rates = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: rates.append(float(model.optimizer.learning_rate)))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        kmp.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False),
        _HalveLearningRate(), record])
    metadata = json.loads((backup_dir / "training_metadata.json").read_text())
    # Epoch 1's end: 0, its rewrite: 1; epoch 2's end: 2, its rewrite at the
    # end of training: 3, which keeps epoch 1's as previous.
    assert (metadata["epoch"], metadata["weights"]) == (2, "backup-000003.weights.h5")
    assert metadata["previous"]["weights"] == "backup-000001.weights.h5"
    assert sorted(os.listdir(backup_dir)) == [
        "backup-000001.weights.h5", "backup-000003.weights.h5", "training_metadata.json"]

    cluster = _FakeCluster(monkeypatch, {"worker-1": 2}, {"worker-1": 1}, {"worker-1": 1})
    resumed = _bfloat16_model()
    began = []
    resumed.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        kmp.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False),
        keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: began.append(
            (epoch, float(resumed.optimizer.learning_rate))))])
    assert cluster.sent == [3, 1, 1]
    # Epoch 1's backup, with the learning rate the callback lowered after it.
    assert began == [(1, rates[1])] and rates[1] == rates[0] * 0.5


def test_the_chief_deletes_its_own_backups_never_a_worker_folder(tmp_path, monkeypatch):
    """At the end the chief deletes its files in a shared folder while the
    other workers delete their folders: one still training keeps its folder,
    and one that vanishes between the chief's listing and its next look is no
    error (it crashed the chief on CI)."""
    backup_dir = tmp_path / "backup"
    _FakeCluster(monkeypatch, {"worker-1": -1, "worker-2": -1}, {"worker-1": -1, "worker-2": -1},
                 {"worker-1": 1, "worker-2": 1})
    still_training = backup_dir / "worker-2"
    still_training.mkdir(parents=True)
    (still_training / "training_metadata.json").write_text("{}")
    listdir = os.listdir

    def listdir_as_worker_1_finishes(path):
        names = listdir(path)
        if os.fspath(path) == str(backup_dir):
            names.append("worker-1")  # listed, and deleted by worker 1 just after
        return names

    monkeypatch.setattr(os, "listdir", listdir_as_worker_1_finishes)
    x, y = _regression_data()
    model = _bfloat16_model()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[kmp.callbacks.BackupAndRestore(str(backup_dir))])
    assert sorted(listdir(backup_dir)) == ["worker-2"]
    assert (still_training / "training_metadata.json").read_text() == "{}"


# -- Several workers (MultiWorkerMirroredStrategy), one process each ---------

_BACKUP_WORKER = os.path.join(os.path.dirname(__file__), "multi_worker_backup_worker.py")
_CLUSTER_TIMEOUT_S = 240


def _start_cluster(tmp_path, name, backup_dirs, worker_args=((), ())):
    """Starts two loopback workers of MultiWorkerMirroredStrategy.

    Returns one `(process, marker, dump directory, log path)` per worker.
    """
    ports = free_ports(len(backup_dirs))
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    workers = []
    for index, (backup_dir, args) in enumerate(zip(backup_dirs, worker_args)):
        dump = tmp_path / f"{name}-{index}"
        dump.mkdir()
        marker = tmp_path / f"{name}-{index}.paused"
        log = tmp_path / f"{name}-{index}.log"
        env = dict(
            child_env(gpu=False),
            TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}
            ),
        )
        with open(log, "w") as log_file:
            process = subprocess.Popen(
                [sys.executable, _BACKUP_WORKER, "--backup", str(backup_dir),
                 "--dump", str(dump), "--marker", str(marker), *args],
                env=env, stdout=log_file, stderr=subprocess.STDOUT,
            )
        _running.append(process)
        workers.append((process, marker, dump, log))
    return workers


def _wait_for_cluster(workers, *, expect_success=True):
    """Waits for every worker; returns their exit codes."""
    deadline = time.monotonic() + _CLUSTER_TIMEOUT_S
    for process, *_ in workers:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=60)
    codes = [process.returncode for process, *_ in workers]
    if expect_success and any(codes):
        pytest.fail(
            f"Workers exited with {codes}:\n"
            + "\n".join(
                f"--- worker {i}:\n" + log.read_text()[-3000:]
                for i, (_, _, _, log) in enumerate(workers)
            )
        )
    return codes


def _wait_for_file(path, workers, predicate=lambda path: True):
    deadline = time.monotonic() + _CLUSTER_TIMEOUT_S
    while not (path.exists() and predicate(path)):
        if any(process.poll() is not None for process, *_ in workers):
            pytest.fail(
                f"A worker ended before {path.name} appeared:\n"
                + "\n".join(log.read_text()[-3000:] for *_, log in workers)
            )
        if time.monotonic() > deadline:
            pytest.fail(f"{path} never appeared.")
        time.sleep(0.05)


def _kill_cluster(workers, killed):
    """SIGKILLs worker `killed`; returns how each survivor ended on its own
    (its exit code, or `None` if it was still running after a minute, and was
    then killed)."""
    process = workers[killed][0]
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    survivors = {}
    for index, (other, *_) in enumerate(workers):
        if index == killed:
            continue
        try:
            survivors[index] = other.wait(timeout=60)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait(timeout=60)
            survivors[index] = None
    return survivors


def _epoch_in(metadata_path):
    try:
        return json.loads(metadata_path.read_text())["epoch"]
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def uninterrupted_cluster(tmp_path_factory):
    """The final state of two workers that share one backup folder, never killed."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    backup = tmp_path / "backup"
    workers = _start_cluster(tmp_path, "reference", [backup, backup])
    _wait_for_cluster(workers)
    assert not backup.exists()  # delete_checkpoint=True: every worker's part
    for _, _, dump, _ in workers:
        assert int(np.load(dump / "restored.npz")["initial_epoch"]) == 0
    final = [dump / "final.npz" for _, _, dump, _ in workers]
    _assert_same_state(final[0], final[1])
    reference = np.load(final[0])
    # The poisoned sample is skipped once per epoch: the state is not trivial.
    assert int(reference["skipped_steps"]) == 4
    return final[0]


def _flip_one_bit_of_a_weight(path):
    """Flips the lowest mantissa bit of the first float32 weight stored in the
    HDF5 file `path`, in its data, not its structure; returns the original
    bytes."""
    import h5py

    original = path.read_bytes()
    with h5py.File(path, "r") as f:
        datasets = []
        f.visititems(
            lambda name, item: datasets.append(name)
            if isinstance(item, h5py.Dataset) and item.dtype == np.float32 and item.size >= 4
            else None
        )
        name = datasets[0]
        values = np.asarray(f[name]).ravel()
    offset = original.find(values.tobytes())
    assert offset >= 0 and original.count(values.tobytes()) == 1
    damaged = bytearray(original)
    damaged[offset] ^= 1
    path.write_bytes(bytes(damaged))
    # HDF5 keeps no checksum: the damaged file opens and reads another value.
    with h5py.File(path, "r") as f:
        read = np.asarray(f[name]).ravel()
    assert read[0] != values[0] and np.array_equal(read[1:], values[1:])
    return original


def test_two_workers_sharing_one_backup_folder_resume_identical_after_a_kill(
    tmp_path, uninterrupted_cluster
):
    backup = tmp_path / "backup"
    # Worker 1 dies mid-epoch 3 (0-based 2), after the epoch-2 backups.
    workers = _start_cluster(
        tmp_path, "first", [backup, backup], [(), ("--pause-at-batch", "2,3")]
    )
    _wait_for_file(workers[1][1], workers)
    survivors = _kill_cluster(workers, killed=1)
    # Worker 0's next collective fails: it stops by itself, with an error.
    assert survivors[0] not in (0, None), survivors
    # The chief's backup in the folder, worker 1's in its own subfolder; each
    # keeps its previous one too.
    assert _epoch_in(backup / "training_metadata.json") == 2
    assert _epoch_in(backup / "worker-1" / "training_metadata.json") == 2
    # Each holds its own lock file, which the killed processes' OS released.
    assert sorted(os.listdir(backup)) == [
        "backup-000000.weights.h5", "backup-000001.weights.h5",
        "kmp-backup.lock", "training_metadata.json", "worker-1",
    ]
    assert (backup / "worker-1" / "kmp-backup.lock").exists()

    # A flipped bit in worker 1's backup: worker 1 names the file, and worker 0
    # stops too instead of training from a state worker 1 does not share.
    metadata = json.loads((backup / "worker-1" / "training_metadata.json").read_text())
    weights_file = backup / "worker-1" / metadata["weights"]
    original = _flip_one_bit_of_a_weight(weights_file)
    workers = _start_cluster(tmp_path, "damaged", [backup, backup])
    assert all(_wait_for_cluster(workers, expect_success=False))
    logs = [log.read_text() for *_, log in workers]
    assert f"The backup file {str(weights_file)!r} is damaged: its SHA-256" in logs[1]
    assert "worker-1 could not restore backup 1" in logs[0]
    for _, _, dump, _ in workers:
        assert not (dump / "final.npz").exists()

    # Restarted with the same command, both resume epoch 3 and end as if
    # never interrupted, bit for bit.
    weights_file.write_bytes(original)
    workers = _start_cluster(tmp_path, "resumed", [backup, backup])
    _wait_for_cluster(workers)
    for _, _, dump, _ in workers:
        assert int(np.load(dump / "restored.npz")["initial_epoch"]) == 2
        _assert_same_state(uninterrupted_cluster, dump / "final.npz")
    assert not backup.exists()


@pytest.mark.parametrize("layout", ["one shared folder", "one folder per worker"])
def test_two_workers_killed_between_their_saves_resume_from_the_same_backup(
    tmp_path, uninterrupted_cluster, layout
):
    if layout == "one shared folder":
        backups = [tmp_path / "backup"] * 2
    else:
        backups = [tmp_path / "backup0", tmp_path / "backup1"]
    worker_1_folder = backups[1] / "worker-1"
    # Worker 1 dies half-way through writing its epoch-3 backup, once worker
    # 0 has committed its own: worker 0 holds epoch 3, worker 1 epoch 2.
    workers = _start_cluster(
        tmp_path, "first", backups, [(), ("--pause-in-save", "3")]
    )
    _wait_for_file(workers[1][1], workers)
    _wait_for_file(
        backups[0] / "training_metadata.json", workers,
        lambda path: _epoch_in(path) == 3,
    )
    _kill_cluster(workers, killed=1)
    assert _epoch_in(worker_1_folder / "training_metadata.json") == 2
    assert any(".partial" in name for name in os.listdir(worker_1_folder))

    # Both resume epoch 2's backup (worker 0 its previous one) and end as if
    # never interrupted, bit for bit.
    workers = _start_cluster(tmp_path, "resumed", backups)
    _wait_for_cluster(workers)
    for _, _, dump, _ in workers:
        assert int(np.load(dump / "restored.npz")["initial_epoch"]) == 2
        _assert_same_state(uninterrupted_cluster, dump / "final.npz")
    for backup in backups:
        assert not backup.exists()
