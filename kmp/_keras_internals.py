"""The Keras internals kmp uses, in one place.

Everything else in kmp uses Keras' public API (`keras.*`, `keras.ops`,
`keras.tree`). The names imported below live under `keras.src`, which Keras
may change in any release; when one moves, this module is the only one to
mend. `tests/test_api.py` checks that no other kmp module imports from
`keras.src`. CI runs the core tests against the oldest Keras pyproject.toml
admits (3.10) and the newest (see README, "Tested with").

Private *attributes* of public Keras objects that kmp reads, and why (each is
present from Keras 3.10 to 3.15):

| attribute | where | why |
|---|---|---|
| `Optimizer._iterations` | `loss_scale.py` | the micro-step count; `iterations` counts windows |
| `Optimizer._backend_reset_gradient_accumulators` | `loss_scale.py` | discard a window with an overflow |
| `Optimizer._trainable_variables` | `loss_scale.py`, `callbacks.py` | the variables an optimizer was built with (`apply(grads)` without variables; the monitor's names) |
| `Optimizer._filter_empty_gradients` | `loss_scale.py` | drop `None` gradients exactly as Keras' `apply` does |
| `Optimizer._get_variable_index` | `loss_scale.py` | which variable overflowed, for the monitor |
| `Optimizer._overwrite_variable_with_gradient` | `loss_scale.py` | variables Keras overwrites with their "gradient" are not unscaled (as Keras' scaler) |
| `Layer._flatten_layers` | `policy.py`, `_precision.py`, `_token_ids.py`, `convert.py`, `export.py`, diagnose | every nested layer, which `model.layers` does not list |
| `Layer._call_has_training_arg` | `convert.py` | call a wrapped model as Keras would |
| `Layer._dtype_policy` | `policy.py` | set a layer's policy without Keras' once-only checks |
| `DTypePolicy.convert_input` (overridden in kmp's own `_ExactIdsPolicy`) | `_token_ids.py` | Keras' autocast of a layer's inputs: a layer holding an embedding hands float32 ids on unrounded |
| `Layer._convert_input_args` (`converts_inputs`, i23-precision) | `_precision.py` | whether a float32 layer's consumer casts its outputs back to 16 bits itself |
| `KerasTensor._keras_history` | `_diagnose_static.py` | which layer produced a functional model's tensor |
| `Model._distribute_strategy`, `Model._symbolic_build` | `model.py`, `distribute.py` | build across workers, where Keras' own build fails |
| `ModelCheckpoint._get_file_path`, `_should_save_model`; `BackupAndRestore._training_metadata_path`, `_initial_epoch` | `checkpoint.py` | resume where Keras' own callbacks keep their state |
| `BackupAndRestore._load_model`, `_save_model` (overridden) | `checkpoint.py` | the restore and the save Keras' callback calls (its `on_train_batch_end` for an integer `save_freq`): kmp's check, lock and write atomically |
| `BackupAndRestore._current_epoch`, `_last_batch_seen` | `checkpoint.py` | the epoch and batch a backup records, which Keras' `_should_save_on_batch` keeps too; reset at each `on_train_begin` |
| `ModelCheckpoint._save_model` (overridden) | `checkpoint.py` | the save Keras' callback calls for every checkpoint: kmp's writes atomically |
| `Model._initial_epoch` | `checkpoint.py` | the epoch `fit` resumes from, set as Keras' own `BackupAndRestore` sets it |
| `Tensor._keras_logits` (`keep_logits`) | `policy.py` | the logits Keras' softmax/sigmoid leave on their output, carried over kmp's float32 output cast so that Keras' cross-entropies still differentiate from logits (a cast hid them, and `log(p)`'s gradient overflowed float16 where Keras' did not) |

One TensorFlow function attribute: `_noinline` (`tf.function(experimental_attributes=...)`,
`distribute.py`), so that a train step starts only once its batch has arrived
(`tests/test_train_function.py` fails if TensorFlow inlines it again).
"""

import keras
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.export.export_utils import get_input_signature
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
]


# --- i23-precision: settling a kmp.Model's precision once (kmp/_precision.py) ---


def converts_inputs(layer):
    """Whether Keras casts `layer`'s floating inputs to its compute dtype.

    `Layer._convert_input_args`: `False` on layers that take their inputs as
    they come (functional models, some of Keras' own). `kmp/_precision.py`
    reads it to know whether a float32 layer's outputs reach a consumer that
    would not cast them back to 16 bits.
    """
    return getattr(layer, "_convert_input_args", True)


# --- the logits behind a softmax or sigmoid output (kmp/policy.py) ---


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
