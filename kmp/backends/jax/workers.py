"""The workers of `kmp.callbacks.BackupAndRestore` on JAX.

kmp runs JAX in one process (Keras' JAX trainer has no multi-worker
strategy), so there is no cluster: `this_worker` answers `None`, the
callback keeps one folder, `backup_dir`, and restores the newest backup that
loads without asking anyone. `gather_from_workers` offers the TensorFlow
module's all-gather for that one process.
"""


def this_worker(strategy):
    """`None`: one process, not a worker of a cluster.

    Args:
        strategy: Ignored (`None` on JAX, where a model has no
            `distribute_strategy`).

    Returns:
        `None`.
    """
    del strategy
    return None


def gather_from_workers(strategy, task, value):
    """`{task: int(value)}`: the all-gather over a cluster of this process.

    Args:
        strategy: Ignored.
        task: String. This process's name.
        value: Integer (or bool). Its value.

    Returns:
        Dict `{task: int(value)}`.
    """
    del strategy
    return {task: int(value)}
