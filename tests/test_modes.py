"""One fit, every mode alike: the differential harness (issue 47).

One scenario table, run eagerly (`run_eagerly=True`), as a graph
(`jit_compile=False`) and under XLA (`jit_compile=True`, also with
`steps_per_execution=2`), on TensorFlow and on JAX (the JAX pass runs this
file too), each run compared with a plain-Python reference of which batches
were applied, and how often, and the runs compared with each other.

The model makes every count exact: a linear `kmp.Model` under
mixed_float16, SGD(0.01), loss `mean(pred * y)`, whose input for batch `b`
is the one-hot `e_b`, so batch `b` owns kernel coordinate `b` and
`(1 - k_b) / (0.01 * t_b)` counts how often it was applied (`t_b`, its
target). The gradient at the scale `s` is `s * t_b` in float16: a target of
`3 * 2**j` overflows at `s = 2**(15 - j)` and not at half of it.

The guard's cases (issue 46) run the same model under the other policies:
a NaN target is a corrupt record (its loss and every gradient are NaN: a
step that applied it would make the whole kernel NaN), skipped under every
policy and never redone; a target far above the others is a loss spike,
skipped with `skip_spikes` (the loss of batch `b` is `k_b * t_b`).

A new case is one more row of `ROWS`.
"""

import collections
import csv
import dataclasses
import math
import os

import keras
import numpy as np
import pytest
from keras import ops

import kmp

BACKEND = keras.backend.backend()
FLOAT16_MAX = 65504.0
SETTLING_RETRIES = 32
LEARNING_RATE = 0.01
NAN = float("nan")
MODES = {
    "eager": dict(run_eagerly=True),
    "graph": dict(jit_compile=False),
    "xla": dict(jit_compile=True),
    "xla-spe2": dict(jit_compile=True, steps_per_execution=2),
}


# -- the reference ---------------------------------------------------------


def reference(epochs, retries="auto", scale=2.0**15, stop=None, loss_scaling=True,
              spikes=None):
    """Which batches a fit applies, in plain Python: the scaler's rule
    (backoff 0.5, hysteresis 1, min_scale 1, no growth within the run) and
    kmp's retries (`"auto"`: up to 32 until the first applied step, then
    none; an int: that many for every batch). A NaN target (a corrupt
    record: its loss is not finite) is skipped, never redone, and backs the
    scale off; a loss spike (`spikes`: the z-score threshold; OLMo-core's
    rule, window 128, none before 64 losses) is skipped. Without loss
    scaling the scale stays 1 and nothing overflows.

    Args:
        epochs: List of epochs, each a list of `(batch, target)`.
        stop: Optional `(epoch, index)`: the last batch that runs.
        loss_scaling: Whether the policy scales the loss (float16).
        spikes: Optional float: `compile(skip_spikes=...)`.

    Returns:
        A dict: `applied` (Counter of batch -> applications), `iterations`,
        `skipped`, `retried`, `scale`, `per_epoch` (the cumulative
        `(skipped, retried)` at each epoch's end) and `sequence` (the batches
        applied, in order).
    """
    applied, skipped, retried, settled = collections.Counter(), 0, 0, False
    per_epoch, sequence, losses = [], [], []
    scale = scale if loss_scaling else 1.0
    for e, batches in enumerate(epochs):
        for index, (batch, target) in enumerate(batches):
            budget = (0 if settled else SETTLING_RETRIES) if retries == "auto" else retries
            loss = target * (1.0 - LEARNING_RATE * target * applied[batch])
            spike = spikes is not None and _is_spike(losses, loss, spikes)
            if math.isfinite(loss):
                losses.append(loss)
            while True:
                if not math.isfinite(loss) or spike:  # skipped, never redone
                    skipped += 1
                    scale = max(scale / 2, 1.0) if loss_scaling and not spike else scale
                    break
                if not loss_scaling or scale * target <= FLOAT16_MAX:
                    applied[batch] += 1
                    sequence.append(batch)
                    settled = True
                    break
                if budget > 0 and scale > 1.0:
                    budget, retried, scale = budget - 1, retried + 1, scale / 2
                    continue
                skipped, scale = skipped + 1, max(scale / 2, 1.0)
                break
            if stop == (e, index):
                per_epoch.append((skipped, retried))
                break
        else:
            per_epoch.append((skipped, retried))
            continue
        break
    return dict(applied=applied, iterations=sum(applied.values()), skipped=skipped,
                retried=retried, scale=scale, per_epoch=per_epoch, sequence=sequence)


