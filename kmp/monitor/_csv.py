"""`LossScaleMonitor`'s per-step CSV: one row per `kmp.monitor._ledger.Step`."""

import csv
import math
import os

from kmp.backup import _atomic_files
from kmp.monitor import _messages as messages

CSV_COLUMNS = ("step", "loss", "loss_scale", "skipped", "reason", "nonfinite_variables")


def _csv_number(value):
    """A number for the CSV: integers without `.0`, floats as Python writes them."""
    value = float(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 2.0**53:
        return int(value)
    return value


class StepCsv:
    """The monitor's per-step CSV: rewritten at each fit, flushed each epoch.

    With `path=None` every method does nothing, so the monitor never checks
    whether it writes a CSV. With `lazy=True` the file is created at the
    first row instead of now.
    """

    def __init__(self, path, lazy=False):
        self._path = path
        self._file = None
        if path is not None and not lazy:
            self._open()

    def _open(self):
        directory = os.path.dirname(self._path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # A link planted at the path is replaced, not written through.
        self._file = _atomic_files.open_replacing(self._path, newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_COLUMNS)
        self._file.flush()

    def write(self, row):
        """Writes one `kmp.monitor._ledger.Step` (nothing for `None`: no step taken)."""
        if self._path is None or row is None:
            return
        if self._file is None:
            self._open()
        self._writer.writerow((
            row.step, row.loss, _csv_number(row.loss_scale), row.skipped, row.reason,
            messages.shorten_names(row.nonfinite_variables, separator=";"),
        ))

    def flush(self):
        if self._file is not None:
            self._file.flush()

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        self._path = None  # a closed CSV stays closed
