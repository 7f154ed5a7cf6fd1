"""How far a mixed_float16 run's loss may be from the float32 run of the same
code: the band the keras.io tests (test_keras_io.py, test_keras_io_jax.py)
hold each step's loss to."""

import numpy as np
from _helpers import EPSILON, float32_compute_dtype


def band_of(roundings):
    """The relative distance a float16 run's loss may be from float32's.

    One rounding to float16 moves a value by at most half its spacing,
    EPSILON["float16"] / 2 = 2**-11 relative. A forward pass rounds each
    layer's input, kernel and output (3 roundings per layer); errors that
    add up give at most `roundings` times that, and the few steps taken
    from weights that differ by the same relative amount keep it of that
    order. The float32 reference rounds too (to TF32 on a GPU that enables
    it), so its epsilon counts as well. A loss further away than this is
    not rounding: gradients divided by a scale the loss was never multiplied
    by, a NaN, another computation. (One step skipped among a few, with
    Adam's small steps, can stay inside it: the tests check the skip
    counters as well.)

    Args:
        roundings: Int. How many float16 roundings the loss goes through.

    Returns:
        The band, a float: relative to the loss, absolute below 1.
    """
    per_rounding = EPSILON["float16"] / 2 + EPSILON[float32_compute_dtype()] / 2
    return roundings * per_rounding


def assert_within_band(mixed, reference, roundings, what):
    """Asserts each of `mixed` (a float16 run's losses) is finite and within
    `band_of(roundings)` of the same step's loss in `reference` (float32);
    `what` names the losses in the message."""
    mixed, reference = np.asarray(mixed, "float64"), np.asarray(reference, "float64")
    assert np.all(np.isfinite(mixed)), f"{what}: a loss is not finite: {mixed}"
    band = band_of(roundings)
    # Relative to the loss, and never tighter than the band around 1: a GAN's
    # losses pass near 0, where a relative bound means nothing.
    allowed = band * np.maximum(np.abs(reference), 1.0)
    assert np.all(np.abs(mixed - reference) <= allowed), (
        f"{what}: mixed_float16 {mixed.tolist()} vs float32 {reference.tolist()}, "
        f"allowed {allowed.tolist()} ({roundings} float16 roundings)"
    )
