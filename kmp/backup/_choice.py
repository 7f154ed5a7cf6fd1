"""Which backup `kmp.callbacks.BackupAndRestore` restores.

One process restores the newest backup its metadata names that loads (the
latest, else the previous one, with a warning). Several workers restore the
same backup: the newest one that every worker holds, agreed on through
all-gathers that every worker makes at the same point (why such a backup
always exists: the end of `kmp/checkpoint.py`'s docstring).

Every step of a restore that one worker can fail (locking its folder,
reading its metadata, checking and loading its file) is a round that every
worker takes: each runs the step, then all-gather whether it succeeded, and
if any worker failed, all-gather the failures' messages, so that every
worker raises the same error, naming the workers that failed and why. No
worker is left waiting in a collective for one that stopped.
"""

import warnings

from kmp.backup import _records as _backup_records
from kmp.backup import _restore as _backup_restore

# What a worker whose metadata cannot be read reports as its latest backup.
UNREADABLE = -2
# What a worker whose folder another run holds (its lock refused) reports.
REFUSED = -3
# How much of each failed worker's message reaches the others: its first
# bytes (UTF-8), in one fixed-size all-gather (every worker sends as many).
MESSAGE_BYTES = 4096
# The failed workers whose messages an error quotes; the others are named.
QUOTED_WORKERS = 3


def held_backups(latest, previous):
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


def restore_newest(candidates, restore, commit, folder):
    """Restores the first backup that loads, for one process.

    Args:
        candidates: List of the metadata entries, latest first.
        restore: Callable restoring one entry.
        commit: Callable making an entry the latest backup: a fallback to
            the previous one is committed, with a warning.
        folder: String. The folder, for the messages.

    Raises:
        UnsafeBackupError: at once, for a backup that is not a regular file.
        OSError, ValueError: if no candidate loads (the error, or all).
    """
    errors = []
    for candidate in candidates:
        try:
            restore(candidate)
        except _backup_restore.UnsafeBackupError:
            raise  # Planted, not damaged: no fallback to another file.
        except (OSError, ValueError) as error:
            errors.append(error)
            continue
        if errors:
            warnings.warn(
                f"Resuming from the previous backup in {folder!r} "
                f"(epoch {candidate['epoch']}): the latest could not be "
                f"restored. {errors[0]}",
                stacklevel=2,
            )
            commit(candidate)
        return
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ValueError(
            f"No complete backup could be restored from {folder!r}. "
            "Tried: " + " ".join(str(error) for error in errors)
        )


def restore_agreed(
    read_candidates, restore, commit, gather, backup_dir, *, lock, gather_bytes, check=None
):
    """Restores the same backup on every worker: the newest one that
    every worker holds (as its latest or its previous backup).

    Each round is an all-gather that every worker makes at the same point
    (`gather(int) -> {task name: int}`):

    ```
    lock this worker's folder, read its metadata
    gather the latest backup numbers (REFUSED, UNREADABLE: that failed),
        then the previous ones; any failure: stop together
    target = the newest backup every worker holds (none in common: the
        same error on every worker, from what was gathered)
    with `check`: check the file, gather whether it passed (a failure: stop
        together); gather what variables each file holds: not the same on
        every worker, the same error on every worker, before any loads
    restore the target (and make it the latest, if it is older), gather
        whether that succeeded (a failure: stop together)
    stop together: gather the failed workers' messages (their first
        MESSAGE_BYTES bytes, through `gather_bytes`), and raise on every
        worker the same error, naming each failed worker, what it could not
        do and its message; a failed worker chains its own error to it
    ```

    With `check`, loading is itself a collective (JAX places each value on
    every process's devices at once, checking that every process gave the
    same value): a worker that fails before it loads must stop every worker
    before any starts to load, or the others would wait for it there, and
    files holding the same variables make every worker's load take the same
    steps (Keras checks each variable's shape before placing it), so that
    they fail together, at the same variable, or not at all.

    Args:
        read_candidates: Callable returning this worker's metadata entries,
            latest first.
        restore: Callable restoring one entry.
        commit: Callable making the restored entry (or `None`: none) the
            latest, when it is older than this worker's latest.
        gather: Callable, the all-gather of one integer over the workers.
        backup_dir: String. The callback's `backup_dir`, for the messages.
        lock: Callable locking this worker's folder; a refusal (another run
            holds it) is agreed on like any other failure.
        gather_bytes: Callable, the all-gather of `MESSAGE_BYTES` bytes over
            the workers (`{task name: bytes}`).
        check: Optional callable checking one entry's file before any worker
            loads (its checksum) and returning `(layout, description)`: a
            text that two workers' files share exactly when they hold the
            same variables, and one that says what the file holds. Defaults
            to `None`: no such rounds.

    Raises:
        RuntimeError: on every worker, if a worker's folder could not be
            locked.
        ValueError: on every worker, if the workers hold no backup in
            common, or hold different variables in it, or a worker could
            not read its metadata or restore.
    """
    error, candidates = None, []
    try:
        lock()
    except Exception as lock_error:  # Any: a worker that stops alone hangs the others.
        latest = previous = REFUSED
        error = lock_error
    else:
        try:
            candidates = read_candidates()
            latest = _backup_records.backup_number(candidates[0] if candidates else None)
            previous = _backup_records.backup_number(
                candidates[1] if len(candidates) > 1 else None)
        except Exception as read_error:
            candidates, latest, previous, error = [], UNREADABLE, UNREADABLE, read_error
    latests = gather(latest)
    previouses = gather(previous)
    failed = {
        name: "lock its backup folder" if n == REFUSED else "read its backup metadata"
        for name, n in latests.items() if n in (REFUSED, UNREADABLE)
    }
    if failed:
        refused = REFUSED in latests.values()
        _stop_together(failed, gather_bytes, error, backup_dir,
                       RuntimeError if refused else ValueError)
    held = {
        name: held_backups(latests[name], previouses.get(name, -1))
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
            f"The workers' backups under {backup_dir!r} have no backup "
            f"in common, so they are not from the same run: {listed}. "
            "Give every worker the `backup_dir` it had when the backups "
            "were written, or delete every worker's backup folder to start "
            "over."
        )
    target = max(common)
    # In this worker's own `held`, so a candidate (or none, for -1, on
    # every worker).
    chosen = next(
        (c for c in candidates if _backup_records.backup_number(c) == target), None
    )
    what = f"restore backup {target}"

    def on_every_worker(step):
        # `step()` here, then all agree: any worker's failure stops all.
        result = error = None
        try:
            result = step()
        except Exception as step_error:
            error = step_error
        succeeded = gather(error is None)
        failed = {name: what for name, ok in succeeded.items() if not ok}
        if failed:
            _stop_together(failed, gather_bytes, error, backup_dir)
        return result

    def restore_then_commit():
        if chosen is not None:
            restore(chosen)
        # In the round too: a worker that cannot rewrite its metadata would
        # otherwise stop alone, after the others had gone on to train.
        if target < latest:
            commit(chosen)

    if check is not None:
        checked = on_every_worker(lambda: None if chosen is None else check(chosen))
        if chosen is not None:
            layout, description = checked
            layouts = _gather_texts(gather_bytes, layout)
            if len(set(layouts.values())) > 1:
                raise ValueError(_not_one_model(
                    _gather_texts(gather_bytes, description), target, backup_dir))
    on_every_worker(restore_then_commit)


