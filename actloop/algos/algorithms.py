"""The one table of algorithms (`algo=...`): what each one computes and what it needs.

Config validation (`actloop.config.validate`), the update (`actloop.train.rl.update`), the trainer's
dispatch, `actloop compare` and the torchrun check (`actloop.train.runtime.distributed`) all read
`ALGORITHMS`; none of them branches on an algorithm's name. An online algorithm is an advantage
estimator (a key of `ADVANTAGE_ESTIMATORS`) fed to the policy loss (`train.policy_loss`); the
inputs the update builds for it are the estimator's declared `inputs` (rewards, token rewards,
critic values, turn ids, ...). Adding an estimator is one function plus one row in
`ADVANTAGE_ESTIMATORS`; exposing it as `algo=NAME` is one row here (docs/algorithms.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actloop.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator


@dataclass(frozen=True)
class Algorithm:
    """One row of ALGORITHMS.

    advantage       key of ADVANTAGE_ESTIMATORS (None: not an online RL algorithm)
    turn_advantage  the estimator used instead with train.turn_credit=true (None: turn credit is
                    refused for this algorithm)
    loss            "policy" (clipped policy-gradient loss, train.policy_loss), "preference"
                    (dpo.loss on pairs) or "supervised" (cross-entropy on assistant tokens)
    section         the config section of the algorithm's own options (None: train.* only)
    params          estimator keyword -> dotted config key it is read from; keywords the estimator
                    does not take are ignored, missing ones keep the function's default
    whiten          whiten the token advantages over the batch's valid tokens (PPO's usual
                    normalisation, `masked_whiten`)
    torchrun        the multi-process update reproduces one process exactly (per-group advantages)
    trainer         "online" (the rollout loop of actloop.train.rl.loop) or "module:function"
    online_key      a boolean config key that moves the algorithm into the rollout loop (its
                    `loss` then names the update the loop calls): `dpo.online`
    compare         `actloop compare` names -> the extra overrides that select each variant
    min_group       the smallest train.group_size it learns from in the rollout loop: 2 where a
                    trajectory is judged against the others of its prompt (a group of 1 is all
                    zero advantages, or no pair)
    stale_refusal   why the algorithm refuses rollout.max_staleness > 0 (asynchronous RL); "" = it
                    trains stale data with the decoupled loss (actloop.algos.offpolicy)
    doc             one line for `config show` and errors
    """

    advantage: str | None
    loss: str
    doc: str
    turn_advantage: str | None = None
    section: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    whiten: bool = False
    torchrun: bool = False
    trainer: str = "online"
    online_key: str | None = None
    compare: dict[str, tuple[str, ...]] | None = None
    min_group: int = 1
    stale_refusal: str = ""

    def estimator_key(self, turn_credit: bool = False) -> str | None:
        return self.turn_advantage if turn_credit and self.turn_advantage else self.advantage

    def estimator(self, turn_credit: bool = False) -> AdvantageEstimator | None:
        key = self.estimator_key(turn_credit)
        return ADVANTAGE_ESTIMATORS[key] if key is not None else None

    @property
    def online(self) -> bool:
        """Always trained by the rollout loop (an advantage estimator and the policy loss)."""
        return self.trainer == "online"

    def in_loop(self, cfg) -> bool:
        """Trained by the rollout loop under this config (cfg: actloop.config.Config)."""
        if self.online:
            return True
        if self.online_key is None:
            return False
        obj = cfg
        for part in self.online_key.split("."):
            obj = getattr(obj, part)
        return bool(obj)

    @property
    def needs_reference(self) -> bool:
        """A reference model whatever train.beta is (the preference loss is relative to it)."""
        return self.loss == "preference"

    @property
    def needs_critic(self) -> bool:
        est = self.estimator()
        return est is not None and est.needs_critic


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm("grpo", "policy", "group-relative advantages (GRPO; Dr. GRPO with train.adv_scale=none)",
                      turn_advantage="turn_grpo",
                      params={"scale": "train.adv_scale", "gamma": "train.turn_gamma"}, torchrun=True, min_group=2,
                      compare={"grpo": (), "dr_grpo": ("train.adv_scale=none", "train.loss_agg=constant")}),
    "rloo": Algorithm("rloo", "policy", "leave-one-out baseline (RLOO)", torchrun=True, min_group=2),
    "reinforce_pp": Algorithm("reinforce_pp", "policy", "batch-normalised outcome advantages (REINFORCE++)"),
    "reinforce_pp_token": Algorithm(
        "reinforce_pp_token", "policy",
        "per-token return-to-go whitened over the batch (REINFORCE++ with kl.mode=reward)",
        params={"gamma": "ppo.gamma"}),
    "ppo": Algorithm("gae", "policy", "GAE with a critic (PPO)", section="ppo",
                     params={"gamma": "ppo.gamma", "lam": "ppo.lam"}, whiten=True),
    "dpo": Algorithm(None, "preference", "preference pairs (DPO/IPO), offline or online", section="dpo",
                     trainer="actloop.train.offline.dpo:train_dpo", online_key="dpo.online", min_group=2,
                     stale_refusal="the preference loss has no behaviour/proximal split: pairs sampled by older "
                     "weights would be trained as the current policy's, with no importance weight",
                     compare={"dpo": ("dpo.online=true",), "dpo_offline": ("dpo.online=false",)}),
    "sft": Algorithm(None, "supervised", "supervised fine-tuning on assistant tokens", section="sft",
                     trainer="actloop.train.offline.sft:train_sft",
                     stale_refusal="it samples nothing: there is no rollout to run ahead of training"),
}


def online_algorithms() -> list[str]:
    return [name for name, a in ALGORITHMS.items() if a.online]


def compare_variants() -> dict[str, list[str]]:
    """`actloop compare` names -> the overrides that select each (one per algorithm unless the row
    lists variants)."""
    out: dict[str, list[str]] = {}
    for name, a in ALGORITHMS.items():
        for label, extra in (a.compare or {name: ()}).items():
            out[label] = [f"algo={name}", *extra]
    return out
