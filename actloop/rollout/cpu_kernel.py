"""actloop's CPU decode kernels, built on first use: an fp32 matmul for few rows (`small_linear.c`,
AVX2), its bf16 twin (`small_linear_bf16.c`, AVX512-BF16), and for a bf16 engine copy on AVX-512 a
one-query attention (`decode_attention_bf16.c`, AVX512-BF16), RMSNorm after a residual add
(`rms_norm_bf16.c`) and RoPE in place (`rope_bf16.c`); the bf16 ones share `bf16.h` (and
`simd_math.h`: exp, SiLU, 8 horizontal sums at once). Three serve the trainer's bf16 passes, forward and
backward: the softmax side of the lm_head's log-probs over bf16 logits (`head_logprob_bf16.c`),
RMSNorm (`rms_norm_train_bf16.c`) and the MLP's SiLU(gate) x up (`swiglu_train_bf16.c`).

A decode step multiplies a few rows (the live batch) by every weight matrix of the model, so it
is one pass over the weights per step. MKL's sgemm (fp32, AVX2) and oneDNN's bf16 GEMM are far
from that pass's memory-bandwidth floor for so few rows; the kernels stream each weight row once
and feed it to all rows at once (at 8 rows about twice as fast as MKL's or oneDNN's pass over
SmolLM2-135M; the tables: docs/performance.md, "Figures the docstrings carried"). Above a few dozen
rows the libraries catch up, so the kernels take 1..`max_rows(dtype)` rows (`SmallBatchLinear`).

Why the decode kernels are still here, though vLLM's CPU build samples the rollouts on x86 Linux:
the HF engine they serve is still the engine there under `torchrun`, in Ray actors and with MoE
routing replay (until vLLM runs those), and in the test suite; without them it decodes 2-2.9x
slower at 8 rows, where it also beats vLLM's CPU build (docs/performance.md).

Each library is compiled with the system C compiler (`$CC`, else `cc`; the flags of its `Kernel`)
into `$ACTLOOP_CACHE/kernels/`, keyed by a hash of the source and flags, once per machine, and
loaded with ctypes (which releases the GIL during the call). Where one cannot be built — not Linux
x86-64, a CPU without its extension, no compiler — or `ACTLOOP_CPU_KERNELS=0`, `load(name)` returns
None with the reason in `reason(name)` and decode keeps the torch path (one warning in the log).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from actloop.models.resolve import cache_dir

log = logging.getLogger(__name__)

MAX_ROWS = 16  # above this the fp32 kernel is no faster than MKL
MAX_ROWS_BF16 = 16  # the bf16 kernel against oneDNN: see `max_rows`
# rows of one `decode_layers` call: its matmuls go through the bf16 kernel at any row count, and saving
# ~12 Python-level operators a layer outweighs oneDNN's faster GEMM up to ~48 rows (docs/performance.md)
MAX_ROWS_STACKED = 32
MAX_HEAD_DIM = 256  # decode_attention_bf16.c's MAXD

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class Kernel:
    """One C source, the compiler flags it needs, the CPU flags (/proc/cpuinfo) it runs on, its
    symbol and the symbol's argument types."""

    source: str
    symbol: str
    flags: tuple[str, ...]
    cpu: tuple[str, ...]
    argtypes: tuple[Any, ...]
    restype: Any = None


