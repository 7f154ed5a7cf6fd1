"""The Keras and TensorFlow internals kmp uses, in one place.

Everything else in kmp uses Keras' and TensorFlow's public API (`keras.*`,
`keras.ops`, `keras.tree`, `tf.*`). What it cannot do there, it does here:
the names imported below from `keras.src`, and the private attributes and
methods that the functions and classes below read, set or override. Keras
may change any of them in any release; when one moves, this module is the
only one to mend. `tests/test_boundary.py` fails on a private Keras or
TensorFlow name (attribute, override, private module) used in any other kmp
module, and on one used here that this docstring does not name;
`tests/test_api.py` fails on an import of `keras.src` anywhere else. CI
(`.ci/run`) runs the core tests on every Keras minor release pyproject.toml
admits, 3.10 through 3.15, each with a TensorFlow it installs with (3.10
with TensorFlow 2.19, 3.11 with 2.20, 3.12 to 3.15 with the newest), so a
name that moves in any of them fails there (see README, "Tested with").

Private names of Keras and TensorFlow objects used here, and why (each
Keras one is present from Keras 3.10 to 3.15, most since 3.0, each
TensorFlow one in the TensorFlows CI installs; the function or class that
uses it says more):

| name | here | used by | why |
|---|---|---|---|
| `Layer._flatten_layers` | `nested_layers` | `precision/_settle.py`, `precision/_float32_layers.py`, `precision/_keep_float32.py`, `precision/_token_ids.py`, `precision/_layer_dtypes.py`, `convert.py`, `export.py`, `diagnose.py`, `diagnosis/_static.py` | every nested layer, which `model.layers` does not list |
| `Layer._call_has_training_arg` | `call_takes_training` | `convert.py`, `backends/tensorflow/trainer.py`, `precision/_float8_training.py`, `precision/_float8_probe.py`, `backends/jax/float8.py` | call a wrapped model, and a model in kmp.Model's own TensorFlow step, as Keras would; whether `fit` puts a subclassed model's float8 layers in training mode |
| `Layer._build_shapes_dict` | `build_shapes` | `precision/_float8_training.py` | the input shape a subclassed model was built with: `enable`'s check of which float8 layers Keras' JAX `fit` runs in training mode, on a batch of zeros of that shape |
| `Trainer._compute_loss` | `compute_loss` | `backends/tensorflow/trainer.py` | kmp.Model's own TensorFlow step computes the loss as Keras' step does (an override of `compute_loss` without `training` still works) |
| `Layer._convert_input_args` | `converts_inputs` | `precision/_settle.py` | whether a float32 layer's consumer casts its outputs back to 16 bits itself |
| `KerasTensor._keras_history` | `producing_layer` | `diagnosis/_static.py` | which layer produced a functional model's output |
| `Operation._inbound_nodes` | `producing_inputs` | `float8.py` (through `precision/_float8_rule.py`) | the tensors a layer was called on: the rule walks a functional model back from its output, through layers without weights, to the layer that makes it |
| `Trainer._compile_config` | `compile_arguments` | `export.py` | `kmp.load_model`'s `LossScaleOptimizer` recorded for the next save |
| `Trainer._initial_epoch` | `set_initial_epoch` | `checkpoint.py` | the epoch `fit` resumes from, set as Keras' own `BackupAndRestore` sets it |
| `BackupAndRestore._load_model`, `_save_model` (overridden) | `BackupAndRestoreBase` | `checkpoint.py` | the restore and the save Keras' callback calls (its `on_train_batch_end` for an integer `save_freq`): kmp's check, lock and atomic write (`_kmp_load_backup`, `_kmp_save_backup`) |
| `BackupAndRestore._current_epoch`, `_last_batch_seen`, `_training_metadata_path` | `BackupAndRestoreBase`'s `_kmp_*` properties | `checkpoint.py` | the epoch and batch a backup records, which Keras' `on_epoch_end` and `_should_save_on_batch` keep too, reset at each `on_train_begin`; where kmp records them |
| `ModelCheckpoint._save_model` (overridden), `_get_file_path`, `_should_save_model` | `ModelCheckpointBase` | `checkpoint.py` | the save Keras' callback calls for every checkpoint: the file and whether to save stay Keras', the write is kmp's atomic one (`_kmp_write_checkpoint`) |
| `Tensor._keras_logits` | `keep_logits` | `precision/_float32_layers.py` | the logits Keras' softmax/sigmoid leave on their output, carried over kmp's float32 output cast so that Keras' cross-entropies still differentiate from logits (a cast hid them, and `log(p)`'s gradient overflowed float16 where Keras' did not) |
| `keras.src.backend.common.masking` (`get_keras_mask`, `set_keras_mask`) | `keep_mask` | `precision/_float32_layers.py` | the mask a masking layer (`Embedding(mask_zero=True)`, `Masking`) leaves on a model's output, which Keras' compiled loss and metrics weight by, carried over kmp's float32 output cast (the cast dropped it, and padded steps counted in the loss) |
| `Optimizer._trainable_variables` | `built_variables` | `loss_scale.py`, `scaling/_step.py`, `backends/jax/step.py`, `monitor/_steps.py` | the variables an optimizer was built with (`apply(grads)` without variables; the monitor's names) |
| `Optimizer._filter_empty_gradients` | `filter_empty_gradients` | `loss_scale.py` | drop `None` gradients exactly as Keras' `apply` does |
| `Optimizer._get_variable_index` | `variable_index` | `scaling/_step.py` | which variable overflowed, for the monitor |
| `Optimizer._overwrite_variable_with_gradient` | `overwritten_with_gradient` | `scaling/_step.py`, `backends/tensorflow/step.py` | variables Keras overwrites with their "gradient" are not unscaled (as Keras' scaler) |
| `Optimizer._iterations` | `micro_steps` | `backends/tensorflow/step.py`, `backends/tensorflow/selects.py` | the micro-step count (`iterations` counts windows): a window's last micro-batch, and its start when a window is discarded |
| `Optimizer._backend_reset_gradient_accumulators` | `reset_gradient_accumulators` | `backends/tensorflow/step.py`, `backends/tensorflow/selects.py` | discard a window with an overflow |
| `Optimizer._clip_gradients` | `clip_gradients` | `backends/tensorflow/step.py` | under several replicas, clip the gradients summed over replicas with the inner optimizer's own rule (Keras clips each replica's share) |
| `tf.__internal__.distribute.strategy_supports_no_merge_call` | `supports_no_merge_call` | `backends/tensorflow/step.py` | whether a step can run without `merge_call` (per-replica decisions) |
| `Operation._set_attr`, the `If` attribute `_lower_using_switch_merge` | `functional_conds` | `backends/tensorflow/step.py` | the skip's `cond` without XLA runs as a function rather than as Switch and Merge ops (a step of hundreds of variables: 0.77x Keras' step lowered, 0.95x not) |
| `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext` | `in_xla_context` | `backends/tensorflow/step.py` | whether the step being traced is compiled by XLA (`jit_compile=True`), where the skip is a select |
| `tf.compat.v1.get_default_graph` | `default_graph` | `backends/tensorflow/step.py`, `backends/tensorflow/selects.py`, `backends/tensorflow/layer_state.py` | whether a recorded loss belongs to the graph being traced |
| `JAXTrainer._update_metrics_variables` | `update_metrics_variables` | `backends/jax/trainer.py` | the metrics of a JAX train step, updated as Keras' own step updates them |
| `Trainer._loss_tracker` | `loss_tracker` | `backends/tensorflow/trainer.py`, `backends/jax/trainer.py` | whether a step computed a loss, for the loss a skipped step logs |
| `Trainer._flatten_metrics_in_order` | `logs_as_list` | `model.py` | `train_on_batch`'s list, made as Keras makes it, from the logs without kmp's scaler entries |
| `Trainer._maybe_symbolic_build` (overridden), `_distribute_strategy` | `ModelBase` | `model.py` | build across workers, where Keras' own build fails: kmp's build from this worker's batch (`_kmp_build_from_iterator`) |
| `Trainer._symbolic_build` | `symbolic_build` | `backends/tensorflow/distribute.py` | that build, as `fit` runs it, from this worker's batch |
| `Variable._autocast` | `following_autocast` | `precision/_compensated.py` | a 16-bit weight Keras made with `autocast=False` (normalization layers' gamma and beta) read in float32 while its update is computed, as the others are |
| `keras.src.backend.common.global_state.get_global_attribute("current_call_ctx")`, `CallContext.entry_layer` | `called_alone` | `scaling/_model_step.py` | a layer a custom `train_step` calls itself, not from within another layer's `call` |
| `keras.src.backend.common.variables` (`AutocastScope`, `get_autocast_scope`), `keras.src.backend.common.global_state.set_global_attribute("autocast_scope")` | `autocast` | `precision/_compensated.py` | a bfloat16 variable's update computed in float32 by any Keras optimizer: its `update_step` casts by `variable.dtype`, which Keras' autocast scope makes float32, and reads the variable and its slots as float32 there |
| `Optimizer._get_variable_index`, `_apply_weight_decay` (shadowed on the instance for one `apply`, `shadowed`), `_use_weight_decay` | `shadowed_optimizer_methods`, `uses_weight_decay` | `precision/_compensated.py` | in that scope TensorFlow's optimizer would look a slot up by a cast value, not its `tf.Variable`; the weight decay of a bfloat16 variable computed in float32 and written compensated, as its update is |
| `_noinline` (a `tf.function(experimental_attributes=...)` attribute) | `noinline_function_attributes` | `backends/tensorflow/distribute.py` | a train step starts only once its batch has arrived (`tests/test_train_function.py` fails if TensorFlow inlines it again) |

`precision/_token_ids.py` also overrides `DTypePolicy.convert_input` (public) in kmp's
own `_ExactIdsPolicy`: Keras' autocast of a layer's inputs, so that a layer
holding an embedding hands float32 ids on unrounded.
"""

