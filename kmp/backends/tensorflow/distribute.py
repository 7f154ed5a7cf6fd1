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

import collections

import keras
import tensorflow as tf

from kmp import _keras_internals

# The logs that every replica computes identically (they come from the loss
# scaler's state, which is decided on all-reduced gradients): they need no
# reduction across replicas.
_REPLICA_INVARIANT_LOGS = ("loss_scale", "skipped_steps")
# The log by which an XLA-compiled train step asks its train function to
# redo the batch (see `make_function`); never in the logs `fit` sees.
RETRY_LOG = "_kmp_retry"

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


def train_or_test_function(model, step_function, keras_function, retries=False):
    """The function that `fit` (or `evaluate`) calls for `step_function`.

    kmp's own (`make_function`) under `MultiWorkerMirroredStrategy`, where
    Keras' fails. With one replica, one step per call and a traced step
    (not `run_eagerly`), kmp's own for `tf.data` iterators too: Keras' own
    wraps each step's logs in a `tf.experimental.Optional` (so that a call
    running several steps can stop early without an error), and unwrapping
    it costs two more eager ops per call, about 0.2 ms on a CPU, where a
    small model's whole step takes 1.5 ms. Anything else (several
    replicas on one machine, `steps_per_execution > 1`, `run_eagerly`,
    `train_on_batch`'s generator) goes to `keras_function`.

    With `retries` (a train step compiled by XLA whose overflowing batches
    kmp redoes), kmp's own for `tf.data` iterators with one replica whatever
    `steps_per_execution`: it redoes a batch by calling the compiled step
    again (see `make_function`).

    Args:
        model: `keras.Model`. The model being trained.
        step_function: Callable. `model.train_step` or `model.test_step`.
        keras_function: Keras' own function for it (`model.train_function`
            as `Model.make_train_function` set it).
        retries: Bool. Whether the function redoes overflowing batches
            around an XLA-compiled step. Defaults to `False`.
    """
    strategy = model.distribute_strategy
    if is_multi_worker(strategy):
        return make_function(model, step_function)
    if (
        model.run_eagerly
        or (model.steps_per_execution != 1 and not retries)
        or strategy.num_replicas_in_sync != 1
    ):
        return keras_function
    return _ByIterator(make_function(model, step_function, retries=retries), keras_function)


class _ByIterator:
    """`direct` for `tf.data` and distributed iterators, `keras_function`
    for anything else; `finish_epoch` is `direct`'s, where it has one."""

    def __init__(self, direct, keras_function):
        self._direct, self._keras_function = direct, keras_function
        self.finish_epoch = getattr(direct, "finish_epoch", lambda: None)

    def __call__(self, iterator):
        if isinstance(iterator, _ITERATORS):
            return self._direct(iterator)
        return self._keras_function(iterator)


