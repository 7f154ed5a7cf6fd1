"""tf.distribute: the strategies kmp trains under, and multi-worker training.

kmp trains under the default strategy, `tf.distribute.OneDeviceStrategy`,
`tf.distribute.MirroredStrategy` (several devices of one machine) and
`tf.distribute.MultiWorkerMirroredStrategy` (several machines, or several
processes of one). `kmp.Model.compile` refuses any other strategy.

Keras 3's `fit` fails under `MultiWorkerMirroredStrategy` with more than one
worker (keras-team/keras#20585, tensorflow/tensorflow#72388), at two places of
`keras/src/backend/tensorflow/trainer.py`:

1. `TensorFlowTrainer._maybe_symbolic_build` builds the model from the first
   batch, which it first averages over replicas with
   `strategy.reduce("MEAN", batch, axis=None)`. The batch is a tuple of
   `PerReplica` values; `MultiWorkerMirroredStrategy` does not reduce nested
   structures across workers and tries to convert the tuple to a tensor:
   `ValueError: Attempt to convert a value (PerReplica:{...}) with an
   unsupported type ... to a Tensor`.
2. `reduce_per_replica`, which turns the step's per-replica logs into single
   values, calls `strategy.reduce("MEAN", value, axis=0)` for every log under
   `MultiWorkerMirroredStrategy`; the logs are scalars, so this fails with
   `Invalid reduction dimension 0 for input with 0 dimensions`.

`kmp.Model` avoids both: it builds from this worker's own replica batch (only
shapes and dtypes matter, so no collective is needed) and, under
`MultiWorkerMirroredStrategy`, uses the train and test functions made here,
which reduce all the step's logs in one collective.
"""

import keras
import tensorflow as tf

from kmp import _keras_internals
from kmp.scaling import _retry

# The logs that every replica computes identically (they come from the loss
# scaler's state, which is decided on all-reduced gradients): they need no
# reduction across replicas.
_REPLICA_INVARIANT_LOGS = ("loss_scale", "skipped_steps") + _retry.ATTEMPT_LOGS

_SUPPORTED_STRATEGIES = (
    "the default strategy, tf.distribute.OneDeviceStrategy, "
    "tf.distribute.MirroredStrategy and tf.distribute.MultiWorkerMirroredStrategy"
)


def _is_supported(strategy):
    if type(strategy) in (
        tf.distribute.OneDeviceStrategy,
        tf.distribute.MirroredStrategy,
        tf.distribute.MultiWorkerMirroredStrategy,
    ):
        return True
    # The default strategy (no `strategy.scope()`) has no public class.
    return strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy()


def check_strategy(strategy):
    """Raises `ValueError` unless kmp trains correctly under `strategy`.

    Loss scaling must reach the same skip decision on every replica and count
    it once; kmp does that, and tests it, under the default strategy,
    `OneDeviceStrategy`, `MirroredStrategy` and `MultiWorkerMirroredStrategy`.
    Under any other strategy (`ParameterServerStrategy`, whose workers apply
    updates asynchronously; `TPUStrategy`, not tested;
    `CentralStorageStrategy`) it would train without that guarantee, so it
    does not train at all.

    Args:
        strategy: `tf.distribute.Strategy`. The model's strategy.

    Raises:
        ValueError: if `strategy` is not one of the supported strategies.
    """
    if _is_supported(strategy):
        return
    raise ValueError(
        f"kmp.Model does not support {type(strategy).__name__}: loss scaling "
        f"is tested under {_SUPPORTED_STRATEGIES} only. Create and compile the "
        "model under one of those. Received: "
        f"strategy={type(strategy).__module__}.{type(strategy).__qualname__}"
    )


def is_multi_worker(strategy):
    """Whether `strategy` is a `MultiWorkerMirroredStrategy`.

    With a single worker Keras' own train function works too, but kmp's gives
    the same result there, so one code path serves both.
    """
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def local_data_batch(strategy, data_batch):
    """Returns this worker's first replica's part of a distributed batch.

    Used in place of Keras' cross-replica mean of the first batch, which is
    only read for its shapes and dtypes (and which fails across workers).
    """

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return keras.tree.map_structure(local, data_batch)


