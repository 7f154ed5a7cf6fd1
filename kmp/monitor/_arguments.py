"""`LossScaleMonitor`'s arguments: their checks, and which optimizers it watches.

The constructor checks its arguments here (nothing is set when one breaks its
rule); when training starts, `resolve_optimizers` turns the `optimizers`
argument into the model's optimizers, by attribute name.
"""

import numbers
import os

import keras

from kmp import loss_scale as loss_scale_module
from kmp.backup import _atomic_files
from kmp.scaling._optimizers import optimizers_by_attribute
from kmp.scaling._optimizers import scaling_optimizers

_OPTIMIZERS_RULE = (
    "`optimizers` must be None (every kmp.LossScaleOptimizer the model holds) "
    "or a list of the model's optimizer attribute names (str) or "
    "kmp.LossScaleOptimizer instances"
)


def check_path(name, value):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"`{name}` must be a file path (str or os.PathLike) or None. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    if value is None:
        return
    # Found now, not after the whole fit, when the file is written.
    if os.path.isdir(value):
        raise ValueError(
            f"`{name}` must be the path of a file to write, but it names an "
            f"existing folder. Received: {name}={os.fspath(value)!r}"
        )
    blocking = _atomic_files.not_a_folder(os.path.dirname(os.path.abspath(value)))
    if blocking is not None:
        raise ValueError(
            f"`{name}` must be the path of a file to write, but {blocking!r}, "
            f"where its folder would be, is not a folder. Received: {name}={os.fspath(value)!r}"
        )


def _is_integer(value, minimum):
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Integral)
        and value >= minimum
    )


def check_arguments(max_consecutive_skips, warn_skip_rate, csv_path, plot_path, verbose):
    """Raises for a `LossScaleMonitor` argument (but `optimizers`) that breaks its rule."""
    if max_consecutive_skips is not None and not _is_integer(max_consecutive_skips, 1):
        raise ValueError(
            "`max_consecutive_skips` must be an integer >= 1 or None. "
            f"Received: max_consecutive_skips={max_consecutive_skips!r}"
        )
    if warn_skip_rate is not None and (
        isinstance(warn_skip_rate, bool)
        or not isinstance(warn_skip_rate, numbers.Real)
        or not 0 <= warn_skip_rate <= 1
    ):
        raise ValueError(
            "`warn_skip_rate` must be a number in [0, 1] or None. "
            f"Received: warn_skip_rate={warn_skip_rate!r}"
        )
    check_path("csv_path", csv_path)
    check_path("plot_path", plot_path)
    if not _is_integer(verbose, 0):
        raise ValueError(f"`verbose` must be an integer >= 0. Received: verbose={verbose!r}")


def check_optimizers(optimizers):
    """`LossScaleMonitor(optimizers=...)` as a tuple (or `None`), or the error."""
    if optimizers is None:
        return None
    if isinstance(optimizers, (str, keras.optimizers.Optimizer)):
        shown = repr(optimizers) if isinstance(optimizers, str) else "model.g_optimizer"
        raise TypeError(
            f"{_OPTIMIZERS_RULE}. Received: optimizers={optimizers!r}. For one "
            f"optimizer pass a list: optimizers=[{shown}]"
        )
    if not isinstance(optimizers, (list, tuple)):
        raise TypeError(
            f"{_OPTIMIZERS_RULE}. Received: optimizers={optimizers!r} of type "
            f"{type(optimizers).__name__}"
        )
    if not optimizers:
        raise ValueError(
            f"{_OPTIMIZERS_RULE}; an empty list would watch nothing. "
            "Received: optimizers=[]"
        )
    wrong = [
        item for item in optimizers
        if not isinstance(item, (str, loss_scale_module.LossScaleOptimizer))
    ]
    if wrong:
        raise TypeError(
            f"{_OPTIMIZERS_RULE}; another optimizer does not scale the loss, so "
            f"it never skips a step. Received: optimizers={list(optimizers)!r}, "
            f"with {wrong!r} neither"
        )
    repeated = [item for i, item in enumerate(optimizers) if item in optimizers[:i]]
    if repeated:
        raise ValueError(
            f"{_OPTIMIZERS_RULE}, each at most once. Received: "
            f"optimizers={list(optimizers)!r}, repeating {repeated!r}"
        )
    return tuple(optimizers)


def optimizers_config(optimizers):
    """The checked `optimizers` as `get_config` writes them: a list of names.

    Raises:
        ValueError: if `optimizers` holds an optimizer instance, which is
            state, not config.
    """
    if not all(isinstance(item, str) for item in optimizers):
        raise ValueError(
            "A LossScaleMonitor given optimizer instances cannot be "
            "serialized: an optimizer is state, not config. Give the "
            "model's attribute names instead (optimizers=['g_optimizer']), "
            f"or None for all of them. Received: optimizers={list(optimizers)!r}"
        )
    return list(optimizers)


def resolve_optimizers(model, selection):
    """The optimizers a monitor watches, by name (their model attribute name).

    Args:
        model: The `keras.Model` being trained.
        selection: `None` (every `kmp.LossScaleOptimizer` of the model) or
            the checked `optimizers` argument.

    Returns:
        Dict from name to `kmp.LossScaleOptimizer`, in the model's attribute
        order for `None`, else in the order of `selection`.

    Raises:
        ValueError: if a name in `selection` is not an attribute of the
            model holding a `kmp.LossScaleOptimizer`.
    """
    if selection is None:
        return scaling_optimizers(model)
    by_attribute = optimizers_by_attribute(model)
    found = {}
    for item in selection:
        if not isinstance(item, str):
            name = next((n for n, o in by_attribute.items() if o is item), None)
            if name is None:
                # Not held by the model: its own name, made unique.
                name, number = item.name, 1
                while name in found or name in by_attribute:
                    name, number = f"{item.name}_{number}", number + 1
            found[name] = item
            continue
        optimizer = by_attribute.get(item)
        if not isinstance(optimizer, loss_scale_module.LossScaleOptimizer):
            what = (
                "the model has no optimizer attribute of that name"
                if optimizer is None
                else f"it is a {type(optimizer).__name__}, which does not scale the loss"
            )
            raise ValueError(
                f"LossScaleMonitor cannot watch {item!r}: {what}. The model's "
                f"kmp.LossScaleOptimizer attributes: {sorted(scaling_optimizers(model))}. "
                f"Received: optimizers={list(selection)!r}"
            )
        found[item] = optimizer
    return found
