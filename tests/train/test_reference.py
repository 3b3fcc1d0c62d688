"""The KL path's reference pass: run only where something needs it, through the policy's own
bf16 path, the LoRA reference being the base model with the adapter off (no copy), its seconds
in the metrics (`ref_s`).

Tiny random Qwen3 (tests/fixtures/tiny_models.py), one prompt with two completions."""

import pytest
import torch

import actloop.train.rl.update as upd
from actloop.config import load_config
from actloop.models import load_models
from actloop.train.numerics.logprobs import token_logprobs
from actloop.train.numerics.mixed_precision import hold_in_bf16
from actloop.train.rl.update import UpdateContext, rl_update

from .test_update_learns import fixed_batch


def run_update(model_dir, *extra, beta=0.05, bf16_reference=False, perturb_lora=False, monkeypatch=None):
    """One rl_update; -> (models, metrics, [(model, grad enabled, adapter on, TokenLogprobs)] of
    every token_logprobs call the update made)."""
    cfg = load_config(None, [f"model={model_dir}", "algo=grpo", "train.lr=1e-3", "train.prompts_per_step=1",
                             "train.group_size=2", f"train.beta={beta}", *extra])
    torch.manual_seed(0)
    models = load_models(cfg.model, lora=cfg.lora, need_reference=beta > 0)
    if bf16_reference:  # as the trainer holds it under bf16 weights
        hold_in_bf16(models.reference)
    if perturb_lora:  # LoRA's B starts at 0 (a no-op adapter): make the adapted model differ from its base
        with torch.no_grad():
            for n, p in models.policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    calls = []

    def spy(model, *a, **k):
        out = token_logprobs(model, *a, **k)
        adapter_on = None
        if models.lora:
            from peft.tuners.tuners_utils import BaseTunerLayer

            adapter_on = not next(m for m in model.modules() if isinstance(m, BaseTunerLayer)).disable_adapters
        calls.append((model, torch.is_grad_enabled(), adapter_on, out, [p.data_ptr() for p in model.parameters()]))
        return out

    monkeypatch.setattr(upd, "token_logprobs", spy)
    opt = torch.optim.AdamW([p for p in models.policy.parameters() if p.requires_grad], lr=cfg.train.lr,
                            weight_decay=0.0)
    m = rl_update(UpdateContext(cfg, models, opt, None, beta, "none"), fixed_batch(models.tokenizer), 2)
    return models, m, calls


def test_on_policy_kl_in_the_loss_runs_the_reference_pass_alone(tiny_qwen3_dir, monkeypatch):
    """GRPO, one update per batch, KL in the loss: the old log-probs are the update's own
    (detached), so the only no-grad pass is the reference's; its seconds are `ref_s`."""
    models, m, calls = run_update(tiny_qwen3_dir, "train.precision=fp32", monkeypatch=monkeypatch)
    no_grad = [c for c in calls if not c[1]]
    assert [c[0] for c in no_grad] == [models.reference]  # one micro-batch: one reference pass, no policy pass
    assert all(c[0] is models.policy for c in calls if c[1]) and any(c[1] for c in calls)
    assert m["ref_s"] > 0 and m["old_logp_s"] == 0.0
    assert 0 <= m["kl"] < 1e-5  # the loss's KL, at the pre-step weights (= the reference's): 0 up to float noise


def test_beta_zero_runs_no_reference_pass(tiny_qwen3_dir, monkeypatch):
    models, m, calls = run_update(tiny_qwen3_dir, "train.precision=fp32", beta=0.0, monkeypatch=monkeypatch)
    assert models.reference is None and all(c[1] for c in calls)  # no no-grad pass at all
    assert m["ref_s"] == 0.0 and m["old_logp_s"] == 0.0


def test_an_off_policy_step_runs_both_passes_on_the_same_micro_batches(tiny_qwen3_dir, monkeypatch):
    models, m, calls = run_update(tiny_qwen3_dir, "train.precision=fp32", "train.epochs=2", monkeypatch=monkeypatch)
    no_grad = [c for c in calls if not c[1]]
    assert [c[0] for c in no_grad] == [models.policy, models.reference]
    assert torch.equal(no_grad[0][3].mask, no_grad[1][3].mask)  # the same rows and targets
    assert m["ref_s"] > 0 and m["old_logp_s"] > 0