import contextlib
import operator

import keras
from keras.src.backend.common.global_state import get_global_attribute
from keras.src.backend.common.global_state import set_global_attribute
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.backend.common.variables import AutocastScope
from keras.src.backend.common.variables import get_autocast_scope
from keras.src.export.export_utils import get_input_signature
from keras.src.losses.loss import unscale_loss_for_distribution
from keras.src.models.functional import Functional
from keras.src.models.model import Trainer
from keras.src.models.model import functional_init_arguments
from keras.src.utils.file_utils import is_remote_path
from keras.src.utils.io_utils import print_msg
from keras.src.utils.tracking import no_automatic_dependency_tracking

__all__ = [
    "Functional",
    "Trainer",
    "functional_init_arguments",
    "get_input_signature",
    "in_symbolic_scope",
    "is_remote_path",
    "no_automatic_dependency_tracking",
    "print_msg",
    "unscale_loss_for_distribution",
]


# --- settling a kmp.Model's precision once (kmp/precision/_settle.py) ---


def converts_inputs(layer):
    """Whether Keras casts `layer`'s floating inputs to its compute dtype.

    `Layer._convert_input_args`: `False` on layers that take their inputs as
    they come (functional models, some of Keras' own). `kmp/precision/_settle.py`
    reads it to know whether a float32 layer's outputs reach a consumer that
    would not cast them back to 16 bits.
    """
    return getattr(layer, "_convert_input_args", True)


