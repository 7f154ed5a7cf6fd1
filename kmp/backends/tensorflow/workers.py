"""The workers of `kmp.callbacks.BackupAndRestore` on TensorFlow.

Under a `tf.distribute.MultiWorkerMirroredStrategy` with several workers,
each worker keeps its own backup folder and the workers agree on one backup
to restore through all-gathers (`kmp/backup/_choice.py`); these are the
TensorFlow side of that: which worker this process is, and the all-gathers
of an integer and of a failed worker's message.
"""

import numpy as np
import tensorflow as tf

from kmp.backends.tensorflow import distribute

# Loading a backup is local to each worker (its own copy of each mirrored
# variable), so a worker that cannot load its file stops the others at the
# all-gather after it (`kmp/backup/_choice.py`).
LOADING_IS_COLLECTIVE = False


def this_worker(strategy):
    """`(task name, is chief)` in a cluster of several workers, else `None`.

    Args:
        strategy: The model's `tf.distribute.Strategy`, or `None`.

    Returns:
        `("worker-1", False)`, `("chief-0", True)`, ...: the task's type and
        index, and whether it writes the cluster's checkpoints; `None` for
        one process (any other strategy, or a cluster of one worker).
    """
    if not distribute.is_multi_worker(strategy):
        return None
    resolver = strategy.cluster_resolver
    cluster = resolver.cluster_spec().as_dict()
    if sum(len(cluster.get(job, ())) for job in ("chief", "worker")) <= 1:
        return None
    return f"{resolver.task_type}-{resolver.task_id}", bool(
        strategy.extended.should_checkpoint
    )


def gather_from_workers(strategy, task, value):
    """`{task name: value}` over the cluster's workers, `value` an int.

    An all-gather in eager mode; every worker must call it at the same point
    (collectives match by order), which `fit`'s callbacks guarantee.

    Args:
        strategy: The cluster's `MultiWorkerMirroredStrategy`.
        task: String. This worker's name, as `this_worker` gives it.
        value: Integer (or bool). This worker's value.

    Returns:
        Dict from each worker's name to its value, as an `int`.
    """
    rows = _gather_rows(strategy, task, [int(value)])
    return {name: int(values[0]) for name, values in rows}


def gather_bytes_from_workers(strategy, task, data):
    """`{task name: data}` over the cluster's workers, `data` bytes of the
    same length on every worker (a failed worker's message, padded).

    An all-gather of the bytes packed into int64 values, in eager mode;
    every worker must call it at the same point.

    Args:
        strategy: The cluster's `MultiWorkerMirroredStrategy`.
        task: String. This worker's name, as `this_worker` gives it.
        data: Bytes. This worker's bytes, as many as every other's.

    Returns:
        Dict from each worker's name to its bytes.
    """
    data = bytes(data)
    words = np.frombuffer(data.ljust(-(-len(data) // 8) * 8, b"\0"), np.int64)
    rows = _gather_rows(strategy, task, words)
    return {name: values.astype(np.int64).tobytes()[: len(data)] for name, values in rows}


def _gather_rows(strategy, task, values):
    """`(task name, values)` of each replica: an all-gather of one row per
    replica, `[job, task index, *values]` (int64)."""
    task_type, task_id = task.rsplit("-", 1)
    job = 0 if task_type == "chief" else 1
    local = tf.constant(
        np.concatenate([[job, int(task_id)], values]).astype(np.int64)[np.newaxis]
    )
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda _: local
    )
    rows = strategy.gather(per_replica, axis=0).numpy()
    # One row per replica: a worker with several devices appears several times.
    return [
        (f"{'chief' if row[0] == 0 else 'worker'}-{row[1]}", row[2:])
        for row in rows
    ]
