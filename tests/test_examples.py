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
    accuracy = quickstart.main(
        ["--policy", policy, "--epochs", "3", "--export-dir", str(tmp_path / "serving")]
    )
    output = capsys.readouterr().out
    assert accuracy > 0.8
    assert "skipped steps:" in output and "time per epoch:" in output
    assert "output dtype float32" in output
    assert (tmp_path / "serving" / "saved_model.pb").exists()
    if policy == "mixed_float16":
        assert "final loss scale:" in output
