"""Loading GPT-OSS for training: MXFP4 checkpoints are dequantized, LoRA targets are the ones
the model has (attention projections; the fused experts are parameters, not Linear modules)."""

import os

import pytest
import torch
from transformers import GptOssConfig

from actloop.config import LoraConfig
from actloop.models import ModelError, load_models
from actloop.models.resolve import is_mxfp4, lora_target_modules, quantization_kwargs


def test_mxfp4_checkpoints_are_dequantized_on_load():
    config = GptOssConfig(num_hidden_layers=2)
    assert not is_mxfp4(config) and quantization_kwargs(config) == {}
    # what the published gpt-oss config.json holds
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    assert is_mxfp4(config)
    q = quantization_kwargs(config)["quantization_config"]
    assert type(q).__name__ == "Mxfp4Config" and q.dequantize is True


def test_lora_targets_the_attention_of_gpt_oss(tiny_gpt_oss_dir):
    with pytest.warns(UserWarning, match=r"\['gate_proj', 'up_proj', 'down_proj'\] do not exist"):
        models = load_models(tiny_gpt_oss_dir, lora=LoraConfig(enabled=True, r=4, alpha=8))
    adapted = {n.split(".lora_A")[0].split(".")[-1] for n, _ in models.policy.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ModelError, match="match no module.*o_proj"):
        lora_target_modules(load_models(tiny_gpt_oss_dir).policy, ["gate_proj", "up_proj"])


def test_lora_engine_copy_of_gpt_oss_samples_the_adapted_weights(tiny_gpt_oss_dir):
    """The engine's merged copy (W + BA) of a LoRA GPT-OSS equals the adapted policy."""
    import warnings

    from actloop.rollout.engine import HFEngine, SamplingParams
    from actloop.train.numerics.logprobs import token_logprobs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = load_models(tiny_gpt_oss_dir, lora=LoraConfig(enabled=True, r=4, alpha=8))
    policy, tok = models.policy, models.tokenizer
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # B = 0 at init would make the adapter a no-op
    engine = HFEngine(policy, tok, (tok.eos_token_id,), precision="fp32", weights="copy")
    engine.sync_weights(policy)
    ids = tok.encode("What is 23 * 17? Use the calculator tool please.", add_special_tokens=False)
    torch.manual_seed(0)
    out = engine.generate([ids], SamplingParams(max_new_tokens=12))[0]
    with torch.no_grad():
        tl = token_logprobs(policy.eval(), [ids + list(out.token_ids)], [[0] * len(ids) + [1] * len(out.token_ids)],
                            precision="fp32", routing=[out.routing])
    assert (tl.logp[0][tl.mask[0]] - torch.tensor(out.logprobs)).abs().max() < 1e-3
    assert tl.routing_disagreement == 0.0


@pytest.mark.skipif(not os.environ.get("ACTLOOP_GPT_OSS_DIR"),
                    reason="set ACTLOOP_GPT_OSS_DIR to a downloaded openai/gpt-oss-20b (MXFP4, ~13 GB; needs ~84 GB RAM)")
def test_real_gpt_oss_checkpoint_loads_dequantized():
    models = load_models(os.environ["ACTLOOP_GPT_OSS_DIR"])
    experts = models.policy.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and not hasattr(models.policy.config, "quantization_config")
    assert models.policy.config._attn_implementation in ("eager", "kernels-community/vllm-flash-attn3")


FP4_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _mxfp4_checkpoint(src: str, out):
    """The tiny GPT-OSS with its experts stored as the published checkpoints store them: MXFP4
    blocks (two e2m1 values per byte, 32 values per block) and one power-of-two scale per block."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    sd = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    expect = {}
    lut = torch.tensor(FP4_E2M1)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = sd.pop(k).shape  # stored [E, out, in / 32, 16] bytes, [E, out, in / 32] scales
        blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(126, 129, (E, n_out, n_in // 32), dtype=torch.uint8, generator=g)  # 2^-1 .. 2^1
        sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
        vals = torch.stack([lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]], -1).flatten(-2)  # [E, out, in/32, 32]
        expect[k] = (vals * torch.exp2(scales.float() - 127)[..., None]).flatten(-2).transpose(1, 2)  # [E, in, out]
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return expect


def test_an_mxfp4_checkpoint_loads_dequantized_and_trains(tiny_gpt_oss_dir, tmp_path):
    expect = _mxfp4_checkpoint(tiny_gpt_oss_dir, tmp_path / "mxfp4")
    models = load_models(str(tmp_path / "mxfp4"))
    policy = models.policy
    assert not hasattr(policy.config, "quantization_config") and getattr(policy, "hf_quantizer", None) is None
    for name, want in expect.items():
        got = policy.get_parameter(name)
        assert got.dtype == torch.float32 and got.requires_grad
        assert torch.equal(got.detach(), want), name  # e2m1 x power-of-two scales: exact in bf16 and fp32
    policy(input_ids=torch.arange(12)[None]).logits.float().logsumexp(-1).sum().backward()
    assert policy.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0
