"""The workers of `kmp.callbacks.BackupAndRestore` on TensorFlow.

Under a `tf.distribute.MultiWorkerMirroredStrategy` with several workers,
each worker keeps its own backup folder and the workers agree on one backup
to restore through all-gathers (`kmp/backup/_choice.py`); these are the
TensorFlow side of that: which worker this process is, and the all-gather.
"""

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
    task_type, task_id = task.rsplit("-", 1)
    local = tf.constant(
        [[0 if task_type == "chief" else 1, int(task_id), int(value)]], tf.int64
    )
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda _: local
    )
    rows = strategy.gather(per_replica, axis=0).numpy()
    # One row per replica: a worker with several devices appears several times.
    return {
        f"{'chief' if job == 0 else 'worker'}-{index}": int(value)
        for job, index, value in rows
    }