def make_function(model, step_function, retries=False):
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

    With `retries` (a train step compiled by XLA), a batch whose gradients
    overflowed is redone by calling the compiled step again on it. With one
    step per call, `RedoLater` does it from Python, one call later, so that
    nothing in the function waits for the step's outcome (see there). With
    several, the function redoes it at once:

    ```
    logs = step(batch, attempt=0)          # one XLA program: one attempt
    while logs.pop(RETRY_LOG):             # the scale has backed off
        logs = step(batch, attempt=1, 2, ...)
    ```

    an `If` op whose predicate the host reads, so each of those steps
    waits for the one before it. In both, the step is compiled once, and
    XLA sees no loop or branch that may write the variables: each would get
    buffers of its own and copy every weight and slot on every step (see
    `kmp.backends.tensorflow.trainer.train_step`).

    Returns:
        A function of a `tf.data` or distributed iterator that returns the
        logs of the last step it ran (a `RedoLater` with retries and one
        step per call).
    """
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data, attempt=None):
        # A generator's missing values (no sample weights) arrive as empty
        # Optionals, as in Keras' own function.
        data = keras.tree.map_structure(
            lambda v: None if isinstance(v, tf.experimental.Optional) else v, data
        )
        # The attempt, where this function redoes batches: an argument of
        # kmp.Model's own step (`kmp.backends.tensorflow.trainer.train_step`).
        kwargs = {} if attempt is None else {"attempt": attempt}
        return reduce_logs(strategy.run(step_function, args=(data,), kwargs=kwargs), strategy)

    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=model.jit_compile,
            # Not inlined into the function that takes the batch: inlined,
            # the step's ops that do not read the batch (the optimizer's
            # step count, a dropout seed) would run even when the iterator
            # turns out empty and the call ends in OutOfRangeError. Called
            # as a function, the step starts once its batch is there. (An
            # XLA-compiled step is one op, which waits for its inputs.)
            experimental_attributes=(
                None if model.jit_compile else _keras_internals.noinline_function_attributes()
            ),
        )

    def step_on_data(data):
        if not retries:
            return one_step_on_data(data)
        def attempt_again(attempt, retry, logs):
            logs = dict(one_step_on_data(data, attempt))
            return attempt + 1, logs.pop(RETRY_LOG), logs

        _, retry, logs = attempt_again(tf.constant(0), None, None)

        def redo():
            return tf.while_loop(
                lambda attempt, retry, logs: retry,
                attempt_again,
                (tf.constant(1), tf.constant(True), logs),
            )[2]

        # One `If` op that TensorFlow does not lower to switches: the loop
        # calls the compiled step, whose every variable a lowered cond (or a
        # bare `tf.while_loop`) would pass through an op of its own on every
        # step, taken or not (~0.5 ms a step on a CPU for 200 variables).
        return _keras_internals.unlowered_cond(retry, redo, lambda: logs)

    if retries and model.steps_per_execution == 1 and not model.run_eagerly:

        @tf.autograph.experimental.do_not_convert
        def launch(iterator):
            data = iterator.get_next()
            return one_step_on_data(data, tf.constant(0)), data

        return RedoLater(model, tf.function(launch, reduce_retracing=True), one_step_on_data)

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


class RedoLater:
    """fit's train function with retries around an XLA-compiled step, one
    step per call: an overflowing batch is redone one call later.

    ```
    def train_function(iterator):
        logs, batch = step(next(iterator), attempt=0)     # launched, not awaited
        checked = pending[:]                    # the steps launched before
        pending.append((batch, 1, logs.pop(RETRY_LOG)))
        for batch, attempt, retry in checked:   # done, or nearly: the
            if retry:                           # device has this call's step
                logs = step(batch, attempt)     # queued behind them
                pending.append((batch, attempt + 1, logs.pop(RETRY_LOG)))
        return logs                             # of the step launched last
    ```

    The host reads a step's retry flag only after it has launched the next
    step, so the device always has a step queued while the host waits: a
    flag read at once (an `If` on it in the function) made the host wait
    for every step before it could launch the next, and the device idle
    while it did. An overflowing batch is so redone after the next batch:
    the scale backed off in the step that overflowed, so that batch already
    runs at the lower scale. Until a first step has been applied (the
    scale settling on the first batch, `overflow_retries="auto"`'s 32
    retries) each step is checked at once and redone before the next, as
    without XLA: otherwise every batch launched meanwhile would overflow too.

    `finish_epoch` redoes what is still pending, before the epoch's logs are
    read (`kmp.Model` calls it there), so no batch is lost at an epoch's end.

    Args:
        model: The `kmp.Model`.
        launch: `tf.function` of an iterator: `(logs, batch)` of its next
            batch's first attempt.
        redo: The compiled step, a `tf.function` of `(batch, attempt)`.
    """

    def __init__(self, model, launch, redo):
        self._model, self._launch, self._redo = model, launch, redo
        self._pending = collections.deque()  # (batch, attempt, retry flag)
        self._settled = False

    def __call__(self, iterator):
        logs, batch = self._launch(iterator)
        checked = len(self._pending)
        logs = self._queue(batch, 1, logs)
        if not self._settled:
            logs = self._redo_pending(logs, None)
            iterations = self._model.optimizer.iterations
            self._settled = bool(keras.ops.convert_to_numpy(iterations) > 0)
            return logs
        return self._redo_pending(logs, checked)

    def finish_epoch(self):
        """Redoes every batch still pending that asks for it; returns the
        logs of the last step redone, or `None` where none was."""
        if not self._pending:
            return None
        return self._redo_pending(None, None)

    def _queue(self, batch, attempt, logs):
        logs = dict(logs)
        self._pending.append((batch, attempt, logs.pop(RETRY_LOG)))
        return logs

    def _redo_pending(self, logs, count):
        """Checks the `count` oldest pending steps (all, and the redos they
        lead to, where `None`) and redoes those that ask for it."""
        while self._pending and (count is None or count > 0):
            batch, attempt, retry = self._pending.popleft()
            if count is not None:
                count -= 1
            if bool(retry):
                logs = self._queue(batch, attempt + 1, self._redo(batch, tf.constant(attempt)))
        return logs


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

