"""Loss scaling: the rule, the step both backends build from it, the hand-off.

The public side is `kmp/loss_scale.py` (`update_loss_scale`,
`LossScaleOptimizer`) and `kmp/model.py` (`kmp.Model`'s train step); each
backend's `step` and `trainer` (`kmp/backends/<backend>/`) run what is here:

- `_rule.py`: the scaling rule and the next state, as pure functions.
- `_step.py`: the parts of one loss-scaled step both backends share.
- `_gradients.py`: finite checks and unscaling of gradients.
- `_handoff.py`: what a train step tells its loss scaler, what it answers.
- `_settings.py`: the scaler's constructor arguments, each checked.
- `_model_step.py`: `kmp.Model`'s train step, what both backends share.
- `_optimizers.py`: the optimizers a model trains with, and their counters.
"""
