"""Mixed precision on two workers with tf.distribute.MultiWorkerMirroredStrategy.

Run it as is: it starts two worker processes on this machine (loopback
addresses in `TF_CONFIG`), each trains the same `kmp.Model` on its half of
every global batch, and both print the same weights checksum, loss scale and
skipped steps:

    python examples/multi_worker.py
    python examples/multi_worker.py --workers 3 --epochs 2

On several machines, start the same script on each with `TF_CONFIG` set
(real addresses, the same cluster everywhere, its own index on each); with
`TF_CONFIG` set the script runs as that one worker:

    TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:12345", "10.0.0.2:12345"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/multi_worker.py

See "Scaling out" in the README.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = 64


def train(epochs, steps_per_epoch):
    """Runs this process as one worker of the cluster in `TF_CONFIG`."""
    import tensorflow as tf

    # First, before anything else sets up TensorFlow's devices.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    import keras
    import numpy as np

    import kmp

    kmp.set_policy("mixed_float16")
    rng = np.random.default_rng(0)  # the same data on every worker ...
    x = rng.normal(size=(GLOBAL_BATCH * steps_per_epoch, 16)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32")
    # ... of which each worker reads its own part of every global batch.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

    with strategy.scope():
        keras.utils.set_random_seed(1)  # the same initial weights everywhere
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        outputs = keras.layers.Dense(2, activation="softmax")(hidden)
        model = kmp.Model(inputs, outputs)
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    history = model.fit(dataset, epochs=epochs, verbose=0)

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    checksum = sum(float(np.sum(w)) for w in model.get_weights())
    # One write per line: the workers share the launcher's stdout, and print()
    # writes the text and its newline separately, so two lines could merge.
    sys.stdout.write(
        f"worker {task['index']}: loss {history.history['loss'][-1]:.4f}, "
        f"accuracy {history.history['accuracy'][-1]:.3f}, "
        f"loss scale {float(model.optimizer.loss_scale):g}, "
        f"skipped steps {int(model.optimizer.skipped_steps)}, "
        f"weights checksum {checksum:.6f}\n"
    )
    sys.stdout.flush()


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(workers, epochs, steps_per_epoch, timeout_s):
    """Starts `workers` copies of this script on loopback; returns 0 if all trained."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(workers)]}
    script_dir = os.path.dirname(os.path.abspath(__file__))
    python_path = os.pathsep.join(
        p for p in (os.path.dirname(script_dir), os.environ.get("PYTHONPATH")) if p
    )
    processes = []
    for index in range(workers):
        env = dict(
            os.environ,
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
            PYTHONPATH=python_path,
            # Each worker is one CPU replica here; on a GPU machine give each
            # worker its own GPU instead, e.g. CUDA_VISIBLE_DEVICES=str(index).
            CUDA_VISIBLE_DEVICES="",
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--epochs", str(epochs),
                 "--steps-per-epoch", str(steps_per_epoch)],
                env=env,
            )
        )
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"The workers did not finish within {timeout_s} s.", file=sys.stderr)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return 0 if all(p.returncode == 0 for p in processes) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes to start on this machine (default 2)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds before the workers are stopped (default 300)")
    args = parser.parse_args(argv)
    if "TF_CONFIG" in os.environ:
        train(args.epochs, args.steps_per_epoch)
        return 0
    return launch(args.workers, args.epochs, args.steps_per_epoch, args.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
