import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from _helpers import child_env

pytest.importorskip("sklearn", reason="the quickstart's dataset ships with scikit-learn")

_QUICKSTART = pathlib.Path(__file__).parents[1] / "examples" / "quickstart.py"


def _load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", _QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(script, argv, cwd):
    """`python examples/<script> ...` as a new user runs it: a fresh process,
    on the GPU when there is one. Returns its standard output."""
    result = subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=cwd,
        env=child_env(gpu=True),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def _run_as_a_script(argv, cwd):
    output = _run_script(_QUICKSTART, argv, cwd)
    accuracy = float(output.split("test accuracy: ")[1].split()[0])
    return accuracy, output


def _run_in_process(argv, capsys):
    accuracy = _load_quickstart().main(argv)
    return accuracy, capsys.readouterr().out


_README = pathlib.Path(__file__).parents[1] / "README.md"


def _readme_transcript():
    """The lines of the quickstart's output the README shows: the first
    unlabelled code block after it names `python examples/quickstart.py`."""
    text = _README.read_text()
    after = text.split("`python examples/quickstart.py` does the same", 1)[1]
    block = after.split("\n```\n", 1)[1].split("\n```", 1)[0]
    return [line for line in block.splitlines() if line != "..."]


_NUMBER = r"[-+]?\d+(?:\.\d+)?(?:e[-+]\d+)?"
# A number on its own, not the digits of a name such as float16 or avx512_bf16.
_SEPARATE_NUMBER = r"(?<![\w.])" + _NUMBER + r"(?!\w)"


def _line_pattern(line):
    """A transcript line as a regular expression: its numbers may differ (a
    run's accuracy and timings), "..." stands for anything (a path, an
    elided part); every word must be there."""
    pieces = [
        _NUMBER.join(re.escape(text) for text in re.split(_SEPARATE_NUMBER, piece))
        for piece in line.split("...")
    ]
    return re.compile(".*".join(pieces))


def _check_readme_transcript(output):
    lines = output.splitlines()
    transcript = _readme_transcript()
    # The README shows a CPU on which auto picks bfloat16; elsewhere only the
    # lines that do not depend on the policy are compared.
    if lines[0] != transcript[0]:
        transcript = [line for line in transcript if line.startswith("test accuracy:")]
    missing = [
        line for line in transcript
        if not any(_line_pattern(line).fullmatch(out) for out in lines)
    ]
    assert transcript and not missing, (
        f"README.md shows quickstart lines its output lacks: {missing}\n{output[-3000:]}"
    )


@pytest.mark.parametrize(
    "policy, how", [("auto", "script"), ("mixed_float16", "in process")]
)
def test_quickstart_trains_exports_and_reloads(policy, how, tmp_path, capsys):
    plot = tmp_path / "loss_scale.png"
    # As a script, two epochs: what the README's transcript shows ("epoch 2:
    # ...", the median time after the first). In process, one: float16 is
    # emulated on a CPU (about 15 s an epoch on 2 cores, 2026-12-06), and
    # one epoch reaches 0.95.
    epochs = "2" if how == "script" else "1"
    argv = ["--policy", policy, "--epochs", epochs, "--export-dir", str(tmp_path / "serving"),
            "--plot", str(plot)]
    if how == "script":
        accuracy, output = _run_as_a_script(argv, cwd=tmp_path)
        _check_readme_transcript(output)
    else:
        accuracy, output = _run_in_process(argv, capsys)
    assert accuracy > 0.8
    assert "skipped steps:" in output and "time per epoch:" in output
    # The self-check passed: served and trained predictions agree.
    assert "output dtype float32" in output and "roundings to" in output
    assert (tmp_path / "serving" / "saved_model.pb").exists()
    # "auto" picks mixed_float16 on a GPU of compute capability 7.x.
    if output.startswith("policy: mixed_float16"):
        assert "final loss scale:" in output
        assert "epoch 1:" in output and "steps skipped" in output  # the monitor's line
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    elif output.startswith("policy: mixed_bfloat16"):
        # Nothing is scaled, but the guard skips non-finite steps: the
        # monitor reports each epoch (without a scale) and draws the losses.
        assert "no loss scaling" in output and "still skipped" in output
        assert "epoch 1:" in output and "loss scale" not in output.split("epoch 1:")[1][:80]
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # float32: Keras' step, nothing to monitor or draw
        assert "no loss scaling" in output and "still skipped" not in output
        assert "compile(..., skip_nonfinite=True)" in output
        assert not plot.exists()


_GAN = pathlib.Path(__file__).parents[1] / "examples" / "gan.py"


def test_gan_example_runs_as_a_script(tmp_path):
    # `python examples/gan.py` as a new user runs it: its own train_step and
    # two optimizers, each wrapped and reported by kmp.
    output = _run_script(_GAN, ["--epochs", "1"], tmp_path)
    lines = output.splitlines()
    assert lines[0].startswith("policy mixed_float16: d_loss ")
    losses = [float(part.split()[1]) for part in lines[0].split(": ", 1)[1].split(", ")]
    assert all(0.0 < loss < 5.0 for loss in losses)
    for name in ("d_optimizer", "g_optimizer"):
        line = next(line for line in lines if line.startswith(name + ":"))
        assert "kmp.loss_scale.LossScaleOptimizer" in line
        skipped, total = (int(v) for v in line.split("skipped steps ")[1].split(" of "))
        assert total == 28 and 0 <= skipped < total  # 1797 digits // 64 steps
    assert "generated images: shape (4, 8, 8, 1), dtype float32, finite True" in lines


def test_quickstart_runs_on_jax_where_tensorflow_is_not_installed(tmp_path):
    # It imported TensorFlow at the top: a bare ModuleNotFoundError on a JAX
    # install (issue 38). It trains on JAX and says why it exports nothing.
    code = (
        "import runpy, sys\n"
        "sys.modules['tensorflow'] = None  # as if not installed\n"
        f"sys.argv = ['quickstart.py', '--epochs', '2']\n"
        f"runpy.run_path({str(_QUICKSTART)!r}, run_name='__main__')\n"
    )
    env = child_env()
    env["KERAS_BACKEND"] = "jax"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # XLA's CPU backend computes bfloat16 through float32: auto picks float32.
    assert lines[0].startswith("policy: ")
    accuracy = float(result.stdout.split("test accuracy: ")[1].split()[0])
    assert accuracy > 0.8
    assert lines[-1] == (
        "SavedModel not exported: it needs TensorFlow, which is not installed "
        '(pip install -e ".[tensorflow]" adds it; Keras writes a SavedModel with '
        "TensorFlow on every backend)"
    )
