"""The offline tiny GPT-OSS / Qwen3 fixtures are what they claim: the right architectures, vocab
sizes that match their tokenizers, special tokens that are single ids, templates that render."""

import pytest
from fixtures.tiny_models import GPT_OSS_SLIDING_WINDOW, HARMONY_SPECIAL_TOKENS, QWEN3_ADDED_TOKENS

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "23 * 17"}}}


def _load(path):
    import torch
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path), torch


def test_tiny_gpt_oss(tiny_gpt_oss_dir):
    config, tok, _ = _load(tiny_gpt_oss_dir)
    assert config.architectures == ["GptOssForCausalLM"]
    assert (config.num_hidden_layers, config.num_local_experts, config.num_experts_per_tok) == (2, 4, 2)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.sliding_window == GPT_OSS_SLIDING_WINDOW
    assert config.vocab_size == len(tok)
    for t in HARMONY_SPECIAL_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert (tok.eos_token, tok.pad_token) == ("<|return|>", "<|endoftext|>")
    msgs = [{"role": "user", "content": "What is 23 * 17?"}, {"role": "assistant", "content": "", "thinking": "use it",
            "tool_calls": [CALL]}, {"role": "tool", "content": "391"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                   reasoning_effort="low")
    assert "Reasoning: low" in text and "type calculator = (_: {\nexpression: string,\n}) => any;" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>use it<|end|><|start|>assistant to=functions.calculator"
            '<|channel|>commentary json<|message|>{"expression": "23 * 17"}<|call|>') in text
    assert text.endswith('<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"391"<|end|>'
                         "<|start|>assistant")
    # a final answer later drops the tool turn's analysis from the re-rendered history
    done = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "391"}], tools=TOOLS, tokenize=False)
    assert "use it" not in done and done.endswith("<|channel|>final<|message|>391<|return|>")


def test_tiny_qwen3(tiny_qwen3_dir):
    config, tok, _ = _load(tiny_qwen3_dir)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.vocab_size == len(tok)
    for t in QWEN3_ADDED_TOKENS + ("<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    msgs = [{"role": "user", "content": "What is 23 * 17?"},
            {"role": "assistant", "content": "", "reasoning_content": "use it", "tool_calls": [CALL]},
            {"role": "tool", "content": "391"}, {"role": "assistant", "content": "391", "reasoning_content": "done"},
            {"role": "user", "content": "And 2 + 2?"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"23 * 17\"}}\n</tool_call>" in text
    assert "<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>" in text
    assert "use it" not in text and "done" not in text  # earlier reasoning dropped on re-render
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("which", ["tiny_gpt_oss_dir", "tiny_qwen3_dir"])
def test_actloop_loads_and_scores_the_tiny_models(which, request):
    """actloop's loader and the trainer's token scorer on each fixture (GPT-OSS: sinks, a sliding-window
    layer, experts): over three sliding windows of tokens, the log-probs the trainer computes (shared
    prompt prefix, chunked head) are the model's own softmax at the scored ids, and they vary (random
    weights, not flat ones)."""
    import torch

    from actloop.models import load_models
    from actloop.train.numerics.logprobs import token_logprobs

    model = load_models(request.getfixturevalue(which)).policy
    ids = [int(i) for i in torch.arange(3 * GPT_OSS_SLIDING_WINDOW) * 7 % model.config.vocab_size]
    mask = [0] * 4 + [1] * (len(ids) - 4)  # a 4-token prompt, then the scored completion
    with torch.no_grad():
        out = token_logprobs(model, [ids], [mask], 1.0, "fp32")
        logits = model(input_ids=torch.tensor([ids])).logits.float()[0, :-1]  # [S-1, V] predicts ids[1:]
    own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # [S-1]
    scored = out.logp[0][out.mask[0].bool()]  # the completion's tokens, in order
    assert len(scored) == sum(mask)
    assert torch.allclose(scored, own[3:], atol=1e-4), (scored - own[3:]).abs().max()
    assert scored.std() > 0.1
