"""One JAX process of `test_jax_distributed.py`'s runs (not a test file).

Run as `python jax_distributed_worker.py SCENARIO --dump DIR [...]` with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` set (JAX reads it when
it starts); with `--processes 2` the processes join through
`jax.distributed.initialize` on `127.0.0.1:--port`, with gloo for the CPU
collectives. Scenarios:

- `fit`: for each `--policies` policy, a kmp.Model trained with `fit` under
  `keras.distribution.DataParallel` over every process's devices; each
  process feeds its own part of each global batch (`local_rows`), and
  process 1's part of global batch 2 holds a value that overflows. Writes
  `fit-<policy>.npz`: weights, optimizer variables, History, scale, skips.
  With `--backup DIR`, mixed_float16's fit has
  `kmp.callbacks.BackupAndRestore(DIR)` and writes `restored.npz` too (what
  training began from). `--exit-after-backup E` ends the process
  (`os._exit`, as a kill: no clean-up) at epoch E's end, after its backup;
  `--exit-before-commit N` inside the save of the backup of N epochs, after
  its file is written and before it is committed.
- `model_parallel`: `keras.distribution.ModelParallel` with a `LayoutMap`
  over a (2, 4) mesh (one process, 8 devices): a model with an Embedding
  and Dense kernels sharded, trained, saved to and loaded from a `.keras`
  file, and a plain Keras model brought over by `kmp.convert`; writes
  `model_parallel.json` with every variable's sharding.

A scenario that raises writes `error.txt`: the error's type and message.
"""

import argparse
import hashlib
import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
# Nothing here needs TensorFlow; Keras' `set_random_seed` would import it
# (seconds per process) only to seed it too.
sys.modules["tensorflow"] = None

EPOCHS = 3
GLOBAL_BATCH = 32
STEPS = 4  # global batches per epoch
FEATURES = 8
CLASSES = 3
# Row 4 of process 1's part of global batch 2 (0-based 1): past float16's
# largest value (65504), so the forward pass overflows there under float16;
# a NaN under bfloat16, whose range is float32's.
POISONED = {"process": 1, "batch": 1, "row": 4}


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["fit", "model_parallel"])
    parser.add_argument("--dump", required=True)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--policies", default="mixed_float16")
    parser.add_argument("--backup", default="")
    parser.add_argument("--exit-after-backup", type=int, default=-1)
    parser.add_argument("--exit-before-commit", type=int, default=-1)
    return parser.parse_args()


def start_jax(args):
    """Joins the processes (before anything else starts JAX's backend)."""
    import jax

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.process_id,
            # A process that never comes is an error within the test's time.
            initialization_timeout=60,
        )
    return jax


def global_data(policy):
    """`(x, y)`: `STEPS` global batches, the poisoned value in place."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, STEPS * GLOBAL_BATCH)
    local = GLOBAL_BATCH // 2
    row = POISONED["batch"] * GLOBAL_BATCH + POISONED["process"] * local + POISONED["row"]
    x[row] = 1e5 if policy == "mixed_float16" else np.nan
    return x, y


def local_rows(x, processes, process_id):
    """This process's part of each global batch: global batch b is the
    processes' parts in process order (the order of `jax.devices()`, along
    which DataParallel lays the batch out)."""
    parts = x.reshape(STEPS, processes, GLOBAL_BATCH // processes, *x.shape[1:])
    return parts[:, process_id].reshape(-1, *x.shape[1:])


def build_model():
    import keras

    import kmp

    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = kmp.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def state(model, history=None):
    """What a run ends with, as numpy values (each variable is replicated:
    this process's copy)."""
    import numpy as np

    optimizer = model.optimizer
    values = [np.asarray(v.value) for v in model.weights + list(optimizer.variables)]
    digest = hashlib.sha256()
    for value in values:
        digest.update(np.ascontiguousarray(value).tobytes())
    result = {f"v{i}": value for i, value in enumerate(values)}
    result.update(
        digest=digest.hexdigest(),
        iterations=int(optimizer.iterations),
        loss_scale=float(optimizer.loss_scale),
        skipped_steps=int(optimizer.skipped_steps),
        initial_epoch=int(getattr(model, "_initial_epoch", None) or 0),
    )
    for key, series in (history or {}).items():
        result[f"history_{key}"] = np.asarray(series, np.float64)
    return result


def data_parallel(jax, args):
    import keras

    distribution = keras.distribution.DataParallel(
        devices=jax.devices(),
        # Each process feeds its own part of the global batch.
        auto_shard_dataset=args.processes == 1,
    )
    keras.distribution.set_distribution(distribution)


def run_fit(jax, args):
    """`fit` under DataParallel for each policy; under mixed_float16 with
    `BackupAndRestore(--backup)` when a folder is given."""
    import keras
    import numpy as np

    import kmp

    data_parallel(jax, args)
    for policy in args.policies.split(","):
        kmp.set_policy(policy)
        x, y = global_data(policy)
        x, y = (local_rows(part, args.processes, args.process_id) for part in (x, y))
        model = build_model()
        callbacks = []
        if args.backup and policy == "mixed_float16":
            if args.exit_before_commit >= 0:
                exit_before_commit(args.exit_before_commit)
            callbacks = [
                kmp.callbacks.BackupAndRestore(args.backup),
                keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: exit_at(
                    epoch, args.exit_after_backup)),
                keras.callbacks.LambdaCallback(on_train_begin=lambda logs: np.savez(
                    os.path.join(args.dump, "restored.npz"), **state(model))),
            ]
        history = model.fit(x, y, batch_size=GLOBAL_BATCH // args.processes, epochs=EPOCHS,
                            shuffle=False, verbose=0, callbacks=callbacks)
        np.savez(os.path.join(args.dump, f"fit-{policy}.npz"), **state(model, history.history))


