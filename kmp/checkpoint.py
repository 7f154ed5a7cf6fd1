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
a kill leaves at most a `*.partial*` file, which is ignored. The temporary
name is new for every write (the pid and a random token) and created with
`O_CREAT | O_EXCL | O_NOFOLLOW`: a file or link already at that name is never
followed, truncated or written through.

`BackupAndRestore` also commits the weights and the epoch together: the
weights go to a new file, and the metadata, which names that file and its
SHA-256, is replaced after it. A kill between the two leaves the metadata
pointing at the previous complete backup. HDF5 keeps no checksum of the
data it stores, so a flipped bit in a weights file would otherwise load
silently; the recorded SHA-256 is checked before anything is loaded.

Each process writes and reads one folder of its own, F: `backup_dir` for a
single process and for the chief of a `MultiWorkerMirroredStrategy`
cluster, `backup_dir/<task type>-<task id>` (e.g. `worker-1`) for the other
workers; among JAX processes joined by `jax.distributed`, `backup_dir` for
process 0 and `backup_dir/process-<index>` for the others. One `backup_dir`
shared by all workers and one `backup_dir` per worker therefore behave the
same: no process writes, prunes or deletes a file in another process's
folder.

```
train begin: create F, lock F/kmp-backup.lock (flock, not following links;
             refused, naming the holder, while another process holds it)
save (at each epoch's end, as Keras; or every `save_freq` batches):
         write weights -> F/.backup-<n>.partial-<pid>-<token>.weights.h5, fsync,
             SHA-256 of it; n = the number the metadata names, plus one
         os.replace(partial, F/backup-<n>.weights.h5)
         write {"epoch", "batch", "weights": "backup-<n>.weights.h5",
                "sha256", "monitors", "previous" (optional: the entry before)}
             -> F/training_metadata.json (same way: partial, fsync, replace)
         delete F's backup-<n>.weights.h5 that the metadata does not name,
         and F's partial files (left by a killed process: F has one writer)
rewrite (the next epoch's start, or train end if kept; only if a callback
             after this one changed the variables or a monitor's counters
             since the epoch's end): save again as backup n + 1, the same
             epoch; its "previous" is the replaced entry's own previous.
             Variables unchanged: backup-<n+1> is a hard link to
             backup-<n> (linked under a partial name, then os.replace)
restore: read F/training_metadata.json (a regular file, not a link); every
             key, type and value checked: the weights entry must be
             backup-<n>.weights.h5, a regular file in F, not a link
         several workers: all-gather each worker's latest and previous
             backup numbers and restore number m = the newest every worker
             holds (see below)
         check the SHA-256 of the file (JAX processes: all-gather whether
             each file passed, and what variables each holds, before any
             loads: loading is a collective),
             then load it strictly: any variable Keras would skip (a
             mismatch) is an error, not a warning
         several workers: all-gather whether each restore succeeded, so all
             raise or none does; the lock and the metadata are agreed on in
             the first all-gather too; after any failure the failed workers'
             messages are all-gathered and every worker raises the same error
train end (delete_checkpoint=True): delete F's metadata, backups, partial
             files and lock file, nothing else; then F, if it is empty (never
             the working directory)
```

Why every worker holds a common backup: a worker writes its backup of
epoch k (number n + 1, previous n) at the end of epoch k, and its rewrite
(n + 2, previous n again) before its first step of epoch k + 1; no worker
can finish that epoch's steps (collectives) and write another backup before
every worker has started them, i.e. written its own. So a worker killed
between its own saves and another's leaves every worker holding backup n
(or, at the first epoch, nothing to restore: every worker starts over), and
the newest backup they all hold is restored. Workers make the same rewrite
decisions (their variables and callbacks are the same), so one number means
one state on every worker.

