"""kmp on Keras' JAX backend: the modules `kmp.backends.get` returns there."""

import keras


def unsupported(feature, instead):
    """The error for what kmp runs on TensorFlow only."""
    return NotImplementedError(
        f"{feature} needs the TensorFlow backend of Keras; this process runs "
        f"KERAS_BACKEND={keras.backend.backend()!r}. {instead}"
    )
