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


def test_a_full_run_on_a_gpu_uses_gpu_sized_workloads():
    from benchmarks import workloads

    assert workloads.GPU_WORKLOAD_NAMES == ("mlp", "resnet50", "transformer")
    bert = workloads.get_workload("transformer", "full", gpu=True).sizes
    assert (bert["blocks"], bert["dim"], bert["heads"], bert["ff"], bert["seq"], bert["batch"]) == (
        12, 768, 12, 3072, 128, 64
    )
    assert workloads.get_workload("resnet50", "full", gpu=True).sizes == dict(
        batch=128, image=224, classes=1000
    )
    mlp = workloads.get_workload("mlp", "full", gpu=True).sizes
    assert (mlp["layers"], mlp["width"], mlp["batch"]) == (4, 8192, 4096)
    # The CPU run and the small modes keep their sizes.
    for mode in ("quick", "smoke"):
        assert (workloads.get_workload("mlp", mode, gpu=True).sizes
                == workloads.get_workload("mlp", mode).sizes)
    assert workloads.get_workload("mlp", "full").sizes["width"] == 1024


def test_gpu_memory_is_the_allocator_peak_above_what_was_resident(monkeypatch):
    """The bookkeeping of the GPU memory figures, with a fake allocator."""
    from benchmarks import workloads

    mib = 2**20
    allocator = {"current": 100 * mib, "peak": 100 * mib}
    original_run = harness._Runner.run

    def run(self, steps):
        result = original_run(self, steps)
        # Each model built keeps 10 MiB; each step peaks 5 MiB above that.
        allocator["peak"] = max(allocator["peak"], allocator["current"] + 5 * mib)
        return result

    def build_model(workload, config, optimizer="adam"):
        allocator["current"] += 10 * mib
        return original_build(workload, config, optimizer)

    original_build = harness.build_model
    monkeypatch.setattr(harness._Runner, "run", run)
    monkeypatch.setattr(harness, "build_model", build_model)
    monkeypatch.setattr(harness, "_gpu_bytes", lambda: (allocator["current"], allocator["peak"]))
    monkeypatch.setattr(
        harness.tf.config.experimental, "reset_memory_stats",
        lambda device: allocator.update(peak=allocator["current"]),
    )
    configs = [harness.find_config("float32", False), harness.find_config("keras mixed_float16", False)]
    rows = harness.time_workload(
        workloads.get_workload("mlp", "smoke"), configs, repeats=1, chunk_seconds=0.0,
        warmup_steps=1, optimizer="sgd", gpu_memory_steps=2, log=lambda line: None,
    )
    for entry in rows.values():
        assert entry["memory"] == {
            "kind": "gpu", "resident_mb": 10.0, "step_peak_mb": 5.0, "peak_mb": 125.0,
        }
    assert rows["keras mixed_float16 | jit=off"]["optimizer"] == "LossScaleOptimizer"
    from benchmarks import report

    results = {"mlp": rows}
    report.ratios(results)
    table = report.results_table(results, [workloads.get_workload("mlp", "smoke")])
    assert "peak GPU MiB above resident (resident)" in table
    assert table.splitlines()[-1].endswith("| 5 (10) |")


@pytest.mark.gpu
def test_gpu_memory_is_measured_on_a_real_gpu():
    from benchmarks import workloads

    configs = [harness.find_config("kmp mixed_float16", True)]
    rows = harness.time_workload(
        workloads.get_workload("mlp", "smoke"), configs, repeats=1, chunk_seconds=0.0,
        warmup_steps=1, optimizer="sgd", gpu_memory_steps=2, log=lambda line: None,
    )
    memory = rows["kmp mixed_float16 | jit=on"]["memory"]
    assert memory["kind"] == "gpu"
    assert memory["resident_mb"] > 0 and memory["step_peak_mb"] >= 0
    assert memory["peak_mb"] >= memory["step_peak_mb"]
