"""What Keras' losses see of a model's outputs on TensorFlow."""

_REASON = (
    "a softmax/sigmoid model output: float32 probabilities, not 16-bit ones cast up "
    "(whose rows sum to 1 only within ~1e-3)"
)


def probability_output_reason():
    """Why a softmax or sigmoid model output computes in float32, or `None`.

    On TensorFlow a 16-bit softmax or sigmoid output tensor carries the
    logits behind it, which Keras' cross-entropies differentiate, so such an
    output would train as well in 16 bits. But kmp returns model outputs in
    float32, and a float16 softmax cast to float32 is a float32 tensor whose
    rows sum to 1 only within float16's rounding (7e-4 measured on two
    classes): `np.random.choice(p=...)` (keras.io's actor-critic) refuses
    that, Keras' own float16 output it accepts. Computed in float32, the
    probabilities are float32's; the layer is a model's last, so its float32
    matmul is a small share of the step.

    Returns:
        String, the reason `kmp.summary` and `kmp.convert` show.
    """
    return _REASON
