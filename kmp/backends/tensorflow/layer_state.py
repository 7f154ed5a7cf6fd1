"""What a forward pass writes to a model's non-trainable variables, kept out
of a step that is skipped or redone.

A layer called with `training=True` may assign its own state:
`BatchNormalization` its moving mean and variance, `Dropout` its seed
generator. A skipped step changes no weight, and a redone batch counts once,
so an attempt that does not count puts that state back as it was:

```
before = [v.value for v in candidates]        # read before the forward pass
... forward, backward, apply ...
for v in written(candidates):                 # found in the traced graph
    v.assign(where(finite, v.value, before))  # a select: no branch, no copy
```

Which variables the pass wrote is read from the graph being traced (the ops
made since a mark that take a variable's handle and do not only read it),
not assumed: a frozen layer's weights are only read, so they get no select
and no write (restoring every `model.non_trainable_variables` would rewrite
a frozen backbone each step); what remains of them is a read taken before
the pass and never used, which XLA drops. A variable whose handle reaches a
nested function is counted as written (that function may assign it). JAX's
step gets the same from Keras' stateless call (`kmp/backends/jax/trainer.py`).
"""

import tensorflow as tf
from keras import ops

from kmp import _keras_internals

# Ops that take a variable's handle and only read it.
_READS = frozenset((
    "ReadVariableOp", "VarIsInitializedOp", "VariableShape", "ResourceGather",
    "ResourceGatherNd",
))


class ForwardState:
    """The candidates' values before a forward pass, and their restore.

    Args:
        model: The `keras.Model` about to run a forward pass in the graph
            being traced.
    """

    def __init__(self, model):
        metrics = {id(v) for v in model.metrics_variables}
        self._candidates = [
            v for v in model.non_trainable_variables if id(v) not in metrics
        ]
        # Run eagerly (`run_eagerly=True`) no graph records the pass: each
        # candidate is read now and put back, on the host, where the step
        # does not count.
        self._eager = tf.executing_eagerly()
        self._graph = None if self._eager else _keras_internals.default_graph()
        self._before = [tf.identity(v.value) for v in self._candidates]
        self._mark = 0 if self._eager else len(self._graph.get_operations())

    def restore_unless(self, finite):
        """Puts back, where `finite` is false, the candidates the ops made
        since this object was made wrote (eagerly: every candidate)."""
        if self._eager:
            if not bool(finite):
                for variable, before in zip(self._candidates, self._before):
                    variable.assign(before)
            return
        written = _written_handles(self._graph.get_operations()[self._mark:])
        for variable, before in zip(self._candidates, self._before):
            if id(variable.value.handle) in written:
                variable.assign(ops.where(finite, variable.value, before))


def _written_handles(new_ops):
    """`id`s of the eager handles of the variables `new_ops` may write."""
    written = set()
    for op in new_ops:
        if op.type in _READS:
            continue
        for tensor in op.inputs:
            if tensor.dtype == tf.resource:
                handle = _eager_handle(tensor)
                if handle is not None:
                    written.add(id(handle))
    return written


def _eager_handle(tensor):
    """The eager handle a graph's resource input was captured from, through
    the enclosing function graphs (a loop body's capture of its function's
    capture); `None` for a handle made in the graph."""
    while True:
        graph = tensor.graph
        outer = next(
            (external for external, internal in getattr(graph, "captures", ())
             if internal is tensor),
            None,
        )
        if outer is None:
            return None
        if not tf.is_symbolic_tensor(outer):
            return outer
        tensor = outer