COMMON = ("-O3", "-fopenmp", "-shared", "-fPIC")
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma")
CPU_AVX512 = ("avx512f", "avx512bw", "avx512vl")
KERNELS = {
    "linear_fp32": Kernel("small_linear.c", "actloop_small_linear", ("-mavx2", "-mfma", *COMMON), ("avx2", "fma"),
                          (_P,) * 4 + (_I,) * 3),
    "linear_bf16": Kernel("small_linear_bf16.c", "actloop_small_linear_bf16", (*AVX512, "-mavx512bf16", *COMMON),
                          (*CPU_AVX512, "avx512_bf16"), (_P,) * 4 + (_I,) * 3),
    "attention_bf16": Kernel("decode_attention_bf16.c", "actloop_decode_attention_bf16",
                             (*AVX512, "-mavx512bf16", *COMMON), (*CPU_AVX512, "avx512_bf16"), (_P,) * 6 + (_I,) * 13 + (_F,)),
    "rms_norm_bf16": Kernel("rms_norm_bf16.c", "actloop_rms_norm_bf16", (*AVX512, *COMMON), CPU_AVX512,
                            (_P,) * 5 + (_I,) * 6 + (_F,)),
    "rope_bf16": Kernel("rope_bf16.c", "actloop_rope_bf16", (*AVX512, *COMMON), CPU_AVX512, (_P,) * 3 + (_I,) * 9),
    "decode_layers_bf16": Kernel("decode_layers_bf16.c", "actloop_decode_layers_bf16", (*AVX512, "-mavx512bf16", *COMMON),
                                 (*CPU_AVX512, "avx512_bf16"), (_P,) * 7 + (_I,) * 9 + (_F,) * 2, ctypes.c_int),
    # the trainer's lm_head softmax over bf16 logits (train/numerics/logprobs.py), forward and backward
    "head_logprob_bf16": Kernel("head_logprob_bf16.c", "actloop_head_logprob_bf16", (*AVX512, *COMMON), CPU_AVX512,
                                (_P,) * 5 + (_I,) * 2 + (_F,)),
    "head_logprob_grad_bf16": Kernel("head_logprob_bf16.c", "actloop_head_logprob_grad_bf16", (*AVX512, *COMMON),
                                     CPU_AVX512, (_P,) * 4 + (_I,) * 2 + (_F,)),
    # the trainer's RMSNorm of bf16 activations (rollout/fused_ops.py), forward and backward
    "rms_norm_fwd_bf16": Kernel("rms_norm_train_bf16.c", "actloop_rms_norm_fwd_bf16", (*AVX512, *COMMON), CPU_AVX512,
                                (_P,) * 4 + (_I,) * 2 + (_F,)),
    "rms_norm_bwd_bf16": Kernel("rms_norm_train_bf16.c", "actloop_rms_norm_bwd_bf16", (*AVX512, *COMMON), CPU_AVX512,
                                (_P,) * 7 + (_I,) * 3),
    # the trainer's SiLU(gate) x up of bf16 activations (rollout/fused_ops.py), forward and backward
    "swiglu_fwd_bf16": Kernel("swiglu_train_bf16.c", "actloop_swiglu_fwd_bf16", (*AVX512, *COMMON), CPU_AVX512,
                              (_P,) * 3 + (_I,)),
    "swiglu_bwd_bf16": Kernel("swiglu_train_bf16.c", "actloop_swiglu_bwd_bf16", (*AVX512, *COMMON), CPU_AVX512,
                              (_P,) * 5 + (_I,)),
}
LINEAR = {torch.float32: "linear_fp32", torch.bfloat16: "linear_bf16"}

_lock = threading.Lock()
_state: dict[str, tuple[Callable | None, str]] = {}  # kernel name -> (the loaded kernel or None, why it is None)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(kernel: Kernel) -> tuple[Callable | None, str]:
    if os.environ.get("ACTLOOP_CPU_KERNELS", "1") == "0":
        return None, "ACTLOOP_CPU_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"built for Linux x86-64 only (this is {platform.system()} {platform.machine()})"
    missing = [f for f in kernel.cpu if f not in _cpu_flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"no C compiler (`{cc}` not found; set CC)"
    source = Path(__file__).with_name(kernel.source)
    # every header and source beside it: decode_layers_bf16.c includes the other kernels' sources
    headers = b"".join(h.read_bytes() for h in sorted([*source.parent.glob("*.h"), *source.parent.glob("*.c")]))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join([cc, *kernel.flags]).encode()).hexdigest()[:16]
    lib = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # built aside, renamed in: no half-written .so
            out = Path(tmp) / lib.name
            res = subprocess.run([cc, *kernel.flags, str(source), "-o", str(out)], capture_output=True, text=True)
            if res.returncode != 0:
                return None, f"`{cc}` failed: {res.stderr.strip()[-500:]}"
            os.replace(out, lib)
    fn = getattr(ctypes.CDLL(str(lib)), kernel.symbol)
    fn.argtypes = list(kernel.argtypes)
    fn.restype = kernel.restype
    return fn, ""


def load(name: str) -> Callable | None:
    """The kernel `name` of KERNELS, built on first use, or None (`reason(name)` says why)."""
    if name not in _state:
        with _lock:
            if name not in _state:
                try:
                    fn, why = _build(KERNELS[name])
                except OSError as e:  # an unwritable cache, a library that does not load
                    fn, why = None, f"{type(e).__name__}: {e}"
                if fn is None:
                    log.warning("decode kernel %s unavailable (%s): decode uses torch", name, why)
                _state[name] = (fn, why)
    return _state[name][0]


def reason(name: str) -> str:
    load(name)
    return _state[name][1]


def small_linear(dtype: torch.dtype = torch.float32) -> Callable | None:
    """The matmul kernel for `dtype` (fp32 or bf16), `fn(x_ptr, w_ptr, bias_ptr_or_None, y_ptr, M, N, K)`,
    or None (see the module; `unavailable_reason(dtype)` says why)."""
    return load(LINEAR[dtype]) if dtype in LINEAR else None


def unavailable_reason(dtype: torch.dtype = torch.float32) -> str:
    return reason(LINEAR[dtype]) if dtype in LINEAR else f"no kernel for {dtype}"


