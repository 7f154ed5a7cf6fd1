"""The `kmp` command line: `kmp doctor` (also `python -m kmp doctor`).

Imports nothing heavy at module level: `kmp doctor` has to run, and say so,
when the backend (TensorFlow or JAX) is missing or broken (see
kmp/_command.py). What it asks the backend (its version, its devices, the
timed ops) comes from `kmp/backends/<backend>/doctor.py`.

Exit codes:

```
0  everything found and measured
2  usage error (unknown command or option, bad --seconds)
3  the backend (TensorFlow or JAX), or Keras on it, is missing or broken
4  no usable device: --device gpu without a GPU, or the benchmark cannot run
```
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NO_BACKEND = 3
EXIT_NO_TENSORFLOW = EXIT_NO_BACKEND  # Its name before kmp ran on JAX.
EXIT_NO_DEVICE = 4

# CPU flags that decide how fast 16-bit math can be on x86.
_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "f16c", "avx512f")
_DTYPES = ("float32", "float16", "bfloat16")

# What `kmp doctor` says when `import kmp` failed, by Keras backend: the
# backend's own module cannot be asked, since importing it may be what failed.
_MISSING_BACKEND = {
    "tensorflow": (
        "TensorFlow is missing or broken: importing kmp failed with {error}. "
        "kmp needs TensorFlow >= 2.19 and Keras 3 on its TensorFlow backend: "
        '`pip install -e ".[tensorflow]"` in your clone of kmp, and '
        "KERAS_BACKEND=tensorflow (or unset)."
    ),
    "jax": (
        "JAX is missing or broken: importing kmp failed with {error}. kmp on "
        "JAX needs JAX and Keras 3 on its JAX backend: "
        '`pip install -e ".[jax]"` in your clone of kmp, and KERAS_BACKEND=jax.'
    ),
}


class _DeviceError(Exception):
    """No usable device; the message says which and why."""


def main(argv=None):
    """Runs the `kmp` command line and returns its exit code.

    Args:
        argv: Optional list of strings, the arguments after `kmp`. Defaults
            to `None` (`sys.argv[1:]`).

    Returns:
        The exit code: 0 ok, 2 usage error, 3 the backend (TensorFlow or
        JAX) missing or broken, 4 no usable device.

    Example:

    ```
    $ kmp doctor --seconds 2
    $ python -m kmp doctor --json > doctor.json
    ```
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage or the help.
        return EXIT_OK if exit_.code in (0, None) else EXIT_USAGE
    if args.command != "doctor":
        parser.print_usage(sys.stderr)
        print("kmp: error: a command is required: doctor", file=sys.stderr)
        return EXIT_USAGE
    return _doctor(args)


def _parser():
    parser = argparse.ArgumentParser(
        prog="kmp",
        description="kmp: mixed precision for Keras 3 on TensorFlow and JAX.",
        epilog="Exit codes: 0 ok, 2 usage error, 3 the backend (TensorFlow "
        "or JAX) missing or broken, 4 no usable device.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command")
    doctor = commands.add_parser(
        "doctor",
        help="versions, devices, what policy 'auto' picks, and a 16-bit benchmark",
        description="Prints the versions of kmp, Keras and its backend "
        "(TensorFlow or JAX), the devices "
        "found, the policy 'auto' resolves to and why, and a short benchmark "
        "of a matmul and a conv in float32, float16 and bfloat16.",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument(
        "--seconds", type=_positive_seconds, default=10.0,
        help="time budget of the benchmark in seconds (default: 10)",
    )
    doctor.add_argument(
        "--device", choices=("auto", "cpu", "gpu"), default="auto",
        help="where to benchmark: the first GPU if any (auto, the default), "
        "the CPU, or a GPU (exit code 4 if there is none)",
    )
    return parser


def _positive_seconds(text):
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds. Received: {text!r}"
        )
    return seconds