# --- the logits behind a softmax or sigmoid output (kmp/precision/_float32_layers.py) ---


def keep_logits(source, result):
    """Carries `source`'s `_keras_logits` over to `result`, its dtype cast.

    Keras' softmax and sigmoid set `_keras_logits` on their output, and its
    cross-entropies (`keras.losses.*_crossentropy`, from Keras 3.0 on)
    differentiate from those logits: the gradient with respect to them is
    `scale * (p - y)`, bounded by the loss scale. A cast to float32 (kmp's
    model outputs) hides them, and the loss then takes `log(p)`, whose
    gradient `scale * (1 - p) / p` overflows float16 where a class has
    p < ~0.2 at scale 2**14: a loop computing its loss from a kmp model's
    output skipped steps that Keras' float16 output did not.
    """
    logits = getattr(source, "_keras_logits", None)
    if logits is None or result is source:
        return result
    try:
        result._keras_logits = keras.ops.cast(logits, result.dtype)
    except AttributeError:  # a tensor type that takes no attributes
        pass
    return result


def keep_mask(source, result):
    """Carries `source`'s Keras mask over to `result`, its dtype cast: a cast
    makes a new tensor without it, and Keras' compiled loss and metrics weight
    by a model output's mask (padded time steps count for nothing).
    """
    mask = get_keras_mask(source)
    if mask is not None and result is not source:
        set_keras_mask(result, mask)
    return result