def max_rows(dtype: torch.dtype) -> int:
    """Most rows the matmul kernel for `dtype` takes (above it torch's GEMM is as fast)."""
    return MAX_ROWS_BF16 if dtype == torch.bfloat16 else MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias -> [M, N] through the kernel of x's dtype: fp32 or bf16 (all three
    alike), contiguous, on the CPU, 1 <= M <= max_rows(dtype), and `small_linear(dtype)` not None (the
    caller checks)."""
    fn = small_linear(x.dtype)
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype)
    fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), M, N, K)
    return y


def can_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `attention` takes these: bf16 on the CPU, one query per row, head_dim contiguous and at
    most MAX_HEAD_DIM, whole groups of query heads per kv head, and the kernel built."""
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[2] == 1
            and q.shape[-1] <= MAX_HEAD_DIM and q.shape[1] % k.shape[1] == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and load("attention_bf16") is not None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, 1, D], k / v [B, Hkv, L, D] (bf16, views of the cache), keep [B, L] bool (a real key)
    -> [B, Hq, 1, D] bf16: softmax(scale q k^T) v over the kept keys, in fp32 (`can_attend` first)."""
    B, Hq, _, D = q.shape
    L = k.shape[2]
    keep = keep.to(torch.uint8).contiguous()
    out = torch.empty((B, Hq, 1, D), dtype=torch.bfloat16)
    scratch = torch.empty((B * Hq, L), dtype=torch.float32)
    load("attention_bf16")(q.data_ptr(), k.data_ptr(), v.data_ptr(), keep.data_ptr(), out.data_ptr(),
                           scratch.data_ptr(), B, Hq, k.shape[1], L, D, q.stride(0), q.stride(1), k.stride(0),
                           k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), scale)
    return out


def _bf16_rows(t: torch.Tensor | None, n: int) -> bool:
    """t is None, or [rows, n] bf16 on the CPU with contiguous rows."""
    return t is None or (t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() == 2 and t.shape[1] == n
                         and t.stride(1) == 1)


def can_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether `rms_norm` takes these: x (and residual, its shape) [rows, n] bf16 with contiguous rows,
    weight [n] bf16 contiguous, and the kernel built."""
    n = x.shape[-1]
    return (_bf16_rows(x, n) and _bf16_rows(residual, n) and (residual is None or residual.shape == x.shape)
            and weight.dtype == torch.bfloat16 and weight.shape == (n,) and weight.is_contiguous()
            and load("rms_norm_bf16") is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, n] (+ residual) -> (s = x + residual rounded to bf16, or x itself; transformers'
    RMSNorm of s scaled by weight), both [rows, n] bf16 (`can_norm` first)."""
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    s = x if residual is None else torch.empty((rows, n), dtype=torch.bfloat16)
    load("rms_norm_bf16")(x.data_ptr(), None if residual is None else residual.data_ptr(), s.data_ptr(),
                          weight.data_ptr(), y.data_ptr(), rows, n, x.stride(0),
                          0 if residual is None else residual.stride(0), s.stride(0), y.stride(0), eps)
    return s, y


def can_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope_` takes these: x [B, T, H, D] bf16 with D contiguous and even, cos / sin [B, T, D]
    bf16 (the same strides, D contiguous: a full rotary dimension), and the kernel built."""
    return (x.dim() == 4 and cos.dim() == 3 and x.dtype == cos.dtype == sin.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.shape[-1] % 2 == 0 and cos.shape == sin.shape == (*x.shape[:2], x.shape[-1])
            and cos.stride() == sin.stride() and x.stride(-1) == cos.stride(-1) == 1 and load("rope_bf16") is not None)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x <- x * cos + rotate_half(x) * sin in place (transformers' apply_rotary_pos_emb, bit for bit),
    x [B, T, H, D], cos / sin [B, T, D]; returns x (`can_rope` first)."""
    B, T, H, D = x.shape
    load("rope_bf16")(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), B, T, H, D, x.stride(0), x.stride(1),
                      x.stride(2), cos.stride(0), cos.stride(1))
    return x


def decode_layers(x: torch.Tensor, weights: torch.Tensor, caches: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keep: torch.Tensor, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                  scale: float) -> torch.Tensor:
    """Every decoder layer of one decode step in one call (`decode_layers_bf16.c`): x [B, H] bf16, the
    embedded new tokens, becomes the residual stream after the last layer (in place); returns that
    layer's MLP output r [B, H], which the final norm adds. weights: int64 [layers, 10] addresses (ln1,
    Wqkv, bqkv, Wo, bo, ln2, Wgu, bgu, Wd, bd; 0 = no bias); caches: int64 [layers, 8] (K and V buffer
    addresses, then K's and V's strides in batch, head, column), each with room for the new column
    L - 1; cos / sin [B, D] (rows of equal stride, D contiguous); keep [B, L] uint8 (1 = a real key).
    The caller checks shapes, dtypes and that `load("decode_layers_bf16")` is not None."""
    B, H = x.shape
    r = torch.empty_like(x)
    failed = load("decode_layers_bf16")(
        x.data_ptr(), r.data_ptr(), weights.data_ptr(), caches.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        keep.data_ptr(), weights.shape[0], B, H, heads, kv_heads, head_dim, intermediate, keep.shape[1], cos.stride(0),
        eps, scale)
    if failed:
        raise MemoryError("decode_layers_bf16: its workspace could not be allocated")
    return r


def can_head(z: torch.Tensor) -> bool:
    """Whether `head_logprob` / `head_logprob_grad_` take these logits: [N, V] bf16 on the CPU,
    contiguous, and both kernels built."""
    return (z.dtype == torch.bfloat16 and z.device.type == "cpu" and z.dim() == 2 and z.is_contiguous()
            and load("head_logprob_bf16") is not None and load("head_logprob_grad_bf16") is not None)


def head_logprob(z: torch.Tensor, tgt: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    """Logits z [N, V] bf16, targets [N] -> fp32 [N] each: log softmax(z / T)[target], the
    log-normaliser logsumexp(z / T) and the entropy (`head_logprob_bf16.c`; `can_head` first)."""
    N, V = z.shape
    tgt = tgt.to(torch.int64).contiguous()
    lp, lse, ent = (torch.empty(N, dtype=torch.float32) for _ in range(3))
    load("head_logprob_bf16")(z.data_ptr(), tgt.data_ptr(), lp.data_ptr(), lse.data_ptr(), ent.data_ptr(), N, V,
                              temperature)
    return lp, lse, ent


def head_logprob_grad_(z: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """z [N, V] bf16 logits becomes, in place, the gradient of sum_n grad[n] * lp[n] with respect to
    them: (onehot(target) - softmax(z / T)) * grad / T, in bf16; lse from `head_logprob`. Returns z."""
    N, V = z.shape
    tgt = tgt.to(torch.int64).contiguous()
    lse, grad = lse.float().contiguous(), grad.float().contiguous()
    load("head_logprob_grad_bf16")(z.data_ptr(), tgt.data_ptr(), lse.data_ptr(), grad.data_ptr(), N, V, temperature)
    return z


def can_norm_train(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_fwd` / `rms_norm_bwd` take these: x [rows, n] and weight [n] bf16 on the CPU,
    contiguous, and both kernels built."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and x.is_contiguous() and weight.shape == (x.shape[1],) and weight.is_contiguous()
            and load("rms_norm_fwd_bf16") is not None and load("rms_norm_bwd_bf16") is not None)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, n] -> (transformers' RMSNorm of x scaled by weight [rows, n] bf16, the rows' fp32
    1 / rms [rows]) (`can_norm_train` first)."""
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    rstd = torch.empty(rows, dtype=torch.float32)
    load("rms_norm_fwd_bf16")(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, n, eps)
    return y, rstd


