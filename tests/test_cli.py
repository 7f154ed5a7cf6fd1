"""`kmp doctor`, run as a user runs it: as a subprocess of `python -m kmp`."""

import json
import os
import pathlib
import subprocess
import sys
import tomllib

import keras
import pytest
import tensorflow as tf

import kmp
from kmp import _command
from kmp import cli
from kmp.precision import _hardware

_REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(args, extra_path=(), env=None, timeout=180):
    environment = dict(os.environ)
    environment.update(env or {})
    environment["PYTHONPATH"] = os.pathsep.join(
        [*map(str, extra_path), str(_REPO), environment.get("PYTHONPATH", "")]
    )
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=environment,
        timeout=timeout, cwd=_REPO,
    )


@pytest.fixture
def broken_tensorflow(tmp_path):
    """A directory that, first on the path, makes `import tensorflow` fail."""
    package = tmp_path / "fake" / "tensorflow"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        'raise ImportError("simulated: TensorFlow is not installed")\n'
    )
    return tmp_path / "fake"


def test_doctor_json_reports_versions_devices_auto_policy_and_speedups():
    result = _run(["-m", "kmp", "doctor", "--json", "--seconds", "1"])

    assert result.returncode == cli.EXIT_OK, result.stderr
    report = json.loads(result.stdout)
    assert report["kmp"] == kmp.__version__
    assert report["keras"] == keras.__version__
    assert report["tensorflow"] == tf.__version__
    assert report["auto_policy"]["name"] == kmp.set_policy("auto").name
    assert report["auto_policy"]["reason"].startswith("auto: ")
    devices = report["devices"]
    assert len(devices["gpus"]) == len(tf.config.list_physical_devices("GPU"))
    flags = _hardware._cpu_flags()
    assert devices["cpu"]["flags"] == {flag: flag in flags for flag in cli._CPU_FLAGS}
    benchmark = report["benchmark"]
    assert benchmark["device"] == ("/GPU:0" if devices["gpus"] else "/CPU:0")
    assert [(e["op"], e["dtype"]) for e in benchmark["results"]] == [
        (op, dtype) for op in ("matmul", "conv3x3")
        for dtype in ("float32", "float16", "bfloat16")
    ]
    for entry in benchmark["results"]:
        if entry["error"] is None:
            assert entry["runs"] >= 1 and entry["median_ms"] > 0
            assert entry["speedup"] > 0
    assert all(e["speedup"] == 1.0 for e in benchmark["results"] if e["dtype"] == "float32")
    float8 = benchmark["float8"]
    capable = benchmark["device"] == "/GPU:0" and kmp.float8._has_float8_tensor_cores(
        devices["gpus"][0]["compute_capability"])
    assert float8["timed"] == capable
    if capable:
        assert float8["float8_ms"] > 0 and float8["speedup"] > 0


def test_doctor_prints_a_readable_report():
    result = _run(["-m", "kmp", "doctor", "--seconds", "1", "--device", "cpu"])

    assert result.returncode == cli.EXIT_OK, result.stderr
    text = result.stdout
    assert f"kmp {kmp.__version__} | Keras {keras.__version__} | TensorFlow {tf.__version__}" in text
    assert f'Policy "auto" -> {kmp.set_policy("auto").name}' in text
    assert "Benchmark on /CPU:0 (1 s budget, dtypes interleaved" in text
    for word in ("matmul", "conv3x3", "float32", "float16", "bfloat16", "avx512_bf16"):
        assert word in text
    assert "  float8 matmul: not timed (no GPU in use; float8 matmuls need" in text


def _doctor_with_floatx(tmp_path, floatx):
    """`kmp doctor --json` with a keras.json whose `floatx` is `floatx`:
    the finished process and the Keras home it read."""
    home = tmp_path / "keras_home"
    home.mkdir()
    (home / "keras.json").write_text(json.dumps({"backend": "tensorflow", "floatx": floatx}))
    result = _run(["-m", "kmp", "doctor", "--json", "--seconds", "1", "--device", "cpu"],
                  env={"KERAS_HOME": str(home)})
    return result, home


def test_doctor_warns_where_keras_json_stores_weights_in_16_bits(tmp_path):
    # keras.json's floatx (float16: Keras refuses bfloat16 there), as a user
    # sets it for all their models: Keras' optimizers then lose small
    # updates; doctor says so, and how kmp trains them. With Keras' default
    # it says nothing of the kind.
    result, _ = _doctor_with_floatx(tmp_path, "float16")
    assert result.returncode == cli.EXIT_OK, result.stderr
    weights = json.loads(result.stdout)["weights"]
    assert (weights["floatx"], weights["dtype_policy"]) == ("float16", "float16")
    assert weights["warning"] == (
        "Keras' floatx is 'float16': a keras.Model's weights are stored in float16, where any "
        "Keras optimizer's update below half a step of the weight (2**-11 of it) is lost. With "
        "kmp: kmp.set_policy('mixed_float16') (float32 weights, float16 math) or "
        "kmp.set_policy('bfloat16') (bfloat16 weights whose updates kmp computes in float32), "
        "and a kmp.Model or kmp.convert(model, policy).")
    default = _run(["-m", "kmp", "doctor", "--seconds", "1", "--device", "cpu"])
    assert "  Keras' floatx: float32; dtype policy: float32\n" in default.stdout
    assert "warning: Keras'" not in default.stdout


