"""Crash-safe resume: SIGKILL mid-epoch and mid-save, checkpoints that reload."""

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


def test_sigkill_mid_save_then_mid_epoch_resumes_bit_identical(worker):
    backup = worker / "backup"
    reference, _, reference_dump = _start(worker, "reference", "--backup", str(worker / "ref"))
    # Run 1 dies inside the third backup (end of epoch 3), half-way through
    # writing it: layers written, optimizer not.
    first, marker, _ = _start(worker, "first", "--backup", str(backup), "--pause-in-save", "3")
    _kill_when_paused(first, marker)
    metadata = json.loads((backup / "training_metadata.json").read_text())
    assert metadata["epoch"] == 2
    assert (backup / metadata["weights"]).exists()
    assert any(".partial" in name for name in os.listdir(backup))
    _finish(reference)
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
def test_keras_backup_killed_mid_save_resumes_from_the_last_complete_backup(worker):
    """What kmp.callbacks.BackupAndRestore does (see the test above), asked of Keras' own."""
    backup = worker / "backup"
    reference, _, reference_dump = _start(worker, "reference", "--backup", str(worker / "ref"))
    first, marker, _ = _start(
        worker, "first", "--callback", "keras", "--backup", str(backup),
        "--pause-in-save", "3",
    )
    _kill_when_paused(first, marker)
    _finish(reference)
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
    uncompiled.save_weights(tmp_path / "backup" / "backup-000000.weights.h5")
    (tmp_path / "backup" / "training_metadata.json").write_text(
        json.dumps({"epoch": 1, "batch": 0, "weights": "backup-000000.weights.h5"})
    )
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
    resumed.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        kmp.callbacks.BackupAndRestore(str(backup_dir), double_checkpoint=True), probe])
    assert probe.seen == [3]  # the epoch-1 backup: 3 steps
    assert int(resumed.optimizer.iterations) == 6
