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

It also reads, under XLA, what a GPU would wait on: in the graph of the
train function `fit` runs, the host-side control flow (`If`, `While`,
`Case`) fed by an output of the compiled step (`host_control_flow`: the
host cannot take such an op before the device has finished the step); and
in the optimized HLO of that compiled step, the `conditional`s left (whose
predicate XLA:GPU reads on the host), with copies of variable-sized buffers
and `dot` ops. With `--buffers`, also the total that XLA's buffer
assignment gives the step (`XLA_FLAGS=--xla_dump_to`).
"""

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import types
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_PROG = "python -m benchmarks.xla_step"
# (name, api, compile arguments of kmp.Model, policy)
CONFIGS = (
    ("kmp default", "kmp", {}, "mixed_float16"),
    ("kmp overflow_retries=0", "kmp", {"overflow_retries": 0}, "mixed_float16"),
    ("kmp loss_scale=None", "kmp", {"loss_scale": None}, "mixed_float16"),
    ("keras mixed_float16", "keras", {}, "mixed_float16"),
    # bfloat16: kmp's guard (a scale fixed at 1, the skip a select) beside
    # Keras' step, which applies whatever the gradients hold.
    ("kmp bf16 guard", "kmp", {}, "mixed_bfloat16"),
    ("keras mixed_bfloat16", "keras", {}, "mixed_bfloat16"),
)
_MODES = {
    "full": dict(chunks=60, steps=20, warmup=5),
    "smoke": dict(chunks=2, steps=1, warmup=1),
}


def _build(workload, api, compile_kwargs, jit_compile, policy="mixed_float16"):
    import keras

    import kmp

    keras.utils.set_random_seed(0)
    if api == "keras":
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            model = workload.build(keras.Model, workload.sizes)
        finally:
            keras.config.set_dtype_policy(previous)
    else:
        with kmp.policy_scope(policy):
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


# Control flow that TensorFlow runs on the host, its predicate (or branch
# index) in host memory; inside an XLA-compiled function it is XLA's instead.
HOST_CONTROL_FLOW_OPS = frozenset(
    {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"}
)
_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# Ops that hand a tensor on unchanged: what they output is still the step's.
_PASS_THROUGH_OPS = frozenset({"Identity", "IdentityN", "Snapshot"})

HostControlFlow = collections.namedtuple("HostControlFlow", "function op name inputs")
HostControlFlow.__doc__ = """A host-side control-flow op fed by an output of a compiled step.

Attributes:
    function: String. The function whose graph holds the op: the train
        function's own, or a branch, loop body or call it runs on the host.
    op: String. The op type (`"If"`, `"While"`, ...).
    name: String. The op's name in that graph.
    inputs: Tuple of ints. Which of its inputs come from the step (0 is an
        `If`'s predicate and a `Case`'s branch index).
