"""The Keras internals kmp uses, in one place.

Everything else in kmp uses Keras' public API (`keras.*`, `keras.ops`,
`keras.tree`). These names live under `keras.src`, which Keras may change in
any release; when one moves, this module is the only one to mend.
`tests/test_api.py` checks that no other kmp module imports from
`keras.src`.
"""

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
    "is_remote_path",
    "no_automatic_dependency_tracking",
    "print_msg",
    "unscale_loss_for_distribution",
]
