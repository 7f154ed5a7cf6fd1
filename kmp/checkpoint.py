"""Crash-safe checkpoints: a save cut short never replaces a good one.

Keras' `BackupAndRestore` and `ModelCheckpoint` write their files in place.
A process killed while saving (SIGKILL, OOM killer, preemption) leaves a
truncated file under the good file's name. Depending on how much HDF5 had
flushed, the next run of Keras' `BackupAndRestore` either cannot open it (an
`OSError`, with a fallback only under `double_checkpoint=True`) or resumes
from it *silently*: the layer weights written before the kill load, the
optimizer group is missing so Keras only warns and keeps a fresh optimizer
(iterations, slots, loss scale and skip counters back to their initial
values), and the epoch comes from the previous, still intact metadata file.
Training goes on from a state that never existed.

The classes here write every file under a temporary name in the same
directory, flush it to disk, then `os.replace` it onto its final name, which
is atomic on POSIX and Windows. A file with a final name is always complete;
a kill leaves at most a `*.partial*` file, which is ignored.

`BackupAndRestore` also commits the weights and the epoch together: the
weights go to a new file, and the metadata, which names that file, is
replaced after it. A kill between the two leaves the metadata pointing at
the previous complete backup.

```
save (when the epoch after the backed-up one begins):
         write weights -> <dir>/.backup-<n>.partial-<pid>.weights.h5, fsync
         os.replace(partial, <dir>/backup-<n>.weights.h5)
         write {"epoch", "batch", "weights": "backup-<n>.weights.h5"}
             -> training_metadata.json (same way: partial, fsync, replace)
         delete older backup-*.weights.h5
restore: read training_metadata.json -> load the file it names, strictly:
         any variable Keras would skip (a mismatch) is an error, not a warning
```
"""

import glob
import hashlib
import json
import numbers
import os
import re
import warnings

import keras

from kmp import _keras_internals

_BACKUP_PATTERN = re.compile(r"^backup-(\d+)\.weights\.h5$")
_PARTIAL_MARK = ".partial"


def _split_suffix(filepath):
    """`("dir/name", ".weights.h5")` for Keras' two-part suffix, else splitext."""
    for suffix in (".weights.h5", ".weights.json"):
        if filepath.endswith(suffix):
            return filepath[: -len(suffix)], suffix
    return os.path.splitext(filepath)


def _fsync_path(path, directory=False):
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # Directories cannot be opened on Windows; replace is still atomic.
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(filepath, write):
    """Calls `write(temporary_path)`, then moves the result onto `filepath`.

    The temporary file sits in `filepath`'s directory with the same suffix
    (so Keras accepts it) and a `.partial` mark; it is flushed to disk
    before `os.replace`, so `filepath` is either the previous complete file
    or the new complete one, never a mix, whenever the process dies.

    Args:
        filepath: String or `pathlib.Path`. The final path.
        write: Callable taking the temporary path (a string) and writing
            the whole file there, e.g. `lambda path: model.save(path)`.

    Returns:
        `filepath` as a string.

    Example:

    ```python
    kmp.checkpoint.write_atomically("run.keras", model.save)
    ```
    """
    filepath = str(filepath)
    if _keras_internals.is_remote_path(filepath):
        # Object stores publish an object only once it is fully uploaded.
        write(filepath)
        return filepath
    stem, suffix = _split_suffix(filepath)
    directory, name = os.path.split(stem)
    partial = os.path.join(directory, f".{name}{_PARTIAL_MARK}-{os.getpid()}{suffix}")
    try:
        write(partial)
        _fsync_path(partial)
        os.replace(partial, filepath)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    _fsync_path(directory or ".", directory=True)
    return filepath