def exit_before_commit(epoch):
    """Ends the process inside the save of epoch `epoch`'s backup (numbered
    as the epochs it holds: 1 after the first), after its weights file is
    written and before the metadata naming it: the last moment a kill can
    leave this process a backup behind the others. (Saving is a collective
    on JAX: Keras gathers each variable before writing it, so no process
    finishes its save before every process has reached it.)"""
    from kmp.backup import _records

    write_metadata = _records.write_metadata

    def write_or_exit(path, metadata):
        if metadata["epoch"] == epoch:
            sys.stdout.flush()
            os._exit(17)
        write_metadata(path, metadata)

    _records.write_metadata = write_or_exit


def exit_at(epoch, when):
    """Ends the process at epoch `when`'s end, as a kill would: no clean-up,
    no lock released, no `jax.distributed.shutdown`."""
    if epoch == when:
        sys.stdout.flush()
        os._exit(17)


# The LayoutMap of `run_model_parallel`: `(regex of the variable path, the
# mesh axis of each dimension)`; every other variable is replicated.
LAYOUT = {
    "embedding/embeddings": (None, "model"),
    "hidden/kernel": (None, "model"),
    "logits/kernel": ("model", None),
}
VOCABULARY = 64


def token_model(keras, model_class):
    """Ids -> Embedding -> mean -> Dense "hidden" -> Dense "logits"."""
    inputs = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(
        VOCABULARY, 16, name="embedding",
        embeddings_initializer=keras.initializers.RandomNormal(seed=2))(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(pooled)
    return model_class(inputs, keras.layers.Dense(CLASSES, name="logits")(hidden))


def shardings(model):
    """`{variable path: [partition spec per dimension, fully replicated]}` of
    the model's and its optimizer's variables."""
    variables = list(model.weights) + list(model.optimizer.variables if model.optimizer else [])
    result = {}
    for v in variables:
        spec = list(v.value.sharding.spec)
        spec += [None] * (len(v.shape) - len(spec))  # JAX drops trailing Nones
        result[v.path] = [[None if axis is None else str(axis) for axis in spec],
                          bool(v.value.sharding.is_fully_replicated)]
    return result


def run_model_parallel(jax, args):
    import keras
    import numpy as np

    import kmp

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for path, axes in LAYOUT.items():
        layout_map[path] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCABULARY, (64, 6)).astype("int32")
    labels = ids[:, 0] % CLASSES
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    keras.utils.set_random_seed(1)
    model = token_model(keras, kmp.Model)
    model.compile(keras.optimizers.Adam(1e-2), loss)
    history = model.fit(ids, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
    path = os.path.join(args.dump, "model.keras")
    model.save(path)
    loaded = kmp.load_model(path)
    loaded.fit(ids, labels, batch_size=16, epochs=1, shuffle=False, verbose=0)

    keras.utils.set_random_seed(1)
    plain = token_model(keras, keras.Model)
    plain.compile(keras.optimizers.Adam(1e-2), loss)
    converted = kmp.convert(plain)
    converted.fit(ids, labels, batch_size=16, epochs=1, shuffle=False, verbose=0)

    # The same fit on one device, for the losses.
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(1)
    single = token_model(keras, kmp.Model)
    single.compile(keras.optimizers.Adam(1e-2), loss)
    single_history = single.fit(ids, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)

    result = {
        "loss": history.history["loss"],
        "single_device_loss": single_history.history["loss"],
        "loss_scale": [float(m.optimizer.loss_scale) for m in (model, loaded, converted)],
        "predictions_after_load": [
            np.asarray(m.predict(ids, verbose=0), np.float64).tolist()
            for m in (model, kmp.load_model(path))],
        "trained": shardings(model),
        "loaded": shardings(loaded),
        "converted": shardings(converted),
        "optimizer": [type(m.optimizer).__name__ for m in (model, loaded, converted)],
    }
    with open(os.path.join(args.dump, "model_parallel.json"), "w") as f:
        json.dump(result, f)


def main():
    args = parse()
    jax = start_jax(args)
    try:
        {"fit": run_fit, "model_parallel": run_model_parallel}[args.scenario](jax, args)
    except Exception as error:
        # The error's type and text, for the test to compare across processes.
        with open(os.path.join(args.dump, "error.txt"), "w") as f:
            f.write(f"{type(error).__name__}: {error}")
        raise


if __name__ == "__main__":
    sys.exit(main())
