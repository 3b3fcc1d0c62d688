"""train.attn_implementation is checked before loading: a clear error instead of a transformers trace."""

import pytest
import torch

from actloop.models.resolve import ModelError, check_attn_implementation


def test_builtin_kernels_pass():
    assert check_attn_implementation("sdpa") == "sdpa"
    assert check_attn_implementation("eager") == "eager"


def test_unknown_name_lists_the_choices():
    with pytest.raises(ModelError, match="flash_attention_2"):
        check_attn_implementation("flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_needs_cuda(name):
    with pytest.raises(ModelError, match="CUDA"):
        check_attn_implementation(name)
