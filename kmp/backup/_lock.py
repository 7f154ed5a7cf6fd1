"""One run per backup folder: an exclusive `flock` on `<folder>/kmp-backup.lock`.

The OS drops the lock when the holding process dies, however it dies
(SIGKILL included), so a killed run never leaves a folder locked. The lock
file holds the holder's pid, host and start time, for the error that refuses
a second run. Within one process the latest holder takes the lock over (see
`FolderLock.acquire`).
"""

import datetime
import errno
import json
import os
import socket
import stat

from kmp.backup import _atomic_files

try:
    import fcntl
except ImportError:  # Windows: no flock; a second run is not refused there.
    fcntl = None

LOCK_NAME = "kmp-backup.lock"

# The backup folders this process holds, by real path of the lock file: a
# second `fit` in this process (a notebook cell run again after an interrupted
# one, with a new callback) takes the lock over instead of being refused by
# its own process.
_HELD_LOCKS = {}


class FolderLock:
    """An exclusive `flock` on `<folder>/kmp-backup.lock`, held for `owner`."""

    def __init__(self, folder):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.fd = None
        self.owner = None

    @classmethod
    def acquire(cls, folder, owner):
        """Locks `folder` for `owner`, or takes over this process's lock.

        Raises:
            RuntimeError: if another process holds the lock (naming it).
            ValueError: if the lock file is not a regular file.
        """
        path = os.path.realpath(os.path.join(folder, LOCK_NAME))
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
            return _atomic_files.same_file(os.fstat(self.fd), os.lstat(self.path))
        except OSError:
            return False

    def _acquire(self):
        flags = os.O_RDWR | os.O_CREAT | _atomic_files.NO_FOLLOW | _atomic_files.CLOEXEC
        # A lock file deleted by its holder at the end of its training
        # between our open and our flock is not the folder's lock any more:
        # open again (a few times at most; each retry means a run just ended).
        for _ in range(10):
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as error:
                if os.path.islink(self.path):
                    raise ValueError(
                        f"The backup lock {self.path!r} is a symbolic link; it "
                        "must be the regular file kmp creates there. Delete it "
                        f"if no run uses {self.folder!r}."
                    ) from None
                raise ValueError(
                    f"The backup lock {self.path!r} cannot be created or opened "
                    f"({error}): kmp needs to write it in the backup folder "
                    f"{self.folder!r}."
                ) from None
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 0:
                os.close(fd)  # Deleted by its holder since our open.
                continue
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                # A hard link is a regular file too, but its other name may
                # be anybody's file: kmp writes its name into the lock.
                os.close(fd)
                raise ValueError(
                    f"The backup lock {self.path!r} is not a regular file of "
                    "its own (" + (
                        f"it has {info.st_nlink} names: hard links"
                        if stat.S_ISREG(info.st_mode) else "a folder, FIFO or device"
                    ) + "); kmp writes only into the lock file it creates. "
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
                if _atomic_files.same_file(os.fstat(fd), os.lstat(self.path)):
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
        """Unlocks, keeping the lock file."""
        if self.fd is not None:
            os.close(self.fd)  # Closing the last descriptor releases the flock.
            self.fd = None
        for path, lock in list(_HELD_LOCKS.items()):
            if lock is self:
                del _HELD_LOCKS[path]


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
