"""The workers of `kmp.callbacks.BackupAndRestore` on JAX.

Several JAX processes joined by `jax.distributed.initialize` (one per host,
or several on one host) run the same program, and each process runs the
same `fit`: under `keras.distribution` its jitted step is one program over
every process's devices. They are the workers of a cluster: each keeps its
own backup folder and they agree on one backup to restore through
all-gathers (`kmp/backup/_choice.py`), as TensorFlow's workers do under
`MultiWorkerMirroredStrategy` (`kmp/backends/tensorflow/workers.py`). These
are the JAX side of that: which worker this process is (`process-<index>`,
process 0 the chief), and the all-gathers of an integer and of a failed
worker's message, JAX's own
(`jax.experimental.multihost_utils.process_allgather`). One process (no
`jax.distributed`, or a cluster of one) is not a worker: `this_worker`
answers `None`.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

# Loading a backup is a collective: each value goes to every process's
# devices at once (`jax.device_put` onto a sharding over all of them, which
# also checks that every process gave the same value), so the processes agree
# that each can load its file before any starts (`kmp/backup/_choice.py`).
LOADING_IS_COLLECTIVE = True


def this_worker(strategy):
    """`(task name, is chief)` among several JAX processes, else `None`.

    Args:
        strategy: Ignored (`None` on JAX, where a model has no
            `distribute_strategy`; the processes are JAX's own).

    Returns:
        `("process-1", False)`, `("process-0", True)`, ...: the process's
        index (`jax.process_index()`), and whether it is process 0, which
        writes to `backup_dir` itself; `None` for one process
        (`jax.process_count() == 1`).
    """
    del strategy
    if jax.process_count() <= 1:
        return None
    index = jax.process_index()
    return f"process-{index}", index == 0


def gather_from_workers(strategy, task, value):
    """`{task name: value}` over the JAX processes, `value` an int.

    An all-gather over every process (`process_allgather`); every process
    must call it at the same point (collectives match by order), which
    `fit`'s callbacks guarantee.

    Args:
        strategy: Ignored.
        task: String. This process's name, as `this_worker` gives it.
        value: Integer (or bool). This process's value.

    Returns:
        Dict from each process's name to its value, as an `int`.
    """
    del strategy
    if jax.process_count() <= 1:
        return {task: int(value)}
    # int32: without `jax_enable_x64` JAX would narrow an int64 itself.
    values = multihost_utils.process_allgather(np.asarray(int(value), np.int32))
    return _by_process(task, [int(v) for v in np.ravel(values)])


def gather_bytes_from_workers(strategy, task, data):
    """`{task name: data}` over the JAX processes, `data` bytes of the same
    length on every process (a failed process's message, padded).

    An all-gather of `uint8` values over every process (`process_allgather`
    stacks equal shapes); every process must call it at the same point.

    Args:
        strategy: Ignored.
        task: String. This process's name, as `this_worker` gives it.
        data: Bytes. This process's bytes, as many as every other's.

    Returns:
        Dict from each process's name to its bytes.
    """
    del strategy
    if jax.process_count() <= 1:
        return {task: bytes(data)}
    rows = multihost_utils.process_allgather(np.frombuffer(bytes(data), np.uint8))
    return _by_process(task, [np.asarray(row, np.uint8).tobytes() for row in rows])


def _by_process(task, values):
    """`{process name: value}` from values stacked in the order of
    `jax.process_index()`."""
    own = jax.process_index()
    return {
        task if index == own else f"process-{index}": value
        for index, value in enumerate(values)
    }
