"""Continuous batching in HFEngine: requests joining a live batch at token boundaries, rows
leaving, the prefix cache — each checked against the trainer's log-probs of the same ids."""

import threading
import time

import pytest
import torch

from actloop.rollout.engine import HFEngine, PrefixCache, SamplingParams
from actloop.train.numerics.logprobs import token_logprobs


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _max_diff(model, prompts, comps, temperatures=None):
    """Largest |engine - trainer| log-prob, each row at its own sampling temperature."""
    worst = 0.0
    for i, (p, c) in enumerate(zip(prompts, comps)):
        t = temperatures[i] if temperatures else 1.0
        with torch.no_grad():
            out = token_logprobs(model, [p + list(c.token_ids)], [[0] * len(p) + [1] * len(c.token_ids)], t, "fp32")
        worst = max(worst, float((torch.tensor(c.logprobs) - out.logp[0][out.mask[0]]).abs().max()))
    return worst


def test_requests_joining_a_live_batch_get_exact_logprobs():
    model = _tiny()
    engine = HFEngine(model, None, eos_token_ids=(), precision="fp32", weights="copy")
    params = [SamplingParams(max_new_tokens=n, temperature=t) for n, t in ((40, 1.0), (7, 0.7), (25, 1.3), (3, 1.0))]
    prompts = [[5, 6, 7, 8, 9], [5, 6, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 12]]
    futures = []
    for p, sp in zip(prompts, params):  # staggered: each arrives while the earlier ones decode
        futures.append(engine.submit(p, sp))
        time.sleep(0.02)
    comps = [f.result(timeout=60) for f in futures]
    assert [len(c.token_ids) for c in comps] == [40, 7, 25, 3] and all(c.finish_reason == "length" for c in comps)
    assert engine.stats["admitted"] == 4 and engine.stats["reused_tokens"] > 0  # [5, 6, ...] came from the cache
    assert _max_diff(model, prompts, comps, [sp.temperature for sp in params]) < 1e-4
    engine.close()


def test_many_threads_submitting_at_once():
    model = _tiny()
    engine = HFEngine(model, None, eos_token_ids=(), precision="fp32", weights="copy")
    prompts = [[1 + i % 7, 2, 3 + i] for i in range(12)]
    comps = [None] * 12

    def work(i):
        comps[i] = engine.submit(prompts[i], SamplingParams(max_new_tokens=5 + i, temperature=1.0)).result(timeout=60)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(c.token_ids) for c in comps] == [5 + i for i in range(12)]
    assert _max_diff(model, prompts, comps) < 1e-4
    engine.close()


def test_a_finished_turn_is_reused_by_the_next_call_and_the_cache_empties_at_sleep():
    model = _tiny()
    engine = HFEngine(model, None, eos_token_ids=(), precision="fp32", weights="copy")
    first = [9, 8, 7, 6, 5, 4]
    c1 = engine.generate([first], SamplingParams(max_new_tokens=6))[0]
    nxt = first + list(c1.token_ids) + [1, 2, 3]  # the agent's next call: previous ids + a tool result
    before = engine.stats["reused_tokens"]
    c2 = engine.generate([nxt], SamplingParams(max_new_tokens=4))[0]
    # reused: the prompt and every sampled token but the last (it was sampled, never fed back)
    assert engine.stats["reused_tokens"] - before == len(first) + len(c1.token_ids) - 1
    assert _max_diff(model, [nxt], [c2]) < 1e-4
    engine.sleep()
    assert not engine.prefix_cache.entries
    engine.close()


def test_errors_reach_the_request_and_the_engine_goes_on():
    engine = HFEngine(_tiny(), None, eos_token_ids=(), precision="fp32", weights="copy")
    bad = engine.submit([1, 2, 999], SamplingParams(max_new_tokens=3))  # id outside the vocabulary
    try:
        bad.result(timeout=60)
        raise AssertionError("expected the request to fail")
    except (IndexError, RuntimeError):
        pass
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3
    engine.close()


