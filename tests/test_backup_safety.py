"""`BackupAndRestore` with a backup folder someone else can write to, or that a
user mistakes for another folder: it reads and deletes only what it wrote,
writes through no planted link, and refuses a second run.

Each test plays one attack or mistake: a metadata entry naming a file elsewhere,
links planted at temporary names, metadata setting attributes of a monitor, a
folder holding the user's own files, two runs on one folder, malformed
metadata, a callback reused after an interrupted fit, a directory given as a
checkpoint path.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types

import keras
import numpy as np
import pytest

import kmp
from _helpers import child_env
from kmp import checkpoint as checkpoint_module
from kmp.backup import _atomic_files

STEPS_PER_EPOCH = 3


def _model(units=1):
    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(units)(keras.layers.Dense(3)(inputs)))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data(units=1):
    rng = np.random.default_rng(0)
    rows = 8 * STEPS_PER_EPOCH
    return (
        rng.normal(size=(rows, 4)).astype("float32"),
        rng.normal(size=(rows, units)).astype("float32"),
    )


class _EpochsBegun(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begun = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)


def _fit(backup_dir, epochs, *, model=None, callbacks=(), **backup_args):
    """Fits a fresh model; returns `(model, epochs begun)`; `fit`'s error
    propagates (the model is then `_fit.last_model`)."""
    model = model or _model()
    x, y = _data()
    probe = _EpochsBegun()
    _fit.last_model, _fit.last_probe = model, probe
    backup = kmp.callbacks.BackupAndRestore(str(backup_dir), **backup_args)
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[backup, *callbacks, probe])
    return model, probe.begun


def _kept_backup(backup_dir, epochs=2):
    """A folder holding kmp's backup of `epochs` epochs; returns its metadata."""
    _fit(backup_dir, epochs, delete_checkpoint=False)
    return json.loads((backup_dir / "training_metadata.json").read_text())


@pytest.fixture(scope="module")
def kept_backup(tmp_path_factory):
    """`copy(backup_dir)`: puts a copy of one kept 2-epoch backup (trained
    once for the file) at `backup_dir`; returns its metadata. For the tests
    that tamper with a backup's folder before a run reads it: each gets its
    own copy, and kmp's metadata names its files relative to the folder."""
    keras.utils.set_random_seed(0)  # as before each test: module fixtures come first
    original = tmp_path_factory.mktemp("kept") / "backup"
    _kept_backup(original)

    def copy(backup_dir):
        shutil.copytree(original, backup_dir, symlinks=True)
        return json.loads((backup_dir / "training_metadata.json").read_text())

    return copy


