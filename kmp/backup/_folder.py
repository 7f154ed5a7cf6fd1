"""One process's backup folder of `kmp.callbacks.BackupAndRestore`: what it
writes there, and in which order.

A backup's weights go to a new file, `backup-<n>.weights.h5`, completed and
renamed atomically (`_atomic_files`); then the metadata naming it and its
SHA-256 (`_backup_records`) is replaced; then what the metadata no longer
names is pruned. A kill at any point leaves the metadata naming a complete
backup. Only this process writes in its folder, and it deletes nothing there
but the files it writes (`_backup_records.is_own_file`).
"""

import os
import stat

from kmp.backup import _atomic_files
from kmp.backup import _lock as _backup_lock
from kmp.backup import _records as _backup_records


def check_backup_dir(backup_dir):
    """Raises Keras' `ValueError` for an empty `backup_dir` (`None`, `""`),
    and a `TypeError` for one that is not a path: `BackupAndRestore` calls it
    before Keras' constructor, and before it makes its `BackupFolder`."""
    if backup_dir is None or (isinstance(backup_dir, str) and not backup_dir):
        raise ValueError("Empty `backup_dir` argument passed")
    if not isinstance(backup_dir, (str, os.PathLike)):
        raise TypeError(
            "`backup_dir` must be a folder's path (str or os.PathLike). "
            f"Received: backup_dir={backup_dir!r} of type {type(backup_dir).__name__}"
        )


