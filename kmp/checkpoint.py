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
workers. One `backup_dir` shared by all workers and one `backup_dir` per
worker therefore behave the same: no process writes, prunes or deletes a
file in another process's folder.

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
         check the SHA-256 of the file, then load it strictly: any variable
             Keras would skip (a mismatch) is an error, not a warning
         several workers: all-gather whether each restore succeeded, so all
             raise or none does
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
"""

import datetime
import errno
import hashlib
import json
import math
import numbers
import os
import re
import secrets
import socket
import stat
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf

from kmp import _keras_internals
from kmp.backends.tensorflow import distribute as _distribute

try:
    import fcntl
except ImportError:  # Windows: no flock; a second run is not refused there.
    fcntl = None

# `\Z`, not `$`: `$` also matches before a final newline.
_BACKUP_PATTERN = re.compile(r"\Abackup-(\d+)\.weights\.h5\Z", re.ASCII)
_METADATA_NAME = "training_metadata.json"
_LOCK_NAME = "kmp-backup.lock"
_PARTIAL_MARK = ".partial"
# The temporary names `write_atomically` gives the files of a backup folder
# (`.<stem>.partial-<pid>-<token><suffix>`, and without the token as kmp named
# them before), so that end of training and pruning delete those and no other
# hidden file.
_BACKUP_PARTIAL_PATTERN = re.compile(
    r"\A\.(backup-\d+|training_metadata)\.partial-\d+(-[0-9a-f]{16})?"
    r"\.(weights\.h5|json)\Z",
    re.ASCII,
)
# What a worker whose metadata cannot be read reports as its latest backup.
_UNREADABLE = -2
# Larger than any metadata kmp writes (a few hundred bytes per monitor).
_MAX_METADATA_BYTES = 1 << 20
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _split_suffix(filepath):
    """`("dir/name", ".weights.h5")` for Keras' two-part suffix, else splitext."""
    for suffix in (".weights.h5", ".weights.json"):
        if filepath.endswith(suffix):
            return filepath[: -len(suffix)], suffix
    return os.path.splitext(filepath)


def _fsync_path(path, directory=False):
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags | _NO_FOLLOW)
    except OSError:
        return  # Directories cannot be opened on Windows; replace is still atomic.
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_partial(filepath):
    """Creates a new, empty temporary file beside `filepath`; returns `(fd, path)`.

    The name carries the pid and a random token, and the file is created
    with `O_CREAT | O_EXCL | O_NOFOLLOW`: whatever already sits at a name
    (a file, a link planted by someone who can write to the folder) makes
    the creation fail and another name is drawn; nothing is ever followed or
    truncated. The mode is `0o666` less the umask, as for `open(path, "w")`.
    """
    stem, suffix = _split_suffix(filepath)
    directory, name = os.path.split(stem)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | _CLOEXEC
    for _ in range(100):
        partial = os.path.join(
            directory,
            f".{name}{_PARTIAL_MARK}-{os.getpid()}-{secrets.token_hex(8)}{suffix}",
        )
        try:
            return os.open(partial, flags, 0o666), partial
        except FileExistsError:
            continue
    raise FileExistsError(
        errno.EEXIST, "No free temporary name after 100 random draws", partial
    )


def _write_atomically(filepath, write_fd=None, write_path=None):
    """`write_atomically`, writing through the new file's descriptor
    (`write_fd(fd)`) or, for writers that want a path (Keras' savers),
    through the path of the file just created (`write_path(path)`)."""
    fd, partial = _create_partial(filepath)
    try:
        if write_fd is not None:
            write_fd(fd)
            os.fsync(fd)
            os.close(fd)
            fd = None
        else:
            os.close(fd)
            fd = None
            write_path(partial)
            _fsync_path(partial)
        os.replace(partial, filepath)
    except BaseException:
        if fd is not None:
            os.close(fd)
        if os.path.lexists(partial):
            os.remove(partial)
        raise
    _fsync_path(os.path.dirname(filepath) or ".", directory=True)
    return filepath


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
    return _write_atomically(filepath, write_path=write)


