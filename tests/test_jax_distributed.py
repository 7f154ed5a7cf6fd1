"""kmp across JAX devices and processes (the suite's `KERAS_BACKEND=jax` pass).

- Two processes on localhost joined by `jax.distributed` (gloo CPU
  collectives, two devices each) training a kmp.Model under
  `keras.distribution.DataParallel`, each process feeding its part of every
  global batch: identical weights, scale and History on both, an overflow in
  one process's data skipped on both, and the same result as one process
  with four devices on the same global batches.
- `kmp.callbacks.BackupAndRestore` across those processes: a run killed
  after an epoch's backup resumes, with one shared folder and with a folder
  per process (one process's backup an epoch behind the other's), and ends
  exactly where the uninterrupted run ends; a process that cannot restore
  (a damaged file, another model's file, a folder another run holds) stops
  both with the same error, naming it and the cause, without a hang.
- `keras.distribution.ModelParallel` with a `LayoutMap` on eight devices:
  the shardings asked for hold after training, a `.keras` round trip and
  `kmp.convert`.
- The stateless `jax.jit` loop (`stateless_scale_loss`, `stateless_apply`)
  under DataParallel on this process's two devices (tests/conftest.py).

Each run of several processes or devices is a child process
(tests/jax_distributed_worker.py): JAX reads its device count and joins
`jax.distributed` when it starts. Children run with a timeout, so a hang
fails the test instead of stalling the suite.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from _helpers import child_env
from _helpers import free_ports

import kmp

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the KERAS_BACKEND=jax pass runs it"
)

_WORKER = os.path.join(os.path.dirname(__file__), "jax_distributed_worker.py")
# Each run takes 5-20 s on the busy 2-core CPU; a hang fails at this.
_TIMEOUT_S = 120
_EPOCHS = 3  # jax_distributed_worker.EPOCHS
_STEPS = 4  # its global batches per epoch


def _start(tmp_path, name, scenario, *, processes=2, devices=2, args=(), per_process=None):
    """Starts `processes` workers running `scenario`, joined by
    `jax.distributed` when there are several; each gets `args` and its
    `per_process[index]` arguments. Returns `(process, dump folder, log)`s."""
    port = free_ports(1)[0]
    env = dict(
        child_env(gpu=False),
        KERAS_BACKEND="jax",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    runs = []
    for index in range(processes):
        dump = tmp_path / f"{name}-{index}"
        dump.mkdir()
        log = tmp_path / f"{name}-{index}.log"
        command = [sys.executable, _WORKER, scenario, "--dump", str(dump),
                   "--processes", str(processes), "--process-id", str(index),
                   "--port", str(port), *map(str, args),
                   *map(str, (per_process or {}).get(index, ()))]
        with open(log, "w") as log_file:
            process = subprocess.Popen(command, env=env, stdout=log_file,
                                       stderr=subprocess.STDOUT)
        runs.append((process, dump, log))
    return runs


def _wait(runs, *, expect_success=True):
    """Waits for every process (killing any still running at the deadline);
    returns their exit codes, `None` for one that hung."""
    deadline = time.monotonic() + _TIMEOUT_S
    codes = []
    for process, _, _ in runs:
        try:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
            codes.append(None)
    if expect_success and any(code != 0 for code in codes):
        pytest.fail(f"Processes exited with {codes} (None: hung, killed):\n" + _logs(runs))
    return codes


def _logs(runs):
    return "\n".join(
        f"--- process {index}:\n{log.read_text()[-3000:]}" for index, (_, _, log) in enumerate(runs)
    )


def _load(dump, name):
    with np.load(dump / name) as data:
        return dict(data)


def _variables(state):
    return [state[f"v{i}"] for i in range(sum(key.startswith("v") for key in state))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two processes training under each policy (mixed_float16's fit with a
    `BackupAndRestore` on one shared folder, never killed), and, beside them,
    one process with four devices on the same global batches."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    backup = tmp_path / "backup"
    policies = ("--policies", "mixed_float16,mixed_bfloat16")
    cluster = _start(tmp_path, "cluster", "fit", args=(*policies, "--backup", backup))
    single = _start(tmp_path, "single", "fit", processes=1, devices=4, args=policies)
    _wait(cluster + single)
    # delete_checkpoint=True: each process's part is gone, and the folder.
    assert not backup.exists()
    return [dump for _, dump, _ in cluster], single[0][1]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_two_processes_train_as_one_and_skip_one_processs_overflow_together(
    uninterrupted, policy
):
    dumps, single_dump = uninterrupted
    first, second = (_load(dump, f"fit-{policy}.npz") for dump in dumps)
    single = _load(single_dump, f"fit-{policy}.npz")
    # Bit for bit the same on both processes: weights, slots, scale, logs.
    assert first["digest"] == second["digest"]
    for key in first:
        if key.startswith("history_"):
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    # The overflow in process 1's part of one global batch, every epoch:
    # skipped on both, once per epoch, and the epochs' losses stay finite.
    np.testing.assert_array_equal(first["history_skipped_steps"], [1, 2, 3])
    assert int(first["iterations"]) == _EPOCHS * (_STEPS - 1)
    assert np.isfinite(first["history_loss"]).all()
    if policy == "mixed_float16":
        # Backed off once per skip from 2**15.
        np.testing.assert_array_equal(first["history_loss_scale"], [2.0**14, 2.0**13, 2.0**12])
    # One process with four devices, the same global batches: the same
    # decisions, and the same numbers up to the order of the sums.
    for key in ("skipped_steps", "iterations", "loss_scale"):
        assert first[key] == single[key], key
    rtol = {"mixed_float16": 2.0**-10, "mixed_bfloat16": 2.0**-7}[policy]
    np.testing.assert_allclose(first["history_loss"], single["history_loss"], rtol=rtol)
    for ours, reference in zip(_variables(first), _variables(single)):
        np.testing.assert_allclose(ours, reference, rtol=rtol, atol=rtol * 0.1)


def _flip_a_byte_of_the_weights(path):
    """Changes one byte of the weights file's data (its last kilobyte holds
    the variables' values, not HDF5's structure); returns the original."""
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[-512] ^= 1
    path.write_bytes(bytes(damaged))
    return original


def _epoch_in(metadata):
    return json.loads(metadata.read_text())["epoch"]


def _one_error(runs):
    """Waits for `runs`, which must all fail, none hang, and none train;
    returns their error (type and message), which must be the same on all."""
    codes = _wait(runs, expect_success=False)
    assert None not in codes and all(codes), (codes, _logs(runs))
    errors = [(dump / "error.txt").read_text() for _, dump, _ in runs]
    assert errors == [errors[0]] * len(errors), errors
    assert errors[0].endswith(
        "Every worker stops with this error: the workers train together, from one "
        "state, or not at all."), errors[0]
    for _, dump, _ in runs:
        assert not (dump / "fit-mixed_float16.npz").exists()
    return errors[0]


def _replace_with_another_models_weights(weights, metadata, scratch):
    """Writes another model's weights (one Dense layer: 2 variables) over
    the backup file `weights`, and records their checksum in `metadata`."""
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5)])
    other.save_weights(scratch)
    weights.write_bytes(scratch.read_bytes())
    entry = json.loads(metadata.read_text())
    entry["sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    metadata.write_text(json.dumps(entry))


def _assert_ends_as_uninterrupted(runs, uninterrupted, resumed_at):
    for index, (_, dump, _) in enumerate(runs):
        assert int(_load(dump, "restored.npz")["initial_epoch"]) == resumed_at
        final = _load(dump, "fit-mixed_float16.npz")
        reference = _load(uninterrupted[0][index], "fit-mixed_float16.npz")
        for key in ("digest", "iterations", "loss_scale", "skipped_steps"):
            assert final[key] == reference[key], (index, key)


def test_a_killed_run_resumes_from_one_shared_folder_as_if_uninterrupted(
    tmp_path, uninterrupted
):
    backup = tmp_path / "backup"
    # Both processes die at epoch 2's end (0-based 1), after its backup.
    kill = {0: ("--exit-after-backup", 1), 1: ("--exit-after-backup", 1)}
    runs = _start(tmp_path, "killed", "fit", args=("--backup", backup), per_process=kill)
    assert _wait(runs, expect_success=False) == [17, 17], _logs(runs)
    # Process 0 writes to the folder, process 1 to its own inside it, each
    # with its previous backup (epoch 1's) kept for the agreement.
    assert sorted(os.listdir(backup)) == [
        "backup-000000.weights.h5", "backup-000001.weights.h5",
        "kmp-backup.lock", "process-1", "training_metadata.json",
    ]
    assert _epoch_in(backup / "training_metadata.json") == 2
    assert _epoch_in(backup / "process-1" / "training_metadata.json") == 2

    # Process 1's latest backup is damaged: it cannot restore it, and both
    # stop at once (no process waits for the other in a collective) with the
    # same error, naming process 1, the backup and the cause.
    latest = backup / "process-1" / "backup-000001.weights.h5"
    original = _flip_a_byte_of_the_weights(latest)
    error = _one_error(_start(tmp_path, "damaged", "fit", args=("--backup", backup)))
    assert error.startswith(
        f"ValueError: process-1 could not restore backup 1 under {str(backup)!r}: "
        f"The backup file {str(latest)!r} is damaged: its SHA-256"), error
    latest.write_bytes(original)

    # Process 1's latest backup is another model's file, its checksum
    # recorded: the processes find that their files hold different variables
    # and stop with the same error before either loads (loading is a
    # collective: one process refusing a variable that the other places on
    # the devices would leave that one waiting).
    metadata = backup / "process-1" / "training_metadata.json"
    recorded = metadata.read_text()
    _replace_with_another_models_weights(latest, metadata, tmp_path / "other.weights.h5")
    error = _one_error(_start(tmp_path, "other-model", "fit", args=("--backup", backup)))
    assert error.startswith(
        f"ValueError: The workers' backup 1 under {str(backup)!r} does not hold the "
        "same variables on every worker"), error
    assert f"process-0: {str(backup / 'backup-000001.weights.h5')!r} holds" in error, error
    assert f"process-1: {str(latest)!r} holds 2 variables" in error, error
    assert "nothing was loaded" in error

    # Restarted with the file repaired, both resume at epoch 2 and end where
    # the uninterrupted run ends, bit for bit.
    latest.write_bytes(original)
    metadata.write_text(recorded)
    runs = _start(tmp_path, "resumed", "fit", args=("--backup", backup))
    _wait(runs)
    _assert_ends_as_uninterrupted(runs, uninterrupted, resumed_at=2)
    assert not backup.exists()


def test_a_folder_another_run_holds_stops_every_process_with_one_error(tmp_path):
    """Process 1's folder is locked by another run (this test's process):
    process 1 cannot take it, and both processes stop with the same error
    (no process waits for the other in a collective)."""
    from kmp.backup import _lock

    backup = tmp_path / "backup"
    (backup / "process-1").mkdir(parents=True)
    owner = object()
    lock = _lock.FolderLock.acquire(str(backup / "process-1"), owner=owner)
    try:
        error = _one_error(_start(tmp_path, "refused", "fit", args=("--backup", backup)))
    finally:
        lock.release(owner=owner)
    assert error.startswith(
        f"RuntimeError: process-1 could not lock its backup folder under {str(backup)!r}: "
        f"The backup folder {str(backup / 'process-1')!r} is in use by another training "
        f"run: process {os.getpid()} on "), error
    # Process 0 took its own folder, and let it go when it stopped.
    assert sorted(os.listdir(backup)) == ["process-1"]


def test_processes_an_epoch_apart_resume_the_backup_both_hold(tmp_path, uninterrupted):
    """A folder per process; at epoch 2's end process 0 commits its backup
    and dies, process 1 dies after writing its file, before committing it:
    process 0 holds epoch 2's backup and epoch 1's, process 1 epoch 1's
    (and an uncommitted file). Both resume epoch 1's."""
    backups = [tmp_path / "backup-0", tmp_path / "backup-1"]
    kill = {0: ("--backup", backups[0], "--exit-after-backup", 1),
            1: ("--backup", backups[1], "--exit-before-commit", 2)}
    runs = _start(tmp_path, "killed", "fit", per_process=kill)
    assert _wait(runs, expect_success=False) == [17, 17], _logs(runs)
    assert _epoch_in(backups[0] / "training_metadata.json") == 2
    assert _epoch_in(backups[1] / "process-1" / "training_metadata.json") == 1

    runs = _start(tmp_path, "resumed", "fit",
                  per_process={index: ("--backup", backup) for index, backup in enumerate(backups)})
    _wait(runs)
    _assert_ends_as_uninterrupted(runs, uninterrupted, resumed_at=1)
    for backup in backups:
        assert not backup.exists()


