"""Rollout routing replay (R3) on the tiny GPT-OSS: the bf16 engine copy records each position's
experts; the fp32 trainer routes some tokens differently on its own (and its log-probs drift from
the engine's), and with replay it routes every recorded token as the engine did."""

import torch
from fixtures.tiny_models import GPT_OSS_SLIDING_WINDOW

from actloop.algos.kl import kl_k3
from actloop.models import load_models
from actloop.models.routing import moe_routers
from actloop.rollout.engine import HFEngine, SamplingParams
from actloop.train.numerics.logprobs import token_logprobs

W = GPT_OSS_SLIDING_WINDOW


def _episodes(tiny_gpt_oss_dir, precision="bf16", weights="copy"):
    models = load_models(tiny_gpt_oss_dir)
    model, tok = models.policy.eval(), models.tokenizer
    engine = HFEngine(model, tok, (tok.eos_token_id,), precision=precision, weights=weights)
    prompt = tok.apply_chat_template([{"role": "system", "content": "Use the calculator tool."},
                                      {"role": "user", "content": "What is 23 * 17?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    prompts = [ids, ids, ids[:-2] + ids[-2:], ids[:5] + ids]
    torch.manual_seed(0)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=3 * W, temperature=1.0))
    seqs = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
    masks = [[0] * len(p) + [1] * len(o.token_ids) for p, o in zip(prompts, outs)]
    return model, prompts, outs, seqs, masks


def test_engine_records_every_position(tiny_gpt_oss_dir):
    model, prompts, outs, _, _ = _episodes(tiny_gpt_oss_dir, precision="fp32", weights="live")
    k = model.config.num_experts_per_tok
    for p, o in zip(prompts, outs):
        assert o.routing.shape == (len(p) + len(o.token_ids) - 1, len(moe_routers(model)), k)
        assert (o.routing >= 0).all() and (o.routing < model.config.num_local_experts).all()
        assert (o.routing.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token and layer


def test_live_fp32_engine_routes_like_the_trainer(tiny_gpt_oss_dir):
    model, _, outs, seqs, masks = _episodes(tiny_gpt_oss_dir, precision="fp32", weights="live")
    with torch.no_grad():
        tl = token_logprobs(model, seqs, masks, precision="fp32", routing=[o.routing for o in outs])
    assert tl.routing_disagreement == tl.router_disagreement == 0.0


def _mismatch(model, outs, seqs, masks, replay):
    with torch.no_grad():
        tl = token_logprobs(model, seqs, masks, precision="fp32", routing=[o.routing for o in outs], replay=replay)
    eng = torch.cat([torch.tensor(o.logprobs) for o in outs])
    trn = torch.cat([tl.logp[i][tl.mask[i]] for i in range(len(outs))])
    return (tl.routing_disagreement, float(kl_k3(eng, trn).mean()), float((eng - trn).abs().max()),
            tl.router_disagreement)


def test_replay_removes_routing_disagreement_with_the_bf16_engine(tiny_gpt_oss_dir, capsys):
    model, _, outs, seqs, masks = _episodes(tiny_gpt_oss_dir)
    off = _mismatch(model, outs, seqs, masks, replay=False)
    on = _mismatch(model, outs, seqs, masks, replay=True)
    with capsys.disabled():
        print(f"\nrouting replay off: disagreement {off[0]:.4f} k3 {off[1]:.2e} max|dlogp| {off[2]:.3f}; "
              f"on: disagreement {on[0]:.4f} (own routers {on[3]:.4f}) k3 {on[1]:.2e} max|dlogp| {on[2]:.3f}")
    assert off[0] > 0  # bf16 vs fp32 flips some tokens' experts
    assert on[0] == 0.0  # the forward used the engine's experts for every recorded token
    assert off[3] == off[0]  # without replay the forward used the trainer's own choice
    assert on[1] < off[1] / 5  # and the log-prob mismatch shrinks