def reduce_logs(logs, strategy):
    """Averages per-replica `logs` over all replicas, in one collective.

    Every floating or integer log is cast to float32, flattened and packed
    into one vector, averaged with a single `strategy.reduce`, and unpacked
    to its own shape and dtype. Logs in `_REPLICA_INVARIANT_LOGS` are read
    from the first local replica: they are the same everywhere. With one
    replica every log is its own value, and no collective runs.
    """
    flat = keras.tree.flatten(logs)
    local_first = [strategy.experimental_local_results(v)[0] for v in flat]
    paths = [path for path, _ in keras.tree.flatten_with_path(logs)]
    to_reduce = [
        i
        for i, path in enumerate(paths)
        if strategy.num_replicas_in_sync > 1
        and not (len(path) == 1 and path[0] in _REPLICA_INVARIANT_LOGS)
    ]
    results = list(local_first)
    if to_reduce:

        def pack(*values):
            return tf.concat(
                [tf.reshape(tf.cast(values[i], "float32"), [-1]) for i in to_reduce],
                axis=0,
            )

        packed = strategy.run(pack, args=tuple(flat))
        packed = strategy.reduce(tf.distribute.ReduceOp.MEAN, packed, axis=None)
        offset = 0
        for i in to_reduce:
            size = local_first[i].shape.num_elements()
            value = tf.reshape(packed[offset : offset + size], local_first[i].shape)
            results[i] = tf.cast(value, local_first[i].dtype)
            offset += size
    return keras.tree.pack_sequence_as(logs, results)


# What `fit` and `evaluate` hand a train or test function (`train_on_batch`
# hands a Python generator).
_ITERATORS = (tf.data.Iterator, tf.distribute.DistributedIterator)


def train_or_test_function(model, step_function, keras_function, retries=None):
    """The function that `fit` (or `evaluate`) calls for `step_function`.

    With `retries` (kmp.Model's own train step, where a batch can be
    redone), a `RetryingFunction`, in every mode and under every strategy.
    Otherwise kmp's own (`make_function`) under `MultiWorkerMirroredStrategy`,
    where Keras' fails; and with one replica, one step per call and a traced
    step (not `run_eagerly`), kmp's own for `tf.data` iterators too: Keras'
    own wraps each step's logs in a `tf.experimental.Optional` (so that a
    call running several steps can stop early without an error), and
    unwrapping it costs two more eager ops per call, about 0.2 ms on a CPU,
    where a small model's whole step takes 1.5 ms. Anything else (several
    replicas on one machine, `steps_per_execution > 1`, `run_eagerly`,
    `train_on_batch`'s generator) goes to `keras_function`.

    Args:
        model: `keras.Model`. The model being trained.
        step_function: Callable. `model.train_step` or `model.test_step`.
        keras_function: Keras' own function for it (`model.train_function`
            as `Model.make_train_function` set it).
        retries: A `kmp.scaling._retry.Retries`, or `None`.
    """
    strategy = model.distribute_strategy
    if retries is not None:
        function = RetryingFunction(model, step_function, retries)
        return function if is_multi_worker(strategy) else _ByIterator(function, keras_function)
    if is_multi_worker(strategy):
        return make_function(model, step_function)
    if (
        model.run_eagerly
        or model.steps_per_execution != 1
        or strategy.num_replicas_in_sync != 1
    ):
        return keras_function
    return _ByIterator(make_function(model, step_function), keras_function)


class _ByIterator:
    """`direct` for `tf.data` and distributed iterators, `keras_function`
    for anything else."""

    def __init__(self, direct, keras_function):
        self._direct, self._keras_function = direct, keras_function

    def __call__(self, iterator):
        if isinstance(iterator, _ITERATORS):
            return self._direct(iterator)
        return self._keras_function(iterator)


