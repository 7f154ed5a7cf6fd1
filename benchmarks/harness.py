"""Builds each configuration, times it, measures its memory and counts ops.

Timing calls the model's own `train_function` (the compiled step `fit` runs)
on one in-memory batch, so neither an input pipeline nor callbacks are
measured: on TensorFlow the batch is repeated by `tf.data` (`_Runner`); on
JAX it sits on the device and the step's state is threaded from one call to
the next, as `fit` does (`_JaxRunner`). Every configuration of a workload is
built and warmed up first; then the timed repeats are interleaved
(A B C ... A B C ...) so that drift in machine speed hits every
configuration alike.

Memory: on a GPU, TensorFlow's allocator counts bytes in use and their peak,
and the peak can be reset, so each configuration is measured in the timing
process (`gpu_memory_steps`); on a CPU only the process's peak RSS is known,
which cannot be split between models sharing a process, so each
configuration runs again in a child process of its own (`measure_memory`).
GPU memory is read on TensorFlow only. Op counts (`op_counts`) count the ops
of a traced TensorFlow graph, so they too are TensorFlow-only.

Two memory figures need no measurement: the bytes a parameter of the weights
and the optimizer's state (`state_bytes_per_parameter`, from the variables'
dtypes, in the timing process), and, for a `jit_compile=True` configuration,
the compiled step's peak from XLA's buffer assignment (`xla_step_buffers`,
read from the dump of the same child process that measures peak RSS).
"""

import dataclasses
import gc
import glob
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter

import keras
import numpy as np
import tensorflow as tf

import kmp
from kmp import _keras_internals
from benchmarks import workloads as workloads_module


@dataclasses.dataclass(frozen=True)
class Config:
    """One way of training a workload.

    Attributes:
        name: Row label, e.g. `"kmp mixed_float16"`.
        api: `"keras"` (plain `keras.Model`, Keras' own loss scaling) or
            `"kmp"` (`kmp.Model`).
        policy: Policy name given to Keras or to `kmp.set_policy`.
        loss_scale: For kmp: the `compile(loss_scale=...)` argument.
        jit_compile: Bool. Passed to `compile`.
        float8: `None`, `"kmp"` (`kmp.float8.enable(model)`: the layers its
            rule chooses) or `"keras"` (`model.quantize("float8")`: every
            Dense and EinsumDense layer), applied before `compile`.
    """

    name: str
    api: str
    policy: str
    loss_scale: object = "auto"
    jit_compile: bool = False
    float8: object = None

    @property
    def label(self):
        return f"{self.name} | jit={'on' if self.jit_compile else 'off'}"


NO_SCALE = "kmp mixed_float16 loss_scale=None"

_BASE_CONFIGS = (
    Config("float32", "keras", "float32"),
    Config("keras mixed_float16", "keras", "mixed_float16"),
    Config("keras mixed_bfloat16", "keras", "mixed_bfloat16"),
    # Keras' own bfloat16 weights: half the memory, but Adam's step is 0
    # there (docs/policies.md, "bfloat16 weights that train").
    Config("keras bfloat16", "keras", "bfloat16"),
    Config("kmp mixed_float16", "kmp", "mixed_float16"),
    Config(NO_SCALE, "kmp", "mixed_float16", loss_scale=None),
    Config("kmp mixed_bfloat16", "kmp", "mixed_bfloat16"),
    # bfloat16 weights whose updates kmp computes in float32 and compensates.
    Config("kmp bfloat16", "kmp", "bfloat16"),
    Config("kmp auto", "kmp", "auto"),
)

CONFIGS = tuple(
    dataclasses.replace(config, jit_compile=jit)
    for jit in (False, True)
    for config in _BASE_CONFIGS
)
CONFIG_NAMES = tuple(config.name for config in _BASE_CONFIGS)