def _doctor(args):
    from kmp import _command

    if _command.import_error is not None:
        error = _command.import_error
        if isinstance(error, _command.BackendNotInstalled):
            # kmp's own error says what to do (KERAS_BACKEND=jax where JAX is
            # installed, the extra that installs TensorFlow).
            return _fail(args, EXIT_NO_BACKEND, str(error))
        if _command.raised_by_keras_config(error):
            said = str(error).rstrip(".")  # Keras 3.10's is a bare assert
            return _fail(args, EXIT_NO_BACKEND, (
                f"Keras' configuration is invalid: importing Keras failed with "
                f"{type(error).__name__}{': ' + said if said else ''}. Fix or remove "
                f"{_command.keras_json()}."))
        backend = _command.requested_backend()
        if backend not in _MISSING_BACKEND:
            # Another Keras backend (torch, numpy): kmp's own error says so.
            return _fail(args, EXIT_NO_BACKEND, str(error))
        message = _MISSING_BACKEND[backend]
        return _fail(
            args, EXIT_NO_BACKEND,
            message.format(error=f"{type(error).__name__}: {error}"),
        )
    import keras

    import kmp
    from kmp import backends
    from kmp import policy as policy_module

    doctor = backends.get("doctor")
    report = {
        "kmp": kmp.__version__,
        "keras": keras.__version__,
        "backend": doctor.KEY,
        doctor.KEY: doctor.version(),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "devices": _devices(doctor),
        "auto_policy": None,
        "benchmark": None,
    }
    auto = policy_module._resolve_auto()
    report["auto_policy"] = {"name": auto.name, "reason": auto.reason}
    report["weights"] = _weights(keras)
    try:
        device = _benchmark_device(doctor, args.device, report["devices"])
        report["benchmark"] = _benchmark(doctor, device, args.seconds, report["devices"])
        report["benchmark"]["float8"] = _float8_matmul(
            device == doctor.device(on_gpu=True), report["devices"], args.seconds
        )
    except _DeviceError as error:
        return _fail(args, EXIT_NO_DEVICE, f"no usable device: {error}", report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format(report, doctor))
    return EXIT_OK


def _weights(keras):
    """Keras' global settings (`keras.json`'s `floatx`, or a dtype policy
    set before), and a warning where they store weights in 16 bits, which
    Keras' own optimizers do not train."""
    from kmp.precision import _compensated

    floatx, policy = keras.config.floatx(), keras.config.dtype_policy().name
    stored = keras.config.dtype_policy().variable_dtype
    warning = None
    if stored in _compensated.LOW_PRECISION:
        setting = (f"floatx is {floatx!r}" if floatx == stored
                   else f"dtype policy is {policy!r}")
        lost = ("Keras' own Adam and AdamW never move them (their step rounds to 0), and any "
                "optimizer's update below half a step of the weight (2**-9 of it) is lost"
                if stored == "bfloat16" else
                "any Keras optimizer's update below half a step of the weight (2**-11 of it) "
                "is lost")
        warning = (
            f"Keras' {setting}: a keras.Model's weights are stored in {stored}, where {lost}. "
            f"With kmp: kmp.set_policy('mixed_{stored}') (float32 weights, {stored} math) or "
            "kmp.set_policy('bfloat16') (bfloat16 weights whose updates kmp computes in "
            "float32), and a kmp.Model or kmp.convert(model, policy)."
        )
    return {"floatx": floatx, "dtype_policy": policy, "warning": warning}


def _fail(args, code, message, report=None):
    if args.json:
        print(json.dumps({**(report or {}), "error": message, "exit_code": code}, indent=2))
    print(f"kmp doctor: {message}", file=sys.stderr)
    return code


def _devices(doctor):
    from kmp.precision import _hardware

    gpus = []
    for device, details in _hardware._gpus():
        capability = details.get("compute_capability")
        gpus.append({
            "name": details.get("device_name", device),
            "device": device,
            "compute_capability": (
                f"{capability[0]}.{capability[1]}" if capability else None
            ),
        })
    flags = _hardware._cpu_flags()
    return {
        "gpus": gpus,
        _key(doctor, "built_with_cuda"): doctor.built_with_cuda(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cpu": {
            "model": _cpu_model(),
            "logical_cores": os.cpu_count(),
            "flags": {flag: flag in flags for flag in _CPU_FLAGS},
            _key(doctor, "devices"): doctor.cpu_devices(),
        },
    }


