"""Benchmarks kmp against Keras' built-in mixed precision on this machine.

Usage (from the repository root):

    python -m benchmarks.run            # full run, ~10-15 minutes on 2 CPU cores
    python -m benchmarks.run --quick    # smaller models, jit off only: ~2 minutes
    python -m benchmarks.run --jit on   # only jit_compile=True (off, on, both)
    python -m benchmarks.run --out DIR  # results folder (default: results/)
    python -m benchmarks.run --backend jax   # on Keras' JAX backend (default: tensorflow)
    python -m benchmarks.run --configs "keras mixed_float16,kmp mixed_float16"
                                        # only these configurations (names as in the report)

`--backend` picks Keras' backend (it sets `KERAS_BACKEND` before Keras is
imported; the environment's `KERAS_BACKEND` does not). On JAX, Keras
jit-compiles every train step, so only the `jit_compile=True`
configurations run there; op counts (a TensorFlow graph's) and GPU memory
(TensorFlow's allocator) are TensorFlow-only.

On a machine with a GPU (TensorFlow's or JAX's, per backend), the full
run uses GPU-sized workloads (a 4x8192 MLP at batch 4096, ResNet50 at
224x224 and batch 128, a BERT-base-sized encoder at sequence 128 and batch
64), SGD with momentum, `jit_compile` on only, and (on TensorFlow) measures
peak GPU memory per configuration in the timing process. `--quick` and `--smoke` keep their
small models there.

What it does, per workload (on a CPU: MLP, convnet, Transformer encoder,
many small variables):

1. builds every configuration in one process: float32; Keras' built-in
   mixed_float16 (plain `keras.Model`, Keras' `LossScaleOptimizer`),
   mixed_bfloat16 and bfloat16 (bfloat16 weights); kmp mixed_float16, the same
   with `loss_scale=None`, mixed_bfloat16, bfloat16 (bfloat16 weights whose
   updates kmp compensates) and auto; each with `jit_compile` off and on (on
   only, on JAX), and records the bytes a parameter of each one's weights and
   optimizer state;
2. warms each up, then times them interleaved (A B C ... A B C ...), each
   repeat a chunk of `train_function` calls on one in-memory batch, and keeps
   the median samples/s;
3. (full run, or `--memory`) measures memory: on a CPU, the peak resident
   memory of each configuration in a child process of its own, since peak RSS
   cannot be split between configurations sharing a process, and for
   `jit_compile=True` the compiled step's peak from XLA's buffer assignment
   (the child's `--xla_dump_to` dump); on a GPU (on
   TensorFlow only), the allocator's peak during a few more steps of each
   configuration, reset before each, and what the configuration keeps
   allocated;
4. (on TensorFlow) counts the ops of the traced train step and of
   `optimizer.apply` for kmp and Keras on the many-variables model.

It writes `report.md` (tables, targets met or missed), `ratios.png` (needs
matplotlib: `pip install -e ".[plot]"`) and `results.json` to the results
folder.
"""

import argparse
import collections
import concurrent.futures
import json
import os
import shlex
import sys
import time

BACKENDS = ("tensorflow", "jax")
_PROG = "python -m benchmarks.run"


def _backend_arguments(argv):
    """Splits `--backend NAME` off `argv`: `(backend, the other arguments)`.

    The backend defaults to `"tensorflow"`; an unknown name exits with
    argparse's message.
    """
    parser = argparse.ArgumentParser(prog=_PROG, add_help=False)
    parser.add_argument("--backend", choices=BACKENDS, default="tensorflow")
    known, rest = parser.parse_known_args(argv)
    return known.backend, rest


def _use_backend(backend):
    """Makes Keras run on `backend`: sets `KERAS_BACKEND`, which Keras reads
    once, when it is imported.

    Raises:
        SystemExit: if Keras is already imported with another backend.
    """
    keras = sys.modules.get("keras")
    if keras is not None and keras.backend.backend() != backend:
        raise SystemExit(
            f"`--backend {backend}` cannot run in this process: Keras was already imported "
            f"here with KERAS_BACKEND={keras.backend.backend()!r}, and Keras picks its "
            f"backend once, when it is imported. Run `{_PROG} --backend {backend}` in a "
            "new process."
        )
    named = os.environ.get("KERAS_BACKEND")
    if named and named != backend:
        print(f"KERAS_BACKEND={named} in the environment is overridden: this run uses "
              f"--backend {backend}.", file=sys.stderr, flush=True)
    os.environ["KERAS_BACKEND"] = backend


