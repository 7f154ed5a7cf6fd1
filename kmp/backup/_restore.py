"""Restoring one backup of `kmp.callbacks.BackupAndRestore`: its file opened
without following a link, its SHA-256 checked against the metadata's, then
its weights loaded strictly (a variable Keras would skip is an error).
"""

import hashlib
import json
import os
import stat
import tempfile
import warnings

from kmp.backup import _atomic_files
from kmp.backup import _records as _backup_records
from kmp.scaling import _optimizers


class UnsafeBackupError(ValueError):
    """A backup path that is not a regular file kmp wrote (a link, a
    folder): refused outright, never a reason to fall back to another."""


def _open_backup(folder, name, metadata_path):
    """A read-only descriptor of backup `name`: a regular file in `folder`,
    opened without following a link."""
    path = os.path.join(folder, name)
    refusal = (
        f"The backup metadata {metadata_path!r} names "
        f"weights={name!r}, but {path!r} is {{}}; kmp reads only the regular "
        f"files it wrote in {folder!r}. Nothing was restored. Delete "
        "the backup directory to start over."
    )
    try:
        fd = _atomic_files.open_for_reading(path)
    except OSError as error:
        if os.path.islink(path):
            raise UnsafeBackupError(refusal.format("a symbolic link")) from None
        raise ValueError(
            f"The backup file {path!r} named by "
            f"{metadata_path!r} cannot be read: {error}"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeBackupError(refusal.format("not a regular file"))
    return fd, path


def check_backup(folder, candidate, backup_dir, *, warn_unchecked=True):
    """Opens the backup a metadata entry names, without following a link,
    and checks its SHA-256 against the entry's.

    Args:
        folder: `_backup_folder.BackupFolder`, where the backup lies.
        candidate: Dict. The checked metadata entry of the backup.
        backup_dir: String. The callback's `backup_dir`, for the messages.
        warn_unchecked: Bool. Warn about a backup without a checksum (an
            older kmp's). Defaults to `True`.

    Returns:
        `(os.stat_result, path)` of the file checked.

    Raises:
        UnsafeBackupError: if the file is a link or not a regular file.
        ValueError: if the file cannot be read or its SHA-256 differs from
            the entry's.
    """
    metadata_path = folder.metadata_path
    fd, weights_path = _open_backup(folder.path, candidate["weights"], metadata_path)
    try:
        checked = os.fstat(fd)
        expected = candidate.get("sha256")
        if expected is None and warn_unchecked:
            warnings.warn(
                f"The backup {weights_path!r} has no checksum in "
                f"{metadata_path!r} (it was written by an older kmp); it is "
                "restored without an integrity check.",
                # BackupAndRestore's `_kmp_load_backup`, past `load_backup`,
                # the choice of backup and the callback's `_restore`.
                stacklevel=5,
            )
        elif expected is not None and _backup_records.sha256_of_fd(fd) != expected:
            # The digest of what was read is not printed: the file at
            # this name may not be one kmp wrote.
            raise ValueError(
                f"The backup file {weights_path!r} is damaged: its SHA-256 "
                f"checksum differs from the one "
                f"{metadata_path!r} recorded ({expected}) when "
                "the file was written. Resuming from it would continue "
                "from weights that were never trained. Put back an intact "
                f"copy of the file, or delete {backup_dir!r} to start "
                "over."
            )
    finally:
        os.close(fd)
    return checked, weights_path


def load_backup(model, folder, candidate, backup_dir):
    """Checks the file and checksum of the backup a metadata entry names,
    then loads it into `model` strictly.

    Args:
        model: The `keras.Model` to load into (its optimizer is built first).
        folder: `_backup_folder.BackupFolder`, where the backup lies.
        candidate: Dict. The checked metadata entry of the backup.
        backup_dir: String. The callback's `backup_dir`, for the messages.

    Raises:
        UnsafeBackupError: if the file is a link, not a regular file, or
            replaced while it was checked.
        ValueError: if the file cannot be read, its SHA-256 differs from the
            entry's, or it does not match the model.
    """
    checked, weights_path = check_backup(folder, candidate, backup_dir)
    _build_saved_optimizers(model, weights_path)
    # Keras opens the file again by its name: it must still be the file
    # just checked.
    if not _atomic_files.same_file(checked, os.lstat(weights_path)):
        raise UnsafeBackupError(
            f"The backup file {weights_path!r} was replaced while it was "
            "being checked; nothing was restored."
        )
    try:
        load_weights_strictly(model, weights_path)
    except OSError as error:
        raise ValueError(
            f"The backup file {weights_path!r} cannot be loaded: {error}"
        ) from None


def _build_saved_optimizers(model, weights_path):
    """Builds each unbuilt optimizer of `model` that the backup holds built
    (more variables under its attribute's name than it has now), as the saved
    run had: `model.optimizer` with the model's trainable variables, as Keras'
    fit does. An optimizer a model's own `compile` sets (a GAN's
    `d_optimizer`) is built by the model's own step, with variables only that
    step knows: a backup that holds it built needs it built before `fit`.

    Raises:
        ValueError: naming those optimizers and the line that builds them.
    """
    try:
        stored = _h5_variables(weights_path)
    except OSError:
        return  # the load says what is wrong with the file
    unbuilt = []
    for name, optimizer in _optimizers.optimizers_by_attribute(model).items():
        held = sum(1 for path in stored if path.startswith(f"{name}/vars/"))
        if optimizer.built or held <= len(optimizer.variables):
            continue
        if name == "optimizer":
            optimizer.build(model.trainable_variables)
        else:
            unbuilt.append(name)
    if unbuilt:
        one = len(unbuilt) == 1
        raise ValueError(
            f"The backup {weights_path!r} holds the state of the model's "
            + ", ".join(f"`{name}`" for name in unbuilt)
            + f", which {'is' if one else 'are'} not built yet: resuming would start "
            f"{'it' if one else 'them'} afresh. Build {'it' if one else 'each'} with the "
            f"variables it updates before `fit`, e.g. `self.{unbuilt[0]}.build("
            "self.discriminator.trainable_variables)` in the model's `compile`. "
            "Nothing was restored."
        )


def _h5_layout(path):
    """`{dataset path: (shape, dtype)}` of a Keras weights file."""
    import h5py

    variables = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, item: variables.__setitem__(name, (tuple(item.shape), item.dtype.str))
            if isinstance(item, h5py.Dataset)
            else None
        )
    return variables