def _key(doctor, what):
    """The report's key for what the backend says about `what`, named after
    the backend (`"tensorflow_devices"`, `"jax_built_with_cuda"`)."""
    return "_".join((doctor.KEY, what))


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _benchmark_device(doctor, requested, devices):
    if requested in ("auto", "gpu") and devices["gpus"]:
        return doctor.device(on_gpu=True)
    if requested == "gpu":
        raise _DeviceError(
            f"--device gpu, but {doctor.NAME} sees no GPU ({doctor.NAME} built with "
            f"CUDA: {'yes' if devices[_key(doctor, 'built_with_cuda')] else 'no'}; "
            f"CUDA_VISIBLE_DEVICES={devices['cuda_visible_devices']!r}). "
            f"Install a CUDA build (`{doctor.CUDA_INSTALL}`) and "
            "check `nvidia-smi`, or use --device cpu."
        )
    if not devices["cpu"][_key(doctor, "devices")]:
        raise _DeviceError(f"{doctor.NAME} lists no CPU device.")
    return doctor.device(on_gpu=False)


def _cases(doctor, device, on_gpu):
    """The ops `kmp doctor` times on `device`, built by the backend's doctor.

    Returns:
        List of `(op, shape, build)`, `build(dtype)` returning `(step,
        flops)`: `step()` runs the op once in `dtype` and returns a float32
        scalar (converting it to a Python float waits for the device).
    """
    n = 4096 if on_gpu else 512
    batch, size, channels = (32, 56, 128) if on_gpu else (8, 32, 64)
    return [
        ("matmul", f"{n}x{n} @ {n}x{n}",
         lambda dtype: (doctor.matmul(device, n, dtype), 2 * n**3)),
        ("conv3x3", f"{batch}x{size}x{size}x{channels} -> {channels}",
         lambda dtype: (doctor.conv(device, batch, size, channels, dtype),
                        2 * batch * size * size * channels * channels * 9)),
    ]


def _benchmark(doctor, device, seconds, devices):
    """Median time of each op in each dtype, within `seconds` in all.

    Each op gets half the budget, and its three dtypes take turns, so a
    machine that is busy for a moment slows all three alike.
    """
    from kmp.precision import _hardware

    on_gpu = device == doctor.device(on_gpu=True)
    results = []
    for op, shape, build in _cases(doctor, device, on_gpu):
        entries, steps = {}, {}
        for dtype in _DTYPES:
            entries[dtype] = {"op": op, "shape": shape, "dtype": dtype,
                              "median_ms": None, "tflops": None, "runs": 0,
                              "speedup": None, "error": None}
            try:
                step, flops = build(dtype)
                step()  # Traces or compiles the step and warms up kernels; not timed.
                steps[dtype] = step
            except Exception as error:  # noqa: BLE001 - reported per entry
                message = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                if dtype == "float32":
                    raise _DeviceError(
                        f"a float32 {op} on {device} failed: {message}"
                    ) from None
                entries[dtype]["error"] = message
        times = {dtype: [] for dtype in steps}
        deadline = time.perf_counter() + seconds / 2
        while True:
            for dtype, step in steps.items():
                start = time.perf_counter()
                float(step())  # Waits for the device.
                times[dtype].append(time.perf_counter() - start)
            if time.perf_counter() >= deadline:
                break
        baseline = statistics.median(times["float32"])
        for dtype, measured in times.items():
            median = statistics.median(measured)
            entries[dtype].update(
                median_ms=median * 1e3, runs=len(measured),
                tflops=flops / median / 1e12, speedup=baseline / median,
            )
        results.extend(entries.values())
    notes = []
    flags = devices["cpu"]["flags"]
    if not on_gpu and not (flags["avx512_fp16"] or flags["amx_fp16"]):
        notes.append(
            "this CPU has no native float16 arithmetic (no avx512_fp16 or "
            f"amx_fp16): {doctor.NAME} emulates float16, and its column shows "
            "what that emulation gives here. Loss scaling is only needed "
            "for float16."
        )
    if not on_gpu and not _hardware._runs_bfloat16([], _hardware._cpu_flags()):
        notes.append(
            "bfloat16 has no native instructions on this CPU (no "
            f"{' or '.join(_hardware._BFLOAT16_CPU_FLAGS)})."
        )
    return {"device": device, "seconds": seconds, "results": results, "notes": notes}


