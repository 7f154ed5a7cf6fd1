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
| `Layer._flatten_layers` | `policy.py`, `_token_ids.py`, `convert.py`, `export.py`, diagnose | every nested layer, which `model.layers` does not list |
| `Layer._call_has_training_arg` | `convert.py` | call a wrapped model as Keras would |
| `Layer._dtype_policy` | `policy.py` | set a layer's policy without Keras' once-only checks |
| `DTypePolicy.convert_input` (overridden) | `_token_ids.py` | Keras' autocast of a layer's inputs: remember the float32 ids behind each 16-bit cast |
| `KerasTensor._keras_history` | `_diagnose_static.py` | which layer produced a functional model's tensor |
| `Model._distribute_strategy`, `Model._symbolic_build` | `model.py`, `distribute.py` | build across workers, where Keras' own build fails |
| `ModelCheckpoint._get_file_path`, `_should_save_model`; `BackupAndRestore._training_metadata_path`, `_initial_epoch` | `checkpoint.py` | resume where Keras' own callbacks keep their state |

One TensorFlow function attribute: `_noinline` (`tf.function(experimental_attributes=...)`,
`distribute.py`), so that a train step starts only once its batch has arrived
(`tests/test_train_function.py` fails if TensorFlow inlines it again).
"""

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