def test_a_group_holds_its_prompt_once_and_the_next_calls_read_the_shared_entries_exactly():
    """A group of completions of one long prompt, then each one's next call (prompt + sampled ids +
    a tool result), as an agent makes it: the cache stores the prompt's KV once, the next calls
    reuse it and their own completion, and every log-prob equals a fresh trainer forward."""
    model = _tiny()
    engine = HFEngine(model, None, eos_token_ids=(), precision="fp32", weights="copy")
    prompt = [(7 * i) % 59 + 1 for i in range(24)]
    group = engine.generate([prompt] * 4, SamplingParams(max_new_tokens=8))
    keys = [prompt + list(c.token_ids[:-1]) for c in group]  # what each finished row left (its last id was never fed)
    distinct = len({tuple(k[: i + 1]) for k in keys for i in range(len(k))})  # every shared column once
    assert engine.prefix_cache.tokens == distinct <= len(prompt) + 4 * 7, (engine.prefix_cache.tokens, distinct)
    nxt = [prompt + list(c.token_ids) + [3, 4, 5] for c in group]
    before = engine.stats["reused_tokens"]
    second = engine.generate(nxt, SamplingParams(max_new_tokens=5))
    assert engine.stats["reused_tokens"] - before == 4 * (len(prompt) + 7)
    assert _max_diff(model, [prompt] * 4, group) < 1e-4 and _max_diff(model, nxt, second) < 1e-4
    engine.close()


def test_a_groups_other_samples_are_prefilled_from_the_cache_without_a_forward():
    """G requests of one prompt: the first is prefilled (a forward), the other G - 1 take its KV and
    its next-token logits from the cache; every row's log-probs still equal the trainer's, and after
    a weight sync the prompt is computed again."""
    model = _tiny()
    engine = HFEngine(model, None, eos_token_ids=(), precision="fp32", weights="copy")
    calls = []
    real = engine._forward_cb
    engine._forward_cb = lambda ids, *a: calls.append(ids.shape) or real(ids, *a)
    prompt = [(5 * i) % 59 + 1 for i in range(20)]
    firsts = engine.generate([prompt] * 4, SamplingParams(max_new_tokens=1))  # prefill only: no decode step
    assert calls == [(1, 20)] and engine.stats["prefill_tokens"] == 20 and engine.stats["reused_tokens"] == 3 * 20
    assert len({c.logprobs[0] for c in firsts if c.token_ids == firsts[0].token_ids}) == 1
    group = engine.generate([prompt] * 4, SamplingParams(max_new_tokens=9))
    assert len(calls) == 1 + 8 and set(calls[1:]) == {(4, 1)}  # 8 decode steps of the 4 rows, no prefill forward
    assert _max_diff(model, [prompt] * 4, firsts) < 1e-4 and _max_diff(model, [prompt] * 4, group) < 1e-4
    engine.sync_weights(model)  # new weights: the held logits go with the KV
    calls.clear()
    engine.generate([prompt] * 2, SamplingParams(max_new_tokens=1))
    assert calls == [(1, 20)]
    engine.close()