# The end of every error that stops every worker.
_EVERY_WORKER_STOPS = (
    "Every worker stops with this error: the workers train together, from one "
    "state, or not at all."
)


def _by_index(name):
    """Sorts task names by kind, then index: `process-2` before `process-10`."""
    kind, _, index = name.rpartition("-")
    return kind, int(index) if index.isdigit() else -1, name


def _gather_texts(gather_bytes, text):
    """`{task name: text}` over the workers: each text's first
    `MESSAGE_BYTES` bytes of UTF-8, in one all-gather of that many bytes."""
    data = text.encode("utf-8")
    if len(data) > MESSAGE_BYTES:
        # A character cut in two is dropped when decoded.
        data = data[: MESSAGE_BYTES - 3] + b"..."
    gathered = gather_bytes(data.ljust(MESSAGE_BYTES, b"\0"))
    return {
        name: bytes(raw).rstrip(b"\0").decode("utf-8", "ignore")
        for name, raw in gathered.items()
    }


def _message_of(error):
    """What a failed worker tells the others: its error's message (kmp's
    own errors say what failed; any other error says its type too)."""
    message = str(error).strip()
    if message and isinstance(error, (OSError, ValueError, RuntimeError)):
        return message
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _stop_together(failed, gather_bytes, own_error, backup_dir, error_class=ValueError):
    """Raises on every worker the same `error_class`: each of the `failed`
    workers (`{task name: what it could not do}`) with its message, gathered
    here from the failed workers (`own_error`: this worker's, or `None`)."""
    messages = _gather_texts(
        gather_bytes, "" if own_error is None else _message_of(own_error))
    names = sorted(failed, key=_by_index)
    parts = [
        f"{name} could not {failed[name]} under {backup_dir!r}: "
        + (messages.get(name) or "(its error did not reach this worker; its log says why).")
        for name in names[:QUOTED_WORKERS]
    ]
    if len(names) > QUOTED_WORKERS:
        parts.append(f"{', '.join(names[QUOTED_WORKERS:])} failed too.")
    parts.append(_EVERY_WORKER_STOPS)
    raise error_class(" ".join(parts)) from own_error


def _not_one_model(descriptions, target, backup_dir, shown=6):
    """The error for workers whose files of backup `target` hold different
    variables (`descriptions`: what each one's file holds)."""
    names = sorted(descriptions, key=_by_index)
    listed = "; ".join(f"{name}: {descriptions[name]}" for name in names[:shown])
    if len(names) > shown:
        listed += f"; and {len(names) - shown} more"
    return (
        f"The workers' backup {target} under {backup_dir!r} does not hold the "
        "same variables on every worker, so its files are not one model's: "
        f"{listed}. Loading them would stop the workers at different points "
        "of a load they make together; nothing was loaded. Give every worker "
        "the `backup_dir` it had when the backups were written, or delete "
        "every worker's backup folder to start over. " + _EVERY_WORKER_STOPS
    )
