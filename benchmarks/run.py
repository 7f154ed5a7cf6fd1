"""Benchmarks kmp against Keras' built-in mixed precision on this machine.

Usage (from the repository root):

    python -m benchmarks.run            # full run, ~10-15 minutes on 2 CPU cores
    python -m benchmarks.run --quick    # smaller models, jit off only: ~2 minutes
    python -m benchmarks.run --jit on   # only jit_compile=True (off, on, both)
    python -m benchmarks.run --out DIR  # results folder (default: results/)

What it does, per workload (MLP, convnet, Transformer encoder, many small
variables):

1. builds every configuration in one process: float32; Keras' built-in
   mixed_float16 (plain `keras.Model`, Keras' `LossScaleOptimizer`) and
   mixed_bfloat16; kmp mixed_float16, the same with `loss_scale=None`,
   mixed_bfloat16 and auto; each with `jit_compile` off and on;
2. warms each up, then times them interleaved (A B C ... A B C ...), each
   repeat a chunk of `train_function` calls on one in-memory batch, and keeps
   the median samples/s;
3. (full run, or `--memory`) measures peak resident memory of each
   configuration in a child process of its own, since peak RSS cannot be
   split between configurations sharing a process;
4. counts the ops of the traced train step and of `optimizer.apply` for kmp
   and Keras on the many-variables model.

It writes `report.md` (tables, targets met or missed), `ratios.png` (needs
matplotlib: `pip install -e ".[plot]"`) and `results.json` to the results
folder.
"""

import argparse
import collections
import concurrent.futures
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
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
        prog="python -m benchmarks.run",
        description="Benchmark kmp against Keras' built-in mixed precision.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller models, fewer seconds per repeat: under 2 minutes")
    size.add_argument("--smoke", action="store_true", help="tiny models, one step per repeat (for tests)")
    parser.add_argument("--out", default="results", help="results folder (default: results/)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated subset of: mlp, convnet, transformer, many_variables")
    parser.add_argument("--jit", choices=("off", "on", "both"), default=None,
                        help="jit_compile settings to run (default: both; off with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per configuration (>= 5 recommended)")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory", dest="memory", action="store_true", default=None,
                        help="measure peak RSS per configuration in child processes (default in the full run)")
    memory.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--no-op-counts", dest="op_counts", action="store_false",
                        help="skip counting graph ops on the many-variables model")
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--memory-child"]:
        return _memory_child(argv[1:])
    args = _parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    settings = dict(_MODES[mode])
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit(f"`--repeats` must be >= 1. Received: --repeats={args.repeats}")
        settings["repeats"] = args.repeats
    if args.memory is not None:
        settings["memory"] = args.memory
    if args.jit is not None:
        settings["jit"] = args.jit

    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    from benchmarks import harness
    from benchmarks import report
    from benchmarks import workloads as workloads_module

    names = args.workloads.split(",") if args.workloads else list(workloads_module.WORKLOAD_NAMES)
    try:
        workloads = [workloads_module.get_workload(name.strip(), mode) for name in names]
    except ValueError as error:
        raise SystemExit(str(error)) from None
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks.run " + " ".join(argv)
    started = time.perf_counter()
    machine = report.describe_machine()
    print(f"kmp benchmarks ({mode}): {report.machine_line(machine)}", flush=True)

    configs = [
        config
        for config in harness.CONFIGS
        if settings["jit"] == "both" or config.jit_compile == (settings["jit"] == "on")
    ]
    results = {}
    for workload in workloads:
        print(f"[{time.perf_counter() - started:6.0f}s] {workload.name}: {workload.sizes}", flush=True)
        results[workload.name] = harness.time_workload(
            workload,
            configs,
            repeats=settings["repeats"],
            chunk_seconds=settings["chunk_seconds"],
            warmup_steps=settings["warmup_steps"],
            log=lambda line: print(line, flush=True),
        )
        import keras

        keras.utils.clear_session()
    report.ratios(results)

    counts = None
    count_workload = next((w for w in workloads if w.name == "many_variables"), None)
    if args.op_counts and count_workload is not None:
        print(f"[{time.perf_counter() - started:6.0f}s] counting ops", flush=True)
        counts = harness.op_counts(count_workload)

    if settings["memory"]:
        print(f"[{time.perf_counter() - started:6.0f}s] memory: one child process per "
              "configuration, two at a time", flush=True)
        jobs = [(workload, config) for workload in workloads for config in configs]
        # Building a model is mostly single-threaded Python tracing, so two
        # children share the two cores well; peak RSS is per process anyway.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            peaks = pool.map(
                lambda job: harness.measure_memory(job[0], mode, job[1], steps=settings["memory_steps"]),
                jobs,
            )
            for (workload, config), peak in zip(jobs, peaks):
                results[workload.name][config.label]["memory"] = peak
        memory_note = (
            "Peak RSS is the VmHWM of a fresh child process that imports TensorFlow, "
            f"builds one configuration and trains it for {settings['memory_steps']} steps; "
            "the figure in brackets is the increase over the same process's peak just "
            "before the model was built (TensorFlow, Keras, kmp and the data)."
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
    )
    with open(os.path.join(args.out, "report.md"), "w") as output:
        output.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as output:
        json.dump(
            {
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

    workload, mode, config, jit, steps = argv
    harness.memory_child(workload, mode, config, jit == "1", int(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