def _float8_matmul(on_gpu, devices, seconds):
    """A float8 matmul against a bfloat16 one, timed in turns within
    `seconds / 4`, where the GPU in use has float8 tensor cores (compute
    capability >= 8.9); otherwise why it was not timed.

    Returns:
        Dict: `timed` (bool), and `reason` when not timed; else `shape`,
        `bfloat16_ms`, `float8_ms` (medians), `runs` and `speedup`
        (bfloat16 time over float8 time).
    """
    from kmp import float8

    if not on_gpu:
        return {"timed": False, "reason": "no GPU in use; float8 matmuls need an "
                "NVIDIA GPU of compute capability 8.9 or above"}
    capability = devices["gpus"][0]["compute_capability"] if devices["gpus"] else None
    if not float8._has_float8_tensor_cores(capability):
        return {"timed": False, "reason": f"GPU compute capability {capability or 'unknown'}; "
                "float8 tensor cores need 8.9 or above (L4, L40, H100, H200)"}
    n = 8192
    steps = {"bfloat16": float8._matmul_step(n, False), "float8": float8._matmul_step(n, True)}
    for step in steps.values():
        step()  # Compiles; not timed.
    times = {name: [] for name in steps}
    deadline = time.perf_counter() + seconds / 4
    while True:
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        if time.perf_counter() >= deadline:
            break
    medians = {name: statistics.median(measured) for name, measured in times.items()}
    return {
        "timed": True,
        "shape": f"{n}x{n} @ {n}x{n} (a Dense layer under mixed_bfloat16, XLA)",
        "bfloat16_ms": medians["bfloat16"] * 1e3,
        "float8_ms": medians["float8"] * 1e3,
        "runs": len(times["float8"]),
        "speedup": medians["bfloat16"] / medians["float8"],
    }


def _float8_line(entry):
    if entry is None:
        return None
    if not entry["timed"]:
        return f"  float8 matmul: not timed ({entry['reason']})"
    return (
        f"  float8 matmul, {entry['shape']}: {entry['float8_ms']:.3g} ms against "
        f"{entry['bfloat16_ms']:.3g} ms in bfloat16 ({entry['speedup']:.2f}x)"
    )


def _format(report, doctor):
    devices = report["devices"]
    lines = [
        "kmp doctor",
        f"  kmp {report['kmp']} | Keras {report['keras']} | {doctor.NAME} "
        f"{report[doctor.KEY]} | Python {report['python']} ({report['platform']})",
        "",
        "Devices",
    ]
    if devices["gpus"]:
        for gpu in devices["gpus"]:
            lines.append(
                f"  GPU {gpu['device']}: {gpu['name']}, compute capability "
                f"{gpu['compute_capability'] or 'unknown'}"
            )
    else:
        lines.append(
            f"  GPU: none found ({doctor.NAME} built with CUDA: "
            f"{'yes' if devices[_key(doctor, 'built_with_cuda')] else 'no'})"
        )
    cpu = devices["cpu"]
    lines.append(f"  CPU: {cpu['model'] or 'unknown'}, {cpu['logical_cores']} logical cores")
    lines.append(
        "       16-bit flags: "
        + ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in cpu["flags"].items())
    )
    auto = report["auto_policy"]
    lines += ["", f'Policy "auto" -> {auto["name"]}', f"  {auto['reason']}"]
    weights = report["weights"]
    lines.append(f"  Keras' floatx: {weights['floatx']}; dtype policy: {weights['dtype_policy']}")
    if weights["warning"]:
        lines.append(f"  warning: {weights['warning']}")
    lines.append("")
    bench = report["benchmark"]
    lines.append(
        f"Benchmark on {bench['device']} ({bench['seconds']:g} s budget, dtypes "
        "interleaved; median time per op, speedup against float32)"
    )
    rows = [["op", "shape"] + list(_DTYPES)]
    for op in dict.fromkeys(entry["op"] for entry in bench["results"]):
        entries = {e["dtype"]: e for e in bench["results"] if e["op"] == op}
        row = [op, next(iter(entries.values()))["shape"]]
        for dtype in _DTYPES:
            entry = entries.get(dtype)
            if entry is None or entry["error"]:
                row.append("failed")
            elif dtype == "float32":
                row.append(f"{entry['median_ms']:.3g} ms")
            else:
                row.append(f"{entry['median_ms']:.3g} ms ({entry['speedup']:.2f}x)")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for entry in bench["results"]:
        if entry["error"]:
            lines.append(f"  {entry['op']} in {entry['dtype']} failed: {entry['error']}")
    float8_line = _float8_line(bench.get("float8"))
    if float8_line:
        lines.append(float8_line)
    for note in bench["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
