import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("ACTLOOP_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded model, dequantized into the cache (25 s the first time)."""
    from actloop.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from actloop.models import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def fp32_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# tiny random GPT-OSS / Qwen3 checkpoints (tests/fixtures/tiny_models.py), built once per session
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixtures.tiny_models import tiny_gpt_oss_dir, tiny_qwen3_dir  # noqa: E402,F401  (session fixtures)
