"""Loss spikes: a finite loss far above the recent ones, as pure functions.

OLMo-core's `SkipStepOptimizer` rule (a z-score against a rolling window,
inactive until the window has enough losses), decided on the device with no
host read:

```
mean, std = mean and sample std of the last min(seen, window) finite losses
spike = seen >= warmup and isfinite(loss) and loss - mean > threshold * std
# then, spike or not, a finite loss enters the window (a level that really
# moved fills it, so training is never locked out):
if isfinite(loss):
    window[seen % len(window)] = loss
    seen += 1
```

Only losses *above* the mean count (OLMo-core compares the absolute
deviation): a batch whose loss falls far below the recent ones brings small
gradients, and skipping it would only slow training.

Example:

>>> window, seen = ops.zeros((4,)), ops.convert_to_tensor(0, "int32")
>>> for loss in (1.0, 1.1, 0.9, 1.0):
...     window, seen = record(window, seen, ops.convert_to_tensor(loss))
>>> bool(is_spike(window, seen, ops.convert_to_tensor(50.0), 6.0, 4))
True
>>> bool(is_spike(window, seen, ops.convert_to_tensor(1.2), 6.0, 4))
False
"""

from keras import ops

# OLMo-core's defaults: 128 losses, and no spike before 64 have been seen.
DEFAULT_WINDOW = 128
DEFAULT_WARMUP = 64


def _filled(window, seen):
    """Float32 mask of the window's slots that hold a loss, and their count."""
    size = window.shape[0]
    count = ops.minimum(ops.cast(seen, "int32"), size)
    mask = ops.cast(ops.arange(size, dtype="int32") < count, "float32")
    return mask, ops.cast(count, "float32")


def is_spike(window, seen, loss, threshold, warmup):
    """Whether `loss` is a spike against `window` (a boolean scalar).

    Args:
        window: Float32 vector: the last losses, a ring buffer.
        seen: Integer scalar: the finite losses recorded so far.
        loss: Float scalar: this step's loss (every replica's sum).
        threshold: Float > 0. Standard deviations above the mean.
        warmup: Int. Losses to record before any step is a spike.
    """
    loss = ops.cast(loss, "float32")
    mask, count = _filled(window, seen)
    mean = ops.sum(window * mask) / ops.maximum(count, 1.0)
    variance = ops.sum(ops.square(window - mean) * mask) / ops.maximum(count - 1.0, 1.0)
    above = loss - mean > threshold * ops.sqrt(variance)
    return ops.logical_and(
        ops.logical_and(ops.cast(seen, "int32") >= warmup, ops.isfinite(loss)), above
    )


def record(window, seen, loss):
    """`(window, seen)` with `loss` recorded, where it is finite."""
    loss = ops.cast(loss, "float32")
    finite = ops.isfinite(loss)
    size = window.shape[0]
    slot = ops.arange(size, dtype="int32") == ops.mod(ops.cast(seen, "int32"), size)
    window = ops.where(ops.logical_and(slot, finite), loss, window)
    return window, seen + ops.cast(finite, seen.dtype)
