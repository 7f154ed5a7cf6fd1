"""What a backup folder of `kmp.callbacks.BackupAndRestore` records, and the
checks that trust nothing else.

The names of the files kmp writes there, the metadata (the epoch and batch
reached, the weights file and its SHA-256, the monitors' counters, the
previous entry), read without following a link and checked key by key, and
the digests that tell whether a backup is intact (the file's SHA-256) or up
to date (the SHA-256 of the variables it holds).
"""

import hashlib
import json
import math
import numbers
import os
import re
import stat

import keras
import numpy as np

from kmp.backup import _atomic_files

# A backup's number as kmp writes it (`f"{n:06d}"`): six digits, or more
# without a leading zero, and at most 18 (a file name's length is bounded; no
# run saves 10**18 times). A user's `backup-1.weights.h5` is not kmp's, and
# is neither read nor deleted.
_NUMBER = r"([0-9]{6}|[1-9][0-9]{6,17})"
# `\Z`, not `$`: `$` also matches before a final newline.
BACKUP_PATTERN = re.compile(rf"\Abackup-{_NUMBER}\.weights\.h5\Z", re.ASCII)
METADATA_NAME = "training_metadata.json"
# The temporary names `_atomic_files` gives the files of a backup folder
# (`.<stem>.partial-<pid>-<token><suffix>`, and without the token as kmp named
# them before), so that end of training and pruning delete those and no other
# hidden file.
BACKUP_PARTIAL_PATTERN = re.compile(
    rf"\A\.(backup-{_NUMBER}\.partial-[0-9]+(-[0-9a-f]{{16}})?\.weights\.h5"
    r"|training_metadata\.partial-[0-9]+(-[0-9a-f]{16})?\.json)\Z",
    re.ASCII,
)
# Larger than any metadata kmp writes (a few hundred bytes per monitor).
MAX_METADATA_BYTES = 1 << 20
MONITOR_ATTRIBUTES = ("best", "wait", "best_epoch", "stopped_epoch", "cooldown_counter")


def is_own_file(name):
    """Whether `name` in a backup folder is one kmp writes there."""
    return bool(
        name == METADATA_NAME
        or BACKUP_PATTERN.match(name)
        or BACKUP_PARTIAL_PATTERN.match(name)
    )


def backup_number(entry):
    """The `<n>` of the `backup-<n>.weights.h5` a metadata entry names; -1
    for no entry. Entries are validated (`check_metadata`) before this is
    asked, so each names its weights."""
    if not entry:
        return -1
    return int(BACKUP_PATTERN.match(entry["weights"]).group(1))


def monitors_argument(monitors):
    """`BackupAndRestore`'s `monitors` as a list; a `TypeError` for anything
    but `None` or a list (or tuple) of Keras callbacks."""
    if monitors is None:
        return []
    if not isinstance(monitors, (list, tuple)):
        raise TypeError(
            "`monitors` must be a list of Keras callbacks (e.g. EarlyStopping) "
            f"or None. Received: monitors={monitors!r} of type {type(monitors).__name__}"
        )
    for monitor in monitors:
        if not isinstance(monitor, keras.callbacks.Callback):
            raise TypeError(
                "`monitors` must be a list of Keras callbacks (e.g. "
                "EarlyStopping). Received an element "
                f"{monitor!r} of type {type(monitor).__name__}"
            )
    return list(monitors)


def monitor_state(monitor):
    """The JSON-able counters of a monitoring callback (`None` stays `None`)."""
    state = {}
    for name in MONITOR_ATTRIBUTES:
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


# A counter a Keras monitor makes in its own `on_train_begin`, after the
# backup is loaded: EarlyStopping's `best_epoch`.
_MADE_AT_TRAIN_BEGIN = ("best_epoch",)