def logs_as_list(model, logs):
    """The list (or single value) Keras' `train_on_batch` returns for `logs`
    without `return_dict`: the metrics in `metrics_names` order, then the
    other entries by name."""
    return model._flatten_metrics_in_order(logs)


# --- a model's layers, nested ones included ---


def nested_layers(layer, *, include_self, recursive):
    """The layers inside `layer` (and `layer` itself for `include_self=True`).

    `Layer._flatten_layers` (Keras 3.0 on): every layer it tracks, once each,
    in tracking order (`recursive=False`: those it holds directly); no public
    API lists the layers nested in a model's.
    """
    return layer._flatten_layers(include_self=include_self, recursive=recursive)


# `call_takes_training(layer)`: whether `layer.call` has a `training`
# argument. `Layer._call_has_training_arg` (Keras 3.0 on), set from `call`'s
# signature when the layer is made. `kmp.convert`'s wrapper of a model passes
# `training=` on only where Keras itself would (a `call` without the argument
# raises on it). An attribute getter: kmp.Model's TensorFlow step reads it at
# every step, at no Python frame's cost.
call_takes_training = operator.attrgetter("_call_has_training_arg")


def build_shapes(layer):
    """`{call argument: shape}` that `layer` was built with, or `None`.

    `Layer._build_shapes_dict` (Keras 3.0 on), set when a layer is built by
    a call or `build(shape)`; a functional model's inputs say it publicly,
    a subclassed model's only here.
    """
    shapes = getattr(layer, "_build_shapes_dict", None)
    return shapes if isinstance(shapes, dict) else None


def producing_layer(tensor):
    """The layer whose output `tensor` (a `KerasTensor`) is.

    `KerasTensor._keras_history.operation` (Keras 3.0 on): no public API
    tells which layer made a functional model's output; `kmp.diagnose`
    names it in its finding about a 16-bit output.
    """
    return tensor._keras_history.operation


def producing_inputs(tensor):
    """The tensors the layer that made `tensor` (a `KerasTensor`) was called on.

    `KerasTensor._keras_history` and `Operation._inbound_nodes` (Keras 3.0
    on): no public API walks a functional graph backwards from an output;
    `kmp.float8` does, through layers without weights, to find the layer
    that makes a model's output.
    """
    operation, node_index, _ = tensor._keras_history
    return list(keras.tree.flatten(operation._inbound_nodes[node_index].input_tensors))


def compile_arguments(model):
    """The arguments `model.compile` recorded for `get_compile_config`, as a
    dict kmp may change in place, or `None` if it recorded none.

    `Trainer._compile_config` (Keras 3.0 on), a `SerializableDict` whose
    `config` holds them. When `kmp.load_model` wraps a loaded optimizer in a
    `kmp.LossScaleOptimizer`, it puts the wrapper there, so that the next
    save records the optimizer whose state it writes; `get_compile_config`
    returns a serialized copy, which would not.
    """
    compile_config = getattr(model, "_compile_config", None)
    return None if compile_config is None else compile_config.config


def set_initial_epoch(model, epoch):
    """Makes `model.fit` start at `epoch`, as Keras' `BackupAndRestore` does.

    `Trainer._initial_epoch` (Keras 3.0 on): `fit` reads it, when set, in
    place of its `initial_epoch` argument; it is how Keras' own callback
    resumes, and `kmp.callbacks.BackupAndRestore` resumes the same way.
    """
    model._initial_epoch = epoch


# --- the crash-safe callbacks (kmp/checkpoint.py) ---


def _keras_attribute(name):
    """A property reading and setting Keras' private attribute `name`."""
    return property(lambda self: getattr(self, name),
                    lambda self, value: setattr(self, name, value))


