"""kmp's default float16 step beside its variants and Keras', paired in one process.

    python -m benchmarks.xla_step                    # large_state and many_variables, XLA on
    python -m benchmarks.xla_step --jit off          # the same without XLA
    python -m benchmarks.xla_step --smoke            # seconds, for the test suite

Builds, in one process, each workload under mixed_float16 with SGD (momentum
0.9) as: Keras' own mixed precision (`keras.Model`, Keras' scaler), kmp's
default (`overflow_retries="auto"`), kmp with `overflow_retries=0`, and kmp
with `loss_scale=None` (no scaling: what loss scaling costs). It then runs
them in alternating chunks of the same steps on one in-memory batch
(A B C D A B C D ...) and reports, per configuration, the fastest and median
step time and the median over chunks of the paired ratio against kmp's
default (above 1: the default is faster). Alternating in one process is what
makes the ratios comparable on a shared machine; absolute times are not.

It also reads, under XLA, the optimized HLO of one training step of each
configuration (copies of variable-sized buffers, `dot` ops, conditionals)
and, with `--buffers`, the total that XLA's buffer assignment gives the
step (`XLA_FLAGS=--xla_dump_to`).
"""

import argparse
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_PROG = "python -m benchmarks.xla_step"
# (name, api, compile arguments of kmp.Model)
CONFIGS = (
    ("kmp default", "kmp", {}),
    ("kmp overflow_retries=0", "kmp", {"overflow_retries": 0}),
    ("kmp loss_scale=None", "kmp", {"loss_scale": None}),
    ("keras mixed_float16", "keras", {}),
)
_MODES = {
    "full": dict(chunks=60, steps=20, warmup=5),
    "smoke": dict(chunks=2, steps=1, warmup=1),
}


def _build(workload, api, compile_kwargs, jit_compile):
    import keras

    import kmp

    keras.utils.set_random_seed(0)
    if api == "keras":
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("mixed_float16")
        try:
            model = workload.build(keras.Model, workload.sizes)
        finally:
            keras.config.set_dtype_policy(previous)
    else:
        with kmp.policy_scope("mixed_float16"):
            model = workload.build(kmp.Model, workload.sizes)
    model.compile(
        keras.optimizers.SGD(1e-3, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
        **compile_kwargs,
    )
    return model


def hlo_counts(text, variable_shapes):
    """What the optimized HLO `text` of a step copies and computes.

    Args:
        text: String. The optimized HLO module.
        variable_shapes: Iterable of shape tuples: the variables whose copies count.

    Returns:
        A dict: `variable_copies` (copies of a buffer of one of those shapes,
        anywhere in the module), `dots` and `conditionals` (op counts).
    """
    shapes = {",".join(str(d) for d in shape) for shape in variable_shapes if len(shape)}
    copies = re.findall(r"= (?:f32|f16|bf16)\[([0-9,]+)\]\{[0-9,]*\} copy\(", text)
    return {
        "variable_copies": sum(shape in shapes for shape in copies),
        "dots": len(re.findall(r"\bdot\(", text)),
        "conditionals": len(re.findall(r"\bconditional\(", text)),
    }


def step_hlo(model, x, y):
    """The optimized HLO of one `model.train_step` on `(x, y)` under XLA."""
    import tensorflow as tf

    model.make_train_function()
    step = model.train_step
    function = tf.function(lambda data: step(data), jit_compile=True)
    return function.experimental_get_compiler_ir((tf.constant(x), tf.constant(y)))(
        stage="optimized_hlo"
    )


def _buffer_total(workload_name, mode, config_index):
    """XLA's buffer-assignment total (bytes) for one compiled train step, in a child."""
    import subprocess

    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={folder}")
        subprocess.run(
            [sys.executable, "-m", "benchmarks.xla_step", "--buffer-child", workload_name, mode,
             str(config_index)],
            env=env, check=True, capture_output=True,
        )
        files = sorted(glob.glob(os.path.join(folder, "*one_step_on_data*buffer-assignment.txt")))
        if not files:
            return None
        with open(files[0]) as dump:
            return int(re.search(r"Total bytes used: (\d+)", dump.read()).group(1))


def _buffer_child(workload_name, mode, config_index):
    import keras  # noqa: F401

    from benchmarks import workloads

    import numpy as np

    workload = workloads.get_workload(workload_name, mode)
    name, api, kwargs = CONFIGS[int(config_index)]
    model = _build(workload, api, kwargs, True)
    x, y = workload.data(workload.sizes, np.random.default_rng(0))
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)


def run(workload_names, mode, jit_compile, buffers=False, log=print):
    """Times the configurations of each workload, paired; returns the results dict."""
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks import workloads

    settings = _MODES[mode]
    results = {}
    for workload_name in workload_names:
        workload = workloads.get_workload(workload_name, mode)
        x, y = workload.data(workload.sizes, np.random.default_rng(0))
        runners = {}
        for name, api, kwargs in CONFIGS:
            model = _build(workload, api, kwargs, jit_compile)
            iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
            model.make_train_function()
            for _ in range(settings["warmup"]):
                logs = model.train_function(iterator)
            float(logs["loss"])
            runners[name] = (model, iterator)
        times = {name: [] for name in runners}
        for _ in range(settings["chunks"]):
            for name, (model, iterator) in runners.items():
                start = time.perf_counter()
                for _ in range(settings["steps"]):
                    logs = model.train_function(iterator)
                float(logs["loss"])  # waits for the last step
                times[name].append((time.perf_counter() - start) / settings["steps"])
        base = times[CONFIGS[0][0]]
        rows = {}
        for index, (name, _, _) in enumerate(CONFIGS):
            model = runners[name][0]
            row = {
                "fastest_us": min(times[name]) * 1e6,
                "median_us": statistics.median(times[name]) * 1e6,
                # Above 1: kmp's default step is faster than this one.
                "this_over_default": statistics.median(t / b for t, b in zip(times[name], base)),
            }
            if jit_compile:
                shapes = [tuple(v.shape) for v in model.trainable_variables]
                row.update(hlo_counts(step_hlo(model, x, y), shapes))
                if buffers:
                    row["buffer_bytes"] = _buffer_total(workload_name, mode, index)
            rows[name] = row
            log(f"{workload_name:15s} {name:24s} " + ", ".join(
                f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                for key, value in row.items()))
        results[workload_name] = rows
        keras.utils.clear_session()
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--buffer-child"]:
        _buffer_child(*argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="large_state,many_variables",
                        help="comma-separated workloads of benchmarks.workloads "
                             "(default: large_state,many_variables)")
    parser.add_argument("--jit", choices=("on", "off"), default="on",
                        help="jit_compile of every configuration (default: on)")
    parser.add_argument("--buffers", action="store_true",
                        help="also the XLA buffer-assignment total of each step (one child each)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, one step per chunk")
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    results = run([name.strip() for name in args.workloads.split(",")], mode,
                  args.jit == "on", buffers=args.buffers)
    if args.out:
        with open(args.out, "w") as output:
            json.dump({"mode": mode, "jit": args.jit, "results": results}, output, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