"""


def _tf_functions(function):
    """The `tf.function`s that `function` reaches through its closures, nearest first.

    Keras' `model.train_function` is a Python function around the
    `tf.function` that takes the iterator, which calls the compiled step;
    kmp's is an object holding such functions (a model it holds is not
    followed).
    """
    import keras
    import tensorflow as tf

    found, seen, queue = [], set(), collections.deque([function])
    while queue:
        current = queue.popleft()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, tf.types.experimental.PolymorphicFunction):
            found.append(current)
            current = current.python_function
        values = []
        for cell in getattr(current, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                continue
        if not isinstance(current, (types.FunctionType, types.MethodType, keras.layers.Layer)):
            values += list(getattr(current, "__dict__", {}).values())
        queue.extend(value for value in values if callable(value)
                     and not isinstance(value, (type, keras.layers.Layer)))
    return found


def train_function_graph(model, iterator):
    """The concrete function that `model.train_function` runs on `iterator`.

    Args:
        model: `keras.Model` (or `kmp.Model`), compiled, its train function
            made (`model.make_train_function()`) and, so that nothing is
            traced anew, called once on `iterator`.
        iterator: The `tf.data` iterator `fit` would pass.

    Returns:
        The `ConcreteFunction` of the nearest `tf.function` that
        `model.train_function` calls: its `graph` is what `fit` runs per call.
    """
    functions = _tf_functions(model.train_function)
    if not functions:
        raise ValueError(
            "`model.train_function` calls no `tf.function` (is the model compiled "
            f"with run_eagerly=True?). Received: run_eagerly={model.run_eagerly}"
        )
    return functions[0].get_concrete_function(iterator)


def _compiled(node, library):
    """Whether `node` calls a function that XLA compiles (`tf.function(jit_compile=True)`)."""
    if node.op not in _CALL_OPS:
        return False
    body = library.get(node.attr["f"].func.name)
    return any(
        "_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b
        for attrs in (node.attr, body.attr if body is not None else {})
    )


def _host_graphs(function):
    """`(library, [(function name, nodes), ...])`: each graph of `function` that runs on the host.

    The function's own graph, then the branches, loop bodies and calls it
    reaches, but nothing inside a function XLA compiles.
    """
    graph_def = function.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    name = function.name.decode() if isinstance(function.name, bytes) else function.name
    graphs, queue, seen = [], collections.deque([(name, graph_def.node)]), {name}
    while queue:
        name, nodes = queue.popleft()
        graphs.append((name, nodes))
        for node in nodes:
            if _compiled(node, library):
                continue  # XLA's: its control flow does not run on the host
            for value in node.attr.values():
                called = [value.func.name] if value.HasField("func") else [
                    f.name for f in value.list.func]
                for callee in called:
                    if callee in library and callee not in seen:
                        seen.add(callee)
                        queue.append((callee, library[callee].node_def))
    return library, graphs


def _compiled_steps(function):
    """Names of the functions that `function`'s host graphs call compiled by XLA."""
    library, graphs = _host_graphs(function)
    return {
        node.attr["f"].func.name
        for _, nodes in graphs
        for node in nodes
        if _compiled(node, library)
    }


def host_control_flow_on_step(function):
    """The host-side control flow that an output of a compiled step feeds.

    A GPU runs ahead of the host only while the host needs nothing the GPU
    has not finished. TensorFlow keeps an `If`'s predicate (a `Case`'s
    index, a `While`'s condition) in host memory: an `If` outside the
    compiled step whose predicate is one of the step's outputs makes every
    call wait for the device to finish the step before it can return.

    ```
    for each graph the host runs (the function's, and the branches, loop
        bodies and uncompiled calls it reaches; not XLA's):
      fed = the call ops whose function has `_XlaMustCompile`
      fed += ops in _PASS_THROUGH_OPS with an input in fed, until none is added
      report each op in HOST_CONTROL_FLOW_OPS with an input in fed
    ```

    Each graph is read on its own: an op inside a branch or loop body is
    reported where a compiled step in that same graph feeds it (kmp's
    `While` that redoes a batch, inside the `If` that the step's retry flag
    feeds, takes the `If`'s inputs, not a step's outputs).

    Args:
        function: `ConcreteFunction`. A train function's (see
            `train_function_graph`).

    Returns:
        A list of `HostControlFlow`, the function's own graph first; empty
        where no control flow on the host waits on a compiled step.

    Example:

    ```python
    model.fit(x, y, epochs=1, verbose=0)    # compiled with jit_compile=True
    iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    model.train_function(iterator)
    for op in host_control_flow_on_step(train_function_graph(model, iterator)):
        print(op.op, op.name, "takes the step's outputs as inputs", op.inputs)
    ```
    """

    def source(name):
        # GraphDef: "op:2" or "op"; FunctionDef: "op:output:2" or an argument.
        return name.split(":")[0]

    found = []
    library, graphs = _host_graphs(function)
    for function_name, nodes in graphs:
        fed = {node.name for node in nodes if _compiled(node, library)}
        added = True
        while added:
            added = False
            for node in nodes:
                if (node.name not in fed and node.op in _PASS_THROUGH_OPS
                        and any(source(i) in fed for i in node.input if not i.startswith("^"))):
                    fed.add(node.name)
                    added = True
        for node in nodes:
            if node.op in HOST_CONTROL_FLOW_OPS:
                # Control inputs ("^op") come after the data inputs.
                inputs = tuple(
                    index for index, name in enumerate(node.input)
                    if not name.startswith("^") and source(name) in fed
                )
                if inputs:
                    found.append(HostControlFlow(function_name, node.op, node.name, inputs))
    return found