def _is_spike(losses, loss, threshold, window=128, warmup=64):
    """OLMo-core's z-score rule, in float64: `loss` more than `threshold`
    sample standard deviations above the mean of the last `window` finite
    losses, once `warmup` have been seen."""
    if len(losses) < warmup or not math.isfinite(loss):
        return False
    recent = np.asarray(losses[-window:], "float64")
    return bool(loss - recent.mean() > threshold * recent.std(ddof=1))


# -- one run ----------------------------------------------------------------


class ReturnsItsVariable(keras.metrics.Metric):
    """A metric whose `result()` returns its own variable (Keras allows it)."""

    def __init__(self, name="total", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(ops.cast(ops.sum(y_true), "float32"))

    def result(self):
        return self.total


def product_loss(y_true, y_pred):
    return ops.mean(y_pred * y_true)


def _build(batches, batch_norm=False, policy="mixed_float16"):
    keras.utils.set_random_seed(0)
    with kmp.policy_scope(policy):
        inputs = keras.Input((batches,))
        outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                                     name="owner")(inputs)
        if batch_norm:
            # Its moving mean moves once per applied step; the output does
            # not depend on it (times zero), so the counts stay exact.
            normalized = keras.layers.BatchNormalization(momentum=0.5, name="norm")(inputs)
            outputs = outputs + 0.0 * keras.ops.sum(normalized, axis=-1, keepdims=True)
        return kmp.Model(inputs, outputs)


def _data(order, targets, batch=4):
    """Rows for the batches in `order` (one epoch), `batch` rows each."""
    size = len(targets)
    x = np.concatenate([np.repeat(np.eye(size, dtype="float32")[[b]], batch, 0) for b in order])
    y = np.concatenate([np.full((batch, 1), targets[b], "float32") for b in order])
    return x, y


@dataclasses.dataclass
class Row:
    """One scenario: targets per batch, `overflow_retries`, epochs, what the
    fit is given, and the modes it runs in."""

    name: str
    targets: tuple
    retries: object = "auto"
    epochs: int = 1
    callbacks: object = None      # callable(model, record) -> list of callbacks
    stop_at: tuple = None         # (epoch, index) the reference stops after
    fit: dict = dataclasses.field(default_factory=dict)
    batch_norm: bool = False
    metric: bool = False
    modes: tuple = tuple(MODES)
    after: object = None          # callable(model, record), after the fit
    fast: bool = False
    backends: tuple = ("tensorflow", "jax")
    policy: str = "mixed_float16"
    compile: dict = dataclasses.field(default_factory=dict)  # more compile arguments


def _run(row, mode, tmp_path):
    targets = [float(t) for t in row.targets]
    model = _build(len(targets), row.batch_norm, row.policy)
    compile_kwargs = dict(MODES[mode], **row.compile)
    model.compile(keras.optimizers.SGD(LEARNING_RATE), product_loss,
                  metrics=["mae"] + ([ReturnsItsVariable()] if row.metric else []),
                  overflow_retries=row.retries, **compile_kwargs)
    record = {"tmp": tmp_path / mode}
    os.makedirs(record["tmp"], exist_ok=True)
    x, y = _data(range(len(targets)), targets)
    callbacks = row.callbacks(model, record) if row.callbacks else []
    fit = dict(batch_size=4, epochs=row.epochs, shuffle=False, verbose=0, callbacks=callbacks)
    fit.update(row.fit)
    if fit.pop("generator", False):
        def cycle():
            while True:
                for start in range(0, len(x), 4):
                    yield x[start:start + 4], y[start:start + 4]
        fit.pop("batch_size")
        history = model.fit(cycle(), steps_per_epoch=len(targets), **fit)
    else:
        try:
            history = model.fit(x, y, **fit)
        except KeyboardInterrupt:
            history = None
    record["history"] = None if history is None else history.history
    if row.after:
        row.after(model, record)
    counts = _counts(model, targets)
    optimizer = model.optimizer
    record.update(
        applied={b: n for b, n in counts.items() if n},
        iterations=int(np.asarray(optimizer.iterations)),
        skipped=int(np.asarray(optimizer.skipped_steps)),
        retried=int(np.asarray(optimizer.counters["retries"])),
        scale=float(np.asarray(optimizer.loss_scale)),
        model=model,
    )
    return record