def test_model_parallel_keeps_the_layout_map_through_training_saving_and_convert(tmp_path):
    runs = _start(tmp_path, "model-parallel", "model_parallel", processes=1, devices=8)
    _wait(runs)
    result = json.loads((runs[0][1] / "model_parallel.json").read_text())
    asked = {"embedding/embeddings": [None, "model"], "hidden/kernel": [None, "model"],
             "logits/kernel": ["model", None]}
    for stage in ("trained", "loaded", "converted"):
        shardings = result[stage]
        for path, spec in asked.items():
            assert shardings[path] == [spec, False], (stage, path, shardings[path])
        for path, (spec, replicated) in shardings.items():
            name = path.split("/", 1)[1]
            kernel = next((k for k in asked if name.startswith(k.replace("/", "_"))), None)
            if kernel is not None:
                # Adam's momentum and velocity of a sharded kernel: as the kernel.
                assert [spec, replicated] == [asked[kernel], False], (stage, path)
            elif path not in asked:
                # Biases, the scaler's scale and counters, the iterations.
                assert replicated, (stage, path, spec)
        scaler = [p for p in shardings if p.split("/")[-1] in ("loss_scale", "counters")]
        assert len(scaler) == 2, (stage, scaler)
    assert result["optimizer"] == ["LossScaleOptimizer"] * 3
    saved, loaded = (np.asarray(p) for p in result["predictions_after_load"])
    assert np.isfinite(saved).all() and saved.shape == (64, 3)
    # The same float32 outputs, up to a float16 rounding: the file holds the weights.
    np.testing.assert_allclose(loaded, saved, rtol=2.0**-10, atol=2.0**-10 * np.abs(saved).max())
    assert result["loss_scale"] == [2.0**15] * 3
    # Sharded over (2, 4) devices or on one: the same losses, up to float16's
    # rounding of sums taken in another order.
    np.testing.assert_allclose(result["loss"], result["single_device_loss"], rtol=2.0**-9)