def test_lora_reference_is_the_base_model_with_the_adapter_off(tiny_qwen3_dir, monkeypatch):
    """No second copy; the reference pass runs the policy module with its adapter disabled and gives
    the base model's log-probs, not the adapted policy's."""
    models, m, calls = run_update(tiny_qwen3_dir, "train.precision=fp32", "lora.enabled=true", "rollout.temperature=1.0",
                                  perturb_lora=True, monkeypatch=monkeypatch)
    assert models.lora and models.reference is None
    (ref_call,) = [c for c in calls if not c[1]]
    assert ref_call[0] is models.policy and ref_call[2] is False  # the adapter was off for it
    assert all(c[2] for c in calls if c[1])  # and on for the policy's passes
    seqs = [s.trajectory.input_ids for s in fixed_batch(models.tokenizer)]
    masks = [s.trajectory.loss_mask for s in fixed_batch(models.tokenizer)]
    base = load_models(tiny_qwen3_dir).policy
    with torch.no_grad():
        want = token_logprobs(base, seqs, masks, 1.0, "fp32")
        adapted = token_logprobs(models.policy, seqs, masks, 1.0, "fp32")  # after the step: adapter on
    got = ref_call[3].logp[ref_call[3].mask]  # [N] sampled tokens in order (the update pads its shapes)
    assert torch.allclose(got, want.logp[want.mask], atol=1e-5)
    assert not torch.allclose(got, adapted.logp[adapted.mask], atol=1e-3)
    assert m["kl"] > 1e-4  # the perturbed adapter moved the policy away from its base


@pytest.mark.skipif(not __import__("actloop.rollout.engine", fromlist=["use_bf16"]).use_bf16("bf16"),
                    reason="bf16 weights need a CPU that computes bf16")
def test_a_bf16_update_holds_the_reference_in_bf16_with_the_same_log_probs(tiny_qwen3_dir, monkeypatch):
    """Under train.bf16_mode=weights a reference loaded in bf16 (cast once) gives exactly the log-probs
    of an fp32 reference cast at every step, and its pass computes on its own storage (no cast)."""
    out = {}
    for held in (True, False):
        models, m, calls = run_update(tiny_qwen3_dir, "train.precision=bf16", bf16_reference=held,
                                      monkeypatch=monkeypatch)
        (ref_call,) = [c for c in calls if not c[1]]
        out[held] = ref_call[3].logp
        if held:  # still bf16 after the update, the same storage: never cast
            assert {p.dtype for p in models.reference.parameters()} == {torch.bfloat16}
            assert next(b for n, b in models.reference.named_buffers() if "inv_freq" in n).dtype == torch.float32
            assert ref_call[4] == [p.data_ptr() for p in models.reference.parameters()]
    assert torch.equal(out[True], out[False])


@pytest.mark.skipif(not __import__("actloop.rollout.engine", fromlist=["use_bf16"]).use_bf16("bf16"),
                    reason="bf16 weights need a CPU that computes bf16")
def test_the_reference_only_pass_leaves_the_policys_weights_uncast(tiny_qwen3_dir, monkeypatch):
    """On-policy GRPO with the KL term in the loss: the no-grad pass runs the reference alone, so the
    policy's fp32 weights are not cast to bf16 for it (a whole-model cast of a pass that never reads
    them); the update's own passes still run on bf16 copies."""
    import actloop.train.numerics.mixed_precision as mp

    cast_sets = []
    real = mp.bf16_weights

    def spy(*models, **kw):
        cast_sets.append([m for m in models if m is not None])
        return real(*models, **kw)

    monkeypatch.setattr(mp, "bf16_weights", spy)
    models, m, calls = run_update(tiny_qwen3_dir, "train.precision=bf16", bf16_reference=True, monkeypatch=monkeypatch)
    assert [c[0] for c in calls if not c[1]] == [models.reference]
    assert cast_sets[0] == [models.reference]  # the reference pass: the policy is not in it
    assert cast_sets[1] == [models.policy]  # the update's forward and backward: bf16 copies of the policy
    assert all(c[4] != [p.data_ptr() for p in models.policy.parameters()] for c in calls if c[1])  # they ran on copies