Where each part lives: this module holds the two callbacks and
`write_atomically`; the atomic writes are `kmp/backup/_atomic_files.py`, the
metadata and its checks `backup/_records.py`, the lock `backup/_lock.py`, the
writes into one process's folder `backup/_folder.py`, the restore of one
backup `backup/_restore.py`, the choice of which backup (one process, or
agreed by the workers) `backup/_choice.py`, and which worker this process is
and the workers' all-gather `kmp/backends/<backend>/workers.py`.
"""

import errno
import json
import os

import keras

from kmp import _keras_internals
from kmp import backends
from kmp.backup import _atomic_files
from kmp.backup import _choice as _backup_choice
from kmp.backup import _folder as _backup_folder
from kmp.backup import _records as _backup_records
from kmp.backup import _restore as _backup_restore

# What a worker whose metadata cannot be read reports as its latest backup.
_UNREADABLE = _backup_choice.UNREADABLE


def write_atomically(filepath, write):
    """Calls `write(temporary_path)`, then moves the result onto `filepath`.

    The temporary file sits in `filepath`'s directory with the same suffix
    (so Keras accepts it), a `.partial` mark, the pid and a random token;
    it is created empty and exclusively (`O_CREAT | O_EXCL | O_NOFOLLOW`)
    before `write` gets its path, so a file or symbolic link that someone
    planted at a temporary name is never written through. The result is
    flushed to disk before `os.replace`, so `filepath` is either the
    previous complete file or the new complete one, never a mix, whenever
    the process dies.

    Args:
        filepath: String or `pathlib.Path`. The final path.
        write: Callable taking the temporary path (a string) and writing
            the whole file there, e.g. `lambda path: model.save(path)`.

    Returns:
        `filepath` as a string.

    Raises:
        IsADirectoryError: before `write` is called, if `filepath` is a
            folder.

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
    if os.path.isdir(filepath):
        # Found before `write` runs (a whole save), not at the move.
        raise IsADirectoryError(
            errno.EISDIR, "`filepath` must be the path of a file, not a folder", filepath)
    return _atomic_files.write_then_replace(filepath, write_path=write)


def _this_worker(strategy):
    """`(task name, is chief)` in a cluster of several workers, else `None`
    (the running backend's `workers.this_worker`)."""
    return backends.get("workers").this_worker(strategy)


def _gather_from_workers(strategy, task, value):
    """`{task name: value}` over the cluster's workers, `value` an int: an
    all-gather every worker makes at the same point (the running backend's
    `workers.gather_from_workers`)."""
    return backends.get("workers").gather_from_workers(strategy, task, value)


def _gather_bytes_from_workers(strategy, task, data):
    """`{task name: data}` over the cluster's workers, `data` bytes of one
    length on every worker (the running backend's
    `workers.gather_bytes_from_workers`)."""
    return backends.get("workers").gather_bytes_from_workers(strategy, task, data)