# -- the stateless jax.jit loop, in this process ------------------------------


def _stateless_loop(distribution, x, y, *, give_loss):
    """docs/jax.md's `jax.grad` loop over `x, y` in batches of 16, twice,
    under `distribution` (or none); returns the losses, the final weights,
    the optimizer and the last batch as the step received it."""
    import jax

    keras.distribution.set_distribution(distribution)
    try:
        keras.utils.set_random_seed(0)
        kmp.set_policy("mixed_float16")
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = kmp.Model(inputs, keras.layers.Dense(3)(hidden))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        optimizer.build(model.trainable_variables)

        def compute_loss(trainable, non_trainable, optimizer_variables, x, y):
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            loss = loss_fn(y, y_pred)
            return optimizer.stateless_scale_loss(optimizer_variables, loss), (loss, non_trainable)

        grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

        @jax.jit
        def train_step(state, x, y):
            trainable, non_trainable, optimizer_variables = state
            (_, (loss, non_trainable)), grads = grad_fn(
                trainable, non_trainable, optimizer_variables, x, y)
            trainable, optimizer_variables = optimizer.stateless_apply(
                optimizer_variables, grads, trainable, loss=loss if give_loss else None)
            return loss, (trainable, non_trainable, optimizer_variables)

        state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
        losses = []
        for _ in range(2):
            for start in range(0, len(x), 16):
                batch = (x[start:start + 16], y[start:start + 16])
                if distribution is not None:
                    batch = tuple(keras.distribution.distribute_tensor(
                        part, distribution.get_data_layout(part.shape)) for part in batch)
                loss, state = train_step(state, *batch)
                losses.append(float(loss))
        for variable, value in zip(optimizer.variables, state[2]):
            variable.assign(value)
        return losses, state[0], optimizer, batch[0]
    finally:
        keras.distribution.set_distribution(None)


