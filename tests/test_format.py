"""kmp._format.format_scale: one notation for loss scales everywhere kmp prints them."""

import doctest

import pytest

from kmp import _format
from kmp._format import format_scale
from kmp.diagnosis import _report as _diagnose_report
from kmp.monitor import _messages as _monitor_messages


@pytest.mark.parametrize(
    "scale, text",
    [
        # Integers print as their digits, powers of two or not.
        (1.0, "1"),
        (3.0, "3"),
        (1000, "1000"),
        (32768.0, "32768"),
        (2.0**24, "16777216"),
        # Powers of two below 1 print as 2^-k.
        (0.5, "2^-1"),
        (0.125, "2^-3"),
        (2.0**-24, "2^-24"),
        (2.0**-100, "2^-100"),
        # Integers from 2**53 on are no longer exact: powers of two as 2^k.
        (2.0**60, "2^60"),
        # Anything else as %g.
        (0.3, "0.3"),
        (1.5, "1.5"),
        (0.375, "0.375"),  # 3 * 2**-3: not a power of two
        (1e20 + 1.0, "1e+20"),
        (float("inf"), "inf"),
        (0.0, "0"),
        (-2.0, "-2"),
        (None, "None"),
    ],
)
def test_format_scale(scale, text):
    assert format_scale(scale) == text


def test_docstring_example_runs():
    result = doctest.testmod(_format)
    assert result.attempted > 0 and result.failed == 0


def _report(loss_scale, recommended):
    layer = dict.fromkeys(
        ["max_abs_activation", "activation_overflow", "activation_zero",
         "activation_subnormal", "max_abs_gradient", "gradient_overflow",
         "gradient_zero", "gradient_subnormal", "rel_error"], 0.0)
    layer.update(name="dense", class_name="Dense", compute_dtype="float16",
                 activation_nonfinite=False, gradient_nonfinite=False)
    return _diagnose_report.DiagnosisReport(
        policy="mixed_float16", loss_scale=loss_scale, steps=1,
        loss={"float32": 1.0, "reduced": 1.0}, layers=[layer],
        first_nonfinite=None, first_inaccurate=None,
        recommended_loss_scale=recommended,
        underflow_at_recommended={"zero": 0.0, "subnormal": 0.0},
        recommended_policy="mixed_float16", policy_reason="it fits", findings=[],
    )


def test_diagnose_report_and_monitor_print_scales_alike():
    report = _report(loss_scale=0.125, recommended=32768.0)
    text = str(report)
    assert "1 step(s), loss scale 2^-3" in text
    assert "Recommended loss scale: 32768 (no gradient overflows" in text
    assert "recommended_loss_scale=32768 " in repr(report)
    assert "down to 2^-24." in str(_report(loss_scale=1.0, recommended=None))

    summary = {"epoch": 1, "steps": 4, "skipped": 0, "forward": 0, "backward": 0,
               "start_scale": 32768.0, "end_scale": 0.125, "min_scale": 0.125,
               "max_scale": 32768.0, "nonfinite_variables": []}
    assert _monitor_messages.epoch_line(summary) == (
        "epoch 1: 0 of 4 steps skipped (0.0%), loss scale 32768 -> 2^-3 "
        "(min 2^-3, max 32768)"
    )
