"""Gated writes: a skipped step as a select inside each write an optimizer
makes through its own `assign`, `assign_add` and `assign_sub`.

Keras' optimizers write their slots and variables through those three
methods (`self.assign_add(m, (g - m) * (1 - beta_1))`). Called with
`where(keep, delta, 0)` (or `where(keep, value, variable)`), each write
changes nothing on a skipped step, and XLA fuses the select into the update
that computes it. A select after the update instead (`v = where(keep, v,
old)`) keeps the old value alive beside the new one, and XLA copies each
slot to hold it.

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

# What each write is given: `value` where the step is kept, and where it is
# skipped what leaves the variable as it is (either may be a `keras.Variable`:
# SGD's `assign_add(variable, m)`).
WRITES = {
    "assign": lambda keep, variable, value: ops.where(keep, value_of(value), value_of(variable)),
    "assign_add": lambda keep, variable, value: ops.where(keep, value_of(value), 0),
    "assign_sub": lambda keep, variable, value: ops.where(keep, value_of(value), 0),
}


def value_of(x):
    """A variable's value (within a `keras.StatelessScope`, the scope's)."""
    return x.value if isinstance(x, keras.Variable) else x


@contextlib.contextmanager
def gated_writes(optimizer, keep, around):
    """Shadows `optimizer`'s `assign`, `assign_add` and `assign_sub` on the
    instance for the block.

    Each wrapper calls the optimizer's own method (a subclass's override, or
    one set on the instance, included): `around(variable, value, gated,
    plain)` decides, where `gated()` writes the value gated by `keep` and
    `plain()` writes it as given; its return is the write's. The instance
    has none of the three of its own after the block (or those it had),
    whether the block returns or raises.
    """
    own = vars(optimizer)
    shadowed = {name: own[name] for name in WRITES if name in own}

    def gate(name, write):
        def write_where_kept(variable, value):
            return around(
                variable, value,
                lambda: write(variable, WRITES[name](keep, variable, value)),
                lambda: write(variable, value),
            )
        return write_where_kept

    for name in WRITES:
        setattr(optimizer, name, gate(name, getattr(optimizer, name)))
    try:
        yield
    finally:
        for name in WRITES:
            if name in shadowed:
                setattr(optimizer, name, shadowed[name])
            else:
                delattr(optimizer, name)


def gated_stateless_apply(optimizer, keep, optimizer_values, grads, trainable_values):
    """`optimizer.stateless_apply(optimizer_values, grads, trainable_values)`
    where `keep`, the values given elsewhere, with no select after a write
    the gate made.

    As Keras' `stateless_apply`, the optimizer's `apply` runs in a
    `keras.StatelessScope` over its variables; each gated write notes the
    value it found and the one it left. A variable whose writes chain from
    its value before the step to its value after through gated writes alone
    takes that value; any other that changed is selected by `keep`.

    Returns:
        `(new_trainable_values, new_optimizer_values)`, as Keras'.
    """
    built = list(_keras_internals.built_variables(optimizer))
    variables = built + list(optimizer.variables)
    values = list(trainable_values) + list(optimizer_values)
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

        with gated_writes(optimizer, keep, around):
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
    return new[:len(built)], new[len(built):]