def _step_on_data(model, step_function, retries=False):
    """The function that runs `step_function` on one batch on every replica
    and reduces its logs (`reduce_logs`); a `tf.function`, compiled with
    `model.jit_compile`, unless `model.run_eagerly`.

    With `retries`, it takes the batch's `retries_left` (an int32 tensor, so
    that every budget runs the one trace, the one XLA program) and passes it
    to kmp.Model's own step.
    """
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data, *retries_left):
        # A generator's missing values (no sample weights) arrive as empty
        # Optionals, as in Keras' own function.
        data = keras.tree.map_structure(
            lambda v: None if isinstance(v, tf.experimental.Optional) else v, data
        )
        kwargs = {"retries_left": retries_left[0]} if retries else {}
        return reduce_logs(strategy.run(step_function, args=(data,), kwargs=kwargs), strategy)

    if model.run_eagerly:
        return one_step_on_data
    return tf.function(
        one_step_on_data,
        reduce_retracing=True,
        jit_compile=model.jit_compile,
        # Not inlined into the function that takes the batch: inlined, the
        # step's ops that do not read the batch (the optimizer's step
        # count, a dropout seed) would run even when the iterator turns out
        # empty and the call ends in OutOfRangeError. Called as a function,
        # the step starts once its batch is there. (An XLA-compiled step is
        # one op, which waits for its inputs.)
        experimental_attributes=(
            None if model.jit_compile else _keras_internals.noinline_function_attributes()
        ),
    )


def make_function(model, step_function, step_on_data=None):
    """Returns a train (or test) function that runs `step_function` per batch.

    It does what Keras' `TensorFlowTrainer._make_function` does (runs
    `step_function` on each replica, `model.steps_per_execution` steps per
    call, the step compiled with `model.jit_compile`), but returns the logs
    themselves, not wrapped in a `tf.experimental.Optional`, reduced with
    `reduce_logs`, which works across workers (see
    `train_or_test_function`).

    Args:
        model: `keras.Model`. The model being trained.
        step_function: Callable. `model.train_step` or `model.test_step`.
        step_on_data: Optional callable of one batch, run per step in place
            of `_step_on_data(model, step_function)`.

    What differs from Keras' function:

    - an exhausted iterator raises `tf.errors.OutOfRangeError` (from
      `iterator.get_next()`), where Keras' raises `StopIteration` after
      reading an empty `Optional`; `fit` and `evaluate` take either as the
      end of the epoch (Keras' epoch iterator catches both), but code that
      calls the function itself must catch `OutOfRangeError`;
    - the logs are returned as they are, not as an `Optional`;
    - under `MultiWorkerMirroredStrategy` the logs are reduced with
      `reduce_logs` (one collective), where Keras' reduction fails.

    `model.steps_per_execution` and `model.unrolled_steps_per_execution`
    (Keras 3.7 and later: steps per iteration of the loop, each after the
    first guarded by a cond) are honoured as in Keras.

    Returns:
        A function of a `tf.data` or distributed iterator that returns the
        logs of the last step it ran.
    """
    if step_on_data is None:
        step_on_data = _step_on_data(model, step_function)

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        steps = model.steps_per_execution
        # Keras' TensorFlow trainer (3.7 and later) runs this many steps per
        # iteration of its loop, each but the first guarded by a cond.
        unrolled = max(1, min(getattr(model, "unrolled_steps_per_execution", 1), steps))
        logs = step_on_data(iterator.get_next())
        if steps == 1:
            return logs

        def more(step, logs, next_data):
            # The distributed iterator tells every worker whether any worker
            # has run out of data, so all workers stop together.
            return tf.logical_and(step < steps, next_data.has_value())

        def one_step(step, logs, next_data):
            logs = step_on_data(next_data.get_value())
            # No batch is taken past the last step of this call.
            next_data = tf.cond(
                step + 1 < steps,
                iterator.get_next_as_optional,
                lambda: next_data,
            )
            return step + 1, logs, next_data

        def body(step, logs, next_data):
            step, logs, next_data = one_step(step, logs, next_data)
            for _ in range(unrolled - 1):
                step, logs, next_data = tf.cond(
                    more(step, logs, next_data),
                    lambda state=(step, logs, next_data): one_step(*state),
                    lambda state=(step, logs, next_data): state,
                )
            return step, logs, next_data

        _, logs, _ = tf.while_loop(
            more, body, (tf.constant(1), logs, iterator.get_next_as_optional())
        )
        return logs

    if not model.run_eagerly:
        multi_step_on_iterator = tf.function(
            multi_step_on_iterator, reduce_retracing=True
        )
    return multi_step_on_iterator


