"""What a train step tells its loss scaler, and what the scaler answers.

kmp.Model's own train step passes values: it scales the loss itself and
calls the scaler's `_kmp_apply(grads, variables, divide=, loss=,
retries_left=)` (the retries its train function allows this batch, see
`kmp.scaling._retry`), and gets a `StepAnswer` back.

Code kmp does not own (a subclass's `train_step`, a GAN's or a VAE's, a
`GradientTape` loop) calls only the optimizer's public methods. For it each
`kmp.LossScaleOptimizer` keeps one `StepRecord` (thread-local:
MirroredStrategy traces each replica in its own thread), in which:

- **the user's step**, through the optimizer's public methods:
  `scale_loss(loss)` records that the loss was scaled, and the unscaled loss;
  `get_unscaled_gradients(grads)` records that the gradients were divided.
- **kmp.Model's train function** opens `model_step()` around a subclass's
  step (`kmp.scaling._model_step.inside_model_step`).
- **the scaler's `apply`** takes the first part (`take_for_apply`) and leaves
  its `StepAnswer`, from which the logs learn that it applied.

```
with record.model_step():                    # around a subclass's train step
    loss = optimizer.scale_loss(loss)        # user: scaled, loss
    optimizer.apply(grads)                   # scaler: take_for_apply(), then
record.answer                                #   StepAnswer(finite, retry, loss)
```

Gradients of a loss that did not go through `scale_loss`: inside kmp.Model's
train step (a custom `train_step` that forgot it) they are applied
undivided, with one warning naming the line to add; anywhere else (a
`GradientTape` loop, Keras' own tests scaling by hand) they are divided, as
Keras' LossScaleOptimizer divides them, with one warning.
"""

import collections
import contextlib
import threading
import warnings

from kmp import _user_line
from kmp import backends

StepAnswer = collections.namedtuple(
    "StepAnswer", ["finite", "retry", "loss"], defaults=(None, None, None)
)
StepAnswer.__doc__ = """What the scaler's `apply` answers.

Fields:
    finite: Boolean tensor: the step was applied (its loss and gradients
        finite, and not a loss spike); `None` where `apply` ran with
        `enabled=False`.
    retry: Boolean tensor, or `None` without retries: the caller is to redo
        the batch (the scale has backed off already; not counted as a skip).
    loss: The unscaled loss `scale_loss` recorded, or `None`.
"""

_UNSCALED_WARNING = (
    "kmp.LossScaleOptimizer '{name}'{held_as} received gradients of a loss that was "
    "not scaled: `scale_loss` did not run for this optimizer in this train step. "
    "They are applied as they are (not divided by the loss scale) and non-finite "
    "steps are still skipped, but small float16 gradients can underflow to zero. "
    "{add_line} (keep `loss` for your metrics)."
)

_DIVIDED_WARNING = (
    "kmp.LossScaleOptimizer '{name}' divided gradients by the loss scale although "
    "`scale_loss` did not run for it since its last `apply`, as Keras' "
    "LossScaleOptimizer does: right for gradients scaled by hand, too small by the "
    "scale for gradients of a loss that was not scaled. Outside `kmp.Model`'s train "
    "step kmp cannot tell them apart. {add_line}."
)

_SPLIT_ERROR = (
    "kmp.LossScaleOptimizer '{name}': `get_unscaled_gradients` ran inside a "
    "compiled function (`tf.function`, `jax.jit`) whose gradients this `apply` "
    "receives outside it. On the function's later calls its Python does not run, "
    "so the scaler cannot learn that those gradients are divided already and "
    "would divide them again (a step 1/scale of what it should be). Call "
    "`optimizer.apply_gradients(...)` inside the same `tf.function` (in `jax.jit`, "
    "`stateless_scale_loss` and `stateless_apply`: docs/jax.md), or apply the "
    "scaled gradients without `get_unscaled_gradients`: `apply` divides them itself."
)


