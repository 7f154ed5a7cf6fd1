"""What Keras' losses see of a model's outputs on TensorFlow."""


def probability_output_reason():
    """Why a softmax or sigmoid model output computes in float32, or `None`.

    On TensorFlow, `None`: a softmax or sigmoid output tensor carries the
    logits behind it, which Keras' cross-entropies differentiate, so a 16-bit
    output layer trains as well as a float32 one.

    Returns:
        `None`.
    """
    return None