def compiled_step_hlo(model, function):
    """The optimized HLO of the step that the train function `function` compiles.

    Args:
        model: `keras.Model`. The model whose `train_function` `function` is.
        function: `ConcreteFunction`. From `train_function_graph(model, ...)`.

    Returns:
        A string: the optimized HLO module of the `tf.function` that
        `function` calls with `_XlaMustCompile`, traced as `fit` traced it.

    Raises:
        ValueError: `function` calls no compiled step, or several.
    """
    import tensorflow as tf

    names = _compiled_steps(function)
    if len(names) != 1:
        raise ValueError(
            "The train function must call one XLA-compiled step. "
            f"Received: compiled steps={sorted(names)}"
        )
    for candidate in _tf_functions(model.train_function):
        # TensorFlow has no public list of a tf.function's traces; the one
        # the train function calls gives the arguments it was traced with.
        for concrete in candidate._list_all_concrete_functions():
            concrete_name = concrete.name
            if isinstance(concrete_name, bytes):
                concrete_name = concrete_name.decode()
            if concrete_name not in names:
                continue
            args, kwargs = tf.nest.map_structure(
                lambda spec: None if spec is None else tf.zeros(spec.shape, spec.dtype),
                concrete.structured_input_signature,
            )
            return candidate.experimental_get_compiler_ir(*args, **kwargs)(
                stage="optimized_hlo"
            )
    raise ValueError(f"No tf.function of `model.train_function` traced {sorted(names)}.")


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
    name, api, kwargs, policy = CONFIGS[int(config_index)]
    model = _build(workload, api, kwargs, True, policy)
    x, y = workload.data(workload.sizes, np.random.default_rng(0))
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)


def _shown(value):
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return " ".join(value) or "none"
    return str(value)


def run(workload_names, mode, jit_compile, buffers=False, log=print):
    """Times the configurations of each workload, paired; returns the results dict."""
    import keras
    import numpy as np

    from benchmarks import harness, workloads

    settings = _MODES[mode]
    results = {}
    for workload_name in workload_names:
        workload = workloads.get_workload(workload_name, mode)
        x, y = workload.data(workload.sizes, np.random.default_rng(0))
        runners = {}
        for name, api, kwargs, policy in CONFIGS:
            model = _build(workload, api, kwargs, jit_compile, policy)
            iterator = iter(harness.repeated_batch(x, y))
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
        for index, (name, *_) in enumerate(CONFIGS):
            model = runners[name][0]
            row = {
                "fastest_us": min(times[name]) * 1e6,
                "median_us": statistics.median(times[name]) * 1e6,
                # Above 1: kmp's default step is faster than this one.
                "this_over_default": statistics.median(t / b for t, b in zip(times[name], base)),
            }
            if jit_compile:
                function = train_function_graph(model, runners[name][1])
                host = host_control_flow_on_step(function)
                row["host_control_flow"] = len(host)
                row["host_control_flow_ops"] = [f"{op.op}:{op.name}" for op in host]
                shapes = [tuple(v.shape) for v in model.trainable_variables]
                row.update(hlo_counts(compiled_step_hlo(model, function), shapes))
                if buffers:
                    row["buffer_bytes"] = _buffer_total(workload_name, mode, index)
            rows[name] = row
            log(f"{workload_name:15s} {name:24s} " + ", ".join(
                f"{key} {_shown(value)}" for key, value in row.items()))
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
