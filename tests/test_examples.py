import importlib.util
import pathlib

import pytest

pytest.importorskip("sklearn", reason="the quickstart's dataset ships with scikit-learn")

_QUICKSTART = pathlib.Path(__file__).parents[1] / "examples" / "quickstart.py"


def _load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", _QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("policy", ["auto", "mixed_float16"])
def test_quickstart_trains_exports_and_reloads(policy, tmp_path, capsys):
    quickstart = _load_quickstart()
    plot = tmp_path / "loss_scale.png"
    accuracy = quickstart.main(
        ["--policy", policy, "--epochs", "3", "--export-dir", str(tmp_path / "serving"),
         "--plot", str(plot)]
    )
    output = capsys.readouterr().out
    assert accuracy > 0.8
    assert "skipped steps:" in output and "time per epoch:" in output
    assert "output dtype float32" in output
    assert (tmp_path / "serving" / "saved_model.pb").exists()
    if policy == "mixed_float16":
        assert "final loss scale:" in output
        assert "epoch 1:" in output and "steps skipped" in output  # the monitor's line
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # bfloat16: nothing is scaled, so nothing is drawn
        assert not plot.exists()
