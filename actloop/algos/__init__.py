"""Pure RL maths: advantages, policy/value/preference losses, KL control, rollout-mismatch
correction, reward shaping and batch helpers. No state, no models: tensors in, tensors out.

Everything selectable by config is looked up in one explicit table (formulas in
docs/algorithms.md):

    ADVANTAGE_ESTIMATORS  grpo, grpo_batch_std, dr_grpo, rloo, reinforce_pp, reinforce_pp_token, gae, turn_grpo
    ADVANTAGE_SCALES      group, batch, none            (grpo_advantages(scale=...))
    LOSS_AGGREGATIONS     seq_mean, token_mean, constant
    POLICY_LOSSES         ppo_clip, gspo
    KL_ESTIMATORS         k1, k2, k3
    KL_CONTROLLERS        fixed, adaptive
    DPO_LOSSES            sigmoid, ipo
    IS_CORRECTIONS        none, tis_token, tis_seq, mis_token, mis_seq

and the algorithms (`algo=...`) built from them, in `ALGORITHMS` (actloop.algos.algorithms):
each names its estimator, loss, config section and torchrun support.
"""

from actloop.algos.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_SCALES
from actloop.algos.algorithms import ALGORITHMS
from actloop.algos.correction import IS_CORRECTIONS
from actloop.algos.dpo import DPO_LOSSES
from actloop.algos.kl import KL_CONTROLLERS, KL_ESTIMATORS
from actloop.algos.losses import LOSS_AGGREGATIONS, POLICY_LOSSES

REGISTRIES = {
    "advantage": ADVANTAGE_ESTIMATORS,
    "advantage_scale": ADVANTAGE_SCALES,
    "loss_agg": LOSS_AGGREGATIONS,
    "policy_loss": POLICY_LOSSES,
    "kl_estimator": KL_ESTIMATORS,
    "kl_controller": KL_CONTROLLERS,
    "dpo_loss": DPO_LOSSES,
    "is_correction": IS_CORRECTIONS,
}

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ADVANTAGE_SCALES", "ALGORITHMS", "DPO_LOSSES", "IS_CORRECTIONS", "KL_CONTROLLERS",
    "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "POLICY_LOSSES", "REGISTRIES",
]
