"""Files that are complete or absent: written under a temporary name, flushed
to disk, then moved onto their final name with `os.replace`.

`os.replace` is atomic on POSIX and Windows, so a file with a final name is
always complete, and a process killed while writing leaves at most a
`.<stem>.partial-<pid>-<token><suffix>` file beside it. The temporary name
is new for every write (the pid and a random token) and the file is created
with `O_CREAT | O_EXCL | O_NOFOLLOW`: whatever already sits at a name (a file,
a link planted by someone who can write to the folder) makes the creation
fail and another name is drawn; nothing is ever followed, truncated or
written through.

`kmp.checkpoint.write_atomically` is the public entry point; the backup
folders of `kmp.callbacks.BackupAndRestore` use these directly.
"""

import errno
import os
import secrets

NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NON_BLOCK = getattr(os, "O_NONBLOCK", 0)
PARTIAL_MARK = ".partial"


def split_suffix(filepath):
    """`("dir/name", ".weights.h5")` for Keras' two-part suffix, else splitext."""
    for suffix in (".weights.h5", ".weights.json"):
        if filepath.endswith(suffix):
            return filepath[: -len(suffix)], suffix
    return os.path.splitext(filepath)


def not_a_folder(folder):
    """The nearest of `folder` and its parents that exists, if it is not a
    folder (a file, a broken link): what stops `os.makedirs(folder)`.
    `None` where the folder exists or can be made."""
    folder = os.path.abspath(folder)
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    return None if os.path.isdir(folder) else folder


def same_file(a, b):
    """Whether two `os.stat` results are of one file."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_for_reading(path):
    """A read-only descriptor of `path`, opened without following a link and
    without waiting: opening a FIFO planted at a name kmp reads would
    otherwise wait forever for a writer. Callers refuse what `os.fstat`
    says is not a regular file (on which `O_NONBLOCK` changes nothing)."""
    return os.open(path, os.O_RDONLY | NO_FOLLOW | CLOEXEC | NON_BLOCK)


def fsync_path(path, directory=False):
    """Flushes `path` (a file, or a folder's entries) to disk, where the OS
    lets a process open it; a no-op otherwise."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags | NO_FOLLOW)
    except OSError:
        return  # Directories cannot be opened on Windows; replace is still atomic.
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _partial_name(filepath):
    """A fresh temporary name beside `filepath`, with its suffix."""
    stem, suffix = split_suffix(filepath)
    directory, name = os.path.split(stem)
    return os.path.join(
        directory,
        f".{name}{PARTIAL_MARK}-{os.getpid()}-{secrets.token_hex(8)}{suffix}",
    )


def create_partial(filepath):
    """Creates a new, empty temporary file beside `filepath`; returns `(fd, path)`.

    The name carries the pid and a random token, and the file is created
    with `O_CREAT | O_EXCL | O_NOFOLLOW`: whatever already sits at a name
    makes the creation fail and another name is drawn. The mode is `0o666`
    less the umask, as for `open(path, "w")`.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW | CLOEXEC
    for _ in range(100):
        partial = _partial_name(filepath)
        try:
            return os.open(partial, flags, 0o666), partial
        except FileExistsError:
            continue
    raise FileExistsError(
        errno.EEXIST, "No free temporary name after 100 random draws", partial
    )


def open_replacing(filepath, **open_kwargs):
    """A text file open for writing (`open`'s `open_kwargs`): a new empty
    file moved onto `filepath`, whatever sat there (a file, a link) replaced,
    never truncated or written through, as `open(filepath, "w")` would. For
    files written as they go (a CSV a row at a time), which cannot be moved
    into place once complete."""
    fd, partial = create_partial(os.fspath(filepath))
    try:
        os.replace(partial, filepath)
    except BaseException:
        os.close(fd)
        os.remove(partial)
        raise
    return os.fdopen(fd, "w", **open_kwargs)


def write_then_replace(filepath, write_fd=None, write_path=None):
    """Writes a new file and moves it onto `filepath`; returns `filepath`.

    The file is written through its descriptor (`write_fd(fd)`) or, for
    writers that want a path (Keras' savers), through the path of the file
    just created (`write_path(path)`), flushed, then `os.replace`d onto
    `filepath`. If anything raises, the temporary file is removed and
    `filepath` is left as it was.
    """
    fd, partial = create_partial(filepath)
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
            fsync_path(partial)
        os.replace(partial, filepath)
    except BaseException:
        if fd is not None:
            os.close(fd)
        if os.path.lexists(partial):
            os.remove(partial)
        raise
    fsync_path(os.path.dirname(filepath) or ".", directory=True)
    return filepath


def write_bytes_then_replace(filepath, data):
    """`write_then_replace` of the bytes `data`; returns `filepath`."""

    def write(fd):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    return write_then_replace(filepath, write_fd=write)


def link_then_replace(source, target):
    """Hard links `source` at `target`, atomically (a link under a temporary
    name, then `os.replace`); `False` where the file system has no hard
    links, `True` once linked."""
    for _ in range(100):
        partial = _partial_name(target)
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
    fsync_path(os.path.dirname(target) or ".", directory=True)
    return True