def check_entry_monitors(monitors, entry, backup_dir, params):
    """Raises a `ValueError`, before the backup of a metadata `entry` is
    loaded, if its monitors' states are not those of `monitors`; nothing
    where no epoch of the `fit` whose `params` these are runs after the
    backup's, which restores no monitor then."""
    if entry["epoch"] < (params or {}).get("epochs", entry["epoch"] + 1):
        check_monitor_states(monitors, entry.get("monitors"), backup_dir)


def check_monitor_states(monitors, states, backup_dir, loaded=False):
    """Raises a `ValueError` if `states` (a metadata entry's `monitors`,
    checked by `check_metadata`; `None`: none recorded) are not those of
    `monitors`; changes nothing.

    Before the backup is loaded (`loaded=False`), each monitor is looked at
    as it is then: a counter it makes when training begins
    (`_MADE_AT_TRAIN_BEGIN`) is checked once the monitors began
    (`loaded=True`, by `restore_monitor_states`)."""
    if states is None:
        return
    if len(states) != len(monitors):
        raise ValueError(
            f"The backup in {backup_dir!r} holds the state of "
            f"{len(states)} monitors, but `monitors` has "
            f"{len(monitors)}. Pass the same callbacks as the run "
            "that wrote it."
        )
    for monitor, state in zip(monitors, states):
        # `check_metadata` admitted only the counters of
        # `MONITOR_ATTRIBUTES`, as numbers; each goes only to a monitor
        # that has it, as the monitor kmp read it from had.
        unknown = sorted(name for name in state if not hasattr(monitor, name)
                         and (loaded or name not in _MADE_AT_TRAIN_BEGIN))
        if unknown:
            raise ValueError(
                f"The backup in {backup_dir!r} holds {', '.join(unknown)} "
                f"for the monitor {type(monitor).__name__}, which has no such "
                "counter. Pass the same callbacks, in the same order, as the "
                "run that wrote it."
            )


