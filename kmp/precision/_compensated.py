"""bfloat16 weights whose updates count: any Keras optimizer's update of a
16-bit variable computed in float32 and written with Kahan compensation.

Keras computes an optimizer's update in the variable's dtype and writes it
in that dtype. For a bfloat16 variable, Adam's `beta_2 ** step` rounds to 1
and its step size to 0 (the weights never move), and an update smaller than
half a bfloat16 step (2**-9 of the weight) rounds away: a weight of 1.0
given 100 updates of -1e-4 stays at 1.0.

`float32_updates(optimizer, buffers)`, around the optimizer's `apply`:

- each 16-bit variable's `update_step` runs in Keras' autocast scope, where
  the variable and its slots read as float32 and `variable.dtype` is
  float32, so every cast, power and sum of the update is float32's;
- each write to a variable that has a buffer is compensated (Kahan): the
  buffer, of the variable's shape and dtype, holds what rounding the stored
  weight lost, so that weight + buffer carries the sum of the updates to
  about 16 significant bits, and the weight moves once that sum passes half
  a step; its slots (Adam's moments, in the variable's dtype as Keras makes
  them) are rounded to nearest;
- the weight decay of such a variable (AdamW's) likewise;
- or, for a bfloat16 variable given no buffer (`compensation="stochastic"`),
  each write is rounded stochastically instead (`stochastic_round`): up or
  down, up with probability the distance to the value below over the step
  between the two, so that every write is right on average and the weight
  needs no buffer (2 bytes a parameter less).

Each write goes through the optimizer's own `assign`, so a gate set around
it (`kmp.scaling._gate`) gates the weight and the buffer alike. Nothing stays
on the optimizer after the block.

A `kmp.LossScaleOptimizer` built on 16-bit variables makes their buffers
(`kmp.scaling._step.build_state`) and applies its inner optimizer within it
(`around_inner_apply`); what is missing is in docs/design.md ("bfloat16
weights").
"""

import contextlib

import keras
from keras import ops

from kmp import _keras_internals
from kmp import backends
from kmp.scaling import _gate

# The dtypes whose updates are computed in float32.
LOW_PRECISION = ("bfloat16", "float16")
# A stochastically rounded write's seed: [the inner optimizer's iterations,
# the variable's index * _WRITES + _WRITES // 2 for its weight decay (0 for
# its update) + which write of that computation this is]. Each computation
# counts its own writes: a strategy runs the update once per replica, and
# each replica's rounding must be the same.
_WRITES = 16


def low_precision(variable):
    """Whether `variable` is stored in a 16-bit float dtype (read outside
    any autocast scope)."""
    return keras.backend.standardize_dtype(variable.dtype) in LOW_PRECISION


def buffered(variable, compensation):
    """Whether `variable` (a 16-bit trainable one) gets a Kahan buffer under
    `compensation`: always but a bfloat16 variable rounded stochastically
    (float16 is not float32 cut short, so it keeps its buffer)."""
    return not (compensation == "stochastic"
                and keras.backend.standardize_dtype(variable.dtype) == "bfloat16")


def stochastic_round(value, seed):
    """`value` (float32) rounded to bfloat16, up or down at random.

    ```
    bits = bits_of(value)                  # uint32; bfloat16 is its upper half
    bits = (bits + random(0..2**16 - 1)) & 0xFFFF0000
    return bfloat16(float32_of(bits))      # exact: the lower half is 0
    ```

    Up with probability the distance from the bfloat16 value below (toward
    zero) over the step between the two, so the expected result is `value`
    itself: a small update moves the weight now and then instead of never
    (Gupta et al. 2015; Gopher's bfloat16 parameters). A carry into the
    exponent is the next binade's first value, as it should be.

    Args:
        value: Float32 tensor.
        seed: Int32 tensor of 2 values; the same seed, the same rounding.

    Returns:
        Bfloat16 tensor of `value`'s shape.
    """
    bits = backends.get("bits")
    noise = ops.bitwise_and(bits.random_bits(value.shape, seed),
                            ops.convert_to_tensor(0xFFFF, "uint32"))
    rounded = ops.bitwise_and(ops.add(bits.bitcast(value, "uint32"), noise),
                              ops.convert_to_tensor(0xFFFF0000, "uint32"))
    return ops.cast(bits.bitcast(rounded, "float32"), "bfloat16")


def new_buffer(variable):
    """A compensation buffer for `variable`: zeros of its shape and dtype,
    not trainable."""
    return keras.Variable(
        ops.zeros(variable.shape, variable.dtype), dtype=variable.dtype, trainable=False,
        autocast=False, name=f"{variable.name}_compensation",
    )


def around_inner_apply(optimizer):
    """`float32_updates` for a `kmp.LossScaleOptimizer`'s inner `apply`,
    with the buffers it built (`kmp.scaling._step.build_state`); nothing
    where it built none."""
    pairs = optimizer._kmp_compensated
    if not pairs:
        return contextlib.nullcontext()
    return float32_updates(optimizer.inner_optimizer, pairs)