def _counts(model, targets):
    """How often each batch was applied, read off the kernel: a NaN
    record's coordinate is 0 if it stayed 1 exactly (never applied), and
    a kernel a NaN step reached is NaN everywhere (`int` raises)."""
    kernel = np.asarray(model.get_layer("owner").kernel).astype("float64").ravel()
    return {b: (0 if kernel[b] == 1.0 else -1) if math.isnan(t)
            else int(round((1.0 - kernel[b]) / (LEARNING_RATE * t)))
            for b, t in enumerate(targets)}


def _expected(row, stop=None):
    epochs = [list(enumerate(row.targets))] * row.epochs
    return reference(epochs, row.retries, stop=stop or row.stop_at,
                     loss_scaling=row.policy == "mixed_float16",
                     spikes=row.compile.get("skip_spikes"))


# -- the table ----------------------------------------------------------------


def _at_batch(index, action):
    class At(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == index:
                action(self.model)
    return At()


def _evaluate_at(index):
    def callbacks(model, record):
        x, y = _data(range(4), [1.0] * 4)

        def evaluate(model):
            record["evaluated"] = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
        return [_at_batch(index, evaluate)]
    return callbacks


def _check_evaluated(model, record):
    assert set(record["evaluated"]) == {"loss", "mae"}, record["evaluated"]


def _stop_at(index):
    def callbacks(model, record):
        def stop(model):
            model.stop_training = True
        return [_at_batch(index, stop)]
    return callbacks


def _interrupt_at(index):
    def callbacks(model, record):
        def interrupt(model):
            raise KeyboardInterrupt
        return [_at_batch(index, interrupt)]
    return callbacks


def _evaluate_after_interrupt(model, record):
    x, y = _data(range(4), [1.0] * 4)
    iterations = int(np.asarray(model.optimizer.iterations))
    logs = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    assert set(logs) == {"loss", "mae"}
    assert int(np.asarray(model.optimizer.iterations)) == iterations  # evaluate trains nothing
    record["evaluated"] = logs


def _checkpoint_every(freq):
    def callbacks(model, record):
        path = str(record["tmp"] / "checkpoint.weights.h5")
        record["checkpoint"], record["checkpoint_freq"] = path, freq
        return [keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=freq)]
    return callbacks


def _monitor(model, record):
    path = record["tmp"] / "steps.csv"
    record["csv"] = path
    return [kmp.callbacks.LossScaleMonitor(csv_path=path, verbose=0)]


def _early_stopping(model, record):
    return [keras.callbacks.EarlyStopping("loss", patience=0, min_delta=1e9)]