# `--float8` adds these: kmp's float8 by its rule, and Keras' own float8 on
# every Dense and EinsumDense layer, under the same policy; "kmp
# mixed_bfloat16" (in CONFIGS) is the 16-bit policy alone.
FLOAT8_SUFFIX = " + float8"
_FLOAT8_CONFIGS = (
    Config("kmp mixed_bfloat16" + FLOAT8_SUFFIX, "kmp", "mixed_bfloat16", float8="kmp"),
    Config("keras mixed_bfloat16 + quantize(float8)", "keras", "mixed_bfloat16", float8="keras"),
)
FLOAT8_CONFIGS = tuple(
    dataclasses.replace(config, jit_compile=jit)
    for jit in (False, True)
    for config in _FLOAT8_CONFIGS
)
FLOAT8_CONFIG_NAMES = tuple(config.name for config in _FLOAT8_CONFIGS)


def find_config(name, jit_compile):
    for config in CONFIGS + FLOAT8_CONFIGS:
        if config.name == name and config.jit_compile == jit_compile:
            return config
    raise ValueError(
        "Unknown configuration. `name` must be one of "
        f"{', '.join(CONFIG_NAMES + FLOAT8_CONFIG_NAMES)}. "
        f"Received: name={name!r}"
    )


def select_configs(names=None, *, float8=False, jit="both"):
    """The configurations a run times, in `CONFIGS` order (float8 ones last).

    Args:
        names: `None` (every configuration, the float8 ones with `float8`),
            or a comma-separated string of configuration names from
            `CONFIG_NAMES` and `FLOAT8_CONFIG_NAMES` (`--configs`): only
            those run, a float8 one without `float8` too.
        float8: Bool. With `names=None`, add the float8 configurations.
        jit: `"off"`, `"on"` or `"both"`: the `jit_compile` settings kept.

    Returns:
        A list of `Config`.

    Raises:
        ValueError: if `names` holds a name that is not a configuration's,
            or no name at all.
    """
    known = CONFIG_NAMES + FLOAT8_CONFIG_NAMES
    if names is None:
        wanted = set(CONFIG_NAMES + (FLOAT8_CONFIG_NAMES if float8 else ()))
    else:
        listed = [name.strip() for name in names.split(",") if name.strip()]
        unknown = [name for name in listed if name not in known]
        if unknown or not listed:
            raise ValueError(
                "`--configs` takes comma-separated configuration names, each one of: "
                f"{', '.join(known)}. Received: --configs {names!r}"
                + (f" (unknown: {', '.join(repr(name) for name in unknown)})" if unknown else "")
            )
        wanted = set(listed)
    return [
        config for config in CONFIGS + FLOAT8_CONFIGS
        if config.name in wanted and (jit == "both" or config.jit_compile == (jit == "on"))
    ]


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "sgd": lambda: keras.optimizers.SGD(1e-3, momentum=0.9),
}