@contextlib.contextmanager
def float32_updates(optimizer, buffers):
    """For the block, `optimizer` computes each 16-bit variable's update in
    float32 and writes those in `buffers` with Kahan compensation.

    A `keras.optimizers.MultiOptimizer`'s sub-optimizers each compute and
    write their own variables' updates (`_gate.writers`): each is set up so.

    Args:
        optimizer: A built Keras optimizer (not a `kmp.LossScaleOptimizer`:
            its inner optimizer).
        buffers: List of `(variable, buffer)` pairs: the trainable variables
            written with compensation and their buffers (`new_buffer`), or
            `None` for a bfloat16 variable rounded stochastically.
    """
    stochastic = {id(variable) for variable, buffer in buffers if buffer is None}
    buffers = {id(variable): buffer for variable, buffer in buffers if buffer is not None}
    with contextlib.ExitStack() as stack:
        seed_offset = 0  # each sub-optimizer's variables draw seeds of their own
        for writer in _gate.writers(optimizer):
            if writer is not optimizer and not writer.built:
                continue  # a sub-optimizer no variable maps to: Keras never builds it
            stack.enter_context(_float32_updates_of(writer, buffers, stochastic, seed_offset))
            seed_offset += len(_keras_internals.built_variables(writer))
        yield


@contextlib.contextmanager
def _float32_updates_of(optimizer, buffers, stochastic, seed_offset):
    """`float32_updates` for an optimizer that writes its variables itself:
    `buffers` maps the `id` of each variable written with compensation to
    its buffer, `stochastic` holds the `id`s of those rounded stochastically,
    whose seed counts the variable's index from `seed_offset`."""
    known = {}  # id of what update_step may be given -> the keras.Variable
    for variable in _keras_internals.built_variables(optimizer):
        known[id(variable)] = variable
        value = _gate.value_of(variable)  # TensorFlow hands over the tf.Variable,
        for handed in (value, *getattr(value, "values", ())):  # a strategy each replica's
            known[id(handed)] = variable
    own = {name: getattr(optimizer, name) for name in _gate.WRITES + ("update_step",)}
    indices = {}  # id(variable) -> its index, looked up before the autocast scope
    updating = []  # [the variable whose update is being computed, its first seed, writes]

    def in_float32(variable, compute, decay=False):
        indices.setdefault(id(variable), _keras_internals.variable_index(optimizer, variable))
        updating.append([variable, (seed_offset + indices[id(variable)]) * _WRITES
                         + decay * _WRITES // 2, 0])
        try:
            # A weight made with autocast=False (a normalization layer's)
            # is read in float32 here too.
            with _keras_internals.autocast("float32"), \
                    _keras_internals.following_autocast(variable):
                return compute()
        finally:
            updating.pop()

    def update_step(gradient, variable, learning_rate):
        target = known.get(id(variable))
        if target is None or not low_precision(target):
            return own["update_step"](gradient, variable, learning_rate)
        return in_float32(target, lambda: own["update_step"](
            ops.cast(gradient, "float32"), target, learning_rate))

    def variable_index(original, variable):
        target = known.get(id(variable), variable)
        if id(target) in indices:
            return indices[id(target)]
        return original(variable)

    def weight_decay(original, variables):
        variables = list(variables)
        original([v for v in variables if not low_precision(v)])
        if optimizer.weight_decay is None:
            return
        for variable in variables:
            if low_precision(variable) and _keras_internals.uses_weight_decay(optimizer, variable):
                in_float32(variable, lambda v=variable: optimizer.assign_sub(
                    v, ops.cast(v.value, "float32")
                    * ops.cast(optimizer.weight_decay, "float32")
                    * ops.cast(optimizer.learning_rate, "float32")), decay=True)

    def write(name):
        def float32_write(variable, value):
            if not updating:
                return own[name](variable, value)
            target = known.get(id(variable), variable)
            current = ops.cast(_gate.value_of(target), "float32")
            value = ops.cast(_gate.value_of(value), "float32")
            buffer = buffers.get(id(target))
            with _keras_internals.autocast(None):
                if id(target) in stochastic:
                    computation = updating[-1]
                    seed = ops.stack([ops.cast(optimizer.iterations, "int32"), ops.convert_to_tensor(
                        computation[1] + computation[2] % (_WRITES // 2), "int32")])
                    computation[2] += 1
                    return own["assign"](variable, stochastic_round(
                        _gate.written(name, current, value), seed))
                if buffer is None:
                    return own["assign"](variable, _gate.written(name, current, value))
                dtype = target.dtype
                # The float32 value to store: a whole new one (`assign`), or
                # the old weight plus the update and what earlier roundings
                # lost (the buffer). The buffer takes what rounding it to the
                # weight's dtype loses (their difference is exact in
                # float32: the two are within a factor of 2), stored in its
                # own 16 bits. The weight takes the value less that buffer,
                # which rounds to the same bits as the value (the buffer
                # holds under half the weight's step), so that its write
                # follows the buffer's: written from the value alone, both
                # writes read the old weight in either order, and XLA copies
                # every weight each step to keep it.
                if name != "assign":
                    delta = value if name == "assign_add" else -value
                    value = current + (ops.cast(_gate.value_of(buffer), "float32") + delta)
                own["assign"](buffer, value - ops.cast(ops.cast(value, dtype), "float32"))
                return own["assign"](variable, ops.cast(
                    value - ops.cast(_gate.value_of(buffer), "float32"), dtype))
        return float32_write

    methods = {name: write(name) for name in _gate.WRITES}
    with _keras_internals.shadowed(optimizer, dict(methods, update_step=update_step)), \
            _keras_internals.shadowed_optimizer_methods(
                optimizer, variable_index=variable_index, apply_weight_decay=weight_decay):
        yield