class _SetTheLearningRateBack(keras.callbacks.Callback):
    """keras.io's scheduler callback for an epoch its schedule does not list:
    the rate set back through the scaler (tracked in its list too, once)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.model.optimizer.learning_rate = self.model.optimizer.learning_rate


def _learning_rate_set_back(model, record):
    return [_SetTheLearningRateBack()]


ROWS = [
    Row("no overflow", (1, 1, 1, 1)),
    Row("first batch overflows", (3, 1, 1, 1), fast=True),
    Row("middle overflows after settling", (1, 1, 3, 1)),
    Row("middle, with 2 retries", (1, 1, 3, 1), retries=2, fast=True),
    Row("middle, without retries", (1, 1, 3, 1), retries=0),
    Row("last batch overflows", (1, 1, 1, 3), retries=2),
    Row("consecutive", (1, 3, 6, 1), retries=2),
    Row("alternating", (3, 1, 6, 1, 12, 1), retries=3, epochs=2),
    Row("first batch deep", (48, 1, 1, 1), epochs=2),
    Row("evaluate in a callback at an overflowing batch", (1, 3, 1, 1), retries=2,
        callbacks=_evaluate_at(1), after=_check_evaluated, modes=("eager", "graph", "xla")),
    Row("stop_training at an overflowing batch", (1, 3, 1, 1), retries=2,
        callbacks=_stop_at(1), stop_at=(0, 1), modes=("eager", "graph", "xla")),
    Row("interrupt at an overflowing batch, then evaluate", (1, 3, 1, 1), retries=2,
        callbacks=_interrupt_at(1), stop_at=(0, 1), after=_evaluate_after_interrupt,
        modes=("eager", "graph", "xla"), fast=True),
    Row("a checkpoint mid-epoch holds every batch before it", (1, 1, 3, 1), retries=2,
        callbacks=_checkpoint_every(3), modes=("eager", "graph", "xla")),
    Row("the monitor writes a row per batch", (1, 3, 1, 3), retries=2, callbacks=_monitor),
    Row("EarlyStopping", (3, 1, 1, 1), epochs=3, callbacks=_early_stopping, stop_at=(1, 3)),
    Row("validation data", (1, 3, 1, 1), retries=2,
        fit=dict(validation_data=_data(range(4), [1.0] * 4))),
    Row("a generator repeated, steps_per_epoch", (1, 3, 1, 1), retries=2, epochs=2,
        fit=dict(generator=True)),
    Row("batch normalization", (1, 3, 1, 6), retries=2, batch_norm=True),
    # Keras' own JAX trainer refuses such a metric (a variable handed to
    # jax.jit's abstractification): TensorFlow only, where Keras trains it.
    Row("a metric returning its variable", (1, 3, 1, 1), retries=2, metric=True,
        backends=("tensorflow",)),
    # The guard (issue 46): a corrupt record and a loss spike, every policy.
    Row("a NaN record under mixed_float16", (1, NAN, 1, 1), retries=2),
    Row("a NaN record first under mixed_float16", (NAN, 12, 1, 1)),
    Row("a NaN record under mixed_bfloat16", (1, NAN, 1, NAN), policy="mixed_bfloat16",
        epochs=2),
    Row("a NaN record under bfloat16 weights", (NAN, 1, 1, 1), policy="bfloat16"),
    Row("a NaN record under float32 with skip_nonfinite", (1, 1, 1, NAN), policy="float32",
        compile=dict(skip_nonfinite=True)),
    Row("the monitor, a NaN record under mixed_bfloat16", (1, NAN, 1, NAN),
        policy="mixed_bfloat16", callbacks=_monitor),
    Row("batch normalization, a NaN record under mixed_bfloat16", (1, NAN, 1, 1),
        policy="mixed_bfloat16", batch_norm=True),
    Row("a checkpoint mid-epoch after a NaN record", (1, NAN, 1, 1),
        policy="mixed_bfloat16", callbacks=_checkpoint_every(3), modes=("eager", "graph", "xla")),
    Row("interrupt at a NaN record, then evaluate", (1, NAN, 1, 1), policy="mixed_bfloat16",
        callbacks=_interrupt_at(1), stop_at=(0, 1), after=_evaluate_after_interrupt,
        modes=("eager", "graph", "xla")),
    Row("a metric returning its variable, a NaN record", (1, NAN, 1, 1),
        policy="mixed_bfloat16", metric=True, backends=("tensorflow",)),
    # 70 losses of 1, then one 10**4 times higher: past the warmup of 64,
    # a spike; the same batch without skip_spikes is applied.
    Row("a loss spike with skip_spikes", (1,) * 70 + (1e4, 1), policy="mixed_bfloat16",
        compile=dict(skip_spikes=6.0)),
    Row("a loss spike without skip_spikes", (1,) * 70 + (1e4, 1), policy="mixed_bfloat16"),
    Row("the learning rate set back through the scaler each epoch", (1, 3, 1, 1), retries=2,
        epochs=2, callbacks=_learning_rate_set_back),
]


def _rows(fast):
    return [pytest.param(row, id=row.name.replace(" ", "_").replace(",", ""))
            for row in ROWS if row.fast == fast and BACKEND in row.backends]


def _check_row(row, tmp_path):
    expected = _expected(row)
    runs = {}
    for mode in row.modes:
        got = _run(row, mode, tmp_path)
        for key in ("applied", "iterations", "skipped", "retried", "scale"):
            want = dict(expected["applied"]) if key == "applied" else expected[key]
            assert got[key] == want, (row.name, mode, key, got[key], want)
        runs[mode] = got
    first = runs[row.modes[0]]
    for mode, got in runs.items():
        # History and compiled metrics: finite (they describe the applied
        # steps) and the same in every mode.
        if first["history"] is not None:
            assert all(np.isfinite(v).all() for v in got["history"].values()), got["history"]
            assert set(got["history"]) == set(first["history"]), (mode, got["history"])
            for key, values in first["history"].items():
                np.testing.assert_allclose(got["history"][key], values, rtol=2e-3, atol=1e-6,
                                           err_msg=f"{row.name}: {mode} {key}")
            # Each epoch's cumulative skips and retries, as the reference.
            skipped = [int(v) for v in got["history"]["skipped_steps"]]
            assert skipped == [s for s, _ in expected["per_epoch"]][:len(skipped)], (mode, skipped)
        if "evaluated" in got:
            for key, value in first["evaluated"].items():
                np.testing.assert_allclose(got["evaluated"][key], value, rtol=2e-3)
        if "checkpoint" in got:
            _check_checkpoint(row, got)
        if "csv" in got:
            _check_monitor_rows(row, got, expected, MODES[mode].get("steps_per_execution", 1))
        if row.batch_norm:
            _check_batch_norm(row, got, expected)
    return runs


def _check_checkpoint(row, got):
    """The weights saved every `freq` batches (the last save, one epoch
    of fewer than `2 * freq` batches) hold what the reference applied up to
    that batch: a batch that overflowed there was redone before the save."""
    freq = got["checkpoint_freq"]
    model = _build(len(row.targets), policy=row.policy)
    model.load_weights(got["checkpoint"])
    saved = {b: n for b, n in _counts(model, [float(t) for t in row.targets]).items() if n}
    assert saved == dict(_expected(row, stop=(0, freq - 1))["applied"]), saved


def _check_monitor_rows(row, got, expected, steps_per_execution):
    with open(got["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    # One row per batch, the last too (per execution of several steps).
    executions = -(-len(row.targets) // steps_per_execution)
    assert len(rows) == executions * row.epochs
    skipped = sum(int(r["skipped"]) for r in rows)
    assert skipped == expected["skipped"]


def _check_batch_norm(row, got, expected):
    """The moving mean moved once per applied step (momentum 0.5 towards
    the batch's mean, `e_b`), in the applied order: a skipped or redone
    attempt's move is put back."""
    moving = np.zeros(len(row.targets))
    for batch in expected["sequence"]:
        moving = 0.5 * moving + 0.5 * np.eye(len(row.targets))[batch]
    norm = got["model"].get_layer("norm")
    np.testing.assert_allclose(np.asarray(norm.moving_mean), moving, atol=2e-3)


@pytest.mark.parametrize("row", _rows(fast=True))
def test_every_mode_applies_what_the_reference_applies(row, tmp_path):
    _check_row(row, tmp_path)


@pytest.mark.parametrize("row", _rows(fast=False))
def test_every_mode_applies_what_the_reference_applies_in_the_whole_table(row, tmp_path):
    _check_row(row, tmp_path)


def test_the_reference_counts_by_hand():
    # Batch 2 overflows after settling: "auto" skips it, 2 retries redo it.
    assert reference([list(enumerate((1, 1, 3, 1)))])["skipped"] == 1
    redone = reference([list(enumerate((1, 1, 3, 1)))], retries=2)
    assert (redone["skipped"], redone["retried"], redone["iterations"]) == (0, 1, 4)
    # The first batch settles the scale: 48 = 3 * 2**4 overflows down to 2**10.
    settling = reference([list(enumerate((48, 1)))])
    assert (settling["retried"], settling["scale"], settling["iterations"]) == (5, 2.0**10, 2)
    # A NaN record is skipped, not redone, and backs the scale off (float16)
    # or leaves it at 1 (no loss scaling).
    corrupt = reference([list(enumerate((1, NAN, 1)))], retries=2)
    assert (corrupt["skipped"], corrupt["retried"], corrupt["scale"]) == (1, 0, 2.0**14)
    assert dict(corrupt["applied"]) == {0: 1, 2: 1}
    assert reference([list(enumerate((NAN, 1)))], loss_scaling=False)["scale"] == 1.0
    # A spike counts only after 64 losses: the 65th batch of 10 is one.
    losses = [(b, 1.0) for b in range(64)]
    assert reference([losses + [(64, 10.0)]], loss_scaling=False, spikes=6.0)["skipped"] == 1
    assert reference([losses[:63] + [(64, 10.0)]], loss_scaling=False, spikes=6.0)["skipped"] == 0
