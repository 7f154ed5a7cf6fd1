"""What Keras' losses see of a model's outputs on JAX."""

_REASON = (
    "a softmax/sigmoid model output on JAX: Keras' cross-entropy differentiates the "
    "probabilities there (TensorFlow carries the logits), whose 16-bit gradient "
    "overflows at the usual loss scales"
)


def probability_output_reason():
    """Why a softmax or sigmoid model output computes in float32, or `None`.

    On JAX, always: an array cannot carry the logits behind a softmax or
    sigmoid output, so Keras' cross-entropies differentiate `log(p)`, whose
    gradient `scale / p` overflows float16 at the usual loss scales. Computed
    in float32, the probabilities' gradient reaches the 16-bit layers below
    as `scale * (p - y)`.

    Returns:
        String, the reason `kmp.summary` and `kmp.convert` show.
    """
    return _REASON
