"""Gated writes: a skipped step as a select inside each write an optimizer
makes through its own `assign`, `assign_add` and `assign_sub`.

Keras' optimizers write their slots and variables through those three
methods (`self.assign_add(m, (g - m) * (1 - beta_1))`). Each becomes
`assign(v, where(keep, new, v))`, `new` computed as Keras' own method
computes it (`v + delta`), so a kept step writes the same bits as without
the gate and a skipped one changes nothing; XLA fuses the select into the
update that computes it. A select after the update instead (`v = where(keep,
v, old)`) keeps the old value alive beside the new one, and XLA copies each
slot to hold it. (`assign_add(v, where(keep, delta, 0))` also skips exactly,
but under XLA a kept step can differ from the ungated one in the last bit:
the select between the product and the sum changes what XLA fuses; TensorFlow
2.20 did so for Adam. It is what an optimizer that overrides `assign_add` or
`assign_sub` gets, as kmp cannot know how its override adds.)

A write made another way (AdamW's weight decay, an EMA's overwrite, a
subclass that calls `variable.assign`) escapes the gate: each backend finds
those (`kmp/backends/tensorflow/step.py` in the traced graph,
`gated_stateless_apply` by the values a `keras.StatelessScope` holds) and
selects their variables after the update, as before.
"""

import contextlib

import keras
from keras import ops

from kmp import _keras_internals

WRITES = ("assign", "assign_add", "assign_sub")


# What a gated write leaves where the step is kept, computed as Keras' own
# method computes it: TensorFlow's optimizer casts the value to the
# variable's dtype and adds in it (`casts_before_adding`);
# `keras.Variable.assign_add`, which a stateless apply reaches, adds with
# `ops.add`'s promotion and casts the sum. Either may be given a
# `keras.Variable`: SGD's `assign_add(variable, m)`.
def _kept(name, variable, value, casts_before_adding):
    value, current = value_of(value), value_of(variable)
    if casts_before_adding and name != "assign":
        value = ops.cast(value, current.dtype)
    return written(name, current, value)


def written(name, current, value):
    """What the write `name` (`"assign"`, `"assign_add"` or `"assign_sub"`)
    of `value` leaves in a variable holding `current`."""
    if name == "assign":
        return value
    return ops.add(current, value) if name == "assign_add" else ops.subtract(current, value)


def _keras_own(optimizer, name):
    """Whether `optimizer.<name>` is Keras' own method (not one a subclass
    or the instance overrides)."""
    method = getattr(optimizer, name)
    return getattr(method, "__module__", "").startswith("keras.") and name not in vars(optimizer)


def value_of(x):
    """A variable's value (within a `keras.StatelessScope`, the scope's)."""
    return x.value if isinstance(x, keras.Variable) else x


def writers(optimizer):
    """The optimizers that write `optimizer`'s updates: a
    `keras.optimizers.MultiOptimizer`'s sub-optimizers (Keras 3.15 and
    later), each through its own `assign` methods; any other, itself."""
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is not None and isinstance(optimizer, multi):
        return list(optimizer.optimizers)
    return [optimizer]


@contextlib.contextmanager
def gated_writes(optimizer, keep, around, *, casts_before_adding):
    """`_gated_writes_of` for each of `optimizer`'s `writers`."""
    with contextlib.ExitStack() as stack:
        for writer in writers(optimizer):
            stack.enter_context(_gated_writes_of(
                writer, keep, around, casts_before_adding=casts_before_adding))
        yield


@contextlib.contextmanager
def _gated_writes_of(optimizer, keep, around, *, casts_before_adding):
    """Shadows `optimizer`'s `assign`, `assign_add` and `assign_sub` on the
    instance for the block.

    Each wrapper calls the optimizer's own methods (a subclass's override,
    or one set on the instance, included): `around(variable, value, gated,
    plain)` decides, where `gated()` writes the value gated by `keep` (where
    all three are Keras' own, every write through `assign`, with the sum
    Keras' `assign_add` or `assign_sub` would have written) and `plain()`
    writes it as given; its return is the write's. The instance
    has none of the three of its own after the block (or those it had),
    whether the block returns or raises. `casts_before_adding`: whether the
    optimizer's `assign_add` casts the value to the variable's dtype before
    adding (Keras' TensorFlow optimizer) or adds first (`keras.Variable`'s).
    """
    methods = {name: getattr(optimizer, name) for name in WRITES}
    # Through Keras' own `assign` where all three are Keras' own.
    through_assign = all(_keras_own(optimizer, name) for name in WRITES)

    def gated_write(name, variable, value):
        if name == "assign" or through_assign:
            kept = _kept(name, variable, value, casts_before_adding)
            return methods["assign"](variable, ops.where(keep, kept, value_of(variable)))
        return methods[name](variable, ops.where(keep, value_of(value), 0))

    def gate(name):
        def write_where_kept(variable, value):
            return around(
                variable, value,
                lambda: gated_write(name, variable, value),
                lambda: methods[name](variable, value),
            )
        return write_where_kept

    with _keras_internals.shadowed(optimizer, {name: gate(name) for name in WRITES}):
        yield


def gated_stateless_apply(optimizer, keep, optimizer_values, grads, trainable_values, *,
                          extra=(), inside=contextlib.nullcontext):
    """`optimizer.stateless_apply(optimizer_values, grads, trainable_values)`
    where `keep`, the values given elsewhere, with no select after a write
    the gate made.

    As Keras' `stateless_apply`, the optimizer's `apply` runs in a
    `keras.StatelessScope` over its variables; each gated write notes the
    value it found and the one it left. A variable whose writes chain from
    its value before the step to its value after through gated writes alone
    takes that value; any other that changed is selected by `keep`.

    Args:
        extra: `(variable, value)` pairs of other variables the apply may
            write (a scaler's compensation buffers), in the scope too.
        inside: A context manager factory entered inside the gate, around
            the optimizer's `apply` (`kmp.precision._compensated`'s).

    Returns:
        `(new_trainable_values, new_optimizer_values, new_extra)`, the first
        two as Keras' `stateless_apply`'s, `new_extra` a dict from each
        extra variable's `id` to its new value.
    """
    built = list(_keras_internals.built_variables(optimizer))
    own = len(built) + len(optimizer.variables)
    variables = built + list(optimizer.variables) + [variable for variable, _ in extra]
    values = list(trainable_values) + list(optimizer_values) + [value for _, value in extra]
    chains = {}  # id(variable) -> [value before its first gated write, after its last, unbroken]
    with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
        before = [scope.get_current_value(v) for v in variables]

        def around(variable, value, gated, plain):
            found = scope.get_current_value(variable)
            result = gated()
            chain = chains.setdefault(id(variable), [found, found, True])
            chain[2] = chain[2] and chain[1] is found
            chain[1] = scope.get_current_value(variable)
            return result

        # A stateless apply writes through `keras.Variable.assign_add`.
        with gated_writes(optimizer, keep, around, casts_before_adding=False), inside():
            optimizer.apply(grads, built)
        after = [scope.get_current_value(v) for v in variables]
    new = []
    for variable, old, value in zip(variables, before, after):
        chain = chains.get(id(variable))
        if value is old:
            new.append(old)
        elif chain is not None and chain[2] and chain[0] is old and chain[1] is value:
            new.append(value)
        else:
            new.append(ops.where(keep, value, old))
    new_extra = {id(variable): value for variable, value in zip(variables[own:], new[own:])}
    return new[:len(built)], new[len(built):own], new_extra