class BackupAndRestore(_keras_internals.BackupAndRestoreBase):
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

    With `save_freq="epoch"` an epoch's backup is written at the epoch's
    end (`on_epoch_end`), as Keras writes it, so a crash anywhere after it
    (a callback listed later that raises in its own `on_epoch_end`
    included) resumes at the next epoch, where Keras' own callback resumes.
    Callbacks listed after this one handle the epoch's end after the
    backup was written: if one of them changes what the backup holds (a
    learning rate that `ReduceLROnPlateau` lowered, weights `EarlyStopping`
    restored, the counters of the callbacks passed as `monitors`), the
    backup is written again when the next epoch begins (or when training
    ends, if the backup is kept), as a new backup of the same epoch that
    replaces it. A change is found by comparing a SHA-256 of the model's
    and optimizer's variables (read back from the device, as a save does)
    and the monitors' counters with those written; when only counters
    changed, the new backup's weights file is a hard link to the one
    written, not a second save. A crash between the two writes resumes
    from the first, which is what Keras' callback would resume.

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
    with the same command. At restore the workers agree on one backup, the
    newest that every worker holds (a worker killed between its save and
    another's holds one backup less), so all resume from the same state.
    For that agreement each worker keeps its previous backup as well, as
    with `double_checkpoint=True`; a folder that cannot be locked or a
    backup that cannot be restored on any worker is the same error on every
    worker, naming the worker and its cause. On JAX the workers are the
    processes joined by `jax.distributed.initialize` (process 0 writes to
    `backup_dir`, process i to `backup_dir/process-<i>`), which agree
    through JAX's own all-gathers.

    The folder is trusted with nothing but what this callback wrote there.
    The metadata is checked key by key (a wrong key, type or value is a
    `ValueError` naming the file, the key and the value, before anything is
    loaded); the weights it names must be `backup-<n>.weights.h5`, a regular
    file in the folder, not a link; monitors get back only the counters
    listed below, as numbers. Temporary files are created exclusively,
    never through a file or link already at their name.

    One run per folder: when training begins the folder is created and
    locked (`flock` on `kmp-backup.lock` in it, holding the pid, host and
    start time); another process that starts training on it is refused with
    a `RuntimeError` naming the holder, until the holder's training ends or
    the holder dies (the OS drops the lock of a killed process, so the same
    command resumes). Within one process the latest `fit` takes the lock
    over, so a `fit` interrupted by an exception never blocks the next one.
    Each worker of a cluster locks its own folder. Training that ends
    (`on_train_end`) or fails while restoring releases the lock and deletes
    the lock file; a `fit` that raises later keeps it until the process
    exits or its next `fit` starts.

    When training ends with `delete_checkpoint=True`, only this callback's
    files go: the metadata, the backups, partial files and the lock file;
    then the folder, if nothing else is left in it (never the working
    directory). Anything else in it (notes, data, a `ModelCheckpoint`'s
    file, another worker's folder) stays.

    Args:
        backup_dir: String. Where the backups go; use one directory per run
            (with several workers, see above). The folder is created, and
            locked, when training begins.
        save_freq: `"epoch"` or integer. As for Keras' callback. Defaults
            to `"epoch"`.
        double_checkpoint: Bool. Keep the previous complete backup too (the
            previous epoch's, with `save_freq="epoch"`; a rewrite of an
            epoch's backup replaces it and keeps the one before), and fall
            back to it, with a warning, if the latest cannot be restored (a
            disk error, a checksum that differs). Defaults to `False`.
        delete_checkpoint: Bool. Delete the backups when training ends (each
            worker its own, and nothing this callback did not write;
            `backup_dir` goes once it is empty). Defaults to `True`.
        monitors: Optional list of callbacks that keep a monitor's state,
            e.g. `EarlyStopping`, `ReduceLROnPlateau`,
            `ModelCheckpoint(save_best_only=True)`. Their `best`, `wait`,
            `best_epoch`, `stopped_epoch` and `cooldown_counter` are backed up
            and restored, so patience does not start over after a crash
            (`EarlyStopping`'s `best_weights` are not). Defaults to `None`.

    Raises:
        TypeError: if `backup_dir` is not a path, or `monitors` holds
            something that is not a callback.
        ValueError: as Keras' callback for invalid arguments; when training
            begins, if `backup_dir` is a file; on restore (before anything is
            loaded), if the metadata is malformed or names a file kmp did not
            write, if the backup's checksum differs, if it does not match the
            model (naming the variables that differ) or the monitors, or if
            the workers' backups are not from one run.
        RuntimeError: when training begins, if another process is training
            with the same folder (with several workers: with any worker's).

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
        _backup_folder.check_backup_dir(backup_dir)  # before Keras' own checks
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self.monitors = _backup_records.monitors_argument(monitors)
        self._pending_monitor_states = None
        # `(metadata entry, variables digest)` of the backup written at the
        # last epoch's end, until the next epoch's start checks it.
        self._epoch_backup = None
        # This process's own folder (`_backup_folder.BackupFolder`), and its
        # task in a multi-worker cluster (`(name, is_chief)`, or `None`); set
        # when training begins.
        self._folder = _backup_folder.BackupFolder(backup_dir)
        self._worker = None

    def _use_folder_of_this_process(self):
        # No `distribute_strategy` on JAX: the workers are JAX's processes.
        self._worker = _this_worker(getattr(self.model, "distribute_strategy", None))
        if self._worker is None or self._worker[1]:
            self._folder.use(self.backup_dir)
        else:
            self._folder.use(os.path.join(self.backup_dir, self._worker[0]))
        self._kmp_training_metadata_path = self._folder.metadata_path

    def _kmp_load_backup(self):
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be "
                "built before you call `fit()`. Build it by calling it on a "
                f"batch of data. Received: unbuilt model {self.model.name!r}"
            )
        self._use_folder_of_this_process()
        folder = self._folder
        if self._worker is None:
            folder.lock(owner=self)
            candidates = folder.candidates()
            if candidates:
                # Other monitors are the caller's mistake: no fallback to the previous backup.
                _backup_records.check_entry_monitors(
                    self.monitors, candidates[0], self.backup_dir, self.params)
            _backup_choice.restore_newest(
                candidates, self._restore, folder.commit_restored, folder.path
            )
            return
        strategy, (task, _) = getattr(self.model, "distribute_strategy", None), self._worker
        _backup_choice.restore_agreed(
            folder.candidates,
            self._restore,
            folder.commit_restored,
            lambda value: _gather_from_workers(strategy, task, value),
            self.backup_dir,
            # A refused lock is agreed on like any failure: a worker that
            # stopped alone would leave the others waiting in a collective.
            lock=lambda: folder.lock(owner=self),
            gather_bytes=lambda data: _gather_bytes_from_workers(strategy, task, data),
            # Loading is a collective there: every worker's file is checked,
            # and the variables the files hold compared, before any loads.
            check=(
                lambda candidate: _backup_restore.check_backup_variables(
                    folder, candidate, self.backup_dir)
            ) if backends.get("workers").LOADING_IS_COLLECTIVE else None,
        )

    def _restore(self, candidate):
        """Checks a backup's monitors, file and checksum, then loads it strictly."""
        _backup_records.check_entry_monitors(
            self.monitors, candidate, self.backup_dir, self.params)
        _backup_restore.load_backup(self.model, self._folder, candidate, self.backup_dir)
        _keras_internals.set_initial_epoch(self.model, candidate["epoch"])
        # Backups written from here on are numbered from the restored epoch.
        self._kmp_current_epoch = candidate["epoch"]
        self._pending_monitor_states = candidate.get("monitors")

    def on_train_begin(self, logs=None):
        # Each fit starts from what the folder holds, never from what an
        # earlier fit with this instance left behind: after an interrupted
        # fit, an epoch backup still to be checked would carry the old epoch
        # number over the restored weights.
        self._epoch_backup = None
        self._pending_monitor_states = None
        self._kmp_current_epoch = 0
        self._kmp_last_batch_seen = 0
        # Keras' version falls back on OSError only; `_kmp_load_backup` already
        # tries every complete backup and says why each one failed.
        try:
            self._kmp_load_backup()
        except BaseException:
            # `fit` ends here: the folder is not in use any more.
            self._folder.release(owner=self)
            raise

    def on_epoch_end(self, epoch, logs=None):
        self._kmp_current_epoch = epoch + 1
        self._kmp_last_batch_seen = 0
        if self.save_freq != "epoch":
            return
        # Written here, as Keras writes it: a later callback that raises in
        # its own `on_epoch_end` (a crash) loses nothing of this epoch.
        entry = self._write_backup()
        # What was written, to bring the backup up to date at the next
        # epoch's start if a callback after this one changes the state.
        self._epoch_backup = (entry, _backup_records.variables_digest(self.model))

    def on_epoch_begin(self, epoch, logs=None):
        if self._epoch_backup is not None:
            self._update_epoch_backup()
        # Not in on_train_begin: each monitor resets its own state there,
        # after this callback has run.
        states, self._pending_monitor_states = self._pending_monitor_states, None
        if states is not None:
            try:
                _backup_records.restore_monitor_states(self.monitors, states, self.backup_dir)
            except ValueError:
                self._folder.release(owner=self)  # fit ends here, without on_train_end
                raise

    def on_train_end(self, logs=None):
        try:
            if self._epoch_backup is not None and not self.delete_checkpoint:
                self._update_epoch_backup()
            self._epoch_backup = None
            if self.delete_checkpoint:
                self._folder.delete_own_files()
        finally:
            self._folder.release(owner=self)
        if self.delete_checkpoint:
            self._folder.remove_empty_folders()

    def _update_epoch_backup(self):
        """Rewrites the backup written at the last epoch's end if a callback
        that ran after this one changed what it holds: the variables (a
        learning rate `ReduceLROnPlateau` lowered, weights `EarlyStopping`
        restored) or a monitor's counters. The rewrite is a new backup of the
        same epoch that replaces that one; with unchanged variables its
        weights file is a hard link to the one written (no second save)."""
        (entry, digest), self._epoch_backup = self._epoch_backup, None
        monitors = [_backup_records.monitor_state(monitor) for monitor in self.monitors]
        same_variables = _backup_records.variables_digest(self.model) == digest
        # json: NaN equals NaN there, as the counters were written.
        if same_variables and json.dumps(monitors) == json.dumps(entry["monitors"]):
            return
        self._write_backup(replacing=entry, same_weights=same_variables)

    def _kmp_save_backup(self):
        self._write_backup()

    def _write_backup(self, replacing=None, same_weights=False):
        """Writes a backup of the current state and commits it; returns its
        metadata entry (see `BackupFolder.write_backup`)."""
        record = {
            "epoch": self._kmp_current_epoch,
            "batch": self._kmp_last_batch_seen,
            "monitors": [_backup_records.monitor_state(monitor) for monitor in self.monitors],
        }
        # Several workers need the previous backup to agree on one at restore.
        keep_previous = self.double_checkpoint or self._worker is not None
        return self._folder.write_backup(
            self.model, record, keep_previous, replacing=replacing, same_weights=same_weights
        )


class ModelCheckpoint(_keras_internals.ModelCheckpointBase):
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

    def _kmp_write_checkpoint(self, filepath, epoch):
        if os.path.isdir(filepath):
            # Keras' own message; without it `os.replace` would raise a raw
            # IsADirectoryError after a whole save.
            raise IOError(
                "Please specify a non-directory filepath for "
                "ModelCheckpoint. Filepath used is an existing "
                f"directory: {filepath}"
            )
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
