"""One worker of the two-worker backup tests in `test_resume.py` (not a test file).

Run as `python multi_worker_backup_worker.py --backup DIR --dump DIR ...` with
`TF_CONFIG` set; it trains `multi_worker_worker.build_model()` on
`multi_worker_worker.dataset()` for `EPOCHS` epochs under
MultiWorkerMirroredStrategy with `kmp.callbacks.BackupAndRestore(DIR)`, and
writes the state it restored (`restored.npz`) and the state it ends with
(`final.npz`) to its dump directory. It can pause (write `--marker`, then
sleep) at a chosen batch or inside a chosen backup write, for the test to
send SIGKILL.
"""

import argparse
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

EPOCHS = 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backup", required=True)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--marker", default="")
    parser.add_argument("--pause-at-batch", default="")  # "epoch,batch", 0-based
    parser.add_argument("--pause-in-save", type=int, default=0)  # n-th backup
    args = parser.parse_args()

    import tensorflow as tf

    # Before anything else initializes TensorFlow's devices.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras
    import numpy as np

    import kmp
    from multi_worker_worker import build_model, dataset

    tf.config.experimental.enable_op_determinism()
    kmp.set_policy("mixed_float16")
    with strategy.scope():
        model = build_model()

    def dump(name):
        optimizer = model.optimizer
        np.savez(
            os.path.join(args.dump, name),
            *[np.asarray(v.numpy()) for v in model.weights],
            *[np.asarray(v.numpy()) for v in optimizer.variables],
            loss_scale=float(optimizer.loss_scale),
            skipped_steps=int(optimizer.skipped_steps),
            iterations=int(optimizer.iterations.numpy()),
            initial_epoch=int(getattr(model, "_initial_epoch", None) or 0),
        )

    def pause():
        with open(args.marker, "w") as f:
            f.write("paused")
        time.sleep(600)

    if args.pause_in_save:
        from keras.src.saving import saving_lib

        original_save_state = saving_lib._save_state
        saves = [0]

        def save_state(saveable, weights_store, assets_store, inner_path,
                       visited_saveables):
            if inner_path == "":
                saves[0] += 1
            if saves[0] == args.pause_in_save and "optimizer" in inner_path:
                # Layers written, optimizer not: the backup is half done.
                weights_store.h5_file.flush()
                pause()
            return original_save_state(
                saveable, weights_store, assets_store, inner_path, visited_saveables
            )

        saving_lib._save_state = save_state

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            dump("restored.npz")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if args.pause_at_batch == f"{self.epoch},{batch}":
                pause()

    backup = kmp.callbacks.BackupAndRestore(args.backup)
    model.fit(dataset(), epochs=EPOCHS, verbose=0, callbacks=[backup, Probe()])
    dump("final.npz")


if __name__ == "__main__":
    sys.exit(main())
