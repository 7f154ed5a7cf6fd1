"""Crash-safe backups: what `kmp.callbacks.BackupAndRestore` writes, and
which backup it trusts and restores.

The public side is `kmp/checkpoint.py` (`BackupAndRestore`,
`ModelCheckpoint`, `write_atomically`):

- `_atomic_files.py`: files that are complete or absent.
- `_lock.py`: one run per backup folder.
- `_records.py`: what a backup folder records, and the checks on it.
- `_folder.py`: one process's backup folder: what it writes, in which order.
- `_choice.py`: which backup is restored (the workers agree on it).
- `_restore.py`: restoring one backup, its checksum checked.
"""