class BackupFolder:
    """The folder where this process keeps its backups: `backup_dir` until
    `use` names another (a worker's folder inside it).

    Args:
        backup_dir: String. The callback's `backup_dir`.
    """

    def __init__(self, backup_dir):
        self.backup_dir = backup_dir
        self.use(backup_dir)
        # Kept across `use`: a lock a `fit` that raised left held is released
        # or taken over by the next `fit`.
        self._lock = None

    def use(self, path):
        """Makes `path` this process's folder (`backup_dir`, or a worker's)."""
        self.path = path
        self.metadata_path = os.path.join(path, _backup_records.METADATA_NAME)

    def lock(self, owner):
        """Creates the folder and locks it for `owner` (`_backup_lock`)."""
        blocking = _atomic_files.not_a_folder(self.path)
        if blocking is not None:
            raise ValueError(
                f"`backup_dir` must be a folder, or a path where one can be made, "
                f"but {blocking!r} is not a folder. Received: backup_dir={self.backup_dir!r}"
            )
        os.makedirs(self.path, exist_ok=True)
        if os.path.islink(self.path) and self.path != self.backup_dir:
            # A worker's folder is kmp's own: a link there was planted.
            raise ValueError(
                f"The worker's backup folder {self.path!r} is a symbolic "
                "link; kmp creates it as a folder. Delete it to start over."
            )
        self._lock = _backup_lock.FolderLock.acquire(self.path, owner=owner)

    def release(self, owner):
        """Unlocks the folder and deletes the lock file, if `owner` holds it."""
        if self._lock is not None:
            self._lock.release(owner=owner)
            self._lock = None

    def read_metadata(self):
        """The checked metadata of the folder, or `None`."""
        return _backup_records.read_metadata(self.metadata_path)

    def candidates(self):
        """The backups the metadata names, latest first."""
        metadata = self.read_metadata()
        if metadata is None:
            return []
        return [metadata] + ([metadata["previous"]] if metadata.get("previous") else [])

    def commit_restored(self, entry):
        """Makes the backup just restored the latest one (`None`: none).

        The next backup is numbered after the latest the metadata names, so
        after this every worker numbers its backups alike again; the newer
        backup file, no longer named, goes at the next save.
        """
        if entry is None:
            os.remove(self.metadata_path)
            return
        entry = dict(entry)
        entry.pop("previous", None)
        _backup_records.write_metadata(self.metadata_path, entry)

    def write_backup(self, model, record, keep_previous, replacing=None, same_weights=False):
        """Writes a backup of `model` and commits it; returns its metadata entry.

        Args:
            model: The `keras.Model` whose weights (and optimizer) are saved.
            record: Dict. `epoch`, `batch` and `monitors` (the monitors'
                states) of the entry.
            keep_previous: Bool. Keep the previous backup as `previous`.
            replacing: Optional dict. The entry of the latest backup, written
                at this epoch's end, that this one replaces (it then keeps
                that entry's `previous`: the previous epoch's backup, as
                Keras' `double_checkpoint` keeps).
            same_weights: Bool. The variables have not changed since
                `replacing` was written, so its weights file is hard linked
                under the new name rather than saved again (saved, if the
                file system has no hard links).
        """
        os.makedirs(self.path, exist_ok=True)
        latest = self.read_metadata()
        # Numbered from the metadata, not from the folder listing: a file a
        # killed save completed but never committed is not counted, so every
        # worker numbers its backups alike.
        weights_name = f"backup-{_backup_records.backup_number(latest) + 1:06d}.weights.h5"
        weights_path = os.path.join(self.path, weights_name)
        replaces_latest = (
            replacing is not None
            and latest is not None
            and latest.get("weights") == replacing["weights"]
        )
        checksum = {}
        if replaces_latest and same_weights and _atomic_files.link_then_replace(
            os.path.join(self.path, replacing["weights"]), weights_path
        ):
            checksum["sha256"] = replacing["sha256"]
        else:

            def write_weights(path):
                model.save_weights(path, overwrite=True)
                checksum["sha256"] = _backup_records.sha256(path)

            _atomic_files.write_then_replace(weights_path, write_path=write_weights)
        metadata = {
            "epoch": record["epoch"],
            "batch": record["batch"],
            "weights": weights_name,
            "sha256": checksum["sha256"],
            "monitors": record["monitors"],
        }
        # The backup kept as `previous`: the latest one, or, when this one
        # replaces the latest (same epoch), the one before it.
        before = latest.get("previous") if replaces_latest else latest
        if keep_previous and before and "weights" in before:
            before = dict(before)
            before.pop("previous", None)
            metadata["previous"] = before
        _backup_records.write_metadata(self.metadata_path, metadata)
        keep = {weights_name}
        if "previous" in metadata:
            keep.add(metadata["previous"]["weights"])
        self._prune(keep)
        return metadata

    def _prune(self, keep):
        """Deletes the backups not in `keep`, and partial files left by a
        process killed while saving: only this process writes here."""
        for name in os.listdir(self.path):
            if (_backup_records.BACKUP_PATTERN.match(name) and name not in keep) or (
                _backup_records.BACKUP_PARTIAL_PATTERN.match(name)
            ):
                path = os.path.join(self.path, name)
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.remove(path)

    def delete_own_files(self):
        """Deletes what kmp wrote in the folder, by kmp's names: the
        metadata first (so a kill part-way leaves no metadata naming a
        deleted file), then the backups and partial files. Anything else
        (the user's files, another worker's folder) is never touched."""
        if not os.path.isdir(self.path):
            return
        names = sorted(
            os.listdir(self.path), key=lambda name: name != _backup_records.METADATA_NAME
        )
        for name in names:
            if not _backup_records.is_own_file(name):
                continue
            path = os.path.join(self.path, name)
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.remove(path)  # A link goes, never what it points to.
            except FileNotFoundError:
                pass

    def remove_empty_folders(self):
        """Removes the folder, then `backup_dir` (a worker's folder is
        inside it), each only if empty and never the working directory; the
        last worker to finish removes `backup_dir`."""
        folders = [self.path]
        if self.path != self.backup_dir:
            folders.append(self.backup_dir)
        for folder in folders:
            try:
                if os.path.samefile(folder, os.getcwd()):
                    continue
                os.rmdir(folder)
            except OSError:
                pass  # Not empty (other files, another worker's), or gone.