class RetryingFunction:
    """fit's train function where kmp.Model's own step can redo a batch.

    ```
    def train_function(iterator):
        if retries.budget() == 0:              # settled, or no retry left to ask
            return steady(iterator)            # make_function's, no host read
        for each of steps_per_execution batches:
            batch = next(iterator)
            logs = retries.run(                # kmp.scaling._retry
                lambda left: step(batch, left), lambda left: step(batch, left))
        return logs
    ```

    One step function, traced (and compiled by XLA) once: both paths call
    it with the batch's `retries_left` as an int32 tensor, 0 on the steady
    path. Each batch that may be redone is taken from the iterator on the
    host, so that it can be given to the step again; its flag is then read
    (the host waits for that step). Once the scale has settled under
    `overflow_retries="auto"` the budget is 0 and nothing is read: the
    steady path is `make_function`'s, the step's retry flag unread. The
    same in eager mode, as a graph and under XLA, under every strategy.

    Args:
        model: The `kmp.Model`.
        step_function: Its `train_step`.
        retries: The `kmp.scaling._retry.Retries`.
    """

    def __init__(self, model, step_function, retries):
        self._model, self._retries = model, retries
        no_retry = tf.constant(0, tf.int32)
        # First: `train_function_graph` (benchmarks.xla_step) reads the
        # nearest `tf.function` as the one `fit` runs per call.
        self._steady = make_function(
            model, step_function, step_on_data=lambda data: self._step(data, no_retry))
        self._step = _step_on_data(model, step_function, retries=True)
        self._first = self._again = None

    def __call__(self, iterator):
        if self._retries.budget() == 0:
            return _retry.without_attempt_logs(self._steady(iterator))
        first, again = self._attempts(iterator)
        logs = None
        for _ in range(self._model.steps_per_execution):
            batch = []

            def attempt(retries_left):
                retries_left = tf.constant(retries_left, tf.int32)
                if batch:
                    return again(batch[0], retries_left)
                try:
                    logs, data = first(iterator, retries_left)
                except (StopIteration, tf.errors.OutOfRangeError):
                    batch.append(None)
                    raise
                batch.append(data)
                return logs

            try:
                logs = self._retries.run(attempt, attempt)
            except (StopIteration, tf.errors.OutOfRangeError):
                if logs is None:
                    raise
                break
        return logs

    def _attempts(self, iterator):
        """`(first, again)`: the batch's first attempt, which takes it from
        the iterator and returns it with its logs, and the same batch again.

        Both call the one step function with the batch as the iterator's
        own element spec gives it (its batch dimension unknown), as the
        steady path does, so that it is traced, and compiled by XLA, once.
        """
        if self._first is not None:
            return self._first, self._again
        step = self._step

        def first(iterator, retries_left):
            data = next(iterator) if self._model.run_eagerly else iterator.get_next()
            return step(data, retries_left), data

        if self._model.run_eagerly or not isinstance(iterator, tf.data.Iterator):
            # A distributed iterator's batch is taken on the host (its
            # per-replica values do not leave a function).
            self._first = lambda iterator, retries_left: (
                lambda data: (step(data, retries_left), data))(next(iterator))
            self._again = step
        else:
            self._first = tf.function(first, reduce_retracing=True)
            self._again = tf.function(step, input_signature=(
                iterator.element_spec, tf.TensorSpec((), tf.int32)))
        return self._first, self._again


def symbolic_build(model, iterator):
    """Builds `model` from this worker's first batch of `iterator`.

    `iterator` is Keras' epoch iterator, which yields `(step, iterator)` up to
    Keras 3.10 and `(begin_step, end_step, iterator)` in later releases; the
    distributed iterator is the last item in both.
    """
    for entry in iterator:
        distributed_iterator = entry[-1]
        data_batch = local_data_batch(
            model.distribute_strategy, next(distributed_iterator)
        )
        break
    else:
        return
    with model.distribute_strategy.scope():
        _keras_internals.symbolic_build(model, data_batch)