class StepRecord(threading.local):
    """The hand-off between one replica's train step and its scaler.

    Attributes:
        answer: The `StepAnswer` of the latest `apply` in this model step,
            or `None` before it.
    """

    def __init__(self):
        # The losses `scale_loss` scaled since the last `apply`, in order:
        # each `apply` of a model step takes the first (two losses, two
        # applies of one optimizer: each its own).
        self._losses, self._divided = [], False
        # Whether `get_unscaled_gradients` divided symbolic gradients (in a
        # `tf.function` or `jax.jit` being traced) since the last `apply`.
        self.divided_in_trace = False
        self.in_model_step, self.answer = False, None

    def __reduce__(self):
        return StepRecord, ()  # a copy starts with a fresh record

    # The user's step, through scale_loss and get_unscaled_gradients.
    def note_scaled(self, loss):
        self._losses.append(loss)

    def note_divided(self, grads):
        self._divided = True
        self.divided_in_trace = _any_traced(grads)

    @contextlib.contextmanager
    def model_step(self):
        """Inside kmp.Model's train step (a subclass's), with no answer yet."""
        self.in_model_step, self.answer = True, None
        try:
            yield self
        finally:
            # Nothing traced may outlive the trace.
            self.in_model_step = False
            self.forget_traced()

    def take(self):
        """`(scaled, divided, loss)` for one `apply`: the first loss scaled
        since the last, and whether gradients were divided; clears them (in
        a model step, the later losses stay for its next `apply`)."""
        scaled, loss = bool(self._losses), self._losses[0] if self._losses else None
        if loss is not None:
            loss = backends.get("step").usable_here(loss)
        taken = (scaled, self._divided, loss)
        later = self._losses[1:] if self.in_model_step else []
        self.clear()
        self._losses = later
        return taken

    def clear(self):
        """Forgets what the step so far recorded (`take`, unread)."""
        self._losses, self._divided = [], False
        self.divided_in_trace = False

    def forget_traced(self):
        """Drops every tensor held: nothing traced may outlive its trace."""
        self._losses, self.answer = [], None


def _any_traced(grads):
    return any(g is not None and backends.get("step").traced(g) for g in grads)


def take_for_apply(optimizer, grads=None):
    """`(divide, loss)` for `optimizer.apply` of `grads`, from what the step
    recorded.

    Clears the record; warns once where no loss went through `scale_loss`:
    inside kmp.Model's train step such gradients are applied undivided,
    elsewhere divided (as Keras' LossScaleOptimizer divides them).

    Raises:
        ValueError: if `get_unscaled_gradients` divided gradients inside a
            trace and `grads` (when given) are not of a trace (an eager apply
            of a compiled function's gradients): every later call would
            divide them twice, silently.
    """
    record = optimizer._kmp_record
    split = grads is not None and record.divided_in_trace and not _any_traced(grads)
    scaled, divided, loss = record.take()
    if split:
        raise ValueError(_SPLIT_ERROR.format(name=optimizer.name))
    if not optimizer.scaling:  # a scale fixed at 1: nothing to divide, nothing to forget
        return False, loss
    if not (scaled or divided):
        _warn_once(optimizer, _UNSCALED_WARNING if record.in_model_step else _DIVIDED_WARNING)
    return not divided and (scaled or not record.in_model_step), loss


def _warn_once(optimizer, template):
    """Warns once per optimizer and message, at the user's line.

    Names the model attribute that holds it (a GAN's `d_optimizer`, set by
    kmp.Model): in a traced step, the warning's line is AutoGraph's.
    """
    if template in optimizer._warned:
        return
    optimizer._warned.add(template)
    attribute = getattr(optimizer, "_kmp_attribute", None)
    attribute = f"self.{attribute}" if attribute else "optimizer"
    message = template.format(
        name=optimizer.name,
        held_as=f" (the model's `{attribute[5:]}`)" if attribute != "optimizer" else "",
        add_line=backends.get("step").ADD_LINE.format(attribute=attribute),
    )
    warnings.warn(message, stacklevel=_user_line.stacklevel())


def read_once_error(optimizer, method):
    """The error of `scale_loss` or `get_unscaled_gradients` (`method`)
    inside `jax.jit` without the step's optimizer values."""
    return (
        f"kmp.LossScaleOptimizer '{optimizer.name}': `{method}` inside `jax.jit` reads "
        "the loss scale once, when JAX traces the function, and keeps that number "
        "for every later call, while the scale moves (the gradients would be off "
        "by the factor it moved since). In a compiled step of your own, read it "
        "from the optimizer variables the step carries: `scaled_loss = "
        "optimizer.stateless_scale_loss(optimizer_variables, loss)`, then "
        "`optimizer.stateless_apply(optimizer_variables, grads, "
        "trainable_variables)`, which divides the gradients (docs/jax.md)."
    )