def _kv_of(ids):
    """A fake one-layer KV whose column j holds token ids[j], so a lookup shows which tokens it returned."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    return lambda start: [(t[:, :, start:].clone(), -t[:, :, start:].clone())]


def test_prefix_cache_lookup_and_eviction():
    cache = PrefixCache(max_tokens=10)
    cache.put([1, 2, 3, 4], _kv_of([1, 2, 3, 4]))
    cache.put([1, 2, 9], _kv_of([1, 2, 9]))
    assert cache.lookup([1, 2, 3, 4, 5])[0] == 4
    assert cache.lookup([1, 2, 3, 4])[0] == 3  # the last prompt token is always fed
    assert cache.lookup([7, 1])[0] == (0, None)[0]
    cache.put([5, 5, 5, 5, 5], _kv_of([5] * 5))  # 12 tokens > 10: the least recently used goes
    assert cache.tokens <= 10 and (1, 2, 9) not in cache.entries


def test_prefix_cache_entries_share_their_common_prefix():
    PrefixCache.MIN_SHARED, saved = 2, PrefixCache.MIN_SHARED
    try:
        cache = PrefixCache(max_tokens=100)
        prompt = [1, 2, 3, 4, 5, 6]
        asked = []

        def kv_from(ids):
            f = _kv_of(ids)
            return lambda start: asked.append(start) or f(start)

        cache.put(prompt, kv_from(prompt))
        for c in ([7, 8], [9], [7, 10, 11]):  # a group's completions of one prompt
            cache.put(prompt + c, kv_from(prompt + c), replaces=prompt)
        assert asked == [0, 6, 6, 7]  # each stored only what no entry held
        assert cache.tokens == 6 + 2 + 1 + 2 and prompt not in [list(k) for k in cache.entries]
        P, kv = cache.lookup(prompt + [7, 10, 11, 99])  # two segments, concatenated
        assert P == 9 and kv[0][0].flatten().tolist() == prompt + [7, 10, 11]
        assert kv[0][1].flatten().tolist() == [-t for t in prompt + [7, 10, 11]]
        cache.put(prompt + [9], kv_from(prompt + [9]))  # held already: nothing copied
        cache.put(prompt[:4], kv_from(prompt[:4]))  # a prefix of an entry: views, nothing copied
        assert asked == [0, 6, 6, 7] and cache.tokens == 11
        assert cache.lookup(prompt[:4] + [0])[1][0][0].flatten().tolist() == prompt[:4]
        # the budget counts each block once, while any entry points into it
        for key in [k for k in cache.entries if k != tuple(prompt[:4])]:
            cache._drop(key)
        assert list(cache.entries) == [tuple(prompt[:4])] and cache.tokens == 6  # the prompt's block stays
        cache._drop(tuple(prompt[:4]))
        assert cache.tokens == 0
    finally:
        PrefixCache.MIN_SHARED = saved


def _update_sync_and_compare(engine, model, precision, before):
    """The "update" (every weight of the policy moves), sync_weights, then greedy decoding equals a
    fresh engine's on the new weights and differs from `before` (the old weights' tokens)."""
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync_weights(model)
    fresh = HFEngine(model, None, eos_token_ids=(0,), precision=precision, weights="copy")
    after = engine.generate([[5, 6, 7]], greedy)[0].token_ids
    assert after == fresh.generate([[5, 6, 7]], greedy)[0].token_ids and after != before
    fresh.close()


def test_sleep_releases_the_copy_and_sync_brings_the_new_weights_back():
    """The trainer sleeps the engine before each update: the bf16/fp32 copy's storage is freed
    (the update's peak does not hold it), sampling then is a clear error, and sync_weights
    re-allocates it with the policy's (changed) weights."""
    model = _tiny()
    engine = HFEngine(model, None, eos_token_ids=(0,), precision="fp32", weights="copy", share_weights=False)
    try:
        greedy = SamplingParams(max_new_tokens=6, greedy=True)
        before = engine.generate([[5, 6, 7]], greedy)[0].token_ids
        assert hasattr(engine.model.model.layers[0].self_attn, "_actloop_fused")  # q/k/v views of one weight
        engine.sleep()
        assert all(t.untyped_storage().nbytes() == 0 for t in engine.model.state_dict().values())
        try:
            engine.generate([[5, 6, 7]], greedy)
            raise AssertionError("a sleeping engine sampled")
        except RuntimeError as e:
            assert "sync_weights" in str(e)
        _update_sync_and_compare(engine, model, "fp32", before)  # the policy changes while the copy sleeps
    finally:
        engine.close()


@pytest.mark.parametrize("lora", [False, True])
def test_a_bf16_copy_lends_its_storage_to_the_updates_bf16_weights(lora):
    """train.bf16_mode=weights: instead of sleeping, the bf16 copy's tensors hold the update's bf16
    weights (no new 2-byte copy of the model), the engine refuses to sample until sync_weights, and
    then samples with the policy's new weights (LoRA: merged again)."""
    from actloop.train.numerics.mixed_precision import bf16_weights

    model = _tiny().train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    engine = HFEngine(model, None, eos_token_ids=(0,), precision="bf16", weights="copy")
    try:
        greedy = SamplingParams(max_new_tokens=6, greedy=True)
        before = engine.generate([[5, 6, 7]], greedy)[0].token_ids
        lent = engine.lend_weights(model)
        masters = [(n, p) for n, p in model.named_parameters() if ".lora_" not in n]
        assert len(lent) == len(masters) and engine.asleep
        with pytest.raises(RuntimeError, match="sync_weights"):
            engine.generate([[5, 6, 7]], greedy)
        with bf16_weights(model, buffers=lent):
            for n, p in masters:
                assert p.dtype == torch.bfloat16 and p.data_ptr() == lent[id(p)].data_ptr(), n
            trainable = [p for p in model.parameters() if p.requires_grad]
            assert all(p.dtype == torch.bfloat16 for p in trainable)
        _update_sync_and_compare(engine, model, "bf16", before)
    finally:
        engine.close()


def test_an_fp32_copy_lends_nothing_and_sleeps():
    engine = HFEngine(_tiny(), None, eos_token_ids=(0,), precision="fp32", weights="copy", share_weights=False)
    try:
        assert engine.lend_weights(engine.model) == {} and engine.asleep
        assert all(t.untyped_storage().nbytes() == 0 for t in engine.model.state_dict().values())
    finally:
        engine.close()


def test_an_fp32_copy_shares_the_policys_tensors_and_sleep_frees_none_of_them():
    """fp32 full fine-tuning: the engine's modules hold the trainer's own parameters (no second copy),
    decode through SmallBatchLinear while the trainer's modules stay nn.Linear, sleep leaves the
    policy's storage alone, and an update is seen at once."""
    from actloop.rollout.small_matmul import SmallBatchLinear

    model = _tiny().train()
    engine = HFEngine(model, None, eos_token_ids=(0,), precision="fp32", weights="copy")
    try:
        assert engine.shared
        ours = dict(model.named_parameters())
        for name, p in engine.model.named_parameters():
            assert p.data_ptr() == ours[name].data_ptr(), name
        assert all(p.requires_grad for p in model.parameters()) and model.training  # the trainer's flags untouched
        assert any(type(m) is SmallBatchLinear for m in engine.model.modules())
        assert not any(isinstance(m, SmallBatchLinear) for m in model.modules())
        greedy = SamplingParams(max_new_tokens=6, greedy=True)
        before = engine.generate([[5, 6, 7]], greedy)[0].token_ids
        engine.sleep()
        assert all(t.untyped_storage().nbytes() > 0 for t in model.state_dict().values())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        engine.sync_weights(model)
        fresh = HFEngine(model, None, eos_token_ids=(0,), precision="fp32", weights="copy", share_weights=False)
        after = engine.generate([[5, 6, 7]], greedy)[0].token_ids
        assert after == fresh.generate([[5, 6, 7]], greedy)[0].token_ids and after != before
        fresh.close()
        comps = engine.generate([[5, 6, 7, 8], [5, 6, 1]], SamplingParams(max_new_tokens=12, temperature=1.0))
        assert _max_diff(model.eval(), [[5, 6, 7, 8], [5, 6, 1]], comps) < 1e-4
    finally:
        engine.close()


def test_a_bf16_copy_is_its_own():
    engine = HFEngine(_tiny(), None, eos_token_ids=(0,), precision="bf16", weights="copy")
    assert not engine.shared and next(engine.model.parameters()).dtype == torch.bfloat16
    engine.close()


def test_run_executes_on_the_decode_thread_between_batches():
    """engine.run(fn): fn runs on the thread that decodes (one OpenMP pool: HFEngine's docstring), with
    autograd on, its result returned and its exception raised to the caller; generate() from inside
    fn is refused instead of deadlocking; decoding goes on afterwards."""
    model = _tiny()
    engine = HFEngine(model, None, eos_token_ids=(), precision="fp32", weights="copy", threads=1)
    params = SamplingParams(max_new_tokens=4)
    try:
        assert len(engine.generate([[1, 2, 3]], params)[0].token_ids) == 4
        decode_thread = engine._thread

        def work(x):
            assert torch.is_grad_enabled()
            return threading.current_thread(), x * 2

        assert engine.run(work, 21) == (decode_thread, 42)
        with pytest.raises(ValueError, match="boom"):
            engine.run(lambda: (_ for _ in ()).throw(ValueError("boom")))
        with pytest.raises(RuntimeError, match="inside engine.run"):
            engine.run(engine.generate, [[1, 2]], params)
        # a request and a call queued together: the call waits for the batch to drain, both complete
        fut = engine.submit([4, 5, 6], SamplingParams(max_new_tokens=8))
        assert engine.run(lambda: fut.done())  # the row had finished before the call ran
        assert len(fut.result().token_ids) == 8
        assert engine._thread is decode_thread
    finally:
        engine.close()


def test_close_answers_every_request_submitted_around_it():
    """Requests submitted from other threads while the engine closes: each gets its completion or
    "the engine was closed", none is left waiting (an episode thread waiting forever held the
    interpreter's exit, the asynchronous loop's shutdown)."""
    for _ in range(5):
        engine = HFEngine(_tiny(), None, eos_token_ids=(), precision="fp32", weights="copy")
        futures, go = [], threading.Event()

        def submit():
            go.wait()
            for _ in range(20):
                try:
                    futures.append(engine.submit([5, 6, 7], SamplingParams(max_new_tokens=30, temperature=1.0)))
                except RuntimeError as e:  # refused once closed
                    assert "closed" in str(e)
                    return

        threads = [threading.Thread(target=submit) for _ in range(3)]
        for t in threads:
            t.start()
        go.set()
        time.sleep(0.01)
        engine.close()
        for t in threads:
            t.join()
        for f in futures:
            try:
                f.result(timeout=10)
            except RuntimeError as e:
                assert "closed" in str(e)
