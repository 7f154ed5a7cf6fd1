"""kmp.monitor._ledger.Ledger: the monitor's numbers, checked without Keras training.

Records are the optimizer's running counters `(step, skipped_total,
forward_total, consecutive, consecutive_forward)` after a step or an
execution of several steps; every expected value below is worked out by hand
or by a plain per-step reference.
"""

import doctest

import hypothesis
from hypothesis import strategies as st

from kmp.monitor import _ledger
from kmp.monitor._ledger import Ledger


def _no_names():
    raise AssertionError("names are read only for a backward overflow")


def test_counts_reasons_scales_and_summaries_by_hand():
    # The optimizer had taken 10 steps (2 skipped, 1 forward) before this fit.
    ledger = Ledger(counters=(10, 2, 1, 0, 0), scale=1024.0)
    ledger.begin_epoch(1)
    assert ledger.record((11, 2, 1, 0, 0), 0.5, 1024.0, _no_names) == (
        11, 0.5, 1024.0, 0, "", []
    )
    row = ledger.record((12, 3, 1, 1, 0), 0.6, 512.0, lambda: ["a/kernel", "b/bias"])
    assert row == (12, 0.6, 512.0, 1, "backward", ["a/kernel", "b/bias"])
    row = ledger.record((13, 4, 2, 2, 1), float("inf"), 256.0, _no_names)
    assert (row.skipped, row.reason, row.nonfinite_variables) == (1, "forward", [])
    assert (ledger.consecutive, ledger.consecutive_forward) == (2, 1)
    assert ledger.step_reaching(2) == 13 and ledger.step_reaching(3) is None
    # The same counters again: no step was taken, nothing is kept.
    assert ledger.record((13, 4, 2, 2, 1), 0.0, 256.0, _no_names) is None
    # One execution of 4 steps: 2 skipped, one of them forward.
    row = ledger.record((17, 6, 3, 0, 0), 0.7, 2048.0, lambda: ["a/kernel", "c/gamma"])
    assert (row.step, row.skipped, row.reason) == (17, 2, "forward+backward")
    assert ledger.last_names == ["a/kernel", "c/gamma"]
    first = ledger.end_epoch()
    assert first == {
        "epoch": 1, "steps": 7, "skipped": 4, "forward": 2, "backward": 2, "spikes": 0,
        "start_scale": 1024.0, "end_scale": 2048.0, "min_scale": 256.0,
        "max_scale": 2048.0,
        "nonfinite_variables": ["a/kernel", "b/bias", "c/gamma"],
    }

    ledger.begin_epoch(2)
    ledger.record((18, 6, 3, 0, 0), 0.1, 2048.0, _no_names)
    second = ledger.end_epoch()
    assert (second["steps"], second["skipped"], second["nonfinite_variables"]) == (1, 0, [])
    assert second["start_scale"] == second["min_scale"] == second["max_scale"] == 2048.0
    assert ledger.last_names == [] and ledger.step == 18
    assert ledger.epoch_summaries == [first, second]
    assert first["nonfinite_variables"] == ["a/kernel", "b/bias", "c/gamma"]

    assert ledger.history == {
        "step": [11, 12, 13, 17, 18],
        "loss": [0.5, 0.6, float("inf"), 0.7, 0.1],
        "loss_scale": [1024.0, 512.0, 256.0, 2048.0, 2048.0],
        "scale_before": [1024.0, 1024.0, 512.0, 256.0, 2048.0],
        "reason": ["", "backward", "forward", "forward+backward", ""],
    }
    # A sixth counter, the loss spikes: a skip that is neither overflow.
    ledger.begin_epoch(3)
    row = ledger.record((19, 7, 3, 1, 0, 1), 9.5, 2048.0, _no_names)
    assert (row.skipped, row.reason) == (1, "spike")
    row = ledger.record((21, 9, 4, 2, 1, 2), 0.2, 1024.0, lambda: ["a/kernel"])
    assert (row.skipped, row.reason, row.nonfinite_variables) == (2, "forward+spike", [])
    third = ledger.end_epoch()
    assert (third["skipped"], third["forward"], third["backward"], third["spikes"]) == (3, 1, 0, 2)


def test_stop_step_within_an_execution():
    ledger = Ledger(counters=(20, 5, 0), scale=8.0)
    ledger.begin_epoch(1)
    # 4 steps, all skipped; 5 consecutive: the 3rd in a row was step 22.
    ledger.record((24, 9, 0, 5, 0), 1.0, 0.5, lambda: ["w"])
    assert ledger.step_reaching(3) == 22
    assert ledger.step_reaching(5) == 24
    assert ledger.step_reaching(6) is None


def _reference(outcomes, groups, scales):
    """Per-step counts, straight from the outcomes ("ok", "forward", "backward")."""
    steps = sum(groups)
    return {
        "steps": steps,
        "skipped": sum(o != "ok" for o in outcomes[:steps]),
        "forward": outcomes[:steps].count("forward"),
        "backward": outcomes[:steps].count("backward"),
        "min_scale": min([1.0] + scales),
        "max_scale": max([1.0] + scales),
    }


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(
    outcomes=st.lists(st.sampled_from(["ok", "forward", "backward"]), min_size=1, max_size=40),
    execution=st.integers(1, 5),
)
def test_executions_add_up_to_the_per_step_counts(outcomes, execution):
    ledger = Ledger(scale=1.0)
    ledger.begin_epoch(1)
    step = skipped = forward = consecutive = 0
    groups, scales = [], []
    for start in range(0, len(outcomes), execution):
        group = outcomes[start:start + execution]
        for outcome in group:
            step += 1
            skipped += outcome != "ok"
            forward += outcome == "forward"
            consecutive = consecutive + 1 if outcome != "ok" else 0
        scale = 2.0 ** -skipped
        ledger.record((step, skipped, forward, consecutive, 0), 0.0, scale, lambda: ["v"])
        groups.append(len(group))
        scales.append(scale)
    summary = ledger.end_epoch()
    expected = _reference(outcomes, groups, scales)
    assert {key: summary[key] for key in expected} == expected
    assert summary["nonfinite_variables"] == (["v"] if "backward" in outcomes else [])
    assert len(ledger.history["step"]) == len(groups)
    assert sum(r != "" for r in ledger.history["reason"]) == sum(
        any(o != "ok" for o in outcomes[s:s + execution])
        for s in range(0, len(outcomes), execution)
    )


def test_docstring_example_runs():
    result = doctest.testmod(_ledger)
    assert result.attempted > 0 and result.failed == 0
