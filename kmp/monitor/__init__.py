"""Monitoring: what `kmp.callbacks.LossScaleMonitor` and kmp's progress bar
report about skipped steps and the loss scale.

The public side is `kmp/callbacks.py`:

- `_arguments.py`: the monitor's arguments, and which optimizers it watches.
- `_steps.py`: one watched optimizer in one fit, and how its steps are read.
- `_ledger.py`: the numbers kept for one optimizer: steps, skips, scales.
- `_messages.py`: what is said about skipped steps.
- `_csv.py`, `_plot.py`: the per-step CSV and the plot.
- `_progbar.py`: Keras' progress bar, with the loss scalers' logs readable.

and `_float8.py`, `kmp.float8.Float8Monitor`: what float8 does to each
float8 layer, every epoch.
"""