def _h5_variables(path):
    """`{dataset path: shape}` of a Keras weights file."""
    import h5py

    variables = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, item: variables.__setitem__(name, tuple(item.shape))
            if isinstance(item, h5py.Dataset)
            else None
        )
    return variables


def _mismatched_variables(model, filepath):
    """What differs between the variables stored in `filepath` and those
    `model` would store, in the file's own layout (`layers/dense_1/vars/0`,
    `optimizer/vars/3`); `""` if nothing differs or a file cannot be read."""
    try:
        with tempfile.TemporaryDirectory() as directory:
            own = os.path.join(directory, "model.weights.h5")
            model.save_weights(own)
            expected = _h5_variables(own)
        stored = _h5_variables(filepath)
    except (OSError, ValueError):
        return ""
    parts = []

    def listed(names, describe):
        shown = ", ".join(describe(name) for name in names[:8])
        return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    differ = sorted(n for n in stored.keys() & expected.keys() if stored[n] != expected[n])
    if differ:
        parts.append("shapes differ (backup vs model): " + listed(
            differ, lambda n: f"{n} {stored[n]} vs {expected[n]}"))
    only_stored = sorted(stored.keys() - expected.keys())
    if only_stored:
        parts.append("only in the backup: " + listed(only_stored, str))
    only_expected = sorted(expected.keys() - stored.keys())
    if only_expected:
        parts.append("missing from the backup: " + listed(only_expected, str))
    return "; ".join(parts)


def _load_weights_strictly(model, filepath):
    """`model.load_weights`, with any variable Keras could not load (a
    "skipping variable loading" warning in older Keras, an error in newer)
    turned into one error naming the file and the variables that differ: a
    file that lacks the optimizer state, or holds another architecture's,
    must not resume training from a fresh optimizer."""
    problem = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.load_weights(filepath)
        except ValueError as error:
            problem = str(error).strip().split("\n")[0]
    for warning in caught:
        message = str(warning.message).strip()
        if "Skipping variable loading" in message or "could not be loaded" in message:
            problem = problem or message.split("\n")[0]
            continue
        warnings.warn_explicit(
            warning.message, warning.category, warning.filename, warning.lineno
        )
    if problem is None:
        return
    mismatched = _mismatched_variables(model, filepath)
    raise ValueError(
        f"The backup {filepath!r} does not match the model: "
        + (f"its variables are another model's ({mismatched}). " if mismatched else "")
        + f"Keras says: {problem} Refusing to resume from a partial state. "
        "Resume with the model the backup was written by, or delete the "
        "backup directory to start over."
    ) from None


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


