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
weights go to a new file, and the metadata, which names that file and its
SHA-256, is replaced after it. A kill between the two leaves the metadata
pointing at the previous complete backup. HDF5 keeps no checksum of the
data it stores, so a flipped bit in a weights file would otherwise load
silently; the recorded SHA-256 is checked before anything is loaded.

Each process writes and reads one folder of its own, F: `backup_dir` for a
single process and for the chief of a `MultiWorkerMirroredStrategy`
cluster, `backup_dir/<task type>-<task id>` (e.g. `worker-1`) for the other
workers. One `backup_dir` shared by all workers and one `backup_dir` per
worker therefore behave the same: no process writes, prunes or deletes a
file in another process's folder.

```
save (when the epoch after the backed-up one begins):
         write weights -> F/.backup-<n>.partial-<pid>.weights.h5, fsync,
             SHA-256 of it; n = the number the metadata names, plus one
         os.replace(partial, F/backup-<n>.weights.h5)
         write {"epoch", "batch", "weights": "backup-<n>.weights.h5",
                "sha256", "monitors", "previous" (optional: the entry before)}
             -> F/training_metadata.json (same way: partial, fsync, replace)
         delete F's backup-*.weights.h5 that the metadata does not name, and
         F's partial files (left by a killed process: F has one writer)
restore: read F/training_metadata.json
         several workers: all-gather each worker's latest backup number and
             restore number m = the lowest on every worker (the others keep
             the previous backup, so they have m too; see below)
         check the SHA-256 of the file, then load it strictly: any variable
             Keras would skip (a mismatch) is an error, not a warning
         several workers: all-gather whether each restore succeeded, so all
             raise or none does
```

Why the workers can differ by one backup at most, and no more: a worker
writes its backup of epoch k before its first step of epoch k + 1, and no
worker can finish that epoch's steps (collectives) and write backup k + 1
before every worker has started them. So when a worker was killed between
its own save and another worker's, the latest backups differ by one, and
every worker still holds the lower one.
"""

import glob
import hashlib
import json
import numbers
import os
import re
import shutil
import warnings

import keras
import tensorflow as tf

from kmp import _keras_internals
from kmp import distribute as _distribute

_BACKUP_PATTERN = re.compile(r"^backup-(\d+)\.weights\.h5$")
_PARTIAL_MARK = ".partial"
# The folders of the workers other than the chief, inside a shared backup_dir.
_WORKER_FOLDER_PATTERN = re.compile(r"^(chief|worker)-\d+$")
# What a worker whose metadata cannot be read reports as its latest backup.
_UNREADABLE = -2


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


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _backup_number(entry):
    """The `<n>` of the `backup-<n>.weights.h5` a metadata entry names; -1
    for no entry, 0 for Keras' own layout (`latest.weights.h5`)."""
    if not entry:
        return -1
    match = _BACKUP_PATTERN.match(entry.get("weights", ""))
    return int(match.group(1)) if match else 0


def _this_worker(strategy):
    """`(task name, is chief)` in a cluster of several workers, else `None`."""
    if not _distribute.is_multi_worker(strategy):
        return None
    resolver = strategy.cluster_resolver
    cluster = resolver.cluster_spec().as_dict()
    if sum(len(cluster.get(job, ())) for job in ("chief", "worker")) <= 1:
        return None
    return f"{resolver.task_type}-{resolver.task_id}", bool(
        strategy.extended.should_checkpoint
    )