def test_doctor_names_keras_own_bfloat16_policy_and_adams_zero_step():
    keras.config.set_dtype_policy("bfloat16")
    try:
        weights = cli._weights(keras)
    finally:
        keras.config.set_dtype_policy("float32")
    assert weights["warning"].startswith(
        "Keras' dtype policy is 'bfloat16': a keras.Model's weights are stored in bfloat16, "
        "where Keras' own Adam and AdamW never move them (their step rounds to 0)")
    assert cli._weights(keras)["warning"] is None


@pytest.mark.parametrize("on_gpu, capability, timed", [
    (False, None, False), (True, "8.6", False), (True, None, False),
    (True, "8.9", True), (True, "9.0", True),
])
def test_doctor_times_a_float8_matmul_only_with_float8_tensor_cores(
        monkeypatch, on_gpu, capability, timed):
    built = []

    def fake_step(n, float8):
        built.append((n, float8))
        return lambda: 0.0

    monkeypatch.setattr(kmp.float8, "_matmul_step", fake_step)
    gpus = [{"name": "GPU", "device": "/GPU:0", "compute_capability": capability}] if on_gpu else []
    entry = cli._float8_matmul(on_gpu, {"gpus": gpus}, seconds=0.0)
    assert entry["timed"] == timed
    if timed:
        # One bfloat16 and one float8 Dense of 8192 x 8192, timed in turns.
        assert built == [(8192, False), (8192, True)]
        assert entry["runs"] >= 1 and entry["speedup"] > 0
        assert cli._float8_line(entry).startswith("  float8 matmul, 8192x8192 @ 8192x8192")
    else:
        assert built == []
        expected = "no GPU in use" if not on_gpu else f"compute capability {capability or 'unknown'};"
        assert expected in entry["reason"] and expected in cli._float8_line(entry)


def test_float8_matmul_step_computes_the_same_matmul_quantized():
    """The step doctor times, at 64 x 64 on this machine, with the same
    weights and data in bfloat16 and in float8: the sums of the 4,096
    outputs (-85.08 and -85.35 on a CPU) differ by float8's rounding only."""
    keras.utils.set_random_seed(0)
    plain = kmp.float8._matmul_step(64, float8=False)()
    keras.utils.set_random_seed(0)
    quantized = kmp.float8._matmul_step(64, float8=True)()
    assert abs(plain) > 10.0
    assert quantized != plain and abs(quantized - plain) < 1.0


def test_missing_tensorflow_exits_3_with_a_message(broken_tensorflow, tmp_path):
    result = _run(["-m", "kmp", "doctor"], extra_path=[broken_tensorflow])

    assert result.returncode == cli.EXIT_NO_TENSORFLOW
    assert "TensorFlow is missing or broken" in result.stderr
    assert "simulated: TensorFlow is not installed" in result.stderr
    assert "Traceback" not in result.stderr
    # The console script `kmp` (what pip writes for [project.scripts]).
    script = tmp_path / "bin" / "kmp"
    script.parent.mkdir()
    script.write_text("import sys\nfrom kmp.cli import main\nsys.exit(main())\n")
    result = _run([str(script), "doctor", "--json"], extra_path=[broken_tensorflow])
    assert result.returncode == cli.EXIT_NO_TENSORFLOW
    assert json.loads(result.stdout)["exit_code"] == cli.EXIT_NO_TENSORFLOW
    # Anywhere else `import kmp` still fails loudly, as before.
    result = _run(["-c", "import kmp"], extra_path=[broken_tensorflow])
    assert result.returncode == 1
    assert "ImportError: simulated" in result.stderr


def test_doctor_runs_on_jax_and_reports_what_jax_sees():
    jax = pytest.importorskip("jax", reason="kmp doctor on JAX needs JAX installed")
    result = _run(
        ["-m", "kmp", "doctor", "--json", "--seconds", "1", "--device", "cpu"],
        env={"KERAS_BACKEND": "jax"},
    )

    assert result.returncode == cli.EXIT_OK, result.stderr
    report = json.loads(result.stdout)
    assert (report["backend"], report["jax"]) == ("jax", jax.__version__)
    assert "tensorflow" not in report
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    assert len(report["devices"]["gpus"]) == len(gpus)
    assert report["devices"]["cpu"]["jax_devices"] == len(jax.devices("cpu"))
    if not gpus:
        # XLA's CPU backend converts bfloat16 to float32, whatever the CPU's flags.
        assert report["auto_policy"]["name"] == "float32"
        assert "XLA" in report["auto_policy"]["reason"]
    benchmark = report["benchmark"]
    assert benchmark["device"] == "cpu:0"
    assert [(e["op"], e["dtype"]) for e in benchmark["results"]] == [
        (op, dtype) for op in ("matmul", "conv3x3")
        for dtype in ("float32", "float16", "bfloat16")
    ]
    for entry in benchmark["results"]:
        assert entry["error"] is None, entry
        assert entry["runs"] >= 1 and entry["median_ms"] > 0
        # The flops are the op's, whatever the backend: 2 n^3 for the matmul.
        assert entry["tflops"] == pytest.approx(
            (2 * 512**3 if entry["op"] == "matmul" else 2 * 8 * 32 * 32 * 64 * 64 * 9)
            / (entry["median_ms"] / 1e3) / 1e12
        )


