"""Whether the gradients a loss scaler receives come from a scaled loss.

Keras' LossScaleOptimizer divides every gradient by the scale, whether or not
`scale_loss` ran: a custom `train_step` or loop that never calls it trains
with gradients 2**15 times too small, silently. kmp's scaler asks this module
instead, at each `apply`, how the step's gradients were made:

- `SCALED`: `scale_loss` ran for this optimizer since its last `apply` (in
  this thread; a `tf.function` or a replica of a strategy traces in one
  thread). Divide by the scale. The unscaled loss comes along, so a skipped
  step can be told apart as a forward overflow.
- `UNSCALED`: since the last `apply`, a `tf.GradientTape` computed
  gradients with respect to a variable this `apply` updates, and no
  `scale_loss` ran: gradients of a loss that was not scaled. Applied as they
  are (with one warning). A tape that differentiated other variables (another
  model's, Keras' own `fit` with a plain optimizer) does not count.
- `BY_HAND`: neither: gradients made without a tape (as Keras' own tests
  make them), taken to be scaled by hand, as Keras does.
- `DIVIDED`: `get_unscaled_gradients` (tf.keras' recipe) divided them by the
  scale already: checked and applied as they are, without a warning.

All of this happens while Python runs, so under `tf.function` it is decided
once per trace, at no cost per step.
"""

import threading
import weakref

import tensorflow as tf

SCALED = "scaled"
UNSCALED = "unscaled"
BY_HAND = "by_hand"
DIVIDED = "divided"

_thread = threading.local()


def _state():
    if not hasattr(_thread, "scaled_losses"):
        _thread.scaled_losses = {}  # id(optimizer) -> the latest unscaled loss
        _thread.divided = set()  # id(optimizer) whose gradients were divided
        # id(variable) -> weakref of each variable a tape differentiated
        # with respect to since the last `apply` (identity, not equality:
        # variables compare elementwise).
        _thread.tape_sources = {}
        _thread.last_losses = {}
        _thread.last_finite = {}
        _thread.last_retry = {}
        _thread.retries_left = {}
        _thread.step_depth = 0
        _thread.applied = []  # optimizers that applied in the current train step
    return _thread


class train_step:  # noqa: N801  (used as `with _loss_record.train_step() as applied:`)
    """Collects the optimizers that `apply` in one (possibly nested) train step.

    `with train_step() as applied:` yields a list that, after the block,
    holds each optimizer that ran `apply` inside it, in order, once; only
    the outermost block of a thread collects (a `train_step` that calls
    `super().train_step`).
    """

    def __enter__(self):
        state = _state()
        self._outer = state.step_depth == 0
        state.step_depth += 1
        if self._outer:
            state.applied = []
            return state.applied
        return []

    def __exit__(self, *exc_info):
        _state().step_depth -= 1
        return False


def record(optimizer, loss):
    """Notes that `optimizer.scale_loss(loss)` ran in this thread."""
    _state().scaled_losses[id(optimizer)] = loss


def record_divided(optimizer):
    """Notes that `optimizer.get_unscaled_gradients` ran in this thread."""
    _state().divided.add(id(optimizer))


def _differentiated(tape_sources, variable):
    # No `:=` here: AutoGraph, converting this module inside a tf.function,
    # warns that it cannot transform a function that uses one.
    ref = tape_sources.get(id(variable))
    return ref is not None and ref() is variable


def take(optimizer, variables):
    """How the gradients of `optimizer`'s current `apply` to `variables` were made.

    Returns:
        `(how, loss)`: one of `SCALED`, `UNSCALED`, `BY_HAND`, `DIVIDED`, and the
        unscaled loss given to `scale_loss` when it can be used here (a
        tensor of the graph being traced, or an eager tensor), else `None`.
    """
    state = _state()
    tape_sources, state.tape_sources = state.tape_sources, {}
    from_tape = any(_differentiated(tape_sources, variable) for variable in variables)
    if state.step_depth and all(optimizer is not seen for seen in state.applied):
        state.applied.append(optimizer)
    divided = id(optimizer) in state.divided
    state.divided.discard(id(optimizer))
    if id(optimizer) in state.scaled_losses:
        loss = _usable_here(state.scaled_losses.pop(id(optimizer)))
        state.last_losses[id(optimizer)] = loss
        return (DIVIDED if divided else SCALED), loss
    state.last_losses[id(optimizer)] = None
    if divided:
        return DIVIDED, None
    return (UNSCALED if from_tape else BY_HAND), None


def note_finite(optimizer, finite, retry=None):
    """Notes the decision of `optimizer`'s latest `apply` in this thread:
    whether it applied, and whether `kmp.Model` will retry its batch."""
    _state().last_finite[id(optimizer)] = finite
    _state().last_retry[id(optimizer)] = retry


def last_retry(optimizer):
    """Boolean tensor: whether `optimizer`'s latest `apply` asked for a retry
    (`None` when retries were not on)."""
    return _state().last_retry.get(id(optimizer))


def set_last_loss(optimizer, loss):
    """Replaces the loss `last_loss` returns (a retry loop's output)."""
    _state().last_losses[id(optimizer)] = loss


class retrying:  # noqa: N801  (used as `with _loss_record.retrying(optimizer, n):`)
    """Tells `optimizer.apply` in the block how many retries its batch has left."""

    def __init__(self, optimizer, retries_left):
        self._key, self._retries_left = id(optimizer), retries_left

    def __enter__(self):
        _state().retries_left[self._key] = self._retries_left

    def __exit__(self, *exc_info):
        _state().retries_left.pop(self._key, None)
        return False


def retries_left(optimizer):
    """The retries `optimizer`'s current batch has left, or `None` (no retries)."""
    return _state().retries_left.get(id(optimizer))


def last_finite(optimizer):
    """Boolean tensor: whether `optimizer`'s latest `apply` in this thread
    applied its gradients (`None` before any)."""
    return _state().last_finite.get(id(optimizer))


def last_loss(optimizer):
    """The unscaled loss of `optimizer`'s latest `apply` in this thread, or `None`."""
    return _state().last_losses.get(id(optimizer))


def _usable_here(loss):
    if not tf.is_symbolic_tensor(loss):
        return loss
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if graph is loss.graph:
            return loss
        graph = getattr(graph, "outer_graph", None)
    return None


def _record_tape_sources():
    gradient = tf.GradientTape.gradient
    if getattr(gradient, "_kmp_counted", False):
        return

    def recording_gradient(self, *args, **kwargs):
        sources = args[1] if len(args) > 1 else kwargs.get("sources")
        tape_sources = _state().tape_sources
        for source in tf.nest.flatten(sources):
            try:
                tape_sources[id(source)] = weakref.ref(source)
            except TypeError:
                pass  # not a variable (a watched tensor): nothing to apply to
        return gradient(self, *args, **kwargs)

    recording_gradient._kmp_counted = True
    recording_gradient.__doc__ = gradient.__doc__
    tf.GradientTape.gradient = recording_gradient


_record_tape_sources()