def _snapshot(folder):
    """`{relative path: bytes}` of every file under `folder` (links as links)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            files[relative] = (
                "-> " + os.readlink(path) if os.path.islink(path)
                else open(path, "rb").read()
            )
    return files


def _weights(model):
    return [v.numpy().copy() for v in model.weights + model.optimizer.variables]


# -- 1. Paths come from kmp's naming scheme, inside the folder ---------------


@pytest.mark.parametrize("entry", ["outside", "absolute", "symlink", "pattern", "dotdot-pattern",
                                   "unpadded", "too long"])
def test_a_metadata_entry_naming_another_file_is_refused_before_loading(tmp_path, entry, kept_backup):
    backup_dir = tmp_path / "backup"
    metadata = kept_backup(backup_dir)
    # A valid weights file of the same model elsewhere, with its checksum:
    # restoring it would "work", which is the attack.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = elsewhere / "planted.weights.h5"
    shutil.copy(backup_dir / metadata["weights"], planted)
    names = {
        "outside": "../elsewhere/planted.weights.h5",
        "absolute": str(planted),
        "symlink": "backup-000007.weights.h5",
        "pattern": "planted.weights.h5",
        "dotdot-pattern": "backup-000001.weights.h5/../../elsewhere/planted.weights.h5",
        # The user's files: kmp writes six digits, or more without a leading zero.
        "unpadded": "backup-1.weights.h5",
        "too long": f"backup-{'9' * 19}.weights.h5",
    }
    if entry == "symlink":
        os.symlink(planted, backup_dir / names["symlink"])
    if entry in ("pattern", "unpadded", "too long"):
        shutil.copy(planted, backup_dir / names[entry])
    metadata["weights"] = names[entry]
    metadata_path = backup_dir / "training_metadata.json"
    metadata_path.write_text(json.dumps(metadata))
    before = _snapshot(tmp_path)

    fresh = _model()
    untouched = _weights(fresh)
    with pytest.raises(ValueError) as info:
        _fit(backup_dir, 3, model=fresh)
    message = str(info.value)
    assert str(metadata_path) in message and repr(names[entry]) in message, message
    assert _fit.last_probe.begun == []
    for value, original in zip(_weights(fresh), untouched):
        np.testing.assert_array_equal(value, original)  # nothing was loaded
    assert _snapshot(tmp_path) == before  # and nothing deleted or written


@pytest.mark.parametrize("entry", ["outside", "symlink", "metadata symlink"])
def test_no_error_prints_the_digest_of_a_file_kmp_did_not_write(tmp_path, entry, kept_backup):
    backup_dir = tmp_path / "backup"
    metadata = kept_backup(backup_dir)
    secret = tmp_path / "secret.weights.h5"
    secret.write_bytes(b"not for the backup's eyes")
    if entry == "metadata symlink":
        # Nor a line of it, as "not valid JSON (received ...)" would.
        os.remove(backup_dir / "training_metadata.json")
        os.symlink(secret, backup_dir / "training_metadata.json")
        with pytest.raises(ValueError, match="training_metadata.json' is a symbolic link") as info:
            _fit(backup_dir, 3)
        assert "eyes" not in str(info.value)
        return
    if entry == "symlink":
        os.symlink(secret, backup_dir / "backup-000009.weights.h5")
        metadata["weights"] = "backup-000009.weights.h5"
    else:
        metadata["weights"] = "../secret.weights.h5"
    metadata["sha256"] = "0" * 64  # wrong, so that a digest would be compared
    (backup_dir / "training_metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(ValueError) as info:
        _fit(backup_dir, 3)
    assert hashlib.sha256(secret.read_bytes()).hexdigest() not in str(info.value)
    assert "metadata" in str(info.value)


# -- 2. Temporary files: exclusive, never through a link -----------------------


def test_links_planted_at_temporary_names_are_never_written_through(tmp_path, monkeypatch):
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    pid = os.getpid()
    fixed_token = "0" * 16
    planted = [
        # The names kmp used before, predictable from the pid...
        f".training_metadata.partial-{pid}.json",
        *(f".backup-{n:06d}.partial-{pid}.weights.h5" for n in range(4)),
        f".best.partial-{pid}.keras",
        # ...and the names it uses now, with the token it is made to draw first.
        f".training_metadata.partial-{pid}-{fixed_token}.json",
        *(f".backup-{n:06d}.partial-{pid}-{fixed_token}.weights.h5" for n in range(4)),
        f".best.partial-{pid}-{fixed_token}.keras",
    ]
    for name in planted:
        folder = tmp_path if "best" in name else backup_dir
        os.symlink(target, folder / name)
    draws = []

    def token_hex(nbytes):
        draws.append(nbytes)
        # Every other draw is the planted token: each write meets a link first.
        return fixed_token if len(draws) % 2 else os.urandom(nbytes).hex()

    # kmp's draws only (Keras draws tokens of its own while saving).
    monkeypatch.setattr(
        _atomic_files, "secrets", types.SimpleNamespace(token_hex=token_hex), raising=False
    )
    checkpoint = kmp.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"))
    model, _ = _fit(backup_dir, 3, delete_checkpoint=False, callbacks=[checkpoint])

    assert target.read_text() == "precious"
    # 9 writes (weights, metadata, checkpoint per epoch); those that met a
    # link drew again. (The first backup's pruning deletes the links planted
    # at kmp's partial names in the backup folder: links, not their target.)
    assert len(draws) > 9
    metadata = json.loads((backup_dir / "training_metadata.json").read_text())
    assert metadata["epoch"] == 3
    assert kmp.load_model(tmp_path / "best.keras").built
    # The backup restores: what was written is complete.
    resumed, begun = _fit(backup_dir, 4, delete_checkpoint=False)
    assert begun == [3]


# -- 3. Monitor state: kmp's counters only, as numbers ------------------------


@pytest.mark.parametrize(
    "state",
    [
        {"filepath": "ELSEWHERE/x.keras"},
        {"wait": "3"},
        {"wait": -1},
        {"wait": True},
        {"best": "low"},
        {"best": float("nan")},
        {"best": 10**400},  # an integer no float holds: EarlyStopping would raise mid-fit
        {"cooldown_counter": 2},  # a counter ModelCheckpoint does not have
    ],
)
def test_restored_monitor_state_sets_only_kmps_counters_as_numbers(tmp_path, state):
    backup_dir = tmp_path / "backup"
    checkpoint = kmp.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="loss", save_best_only=True
    )
    _fit(backup_dir, 2, delete_checkpoint=False, monitors=[checkpoint],
         callbacks=[checkpoint])
    metadata_path = backup_dir / "training_metadata.json"
    metadata = json.loads(metadata_path.read_text())
    assert set(metadata["monitors"][0]) == {"best"}
    state = {
        key: str(tmp_path / "elsewhere" / "x.keras") if value == "ELSEWHERE/x.keras" else value
        for key, value in state.items()
    }
    metadata["monitors"] = [state]
    metadata_path.write_text(json.dumps(metadata))

    fresh = kmp.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="loss", save_best_only=True
    )
    with pytest.raises(ValueError, match=r"monitor") as info:
        _fit(backup_dir, 4, delete_checkpoint=False, monitors=[fresh], callbacks=[fresh])
    key = next(iter(state))
    assert key in str(info.value)
    assert fresh.filepath == str(tmp_path / "best.keras")
    assert not hasattr(fresh, "cooldown_counter")
    assert not (tmp_path / "elsewhere").exists()
    assert int(_fit.last_model.optimizer.iterations) == 0  # nothing restored or trained
    assert not (backup_dir / "kmp-backup.lock").exists()


def test_a_best_epoch_for_a_monitor_without_one_is_refused_before_a_step(tmp_path):
    # EarlyStopping makes `best_epoch` in its own on_train_begin, after the
    # backup is loaded: that counter is checked at the first epoch's start.
    backup_dir = tmp_path / "backup"
    checkpoint = kmp.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="loss", save_best_only=True)
    _fit(backup_dir, 2, delete_checkpoint=False, monitors=[checkpoint], callbacks=[checkpoint])
    metadata = json.loads((backup_dir / "training_metadata.json").read_text())
    metadata["monitors"] = [{"best": 1.0, "best_epoch": 1}]
    (backup_dir / "training_metadata.json").write_text(json.dumps(metadata))
    fresh = kmp.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="loss", save_best_only=True)
    with pytest.raises(ValueError, match="holds best_epoch for the monitor ModelCheckpoint"):
        _fit(backup_dir, 4, delete_checkpoint=False, monitors=[fresh], callbacks=[fresh])
    assert _fit.last_probe.begun == []
    assert int(_fit.last_model.optimizer.iterations) == 2 * STEPS_PER_EPOCH  # restored, not trained
    assert fresh.best != 1.0  # the backup's counters were not set
    assert not (backup_dir / "kmp-backup.lock").exists()  # released without on_train_end


@pytest.mark.parametrize("monitors, message", [
    (0, r"holds the state of 1 monitors, but `monitors` has 0"),
    (2, r"holds the state of 1 monitors, but `monitors` has 2"),
])
def test_a_backup_of_other_monitors_is_refused_before_anything_is_loaded(
        tmp_path, monitors, message):
    backup_dir = tmp_path / "backup"
    stopping = keras.callbacks.EarlyStopping(monitor="loss", patience=100)
    _fit(backup_dir, 2, delete_checkpoint=False, double_checkpoint=True,
         monitors=[stopping], callbacks=[stopping])
    before = _snapshot(backup_dir)
    fresh = _model()
    untouched = fresh.get_weights()
    resumed = [keras.callbacks.EarlyStopping(monitor="loss", patience=100)
               for _ in range(monitors)]
    with pytest.raises(ValueError, match=message):  # once: the previous backup is not tried
        _fit(backup_dir, 4, model=fresh, delete_checkpoint=False, double_checkpoint=True,
             monitors=resumed, callbacks=resumed)
    assert _fit.last_probe.begun == []
    for value, original in zip(fresh.get_weights(), untouched, strict=True):
        np.testing.assert_array_equal(value, original)  # nothing was loaded
    assert int(fresh.optimizer.iterations) == 0
    assert _snapshot(backup_dir) == before  # the lock released, nothing written
    # The model starts from epoch 0 in a fit without the backup.
    history = fresh.fit(*_data(), batch_size=8, epochs=2, verbose=0)
    assert history.epoch == [0, 1]


def test_valid_monitor_counters_are_restored_as_numbers(tmp_path):
    backup_dir = tmp_path / "backup"
    stopping = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=100)
    _fit(backup_dir, 3, delete_checkpoint=False, monitors=[stopping], callbacks=[stopping])
    resumed = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=100)
    _fit(backup_dir, 4, delete_checkpoint=False, monitors=[resumed], callbacks=[resumed])
    assert (resumed.wait, resumed.best_epoch) == (3, 0)
    assert isinstance(resumed.wait, int) and isinstance(resumed.best, float)


# -- 4. End of training deletes what kmp wrote, nothing else ------------------


# What a user keeps in a folder kmp backs up to (and `data/train.csv`): some
# names look like kmp's, which writes its backups `backup-%06d.weights.h5`.
_USERS_NAMES = [
    ".draft.partial-1.txt",  # looks temporary, is not kmp's
    "notes.txt",
    "backup-1.weights.h5",
    "backup-0000000000000000000000001.weights.h5",
    ".backup-7.partial-1.weights.h5",
    ".backup-1.partial-9-0123456789abcdef.weights.h5",
    ".training_metadata.partial-5.weights.h5",
]


def _users_files(folder):
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.csv").write_text("x,y\n1,2\n")
    for name in _USERS_NAMES:
        (folder / name).write_text(f"the user's {name}")


def _kept_users_files(folder, *also):
    assert sorted(os.listdir(folder)) == sorted([*_USERS_NAMES, "data", *also])
    assert (folder / "data" / "train.csv").read_text() == "x,y\n1,2\n"
    for name in _USERS_NAMES:
        assert (folder / name).read_text() == f"the user's {name}"


def test_end_of_training_deletes_only_kmps_files(tmp_path):
    run = tmp_path / "run"
    _users_files(run)
    checkpoint = kmp.callbacks.ModelCheckpoint(str(run / "best.keras"))
    _fit(run, 3, callbacks=[checkpoint])  # delete_checkpoint=True
    _kept_users_files(run, "best.keras")

    # Each backup prunes the ones before it, by the same names.
    kept = tmp_path / "kept"
    _users_files(kept)
    _fit(kept, 3, delete_checkpoint=False)
    _kept_users_files(kept, "backup-000002.weights.h5", "training_metadata.json")

    # A folder holding only kmp's files goes, as Keras' does.
    _fit(tmp_path / "own", 2)
    assert not (tmp_path / "own").exists()


def test_a_backup_dir_of_dot_never_deletes_the_working_directory(tmp_path, monkeypatch):
    for files in (True, False):
        work = tmp_path / f"work-{files}"
        work.mkdir()
        if files:
            _users_files(work)
        monkeypatch.chdir(work)
        _fit(".", 2)
        assert work.is_dir() and os.path.samefile(os.getcwd(), work)
        if files:
            _kept_users_files(work)
        else:
            assert os.listdir(work) == []


class _FakeCluster:
    """This process is `task` of a two-worker cluster; the other worker's
    all-gathered values are `other` (one per gather, repeated)."""

    def __init__(self, monkeypatch, task, is_chief, other):
        monkeypatch.setattr(checkpoint_module, "_this_worker", lambda strategy: (task, is_chief))
        self.task, self.other = task, other
        monkeypatch.setattr(checkpoint_module, "_gather_from_workers", self.gather)

    def gather(self, strategy, task, value):
        return {self.task: int(value), **self.other(value)}


def test_the_multi_worker_chief_deletes_only_its_own_files(tmp_path, monkeypatch):
    backup_dir = tmp_path / "backup"
    _users_files(backup_dir)
    (backup_dir / "worker-1").mkdir()
    (backup_dir / "worker-1" / "training_metadata.json").write_text("{}")
    _FakeCluster(monkeypatch, "worker-0", True, lambda value: {"worker-1": int(value)})
    _fit(backup_dir, 2)
    _kept_users_files(backup_dir, "worker-1")
    assert (backup_dir / "worker-1" / "training_metadata.json").read_text() == "{}"


# -- 5. A second run on a folder in use is refused ----------------------------

_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import keras
    import kmp

    backup_dir, marker = sys.argv[1], sys.argv[2]

    class PauseInSecondEpoch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.params and os.path.exists(
                    os.path.join(backup_dir, "training_metadata.json")):
                open(marker, "w").write("paused")
                time.sleep(600)

    inputs = keras.Input((4,))
    model = kmp.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(3)(inputs)))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 4)), rng.normal(size=(24, 1))
    model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[
        kmp.callbacks.BackupAndRestore(backup_dir), PauseInSecondEpoch()])
    """
)