def _gather_from_workers(strategy, task, value):
    """`{task name: value}` over the cluster's workers, `value` an int.

    An all-gather in eager mode; every worker must call it at the same point
    (collectives match by order), which `fit`'s callbacks guarantee.
    """
    task_type, task_id = task.rsplit("-", 1)
    local = tf.constant(
        [[0 if task_type == "chief" else 1, int(task_id), int(value)]], tf.int64
    )
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda _: local
    )
    rows = strategy.gather(per_replica, axis=0).numpy()
    # One row per replica: a worker with several devices appears several times.
    return {
        f"{'chief' if job == 0 else 'worker'}-{index}": int(value)
        for job, index, value in rows
    }


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

    The metadata records the SHA-256 of the weights file it names, and a
    restore checks it before loading anything: a file changed since it was
    written (a flipped bit, a bad copy) raises a `ValueError` naming the
    file, before any epoch is trained. Backups written by kmp before it
    recorded checksums restore without that check, with a warning.

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

    Under `tf.distribute.MultiWorkerMirroredStrategy` with several workers,
    give every worker the same `backup_dir`, either one folder on a file
    system they share (the layout of TensorFlow's multi-worker guide) or
    each its own: both work. The chief writes to `backup_dir`, every other
    worker to a folder of its own inside it, `backup_dir/worker-<index>`,
    so no process writes, prunes or deletes another's files. When a worker
    dies the others stop too (their collectives fail); rerun every worker
    with the same command. At restore the workers agree on one backup (a
    worker killed between its save and another's holds one backup less), so
    all resume from the same state. For that agreement each worker keeps its
    previous backup as well, as with `double_checkpoint=True`; a backup that
    cannot be restored on any worker is an error on every worker.

    Args:
        backup_dir: String. Where the backups go; use one directory per run
            (with several workers, see above). The folder is created when the
            first backup is written.
        save_freq: `"epoch"` or integer. As for Keras' callback. Defaults
            to `"epoch"`.
        double_checkpoint: Bool. Keep the previous complete backup too, and
            fall back to it, with a warning, if the latest cannot be restored
            (a disk error, a checksum that differs). Defaults to `False`.
        delete_checkpoint: Bool. Delete the backups when training ends (each
            worker its own; `backup_dir` goes once it is empty). Defaults to
            `True`.
        monitors: Optional list of callbacks that keep a monitor's state,
            e.g. `EarlyStopping`, `ReduceLROnPlateau`,
            `ModelCheckpoint(save_best_only=True)`. Their `best`, `wait`,
            `best_epoch`, `stopped_epoch` and `cooldown_counter` are backed up
            and restored, so patience does not start over after a crash
            (`EarlyStopping`'s `best_weights` are not). Defaults to `None`.

    Raises:
        TypeError: if `monitors` holds something that is not a callback.
        ValueError: as Keras' callback for invalid arguments; on restore, if
            the backup's checksum differs, if it does not match the model or
            the monitors, or if the workers' backups are not from one run.

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
        # This process's own folder, and its task in a multi-worker cluster
        # (`(name, is_chief)`, or `None`); set when training begins.
        self._folder = backup_dir
        self._worker = None

    def _use_folder_of_this_process(self):
        self._worker = _this_worker(self.model.distribute_strategy)
        if self._worker is None or self._worker[1]:
            self._folder = self.backup_dir
        else:
            self._folder = os.path.join(self.backup_dir, self._worker[0])
        self._training_metadata_path = os.path.join(
            self._folder, "training_metadata.json"
        )

    def _backup_files(self):
        files = []
        for path in glob.glob(os.path.join(glob.escape(self._folder), "backup-*")):
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

    def _write_metadata(self, metadata):
        def write(path):
            with open(path, "w") as f:
                f.write(json.dumps(metadata))

        write_atomically(self._training_metadata_path, write)

    def _load_model(self):
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be "
                "built before you call `fit()`. Build it by calling it on a "
                f"batch of data. Received: unbuilt model {self.model.name!r}"
            )
        self._use_folder_of_this_process()
        if self._worker is None:
            self._restore_newest(self._candidates())
        else:
            self._restore_agreed()

    def _candidates(self):
        """The backups the metadata names, latest first."""
        metadata = self._read_metadata()
        if metadata is None:
            return []
        return [metadata] + ([metadata["previous"]] if metadata.get("previous") else [])

    def _restore_newest(self, candidates):
        """Restores the first candidate that loads (one process)."""
        errors = []
        for candidate in candidates:
            try:
                self._restore(candidate)
            except (OSError, ValueError) as error:
                errors.append(error)
                continue
            if errors:
                warnings.warn(
                    f"Resuming from the previous backup in {self._folder!r} "
                    f"(epoch {candidate['epoch']}): the latest could not be "
                    f"restored. {errors[0]}",
                    stacklevel=2,
                )
                self._commit_restored(candidate)
            return
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ValueError(
                f"No complete backup could be restored from {self._folder!r}. "
                "Tried: " + " ".join(str(error) for error in errors)
            )

    def _restore_agreed(self):
        """Restores the same backup on every worker: the lowest latest one.

        Two all-gathers, at the same point on every worker: the latest
        backup numbers, then whether each restore succeeded, so that a
        worker that cannot restore stops every worker, not only itself
        (rather than leaving them waiting for it in a collective).
        """
        strategy, (task, _) = self.model.distribute_strategy, self._worker
        try:
            candidates = self._candidates()
            latest, error = _backup_number(candidates[0] if candidates else None), None
        except (OSError, ValueError) as read_error:
            candidates, latest, error = [], _UNREADABLE, read_error
        latests = _gather_from_workers(strategy, task, latest)
        if error is not None:
            raise error
        unreadable = sorted(name for name, n in latests.items() if n == _UNREADABLE)
        if unreadable:
            raise self._other_workers_failed(unreadable, "read its backup metadata")
        target = min(latests.values())
        if max(latests.values()) - target > 1:
            held = ", ".join(
                f"{name} holds {'backup ' + str(n) if n >= 0 else 'none'}"
                for name, n in sorted(latests.items())
            )
            raise ValueError(
                f"The workers' backups under {self.backup_dir!r} are more than "
                f"one backup apart, so they are not from the same run: {held}. "
                "Give every worker the `backup_dir` it had when the backups "
                "were written, or delete every worker's backup folder to start "
                "over."
            )
        chosen = next((c for c in candidates if _backup_number(c) == target), None)
        if target >= 0 and chosen is None:
            error = ValueError(
                f"{task} cannot resume with the other workers from backup "
                f"{target}: {self._training_metadata_path!r} names backup "
                f"{latest} and no previous one. Delete every worker's backup "
                "folder to start over."
            )
        elif chosen is not None:
            try:
                self._restore(chosen)
            except (OSError, ValueError) as restore_error:
                error = restore_error
        succeeded = _gather_from_workers(strategy, task, error is None)
        if error is not None:
            raise error
        failed = sorted(name for name, ok in succeeded.items() if not ok)
        if failed:
            raise self._other_workers_failed(failed, f"restore backup {target}")
        if target < latest:
            self._commit_restored(chosen)

    def _other_workers_failed(self, names, what):
        return ValueError(
            f"{', '.join(names)} could not {what} under {self.backup_dir!r} "
            "(its own error, in its log, says why). Every worker stops: "
            "workers resumed from different states would train a different "
            "model."
        )

    def _restore(self, candidate):
        """Checks a backup's checksum, then loads it strictly."""
        weights_path = os.path.join(
            self._folder, candidate.get("weights", "latest.weights.h5")
        )
        expected = candidate.get("sha256")
        if expected is None:
            warnings.warn(
                f"The backup {weights_path!r} has no checksum in "
                f"{self._training_metadata_path!r} (it was written by Keras "
                "or by an older kmp); it is restored without an integrity "
                "check.",
                stacklevel=3,
            )
        else:
            try:
                actual = _sha256(weights_path)
            except OSError as error:
                raise ValueError(
                    f"The backup file {weights_path!r} named by "
                    f"{self._training_metadata_path!r} cannot be read: {error}"
                ) from None
            if actual != expected:
                raise ValueError(
                    f"The backup file {weights_path!r} is damaged: its SHA-256 "
                    f"checksum is {actual}, but {self._training_metadata_path!r} "
                    f"recorded {expected} when the file was written. Resuming "
                    "from it would continue from weights that were never "
                    "trained. Put back an intact copy of the file, or delete "
                    f"{self.backup_dir!r} to start over."
                )
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        try:
            _load_weights_strictly(self.model, weights_path)
        except OSError as error:
            raise ValueError(
                f"The backup file {weights_path!r} cannot be loaded: {error}"
            ) from None
        self.model._initial_epoch = candidate["epoch"]
        self._pending_monitor_states = candidate.get("monitors")

    def _commit_restored(self, entry):
        """Makes the backup just restored the latest one (`None`: none).

        The next backup is numbered after the latest the metadata names, so
        after this every worker numbers its backups alike again; the newer
        backup file, no longer named, goes at the next save.
        """
        if entry is None:
            os.remove(self._training_metadata_path)
            return
        entry = dict(entry)
        entry.pop("previous", None)
        self._write_metadata(entry)

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
        if not self.delete_checkpoint:
            return
        if self._worker is None:
            super().on_train_end(logs)
            return
        self._delete_own_backups()

    def _delete_own_backups(self):
        """Deletes this worker's folder, or for the chief its own files in
        `backup_dir`, never another worker's; `backup_dir` goes with the
        last worker to finish."""
        if self._worker[1]:
            if os.path.isdir(self._folder):
                for name in os.listdir(self._folder):
                    if _WORKER_FOLDER_PATTERN.match(name):
                        # Another worker's folder, which that worker deletes
                        # itself, perhaps this very moment: never looked at.
                        continue
                    path = os.path.join(self._folder, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
        else:
            shutil.rmtree(self._folder, ignore_errors=True)
        try:
            os.rmdir(self.backup_dir)
        except OSError:
            pass  # Another worker's backups are still in it, or it is gone.

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
        os.makedirs(self._folder, exist_ok=True)
        latest = self._read_metadata()
        # Numbered from the metadata, not from the folder listing: a file a
        # killed save completed but never committed is not counted, so every
        # worker numbers its backups alike.
        weights_name = f"backup-{_backup_number(latest) + 1:06d}.weights.h5"
        checksum = {}

        def write_weights(path):
            self.model.save_weights(path, overwrite=True)
            checksum["sha256"] = _sha256(path)

        write_atomically(os.path.join(self._folder, weights_name), write_weights)
        metadata = {
            "epoch": self._current_epoch,
            "batch": self._last_batch_seen,
            "weights": weights_name,
            "sha256": checksum["sha256"],
            "monitors": [_monitor_state(monitor) for monitor in self.monitors],
        }
        # Several workers need the previous backup to agree on one at restore.
        keep_previous = self.double_checkpoint or self._worker is not None
        if keep_previous and latest and "weights" in latest:
            latest.pop("previous", None)
            metadata["previous"] = latest
        self._write_metadata(metadata)
        keep = {weights_name}
        if "previous" in metadata:
            keep.add(metadata["previous"]["weights"])
        for path in self._backup_files():
            if os.path.basename(path) not in keep:
                os.remove(path)
        for path in glob.glob(
            os.path.join(glob.escape(self._folder), f".*{_PARTIAL_MARK}-*")
        ):
            # Left by a process killed while saving: only this process
            # writes in this folder.
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
