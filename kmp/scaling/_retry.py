"""Overflow retries: the one design, on the host, for every mode and backend.

A batch whose gradients overflowed while its loss was finite can be redone
at the lower scale the step has already backed off to. kmp.Model's train
functions (`kmp/backends/<backend>/trainer.py`) run each batch through
`Retries.run`, the same way eagerly, as a graph and under XLA, on TensorFlow
and on JAX:

```
budget = retries this batch may take        # on the host, no device read
logs = step(batch, retries_left=budget)     # one attempt: forward, backward,
                                            # check, apply or skip, scale
if budget:                                  # only then is a flag read
    while logs[RETRY_LOG]:                  # the step backed the scale off
        logs = step(batch, retries_left=budget - attempt)
```

A step asked to retry applies nothing, counts no skip and puts back its
metrics and what its forward pass wrote (`kmp.scaling._rule.next_state`,
the backends' steps); the batch's last attempt is its one step. Nothing is
left pending between calls: `evaluate`, `predict`, a callback, an interrupt
or a backup see every batch before them as the step left it.

The budget (`compile(overflow_retries=...)`):

- `"auto"`, with the dynamic scaler kmp made: until the scaler's first
  applied step, `SETTLING_RETRIES` (the scale finds its level on the first
  batch, so no batch is lost while it settles), then 0: a later overflow
  is skipped, as every peer skips it (about one batch per `growth_interval`
  steps), and the host never waits for a step;
- an int `n`: `n` for every batch, each step's flag read on the host (the
  host waits for every step: the cost of asking);
- otherwise none (`Retries` is not made).
"""

from keras import ops

# The step's logs that tell the train function about its attempt; taken
# out before any callback sees the logs.
RETRY_LOG = "_kmp_retry"
APPLIED_LOG = "_kmp_applied"
ATTEMPT_LOGS = (RETRY_LOG, APPLIED_LOG)

# `overflow_retries="auto"` until the first applied step: from the default
# 2**15 to `min_scale` 1 is 15 halvings, from kmp's `max_scale` 2**24 it is
# 24.
SETTLING_RETRIES = 32


def attempt_logs(retry, applied):
    """The logs a step adds for the train function: whether to redo the
    batch (`None`: never) and whether it was applied."""
    return {
        RETRY_LOG: ops.convert_to_tensor(False) if retry is None else ops.cast(retry, "bool"),
        APPLIED_LOG: ops.cast(applied, "bool"),
    }


def without_attempt_logs(logs):
    """`logs` without the attempt's logs (a new dict; `logs` as it is if it
    holds none)."""
    if not isinstance(logs, dict) or not any(key in logs for key in ATTEMPT_LOGS):
        return logs
    return {key: value for key, value in logs.items() if key not in ATTEMPT_LOGS}


class Retries:
    """How many times a batch may be redone, and the loop that redoes it.

    Args:
        asked: `"auto"` or an int >= 0: `compile(overflow_retries=...)`.
        settled: Bool. Whether the scaler has applied a step already (read
            once, when the train function is made).
    """

    def __init__(self, asked, settled):
        self._asked, self.settled = asked, bool(settled)

    def budget(self):
        """The retries the next batch may take: an int, known on the host."""
        if self._asked == "auto":
            return 0 if self.settled else SETTLING_RETRIES
        return int(self._asked)

    def run(self, first, again):
        """Runs one batch: `first(budget)`, then `again(retries_left)` while
        its logs ask for the batch again.

        Args:
            first: Callable of the retries left: the batch's first attempt
                (it takes the batch from the iterator); returns its logs.
            again: Callable of the retries left: the same batch again.

        Returns:
            The last attempt's logs, without the attempt's own.
        """
        budget = self.budget()
        logs = first(budget)
        if budget:
            left = budget
            while bool(ops.convert_to_numpy(logs[RETRY_LOG])) and left > 0:
                left -= 1
                logs = again(left)
            if not self.settled:
                self.settled = bool(ops.convert_to_numpy(logs[APPLIED_LOG]))
        return without_attempt_logs(logs)