def _start_holder(tmp_path, backup_dir):
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    marker = tmp_path / "paused"
    process = subprocess.Popen(
        [sys.executable, str(script), str(backup_dir), str(marker)],
        env=child_env(gpu=False), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not marker.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail("The holder never paused:\n" + process.communicate()[1][-3000:])
        time.sleep(0.05)
    return process


def test_a_second_run_on_a_folder_in_use_is_refused_and_a_killed_one_resumes(tmp_path):
    backup_dir = tmp_path / "backup"
    holder = _start_holder(tmp_path, backup_dir)
    try:
        before = _snapshot(backup_dir)
        assert json.loads((backup_dir / "training_metadata.json").read_text())["epoch"] == 1
        with pytest.raises(RuntimeError) as info:
            _fit(backup_dir, 4)
        message = str(info.value)
        assert repr(str(backup_dir)) in message
        assert f"process {holder.pid} on " in message and "started 20" in message
        assert _fit.last_probe.begun == []  # nothing trained
        assert int(_fit.last_model.optimizer.iterations) == 0  # nothing restored
        assert _snapshot(backup_dir) == before  # nothing written or deleted
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        holder.stderr.close()
    # The OS released the dead holder's lock: the same command resumes.
    model, begun = _fit(backup_dir, 4)
    assert begun == [1, 2, 3]
    assert int(model.optimizer.iterations) == 4 * STEPS_PER_EPOCH
    assert not backup_dir.exists()


_LOCK_HOLDER = textwrap.dedent(
    """
    import fcntl, json, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": "h", "started": "s"}).encode())
    print("locked", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_each_worker_of_a_cluster_holds_its_own_entry(tmp_path, monkeypatch):
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    # Another process holds the chief's entry (the chief of a cluster still running).
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(backup_dir / "kmp-backup.lock")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        # Worker 1 has an entry of its own: not refused.
        _FakeCluster(monkeypatch, "worker-1", False, lambda value: {"worker-0": int(value)})
        _, begun = _fit(backup_dir, 2, delete_checkpoint=False)
        assert begun == [0, 1]
        assert (backup_dir / "worker-1" / "training_metadata.json").exists()
        assert not (backup_dir / "worker-1" / "kmp-backup.lock").exists()  # released
        # A second chief is refused.
        _FakeCluster(monkeypatch, "worker-0", True, lambda value: {"worker-1": int(value)})
        with pytest.raises(RuntimeError, match=f"process {holder.pid} on h, started s"):
            _fit(backup_dir, 2)
    finally:
        holder.kill()
        holder.wait(timeout=60)
        holder.stdout.close()


def test_a_backup_dir_that_is_not_a_folder_is_refused_naming_it(tmp_path):
    (tmp_path / "notes").write_text("the user's notes")
    with pytest.raises(TypeError, match=r"`backup_dir` must be a folder's path \(str or "
                       r"os.PathLike\). Received: backup_dir=123 of type int"):
        kmp.callbacks.BackupAndRestore(123)
    with pytest.raises(TypeError, match=r"Received: monitors='es' of type str"):
        kmp.callbacks.BackupAndRestore(str(tmp_path / "backup"), monitors="es")
    for backup_dir in (tmp_path / "notes", tmp_path / "notes" / "backup"):
        with pytest.raises(ValueError, match=(
                f"`backup_dir` must be a folder, or a path where one can be made, but "
                f"'{tmp_path / 'notes'}' is not a folder. Received: backup_dir='{backup_dir}'")):
            _fit(backup_dir, 1)
        assert _fit.last_probe.begun == []
    assert sorted(os.listdir(tmp_path)) == ["notes"]
    assert (tmp_path / "notes").read_text() == "the user's notes"


def test_the_lock_is_released_when_fit_ends_or_fails_at_the_start(tmp_path):
    backup_dir = tmp_path / "backup"
    _kept_backup(backup_dir)
    assert not (backup_dir / "kmp-backup.lock").exists()
    (backup_dir / "training_metadata.json").write_text("[]")
    with pytest.raises(ValueError):
        _fit(backup_dir, 3)
    assert not (backup_dir / "kmp-backup.lock").exists()
    # A planted link at the lock's name is not followed.
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    os.remove(backup_dir / "training_metadata.json")
    os.symlink(target, backup_dir / "kmp-backup.lock")
    with pytest.raises(ValueError, match="kmp-backup.lock"):
        _fit(backup_dir, 1)
    assert target.read_text() == "precious"


# -- 6. Malformed metadata: one ValueError naming file, key and value ---------


@pytest.mark.parametrize(
    "metadata, key, value",
    [
        ([], None, "[]"),
        ("a string", None, "'a string'"),
        ({"epoch": 1, "weights": 5}, "weights", "5"),
        ({"epoch": "1"}, "epoch", "'1'"),
        ({"batch": 0}, "epoch", "None"),
        ({"epoch": -3}, "epoch", "-3"),
        ({"epoch": True}, "epoch", "True"),
        ({"epoch": 1, "learning_rate": 0.1}, "learning_rate", "0.1"),
        ({"epoch": 1, "sha256": "abc"}, "sha256", "'abc'"),
        ({"epoch": 1, "previous": {"epoch": 0, "weights": "/etc/passwd"}},
         "previous.weights", "'/etc/passwd'"),
    ],
)
def test_malformed_metadata_is_one_value_error_naming_file_key_and_value(
    tmp_path, metadata, key, value, kept_backup
):
    backup_dir = tmp_path / "backup"
    original = kept_backup(backup_dir)
    if isinstance(metadata, dict):
        # Kept valid apart from the key under test.
        metadata = {**{k: original[k] for k in ("weights", "sha256") if k not in metadata
                       and "epoch" in metadata}, **metadata}
    metadata_path = backup_dir / "training_metadata.json"
    metadata_path.write_text(json.dumps(metadata))
    before = _snapshot(backup_dir)
    with pytest.raises(ValueError) as info:
        _fit(backup_dir, 4)
    message = str(info.value)
    assert repr(str(metadata_path)) in message, message
    if key is not None:
        assert f"Received: {key}={value}" in message, message
    else:
        assert f"Received: {value}" in message, message
    assert _fit.last_probe.begun == []  # nothing trained
    assert _snapshot(backup_dir) == before  # nothing deleted


def test_a_folder_keras_own_callback_wrote_is_refused_and_left_as_it_is(tmp_path):
    # Keras' BackupAndRestore writes {"epoch", "batch"} and latest.weights.h5:
    # a file kmp never writes, so never reads (it once loaded it, unchecked).
    backup_dir = tmp_path / "backup"
    x, y = _data()
    _model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False)])
    assert {"latest.weights.h5", "training_metadata.json"} <= set(os.listdir(backup_dir))
    before = _snapshot(backup_dir)
    with pytest.raises(ValueError, match=r"names no weights file \(`weights` is absent\)") as info:
        _fit(backup_dir, 4)
    assert repr(str(backup_dir / "training_metadata.json")) in str(info.value)
    assert "Keras' own BackupAndRestore" in str(info.value)
    assert _fit.last_probe.begun == []  # nothing trained
    assert int(_fit.last_model.optimizer.iterations) == 0  # nothing restored
    assert _snapshot(backup_dir) == before  # nothing deleted or written


def test_deeply_nested_metadata_is_a_value_error_naming_the_file(tmp_path):
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    metadata_path = backup_dir / "training_metadata.json"
    metadata_path.write_text("[" * 100_000 + "]" * 100_000)  # under the size limit
    with pytest.raises(ValueError, match="not valid JSON") as info:
        _fit(backup_dir, 2)
    assert repr(str(metadata_path)) in str(info.value)
    assert _fit.last_probe.begun == []


@pytest.fixture
def no_hang():
    """Fails a test whose call blocks (a FIFO opened for reading waits for a
    writer forever) instead of hanging the suite."""

    def hung(signum, frame):
        raise TimeoutError("blocked for 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
@pytest.mark.parametrize("name", ["training_metadata.json", "weights"])
def test_a_fifo_at_a_name_kmp_reads_is_refused_without_waiting(tmp_path, name, kept_backup, no_hang):
    backup_dir = tmp_path / "backup"
    metadata = kept_backup(backup_dir)
    name = metadata["weights"] if name == "weights" else name
    os.remove(backup_dir / name)
    os.mkfifo(backup_dir / name)
    with pytest.raises(ValueError, match="not a regular file") as info:
        _fit(backup_dir, 4)
    assert repr(str(backup_dir / name)) in str(info.value)
    assert _fit.last_probe.begun == []


def test_a_hard_link_at_the_lock_name_is_refused_and_its_file_kept(tmp_path):
    # A hard link is a regular file: kmp would write its pid into the other
    # name's file, outside the folder.
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's own data\n")
    try:
        os.link(precious, backup_dir / "kmp-backup.lock")
    except OSError as error:
        pytest.skip(f"this file system has no hard links ({error})")
    with pytest.raises(ValueError, match=r"not a regular file of its own \(it has 2 names"):
        _fit(backup_dir, 2)
    assert precious.read_text() == "the user's own data\n"
    assert _fit.last_probe.begun == []


def test_a_backup_of_another_architecture_names_the_file_and_the_variables(tmp_path):
    backup_dir = tmp_path / "backup"
    metadata = _kept_backup(backup_dir)
    before = _snapshot(backup_dir)
    wider = _model(units=2)
    with pytest.raises(ValueError) as info:
        _fit(backup_dir, 4, model=wider)
    message = str(info.value)
    assert repr(str(backup_dir / metadata["weights"])) in message, message
    # The second Dense: (3, 1) in the backup, (3, 2) in this model.
    assert "layers/dense_1/vars/0 (3, 1) vs (3, 2)" in message, message
    assert _fit.last_probe.begun == []
    assert _snapshot(backup_dir) == before


# -- 7. A callback reused after an interrupted or a completed fit ------------


class _RaiseAt(keras.callbacks.Callback):
    """Raises at the end of epoch `epoch_end`, or after batch `batch` of the
    first epoch this fit runs."""

    def __init__(self, epoch_end=None, batch=None):
        super().__init__()
        self.epoch_end, self.batch, self.first = epoch_end, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self.first = epoch if self.first is None else self.first
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch_end:
            raise RuntimeError(f"interrupted at the end of epoch {epoch}")

    def on_train_batch_end(self, batch, logs=None):
        if self.batch == batch and self.epoch == self.first:
            raise RuntimeError(f"interrupted after batch {batch}")


def _counter_run(backup_class, backup_dir, first_fit):
    """The optimizer's step counter after: `first_fit` (an interrupted or a
    complete fit of 5 epochs), a fit with the same callback instance
    interrupted after its second batch, then a resumed fit of 5 epochs with
    a new one. Every resume must end at 5 epochs' steps."""
    x, y = _data()
    backup = backup_class(str(backup_dir))
    model = _model()
    fit = lambda model, callbacks: model.fit(  # noqa: E731
        x, y, batch_size=8, epochs=5, shuffle=False, verbose=0, callbacks=callbacks)
    if first_fit == "interrupted":
        with pytest.raises(RuntimeError, match="end of epoch 1"):
            fit(model, [backup, _RaiseAt(epoch_end=1)])
    else:
        fit(model, [backup])
        model = _model()  # the next run of a loop that reuses the callback
    with pytest.raises(RuntimeError, match="after batch 1"):
        fit(model, [backup, _RaiseAt(batch=1)])
    resumed = _model()
    fit(resumed, [backup_class(str(backup_dir))])
    return int(resumed.optimizer.iterations)


# Keras' own callback is the control: in the slow tier (tests/conftest.py).
@pytest.mark.parametrize(("backup_class", "first_fit"), [
    pytest.param(keras.callbacks.BackupAndRestore, "interrupted", id="keras-interrupted",
                 marks=pytest.mark.slow),
    pytest.param(keras.callbacks.BackupAndRestore, "completed", id="keras-completed",
                 marks=pytest.mark.slow),
    pytest.param(kmp.callbacks.BackupAndRestore, "interrupted", id="kmp-interrupted"),
    pytest.param(kmp.callbacks.BackupAndRestore, "completed", id="kmp-completed"),
])
def test_a_reused_callback_writes_backups_whose_epoch_matches_their_weights(
    tmp_path, backup_class, first_fit
):
    assert _counter_run(backup_class, tmp_path / "backup", first_fit) == 5 * STEPS_PER_EPOCH


# -- 8. ModelCheckpoint onto a directory --------------------------------------


@pytest.mark.parametrize(
    "callback_class", [keras.callbacks.ModelCheckpoint, kmp.callbacks.ModelCheckpoint],
    ids=["keras", "kmp"],
)
def test_model_checkpoint_onto_an_existing_directory_says_so(tmp_path, callback_class):
    directory = tmp_path / "run.keras"
    directory.mkdir()
    model = _model()
    x, y = _data()
    with pytest.raises(OSError) as info:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[callback_class(str(directory))])
    assert not isinstance(info.value, IsADirectoryError)
    assert str(info.value) == (
        "Please specify a non-directory filepath for ModelCheckpoint. Filepath "
        f"used is an existing directory: {directory}"
    )
    assert os.listdir(tmp_path) == ["run.keras"] and os.listdir(directory) == []