def build_model(workload, config, optimizer="adam"):
    """Builds and compiles `workload` under `config`; returns (model, resolved policy).

    `optimizer` is a key of `OPTIMIZERS`: `"adam"`, or `"sgd"` (with momentum).
    """
    if config.api == "keras":
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(config.policy)
        try:
            model = workload.build(keras.Model, workload.sizes)
        finally:
            keras.config.set_dtype_policy(previous)
        resolved = config.policy
        compile_kwargs = {}
    else:
        with kmp.policy_scope(config.policy) as policy:
            model = workload.build(kmp.Model, workload.sizes)
        resolved = policy.name
        compile_kwargs = {"loss_scale": config.loss_scale}
    if config.float8 == "kmp":
        kmp.float8.enable(model)
    elif config.float8 == "keras":
        with warnings.catch_warnings():
            # "Layer InputLayer does not have a `quantize` method": Keras
            # quantizes what it can and says so of every other layer.
            warnings.simplefilter("ignore", UserWarning)
            model.quantize("float8")
    model.compile(
        optimizer=OPTIMIZERS[optimizer](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=config.jit_compile,
        **compile_kwargs,
    )
    return model, resolved


def repeated_batch(x, y):
    """A `tf.data.Dataset` of the batch `(x, y)`, repeated without end.

    One tensor repeated has nothing to tune, and an autotuned iterator's
    destructor waits for its tuning thread to wake, which sleeps longer the
    older the iterator: freeing a smoke run's 18 runners took 30-40 s of it
    on a 2-core CPU with autotuning on, under 1 s with it off.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensors((x, y)).repeat().with_options(options)


class _Runner:
    """Runs training steps of one compiled model on one repeated batch."""

    def __init__(self, model, x, y):
        self.model = model
        self.iterator = iter(repeated_batch(x, y))
        model.make_train_function()

    def run(self, steps):
        logs = None
        for _ in range(steps):
            logs = self.model.train_function(self.iterator)
        # Reading a value waits for the last step to finish.
        return float(logs["loss"])


class _JaxRunner:
    """Runs training steps of one compiled model on one repeated batch, on JAX.

    Keras' JAX `train_function(state, iterator)` is a pure function of the
    model's state: `(trainable, non_trainable, optimizer, metrics)` values in,
    new values out. The runner keeps what each call returns for the next one,
    as `fit` does between its steps; the jitted step donates the state it is
    given, so the old values must not be used again. (The model's variables
    are not updated, which a benchmark never reads.)
    """

    def __init__(self, model, x, y):
        import jax

        self.model = model
        model.make_train_function()
        # `fit` builds the optimizer before its first step; its variables
        # must exist before the state is read (a traced step cannot make them).
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        # On the device once, as TensorFlow's runner repeats one batch.
        self.iterator = itertools.repeat((jax.device_put(x), jax.device_put(y)))
        self.state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables],
            [v.value for v in model.metrics_variables],
        )

    def run(self, steps):
        logs = None
        for _ in range(steps):
            logs, self.state = self.model.train_function(self.state, self.iterator)
        # Reading a value waits for the last step to finish (JAX dispatches
        # steps asynchronously).
        return float(logs["loss"])


def _float8_layer_counts(model):
    """`[layers running float8 matmuls, Dense and EinsumDense layers]` of
    `model`, or `None` for what is not a Keras model (a test's stand-in)."""
    if not isinstance(model, keras.Model):
        return None
    return [
        len(kmp.float8.float8_layers(model)),
        sum(
            isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
            for layer in _keras_internals.nested_layers(model, include_self=False, recursive=True)
        ),
    ]


def make_runner(model, x, y):
    """The runner for Keras' backend: `_Runner` on TensorFlow, `_JaxRunner` on JAX.

    Both have `run(steps)`, which runs `steps` training steps on the batch
    `(x, y)` and returns the loss of the last one after waiting for it.
    """
    if keras.backend.backend() == "jax":
        return _JaxRunner(model, x, y)
    return _Runner(model, x, y)


def has_gpu():
    """Whether Keras' backend sees a GPU (on JAX, without initializing TensorFlow's)."""
    if keras.backend.backend() == "jax":
        import jax

        return any(device.platform == "gpu" for device in jax.devices())
    return bool(tf.config.list_physical_devices("GPU"))


def _peak_rss_mb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _gpu_bytes():
    """`(current, peak)` bytes in use on the first GPU, by TensorFlow's allocator."""
    info = tf.config.experimental.get_memory_info("GPU:0")
    return info["current"], info["peak"]


def time_workload(workload, configs, *, repeats, chunk_seconds, warmup_steps,
                  optimizer="adam", gpu_memory_steps=0, log=print):
    """Times every configuration of `workload`, interleaved.

    Args:
        gpu_memory_steps: Int. With a GPU, after timing, runs each
            configuration this many more steps with the allocator's peak reset
            and adds `"memory"` to its row (0: not measured). TensorFlow's
            allocator counts the bytes: on JAX it must be 0. Defaults to 0.

    Returns:
        Dict `label -> {"samples_per_s": median, "repeats": [...], "steps": n,
        "policy": resolved policy, "optimizer": class name, "float8_layers":
        [float8 layers, Dense and EinsumDense layers], "bytes_per_parameter":
        `state_bytes_per_parameter`'s dict}`; with
        `gpu_memory_steps`, also `"memory": {"kind": "gpu", "resident_mb",
        "step_peak_mb", "peak_mb"}` (MiB): what building and warming this
        configuration left allocated (weights, optimizer state), the peak
        above everything allocated during its steps (activations, gradients,
        the optimizer's temporaries), and the allocator's peak in all.

    Raises:
        ValueError: if `gpu_memory_steps` is not 0 on Keras' JAX backend.
    """
    if gpu_memory_steps and keras.backend.backend() != "tensorflow":
        raise ValueError(
            "`gpu_memory_steps` reads TensorFlow's GPU allocator: it must be 0 on "
            f"KERAS_BACKEND={keras.backend.backend()!r}. Received: "
            f"gpu_memory_steps={gpu_memory_steps}"
        )
    rng = np.random.default_rng(0)
    x, y = workload.data(workload.sizes, rng)
    batch = len(y)
    runners, info, resident = {}, {}, {}
    for config in configs:
        start = time.perf_counter()
        if gpu_memory_steps:
            before, _ = _gpu_bytes()
        model, resolved = build_model(workload, config, optimizer)
        runner = make_runner(model, x, y)
        runner.run(warmup_steps)
        if gpu_memory_steps:
            resident[config.label] = _gpu_bytes()[0] - before
        # A few more timed steps tell how many make a chunk of `chunk_seconds`
        # (the fastest, as other processes can only slow a step down).
        step_time = float("inf")
        for _ in range(3):
            step_start = time.perf_counter()
            runner.run(1)
            step_time = min(step_time, time.perf_counter() - step_start)
        steps = max(1, round(chunk_seconds / step_time))
        runners[config.label] = (runner, steps)
        info[config.label] = {
            "config": config.name,
            "jit_compile": config.jit_compile,
            "policy": resolved,
            "optimizer": type(model.optimizer).__name__,
            "float8_layers": _float8_layer_counts(model),
            "model_class": type(model).__name__,
            "bytes_per_parameter": state_bytes_per_parameter(model),
            "steps": steps,
            "repeats": [],
        }
        log(
            f"  built {config.label:45s} policy={resolved:15s} "
            f"optimizer={type(model.optimizer).__name__:20s} "
            f"{time.perf_counter() - start:5.1f}s, {step_time * 1e3:7.1f} ms/step"
        )
    # Python's garbage collector would pause whichever configuration happens
    # to be running; collecting once and pausing it spares all of them.
    gc.collect()
    gc.disable()
    try:
        # Round 0 is one more warm-up, interleaved like the timed rounds: the
        # first chunk after building the others runs measurably slower.
        for repeat in range(repeats + 1):
            for label, (runner, steps) in runners.items():
                start = time.perf_counter()
                runner.run(steps)
                elapsed = time.perf_counter() - start
                if repeat:
                    info[label]["repeats"].append(steps * batch / elapsed)
            if repeat:
                log(f"  repeat {repeat}/{repeats} done")
    finally:
        gc.enable()
    for label, entry in info.items():
        entry["samples_per_s"] = statistics.median(entry["repeats"])
    if gpu_memory_steps:
        for label, (runner, _) in runners.items():
            runner.run(1)  # nothing of another configuration still running
            tf.config.experimental.reset_memory_stats("GPU:0")
            current, _ = _gpu_bytes()
            runner.run(gpu_memory_steps)
            _, peak = _gpu_bytes()
            info[label]["memory"] = {
                "kind": "gpu",
                "resident_mb": resident[label] / 2**20,
                "step_peak_mb": (peak - current) / 2**20,
                "peak_mb": peak / 2**20,
            }
    return info


# -- memory: what the weights and the optimizer's state take -------------------


def _dtype_bytes(dtype):
    """Bytes of one element of `dtype` (`"bfloat16"` -> 2, `"int64"` -> 8)."""
    name = keras.backend.standardize_dtype(dtype)
    bits = re.search(r"(\d+)$", name)
    if bits is None:  # bool
        return 1
    return int(bits.group(1)) // 8


def state_bytes_per_parameter(model):
    """Bytes a trainable parameter of `model`'s weights and its optimizer's state.

    Counts every weight of the model (trainable or not) and every float
    variable of its built optimizer that has the shape of a trainable weight:
    Adam's two moments, SGD's momentum, kmp's compensation buffers. The step
    counters, learning rate and loss scale, a few bytes in all, are left out. So Adam
    under `mixed_bfloat16` (float32 weights and moments) is 12.0, and
    bfloat16 weights with Adam's moments in bfloat16 are 6.0, or 8.0 with
    kmp's bfloat16 compensation buffer.

    Returns:
        Dict with `parameters` (trainable parameters), `weights` and
        `optimizer` (bytes a parameter of each) and `total` (their sum); `None`
        for what is not a Keras model (a test's stand-in).
    """
    if not isinstance(model, keras.Model):
        return None

    def size(variable):
        return int(np.prod(variable.shape, dtype=np.int64))

    trainable = list(model.trainable_weights)
    parameters = sum(size(v) for v in trainable)
    shapes = {tuple(v.shape) for v in trainable}
    weights = sum(size(v) * _dtype_bytes(v.dtype) for v in model.weights)
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(trainable)
    state = sum(size(v) * _dtype_bytes(v.dtype) for v in optimizer.variables
                if tuple(v.shape) in shapes and keras.backend.is_float_dtype(v.dtype))
    return {
        "parameters": parameters,
        "weights": weights / parameters,
        "optimizer": state / parameters,
        "total": (weights + state) / parameters,
    }


# The compiled train step's XLA module: TensorFlow's `one_step_on_data`,
# JAX's `train_step`.
_STEP_MODULE = re.compile(r"one_step_on_data|train_step")


def xla_step_buffers(folder):
    """The compiled train step's memory, from XLA's dump in `folder`
    (`XLA_FLAGS=--xla_dump_to=folder`).

    The peak is what XLA's buffer assignment has live at once ("Stack trace
    breakdown for peak usage"): the step's arguments (weights, optimizer
    state, the batch), its activations, gradients and temporaries. Where
    several train steps were compiled, the largest.

    Returns:
        Dict with `peak_bytes` and `total_bytes` (the assignment's "Total
        bytes used": every buffer, reused or not), or `None` where the dump
        holds no train step.
    """
    found = None
    for path in glob.glob(os.path.join(folder, "*buffer-assignment.txt")):
        name = os.path.basename(path)
        if not _STEP_MODULE.search(name):
            continue
        # Newer XLA writes the totals and the live ranges to files of their own.
        stem = name[: -len("-buffer-assignment.txt")]
        text = ""
        for suffix in ("-buffer-assignment.txt", "-buffer-assignment-values.txt",
                       "-live-range.txt"):
            extra = os.path.join(folder, stem + suffix)
            if os.path.exists(extra):
                with open(extra) as dump:
                    text += dump.read()
        peak = re.search(r"peak usage: ([\d ]+) bytes", text)
        total = re.search(r"Total bytes used: (\d+)", text)
        if peak is None or total is None:
            continue
        figures = {"peak_bytes": int(peak.group(1).replace(" ", "")),
                   "total_bytes": int(total.group(1))}
        if found is None or figures["peak_bytes"] > found["peak_bytes"]:
            found = figures
    return found


# -- memory: one child process per configuration ------------------------------


def memory_child(workload_name, mode, config_name, jit_compile, steps, optimizer="adam"):
    """Entry point of the child: prints JSON with its peak resident memory."""
    workload = workloads_module.get_workload(workload_name, mode)
    config = find_config(config_name, jit_compile)
    x, y = workload.data(workload.sizes, np.random.default_rng(0))
    baseline = _peak_rss_mb()
    model, _ = build_model(workload, config, optimizer)
    make_runner(model, x, y).run(steps)
    print(json.dumps({"baseline_mb": baseline, "peak_mb": _peak_rss_mb()}))


def measure_memory(workload, mode, config, *, steps, optimizer="adam"):
    """Peak RSS of a fresh process that builds and trains one configuration.

    The child runs on this process's Keras backend.

    A `jit_compile=True` child also dumps its XLA programs, and the compiled
    step's buffer assignment gives its peak (`xla_step_buffers`).

    Returns:
        Dict with `peak_mb` (VmHWM of the child, which includes the backend
        itself) and `baseline_mb` (VmHWM after importing the backend, Keras and
        kmp and making the data, before the model was built), and for
        `jit_compile=True` `xla_step` (`xla_step_buffers`' dict, or `None`);
        or `None` if the child failed.
    """
    backend = keras.backend.backend()
    command = [
        sys.executable, "-m", "benchmarks.run", "--backend", backend, "--memory-child",
        workload.name, mode, config.name, "1" if config.jit_compile else "0", str(steps),
        optimizer,
    ]
    # A CPU measurement: the child must not take a GPU.
    environment = dict(
        os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
        JAX_PLATFORMS="cpu",
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as folder:
        if config.jit_compile:
            environment["XLA_FLAGS"] = (
                environment.get("XLA_FLAGS", "") + f" --xla_dump_to={folder}").strip()
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=root, env=environment
        )
        if result.returncode != 0:
            return None
        peak = json.loads(result.stdout.strip().splitlines()[-1])
        if config.jit_compile:
            peak["xla_step"] = xla_step_buffers(folder)
    peak["kind"] = "rss"
    return peak


# -- op counts ------------------------------------------------------------------


def graph_op_types(concrete_function):
    """Counter of op types in a traced function, its nested functions included."""
    graph_def = concrete_function.graph.as_graph_def()
    types = Counter(node.op for node in graph_def.node)
    for function in graph_def.library.function:
        types.update(node.op for node in function.node_def)
    return types


def count_train_step_ops(model, x, y):
    """Op types of `model.train_step` traced on one batch (as `fit` traces it)."""
    spec = (
        tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)),
        tf.TensorSpec(y.shape, tf.as_dtype(y.dtype)),
    )
    # autograph=False, as Keras traces its own train step.
    concrete = tf.function(model.train_step, autograph=False).get_concrete_function(spec)
    return graph_op_types(concrete)