def _h5_variables(path):
    """`{dataset path: shape}` of a Keras weights file."""
    return {name: shape for name, (shape, _) in _h5_layout(path).items()}


def check_backup_variables(folder, candidate, backup_dir):
    """`check_backup` (no warning for a backup without a checksum), then
    what the file holds, for workers whose loading is a collective to
    compare before any of them loads: files that hold the same variables
    make every worker's load take the same steps.

    Args:
        folder: `_backup_folder.BackupFolder`, where the backup lies.
        candidate: Dict. The checked metadata entry of the backup.
        backup_dir: String. The callback's `backup_dir`, for the messages.

    Returns:
        `(layout, description)`: the SHA-256 (hexadecimal) of the variables'
        paths, shapes and dtypes in the file, and
        `"'<file>' holds <n> variables (layout <its first 12 digits>)"`.

    Raises:
        UnsafeBackupError, ValueError: as `check_backup`; ValueError too if
            the file cannot be read as a Keras weights file.
    """
    _, weights_path = check_backup(folder, candidate, backup_dir, warn_unchecked=False)
    try:
        variables = _h5_layout(weights_path)
    except OSError as error:
        raise ValueError(
            f"The backup file {weights_path!r} cannot be read as a Keras "
            f"weights file: {error}"
        ) from None
    layout = hashlib.sha256(json.dumps(sorted(variables.items())).encode()).hexdigest()
    return layout, (
        f"{weights_path!r} holds {len(variables)} variables (layout {layout[:12]})"
    )


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


def _why_keras_failed(message, limit=1500):
    """Keras' message about a load that failed, on one line, with the error
    it gives as an example (the real cause: a shape, a value JAX refused to
    place on the devices) and without its list of every object that failed;
    cut to `limit` characters."""
    message = message.split("List of objects that could not be loaded")[0]
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def load_weights_strictly(model, filepath):
    """`model.load_weights`, with any variable Keras could not load (a
    "skipping variable loading" warning in older Keras, an error in newer)
    turned into one error naming the file and the variables that differ: a
    file that lacks the optimizer state, or holds another architecture's,
    must not resume training from a fresh optimizer."""
    problem = cause = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.load_weights(filepath)
        except ValueError as error:
            problem, cause = _why_keras_failed(str(error)), error
    for warning in caught:
        message = str(warning.message).strip()
        if "Skipping variable loading" in message or "could not be loaded" in message:
            problem = problem or _why_keras_failed(message)
            continue
        warnings.warn_explicit(
            warning.message, warning.category, warning.filename, warning.lineno
        )
    if problem is None:
        return
    mismatched = _mismatched_variables(model, filepath)
    raise ValueError(
        f"The backup {filepath!r} "
        + (f"does not match the model: its variables are another model's ({mismatched}). "
           if mismatched else "could not be loaded into the model. ")
        + f"Keras says: {problem} Refusing to resume from a partial state. "
        "Resume with the model the backup was written by, or delete the "
        "backup directory to start over."
    ) from cause