def test_the_stateless_jit_loop_under_data_parallel_skips_as_on_one_device():
    import jax

    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py asks XLA for two host devices"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, 64)
    x[16 + 11] = 1e5  # past float16's range, in the second batch's second half

    losses, weights, optimizer, batch = _stateless_loop(
        keras.distribution.DataParallel(devices=devices), x, y, give_loss=True)
    single_losses, single_weights, single, _ = _stateless_loop(None, x, y, give_loss=True)
    # The batch was split over the two devices, the weights replicated.
    assert [shard.data.shape[0] for shard in batch.addressable_shards] == [8, 8]
    for value in weights:
        shards = [np.asarray(shard.data) for shard in value.addressable_shards]
        assert len(shards) == 2
        np.testing.assert_array_equal(shards[0], shards[1])
    # One skip per pass over the data, each counted as the forward overflow
    # it is, as on one device; the same losses and weights up to float16's
    # rounding of sums taken in another order.
    counters = {name: int(value) for name, value in optimizer.counters.items()}
    assert counters["skipped_steps"] == counters["forward_overflows"] == 2
    assert counters == {name: int(value) for name, value in single.counters.items()}
    assert float(optimizer.loss_scale) == float(single.loss_scale) == 2.0**13
    assert int(optimizer.iterations) == int(single.iterations) == 6
    assert not np.isfinite(losses[1]) and not np.isfinite(losses[5])
    finite = [i for i in range(8) if i not in (1, 5)]
    np.testing.assert_allclose(np.take(losses, finite), np.take(single_losses, finite),
                               rtol=2.0**-10)
    for ours, reference in zip(weights, single_weights):
        # atol: Adam's normalized steps move a weight near 0 by its full step
        # whatever the size of its gradient, so the difference there is absolute.
        np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), rtol=2.0**-9,
                                   atol=2.0**-9)