def _sha256_of_fd(fd):
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    for block in iter(lambda: os.read(fd, 1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def _sha256(path):
    fd = os.open(path, os.O_RDONLY | _NO_FOLLOW | _CLOEXEC)
    try:
        return _sha256_of_fd(fd)
    finally:
        os.close(fd)


def _backup_number(entry):
    """The `<n>` of the `backup-<n>.weights.h5` a metadata entry names; -1
    for no entry, 0 for Keras' own layout (`latest.weights.h5`). Entries are
    validated (`_check_metadata`) before this is asked."""
    if not entry:
        return -1
    match = _BACKUP_PATTERN.match(entry.get("weights", ""))
    return int(match.group(1)) if match else 0


def _held_backups(latest, previous):
    """The backups a worker can restore, given the numbers of its latest and
    previous backups (-1: none); -1 in the result: it can start over.

    A worker holding nothing can start over, and so can one whose latest
    backup is one of a run's first two (the backup of the first epoch, and
    the rewrite of it, see `BackupAndRestore._update_epoch_backup`) with
    nothing before it: another worker may have died before writing its
    first. Later backups of several workers always keep their previous one.
    """
    if latest < 0:
        return {-1}
    held = {latest}
    if previous >= 0:
        held.add(previous)
    elif latest <= 1:
        held.add(-1)
    return held


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_monitor_states(states):
    """The problem with a metadata `monitors` entry, or `None`."""
    if not isinstance(states, list):
        return "a list of one object per monitor"
    for index, state in enumerate(states):
        if not isinstance(state, dict):
            return f"a list of objects (item {index} is not one)"
        for name, value in state.items():
            if name not in _MONITOR_ATTRIBUTES:
                return (
                    f"counters among {', '.join(_MONITOR_ATTRIBUTES)} (item "
                    f"{index} has {name!r})"
                )
            if name == "best":
                # Keras' own initial `best` is None or +-inf; NaN never is.
                ok = value is None or (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and not math.isnan(value)
                )
            else:
                ok = value is None or _is_count(value)
            if not ok:
                return (
                    f"numbers (item {index} has {name}={value!r}; `best` is a "
                    "number, the others are counts >= 0)"
                )
    return None


# The keys of a metadata entry: what each must be, and a check.
_METADATA_KEYS = {
    "epoch": ("an integer >= 0", _is_count),
    "batch": ("an integer >= 0", _is_count),
    "weights": (
        "a file name of the form backup-<n>.weights.h5 (no folder)",
        lambda value: isinstance(value, str) and bool(_BACKUP_PATTERN.match(value)),
    ),
    "sha256": (
        "64 lowercase hexadecimal digits",
        lambda value: isinstance(value, str) and bool(re.fullmatch(r"[0-9a-f]{64}", value)),
    ),
}


def _check_metadata(metadata, path, prefix=""):
    """Raises a `ValueError` naming `path`, the key and the value for
    metadata that kmp (or Keras, for its own layout) would not have written."""

    def refuse(key, value, expected):
        shown = repr(value)
        shown = shown if len(shown) <= 300 else shown[:297] + "..."
        raise ValueError(
            f"The backup metadata {path!r} is not valid: `{prefix}{key}` must "
            f"be {expected}. Received: {prefix}{key}={shown}. It was not "
            "written by kmp.callbacks.BackupAndRestore; nothing was restored. "
            "Delete the backup directory to start over."
        )

    if not isinstance(metadata, dict):
        shown = repr(metadata)
        raise ValueError(
            f"The backup metadata {path!r} is not valid: it must be a JSON "
            "object with the keys epoch, batch, weights, sha256, monitors and "
            f"previous. Received: {shown if len(shown) <= 80 else shown[:77] + '...'}. "
            "Delete the backup directory to start over."
        )
    allowed = set(_METADATA_KEYS) | {"monitors"} | ({"previous"} if not prefix else set())
    for key in metadata:
        if key not in allowed:
            refuse(key, metadata[key], f"absent (the keys are {', '.join(sorted(allowed))})")
    if "epoch" not in metadata:
        refuse("epoch", None, "present, " + _METADATA_KEYS["epoch"][0])
    for key, (expected, check) in _METADATA_KEYS.items():
        if key in metadata and not check(metadata[key]):
            refuse(key, metadata[key], expected)
    if "monitors" in metadata:
        problem = _check_monitor_states(metadata["monitors"])
        if problem:
            refuse("monitors", metadata["monitors"], problem)
    if "previous" in metadata:
        previous = metadata["previous"]
        if not isinstance(previous, dict) or "weights" not in previous:
            refuse("previous", previous, "an earlier entry naming its weights")
        _check_metadata(previous, path, prefix="previous.")


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


# The backup folders this process holds, by real path of the lock file: a
# second `fit` in this process (a notebook cell run again after an interrupted
# one, with a new callback) takes the lock over instead of being refused by
# its own process.
_HELD_LOCKS = {}


class _FolderLock:
    """An exclusive `flock` on `<folder>/kmp-backup.lock`.

    The OS drops the lock when the holding process dies, however it dies
    (SIGKILL included), so a killed run never leaves a folder locked. The
    lock file holds the holder's pid, host and start time, for the error
    that refuses a second run.
    """

    def __init__(self, folder):
        self.folder = folder
        self.path = os.path.join(folder, _LOCK_NAME)
        self.fd = None
        self.owner = None

    @classmethod
    def acquire(cls, folder, owner):
        path = os.path.realpath(os.path.join(folder, _LOCK_NAME))
        held = _HELD_LOCKS.get(path)
        if held is not None and held.still_ours():
            held.owner = owner
            return held
        if held is not None:  # Its lock file was deleted: the lock is moot.
            held.close()
        lock = cls(folder)
        lock.owner = owner
        lock._acquire()
        _HELD_LOCKS[path] = lock
        return lock

    def still_ours(self):
        """Whether the lock file is still the file this process locked."""
        if self.fd is None:
            return False
        try:
            return _same_file(os.fstat(self.fd), os.lstat(self.path))
        except OSError:
            return False

    def _acquire(self):
        flags = os.O_RDWR | os.O_CREAT | _NO_FOLLOW | _CLOEXEC
        # A lock file deleted by its holder at the end of its training
        # between our open and our flock is not the folder's lock any more:
        # open again (a few times at most; each retry means a run just ended).
        for _ in range(10):
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as error:
                raise ValueError(
                    f"The backup lock {self.path!r} cannot be opened ({error}); "
                    "it must be a regular file, not a link. Delete it if no run "
                    f"uses {self.folder!r}."
                ) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ValueError(
                    f"The backup lock {self.path!r} is not a regular file. "
                    f"Delete it if no run uses {self.folder!r}."
                )
            if fcntl is None:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = _read_holder(fd)
                os.close(fd)
                if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise RuntimeError(
                    f"The backup folder {self.folder!r} is in use by another "
                    f"training run: {holder} holds {self.path!r}. Two runs on "
                    "one backup_dir would restore and overwrite each other's "
                    "backups. Give this run a backup_dir of its own, or stop "
                    "the other run first (a run that died, even by SIGKILL, "
                    "releases the folder by itself)."
                ) from None
            try:
                if _same_file(os.fstat(fd), os.lstat(self.path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise RuntimeError(f"Could not lock {self.path!r}: it keeps being replaced.")
        self.fd = fd
        holder = json.dumps({
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
        })
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, holder.encode())

    def release(self, owner):
        """Deletes the lock file and unlocks, if `owner` holds the lock."""
        if self.owner is not owner or self.fd is None:
            return
        if self.still_ours():
            os.remove(self.path)
        self.close()

    def close(self):
        if self.fd is not None:
            os.close(self.fd)  # Closing the last descriptor releases the flock.
            self.fd = None
        for path, lock in list(_HELD_LOCKS.items()):
            if lock is self:
                del _HELD_LOCKS[path]


def _same_file(a, b):
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_holder(fd):
    """`process <pid> on <host>, started <time>` from a lock file."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 4096).decode())
        return (
            f"process {int(holder['pid'])} on {str(holder['host'])[:100]}, "
            f"started {str(holder['started'])[:40]}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


class _UnsafeBackupError(ValueError):
    """A backup path that is not a regular file kmp wrote (a link, a
    folder): refused outright, never a reason to fall back to another."""


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
    with `double_checkpoint=True`; a backup that cannot be restored on any
    worker is an error on every worker.

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
        TypeError: if `monitors` holds something that is not a callback.
        ValueError: as Keras' callback for invalid arguments; on restore, if
            the metadata is malformed or names a file kmp did not write, if
            the backup's checksum differs, if it does not match the model
            (naming the variables that differ) or the monitors, or if the
            workers' backups are not from one run.
        RuntimeError: when training begins, if another process is training
            with the same folder.

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
        # `(metadata entry, variables digest)` of the backup written at the
        # last epoch's end, until the next epoch's start checks it.
        self._epoch_backup = None
        # This process's own folder, and its task in a multi-worker cluster
        # (`(name, is_chief)`, or `None`); set when training begins.
        self._folder = backup_dir
        self._worker = None
        self._lock = None

    def _use_folder_of_this_process(self):
        # No `distribute_strategy` on JAX: one process, one folder.
        self._worker = _this_worker(getattr(self.model, "distribute_strategy", None))
        if self._worker is None or self._worker[1]:
            self._folder = self.backup_dir
        else:
            self._folder = os.path.join(self.backup_dir, self._worker[0])
        self._kmp_training_metadata_path = os.path.join(self._folder, _METADATA_NAME)

    def _lock_folder(self):
        """Creates this process's folder and locks it (see `_FolderLock`)."""
        os.makedirs(self._folder, exist_ok=True)
        if os.path.islink(self._folder) and self._folder != self.backup_dir:
            # A worker's folder is kmp's own: a link there was planted.
            raise ValueError(
                f"The worker's backup folder {self._folder!r} is a symbolic "
                "link; kmp creates it as a folder. Delete it to start over."
            )
        self._lock = _FolderLock.acquire(self._folder, owner=self)

    def _release_lock(self):
        if self._lock is not None:
            self._lock.release(owner=self)
            self._lock = None

    def _backup_files(self):
        files = []
        for name in os.listdir(self._folder):
            match = _BACKUP_PATTERN.match(name)
            if match:
                files.append((int(match.group(1)), os.path.join(self._folder, name)))
        return [path for _, path in sorted(files)]

    def _read_metadata(self):
        """The checked metadata of this process's folder, or `None`."""
        path = self._kmp_training_metadata_path
        try:
            fd = os.open(path, os.O_RDONLY | _NO_FOLLOW | _CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as error:
            if os.path.islink(path):
                raise ValueError(
                    f"The backup metadata {path!r} is a symbolic link; kmp "
                    "reads only the regular file it wrote there. Nothing was "
                    "restored. Delete the backup directory to start over."
                ) from None
            raise ValueError(f"The backup metadata {path!r} cannot be read: {error}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_METADATA_BYTES:
                raise ValueError(
                    f"The backup metadata {path!r} is not a regular file of at "
                    f"most {_MAX_METADATA_BYTES} bytes (size {info.st_size}); it "
                    "was not written by kmp.callbacks.BackupAndRestore. Delete "
                    "the backup directory to start over."
                )
            data = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
        finally:
            os.close(fd)
        try:
            metadata = json.loads(data.decode("utf-8"))
        except ValueError:
            raise ValueError(
                f"The backup metadata {path!r} is not valid JSON (received "
                f"{data[:80]!r}); it was not written by "
                "kmp.callbacks.BackupAndRestore, which replaces it atomically. "
                "Delete the backup directory to start over."
            ) from None
        _check_metadata(metadata, path)
        return metadata

    def _write_metadata(self, metadata):
        data = json.dumps(metadata).encode()

        def write(fd):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]

        _write_atomically(self._kmp_training_metadata_path, write_fd=write)

    def _kmp_load_backup(self):
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be "
                "built before you call `fit()`. Build it by calling it on a "
                f"batch of data. Received: unbuilt model {self.model.name!r}"
            )
        self._use_folder_of_this_process()
        self._lock_folder()
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
            except _UnsafeBackupError:
                raise  # Planted, not damaged: no fallback to another file.
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
        """Restores the same backup on every worker: the newest one that
        every worker holds (as its latest or its previous backup).

        Three all-gathers, at the same point on every worker: the latest
        backup numbers, the previous ones, then whether each restore
        succeeded, so that a worker that cannot restore stops every worker,
        not only itself (rather than leaving them waiting for it in a
        collective).
        """
        strategy, (task, _) = self.model.distribute_strategy, self._worker
        try:
            candidates = self._candidates()
            latest, error = _backup_number(candidates[0] if candidates else None), None
            previous = _backup_number(candidates[1] if len(candidates) > 1 else None)
        except (OSError, ValueError) as read_error:
            candidates, latest, previous, error = [], _UNREADABLE, _UNREADABLE, read_error
        latests = _gather_from_workers(strategy, task, latest)
        previouses = _gather_from_workers(strategy, task, previous)
        if error is not None:
            raise error
        unreadable = sorted(name for name, n in latests.items() if n == _UNREADABLE)
        if unreadable:
            raise self._other_workers_failed(unreadable, "read its backup metadata")
        held = {
            name: _held_backups(latests[name], previouses.get(name, -1))
            for name in latests
        }
        common = set.intersection(*held.values())
        if not common:
            listed = ", ".join(
                f"{name} holds "
                + (" and ".join(f"backup {n}" for n in sorted(numbers, reverse=True) if n >= 0)
                   if max(numbers) >= 0 else "none")
                for name, numbers in sorted(held.items())
            )
            raise ValueError(
                f"The workers' backups under {self.backup_dir!r} have no backup "
                f"in common, so they are not from the same run: {listed}. "
                "Give every worker the `backup_dir` it had when the backups "
                "were written, or delete every worker's backup folder to start "
                "over."
            )
        target = max(common)
        # In this worker's own `held`, so a candidate (or none, for -1).
        chosen = next((c for c in candidates if _backup_number(c) == target), None)
        if chosen is not None:
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

    def _open_backup(self, name):
        """A read-only descriptor of backup `name`: a regular file in this
        process's folder, opened without following a link."""
        path = os.path.join(self._folder, name)
        refusal = (
            f"The backup metadata {self._kmp_training_metadata_path!r} names "
            f"weights={name!r}, but {path!r} is {{}}; kmp reads only the regular "
            f"files it wrote in {self._folder!r}. Nothing was restored. Delete "
            "the backup directory to start over."
        )
        try:
            fd = os.open(path, os.O_RDONLY | _NO_FOLLOW | _CLOEXEC)
        except OSError as error:
            if os.path.islink(path):
                raise _UnsafeBackupError(refusal.format("a symbolic link")) from None
            raise ValueError(
                f"The backup file {path!r} named by "
                f"{self._kmp_training_metadata_path!r} cannot be read: {error}"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _UnsafeBackupError(refusal.format("not a regular file"))
        return fd, path

    def _restore(self, candidate):
        """Checks a backup's file and checksum, then loads it strictly."""
        fd, weights_path = self._open_backup(candidate.get("weights", "latest.weights.h5"))
        try:
            checked = os.fstat(fd)
            expected = candidate.get("sha256")
            if expected is None:
                warnings.warn(
                    f"The backup {weights_path!r} has no checksum in "
                    f"{self._kmp_training_metadata_path!r} (it was written by Keras "
                    "or by an older kmp); it is restored without an integrity "
                    "check.",
                    stacklevel=3,
                )
            elif _sha256_of_fd(fd) != expected:
                # The digest of what was read is not printed: the file at
                # this name may not be one kmp wrote.
                raise ValueError(
                    f"The backup file {weights_path!r} is damaged: its SHA-256 "
                    f"checksum differs from the one "
                    f"{self._kmp_training_metadata_path!r} recorded ({expected}) when "
                    "the file was written. Resuming from it would continue "
                    "from weights that were never trained. Put back an intact "
                    f"copy of the file, or delete {self.backup_dir!r} to start "
                    "over."
                )
        finally:
            os.close(fd)
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        # Keras opens the file again by its name: it must still be the file
        # just checked.
        if not _same_file(checked, os.lstat(weights_path)):
            raise _UnsafeBackupError(
                f"The backup file {weights_path!r} was replaced while it was "
                "being checked; nothing was restored."
            )
        try:
            _load_weights_strictly(self.model, weights_path)
        except OSError as error:
            raise ValueError(
                f"The backup file {weights_path!r} cannot be loaded: {error}"
            ) from None
        _keras_internals.set_initial_epoch(self.model, candidate["epoch"])
        # Backups written from here on are numbered from the restored epoch.
        self._kmp_current_epoch = candidate["epoch"]
        self._pending_monitor_states = candidate.get("monitors")

    def _commit_restored(self, entry):
        """Makes the backup just restored the latest one (`None`: none).

        The next backup is numbered after the latest the metadata names, so
        after this every worker numbers its backups alike again; the newer
        backup file, no longer named, goes at the next save.
        """
        if entry is None:
            os.remove(self._kmp_training_metadata_path)
            return
        entry = dict(entry)
        entry.pop("previous", None)
        self._write_metadata(entry)

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
            self._release_lock()
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
        self._epoch_backup = (entry, self._variables_digest())

    def on_epoch_begin(self, epoch, logs=None):
        if self._epoch_backup is not None:
            self._update_epoch_backup()
        self._restore_monitors()

    def on_train_end(self, logs=None):
        try:
            if self._epoch_backup is not None and not self.delete_checkpoint:
                self._update_epoch_backup()
            self._epoch_backup = None
            if self.delete_checkpoint:
                self._delete_own_files()
        finally:
            self._release_lock()
        if self.delete_checkpoint:
            self._remove_empty_folders()

    def _variables_digest(self):
        """SHA-256 of the values of every variable a backup holds (the
        model's and the optimizer's; not the metrics', which `fit` resets
        at each epoch's start), with their paths, dtypes and shapes."""
        metrics = {id(v) for v in self.model.metrics_variables}
        variables = [v for v in self.model.variables if id(v) not in metrics]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        digest = hashlib.sha256()
        for variable in variables:
            value = np.ascontiguousarray(keras.ops.convert_to_numpy(variable))
            digest.update(f"{variable.path}:{value.dtype}:{value.shape};".encode())
            digest.update(value.reshape(-1).view(np.uint8))
        return digest.hexdigest()

    def _update_epoch_backup(self):
        """Rewrites the backup written at the last epoch's end if a callback
        that ran after this one changed what it holds: the variables (a
        learning rate `ReduceLROnPlateau` lowered, weights `EarlyStopping`
        restored) or a monitor's counters. The rewrite is a new backup of the
        same epoch that replaces that one; with unchanged variables its
        weights file is a hard link to the one written (no second save)."""
        (entry, digest), self._epoch_backup = self._epoch_backup, None
        monitors = [_monitor_state(monitor) for monitor in self.monitors]
        same_variables = self._variables_digest() == digest
        # json: NaN equals NaN there, as the counters were written.
        if same_variables and json.dumps(monitors) == json.dumps(entry["monitors"]):
            return
        self._write_backup(replacing=entry, same_weights=same_variables)

    def _delete_own_files(self):
        """Deletes what kmp wrote in this process's folder, by kmp's names:
        the metadata first (so a kill part-way leaves no metadata naming a
        deleted file), then the backups and partial files. Anything else
        (the user's files, another worker's folder) is never touched."""
        if not os.path.isdir(self._folder):
            return
        names = sorted(os.listdir(self._folder), key=lambda name: name != _METADATA_NAME)
        for name in names:
            if not (
                name == _METADATA_NAME
                or _BACKUP_PATTERN.match(name)
                or _BACKUP_PARTIAL_PATTERN.match(name)
            ):
                continue
            path = os.path.join(self._folder, name)
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.remove(path)  # A link goes, never what it points to.
            except FileNotFoundError:
                pass

    def _remove_empty_folders(self):
        """Removes this process's folder, then `backup_dir` (a worker's
        folder is inside it), each only if empty and never the working
        directory; the last worker to finish removes `backup_dir`."""
        folders = [self._folder]
        if self._folder != self.backup_dir:
            folders.append(self.backup_dir)
        for folder in folders:
            try:
                if os.path.samefile(folder, os.getcwd()):
                    continue
                os.rmdir(folder)
            except OSError:
                pass  # Not empty (other files, another worker's), or gone.

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
            # `_check_metadata` admitted only the counters of
            # `_MONITOR_ATTRIBUTES`, as numbers; each goes only to a monitor
            # that has it, as the monitor kmp read it from had.
            unknown = sorted(name for name in state if not hasattr(monitor, name))
            if unknown:
                raise ValueError(
                    f"The backup in {self.backup_dir!r} holds {', '.join(unknown)} "
                    f"for the monitor {type(monitor).__name__}, which has no such "
                    "counter. Pass the same callbacks, in the same order, as the "
                    "run that wrote it."
                )
        for monitor, state in zip(self.monitors, states):
            for name in _MONITOR_ATTRIBUTES:
                if name in state:
                    setattr(monitor, name, state[name])

    def _kmp_save_backup(self):
        self._write_backup()

    def _write_backup(self, replacing=None, same_weights=False):
        """Writes a backup of the current state and commits it; returns its
        metadata entry.

        `replacing`: the entry of the latest backup, written at this
        epoch's end, that this one replaces (it then keeps that entry's
        `previous`: the previous epoch's backup, as Keras'
        `double_checkpoint` keeps). `same_weights`: the variables have not
        changed since `replacing` was written, so its weights file is hard
        linked under the new name rather than saved again (saved, if the
        file system has no hard links).
        """
        os.makedirs(self._folder, exist_ok=True)
        latest = self._read_metadata()
        # Numbered from the metadata, not from the folder listing: a file a
        # killed save completed but never committed is not counted, so every
        # worker numbers its backups alike.
        weights_name = f"backup-{_backup_number(latest) + 1:06d}.weights.h5"
        weights_path = os.path.join(self._folder, weights_name)
        replaces_latest = (
            replacing is not None
            and latest is not None
            and latest.get("weights") == replacing["weights"]
        )
        checksum = {}
        if replaces_latest and same_weights and self._link_backup(
            replacing["weights"], weights_path
        ):
            checksum["sha256"] = replacing["sha256"]
        else:

            def write_weights(path):
                self.model.save_weights(path, overwrite=True)
                checksum["sha256"] = _sha256(path)

            _write_atomically(weights_path, write_path=write_weights)
        metadata = {
            "epoch": self._kmp_current_epoch,
            "batch": self._kmp_last_batch_seen,
            "weights": weights_name,
            "sha256": checksum["sha256"],
            "monitors": [_monitor_state(monitor) for monitor in self.monitors],
        }
        # The backup kept as `previous`: the latest one, or, when this one
        # replaces the latest (same epoch), the one before it.
        before = latest.get("previous") if replaces_latest else latest
        # Several workers need the previous backup to agree on one at restore.
        keep_previous = self.double_checkpoint or self._worker is not None
        if keep_previous and before and "weights" in before:
            before = dict(before)
            before.pop("previous", None)
            metadata["previous"] = before
        self._write_metadata(metadata)
        keep = {weights_name}
        if "previous" in metadata:
            keep.add(metadata["previous"]["weights"])
        for name in os.listdir(self._folder):
            # Backups no longer named, and partial files left by a process
            # killed while saving: only this process writes in this folder.
            if (_BACKUP_PATTERN.match(name) and name not in keep) or (
                _BACKUP_PARTIAL_PATTERN.match(name)
            ):
                path = os.path.join(self._folder, name)
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.remove(path)
        return metadata

    def _link_backup(self, source_name, target):
        """Hard links backup `source_name` at `target`, atomically (a link
        under a temporary name, then `os.replace`); `False` where the file
        system has no hard links."""
        source = os.path.join(self._folder, source_name)
        stem, suffix = _split_suffix(target)
        directory, name = os.path.split(stem)
        for _ in range(100):
            partial = os.path.join(
                directory,
                f".{name}{_PARTIAL_MARK}-{os.getpid()}-{secrets.token_hex(8)}{suffix}",
            )
            try:
                os.link(source, partial, follow_symlinks=False)
                break
            except FileExistsError:
                continue
            except (OSError, NotImplementedError):
                return False
        else:
            return False
        try:
            os.replace(partial, target)
        except BaseException:
            os.remove(partial)
            raise
        _fsync_path(directory or ".", directory=True)
        return True


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