# Before anything in this process imports Keras (nothing above does).
if __name__ == "__main__":
    _use_backend(_backend_arguments(sys.argv[1:])[0])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_MODES = {
    # repeats, seconds per timed chunk, warm-up steps, steps in a memory child
    "full": dict(repeats=7, chunk_seconds=0.5, warmup_steps=3, memory_steps=5, memory=True, jit="both"),
    # Building and compiling 56 models takes most of a run; XLA compiles take
    # twice as long as the rest, so the quick run leaves them out.
    "quick": dict(repeats=5, chunk_seconds=0.1, warmup_steps=1, memory_steps=3, memory=False, jit="off"),
    # For tests: tiny models, one step per repeat.
    "smoke": dict(repeats=5, chunk_seconds=0.0, warmup_steps=1, memory_steps=1, memory=False, jit="both"),
}


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Benchmark kmp against Keras' built-in mixed precision.",
    )
    parser.add_argument("--backend", choices=BACKENDS, default="tensorflow",
                        help="Keras backend to run on (default: tensorflow; sets KERAS_BACKEND, "
                             "which must not already be in use with another backend)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller models, fewer seconds per repeat: under 2 minutes")
    size.add_argument("--smoke", action="store_true", help="tiny models, one step per repeat (for tests)")
    parser.add_argument("--out", default="results", help="results folder (default: results/)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated subset of: mlp, convnet, transformer, many_variables, "
                             "large_state, resnet50 (default: all but resnet50 on a CPU; mlp, "
                             "resnet50, transformer on a GPU)")
    parser.add_argument("--jit", choices=("off", "on", "both"), default=None,
                        help="jit_compile settings to run (default: both on a CPU, off with "
                             "--quick; on with a GPU, both with --smoke; on JAX, on only)")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default=None,
                        help="adam, or sgd with momentum 0.9 (default: adam on a CPU, sgd on a GPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per configuration (>= 5 recommended)")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory", dest="memory", action="store_true", default=None,
                        help="measure peak memory per configuration: GPU allocator peak, or peak "
                             "RSS in child processes on a CPU (default in the full run; GPU "
                             "memory on TensorFlow only)")
    memory.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--float8", action="store_true",
                        help="also run float8 configurations: kmp mixed_bfloat16 + kmp.float8 "
                             "(its rule), Keras' quantize(\"float8\") under mixed_bfloat16; "
                             "float8 is emulated, and slow, where the GPU has no float8 "
                             "tensor cores (compute capability < 8.9) or there is no GPU")
    parser.add_argument("--configs", default=None,
                        help="comma-separated subset of the configurations to run, by the "
                             "names the report shows (default: all; float8 ones with "
                             "--float8); ratios whose peer did not run are left blank")
    parser.add_argument("--no-op-counts", dest="op_counts", action="store_false",
                        help="skip counting graph ops on the many-variables model (TensorFlow "
                             "only: never counted on JAX)")
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    backend, rest = _backend_arguments(argv)
    _use_backend(backend)
    if rest[:1] == ["--memory-child"]:
        return _memory_child(rest[1:])
    args = _parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    settings = dict(_MODES[mode])
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit(f"`--repeats` must be >= 1. Received: --repeats={args.repeats}")
        settings["repeats"] = args.repeats
    if backend == "jax" and args.jit not in (None, "on"):
        raise SystemExit(
            f"`--jit {args.jit}` is TensorFlow-only: Keras' JAX backend jit-compiles every "
            "train step (with `jit_compile=False` it would run the step op by op), so "
            "`--backend jax` runs `jit_compile=True` only. Leave `--jit` out, or pass "
            f"`--jit on`. Received: --jit {args.jit}"
        )
    if backend == "tensorflow":
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
        for gpu in tf.config.list_physical_devices("GPU"):
            # Allocate as needed, so that the allocator's figures are the models'
            # (and another process can share the GPU). Too late once devices are
            # initialized, as when main() runs inside a process that used them.
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except RuntimeError:
                pass
    from benchmarks import harness

    gpu = harness.has_gpu()
    if gpu and mode == "full":
        # XLA is what Keras uses on a GPU by default (jit_compile="auto").
        settings["jit"] = "on"
    if gpu:
        # Measured in this process from the allocator's counters: cheap.
        settings["memory"] = True
    if args.memory is not None:
        settings["memory"] = args.memory
    if args.jit is not None:
        settings["jit"] = args.jit
    if backend == "jax":
        settings["jit"] = "on"
        if gpu and settings["memory"]:
            # TensorFlow's allocator counters are what measure GPU memory, and
            # peak RSS of CPU children would not describe a GPU run.
            if args.memory:
                print("--memory: GPU memory is measured on TensorFlow only; not on JAX.",
                      file=sys.stderr, flush=True)
            settings["memory"] = False
    settings["optimizer"] = args.optimizer or ("sgd" if gpu else "adam")
    settings["device"] = "gpu" if gpu else "cpu"
    settings["backend"] = backend
    from benchmarks import report
    from benchmarks import workloads as workloads_module

    default_names = (
        workloads_module.GPU_WORKLOAD_NAMES if gpu and mode == "full"
        else workloads_module.WORKLOAD_NAMES
    )
    names = args.workloads.split(",") if args.workloads else list(default_names)
    try:
        workloads = [
            workloads_module.get_workload(name.strip(), mode, gpu=gpu) for name in names
        ]
        configs = harness.select_configs(args.configs, float8=args.float8, jit=settings["jit"])
    except ValueError as error:
        raise SystemExit(str(error)) from None
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks.run " + shlex.join(argv)
    started = time.perf_counter()
    machine = report.describe_machine()
    print(f"kmp benchmarks ({mode}, {backend}): {report.machine_line(machine)}", flush=True)

    results = {}
    for workload in workloads:
        print(f"[{time.perf_counter() - started:6.0f}s] {workload.name}: {workload.sizes}", flush=True)
        results[workload.name] = harness.time_workload(
            workload,
            configs,
            repeats=settings["repeats"],
            chunk_seconds=settings["chunk_seconds"],
            warmup_steps=settings["warmup_steps"],
            optimizer=settings["optimizer"],
            gpu_memory_steps=settings["memory_steps"] if gpu and settings["memory"] else 0,
            log=lambda line: print(line, flush=True),
        )
        import keras

        keras.utils.clear_session()
    report.ratios(results)

    counts = None
    count_workload = next((w for w in workloads if w.name == "many_variables"), None)
    # Counts of a traced TensorFlow graph; the report says so on JAX.
    if args.op_counts and count_workload is not None and backend == "tensorflow":
        print(f"[{time.perf_counter() - started:6.0f}s] counting ops", flush=True)
        counts = harness.op_counts(count_workload)

    if settings["memory"] and gpu:
        memory_note = (
            "GPU memory, in MiB, from TensorFlow's allocator on GPU:0 in the timing process "
            "(memory growth on): \"above resident\" is the allocator's peak during "
            f"{settings['memory_steps']} more steps of the configuration, reset just before "
            "them, minus what was allocated then (every model built so far: their weights "
            "and optimizer state), so it is what one step needs on top (activations, "
            "gradients, the optimizer's temporaries); \"resident\" is what building and "
            "warming up this configuration left allocated."
        )
    elif settings["memory"]:
        print(f"[{time.perf_counter() - started:6.0f}s] memory: one child process per "
              "configuration, two at a time", flush=True)
        jobs = [(workload, config) for workload in workloads for config in configs]
        # Building a model is mostly single-threaded Python tracing, so two
        # children share the two cores well; peak RSS is per process anyway.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            peaks = pool.map(
                lambda job: harness.measure_memory(
                    job[0], mode, job[1], steps=settings["memory_steps"],
                    optimizer=settings["optimizer"],
                ),
                jobs,
            )
            for (workload, config), peak in zip(jobs, peaks):
                results[workload.name][config.label]["memory"] = peak
        imported = "TensorFlow" if backend == "tensorflow" else "JAX, TensorFlow"
        memory_note = (
            f"Peak RSS is the VmHWM of a fresh child process on the {backend} backend that "
            f"imports {imported}, Keras and kmp, builds one configuration and trains it for "
            f"{settings['memory_steps']} steps; the figure in brackets is the increase over "
            "the same process's peak just before the model was built (those imports and "
            "the data)."
        )
    elif gpu and backend == "jax":
        memory_note = (
            "GPU memory not measured: on JAX this benchmark does not read GPU memory "
            "(TensorFlow's allocator counters measure it, with `--backend tensorflow`)."
        )
    else:
        memory_note = (
            "Peak RSS not measured in this mode (it takes one child process per "
            "configuration); pass `--memory`, or run the full benchmark."
        )

    machine["load_average_end"] = report._load_average()
    chart_path = os.path.join(args.out, "ratios.png")
    if report.chart(results, workloads, chart_path):
        chart_note = "Chart: `ratios.png` (kmp / Keras same policy, and kmp / float32)."
    else:
        chart_note = (
            "Chart not written: it needs matplotlib (`pip install -e \".[plot]\"`)."
        )
    text = report.markdown(
        results,
        workloads,
        machine,
        command=command,
        mode=mode,
        repeats=settings["repeats"],
        counts=counts,
        memory_note=memory_note,
        chart_note=chart_note,
        optimizer=settings["optimizer"],
    )
    with open(os.path.join(args.out, "report.md"), "w") as output:
        output.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as output:
        json.dump(
            {
                "backend": backend,
                "machine": machine,
                "mode": mode,
                "settings": settings,
                "results": results,
                "op_counts": None if counts is None else _plain_counts(counts),
            },
            output,
            indent=1,
        )
    print(text)
    print(f"[{time.perf_counter() - started:6.0f}s] wrote {args.out}/report.md, results.json"
          + (", ratios.png" if os.path.exists(chart_path) else ""))
    return 0


def _plain_counts(value):
    if isinstance(value, dict) and not isinstance(value, collections.Counter):
        return {key: _plain_counts(item) for key, item in value.items()}
    return dict(value) if isinstance(value, collections.Counter) else value


def _memory_child(argv):
    from benchmarks import harness

    workload, mode, config, jit, steps, optimizer = argv
    harness.memory_child(workload, mode, config, jit == "1", int(steps), optimizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
