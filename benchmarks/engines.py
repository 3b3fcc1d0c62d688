"""Decode throughput of the engines on the same prompts: the HF engine, actloop's VLLMEngine and
raw `vllm.LLM.generate` on that same LLM.

    python benchmarks/engines.py [--rows 8,32,64] [--max-new-tokens 128] [--repeats 3] [--threads 2]

GSM8K test questions rendered by the embedded model's chat template, T = 1, `--max-new-tokens`
new tokens at most (every engine stops at the renderer's EOS ids, with the same sampling
settings: actloop's `vllm_sampling_kwargs`). Each repeat runs the three engines one after another
at every batch size (alternating, so that a slow spell of a shared machine hits all three), and
prints one JSON line per measurement, then the median tokens/s per engine and batch size and
actloop-over-raw-vLLM. vLLM runs compiled (the default; `--eager` for enforce_eager) with its
compile cache warm after the first start here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    from actloop.data.sources import data_dir
    from actloop.rollout.renderer import Renderer
    from actloop.types import Message

    path = data_dir() / "gsm8k" / "test.jsonl"
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines()[:n]]
    r = Renderer(tokenizer)
    return [r.prompt_ids([Message("user", q)]) for q in questions]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32,64")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]

    import torch

    torch.set_num_threads(args.threads)
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    from actloop.models import load_models, resolve_model
    from actloop.rollout.engine import HFEngine, SamplingParams
    from actloop.rollout.renderer import Renderer
    from actloop.rollout.vllm_engine import VLLMEngine, vllm_sampling_kwargs

    path = resolve_model("smollm2-135m-instruct")
    models = load_models(path)
    renderer = Renderer(models.tokenizer)
    prompts = prompts_of(models.tokenizer, max(rows))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    t = time.time()
    hf = HFEngine(models.policy, models.tokenizer, renderer.eos_token_ids, renderer.stop_strings, threads=args.threads)
    del models.policy
    hf_start = time.time() - t
    t = time.time()
    vl = VLLMEngine(path, renderer.eos_token_ids, renderer.stop_strings, threads=args.threads, kv_cache_gb=1.0,
                    max_model_len=2048, enforce_eager=args.eager)
    vllm_start = time.time() - t
    print(json.dumps({"start_s": {"hf": round(hf_start, 1), "vllm": round(vllm_start, 1)}}), flush=True)
    vparams = VSamplingParams(**vllm_sampling_kwargs(params, renderer.eos_token_ids, renderer.stop_strings))

    def raw(batch):  # vLLM's own offline API, on the engine's thread (the same torch threads)
        outs = vl.llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], vparams, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    runs = {
        "hf": lambda batch: sum(len(c.token_ids) for c in hf.generate(batch, params)),
        "actloop-vllm": lambda batch: sum(len(c.token_ids) for c in vl.generate(batch, params)),
        "raw-vllm": lambda batch: vl.run(raw, batch),
    }
    for name, fn in runs.items():  # warm-up: first-call allocations, compiled shapes
        fn(prompts[:4])
    results: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        for n in rows:
            for name, fn in runs.items():
                t = time.time()
                tokens = fn(prompts[:n])
                dt = time.time() - t
                results.setdefault((name, n), []).append(tokens / dt)
                print(json.dumps({"repeat": rep, "engine": name, "rows": n, "tokens": tokens, "seconds": round(dt, 2),
                                  "tokens_per_s": round(tokens / dt, 1)}), flush=True)
    summary = {}
    for n in rows:
        med = {name: statistics.median(results[(name, n)]) for name in runs}
        summary[n] = {**{k: round(v, 1) for k, v in med.items()},
                      "range": {name: [round(min(results[(name, n)]), 1), round(max(results[(name, n)]), 1)]
                                for name in runs},
                      "actloop_over_raw": round(med["actloop-vllm"] / med["raw-vllm"], 3),
                      "vllm_over_hf": round(med["actloop-vllm"] / med["hf"], 2)}
    print(json.dumps({"median_tokens_per_s": summary}, indent=1))
    hf.close()
    vl.close()


if __name__ == "__main__":
    main()