def restore_monitor_states(monitors, states, backup_dir):
    """Sets each monitor's counters from `states`, once the monitors began
    training; a `ValueError` (`check_monitor_states`) changes nothing."""
    check_monitor_states(monitors, states, backup_dir, loaded=True)
    for monitor, state in zip(monitors, states):
        for name in MONITOR_ATTRIBUTES:
            if name in state:
                setattr(monitor, name, state[name])


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value, limit=300):
    """`repr(value)`, cut to `limit` characters."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _is_float_or_infinity(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return not math.isnan(float(value))
    except OverflowError:
        return False


def _check_monitor_states(states):
    """The problem with a metadata `monitors` entry, or `None`."""
    if not isinstance(states, list):
        return "a list of one object per monitor"
    for index, state in enumerate(states):
        if not isinstance(state, dict):
            return f"a list of objects (item {index} is not one)"
        for name, value in state.items():
            if name not in MONITOR_ATTRIBUTES:
                return (
                    f"counters among {', '.join(MONITOR_ATTRIBUTES)} (item "
                    f"{index} has {name!r})"
                )
            if name == "best":
                # Keras' own initial `best` is None or +-inf; NaN never is,
                # nor an integer no float holds (EarlyStopping compares it
                # with a float metric).
                ok = value is None or _is_float_or_infinity(value)
            else:
                ok = value is None or _is_count(value)
            if not ok:
                return (
                    f"numbers (item {index} has {name}={_shown(value, 40)}; `best` is a "
                    "number, the others are counts >= 0)"
                )
    return None


# The keys of a metadata entry: what each must be, and a check.
_METADATA_KEYS = {
    "epoch": ("an integer >= 0", _is_count),
    "batch": ("an integer >= 0", _is_count),
    "weights": (
        "a file name of the form backup-<n>.weights.h5 (no folder), <n> as kmp writes "
        "it: 6 digits, or 7 to 18 without a leading zero",
        lambda value: isinstance(value, str) and bool(BACKUP_PATTERN.match(value)),
    ),
    "sha256": (
        "64 lowercase hexadecimal digits",
        lambda value: isinstance(value, str) and bool(re.fullmatch(r"[0-9a-f]{64}", value)),
    ),
}


def check_metadata(metadata, path, prefix=""):
    """Raises a `ValueError` naming `path`, the key and the value for
    metadata that kmp would not have written."""

    def refuse(key, value, expected):
        raise ValueError(
            f"The backup metadata {path!r} is not valid: `{prefix}{key}` must "
            f"be {expected}. Received: {prefix}{key}={_shown(value)}. It was not "
            "written by kmp.callbacks.BackupAndRestore; nothing was restored. "
            "Delete the backup directory to start over."
        )

    if not isinstance(metadata, dict):
        raise ValueError(
            f"The backup metadata {path!r} is not valid: it must be a JSON "
            "object with the keys epoch, batch, weights, sha256, monitors and "
            f"previous. Received: {_shown(metadata, 80)}. "
            "Delete the backup directory to start over."
        )
    allowed = set(_METADATA_KEYS) | {"monitors"} | ({"previous"} if not prefix else set())
    for key in metadata:
        if key not in allowed:
            refuse(key, metadata[key], f"absent (the keys are {', '.join(sorted(allowed))})")
    if "epoch" not in metadata:
        refuse("epoch", None, "present, " + _METADATA_KEYS["epoch"][0])
    if "weights" not in metadata:
        # Keras' own BackupAndRestore writes `{"epoch", "batch"}` beside its
        # `latest.weights.h5`: a file kmp never wrote, so never reads.
        raise ValueError(
            f"The backup metadata {path!r} names no weights file (`{prefix}weights` "
            f"is absent), as the metadata of Keras' own BackupAndRestore does: "
            "kmp.callbacks.BackupAndRestore resumes only from the "
            "backup-<n>.weights.h5 files it wrote. Nothing was restored. Resume "
            "with the callback that wrote this folder, or give this run "
            "another backup_dir (or delete this one) to start over."
        )
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
        check_metadata(previous, path, prefix="previous.")


def read_metadata(path):
    """The checked metadata at `path` (a regular file, not a link), or
    `None` if there is none."""
    try:
        fd = _atomic_files.open_for_reading(path)
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
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_METADATA_BYTES:
            raise ValueError(
                f"The backup metadata {path!r} is not a regular file of at "
                f"most {MAX_METADATA_BYTES} bytes (size {info.st_size}); it "
                "was not written by kmp.callbacks.BackupAndRestore. Delete "
                "the backup directory to start over."
            )
        data = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
    finally:
        os.close(fd)
    try:
        metadata = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        # What was read is not shown: the file at this name may not be
        # one kmp wrote (a link to another file).
        raise ValueError(
            f"The backup metadata {path!r} is not valid JSON ({len(data)} "
            "bytes); it was not written by "
            "kmp.callbacks.BackupAndRestore, which replaces it atomically. "
            "Delete the backup directory to start over."
        ) from None
    check_metadata(metadata, path)
    return metadata


def write_metadata(path, metadata):
    """Replaces the metadata at `path` atomically."""
    _atomic_files.write_bytes_then_replace(path, json.dumps(metadata).encode())


def sha256_of_fd(fd):
    """The SHA-256 of the whole file open at `fd` (read from its start)."""
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    for block in iter(lambda: os.read(fd, 1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def sha256(path):
    """The SHA-256 of the file at `path`, opened without following a link."""
    fd = _atomic_files.open_for_reading(path)
    try:
        return sha256_of_fd(fd)
    finally:
        os.close(fd)


def variables_digest(model):
    """SHA-256 of the values of every variable a backup holds (the
    model's and the optimizer's; not the metrics', which `fit` resets
    at each epoch's start), with their paths, dtypes and shapes."""
    metrics = {id(v) for v in model.metrics_variables}
    variables = [v for v in model.variables if id(v) not in metrics]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    digest = hashlib.sha256()
    for variable in variables:
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(variable))
        digest.update(f"{variable.path}:{value.dtype}:{value.shape};".encode())
        digest.update(value.reshape(-1).view(np.uint8))
    return digest.hexdigest()