def rms_norm_bwd(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, need_weight: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of `rms_norm_fwd` for the upstream dy [rows, n]: (dx [rows, n] bf16, dweight [n]
    bf16 or None)."""
    rows, n = x.shape
    dy = dy.to(torch.bfloat16).contiguous()
    dx = torch.empty((rows, n), dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    dw = torch.empty(n, dtype=torch.bfloat16) if need_weight else None
    scratch = torch.empty((threads, n), dtype=torch.float32) if need_weight else None
    load("rms_norm_bwd_bf16")(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                              None if dw is None else dw.data_ptr(), None if scratch is None else scratch.data_ptr(),
                              rows, n, threads)
    return dx, dw


def can_swiglu(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `swiglu_fwd` / `swiglu_bwd` take these: gate and up of one shape, bf16 on the CPU,
    contiguous, and both kernels built."""
    return (gate.dtype == up.dtype == torch.bfloat16 and gate.device.type == up.device.type == "cpu"
            and gate.shape == up.shape and gate.is_contiguous() and up.is_contiguous()
            and load("swiglu_fwd_bf16") is not None and load("swiglu_bwd_bf16") is not None)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up), elementwise (`can_swiglu` first)."""
    out = torch.empty_like(gate)
    load("swiglu_fwd_bf16")(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, need_up: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of `swiglu_fwd` for the upstream grad: (d gate, d up or None), bf16."""
    grad = grad.to(torch.bfloat16).contiguous()
    dg = torch.empty_like(gate)
    du = torch.empty_like(up) if need_up else None
    load("swiglu_bwd_bf16")(gate.data_ptr(), up.data_ptr(), grad.data_ptr(), dg.data_ptr(),
                            None if du is None else du.data_ptr(), gate.numel())
    return dg, du