def _sha256(filepath):
    digest = hashlib.sha256()
    with open(filepath, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_sha256(filepath, expected):
    """Raises `ValueError` naming `filepath` when its SHA-256 is not `expected`."""
    if expected is None or not os.path.exists(filepath):
        return
    actual = _sha256(filepath)
    if actual != expected:
        raise ValueError(
            f"The backup {filepath!r} is damaged: its SHA-256 is {actual}, but "
            f"the backup metadata recorded {expected} when it was written. "
            "Refusing to resume from it. Delete the backup directory to start "
            "over, or restore the file from a copy."
        )


def _load_weights_strictly(model, filepath):
    """`model.load_weights`, with Keras' "skipping variable loading" warning
    turned into an error: a file that lacks the optimizer state (or has the
    wrong one) must not resume training from a fresh optimizer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(filepath)
    for warning in caught:
        message = str(warning.message).strip()
        if "Skipping variable loading" in message or "could not be loaded" in message:
            raise ValueError(
                f"The backup {filepath!r} does not match the model: {message} "
                "Refusing to resume from a partial state. Delete the backup "
                "directory to start over."
            )
        warnings.warn_explicit(
            warning.message, warning.category, warning.filename, warning.lineno
        )


_MONITOR_ATTRIBUTES = ("best", "wait", "best_epoch", "stopped_epoch", "cooldown_counter")


def _monitor_state(monitor):
    """The JSON-able counters of a monitoring callback (`None` stays `None`)."""
    state = {}
    for name in _MONITOR_ATTRIBUTES:
        if not hasattr(monitor, name):
            continue
        value = getattr(monitor, name)
        if value is None:
            state[name] = None
        elif isinstance(value, numbers.Integral):
            state[name] = int(value)
        else:
            # numpy and tensor scalars; json writes inf as Infinity.
            state[name] = float(value)
    return state


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` whose backups survive a kill mid-save.

    Same arguments and behaviour as Keras' callback: it saves the weights,
    the optimizer state (including a `kmp.LossScaleOptimizer`'s scale and
    counters) and the epoch reached, and `fit()` resumes from them. The
    difference is how it writes: each backup goes to a new file that is
    completed, flushed and atomically renamed before the metadata naming it
    is atomically replaced, so a process killed at any moment leaves the
    last complete backup in charge (see the module docstring for the
    order). Restoring is strict: a backup that does not hold every variable
    of the model and optimizer raises instead of resuming from a fresh
    optimizer.

    An epoch's backup is written when the next epoch begins (or when
    training ends, if the backup is kept), after every callback has handled
    the epoch's end: a learning rate that `ReduceLROnPlateau` lowered, and
    the counters of the callbacks passed as `monitors`, are part of it
    wherever this callback sits in the list.

    With deterministic ops (`tf.config.experimental.enable_op_determinism`,
    `keras.utils.set_random_seed`) and `shuffle=False` or a seeded input
    pipeline, a run killed mid-epoch and resumed with `save_freq="epoch"`
    ends bit-identical to an uninterrupted run. With an integer `save_freq`
    Keras resumes at the start of the saved epoch, so the batches already
    seen in that epoch are trained again.

    Args:
        backup_dir: String. Where the backups go; use one directory per run.
        save_freq: `"epoch"` or integer. As for Keras' callback. Defaults
            to `"epoch"`.
        double_checkpoint: Bool. Keep the previous complete backup too, and
            fall back to it if the latest cannot be read (a disk error).
            Defaults to `False`.
        delete_checkpoint: Bool. Delete `backup_dir` when training ends.
            Defaults to `True`.
        monitors: Optional list of callbacks that keep a monitor's state,
            e.g. `EarlyStopping`, `ReduceLROnPlateau`,
            `ModelCheckpoint(save_best_only=True)`. Their `best`, `wait`,
            `best_epoch`, `stopped_epoch` and `cooldown_counter` are backed up
            and restored, so patience does not start over after a crash
            (`EarlyStopping`'s `best_weights` are not). Defaults to `None`.

    Raises:
        TypeError: if `monitors` holds something that is not a callback.
        ValueError: as Keras' callback for invalid arguments; on restore,
            if the backup does not match the model or the monitors.

    Example:

    ```python
    backup = kmp.callbacks.BackupAndRestore("/tmp/run-42/backup")
    model.fit(x, y, epochs=10, callbacks=[backup])  # rerun after a crash
    ```
    """

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
        monitors=None,
    ):
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        monitors = list(monitors or [])
        for monitor in monitors:
            if not isinstance(monitor, keras.callbacks.Callback):
                raise TypeError(
                    "`monitors` must be a list of Keras callbacks (e.g. "
                    "EarlyStopping). Received an element "
                    f"{monitor!r} of type {type(monitor).__name__}"
                )
        self.monitors = monitors
        self._pending_monitor_states = None
        self._epoch_backup_pending = False

    def _backup_files(self):
        files = []
        for path in glob.glob(os.path.join(glob.escape(self.backup_dir), "backup-*")):
            match = _BACKUP_PATTERN.match(os.path.basename(path))
            if match:
                files.append((int(match.group(1)), path))
        return [path for _, path in sorted(files)]

    def _read_metadata(self):
        if not os.path.exists(self._training_metadata_path):
            return None
        with open(self._training_metadata_path) as f:
            text = f.read()
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(
                f"The backup metadata {self._training_metadata_path!r} is not "
                f"valid JSON (received {text[:80]!r}); it was not written by "
                "kmp.callbacks.BackupAndRestore, which replaces it atomically. Delete "
                "the backup directory to start over."
            ) from None

    def _load_model(self):
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be "
                "built before you call `fit()`. Build it by calling it on a "
                f"batch of data. Received: unbuilt model {self.model.name!r}"
            )
        metadata = self._read_metadata()
        if metadata is None:
            return
        candidates = [metadata]
        if metadata.get("previous"):
            candidates.append(metadata["previous"])
        errors = []
        for candidate in candidates:
            weights_path = os.path.join(
                self.backup_dir, candidate.get("weights", "latest.weights.h5")
            )
            if self.model.optimizer is not None and not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)
            try:
                # HDF5 keeps no checksum of the data: a flipped bit would
                # restore silently. Backups from before checksums have none.
                _check_sha256(weights_path, candidate.get("sha256"))
                _load_weights_strictly(self.model, weights_path)
            except (OSError, ValueError) as error:
                errors.append(f"{weights_path}: {error}")
                continue
            if errors:
                warnings.warn(
                    "BackupAndRestore resumed from the previous backup "
                    f"{weights_path!r} (epoch {candidate['epoch']}): the latest "
                    f"could not be restored. {'; '.join(errors)}"
                )
            self.model._initial_epoch = candidate["epoch"]
            self._pending_monitor_states = candidate.get("monitors")
            return
        raise ValueError(
            "No complete backup could be restored from "
            f"{self.backup_dir!r}. Tried: " + "; ".join(errors)
        )

    def on_train_begin(self, logs=None):
        # Keras' version falls back on OSError only; `_load_model` already
        # tries every complete backup and says why each one failed.
        self._load_model()

    def on_epoch_end(self, epoch, logs=None):
        self._current_epoch = epoch + 1
        self._last_batch_seen = 0
        # Written at the next epoch's start (or at the end of training), once
        # every callback has handled this epoch's end: callbacks listed after
        # this one (EarlyStopping, ReduceLROnPlateau changing the learning
        # rate) are then part of the backup, whatever the order of the list.
        self._epoch_backup_pending = self.save_freq == "epoch"

    def on_epoch_begin(self, epoch, logs=None):
        if self._epoch_backup_pending:
            self._epoch_backup_pending = False
            self._save_model()
        self._restore_monitors()

    def on_train_end(self, logs=None):
        if self._epoch_backup_pending and not self.delete_checkpoint:
            self._epoch_backup_pending = False
            self._save_model()
        super().on_train_end(logs)

    def _restore_monitors(self):
        # Not in on_train_begin: each monitor resets its own state there,
        # after this callback has run.
        states, self._pending_monitor_states = self._pending_monitor_states, None
        if states is None:
            return
        if len(states) != len(self.monitors):
            raise ValueError(
                f"The backup in {self.backup_dir!r} holds the state of "
                f"{len(states)} monitors, but `monitors` has "
                f"{len(self.monitors)}. Pass the same callbacks as the run "
                "that wrote it."
            )
        for monitor, state in zip(self.monitors, states):
            for name, value in state.items():
                setattr(monitor, name, value)

    def _save_model(self):
        os.makedirs(self.backup_dir, exist_ok=True)
        existing = self._backup_files()
        if existing:
            last = _BACKUP_PATTERN.match(os.path.basename(existing[-1])).group(1)
            index = int(last) + 1
        else:
            index = 0
        weights_name = f"backup-{index:06d}.weights.h5"
        write_atomically(
            os.path.join(self.backup_dir, weights_name),
            lambda path: self.model.save_weights(path, overwrite=True),
        )
        metadata = {
            "epoch": self._current_epoch,
            "batch": self._last_batch_seen,
            "weights": weights_name,
            "sha256": _sha256(os.path.join(self.backup_dir, weights_name)),
            "monitors": [_monitor_state(monitor) for monitor in self.monitors],
        }
        previous = self._read_metadata() if self.double_checkpoint else None
        if previous and "weights" in previous:
            previous.pop("previous", None)
            metadata["previous"] = previous

        def write_metadata(path):
            with open(path, "w") as f:
                f.write(json.dumps(metadata))

        write_atomically(self._training_metadata_path, write_metadata)
        keep = {weights_name}
        if "previous" in metadata:
            keep.add(metadata["previous"]["weights"])
        for path in self._backup_files():
            if os.path.basename(path) not in keep:
                os.remove(path)
        for path in glob.glob(
            os.path.join(glob.escape(self.backup_dir), f".*{_PARTIAL_MARK}-*")
        ):
            # Left by a process killed while saving.
            os.remove(path)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` that never leaves a half-written file.

    Same arguments and behaviour as Keras' callback, but each file is written
    under a temporary name, flushed and atomically renamed (see
    `write_atomically`): with a fixed `filepath` (e.g. `save_best_only=True`)
    a process killed while saving keeps the previous complete checkpoint. A
    full-model checkpoint (`save_weights_only=False`) holds the optimizer
    with a `kmp.LossScaleOptimizer`'s scale and counters, so
    `kmp.load_model(path)` continues training with the same loss scale.

    Args:
        filepath: String. As for Keras' callback.
        **kwargs: The other arguments of `keras.callbacks.ModelCheckpoint`.

    Example:

    ```python
    checkpoint = kmp.callbacks.ModelCheckpoint("best.keras", save_best_only=True)
    model.fit(x, y, validation_split=0.2, epochs=10, callbacks=[checkpoint])
    model = kmp.load_model("best.keras")
    ```
    """

    def _save_model(self, epoch, batch, logs):
        filepath = self._get_file_path(epoch, batch, logs)
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        dirname = os.path.dirname(filepath)
        if dirname:
            os.makedirs(dirname, exist_ok=True)
        if self.save_weights_only:
            write = lambda path: self.model.save_weights(path, overwrite=True)  # noqa: E731
        else:
            write = lambda path: self.model.save(path, overwrite=True)  # noqa: E731
        write_atomically(filepath, write)
        if self.verbose > 0:
            _keras_internals.print_msg(
                f"\nEpoch {epoch + 1}: finished saving model to {filepath}"
            )
