"""The benchmark suite runs end to end and writes a complete report.

This checks that `python -m benchmarks.run` works and that its table has a
row for every configuration, not how fast anything is. It runs the `--smoke`
mode (tiny models, one step per repeat) in a subprocess, since the suite
sets up TensorFlow its own way.
"""

import json
import os
import subprocess
import sys

import pytest

from _helpers import child_env
from benchmarks import harness

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKLOADS = ("mlp", "many_variables")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke",
         "--workloads", ",".join(_WORKLOADS), "--out", str(out)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        # On a GPU machine the benchmarks run there, as a user would run them.
        env=child_env(gpu=True),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_report_has_a_row_per_workload_and_configuration(smoke_run):
    report = (smoke_run / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ")]
    for workload in _WORKLOADS:
        for config in harness.CONFIGS:
            jit = "on" if config.jit_compile else "off"
            prefix = f"| {workload} | {config.name} | {jit} |"
            assert sum(row.startswith(prefix) for row in rows) == 1, prefix


def test_report_has_overhead_op_counts_and_targets(smoke_run):
    report = (smoke_run / "report.md").read_text()
    assert "## Loss-scaling overhead" in report
    assert "## Ops in the traced graph" in report
    assert "| train step, all ops |" in report
    assert "## Targets" in report


def test_results_json_has_positive_throughput_for_every_configuration(smoke_run):
    data = json.loads((smoke_run / "results.json").read_text())
    for workload in _WORKLOADS:
        rows = data["results"][workload]
        assert set(rows) == {config.label for config in harness.CONFIGS}
        for entry in rows.values():
            assert len(entry["repeats"]) >= 5
            assert entry["samples_per_s"] > 0
    assert data["results"]["mlp"]["kmp mixed_float16 | jit=off"]["optimizer"] == "LossScaleOptimizer"
    assert data["results"]["mlp"]["keras mixed_float16 | jit=off"]["model_class"] == "Functional"


def test_chart_is_written_when_matplotlib_is_installed(smoke_run):
    pytest.importorskip("matplotlib", reason="the chart is the optional `kmp[plot]` extra")
    assert (smoke_run / "ratios.png").stat().st_size > 0
