"""Keras' sparse-gradient optimizer tests, their loss-scale-optimizer case,
on `kmp.LossScaleOptimizer`.

Ported from keras-team/keras, keras/src/optimizers/optimizer_sparse_test.py
(`OptimizerSparseTest.test_sparse_gradients` and `test_sparse_correctness`,
case `loss_scale_optimizer_sgd`: a scaler around `SGD(learning_rate=0.5)`).
The other cases test Keras' own optimizers, not kmp. Both backends support
sparse gradients (`tf.IndexedSlices`, JAX's `BCOO`), so both passes run it.
"""

from unittest import mock

import keras
import numpy as np
import pytest
from keras import ops

import kmp

ON_TF = keras.backend.backend() == "tensorflow"


def _make_optimizer():
    return kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))


def _sparse(values, indices, shape):
    if ON_TF:
        import tensorflow as tf

        return tf.IndexedSlices(values, indices, shape)
    import jax.experimental.sparse as jax_sparse

    return jax_sparse.BCOO((values, tuple((i,) for i in indices)), shape=shape)


@pytest.mark.filterwarnings("ignore:kmp.LossScaleOptimizer .* divided gradients")
def test_sparse_gradients():
    """Original: `test_sparse_gradients[loss_scale_optimizer_sgd]`: a sparse
    gradient reaches the model variable as a sparse update through the
    inner optimizer's `assign*` (Keras' expectation for SGD behind a scaler:
    model updates sparse, no sparse update of an optimizer variable), and no
    model variable or inner-optimizer slot is assigned directly."""
    model_variable = keras.Variable(initializer="ones", shape=(5, 10))
    optimizer = _make_optimizer()
    grad = _sparse(0.5 * ops.ones((3, 10)), (0, 2, 4), (5, 10))
    if ON_TF:
        import tensorflow as tf

        sparse_class = tf.IndexedSlices
        variable_class = model_variable.value.__class__
    else:
        import jax.experimental.sparse as jax_sparse

        sparse_class = jax_sparse.JAXSparse
        variable_class = model_variable.__class__
    inner = optimizer.inner_optimizer
    updates = {"model": False, "optimizer": False}

    def optimizer_assign(variable, value):
        if isinstance(variable, keras.Variable):
            variable = variable.value
        if isinstance(value, sparse_class):
            if variable is model_variable.value:
                updates["model"] = True
            elif any(variable is v.value for v in optimizer.variables):
                updates["optimizer"] = True

    def own_state(variable):
        # The scaler's own state (scale, counters) holds no gradient and is
        # never sparse: the original exempts Keras' scaler's state the same
        # way, by its shape (scalars); kmp keeps its counters in one vector.
        inner_ids = {id(v) for v in inner.variables}
        return any(variable is v or variable is v.value
                   for v in optimizer.variables if id(v) not in inner_ids)

    def variable_assign(variable, value):
        if len(variable.shape) and not own_state(variable):
            pytest.fail(
                "A variable of shape "
                f"{tuple(variable.shape)} was assigned directly, not through the optimizer's "
                "`assign`/`assign_add`/`assign_sub`: a sparse update would be densified."
            )

    with (
        mock.patch.object(inner, "assign", autospec=True) as inner_assign,
        mock.patch.object(inner, "assign_add", autospec=True) as inner_assign_add,
        mock.patch.object(inner, "assign_sub", autospec=True) as inner_assign_sub,
        mock.patch.object(variable_class, "assign", autospec=True) as v_assign,
        mock.patch.object(variable_class, "assign_add", autospec=True) as v_assign_add,
        mock.patch.object(variable_class, "assign_sub", autospec=True) as v_assign_sub,
    ):
        for patched in (inner_assign, inner_assign_add, inner_assign_sub):
            patched.side_effect = optimizer_assign
        for patched in (v_assign, v_assign_add, v_assign_sub):
            patched.side_effect = variable_assign
        optimizer.apply([grad], [model_variable])
    assert updates == {"model": True, "optimizer": False}


@pytest.mark.filterwarnings("ignore:kmp.LossScaleOptimizer .* divided gradients")
def test_sparse_correctness():
    """Original: `test_sparse_correctness[loss_scale_optimizer_sgd]`: five
    steps with a sparse gradient (rows 0, 2, 4 set to 10 - i) give what the
    same dense gradient gives; on JAX through `stateless_apply` with the
    optimizers' `variables`, as the original passes them. Keras' own scaler,
    given the dense gradients, is the second reference."""
    optimizer_sparse, optimizer_dense = _make_optimizer(), _make_optimizer()
    reference = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    var_sparse = keras.Variable(initializer="ones", shape=(5, 3, 2))
    var_dense = keras.Variable(initializer="ones", shape=(5, 3, 2))
    var_reference = keras.Variable(initializer="ones", shape=(5, 3, 2))
    stateless = not ON_TF
    if stateless:
        optimizer_sparse.build([var_sparse])
        optimizer_dense.build([var_dense])
        reference.build([var_reference])
    sparse_state, dense_state = optimizer_sparse.variables, optimizer_dense.variables
    reference_state = [v.value for v in reference.variables]
    sparse_values, dense_values = [var_sparse.value], [var_dense.value]
    reference_values = [var_reference.value]
    for i in range(5):
        grad_sparse = _sparse(ops.ones((3, 3, 2)) * (10.0 - i), (0, 2, 4), (5, 3, 2))
        grad_dense = ops.convert_to_tensor(grad_sparse, sparse=False)
        if stateless:
            sparse_values, sparse_state = optimizer_sparse.stateless_apply(
                sparse_state, [grad_sparse], sparse_values
            )
            dense_values, dense_state = optimizer_dense.stateless_apply(
                dense_state, [grad_dense], dense_values
            )
            reference_values, reference_state = reference.stateless_apply(
                reference_state, [grad_dense], reference_values
            )
            np.testing.assert_allclose(sparse_values[0], dense_values[0])
            np.testing.assert_allclose(sparse_values[0], reference_values[0])
        else:
            optimizer_sparse.apply([grad_sparse], [var_sparse])
            optimizer_dense.apply([grad_dense], [var_dense])
            reference.apply([grad_dense], [var_reference])
            np.testing.assert_allclose(var_sparse.value, var_dense.value)
            np.testing.assert_allclose(var_sparse.value, var_reference.value)