class BackupAndRestoreBase(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with its restore and save handed to
    kmp, and its state under names kmp owns.

    Keras' callback restores in `_load_model` and saves in `_save_model`,
    which its own `on_train_batch_end` calls for an integer `save_freq`
    (both from Keras 3.0 to 3.15). A subclass defines `_kmp_load_backup` and
    `_kmp_save_backup`, so that every restore and save, Keras' own calls
    included, goes through kmp's checks, lock and atomic writes.
    `_current_epoch` and `_last_batch_seen` are the epoch and batch a backup
    records (Keras' `on_epoch_end` and `_should_save_on_batch` keep them),
    `_training_metadata_path` where it records them.
    """

    def _load_model(self):
        self._kmp_load_backup()

    def _save_model(self):
        self._kmp_save_backup()

    def _kmp_load_backup(self):
        raise NotImplementedError(f"{type(self).__name__} restores nothing: define `_kmp_load_backup`.")

    def _kmp_save_backup(self):
        raise NotImplementedError(f"{type(self).__name__} saves nothing: define `_kmp_save_backup`.")

    # Keras' own state of the callback, under kmp's names.
    _kmp_current_epoch = _keras_attribute("_current_epoch")
    _kmp_last_batch_seen = _keras_attribute("_last_batch_seen")
    _kmp_training_metadata_path = _keras_attribute("_training_metadata_path")


class ModelCheckpointBase(keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` whose writing of a checkpoint is
    kmp's.

    Keras' callback saves in `_save_model(epoch, batch, logs)`, for every
    checkpoint (Keras 3.0 to 3.15); here it chooses the file as Keras does
    (`_get_file_path`) and decides as Keras does whether to save
    (`_should_save_model`, which also tracks `best` and prints Keras'
    messages), then hands the writing to the subclass's
    `_kmp_write_checkpoint(filepath, epoch)`.
    """

    def _save_model(self, epoch, batch, logs):
        filepath = self._get_file_path(epoch, batch, logs)
        if self._should_save_model(epoch, batch, logs, filepath):
            self._kmp_write_checkpoint(filepath, epoch)

    def _kmp_write_checkpoint(self, filepath, epoch):
        raise NotImplementedError(f"{type(self).__name__} writes nothing: define `_kmp_write_checkpoint`.")


# --- the scaler's step (kmp/loss_scale.py, kmp/scaling/_step.py, kmp/backends/*/step.py, kmp/monitor/_steps.py) ---


# `built_variables(optimizer)`: the variables `optimizer` was built with, in
# Keras' index order. `Optimizer._trainable_variables` (Keras 3.0 on):
# `build` records them, and no public API gives them back.
# `kmp.LossScaleOptimizer.apply(grads)` without variables applies to them (as
# Keras' `apply` does), the monitor names an overflowing gradient by its
# index among them, and the stateless step maps them to their values. An
# attribute getter, as `loss_tracker`: read at every step.
built_variables = operator.attrgetter("_trainable_variables")


def filter_empty_gradients(optimizer, grads, variables):
    """`(grads, variables)` without the pairs whose gradient is `None`.

    `Optimizer._filter_empty_gradients` (Keras 3.0 on): exactly the pairs,
    and the warning, that Keras' own `apply` drops and gives, so a kmp
    scaler drops what the optimizer it wraps would.
    """
    return optimizer._filter_empty_gradients(grads, variables)


def variable_index(optimizer, variable):
    """`variable`'s index among `built_variables(optimizer)`.

    `Optimizer._get_variable_index` (Keras 3.0 on): how Keras finds a
    variable's slots; the monitor records which variables overflowed by it.
    """
    return optimizer._get_variable_index(variable)


def called_alone(layer):
    """Whether `layer`, from within its `call`, was called by no other layer:
    Keras' call context (3.0 on) is the one `layer.__call__` opened, or none
    (`stateless_call`)."""
    context = get_global_attribute("current_call_ctx")
    return context is None or context.entry_layer is layer


@contextlib.contextmanager
def autocast(dtype):
    """For the block, float `keras.Variable`s (those created with
    `autocast=True`, as layers' and optimizers' are) read as `dtype` and say
    so (`variable.dtype`); `None`: as stored, whatever scope is around.

    Keras' `AutocastScope` (3.0 on), set and restored through the global
    attribute Keras keeps it in (`AutocastScope(None)` would make `.dtype`
    read float32).
    """
    previous = get_autocast_scope()
    set_global_attribute("autocast_scope", None if dtype is None else AutocastScope(dtype))
    try:
        yield
    finally:
        set_global_attribute("autocast_scope", previous)


@contextlib.contextmanager
def following_autocast(variable):
    """For the block, `variable` follows the autocast scope (`autocast`) as
    a variable made with `autocast=True` does, then is as it was.

    `Variable._autocast` (Keras 3.0 on), set from the `autocast` argument
    Keras' normalization layers (LayerNormalization, BatchNormalization,
    GroupNormalization) pass as `False` for gamma and beta: in bfloat16,
    Keras' optimizers would compute their update in bfloat16 within kmp's
    float32 scope too (Adam's step 0: `beta_2 ** step` rounds to 1).
    """
    previous = variable._autocast
    variable._autocast = True
    try:
        yield
    finally:
        variable._autocast = previous


@contextlib.contextmanager
def shadowed(instance, methods):
    """For the block, each `instance.<name>` is `methods[name]`, set on the
    instance; after it the instance has what it had before (its own
    attribute, or none), whether the block returns or raises."""
    own = vars(instance)
    kept = {name: own[name] for name in methods if name in own}
    for name, method in methods.items():
        setattr(instance, name, method)
    try:
        yield
    finally:
        for name in methods:
            if name in kept:
                setattr(instance, name, kept[name])
            else:
                delattr(instance, name)


def shadowed_optimizer_methods(optimizer, *, variable_index, apply_weight_decay):
    """For the block, `optimizer._get_variable_index(variable)` and
    `optimizer._apply_weight_decay(variables)` are the functions given,
    each called with the optimizer's own as its first argument (`shadowed`).
    """
    given = {"_get_variable_index": variable_index, "_apply_weight_decay": apply_weight_decay}
    return shadowed(optimizer, {
        name: lambda *args, _m=method, _o=getattr(optimizer, name): _m(_o, *args)
        for name, method in given.items()
    })


def uses_weight_decay(optimizer, variable):
    """Whether `optimizer` decays `variable` (`Optimizer._use_weight_decay`,
    Keras 3.0 on: its `exclude_from_weight_decay` rules)."""
    return optimizer._use_weight_decay(variable)


def overwritten_with_gradient(optimizer, variables):
    """For each of `variables`, whether `optimizer` sets it to its
    "gradient" (no update rule).

    `Optimizer._overwrite_variable_with_gradient` (Keras 3.0 on): such a
    "gradient" (a moving statistic some layers keep) is a value, not a
    scaled gradient; kmp leaves it undivided, as Keras' own scaler does.
    """
    return [optimizer._overwrite_variable_with_gradient(v) for v in variables]


def clip_gradients(optimizer, grads):
    """`grads` clipped by `optimizer`'s `clipnorm`, `global_clipnorm` or
    `clipvalue` (unchanged when none is set).

    `Optimizer._clip_gradients` (Keras 3.0 on): the very rule the optimizer
    applies in its own `apply` (TensorFlow's `IndexedSlices` included). Under
    several replicas kmp applies it to the gradients summed over replicas,
    where Keras would apply it to each replica's share (see
    `kmp.backends.tensorflow.step._shares_of_clipped_sum`).
    """
    return optimizer._clip_gradients(grads)


def micro_steps(optimizer):
    """The variable counting `optimizer`'s calls to `apply`, micro-batches
    of an accumulated step included.

    `Optimizer._iterations` (Keras 3.0 on): with
    `gradient_accumulation_steps`, the public `iterations` counts windows;
    kmp reads this one to know a window's last micro-batch, and moves it
    back to the window's start when it discards the window.
    """
    return optimizer._iterations


def reset_gradient_accumulators(optimizer):
    """Zeroes `optimizer`'s gradient accumulators.

    `Optimizer._backend_reset_gradient_accumulators` (Keras 3.0 on): what
    Keras does at the end of each window; kmp calls it to discard a window
    in which a gradient overflowed, so that no inf or NaN stays in them.
    """
    return optimizer._backend_reset_gradient_accumulators()


def supports_no_merge_call():
    """Whether the current strategy runs a step without `merge_call`.

    `tf.__internal__.distribute.strategy_supports_no_merge_call` (TensorFlow
    2.x): no public API tells. Without `merge_call` kmp checks and decides
    in each replica (one collective of flags), and can retry a batch in a
    `tf.while_loop`, which TensorFlow refuses around a `merge_call`.
    """
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


@contextlib.contextmanager
def functional_conds():
    """The `tf.cond`s built in the block's graph run as functions.

    TensorFlow lowers a `tf.cond` in a `tf.function` to `Switch` and
    `Merge` ops, one `Switch` per tensor a branch captures, unless the `If`
    op carries `_lower_using_switch_merge=False` (what XLA's and the
    single-threaded executor's conds get; no public argument sets it). The
    skip's `cond` captures every gradient, variable and slot: on a graph of
    202 small variables (`benchmarks`' many_variables) the lowered step ran
    at 0.77x Keras' step without a skip, the functional one at 0.95x. Only
    the taken branch runs either way. In a graph being traced only.
    """
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    yield
    for op in graph.get_operations()[start:]:
        if op.type in ("If", "StatelessIf"):
            op._set_attr("_lower_using_switch_merge", tf.compat.v1.AttrValue(b=False))


def in_xla_context():
    """Whether the function being traced is compiled by XLA.

    TensorFlow's `control_flow_util.GraphOrParentsInXlaContext`: no public API
    tells whether a `tf.function` (or one it is nested in) has
    `jit_compile=True`, and there kmp's train step takes another shape (see
    `kmp.backends.tensorflow.trainer`): XLA gives a conditional's outputs
    buffers of their own, so a branch that may write the variables copies
    them even when it does not run.
    """
    import tensorflow as tf

    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def default_graph():
    """The graph being built now (the eager context's outside any trace).

    `tf.compat.v1.get_default_graph`: TensorFlow 2's public API has no
    other way to ask which `tf.function` graph is being traced; the scaler
    uses a loss it recorded only within that graph (or one it is nested in).
    """
    import tensorflow as tf

    return tf.compat.v1.get_default_graph()


def update_metrics_variables(model, metrics_values, unscaled_loss, x, y, y_pred, sample_weight):
    """`(logs, new_metrics_values)` after one JAX train step, as Keras' own.

    `JAXTrainer._update_metrics_variables` (Keras 3.10 on): the loss tracker
    and `compute_metrics` run statelessly on the metric values, exactly as in
    Keras' JAX `train_step`, which kmp.Model's JAX step follows.
    """
    return model._update_metrics_variables(
        metrics_values, unscaled_loss, x, y, y_pred, sample_weight
    )


def compute_loss(model, x, y, y_pred, sample_weight):
    """`model`'s loss in a train step, as Keras' own train step computes it.

    `Trainer._compute_loss` (Keras 3.3 on): `compute_loss(..., training=True)`,
    or without `training` for an override of `compute_loss` that does not
    take it. kmp.Model's own TensorFlow step computes its loss here, as
    Keras' `train_step` does.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


# `loss_tracker(model)`: the metric in which `model`'s `compute_loss` sums
# its losses. `Trainer._loss_tracker` (Keras 3.0 on): its `count` says
# whether the step computed a loss at all; a step that was skipped before it
# did logs the loss of the skipped attempt instead. An attribute getter, as
# `call_takes_training`: both train steps read it at every step.
loss_tracker = operator.attrgetter("_loss_tracker")


# --- the train function and the build across workers (kmp/backends/tensorflow/distribute.py, kmp/model.py) ---


def noinline_function_attributes():
    """`experimental_attributes` for a `tf.function` TensorFlow must not inline.

    `_noinline`, a function attribute TensorFlow's grappler honours and no
    public argument sets: a train step called as a function starts once its
    batch has arrived; inlined, its ops that do not read the batch run even
    when the iterator is empty (`tests/test_train_function.py` checks it).
    """
    return {"_noinline": True}


def symbolic_build(model, data_batch):
    """Builds `model` (and its metrics and optimizer) from one batch, as `fit`
    does before its first step.

    `Trainer._symbolic_build` (Keras 3.0 on): `fit`'s build, which kmp runs
    itself across workers with this worker's batch (see `ModelBase`).
    """
    model._symbolic_build(data_batch=data_batch)


class ModelBase(keras.Model):
    """`keras.Model` whose build before `fit` a subclass may take over.

    Keras' `Trainer._maybe_symbolic_build` (Keras 3.0 to 3.15) averages the
    first batch over replicas just to read its shapes, which fails across
    workers. With an iterator and a strategy of the model's own
    (`Trainer._distribute_strategy`), it first asks the subclass's
    `_kmp_build_from_iterator(iterator, strategy)`, which returns whether it
    built the model itself; otherwise Keras builds as always.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = getattr(self, "_distribute_strategy", None)  # TensorFlow only
        if (
            iterator is not None
            and strategy is not None
            and self._kmp_build_from_iterator(iterator, strategy)
        ):
            return
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _kmp_build_from_iterator(self, iterator, strategy):
        return False
