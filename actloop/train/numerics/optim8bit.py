"""AdamW with block-wise 8-bit moments (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization", arXiv:2110.02861) on bitsandbytes' kernels, stepped in chunks on CPU.

bitsandbytes' CPU step de-quantizes a whole tensor's two moments to fp32, copies its gradient and
builds the denominator before re-quantizing: for the 135M model's 28M-value embedding that is
~0.5 GB of fp32 temporaries, and it held the demo's update peak (3.25-3.86 GB at the optimizer
step against 2.84-3.68 GB in the backward; docs/performance.md). The quantization blocks are 256 values
each, independent of one another, so stepping a tensor's flat values in chunks of whole blocks
gives bit-identical moments and parameters (`tests/train/test_optim.py`) with temporaries of one
chunk. CUDA keeps bitsandbytes' own fused kernel (no fp32 temporaries), unchunked.
"""

from __future__ import annotations

import logging

import torch

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # an optional 4-bit GEMM kernel's notice
import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402

BLOCK = 256  # bitsandbytes' block size for the 8-bit optimizer states
CHUNK = 1 << 20  # values stepped at once on CPU: 4 MB of fp32 per temporary


class AdamW8bit(bnb.optim.AdamW8bit):
    """bitsandbytes.optim.AdamW8bit whose CPU step goes through a tensor in chunks of CHUNK
    values (a multiple of BLOCK, so every chunk holds whole quantization blocks). Tensors under
    4096 values keep fp32 moments (bitsandbytes' min_8bit_size)."""

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        state = self.state[p]
        if state["state1"].dtype != torch.uint8 or p.device.type != "cpu" or p.numel() <= CHUNK:
            return super().update_step(group, p, gindex, pindex)
        p.data = p.data.contiguous()
        p.grad = p.grad.contiguous()
        config = self.get_config(gindex, pindex, group)
        state["step"] += 1
        flat = {k: state[k].view(-1) for k in ("state1", "state2")}
        g, w = p.grad.view(-1), p.data.view(-1)
        for a in range(0, p.numel(), CHUNK):
            b = min(a + CHUNK, p.numel())
            blocks = slice(a // BLOCK, -(-b // BLOCK))
            F.optimizer_update_8bit_blockwise(
                self.optimizer_name, g[a:b], w[a:b], flat["state1"][a:b], flat["state2"][a:b],
                config["betas"][0], config["betas"][1], 0.0, 0.0, config["eps"], state["step"], config["lr"],
                state["qmap1"], state["qmap2"], state["absmax1"][blocks], state["absmax2"][blocks],
                config["weight_decay"], gnorm_scale=1.0, skip_zeros=config["skip_zeros"])
