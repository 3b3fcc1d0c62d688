"""train.attn_implementation is checked before loading: a clear error instead of a transformers trace,
and a model with attention sinks (GPT-OSS) never gets a kernel that silently drops them."""

import pytest
import torch
from transformers import GptOssConfig, LlamaConfig

from actloop.models.attention import SINK_KERNEL, AttentionError, choose_attn_implementation
from actloop.models.resolve import ModelError, check_attn_implementation

SINKS = GptOssConfig(num_hidden_layers=2)
PLAIN = LlamaConfig(num_hidden_layers=2)


def test_builtin_kernels_pass():
    assert check_attn_implementation("sdpa") == "sdpa"
    assert check_attn_implementation("eager") == "eager"
    assert check_attn_implementation("sdpa", PLAIN) == "sdpa"


def test_unknown_name_lists_the_choices():
    with pytest.raises(ModelError, match="flash_attention_2"):
        check_attn_implementation("flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_needs_cuda(name):
    with pytest.raises(ModelError, match="CUDA"):
        check_attn_implementation(name)


def test_auto_picks_sdpa_without_sinks_and_eager_for_sinks_on_cpu():
    assert choose_attn_implementation("auto", PLAIN, cuda=False) == "actloop_sdpa"  # sdpa + a small-scores path
    assert choose_attn_implementation("auto", PLAIN, cuda=True) == "sdpa"
    assert choose_attn_implementation("auto", SINKS, cuda=False) == "eager"
    assert choose_attn_implementation("eager", SINKS, cuda=False) == "eager"


@pytest.mark.parametrize("name", ["sdpa", "actloop_sdpa", "flash_attention_2", "flash_attention_3"])
@pytest.mark.parametrize("cuda", [False, True])
def test_kernels_without_sinks_are_refused_for_sink_models(name, cuda):
    with pytest.raises(AttentionError, match=r"sinks.*eager") as e:
        choose_attn_implementation(name, SINKS, cuda=cuda)
    assert "gpt_oss" in str(e.value) and "auto" in str(e.value)


def test_flex_attention_refuses_sinks_on_cpu_only():
    with pytest.raises(AttentionError, match="flex_attention cannot apply gpt_oss's attention sinks on CPU"):
        choose_attn_implementation("flex_attention", SINKS, cuda=False)
    assert choose_attn_implementation("flex_attention", SINKS, cuda=True) == "flex_attention"


def test_sink_kernel_needs_cuda_and_the_kernels_package(monkeypatch):
    import actloop.models.attention as attention

    with pytest.raises(AttentionError, match="CUDA"):
        choose_attn_implementation(SINK_KERNEL, SINKS, cuda=False)
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AttentionError, match="pip install kernels"):
        choose_attn_implementation(SINK_KERNEL, SINKS, cuda=True)
    assert choose_attn_implementation("auto", SINKS, cuda=True) == "eager"  # CUDA without `kernels`
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    assert choose_attn_implementation("auto", SINKS, cuda=True) == SINK_KERNEL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hub FA3 sink kernel needs a CUDA GPU (none here)")
def test_sink_kernel_matches_eager_on_cuda(tiny_gpt_oss_dir):
    pytest.importorskip("kernels", reason="the sink kernel is loaded through the `kernels` package")
    from transformers import AutoModelForCausalLM

    ids = torch.arange(40, device="cuda")[None] % 600
    out = {}
    for attn in ("eager", SINK_KERNEL):
        model = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss_dir, dtype=torch.bfloat16, attn_implementation=attn)
        out[attn] = model.cuda()(input_ids=ids).logits.float()
    assert (out["eager"] - out[SINK_KERNEL]).abs().max() < 5e-2


def test_gpt_oss_dir_loads_with_the_default(tiny_gpt_oss_dir):
    """Before: `model=` a gpt-oss directory crashed because sdpa was asked for."""
    from actloop.models import load_models

    models = load_models(tiny_gpt_oss_dir)
    assert models.policy.config._attn_implementation == "eager"
    with pytest.raises(ModelError, match="has no attention sinks"):
        load_models(tiny_gpt_oss_dir, attn_implementation="sdpa")
