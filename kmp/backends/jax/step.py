"""The loss-scaled step on JAX: a pure function of values.

JAX traces a step once and runs it as a pure function of its state, so the
step is `kmp.scaling._step.stateless_step` (the finiteness decision, the
unscaling and the rule shared with TensorFlow); `apply` runs it and assigns
what it returns, or, outside a trace, decides on the host and lets the inner
optimizer's own `apply` update (a sparse gradient then reaches it as it is).

The same names as `kmp/backends/tensorflow/step.py`.
"""

import contextlib

import jax
from keras import ops

from kmp import _keras_internals
from kmp.precision import _compensated
from kmp.scaling import _handoff
from kmp.scaling import _step as _scaling_step

# The line a warning asks for (`kmp.scaling._handoff`): JAX's steps are stateless.
ADD_LINE = ("Add one line in the function you differentiate, `scaled_loss = "
            "{attribute}.scale_loss(loss)` (in a `jax.grad` loop of your own, outside "
            "kmp.Model's train step: `scaled_loss = {attribute}.stateless_scale_loss("
            "optimizer_variables, loss)`), and differentiate `scaled_loss`")


def snapshot(value):
    """A variable's value: a JAX array never changes."""
    return value


def outside_functions():
    return contextlib.nullcontext()


def usable_here(loss):
    return loss


def traced(value):
    """Whether `value` is a JAX tracer (of `jax.jit`, `jax.grad`, ...)."""
    return isinstance(value, jax.core.Tracer)


def read_once(loss, scale):
    """Whether `loss * scale` would keep `scale` as a constant: `loss` is
    staged into a compiled function (`jax.jit`, a `lax` loop; through
    `jax.grad`'s and `jax.vmap`'s tracers around it) and `scale` is a
    variable's concrete value, not one the function was given. JAX then
    keeps the number it read when it traced, for every later call."""
    if isinstance(scale, jax.core.Tracer):
        return False
    value = loss
    for _ in range(64):  # a few nested transformations, never a cycle
        if not isinstance(value, jax.core.Tracer):
            return False
        if type(value).__name__ == "DynamicJaxprTracer":
            return True
        inner = getattr(value, "primal", None)
        value = getattr(value, "val", None) if inner is None else inner
    return False


def check_buildable(optimizer):
    """Refuses an inner optimizer that accumulates gradients."""
    steps = _scaling_step.accumulation_steps(optimizer)
    if steps:
        raise ValueError(
            "On the JAX backend kmp.LossScaleOptimizer does not combine with the inner "
            "optimizer's `gradient_accumulation_steps` (a window with an overflow cannot be "
            "discarded whole there). Use the TensorFlow backend, or a larger batch"
            + ("" if optimizer.scaling else
               ", or, where kmp.Model's compile added this scaler as the guard (a scale fixed at 1 "
               "that skips non-finite steps), compile with `skip_nonfinite=False`, which trains "
               "without it as Keras does")
            + f". Received: gradient_accumulation_steps={steps}"
        )


def apply(optimizer, grads, trainable_variables, *, divide, loss, retries_left, window):
    """`LossScaleOptimizer.apply` on JAX: the pure step, then assigned.

    The step runs over every variable the optimizer was built with; those
    not among `trainable_variables` (or whose gradient was `None`, filtered
    out before) get a `None` gradient, which the inner optimizer leaves
    alone, as Keras' `apply` leaves them. A batch is redone by kmp.Model's
    train function, which calls the stateless step (`retries_left` here is
    for its callers alike, and `None` from a loop of the user's own).
    `window` (the inner optimizer's `gradient_accumulation_steps`) is
    always `None` here: `check_buildable` refuses one.

    Returns:
        The `kmp.scaling._handoff.StepAnswer`.
    """
    del window
    built = _keras_internals.built_variables(optimizer)
    positions = {id(v): i for i, v in enumerate(built)}
    unknown = [v for v in trainable_variables if id(v) not in positions]
    if unknown:
        raise ValueError(
            "kmp.LossScaleOptimizer.apply takes only variables it was built with. "
            f"Received: {len(unknown)} other variable(s), the first "
            f"{getattr(unknown[0], 'path', unknown[0])!r}; built with {len(built)}"
        )
    all_grads = [None] * len(built)
    for grad, variable in zip(grads, trainable_variables):
        all_grads[positions[id(variable)]] = grad
    if not any(isinstance(g, jax.core.Tracer) for g in all_grads):
        if isinstance(loss, jax.core.Tracer):
            # Recorded by `scale_loss` inside `jax.grad`: a value of that
            # transformation, which ended; the gradients here are concrete.
            loss = None
        finite, retry = _apply_eagerly(
            optimizer, all_grads, built, trainable_variables, divide, loss, retries_left)
        return _handoff.StepAnswer(finite, retry, loss)
    new_trainable, new_values, finite, retry = _scaling_step.stateless_step(
        optimizer, [v.value for v in optimizer.variables], all_grads,
        [v.value for v in built], loss=loss, divide=divide, retries_left=retries_left,
    )
    for variable in trainable_variables:
        variable.assign(new_trainable[positions[id(variable)]])
    for variable, value in zip(optimizer.variables, new_values):
        variable.assign(value)
    return _handoff.StepAnswer(finite, retry, loss)


def _apply_eagerly(optimizer, all_grads, built, trainable_variables, divide, loss,
                   retries_left):
    """`apply` on JAX outside a trace: decided on the host, then the inner
    optimizer's own `apply` updates the variables, as Keras' scaler does (a
    sparse gradient then reaches the inner optimizer's `assign_sub` as it
    is); the scaler's own variables take the same rule as the pure step."""
    scale = optimizer._kmp_scale.value
    grads, divide, finite, loss_finite, nonfinite = _scaling_step.check(
        optimizer, all_grads, built, loss, divide=divide, scale=scale
    )
    decision = _scaling_step.decide(optimizer, finite, loss_finite, nonfinite, loss,
                                    retries_left=retries_left, scale=scale)
    finite = decision.applied
    if bool(finite):
        unscaled = _scaling_step.unscale(optimizer, grads, built, scale) if divide else grads
        by_id = {id(v): g for v, g in zip(built, unscaled)}
        with _compensated.around_inner_apply(optimizer):
            optimizer.inner_optimizer.apply(
                [by_id[id(v)] for v in trainable_variables], trainable_variables
            )
    _scaling_step.assign_state(optimizer, decision)
    return ops.convert_to_tensor(bool(finite)), decision.retry
