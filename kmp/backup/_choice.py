"""Which backup `kmp.callbacks.BackupAndRestore` restores.

One process restores the newest backup its metadata names that loads (the
latest, else the previous one, with a warning). Several workers restore the
same backup: the newest one that every worker holds, agreed on through
all-gathers that every worker makes at the same point (why such a backup
always exists: the end of `kmp/checkpoint.py`'s docstring).
"""

import warnings

from kmp.backup import _records as _backup_records
from kmp.backup import _restore as _backup_restore

# What a worker whose metadata cannot be read reports as its latest backup.
UNREADABLE = -2


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


def restore_agreed(read_candidates, restore, commit, gather, backup_dir, check=None):
    """Restores the same backup on every worker: the newest one that
    every worker holds (as its latest or its previous backup).

    Three all-gathers (`gather(int) -> {task name: int}`), at the same point
    on every worker: the latest backup numbers, the previous ones, then
    whether each restore succeeded, so that a worker that cannot restore
    stops every worker, not only itself (rather than leaving them waiting
    for it in a collective). With `check`, one more before the restore:
    whether each worker's backup passed `check`; where loading is itself a
    collective (JAX places each value on every process's devices at once),
    a worker that cannot load its file must stop every worker before any
    starts to load, or the others would wait for it there.

    Args:
        read_candidates: Callable returning this worker's metadata entries,
            latest first.
        restore: Callable restoring one entry.
        commit: Callable making the restored entry (or `None`: none) the
            latest, when it is older than this worker's latest.
        gather: Callable, the all-gather of one integer over the workers.
        backup_dir: String. The callback's `backup_dir`, for the messages.
        check: Optional callable checking one entry's file before any worker
            loads (its checksum). Defaults to `None`: no such round.

    Raises:
        ValueError: if the workers hold no backup in common, or a worker
            could not read its metadata or restore (this one: its own error).
    """
    try:
        candidates = read_candidates()
        latest, error = _backup_records.backup_number(candidates[0] if candidates else None), None
        previous = _backup_records.backup_number(candidates[1] if len(candidates) > 1 else None)
    except (OSError, ValueError) as read_error:
        candidates, latest, previous, error = [], UNREADABLE, UNREADABLE, read_error
    latests = gather(latest)
    previouses = gather(previous)
    if error is not None:
        raise error
    unreadable = sorted(name for name, n in latests.items() if n == UNREADABLE)
    if unreadable:
        raise _other_workers_failed(unreadable, "read its backup metadata", backup_dir)
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
    # In this worker's own `held`, so a candidate (or none, for -1).
    chosen = next(
        (c for c in candidates if _backup_records.backup_number(c) == target), None
    )

    def on_every_worker(step):
        # `step(chosen)` here, then all agree: any worker's failure stops all.
        error = None
        if chosen is not None:
            try:
                step(chosen)
            except (OSError, ValueError) as step_error:
                error = step_error
        succeeded = gather(error is None)
        if error is not None:
            raise error
        failed = sorted(name for name, ok in succeeded.items() if not ok)
        if failed:
            raise _other_workers_failed(failed, f"restore backup {target}", backup_dir)

    if check is not None:
        on_every_worker(check)
    on_every_worker(restore)
    if target < latest:
        commit(chosen)


def _other_workers_failed(names, what, backup_dir):
    return ValueError(
        f"{', '.join(names)} could not {what} under {backup_dir!r} "
        "(its own error, in its log, says why). Every worker stops: "
        "workers resumed from different states would train a different "
        "model."
    )