@pytest.mark.parametrize("how", ["KERAS_BACKEND", "keras.json"])
def test_missing_jax_exits_3_and_names_jax(how, tmp_path):
    package = tmp_path / "fake" / "jax"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("simulated: JAX is not installed")\n')
    if how == "KERAS_BACKEND":
        env = {"KERAS_BACKEND": "jax"}
    else:  # Read as Keras reads it when KERAS_BACKEND is unset.
        home = tmp_path / "keras_home"
        home.mkdir()
        (home / "keras.json").write_text(json.dumps({"backend": "jax"}))
        env = {"KERAS_BACKEND": "", "KERAS_HOME": str(home)}
    result = _run(["-m", "kmp", "doctor"], extra_path=[tmp_path / "fake"], env=env)

    assert result.returncode == cli.EXIT_NO_BACKEND
    assert "JAX is missing or broken" in result.stderr
    assert "simulated: JAX is not installed" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("how", ["KERAS_BACKEND", "keras.json"])
def test_another_keras_backend_exits_3_naming_it_not_tensorflow(how, tmp_path):
    if how == "KERAS_BACKEND":
        env = {"KERAS_BACKEND": "torch"}
    else:  # torch is not installed: Keras' own import fails on it
        (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch"}))
        env = {"KERAS_BACKEND": "", "KERAS_HOME": str(tmp_path)}
    result = _run(["-m", "kmp", "doctor"], env=env)
    assert result.returncode == cli.EXIT_NO_BACKEND
    assert "kmp supports the TensorFlow and JAX backends of Keras. Received: backend='torch'" \
        in result.stderr
    assert "TensorFlow is missing" not in result.stderr and ".." not in result.stderr
    assert "Traceback" not in result.stderr


def test_no_gpu_for_device_gpu_exits_4():
    # CUDA_VISIBLE_DEVICES="" hides every GPU, on any machine.
    result = _run(
        ["-m", "kmp", "doctor", "--device", "gpu", "--json"],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )

    assert result.returncode == cli.EXIT_NO_DEVICE
    report = json.loads(result.stdout)
    assert report["exit_code"] == cli.EXIT_NO_DEVICE
    assert report["devices"]["gpus"] == []
    assert "no usable device: --device gpu, but TensorFlow sees no GPU" in report["error"]
    assert "no usable device" in result.stderr


@pytest.mark.parametrize(
    "argv",
    [[], ["cure"], ["doctor", "--seconds", "0"], ["doctor", "--seconds", "x"],
     ["doctor", "--device", "tpu"]],
)
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "usage: kmp" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert cli.main(["doctor", "--help"]) == cli.EXIT_OK
    assert "--seconds" in capsys.readouterr().out


@pytest.mark.parametrize(
    "orig_argv, argv0, expected",
    [
        (["python", "-m", "kmp", "doctor"], "-m", True),
        (["python", "-X", "dev", "-mkmp", "doctor"], "-m", True),
        (["python", "-m", "kmp.cli", "doctor"], "-m", True),
        (["python", "-m", "pytest", "-m", "kmp"], "pytest", False),
        (["python", "script.py", "-m", "kmp"], "script.py", False),
        (["python", "-c", "import kmp"], "-c", False),
        (["python", "/usr/bin/kmp", "doctor"], "/usr/bin/kmp", True),
        (["python", "/usr/bin/kmpx"], "/usr/bin/kmpx", False),
    ],
)
def test_only_the_command_line_tolerates_a_broken_tensorflow(orig_argv, argv0, expected):
    assert _command.started_as_command(orig_argv, argv0) is expected


def test_console_script_is_declared():
    with open(_REPO / "pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    assert project["scripts"] == {"kmp": "kmp.cli:main"}


def test_doctor_names_an_invalid_keras_json_not_the_backend(tmp_path):
    # Keras refuses `floatx: bfloat16` in keras.json while it is imported:
    # doctor says it is Keras' configuration, and which file, with Keras'
    # own words, rather than calling TensorFlow missing or broken.
    result, home = _doctor_with_floatx(tmp_path, "bfloat16")
    assert result.returncode == cli.EXIT_NO_BACKEND, result.stderr
    error = json.loads(result.stdout)["error"]
    assert error.startswith("Keras' configuration is invalid: importing Keras failed with "), error
    assert error.endswith(f". Fix or remove {home / 'keras.json'}."), error
    # Keras' own words: a ValueError naming the value, or (Keras 3.10 and
    # 3.11) a bare assert, which has none.
    assert (
        "failed with ValueError: Invalid `floatx` configuration." in error
        and "Received: floatx=bfloat16. Fix" in error
    ) or "failed with AssertionError. Fix" in error, error
    assert "TensorFlow is missing" not in result.stderr