def count_apply_ops(optimizer, variables):
    """Op types of `optimizer.apply(grads, variables)` traced alone."""
    optimizer.build(variables)
    specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    concrete = tf.function(
        lambda grads: optimizer.apply(grads, variables), autograph=False
    ).get_concrete_function(specs)
    return graph_op_types(concrete)


def op_counts(workload):
    """Counts the ops kmp and Keras add for loss scaling on `workload`.

    Returns:
        Dict with, for `"keras"` and `"kmp"` (both mixed_float16, jit off):
        the op types of the whole train step and of the optimizer's `apply`
        alone, plus the op types of plain Adam's `apply` on the same variables
        (so `apply - adam` is what loss scaling costs in ops).
    """
    x, y = workload.data(workload.sizes, np.random.default_rng(0))
    result = {}
    for api in ("keras", "kmp"):
        config = find_config(f"{api} mixed_float16", False)
        model, _ = build_model(workload, config)
        train_step = count_train_step_ops(model, x, y)
        variables = model.trainable_variables
        if api == "keras":
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        else:
            optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        apply_ops = count_apply_ops(optimizer, variables)
        result[api] = {"train_step": train_step, "apply": apply_ops}
        result["variables"] = len(variables)
    result["adam_apply"] = count_apply_ops(keras.optimizers.Adam(1e-3), variables)
    return result
