"""The optimizers a model trains with, found by attribute.

A model compiled the usual way holds one, `model.optimizer`; a GAN or a
distillation model written the keras.io way holds more, as attributes it
sets itself (`self.d_optimizer = ...`). kmp names each after its attribute.
"""

import keras
import numpy as np

from kmp.loss_scale import LossScaleOptimizer
from kmp.scaling._step import monitor_state


def optimizers_by_attribute(model):
    """Every `keras.optimizers.Optimizer` a model holds, by attribute name.

    Returns:
        Dict from attribute name (`"optimizer"` for the compiled one) to
        optimizer, in attribute order, each optimizer once (the first name
        wins).
    """
    found = {}
    for name, value in list(vars(model).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, keras.optimizers.Optimizer) and all(
            value is not seen for seen in found.values()
        ):
            found[name] = value
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and all(
        optimizer is not seen for seen in found.values()
    ):
        found["optimizer"] = optimizer
    return found


def scaling_optimizers(model, built_only=False):
    """The `kmp.LossScaleOptimizer`s among `optimizers_by_attribute(model)`.

    Args:
        model: A `keras.Model`.
        built_only: Bool. Leave out optimizers that never ran a step (a
            default optimizer a custom `compile` creates and never uses).

    Returns:
        Dict from attribute name to optimizer.
    """
    return {
        name: optimizer
        for name, optimizer in optimizers_by_attribute(model).items()
        if isinstance(optimizer, LossScaleOptimizer) and (optimizer.built or not built_only)
    }


def retries(optimizer):
    """Host read of the batches `optimizer` had redone (0 before it is built)."""
    return int(optimizer.counters["retries"]) if optimizer.built else 0


def read_counters(optimizer):
    """Host read of `[step, skipped, forward, consecutive, consecutive_forward,
    spikes]`."""
    if not optimizer.built:
        return np.zeros(6, dtype=np.int64)
    counters, _ = monitor_state(optimizer)
    return np.asarray(counters)
