"""Attention for Hopper GPUs (sm_90), in Gluon: the forward with FA3's intra-warpgroup overlap written out (most
calls warp-specialized: a TMA producer warpgroup feeding two consumer warpgroups, or three at D64), and
the backward's two passes (dK/dV, dQ) on asynchronous ``wgmma`` fed by TMA.

Triton's compiler waits for each ``tl.dot`` right after issuing it, so the softmax of a key block never overlaps a
matrix product. Gluon exposes the asynchronous ``wgmma`` and its wait: in the forward the next block's S = Q K^T and
this block's O += P V are both in flight while the softmax of S runs, and K and V arrive by TMA (the bulk tensor copy
engine) into rings of shared memory, each buffer refilled as soon as the product that read it has retired. Two
warpgroups share an SM, so one's softmax also runs under the other's products: for dense calls (``_attn_fwd_ws``) as
the consumers of one program, which share every K/V tile a producer warpgroup loads, and get its registers;
for short key intervals and small D64 calls (``_attn_fwd_hopper``) as two programs of one warpgroup each. The
default backward at D128 (not soft-capped) and at D64 from 1024 keys, dense or on key intervals, is one pass with
FA3's structure (``_attn_bwd_hopper``: dQ added by unordered fp32 TMA reductions). The deterministic one, and every
other call's, keeps the Triton kernels' split (no atomics): a dK/dV program holds one key block and streams
the query blocks of every query head sharing it, in transposed (key x query) tiles so that P^T and dS^T are the next
products' register operands; a dQ program holds one query block and streams the key blocks, and runs first: it
forms delta = rowsum(dO * O) of its rows for both passes. (One pass with dQ added in fp32 by ordered TMA
reductions was deterministic but 0.51-0.95x of this, inline, with a writer partition or pipelined:
h100-attention-experiments.md, the 2026-11-26 runs at 8c0abe0, 9c94282 and 6608e51; FA3's structure with ordered
reductions 0.66-1.02x, the 2026-11-28 run at ce21c65.)

Measured against the Triton kernels in the same run (bf16, B*L = 16384, H*D = 2048, L 1K-16K; benchmarks/results/
h*-scaled_dot_product_attention.md, H100 and H200): forward 1.00-1.51x, forward+backward 1.00-1.54x. Against cuDNN
(D 64/128, L >= 2048, H100, 2026-11-27 at fbaeb58, four shuffled rounds a row): forward 0.99-1.12x (every D64 row
1.00-1.12x; D128 2K not causal 0.99x), forward+backward 0.87-1.03x (the D64 rows 0.87-0.98x: this D64 backward runs at
about 0.84x cuDNN's); each run since the one at e6a0c55 has had one or two rows a few percent under 1.0x / 0.9x, never
the same ones.

They cover fp16/bf16, head dims 64, 128 and 256 (D = Dv),
no attn_mask or dropout, a positive scale, inputs (and the output's gradient) the TMA can describe (last dim
contiguous, other strides and the base 16-byte aligned), calls of at least MIN_FLOPS. Windows and packed sequences
(fl.varlen_attention) come as per-row key intervals: the key blocks no row of a query block reaches are skipped, the
edge blocks masked.
Gemma 2's soft-cap (``cap_scale`` > 0) is the hardware's tanh on each score, in every kernel (the backward
multiplies dS by the cap's derivative, 1 - tanh^2, of the score it already forms). Everything else, other GPUs and
the interpreter run the Triton kernels, whose logsumexp this forward writes in the same units (natural log, fp32), so
either backward takes either forward's output as is.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os

import torch

from fusedlayers import backend
from fusedlayers.kernels import cdiv, launch

try:
    import triton
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon's Hopper module: the Triton kernels run
    gluon = None

enabled = os.environ.get("FUSEDLAYERS_HOPPER_ATTENTION", "1") != "0"  # 0: the Triton forward everywhere (A/B timing)
# (BLOCK_M, BLOCK_N, V ring depth) per (head dim, causal), 4 warps: the fastest of five shapes each on an H100.
# 64 x 128 tiles with a one-deep V ring keep two programs (115 KB of shared memory each) on an SM at D128;
# causal needs BLOCK_M to be a multiple of BLOCK_N (the diagonal block).
_CONFIGS = {(64, False): (64, 64, 2), (64, True): (64, 64, 2), (128, False): (64, 128, 1), (128, True): (64, 64, 2),
            (256, False): (64, 32, 2), (256, True): (64, 32, 2)}
# Head dims the forwards take (those configured above) and the backward's passes.
FORWARD_HEAD_DIMS = tuple(sorted({d for d, _ in _CONFIGS}))
BACKWARD_HEAD_DIMS = (64, 128, 256)


# Smaller calls keep the Triton kernels. The choice is by GPU time, as in a training step, where the host runs ahead
# of the GPU: from 2**29 to 2**37 flops (dense D64/D128/D256 causal and not, GQA, packed documents of 128-1024
# tokens, windows of 128-512 keys) the Triton kernels' forward+backward took 1.00-1.73x the Gluon kernels' GPU time
# (H200, 2026-11-29; `bench_scaled_dot_product_attention.py --routing`; h100-attention-experiments.md, "MIN_FLOPS"),
# and the Hugging Face Llama step at B 4, L 2K (2**36 a call) ran 1.04x faster on them. A call alone is host-bound
# below about 2**37 (either path spends about 1 ms of host time on a forward+backward, the Gluon path 0.1-0.4 ms
# more), which is what do_bench times there; below 2**34 (under 0.2 ms of GPU time) the host's cost decides, and the
# Triton path's is the smaller.
MIN_FLOPS = 2**34
# The forwards deal causal tiles in groups of this many heads, the longest rows of a group first (``_causal_order``):
# 1.03-1.10x one head at a time at D128 L 2K-16K (H100; the warp-specialized forward; D64's one-warpgroup forward
# 0.99-1.02x). The dQ pass keeps one head at a time (grouped: 0.96-1.05x, noise either way); the one pass and the
# deterministic dK/dV pass deal key blocks by groups of 2-4 heads where a wave covers that many (``_head_group``).
CAUSAL_HEAD_GROUP = 8


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plain: bool, scale: float, is_causal: bool,
            keys_per_row: float | None = None) -> bool:
    """Whether this kernel runs the call: ``plain`` = no mask or dropout (windows and packed sequences come as key
    intervals, the soft-cap as ``cap_scale``); ``keys_per_row``: with intervals, about how many keys a row attends
    (else all, or half when causal)."""
    if gluon is None or not plain or scale <= 0.0 or not q.is_cuda or not _is_hopper(q.device):
        return False
    if k.shape[2] == 0:  # no keys: the kernel would wait for a first K block that never comes
        return False
    if _flops(q, k, is_causal, keys_per_row) < MIN_FLOPS:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.shape[-1] not in FORWARD_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    return all(_tma_compatible(t) for t in (q, k, v))


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU, asked once per device (torch's query costs 5 us a call on an H100
    host, and every attention call asked it twice)."""
    return torch.cuda.get_device_capability(device)[0] == 9


def _flops(q: torch.Tensor, k: torch.Tensor, is_causal: bool, keys_per_row: float | None) -> float:
    """The forward's flops, 4 * B * H * L * D per key a row attends: MIN_FLOPS's measure. Packed short sequences and
    narrow windows are small calls however long the packed row (16K tokens, H * D = 2048: documents of 128 tokens
    2**33 flops, windows of 256 keys 2**35)."""
    B, H, L, D = q.shape
    if keys_per_row is None:
        keys_per_row = backend.keys_per_row(k.shape[2], is_causal)
    return 4.0 * B * H * L * D * keys_per_row


def _tma_compatible(t: torch.Tensor) -> bool:
    """Whether the TMA can read t: a contiguous last dim, the base and every other stride 16-byte aligned (a size-1
    dim's stride is never used)."""
    strides = t.stride()
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    size = t.element_size()
    for n, s in zip(t.shape[:-1], strides[:-1], strict=True):  # a loop, not all(...): on every call's host path
        if n != 1 and (s <= 0 or s * size % 16):
            return False
    return True


def _descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A 4-D descriptor over (B, H, L, D) with t's strides (a size-1 dim gets any aligned stride), loading
    (1, 1, block_rows, D) tiles: rows past L read as zeros."""
    shape = list(t.shape)
    strides = [s if n > 1 else t.shape[-1] for n, s in zip(shape, t.stride(), strict=True)]
    block = [1, 1, block_rows, shape[-1]]
    return _new_descriptor(t, shape, strides, block, _shared_layout(block_rows, shape[-1], t.dtype))


# (block shape, layout) -> the fields of a descriptor Triton checked, but its base
_DESCRIPTOR_FIELDS: dict = {}


def _new_descriptor(base: torch.Tensor, shape: list[int], strides: list[int], block: list[int],
                    layout) -> TensorDescriptor:
    """``TensorDescriptor(base, shape, strides, block, layout)`` with Triton's checks run once per block shape and
    layout: they cost about 6 us a descriptor on an H200's host, ten descriptors a forward+backward. What they check
    of each call's tensor (a 16-byte aligned base and strides, a contiguous last dim, no empty dim) the callers
    checked first (``_tma_compatible``, the launchers' early returns)."""
    key = (*block, layout)
    fields = _DESCRIPTOR_FIELDS.get(key)
    if fields is None:
        desc = TensorDescriptor(base, shape, strides, block, layout)
        _DESCRIPTOR_FIELDS[key] = {**vars(desc), "base": None}  # no reference to the tensor kept
        return desc
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(fields)
    desc.base, desc.shape, desc.strides = base, shape, strides
    return desc


@functools.cache
def _shared_layout(block_rows: int, head_dim: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a (1, 1, rows, D) tile (a few us to build: built once per shape, not
    per call; three per forward)."""
    block = [1, 1, block_rows, head_dim]
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def attention_forward(q, k, v, is_causal: bool, qk_scale: float, out: torch.Tensor, lse: torch.Tensor,
                      intervals: tuple[torch.Tensor, ...] | None = None, keys_per_row: float | None = None,
                      cap_scale: float = 0.0) -> None:
    """Writes out (B, H, L, D) and lse (B, H, L) (natural log, fp32; +inf for a row without keys) for q (B, H, L, D),
    k/v (B, H_kv, S, D); ``qk_scale``: the softmax scale in base-2 exponent units (the Triton launcher's
    ``_exponent_scale``); ``intervals``: the Triton launcher's (row_lo, row_hi, col_lo, col_hi), B = 1, with about
    ``keys_per_row`` keys a row; ``cap_scale`` > 0: soft-capped scores qk_scale * tanh(qk * cap_scale) (qk_scale
    then the cap in exponent units: the Triton launcher's ``_window_softcap_args``)."""
    ws = _warp_specialized(q, k, is_causal, out, intervals, keys_per_row)
    if ws is not None:
        _forward_warp_specialized(q, k, v, is_causal, qk_scale, cap_scale, out, lse, intervals, *ws)
        return
    B, H, L, D = q.shape
    S = k.shape[2]
    block_m, block_n, v_bufs = _CONFIGS[(D, is_causal or intervals is not None)]
    row_lo, row_hi = intervals[:2] if intervals is not None else (lse, lse)
    grid = (cdiv(L, block_m), B * H)
    launch(_attn_fwd_hopper, grid,
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), out, lse, row_lo, row_hi,
        *out.stride(), H, H // k.shape[1], L, S, qk_scale, cap_scale,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=is_causal, EVEN_S=S % block_n == 0, V_BUFS=v_bufs,
        INTERVALS=intervals is not None, SOFTCAP=cap_scale > 0.0, BH_GROUP=CAUSAL_HEAD_GROUP, num_warps=4,
    )


if gluon is not None:

    @gluon.jit
    def _tanh(x):
        """The hardware's tanh.approx.f32 (one special-function instruction, relative error about 2**-11, below the
        16-bit inputs' own rounding of the score), as the Triton kernels' soft-cap on the GPU."""
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale, cap_scale, offs_m, start_n, q_lo, S, row_lo, row_hi, seen_lo, seen_hi,
                      BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, EVEN_S: gl.constexpr, INTERVALS: gl.constexpr,
                      SOFTCAP: gl.constexpr, s_layout: gl.constexpr):
        """p = exp2(s * scale - m) with the running max m and sum l updated; alpha rescales the output (SOFTCAP: s is
        first tanh(s * cap_scale), and scale the cap). INTERVALS: row i keeps keys [row_lo[i], row_hi[i]]; blocks
        outside [seen_lo, seen_hi] (the keys every row keeps) are masked, and a row may have no key yet (m = -inf:
        p = alpha = 0)."""
        if SOFTCAP:
            s = _tanh(s * cap_scale)
        if INTERVALS:
            if start_n < seen_lo or start_n + BLOCK_N - 1 > seen_hi:
                offs_n = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
                keep = (offs_n >= gl.expand_dims(row_lo, 1)) & (offs_n <= gl.expand_dims(row_hi, 1))
                s = gl.where(keep, s, float("-inf"))
        elif CAUSAL or not EVEN_S:
            # the blocks that cross the diagonal, the ragged last one (the TMA reads zeros past S)
            if (CAUSAL and start_n + BLOCK_N > q_lo) or (not EVEN_S and start_n + BLOCK_N > S):
                offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                keep = gl.expand_dims(offs_n < S, 0)
                if CAUSAL:
                    keep = keep & (gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0))
                s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        if INTERVALS:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))  # one FMA per score
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _load(desc, b, h, row, bar, dst, pred):
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [b, h, row, 0], bar, dst, pred=pred)

    @gluon.jit
    def _step_stats(Lse, Delta, bh, offs_m, L, valid):
        """The backward's per-row statistics of head bh's query rows offs_m: the logsumexp in base-2 units and
        delta. Rows past L (or no step at all, ``valid`` false): logsumexp +inf, so P = 0 there (the TMA reads their
        q and dO as zeros)."""
        ok = (offs_m < L) & valid
        lse2 = gl.load(Lse + bh.to(gl.int64) * L + offs_m, mask=ok, other=float("inf")) * 1.4426950408889634
        delta = gl.load(Delta + bh.to(gl.int64) * L + offs_m, mask=ok, other=0.0)
        return lse2, delta

    @gluon.jit
    def _causal_order(t, num_m, num_bh, BH_GROUP: gl.constexpr):
        """(b * H + h, query block) of causal tile t, tiles dealt in launch order: heads in groups of BH_GROUP, the
        longest rows of the whole group first. One head's tiles together (BH_GROUP = 1) left the longest tiles of
        the last heads to the last wave; all heads' longest first (no groups) ran SMs on as many heads as they hold
        tiles, each streaming its own K/V (0.73-1.01x the first at D128, L 2K-16K; CAUSAL_HEAD_GROUP's)."""
        group = t // (BH_GROUP * num_m)
        r = t % (BH_GROUP * num_m)
        heads = gl.minimum(BH_GROUP, num_bh - group * BH_GROUP)
        return group * BH_GROUP + r % heads, num_m - 1 - r // heads

    @gluon.jit
    def _query_block(RowLo, RowHi, H, GROUP, L, S, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                     INTERVALS: gl.constexpr, BH_GROUP: gl.constexpr, row_layout: gl.constexpr):
        """A query-block program's (bh, b, h, hk, first row m0, rows offs_m) and the key blocks it visits: [lo, lo +
        n * BLOCK_N), and with INTERVALS the rows' intervals and the keys every row keeps (``_block_intervals``).
        Causal programs take the longest rows first (``_causal_order``): the short ones fill the last wave."""
        if CAUSAL:
            bh, pid_m = _causal_order(gl.program_id(1) * gl.num_programs(0) + gl.program_id(0), gl.num_programs(0),
                                      gl.num_programs(1), BH_GROUP)
        else:
            pid_m = gl.program_id(0)
            bh = gl.program_id(1)
        h = bh % H
        m0 = pid_m * BLOCK_M
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        if INTERVALS:
            row_lo, row_hi, lo, n, seen_lo, seen_hi = _block_intervals(RowLo, RowHi, offs_m, L, S, BLOCK_N)
        else:
            row_lo, row_hi, lo, seen_lo, seen_hi = offs_m, offs_m, 0, 0, 0
            if CAUSAL:
                n = gl.cdiv(gl.minimum(m0 + BLOCK_M, S), BLOCK_N)
            else:
                n = gl.cdiv(S, BLOCK_N)
        return bh, bh // H, h, h // GROUP, m0, offs_m, row_lo, row_hi, lo, n, seen_lo, seen_hi

    @gluon.jit
    def _block_intervals(Lo, Hi, offs, count, limit, BLOCK: gl.constexpr):
        """The intervals [lo[i], hi[i]] of a block's rows (rows past ``count``: empty); the blocks of the other side
        they reach, [first, first + n * BLOCK) (n >= 1, so that a pipeline's first block always arrives; an empty
        interval masks it whole), and [seen_lo, seen_hi]: what every row's interval holds (blocks inside it need no
        mask)."""
        lo = gl.load(Lo + offs, mask=offs < count, other=limit)
        hi = gl.load(Hi + offs, mask=offs < count, other=-1)
        first = (gl.minimum(gl.min(lo, 0), limit - 1) // BLOCK) * BLOCK
        n = gl.maximum(gl.cdiv(gl.minimum(gl.max(hi, 0) + 1, limit) - first, BLOCK), 1)
        return lo, hi, first, n, gl.max(lo, 0), gl.min(hi, 0)

    @gluon.jit
    def _attn_fwd_hopper(q_desc, k_desc, v_desc, Out, Lse, RowLo, RowHi, stride_ob, stride_oh, stride_om, stride_od,
                         H, GROUP, L, S, qk_scale, cap_scale,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                         EVEN_S: gl.constexpr, V_BUFS: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                         BH_GROUP: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        bh, b, h, hk, q_lo, offs_m, row_lo, row_hi, lo, n, seen_lo, seen_hi = _query_block(
            RowLo, RowHi, H, GROUP, L, S, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, BH_GROUP, row_s)

        # the (1, 1, rows, D) tiles the descriptors load, viewed as (rows, D) by the products
        q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [V_BUFS, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [V_BUFS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(k_bar.index(i), count=1)
        for i in gl.static_range(V_BUFS):
            mbarrier.init(v_bar.index(i), count=1)
        fence_async_shared()

        _load(q_desc, b, h, q_lo, q_bar, q_smem, True)
        for i in gl.static_range(2):
            _load(k_desc, b, hk, lo + i * BLOCK_N, k_bar.index(i), k_smem.index(i), i < n)
        for i in gl.static_range(V_BUFS):
            _load(v_desc, b, hk, lo + i * BLOCK_N, v_bar.index(i), v_smem.index(i), i < n)
        q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, phase=0)
        mbarrier.wait(k_bar.index(0), phase=0)
        s = warpgroup_mma(q_tile, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        _load(k_desc, b, hk, lo + 2 * BLOCK_N, k_bar.index(0), k_smem.index(0), 2 < n)  # K_0 read: takes K_2
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, cap_scale, offs_m, lo, q_lo, S, row_lo, row_hi,
                                           seen_lo, seen_hi, BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP, s_layout)
        for j in range(1, n):
            buf = j % 2
            prev = (j - 1) % V_BUFS
            mbarrier.wait(k_bar.index(buf), phase=(j // 2) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(buf).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            mbarrier.wait(v_bar.index(prev), phase=((j - 1) // V_BUFS) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j done; P_{j-1} V_{j-1} may still run
            _load(k_desc, b, hk, lo + (j + 2) * BLOCK_N, k_bar.index(buf), k_smem.index(buf), j + 2 < n)
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, cap_scale, offs_m, lo + j * BLOCK_N, q_lo, S,
                                               row_lo, row_hi, seen_lo, seen_hi, BLOCK_N, CAUSAL, EVEN_S, INTERVALS,
                                               SOFTCAP, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _load(v_desc, b, hk, lo + (j - 1 + V_BUFS) * BLOCK_N, v_bar.index(prev), v_smem.index(prev),
                  j - 1 + V_BUFS < n)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        last = n - 1
        mbarrier.wait(v_bar.index(last % V_BUFS), phase=(last // V_BUFS) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                            v_smem.index(last % V_BUFS).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(k_bar.index(i))
        for i in gl.static_range(V_BUFS):
            mbarrier.invalidate(v_bar.index(i))

        if INTERVALS:  # a row without keys: output 0, logsumexp +inf (as the Triton kernel writes)
            has_keys = l_i > 0.0
            l_safe = gl.where(has_keys, l_i, 1.0)
            acc = acc * gl.expand_dims(gl.convert_layout(gl.where(has_keys, 1.0 / l_safe, 0.0), row_o), 1)
            lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        else:  # every row sees at least key 0: l > 0
            acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
            lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        gl.store(Lse + bh.to(gl.int64) * L + offs_m, lse, mask=offs_m < L)
        offs_mo = q_lo + gl.arange(0, BLOCK_M, layout=row_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = (Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
                + gl.expand_dims(offs_mo, 1) * stride_om + gl.expand_dims(offs_d, 0) * stride_od)
        gl.store(ptrs, acc.to(dtype), mask=gl.expand_dims(offs_mo < L, 1))


# ----------------------------------------------------------------------------- forward, warp-specialized

# Calls whose output the TMA can store run this forward (see _warp_specialized): a program is a producer warpgroup
# issuing every TMA load and two or three consumers of 64 query rows each that share every K/V tile (a half or a third
# of the shared memory traffic of 64-row programs); the producer hands its registers to the consumers (setmaxnreg).
# Two consumers (232 registers each) run the intra-warpgroup overlap above; three (160 each, D64, FA3's
# choice there) run one block at a time, S and P of one block live, and overlap only with each other: against two
# with the overlap, 1.06-1.14x at D64 L = 2K-16K not causal (H100, 2026-11-26, run 6608e51; three with the overlap
# spilled, 0.39x).
# Persistent programs (one per SM looping over tiles) load the next tile while the consumers finish this one.
# (K/V ring depth, persistent, consumers, fewest keys) per (head dim, causal): the fastest of the variants in direct
# A/Bs on an H200 and an H100 (bf16, B*L = 16384, H*D = 2048; benchmarks/results/h100-attention-experiments.md).
# Causal programs are persistent too, each taking the tiles ``_causal_schedule`` deals it (every programs-th tile
# left the long ones of each head group to the same programs: 0.74-0.91x of one program a tile at D128). Against one
# program a tile (H100, 2026-11-26, run 654a0d8): D128 1.07x / 1.03x / 0.99x at L = 2K / 4K / 16K; D64 (two
# consumers, 3-deep ring) 1.06x / 1.10x / 1.04x / 1.04x at 2K / 4K / 8K / 16K against the routing before (the forward
# above below 8K keys), and three consumers with a 2-deep ring 1.00x / 1.07x / 1.07x / 1.11x over that
# (unscheduled, three consumers had been 0.61-0.96x). At D64 the forward above keeps the calls
# with fewer keys: not causal below 2K (1.00x at 1K and 2K in a direct A/B, 0.94-0.95x at 1K against the previous
# benchmark tables on both cards), causal below 2K (128-key blocks mask more of the diagonal where a causal row has
# few blocks).
# D256 (H100, 2026-11-26, code at e5bb92e, forward TFLOP/s at L 1K / 2K / 4K / 16K against the Triton forward): two
# consumers on 32-key blocks, persistent, not causal 2-deep ring 475 / 506 / 529 / 553 (Triton 363 / 410 / 432 / 432;
# the forward above with 64 x 32 tiles 438 / 457 / 481 / 499), causal 3-deep 281 / 473 / 543 / 525 (2-deep 388 / 484
# / 494 / 503; Triton 273 / 332 / 377 / 449).
_WS_CONFIGS = {(64, False): (4, True, 3, 2048), (64, True): (2, True, 3, 2048), (128, False): (2, True, 2, 0),
               (128, True): (2, True, 2, 0), (256, False): (2, True, 2, 0), (256, True): (3, True, 2, 0)}
# D128 causal calls with more keys than this keep one program a tile: persistent 0.96-0.99x there at 16K (three runs),
# 1.03-1.07x at 2K-4K.
PERSISTENT_CAUSAL_MAX_KEYS = {64: float("inf"), 128: 8192, 256: float("inf")}
# Three consumers were measured on L = S calls from 2K rows; on fewer query rows a 192-row tile leaves up to a third of
# its rows empty (L = 1000: 13% more rows computed than with 128-row tiles, about their gain), so those keep two
# consumers (7f9ca96's config, 3-deep ring).
THREE_CONSUMERS_MIN_ROWS = 2048
# Key block of the warp-specialized forward per head dim (D256: 64 KB of Q and 64 KB of O staging for two consumers
# leave room for 32-key K/V blocks, 16 KB each, in a 2- or 3-deep ring).
WS_BLOCK_N = {64: 128, 128: 128, 256: 32}
# Q sets of a persistent program (a tile's Q tiles, one a consumer) per (head dim, causal): with two, the next tile's
# Q loads while this one runs, so the producer goes straight on from one tile's K and V blocks to the next one's
# instead of waiting for every consumer to finish with the last Q (with three consumers, their whole tile). Forward
# against one set (H200, L 2K / 4K / 16K, best of 3 shuffled rounds): D64 not causal 1.010 / 1.015 / 1.013x, causal
# 1.029 / 0.999 / 1.009x, D128 causal 1.028 / 1.010x (16K keeps one program a tile); D128 not causal 0.986-0.989x
# (229 KB of shared memory with two; its two consumers release Q after their last S, so the next one loads under
# the last P V already); D64 causal windows of 4096 / 8192 keys 0.992 / 1.008x. D256: no room.
WS_Q_STAGES = {(64, False): 2, (64, True): 2, (128, False): 1, (128, True): 2, (256, False): 1, (256, True): 1}
ws_enabled = True  # False: the forward above for every call (A/B timing)
ws_schedule = True  # persistent causal programs take their tiles from _causal_schedule's table (A/B switch)


# Key intervals (windows, packed sequences) too, (K/V ring depth, persistent, consumers, fewest keys a row) per head
# dim, keys a row as the ops estimate them (a window's width, or half the longest sequence when causal). Against the
# forward above (H100, 16K-32K tokens, H*D = 2048): D128 one program a tile from 2048
# keys, window 2048 1.14x, 4096 1.01x, documents of up to 4-5.5K tokens 0.97-1.08x (window 1024 0.96x, the
# benchmark's documents of up to 2663 tokens 0.93x: short intervals waste more of 128-key blocks); D64 persistent from
# 4096 keys, window 4096 1.04x (one program a tile: 1.01x; H200 1.03x), documents with a 4096 window 1.00x
# (persistent programs are dealt tiles statically; at D64 window 2048 and documents below 4096 keys 0.97-1.03x).
# D256 one program a tile at every width (H200, 2026-11-26 at 1c2a027, 16K tokens causal, H = 8): windows 1024 /
# 2048 / 4096 / 8192 forward 1.22x / 1.10x / 1.07x / 1.15x the Triton forward (persistent: 0.93-1.22x; the forward
# above: 0.94-1.05x), forward+backward 1.02-1.03x.
_WS_INTERVAL_CONFIGS = {64: (3, True, 2, 4096), 128: (2, False, 2, 2048), 256: (2, False, 2, 0)}


def _warp_specialized(q: torch.Tensor, k: torch.Tensor, is_causal: bool, out: torch.Tensor,
                      intervals: tuple | None, keys_per_row: float | None = None) -> tuple[int, bool, int] | None:
    """The warp-specialized forward's (ring depth, persistent, consumers) for this call, or None where the forward
    above runs; ``keys_per_row`` as ``applies``'."""
    if not ws_enabled or not _tma_compatible(out):
        return None
    if intervals is not None:
        *config, min_keys = _WS_INTERVAL_CONFIGS[q.shape[-1]]
        return tuple(config) if keys_per_row is not None and keys_per_row >= min_keys else None
    stages, persistent, consumers, min_keys = _WS_CONFIGS[(q.shape[-1], is_causal)]
    if k.shape[2] < min_keys:
        return None
    if is_causal and k.shape[2] > PERSISTENT_CAUSAL_MAX_KEYS[q.shape[-1]]:
        persistent = False
    if consumers == 3 and q.shape[2] < THREE_CONSUMERS_MIN_ROWS:
        return 3, persistent, 2
    return stages, persistent, consumers


# The schedule's cost of a tile: its key blocks plus this many for its Q load, first product and O store (0, 1, 2 and
# 4 within 3% of each other; 1 the best in 6 of 6 causal shapes, by 1-4%).
TILE_OVERHEAD_BLOCKS = 1


def _causal_query_block(t: int, num_m: int, num_bh: int) -> int:
    """The query block of causal tile t in launch order: ``_causal_order``'s on the host."""
    r = t % (CAUSAL_HEAD_GROUP * num_m)
    heads = min(CAUSAL_HEAD_GROUP, num_bh - t // (CAUSAL_HEAD_GROUP * num_m) * CAUSAL_HEAD_GROUP)
    return num_m - 1 - r // heads


@functools.lru_cache(maxsize=32)
def _causal_schedule(num_m: int, num_bh: int, S: int, tile_rows: int, block_n: int, programs: int,
                     device: torch.device) -> torch.Tensor:
    """Which causal tiles each persistent program takes, as the GPU's block scheduler would deal them to programs of
    one tile each: the tiles in launch order (``_causal_order``: groups of heads, longest rows first), each to the
    program that frees up first by the tiles' key blocks. int32 [start (programs + 1) | tiles by program]. Dealing
    every programs-th tile instead left the long tiles of each group to the same programs (0.74-0.91x of one program a
    tile at D128). Built once per shape (a model's layers share it)."""
    free = [(0, p) for p in range(programs)]
    tiles: list[list[int]] = [[] for _ in range(programs)]
    for t in range(num_m * num_bh):
        q_hi = (_causal_query_block(t, num_m, num_bh) + 1) * tile_rows  # one past the tile's last row
        busy, p = heapq.heappop(free)
        tiles[p].append(t)
        heapq.heappush(free, (busy + cdiv(min(q_hi, S), block_n) + TILE_OVERHEAD_BLOCKS, p))
    start = list(itertools.accumulate((len(x) for x in tiles), initial=0))
    return torch.tensor(start + [t for x in tiles for t in x], dtype=torch.int32, device=device)


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _forward_warp_specialized(q, k, v, is_causal: bool, qk_scale: float, cap_scale: float, out: torch.Tensor,
                              lse: torch.Tensor, intervals: tuple | None, stages: int, persistent: bool,
                              consumers: int) -> None:
    B, H, L, D = q.shape
    S = k.shape[2]
    block_m, block_n = 64, WS_BLOCK_N[D]
    num_m = cdiv(L, consumers * block_m)
    num_tiles = num_m * B * H
    grid = (min(num_tiles, _sm_count(q.device.index)) if persistent else num_tiles,)
    row_lo, row_hi = intervals[:2] if intervals is not None else (lse, lse)
    scheduled = ws_schedule and persistent and is_causal and intervals is None
    schedule = _causal_schedule(num_m, B * H, S, consumers * block_m, block_n, grid[0], q.device) if scheduled else lse
    launch(_attn_fwd_ws, grid,
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(out, block_m), lse,
        row_lo, row_hi, schedule, num_tiles, num_m, H, H // k.shape[1], L, S, qk_scale, cap_scale, HEAD_DIM=D,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=is_causal, EVEN_S=S % block_n == 0, INTERVALS=intervals is not None,
        SOFTCAP=cap_scale > 0.0, STAGES=stages, CONSUMERS=consumers, BH_GROUP=CAUSAL_HEAD_GROUP,
        SCHEDULE=scheduled, Q_STAGES=WS_Q_STAGES[(D, is_causal)] if persistent else 1, num_warps=4,
    )


if gluon is not None:

    @gluon.jit
    def _ws_tile(t, num_tiles, num_m, L, S, H, GROUP, RowLo, RowHi, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, CONSUMERS: gl.constexpr, BH_GROUP: gl.constexpr,
                 layout: gl.constexpr):
        """Tile t's (b*H + h, b, h, key/value head, first row) and key blocks [first, first + n * BLOCK_N): those of
        any of its CONSUMERS 64-row parts (with INTERVALS, the union of theirs). The tiles of one (batch, head) are
        consecutive (programs running together share its K/V in L2), the longest causal rows first."""
        if CAUSAL:
            bh, pid_m = _causal_order(t, num_m, num_tiles // num_m, BH_GROUP)
        else:
            bh = t // num_m
            pid_m = t % num_m
        q_lo = pid_m * CONSUMERS * BLOCK_M
        if INTERVALS:
            offs = q_lo + gl.arange(0, BLOCK_M, layout=layout)
            _, _, first, n0, _, _ = _block_intervals(RowLo, RowHi, offs, L, S, BLOCK_N)
            end = first + n0 * BLOCK_N
            for c in gl.static_range(1, CONSUMERS):
                _, _, first_c, n_c, _, _ = _block_intervals(RowLo, RowHi, offs + c * BLOCK_M, L, S, BLOCK_N)
                first = gl.minimum(first, first_c)
                end = gl.maximum(end, first_c + n_c * BLOCK_N)
            n = (end - first) // BLOCK_N
        else:
            first = 0
            if CAUSAL:
                n = gl.cdiv(gl.minimum(q_lo + CONSUMERS * BLOCK_M, S), BLOCK_N)
            else:
                n = gl.cdiv(S, BLOCK_N)
        h = bh % H
        return bh, bh // H, h, h // GROUP, q_lo, first, n

    @gluon.jit
    def _ws_tiles(num_tiles, Schedule, SCHEDULE: gl.constexpr):
        """(first, count) of this program's tiles: every num_programs-th from its id, or with SCHEDULE its slice
        [start[p], start[p + 1]) of the host's table (``_causal_schedule``)."""
        p = gl.program_id(0)
        if SCHEDULE:
            first = gl.load(Schedule + p)
            return first, gl.load(Schedule + p + 1) - first
        P = gl.num_programs(0)
        return 0, (num_tiles - p + P - 1) // P

    @gluon.jit
    def _ws_tile_id(first, r, Schedule, SCHEDULE: gl.constexpr):
        """The r-th tile of this program (``_ws_tiles``)."""
        if SCHEDULE:
            return gl.load(Schedule + gl.num_programs(0) + 1 + first + r)
        return gl.program_id(0) + r * gl.num_programs(0)

    @gluon.jit
    def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty,
                     v_empty, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMERS: gl.constexpr, BH_GROUP: gl.constexpr, SCHEDULE: gl.constexpr,
                     Q_STAGES: gl.constexpr):
        """Every TMA load: a tile's Q tiles (one a consumer) into the next of Q_STAGES sets once every consumer is
        done with that set's last tile, then its K and V blocks through STAGES-deep rings, a slot refilled once every
        consumer released it. Ring positions and barrier phases count blocks (and Q sets) across the program's
        tiles."""
        rows: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        kv = 0
        i = 0
        mine, count = _ws_tiles(num_tiles, Schedule, SCHEDULE)
        for r in range(count):
            t = _ws_tile_id(mine, r, Schedule, SCHEDULE)
            bh, b, h, hk, q_lo, first, n = _ws_tile(t, num_tiles, num_m, L, S, H, GROUP, RowLo, RowHi, BLOCK_M,
                                                    BLOCK_N, CAUSAL, INTERVALS, CONSUMERS, BH_GROUP, rows)
            qs = i % Q_STAGES
            mbarrier.wait(q_empty.index(qs), phase=((i // Q_STAGES) & 1) ^ 1, pred=i >= Q_STAGES)
            mbarrier.expect(q_full.index(qs), CONSUMERS * q_desc.block_type.nbytes)
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [b, h, q_lo + c * BLOCK_M, 0], q_full.index(qs),
                                                q_smem.index(qs * CONSUMERS + c))
            for j in range(n):
                slot = kv % STAGES
                mbarrier.wait(k_empty.index(slot), phase=((kv // STAGES) & 1) ^ 1, pred=kv >= STAGES)
                _load(k_desc, b, hk, first + j * BLOCK_N, k_full.index(slot), k_smem.index(slot), True)
                mbarrier.wait(v_empty.index(slot), phase=((kv // STAGES) & 1) ^ 1, pred=kv >= STAGES)
                _load(v_desc, b, hk, first + j * BLOCK_N, v_full.index(slot), v_smem.index(slot), True)
                kv += 1
            i += 1

    @gluon.jit
    def _ws_release(k_full, v_full, k_empty, v_empty, kv, count, STAGES: gl.constexpr):
        """Releases ``count`` blocks this warpgroup does not read, each once loaded (its empty barrier's phase counts
        every block of the ring)."""
        for _ in range(count):
            slot = kv % STAGES
            mbarrier.wait(k_full.index(slot), phase=(kv // STAGES) & 1)
            mbarrier.arrive(k_empty.index(slot), count=1)
            mbarrier.wait(v_full.index(slot), phase=(kv // STAGES) & 1)
            mbarrier.arrive(v_empty.index(slot), count=1)
            kv += 1
        return kv

    @gluon.jit
    def _ws_consumer(q_smem, k_smem, v_smem, o_smem, o_desc, q_full, q_empty, k_full, v_full, k_empty, v_empty, Lse,
                     RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, qk_scale, cap_scale, WG: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                     EVEN_S: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMERS: gl.constexpr, BH_GROUP: gl.constexpr, SCHEDULE: gl.constexpr,
                     Q_STAGES: gl.constexpr):
        """Warpgroup WG's 64 rows of each tile: the forward above's loop on the shared K/V rings (with two
        consumers; three take one block at a time), over the tile's blocks its rows reach (the others released
        unread), O stored by TMA."""
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        kv = 0
        i = 0
        mine, count = _ws_tiles(num_tiles, Schedule, SCHEDULE)
        for r in range(count):
            t = _ws_tile_id(mine, r, Schedule, SCHEDULE)
            bh, b, h, hk, q_lo, first, n_tile = _ws_tile(t, num_tiles, num_m, L, S, H, GROUP, RowLo, RowHi, BLOCK_M,
                                                         BLOCK_N, CAUSAL, INTERVALS, CONSUMERS, BH_GROUP, row_s)
            m0 = q_lo + WG * BLOCK_M
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
            if INTERVALS:  # this warpgroup's rows reach key blocks [lo, lo + n * BLOCK_N) of the tile's
                row_lo, row_hi, lo, n, seen_lo, seen_hi = _block_intervals(RowLo, RowHi, offs_m, L, S, BLOCK_N)
            else:
                row_lo, row_hi, lo, n, seen_lo, seen_hi = offs_m, offs_m, 0, n_tile, 0, 0
                if CAUSAL:  # its rows may end a block before the tile's
                    n = gl.minimum(n_tile, gl.cdiv(gl.minimum(m0 + BLOCK_M, S), BLOCK_N))
            lead = (lo - first) // BLOCK_N
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
            qs = i % Q_STAGES
            q_tile = q_smem.index(qs * CONSUMERS + WG).reshape([BLOCK_M, HEAD_DIM])
            mbarrier.wait(q_full.index(qs), phase=(i // Q_STAGES) & 1)
            kv = _ws_release(k_full, v_full, k_empty, v_empty, kv, lead, STAGES)

            if m0 >= L:  # rows past the end (the last tile's last consumer(s) when L is not a multiple of the tile):
                # nothing to compute (it was a whole causal row of blocks before: 6% of a D64 causal 2K head)
                mbarrier.arrive(q_empty.index(qs), count=1)
                kv = _ws_release(k_full, v_full, k_empty, v_empty, kv, n_tile - lead, STAGES)
            elif CONSUMERS == 2:
                slot = kv % STAGES
                mbarrier.wait(k_full.index(slot), phase=(kv // STAGES) & 1)
                s = warpgroup_mma(q_tile, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                mbarrier.arrive(k_empty.index(slot), count=1)
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, cap_scale, offs_m, lo, m0, S, row_lo,
                                                   row_hi, seen_lo, seen_hi, BLOCK_N, CAUSAL, EVEN_S, INTERVALS,
                                                   SOFTCAP, s_layout)
                for j in range(1, n):
                    prev, prev_phase = slot, (kv // STAGES) & 1
                    kv += 1
                    slot = kv % STAGES
                    mbarrier.wait(k_full.index(slot), phase=(kv // STAGES) & 1)
                    s = warpgroup_mma(q_tile, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                                      s_zero, use_acc=False, is_async=True)
                    mbarrier.wait(v_full.index(prev), phase=prev_phase)
                    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                        v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j done; P_{j-1} V_{j-1} may still run
                    mbarrier.arrive(k_empty.index(slot), count=1)
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, cap_scale, offs_m,
                                                       lo + j * BLOCK_N, m0, S, row_lo, row_hi, seen_lo, seen_hi,
                                                       BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP, s_layout)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                mbarrier.arrive(q_empty.index(qs), count=1)  # this tile's S products are done: the next Q may come
                mbarrier.wait(v_full.index(slot), phase=(kv // STAGES) & 1)
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                    v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(slot), count=1)
                kv = _ws_release(k_full, v_full, k_empty, v_empty, kv + 1, n_tile - lead - n, STAGES)
            else:  # three warpgroups: one's softmax runs under the others' products (S and P of one block live)
                for j in range(n):
                    slot = kv % STAGES
                    mbarrier.wait(k_full.index(slot), phase=(kv // STAGES) & 1)
                    s = warpgroup_mma(q_tile, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                                      s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                    mbarrier.arrive(k_empty.index(slot), count=1)
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, cap_scale, offs_m,
                                                       lo + j * BLOCK_N, m0, S, row_lo, row_hi, seen_lo, seen_hi,
                                                       BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP, s_layout)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    mbarrier.wait(v_full.index(slot), phase=(kv // STAGES) & 1)
                    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                        v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    mbarrier.arrive(v_empty.index(slot), count=1)
                    kv += 1
                mbarrier.arrive(q_empty.index(qs), count=1)
                kv = _ws_release(k_full, v_full, k_empty, v_empty, kv, n_tile - lead - n, STAGES)
            i += 1

            if INTERVALS:  # a row without keys: output 0, logsumexp +inf (as the Triton kernel writes)
                has_keys = l_i > 0.0
                l_safe = gl.where(has_keys, l_i, 1.0)
                acc = acc * gl.expand_dims(gl.convert_layout(gl.where(has_keys, 1.0 / l_safe, 0.0), row_o), 1)
                lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("inf"))
            else:  # every row sees key 0: l > 0
                acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
                lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
            gl.store(Lse + bh.to(gl.int64) * L + offs_m, lse, mask=offs_m < L)
            # O through shared memory and a TMA store (rows past L clipped): no pointer tile held in registers
            tma.store_wait(0)  # this warpgroup's previous store has left the buffer
            o_smem.index(WG).reshape([BLOCK_M, HEAD_DIM]).store(acc.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [b, h, m0, 0], o_smem.index(WG))
        tma.store_wait(0)

    @gluon.jit
    def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, Lse, RowLo, RowHi, Schedule, num_tiles, num_m, H, GROUP, L, S,
                     qk_scale, cap_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     CAUSAL: gl.constexpr, EVEN_S: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                     STAGES: gl.constexpr, CONSUMERS: gl.constexpr, BH_GROUP: gl.constexpr, SCHEDULE: gl.constexpr,
                     Q_STAGES: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [Q_STAGES * CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM], o_desc.layout)
        q_full = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_STAGES):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=CONSUMERS)  # one arrival a consumer frees the set
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        fence_async_shared()

        # this program's 4 warps are the producer (the default partition, left with 24-40 registers a thread); the
        # consumers are 4-warp workers with the rest: 232 registers each for two (a 64 x 128 fp32 O plus S and P in
        # flight), 160 each for three (D64: a 64 x 64 O). The partition lists are written out: Triton 3.6's Gluon
        # frontend takes each partition's arguments only as a literal tuple (a tuple variable of them loses the
        # constexprs; one holding the function does not compile), so the two counts cannot share one list.
        if CONSUMERS == 3:
            gl.warp_specialize([
                (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full,
                                k_empty, v_empty, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, BLOCK_M,
                                BLOCK_N, CAUSAL, INTERVALS, STAGES, CONSUMERS, BH_GROUP, SCHEDULE, Q_STAGES)),
                (_ws_consumer, (q_smem, k_smem, v_smem, o_smem, o_desc, q_full, q_empty, k_full, v_full, k_empty,
                                v_empty, Lse, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, qk_scale,
                                cap_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP,
                                STAGES, CONSUMERS, BH_GROUP, SCHEDULE, Q_STAGES)),
                (_ws_consumer, (q_smem, k_smem, v_smem, o_smem, o_desc, q_full, q_empty, k_full, v_full, k_empty,
                                v_empty, Lse, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, qk_scale,
                                cap_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP,
                                STAGES, CONSUMERS, BH_GROUP, SCHEDULE, Q_STAGES)),
                (_ws_consumer, (q_smem, k_smem, v_smem, o_smem, o_desc, q_full, q_empty, k_full, v_full, k_empty,
                                v_empty, Lse, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, qk_scale,
                                cap_scale, 2, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP,
                                STAGES, CONSUMERS, BH_GROUP, SCHEDULE, Q_STAGES)),
            ], [4, 4, 4], [160, 160, 160])
        else:
            gl.warp_specialize([
                (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full,
                                k_empty, v_empty, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, BLOCK_M,
                                BLOCK_N, CAUSAL, INTERVALS, STAGES, CONSUMERS, BH_GROUP, SCHEDULE, Q_STAGES)),
                (_ws_consumer, (q_smem, k_smem, v_smem, o_smem, o_desc, q_full, q_empty, k_full, v_full, k_empty,
                                v_empty, Lse, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, qk_scale,
                                cap_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP,
                                STAGES, CONSUMERS, BH_GROUP, SCHEDULE, Q_STAGES)),
                (_ws_consumer, (q_smem, k_smem, v_smem, o_smem, o_desc, q_full, q_empty, k_full, v_full, k_empty,
                                v_empty, Lse, RowLo, RowHi, Schedule, num_tiles, num_m, L, S, H, GROUP, qk_scale,
                                cap_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, EVEN_S, INTERVALS, SOFTCAP,
                                STAGES, CONSUMERS, BH_GROUP, SCHEDULE, Q_STAGES)),
            ], [4, 4], [232, 232])


# ----------------------------------------------------------------------------- backward: dK and dV

# (BLOCK_N keys, BLOCK_M queries, warps) per head dim: a program owns one key block, its dK and dV stay in registers
# while query blocks stream through two-deep TMA rings. One warpgroup of 64 keys, two programs an SM (96 KB of shared
# memory each at D128), so that one program's softmax runs under the other's products: with each step's lse and delta
# loaded under the previous step's dV and dK products, 1.06-1.13x forward+backward over (128 keys, 8 warps), whose two
# warpgroups shared the query blocks and so ran in step (D128, H100, L 2K-16K, causal and not; D64: 1.02-1.06x, and
# 1.02-1.06x the Triton dK/dV at D64 causal, which used to keep it). Also the fastest with key intervals (packed
# documents, windows), whose edge blocks waste less with fewer keys (1.06-1.15x over 128 keys, H100). D256: a 64 x
# 256 dK and dV do not fit one warpgroup's registers; two warpgroups (8 warps, one program an SM: 196 KB of shared
# memory) share the 64 keys, each with half of every tile's columns (217-229 registers, no spills): forward+backward
# 1.46-1.58x the Triton dK/dV kernel's (H200, B*L = 16384, H*D = 2048, L 1K-16K, causal from 4K).
_DKDV_CONFIGS = {64: (64, 64, 4), 128: (64, 64, 4), 256: (64, 64, 8)}
backward_enabled = True  # False: the Triton dK/dV kernel (A/B timing)


def _backward_applies(q, k, v, grad_out, plain: bool, scale: float, is_causal: bool,
                      keys_per_row: float | None = None) -> bool:
    """As ``applies`` (grad_out too in TMA's reach)."""
    if gluon is None or not enabled or not plain or scale <= 0.0 or not q.is_cuda:
        return False
    if not _is_hopper(q.device) or k.shape[2] == 0 or q.shape[2] == 0:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype == grad_out.dtype):
        return False
    if q.shape[-1] not in BACKWARD_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    if _flops(q, k, is_causal, keys_per_row) < MIN_FLOPS:
        return False
    return all(_tma_compatible(t) for t in (q, k, v, grad_out))


def backward_passes(q, k, v, grad_out, plain: bool, scale: float, is_causal: bool,
                    keys_per_row: float | None = None) -> tuple[bool, bool]:
    """(dK/dV, dQ): which backward passes run here, each where it measured faster (``_DKDV_CONFIGS``,
    ``_DQ_CONFIGS``); the shared checks run once per backward."""
    if not (backward_enabled or dq_enabled) or not _backward_applies(q, k, v, grad_out, plain, scale, is_causal,
                                                                      keys_per_row):
        return False, False
    return backward_enabled, dq_enabled


def attention_backward_dkdv(q, k, v, grad_out, lse, delta, is_causal: bool, qk_scale: float, scale: float,
                            dk: torch.Tensor, dv: torch.Tensor, intervals: tuple[torch.Tensor, ...] | None = None,
                            cap_scale: float = 0.0) -> None:
    """Writes dK, dV (any strides) for q (B, H, L, D), k/v (B, H_kv, S, D); ``lse`` (natural log) and ``delta``
    (rowsum(dO * O)) fp32 (B, H, L) contiguous; ``qk_scale`` in base-2 units, ``scale`` the softmax scale;
    ``intervals`` and ``cap_scale`` as ``attention_forward``'s."""
    B, H, L, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    block_n, block_m, warps = _DKDV_CONFIGS[D]
    grid = (cdiv(S, block_n), B * H_kv)
    row_lo, row_hi, col_lo, col_hi = intervals if intervals is not None else (lse,) * 4
    launch(_attn_bwd_dkdv_hopper, grid,
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(grad_out, block_m),
        lse, delta, dk, dv, row_lo, row_hi, col_lo, col_hi, *dk.stride(), *dv.stride(), H, H // H_kv, L, S,
        qk_scale, scale, cap_scale, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=is_causal,
        INTERVALS=intervals is not None, SOFTCAP=cap_scale > 0.0, num_warps=warps,
    )


if gluon is not None:

    @gluon.jit
    def _attn_bwd_dkdv_hopper(q_desc, k_desc, v_desc, do_desc, Lse, Delta, DK, DV, RowLo, RowHi, ColLo, ColHi,
                              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                              stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                              H, GROUP, L, S, qk_scale, scale, cap_scale,
                              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                              num_warps: gl.constexpr):
        """One key block: S^T = K Q^T and dP^T = V dO^T for each query block (of every query head sharing this
        key head), P^T = exp(S^T - lse), dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q, all in transposed
        (key x query) tiles so that P^T and dS^T feed the next products from registers. SOFTCAP: S^T is
        tanh(S^T * cap_scale) and dS^T gains the factor 1 - tanh^2."""
        dtype: gl.constexpr = q_desc.dtype
        # 8 warps (D256): two warpgroups on the same 64 keys, each with half of every tile's columns (queries in
        # S^T and dP^T, head dims in dK and dV), so that dK and dV fit in registers
        WARPS_N: gl.constexpr = num_warps // 4
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPS_N],
                                                           instr_shape=[16, BLOCK_M // WARPS_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPS_N],
                                                             instr_shape=[16, HEAD_DIM // WARPS_N, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

        pid_n = gl.program_id(0)
        bhk = gl.program_id(1)
        H_KV = H // GROUP
        b = bhk // H_KV
        hk = bhk % H_KV
        n0 = pid_n * BLOCK_N
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=row_s)
        if INTERVALS:  # the query blocks the keys' intervals reach; [seen_lo, seen_hi]: rows every key has
            _, _, m_start, n_m, seen_lo, seen_hi = _block_intervals(ColLo, ColHi, offs_n, S, L, BLOCK_M)
        else:
            seen_lo, seen_hi = 0, 0
            if CAUSAL:  # queries before this key block see none of it
                m_start = (n0 // BLOCK_M) * BLOCK_M
            else:
                m_start = 0
            n_m = gl.maximum(gl.cdiv(L - m_start, BLOCK_M), 0)
        total = GROUP * n_m

        k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        do_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(q_bar.index(i), count=1)
            mbarrier.init(do_bar.index(i), count=1)
        fence_async_shared()

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_bar, v_smem)
        for i in gl.static_range(2):
            h = hk * GROUP + i // gl.maximum(n_m, 1)
            m0 = m_start + (i % gl.maximum(n_m, 1)) * BLOCK_M
            _load(q_desc, b, h, m0, q_bar.index(i), q_smem.index(i), i < total)
            _load(do_desc, b, h, m0, do_bar.index(i), do_smem.index(i), i < total)
        k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        lse2, delta = _step_stats(Lse, Delta, b * H + hk * GROUP, m_start + gl.arange(0, BLOCK_M, layout=col_s), L,
                                  total > 0)
        mbarrier.wait(kv_bar, phase=0)
        for i in range(total):
            buf = i % 2
            phase = (i // 2) & 1
            m0 = m_start + (i % n_m) * BLOCK_M
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_s)
            q_tile = q_smem.index(buf).reshape([BLOCK_M, HEAD_DIM])
            do_tile = do_smem.index(buf).reshape([BLOCK_M, HEAD_DIM])
            mbarrier.wait(q_bar.index(buf), phase=phase)
            s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_bar.index(buf), phase=phase)
            dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))
            if SOFTCAP:
                s_t = _tanh(s_t * cap_scale)
            p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
            if CAUSAL:
                if m0 < n0 + BLOCK_N:  # only the blocks that cross the diagonal pay for the mask
                    p_t = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1), p_t, 0.0)
            if INTERVALS:
                if m0 < seen_lo or m0 + BLOCK_M - 1 > seen_hi:  # query i keeps keys [row_lo[i], row_hi[i]]
                    row_lo = gl.load(RowLo + offs_m, mask=offs_m < L, other=S)
                    row_hi = gl.load(RowHi + offs_m, mask=offs_m < L, other=-1)
                    keep = ((gl.expand_dims(offs_n, 1) >= gl.expand_dims(row_lo, 0))
                            & (gl.expand_dims(offs_n, 1) <= gl.expand_dims(row_hi, 0)))
                    p_t = gl.where(keep, p_t, 0.0)
            dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_tile, dv, is_async=True)
            if SOFTCAP:  # through the cap to the raw score, folded in now so that tanh's tile dies here
                p_t = p_t * (1.0 - s_t * s_t)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, ))
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
            dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_tile, dk, is_async=True)
            # the next step's lse and delta, their latency hidden under this step's dV and dK products
            nxt = i + 1
            lse2, delta = _step_stats(Lse, Delta, b * H + hk * GROUP + nxt // n_m,
                                      m_start + (nxt % n_m) * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s), L,
                                      nxt < total)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            # this buffer's q and dO are read: it takes iteration i + 2's
            nxt = i + 2
            h_next = hk * GROUP + nxt // n_m
            m_next = m_start + (nxt % n_m) * BLOCK_M
            _load(q_desc, b, h_next, m_next, q_bar.index(buf), q_smem.index(buf), nxt < total)
            _load(do_desc, b, h_next, m_next, do_bar.index(buf), do_smem.index(buf), nxt < total)
        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(q_bar.index(i))
            mbarrier.invalidate(do_bar.index(i))

        offs_na = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        rows = gl.expand_dims(offs_na < S, 1)
        dk_ptrs = (DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh
                   + gl.expand_dims(offs_na, 1) * stride_dkn + gl.expand_dims(offs_d, 0) * stride_dkd)
        gl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=rows)
        dv_ptrs = (DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh
                   + gl.expand_dims(offs_na, 1) * stride_dvn + gl.expand_dims(offs_d, 0) * stride_dvd)
        gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=rows)


# ----------------------------------------------------------------------------- backward: one pass

# FA3's Hopper backward: a program owns BLOCK_N = 128 keys (two consumer warpgroups of 64 keys, dK and dV in their
# registers) and streams the query blocks of every query head sharing them, fed by a TMA producer warpgroup. A step
# issues S^T = K Q^T and dP^T = V dO^T, forms P^T and dS^T, issues dV += P^T dO and dK += dS^T Q from registers (RS),
# and dQ_part = dS K from shared memory (dS of both warpgroups: a barrier per step), which each warpgroup adds to an
# fp32 dQ by a TMA bulk reduction, issued and not waited for. Five tile products a step against the two passes'
# seven; the fp32 additions are unordered, so dQ is not bitwise repeatable (the two passes run in deterministic mode).
# 128 keys x 64 queries a step at D 64 and 128, each warpgroup forming half of dQ_part's head dims (FA3's D64 128 x 128
# steps, dQ_part split by queries, spilled 120-376 bytes of registers in this kernel). Key intervals (windows, packed
# sequences) and the soft-cap as in the dK/dV pass: a program walks the query blocks its keys' intervals reach, and
# masks only the steps outside the rows all its keys are seen by.
ONE_PASS_HEAD_DIMS = (64, 128)
ONE_PASS_BLOCK_N, ONE_PASS_BLOCK_M = 128, 64
# Dense D64: two steps an iteration, the second's S^T and dP^T issued behind the first's dV (``_bwd_step_pairs``),
# with 4-deep Q/dO rings: forward+backward 0.995-1.04x one step an iteration (H200, L 2K-16K, two runs of 3 rounds).
# On key intervals or soft-capped 0.86-0.97x (their masks and tanh spill registers there); D128's registers do not
# hold a second step's tiles (ptxas serializes every wgmma). Warpgroup 0 forms step a's whole dQ_part and warpgroup 1
# step b's, rather than each half the head dims of both: 1.007-1.057x forward+backward (H200, L 2K-16K, 3 rounds).
ONE_PASS_STEP_PAIRS = (64,)
# D64 one pass / two passes, fwd+bwd (H200, two runs of 3 rounds, step pairs): 2K keys 1.03-1.12x, 1K not causal
# 1.08x; single steps at 50d2cd8 measured 2K at 0.95-1.00x
ONE_PASS_D64_MIN_KEYS = 1024
# Soft-capped D64 (single steps): each consumer forms dQ_part over its own 64 keys and all head dims (``OWN_DQ``), so
# the warpgroups never wait for each other's dS^T, at twice the dQ reductions: forward+backward 1.06-1.08x sharing
# dQ_part (H200, 16K tokens, causal and not, best of 3 shuffled rounds); dense D64 (step pairs or single steps)
# 0.93-0.97x, packed documents and windows 0.99-1.01x. D128 needs 64 KB more shared memory than the SM has.
ONE_PASS_OWN_DQ_SOFTCAP = (64,)
# (head dim, causal) of the dense calls that add dQ_part by 16-byte fp32 atomics from registers into a dq32 held in
# the order of the accumulator's fragments (``_bwd_dq_red``: a warp's instruction covers 512 contiguous bytes), instead
# of staging it in shared memory for a TMA reduction, and the Q/dO ring depth that the freed shared memory then allows.
# Forward+backward against the TMA (H200, L 2K-16K, two runs of 3 shuffled rounds): D128 not causal 1.003-1.035x;
# causal 0.983-1.011x, a 1024-key window 0.92x, packed documents 0.92x (register spills there), which keep the TMA.
# D64 step pairs causal with a 6-deep ring 1.006-1.049x (4-deep 0.981-1.024x, 5-deep 0.997-1.018x); not causal
# 0.972-0.996x at 4-6 deep, which keep the TMA. Two-float atomics in dq32's row layout (a warp's instruction over eight
# 32-byte pieces) measured 0.84-0.90x.
ONE_PASS_DQ_FRAGMENTS = {(128, False): 2, (64, True): 6}
one_pass_enabled = True  # False: the two passes (A/B timing)
# The deterministic mode's dK/dV: the one pass with its dQ work compiled out (``DQ`` off: no dS^T store, no meeting
# of the warpgroups, no dQ_part) is a warp-specialized dK/dV pass, a TMA producer feeding two 64-key consumers, whose
# gradients are as repeatable as the one-warpgroup pass's (no unordered sums). It reads a step's logsumexp and delta
# from shared memory as soon as their tiles arrive, before issuing the step's S^T and dP^T (``EARLY``): behind those
# products the loads queued behind the products' shared-memory reads and the softmax waited for them (Nsight Compute,
# D128: 14% of the pass's warp-stall samples short-scoreboard, mostly the FFMAs that subtract the logsumexp); reading
# them early gave 1.006-1.040x at D64 and 1.015-1.034x at D128 not causal, while the one pass with dQ so measured
# 0.93-1.02x (48-84 more bytes spilled) and keeps the loads behind the products. Deterministic forward+backward against
# the one-warpgroup pass (H200, bf16, L 2K-16K, best of 3 shuffled rounds): dense D64 (step pairs) 1.03-1.05x, D128
# not causal 1.01-1.03x, D128 causal 1.020-1.032x from 4096 keys (0.967x at 2048), D64 soft-capped 1.03-1.04x; key
# intervals D64 0.991-1.047x, D128 0.93-0.965x, D128 soft-capped 0.87-0.88x (the cap's tile spills 112-120 bytes).
# It runs where it gained: no key intervals, D64, or D128 not soft-capped, from ``WS_DKDV_MIN_KEYS[(D, causal)]``
# keys. Its Q/dO ring is 4 deep (D128 causal 1.014-1.021x at 3 deep, 44 bytes spilled against 12; D128 not causal 3
# deep level, 0.999-1.002x; D64 6 or 8 deep 0.99-1.02x).
WS_DKDV_STAGES = 4
# Head dims whose single-step dK/dV pass (no dQ; at D64 the soft-capped calls) issues step i+1's S^T inside step i
# once its dV has run, and its dP^T once dK has (``_bwd_steps_dkdv``): soft-capped D64 deterministic forward+backward
# 1.02-1.09x waiting for both first (H200, L 2K-16K); D128 not causal 0.97-1.01x. The one pass with dQ so: D128
# 0.82-0.97x (a step then holds both slots of its two-deep Q/dO ring; not profiled), D64 against the step pairs
# 0.90-0.92x.
WS_DKDV_PIPELINED = (64,)
# (head dim, causal) of the dense calls whose deterministic dK/dV pass runs one program an SM, each taking every
# num_programs-th tile (a key block of a batch and key head, in the hardware's order), the next tile's K, V and first
# steps loaded while the last tile's dK and dV are stored: D64 not causal 1.014-1.093x deterministic forward+backward
# over a program a tile (H200, L 2K-16K, best of 3 shuffled rounds; 1.030-1.043x and 1.002-1.023x in two earlier
# forms), D64 causal 0.972-0.976x (dealt by a host-built schedule as the causal forward's: 0.975-1.005x), D128
# 0.82-1.01x. The one pass with dQ so measured 0.67-0.985x (a tile counter dealing the tiles instead: 0.86-0.996x).
WS_DKDV_PERSISTENT = ((64, False),)
WS_DKDV_MIN_KEYS = {(64, False): 2048, (64, True): 2048, (128, False): 2048, (128, True): 4096}
ws_dkdv_enabled = True  # False: the one-warpgroup dK/dV pass (A/B timing)


# A program-a-tile launch of the one pass (or of the deterministic dK/dV pass) goes out in launch order, a head's key
# blocks in turn, head by head: on causal calls the last heads' longest key blocks then start in the last wave and the
# SMs that finish first idle (each program traced on an H200: 6.2% of the SMs' time at D128 L 2K and 4K, 3.2% at D64,
# 0.5% at 16K). Dealt instead G heads at a time, the first key block of each, then their second, ... (the longest first,
# as ``_causal_order`` deals the forwards' query blocks, G a runtime value here), with G about a wave of programs over a
# head's key blocks (4 at L 4K, 2 at 8K), that idle is 0.5-0.9% and forward+backward gains: D128 L 4K / 8K 1.020-1.026x
# / 1.038x (deterministic 1.047x / 1.014x), D64 L 4K 1.009-1.024x (H200, best of 3 shuffled rounds). At L 2K and below
# (G 8 and 16, more heads at once) not: D128 2K 0.990-1.007x, D64 2K 0.996-1.024x, D128 1K 0.81x; so G stays within
# HEAD_GROUP_MAX.
HEAD_GROUP_MAX = 4
head_groups_enabled = True  # False: head by head (A/B timing)


def _head_group(q: torch.Tensor, S: int, is_causal: bool, intervals) -> int:
    """The heads whose causal key blocks a program-a-tile backward launch deals together (0: head by head): about a
    wave of programs, the SMs over a head's key blocks, from 2 to HEAD_GROUP_MAX; not causal (tiles alike) or on key
    intervals, 0."""
    if not head_groups_enabled or not is_causal or intervals is not None:
        return 0
    group = round(_sm_count(q.device.index) / cdiv(S, ONE_PASS_BLOCK_N))
    return group if 1 < group <= HEAD_GROUP_MAX else 0


def one_pass_applies(q: torch.Tensor, k: torch.Tensor, softcap: bool) -> bool:
    """Whether a backward that ``backward_passes`` admits runs in one pass: D 128 (not soft-capped: the cap's tanh
    tile spills registers there, 0.95x the two passes on an H200), or D 64 from ONE_PASS_D64_MIN_KEYS keys, and
    bitwise repeatable gradients not asked for."""
    D = q.shape[-1]
    return (one_pass_enabled and D in ONE_PASS_HEAD_DIMS and (D == 64 or not softcap)
            and (D > 64 or k.shape[2] >= ONE_PASS_D64_MIN_KEYS) and not backend.deterministic_attention())


def ws_dkdv_applies(q: torch.Tensor, k: torch.Tensor, is_causal: bool, intervals: bool, softcap: bool) -> bool:
    """Whether the deterministic mode's dK/dV runs warp-specialized (``attention_backward`` without dQ) rather than in
    ``attention_backward_dkdv``: calls without key intervals at D 64, and at D 128 not soft-capped, from
    ``WS_DKDV_MIN_KEYS`` keys (``WS_DKDV_STAGES``)."""
    D = q.shape[-1]
    return (ws_dkdv_enabled and not intervals and not (softcap and D == 128)
            and k.shape[2] >= WS_DKDV_MIN_KEYS.get((D, is_causal), float("inf")))


def one_pass_stats(q: torch.Tensor) -> torch.Tensor:
    """An uninitialized (2, B * H, L padded to ONE_PASS_BLOCK_M) fp32 tensor for the one pass's statistics (the
    base-2 logsumexp, then delta), which its producer loads by TMA a query block at a time."""
    B, H, L, _ = q.shape
    l_pad = cdiv(L, ONE_PASS_BLOCK_M) * ONE_PASS_BLOCK_M
    return torch.empty((2, B * H, l_pad), dtype=torch.float32, device=q.device)


def attention_backward(q, k, v, grad_out, stats, dq32, is_causal: bool, qk_scale: float, scale: float,
                       dq: torch.Tensor | None, dk: torch.Tensor, dv: torch.Tensor,
                       intervals: tuple[torch.Tensor, ...] | None = None, cap_scale: float = 0.0) -> None:
    """Writes dQ, dK, dV (any strides) in one pass; arguments as ``attention_backward_dkdv``'s, with ``stats``
    (2, B * H, L padded to ONE_PASS_BLOCK_M) fp32 contiguous instead of lse and delta: the logsumexp in base 2 (+inf
    in the padding rows) and delta (0 there); ``dq32``: (B * H, L padded likewise, D) fp32 zeros, where the programs
    add dQ (``ONE_PASS_DQ_FRAGMENTS``: in the fragment order of ``_bwd_dq_red``). With ``dq`` and ``dq32`` None, dK
    and dV alone, by the same producer and consumers (``ws_dkdv_applies``): no unordered sums, so bitwise
    repeatable; ``WS_DKDV_PERSISTENT`` calls then run one program an SM."""
    B, H, L, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    block_n, block_m = ONE_PASS_BLOCK_N, ONE_PASS_BLOCK_M
    l_pad = stats.shape[-1]
    stats_desc = _new_descriptor(stats, [2 * B * H, l_pad], [l_pad, 1], [1, block_m], _stats_layout())
    with_dq = dq is not None
    own_dq = cap_scale > 0.0 and D in ONE_PASS_OWN_DQ_SOFTCAP
    pairs = D in ONE_PASS_STEP_PAIRS and intervals is None and cap_scale <= 0.0
    dq_cols = D if own_dq or pairs else D // 2  # the head dims of a warpgroup's dQ_part (the kernel's DQ_COLS)
    frag_stages = ONE_PASS_DQ_FRAGMENTS.get((D, is_causal)) if intervals is None and cap_scale <= 0.0 else None
    frag = with_dq and frag_stages is not None
    dq_desc = (_new_descriptor(dq32, [B * H, L, D], [l_pad * D, D, 1], [1, block_m, dq_cols],
                               _dq_layout(block_m, dq_cols))
               if with_dq else stats_desc)  # not read without dQ
    row_lo, row_hi, col_lo, col_hi = intervals if intervals is not None else (stats,) * 4
    stages = (frag_stages if frag else 4 if pairs else 2) if with_dq else WS_DKDV_STAGES
    n_tiles = cdiv(S, block_n) * B * H_kv
    persistent = not with_dq and pairs and (D, is_causal) in WS_DKDV_PERSISTENT
    grid = (min(n_tiles, _sm_count(q.device.index)),) if persistent else (cdiv(S, block_n), B * H_kv)
    deal = n_tiles if persistent else _head_group(q, S, is_causal, intervals)
    launch(_attn_bwd_hopper, grid,
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(grad_out, block_m),
        dq_desc, stats_desc, dq32 if with_dq else stats, dk, dv, row_lo, row_hi, col_lo, col_hi, *dk.stride(),
        *dv.stride(), H, H // H_kv, L, S, B * H, l_pad, deal, qk_scale, scale, cap_scale, HEAD_DIM=D,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=is_causal, INTERVALS=intervals is not None, SOFTCAP=cap_scale > 0.0,
        DS_LAYOUT=_ds_layout(block_n, block_m, q.dtype), STAGES=stages, STEP_PAIRS=pairs, DQ=with_dq, OWN_DQ=own_dq,
        PIPELINED=not with_dq and not pairs and D in WS_DKDV_PIPELINED, DQ_FRAG=frag, EARLY=not with_dq,
        PERSISTENT=persistent, num_warps=4,
    )
    if with_dq:
        _dq_scale(dq32, dq, scale, frag)


def _dq_scale(dq32: torch.Tensor, dq: torch.Tensor, scale: float, frag: bool) -> None:
    """dq = dq32 * scale in dq's dtype and strides, one pass over the fp32 sums (rows padded to 64; ``frag``: in
    the fragment order of ``_bwd_dq_red``)."""
    B, H, L, D = dq.shape
    launch(_one_pass_dq, (cdiv(L, 64), B * H), dq32, dq, *dq.stride(), H, L, dq32.shape[1], scale, HEAD_DIM=D,
           BLOCK_M=64, FRAG=frag)


@functools.cache
def _dq_layout(rows: int, cols: int):
    return gl.NVMMASharedLayout.get_default_for([1, rows, cols], gl.float32)


@functools.cache
def _stats_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@functools.cache
def _ds_layout(block_n: int, block_m: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([block_n, block_m], gl.bfloat16 if dtype == torch.bfloat16 else
                                                gl.float16)


if gluon is not None:

    @triton.jit
    def _one_pass_dq(DQ32, DQ, stride_b, stride_h, stride_m, stride_d, H, L, L_PAD, scale, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, FRAG: tl.constexpr):
        """DQ[b, h, i] = DQ32[b * H + h, i] * scale, in DQ's dtype and strides (FRAG: DQ32 in the fragment order of
        ``_bwd_dq_red``, 64-column parts of each 64-row block)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        bh = tl.program_id(1)
        offs_d = tl.arange(0, HEAD_DIM)
        rows = offs_m[:, None] < L
        if FRAG:  # the block's tiles read whole, in order, then put back in (row, head dim) order in registers
            tl.static_assert(BLOCK_M == 64, "fragment-order tiles are 64 x 64")
            x = tl.load(DQ32 + (bh.to(tl.int64) * (L_PAD // BLOCK_M) + tl.program_id(0)) * (BLOCK_M * HEAD_DIM)
                        + tl.arange(0, BLOCK_M * HEAD_DIM))
            # (part, r // 8, b, r % 8, e, f1, f0) with head dim part * 64 + 16 b + 8 f1 + 2 e + f0 (_bwd_dq_red's
            # permuted column c = 16 e + 4 b + 2 f1 + f0)
            x = x.reshape(HEAD_DIM // 64, 8, 4, 8, 4, 2, 2)
            dq = x.permute(1, 3, 0, 2, 5, 4, 6).reshape(BLOCK_M, HEAD_DIM)
        else:
            src = (bh.to(tl.int64) * L_PAD + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
            dq = tl.load(DQ32 + src, mask=rows)
        ptrs = (DQ + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h + offs_m[:, None] * stride_m
                + offs_d[None, :] * stride_d)
        tl.store(ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=rows)

    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """dst[coord...] += src by the TMA (Triton 3.6 builds the op; Gluon has no Python name for it yet)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

    @gluon.jit
    def _bwd_program(ColLo, ColHi, H, GROUP, L, S, tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, PERSISTENT: gl.constexpr):
        """(key block's first key, batch, key head, query blocks per head, first query block's row, steps) of the
        program's tile (PERSISTENT: of ``tile``, the key blocks of each batch and key head in turn; otherwise of the
        program, the key blocks of each batch and key head in turn, or with ``tile`` > 1, ``_head_group``'s dealing:
        the first key block of each of ``tile`` heads, then their second, ..., group by group): a key block meets the
        query blocks of each of the GROUP query heads sharing its key head (causal: from the block holding its first
        key on; INTERVALS: the blocks its keys' query intervals reach)."""
        if PERSISTENT:
            n_blocks = gl.cdiv(S, BLOCK_N)
            n0 = (tile % n_blocks) * BLOCK_N
            bhk = tile // n_blocks
        else:
            n0 = gl.program_id(0) * BLOCK_N
            bhk = gl.program_id(1)
            if tile > 1:  # the key blocks of groups of ``tile`` heads, key block by key block
                n_kb = gl.num_programs(0)
                pid = gl.program_id(0) + gl.program_id(1) * n_kb
                group = pid // (tile * n_kb)
                size = gl.minimum(tile, gl.num_programs(1) - group * tile)
                r = pid - group * tile * n_kb
                n0 = (r // size) * BLOCK_N
                bhk = group * tile + r % size
        H_KV = H // GROUP
        if INTERVALS:
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([1], [32], [4], [0]))
            _, _, m_start, n_m, _, _ = _block_intervals(ColLo, ColHi, offs_n, S, L, BLOCK_M)
        else:
            if CAUSAL:
                m_start = (n0 // BLOCK_M) * BLOCK_M
            else:
                m_start = 0
            n_m = gl.maximum(gl.cdiv(L - m_start, BLOCK_M), 0)
        return n0, bhk // H_KV, bhk % H_KV, n_m, m_start, GROUP * n_m

    @gluon.jit
    def _bwd_producer(q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                      delta_smem, kv_bar, kv_empty, q_full, q_empty, do_full, do_empty, ColLo, ColHi, H, GROUP, L, S,
                      BH, deal, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                      INTERVALS: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
        """The tile's loads, or (PERSISTENT) every num_programs-th tile's, each tile's K and V once both consumers are
        done with the last tile's, ring positions and phases counted across the tiles."""
        if PERSISTENT:
            steps = 0
            j = 0
            for tile in range(gl.program_id(0), deal, gl.num_programs(0)):
                mbarrier.wait(kv_empty, phase=(j & 1) ^ 1, pred=j > 0)
                steps += _bwd_produce_tile(q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem,
                                           v_smem, lse_smem, delta_smem, kv_bar, q_full, q_empty, do_full, do_empty,
                                           ColLo, ColHi, H, GROUP, L, S, BH, tile, steps, BLOCK_M, BLOCK_N, CAUSAL,
                                           INTERVALS, STAGES, PERSISTENT)
                j += 1
        else:
            _bwd_produce_tile(q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                              delta_smem, kv_bar, q_full, q_empty, do_full, do_empty, ColLo, ColHi, H, GROUP, L, S,
                              BH, deal, 0, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, STAGES, PERSISTENT)

    @gluon.jit
    def _bwd_produce_tile(q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                          delta_smem, kv_bar, q_full, q_empty, do_full, do_empty, ColLo, ColHi, H, GROUP, L, S, BH,
                          tile, steps, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                          INTERVALS: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
        """K and V once, then each step's Q with its logsumexp and dO with its delta into STAGES-deep rings (the
        tile's steps after ``steps`` others), a slot refilled once both consumers released it; returns the steps."""
        n0, b, hk, n_m, m_start, total = _bwd_program(ColLo, ColHi, H, GROUP, L, S, tile, BLOCK_M, BLOCK_N, CAUSAL,
                                                      INTERVALS, PERSISTENT)
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_bar, v_smem)
        for i in range(total):
            g = steps + i
            buf = g % STAGES
            empty_phase = ((g // STAGES) & 1) ^ 1
            h = hk * GROUP + i // n_m
            m0 = m_start + (i % n_m) * BLOCK_M
            mbarrier.wait(q_empty.index(buf), phase=empty_phase, pred=g >= STAGES)
            mbarrier.expect(q_full.index(buf), q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_full.index(buf), q_smem.index(buf))
            tma.async_copy_global_to_shared(stats_desc, [b * H + h, m0], q_full.index(buf), lse_smem.index(buf))
            mbarrier.wait(do_empty.index(buf), phase=empty_phase, pred=g >= STAGES)
            mbarrier.expect(do_full.index(buf), do_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], do_full.index(buf), do_smem.index(buf))
            tma.async_copy_global_to_shared(stats_desc, [BH + b * H + h, m0], do_full.index(buf),
                                            delta_smem.index(buf))
        return total

    @gluon.jit
    def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc, DQ32,
                      kv_bar, kv_empty, q_full, q_empty, do_full, do_empty, ds_ready, DK, DV, RowLo, RowHi, ColLo,
                      ColHi, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                      stride_dvd, H, GROUP, L, S, L_PAD, deal, qk_scale, scale, cap_scale, WG: gl.constexpr,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                      INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr, STAGES: gl.constexpr, STEP_PAIRS: gl.constexpr,
                      DQ: gl.constexpr, OWN_DQ: gl.constexpr, PIPELINED: gl.constexpr, DQ_FRAG: gl.constexpr,
                      EARLY: gl.constexpr, PERSISTENT: gl.constexpr):
        """The program's tile, or (PERSISTENT: step pairs without dQ) every num_programs-th tile, each tile's K and V
        released to the producer once its last product has run, ring positions and phases counted across the
        tiles."""
        if PERSISTENT:
            gl.static_assert(STEP_PAIRS and not DQ, "persistent programs: the step pairs without dQ")
            steps = 0
            j = 0
            for tile in range(gl.program_id(0), deal, gl.num_programs(0)):
                steps += _bwd_consume_tile(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                                           dq_desc, DQ32, kv_bar, kv_empty, q_full, q_empty, do_full, do_empty,
                                           ds_ready, DK, DV, RowLo, RowHi, ColLo, ColHi, stride_dkb, stride_dkh,
                                           stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, H,
                                           GROUP, L, S, L_PAD, qk_scale, scale, cap_scale, tile, j, steps, WG,
                                           HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, SOFTCAP, STAGES, STEP_PAIRS,
                                           DQ, OWN_DQ, PIPELINED, DQ_FRAG, EARLY, PERSISTENT)
                j += 1
        else:
            _bwd_consume_tile(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc, DQ32,
                              kv_bar, kv_empty, q_full, q_empty, do_full, do_empty, ds_ready, DK, DV, RowLo, RowHi,
                              ColLo, ColHi, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh,
                              stride_dvn, stride_dvd, H, GROUP, L, S, L_PAD, qk_scale, scale, cap_scale, deal, 0, 0,
                              WG, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, SOFTCAP, STAGES, STEP_PAIRS, DQ,
                              OWN_DQ, PIPELINED, DQ_FRAG, EARLY, PERSISTENT)

    @gluon.jit
    def _bwd_consume_tile(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc, DQ32,
                          kv_bar, kv_empty, q_full, q_empty, do_full, do_empty, ds_ready, DK, DV, RowLo, RowHi, ColLo,
                          ColHi, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                          stride_dvd, H, GROUP, L, S, L_PAD, qk_scale, scale, cap_scale, tile, j, steps,
                          WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
                          STEP_PAIRS: gl.constexpr, DQ: gl.constexpr, OWN_DQ: gl.constexpr, PIPELINED: gl.constexpr,
                          DQ_FRAG: gl.constexpr, EARLY: gl.constexpr, PERSISTENT: gl.constexpr):
        """Warpgroup WG's 64 keys: dK and dV in registers over every step, and (DQ) its share of the steps' dQ_part
        (half the head dims of each step over both warpgroups' keys; OWN_DQ: every head dim of each step over its own
        keys; STEP_PAIRS: every head dim of every other step over both's), a step an iteration or (STEP_PAIRS) two.
        SOFTCAP: S^T is tanh(S^T * cap_scale) and dS^T gains the factor 1 - tanh^2."""
        KEYS: gl.constexpr = 64
        DQ_COLS: gl.constexpr = dq_desc.block_type.shape[-1]  # dQ_part's head dims: the host's dq_cols (DQ)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

        n0, b, hk, n_m, m_start, total = _bwd_program(ColLo, ColHi, H, GROUP, L, S, tile, BLOCK_M, BLOCK_N, CAUSAL,
                                                      INTERVALS, PERSISTENT)
        keys0 = n0 + WG * KEYS
        offs_n = keys0 + gl.arange(0, KEYS, layout=row_s)
        if INTERVALS:  # [seen_lo, seen_hi]: the rows all this warpgroup's keys are seen by (steps within: no mask)
            _, _, _, _, seen_lo, seen_hi = _block_intervals(ColLo, ColHi, offs_n, S, L, BLOCK_M)
        else:
            seen_lo, seen_hi = 0, 0
        k_all = k_smem.reshape([BLOCK_N, HEAD_DIM])
        k_tile = k_all.slice(WG * KEYS, KEYS)
        v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(WG * KEYS, KEYS)
        if OWN_DQ:
            dq_b = k_tile
        elif STEP_PAIRS:
            dq_b = k_all
        else:
            dq_b = k_all.slice(WG * DQ_COLS, DQ_COLS, dim=1)
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
        dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
        masks = (offs_n, keys0, RowLo, RowHi, L, S, seen_lo, seen_hi, keys0 + KEYS > S)
        mbarrier.wait(kv_bar, phase=j & 1)  # the program's j-th tile's K and V
        if STEP_PAIRS and not DQ:
            dk, dv = _bwd_step_pairs_dkdv(q_smem, do_smem, lse_smem, delta_smem, q_full, q_empty, do_full, do_empty,
                                          k_tile, v_tile, dk, dv, s_zero, masks, n_m, m_start, total, steps, qk_scale,
                                          BLOCK_M, KEYS, CAUSAL, STAGES, col_s, a_layout, EARLY)
        elif PIPELINED:
            dk, dv = _bwd_steps_dkdv(q_smem, do_smem, lse_smem, delta_smem, q_full, q_empty, do_full, do_empty,
                                     k_tile, v_tile, dk, dv, s_zero, masks, n_m, m_start, total, qk_scale, cap_scale,
                                     BLOCK_M, KEYS, CAUSAL, INTERVALS, SOFTCAP, STAGES, col_s, a_layout)
        elif STEP_PAIRS:
            dk, dv = _bwd_step_pairs(q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc, DQ32, q_full,
                                     q_empty, do_full, do_empty, ds_ready, k_tile, v_tile, dq_b, dk, dv, s_zero,
                                     dq_zero, masks, b * H + hk * GROUP, n_m, m_start, total, L_PAD, qk_scale, WG,
                                     BLOCK_M, KEYS, DQ_COLS, CAUSAL, STAGES, col_s, a_layout, DQ_FRAG)
        else:
            dk, dv = _bwd_steps(q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc, DQ32, q_full,
                                q_empty, do_full, do_empty, ds_ready, k_tile, v_tile, dq_b, dk, dv, s_zero, dq_zero,
                                masks, b * H + hk * GROUP, n_m, m_start, total, L_PAD, qk_scale, cap_scale, WG,
                                BLOCK_M, KEYS, DQ_COLS, CAUSAL, INTERVALS, SOFTCAP, STAGES, col_s, a_layout, DQ,
                                OWN_DQ, DQ_FRAG, EARLY)
        if PERSISTENT:  # every product reading K and V was waited for: the next tile's may come
            mbarrier.arrive(kv_empty)
        tma.store_wait(0)
        _bwd_store_dkdv(dk, dv, DK, DV, b, hk, keys0, S, scale, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                        stride_dvb, stride_dvh, stride_dvn, stride_dvd, KEYS, HEAD_DIM)
        return total

    @gluon.jit
    def _bwd_steps(q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc, DQ32, q_full, q_empty, do_full,
                   do_empty, ds_ready, k_tile, v_tile, dq_b, dk, dv, s_zero, dq_zero, masks, bh0, n_m, m_start, total,
                   L_PAD, qk_scale, cap_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
                   DQ_COLS: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                   STAGES: gl.constexpr, col_s: gl.constexpr, a_layout: gl.constexpr, DQ: gl.constexpr,
                   OWN_DQ: gl.constexpr, DQ_FRAG: gl.constexpr, EARLY: gl.constexpr):
        """A step an iteration: S^T and dP^T, then dV, dQ_part and dK, all waited for within the step."""
        HEAD_DIM: gl.constexpr = q_smem.shape[-1]
        for i in range(total):
            buf = i % STAGES
            phase = (i // STAGES) & 1
            m0 = m_start + (i % n_m) * BLOCK_M
            q_tile = q_smem.index(buf).reshape([BLOCK_M, HEAD_DIM])
            do_tile = do_smem.index(buf).reshape([BLOCK_M, HEAD_DIM])
            p_a, ds_t = _bwd_step_ds(q_tile, do_tile, k_tile, v_tile, lse_smem, delta_smem, q_full, do_full, buf,
                                     phase, s_zero, m0, masks, qk_scale, cap_scale, BLOCK_M, KEYS, CAUSAL, INTERVALS,
                                     SOFTCAP, col_s, a_layout, EARLY)
            if not DQ:
                dk, dv, _, _ = _bwd_dkdv_products(p_a, ds_t, q_smem, do_smem, q_full, q_empty, do_full, do_empty,
                                                  k_tile, v_tile, dk, dv, s_zero, i, BLOCK_M, STAGES, a_layout, False)
            else:
                # dS^T to shared memory for dQ_part = dS K, which needs both warpgroups' keys (OWN_DQ: its own); two
                # buffers, so that a warpgroup a step ahead never overwrites what the other's dQ_part still reads
                ds_smem.index(i % 2).slice(WG * KEYS, KEYS).store(ds_t)
                dv = warpgroup_mma(p_a, do_tile, dv, is_async=True)
                _bwd_ds_publish(ds_ready, i % 2, OWN_DQ)
                ds = _bwd_ds_operand(ds_smem, i % 2, i % 2, ds_ready, i // 2, WG, KEYS, OWN_DQ)
                dq = warpgroup_mma(ds, dq_b, dq_zero, use_acc=False, is_async=True)
                dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv, ))
                mbarrier.arrive(do_empty.index(buf))
                dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_tile, dk, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq, ))
                if DQ_FRAG:
                    _bwd_dq_red(dq, DQ32, bh0, i, n_m, m_start, L_PAD, WG, BLOCK_M, DQ_COLS, HEAD_DIM)
                else:
                    _bwd_dq_add(dq, dq_smem, dq_desc, bh0, i, n_m, m_start, WG, BLOCK_M, DQ_COLS, OWN_DQ)
                dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
                mbarrier.arrive(q_empty.index(buf))
        return dk, dv

    @gluon.jit
    def _bwd_step_pairs(q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc, DQ32, q_full, q_empty,
                        do_full, do_empty, ds_ready, k_tile, v_tile, dq_b, dk, dv, s_zero, dq_zero, masks, bh0, n_m,
                        m_start, total, L_PAD, qk_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
                        DQ_COLS: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr, col_s: gl.constexpr,
                        a_layout: gl.constexpr, DQ_FRAG: gl.constexpr):
        """Two steps (a, b) an iteration, for dense calls without the soft-cap (``ONE_PASS_STEP_PAIRS``): b's S^T and
        dP^T are issued behind a's dV, so that P_b forms while dP_b, dK_a and (warpgroup 0) dQ_a run. Warpgroup 0
        forms step a's whole dQ_part (every head dim over both warpgroups' keys), warpgroup 1 step b's: each waits
        for the other's dS^T once an iteration. Every product is waited for before the loop's back-edge (a product
        in flight across it, with a wait(N > 0) read in the loop, makes ptxas serialize every wgmma). An odd last
        step b runs on a's buffers with an infinite logsumexp (P = dS = 0), its dQ_part not added. dS^T tiles
        alternate between two pairs of buffers by iteration: warpgroup 0 arrives with b's dS^T before its dQ_a has
        read a's, so warpgroup 1, once past that arrival, must not overwrite a's buffer in the next iteration."""
        dtype: gl.constexpr = q_smem.dtype
        DQ_A: gl.constexpr = WG == 0  # whether this warpgroup forms step a's dQ_part, else b's
        for j in range(gl.cdiv(total, 2)):
            ia, ib, valid_b, buf_a, buf_b, m0_a, m0_b, q_a, do_a, q_b, do_b = _step_pair(q_smem, do_smem, j, total, n_m,
                                                                                        m_start, 0, BLOCK_M, STAGES)
            ds0 = 2 * (j % 2)  # this iteration's dS^T buffers: ds0 for a, ds0 + 1 for b
            # step a: S, dP, P, dS
            p_a, ds_a = _bwd_step_ds(q_a, do_a, k_tile, v_tile, lse_smem, delta_smem, q_full, do_full, buf_a,
                                     (ia // STAGES) & 1, s_zero, m0_a, masks, qk_scale, 0.0, BLOCK_M, KEYS, CAUSAL,
                                     False, False, col_s, a_layout, False)
            ds_smem.index(ds0).slice(WG * KEYS, KEYS).store(ds_a)
            _bwd_ds_publish(ds_ready, 0, False)
            # a's dV, b's S and dP, a's dQ_part (warpgroup 0) and dK: P_b forms under dP_b, dQ_a and dK_a
            dv = warpgroup_mma(p_a, do_a, dv, is_async=True)
            mbarrier.wait(q_full.index(buf_b), phase=(ib // STAGES) & 1, pred=valid_b)
            s_t = warpgroup_mma(k_tile, q_b.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_full.index(buf_b), phase=(ib // STAGES) & 1, pred=valid_b)
            dp_t = warpgroup_mma(v_tile, do_b.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if DQ_A:
                dq = warpgroup_mma(_bwd_ds_operand(ds_smem, ds0, 0, ds_ready, j, WG, KEYS, False), dq_b, dq_zero,
                                   use_acc=False, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(ds_a, a_layout), q_a, dk, is_async=True)
            lse2 = gl.where(valid_b, lse_smem.index(buf_b).reshape([BLOCK_M]).load(col_s), float("inf"))
            dv, s_t = warpgroup_mma_wait(num_outstanding=2 + DQ_A, deps=(dv, s_t))
            mbarrier.arrive(do_empty.index(buf_a))
            p_a, p_ds = _bwd_probs(s_t, lse2, m0_b, masks, qk_scale, 0.0, BLOCK_M, KEYS, CAUSAL, False, False, dtype,
                                   col_s, a_layout)
            delta = delta_smem.index(buf_b).reshape([BLOCK_M]).load(col_s)
            dp_t = warpgroup_mma_wait(num_outstanding=1 + DQ_A, deps=(dp_t, ))
            ds_b = (p_ds * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
            ds_smem.index(ds0 + 1).slice(WG * KEYS, KEYS).store(ds_b)
            _bwd_ds_publish(ds_ready, 1, False)
            if DQ_A:
                dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq, ))
                if DQ_FRAG:  # a pair's dQ_part spans every head dim (DQ_COLS is the head dim): one 64 x 64 part
                    _bwd_dq_red(dq, DQ32, bh0, ia, n_m, m_start, L_PAD, 0, BLOCK_M, DQ_COLS, DQ_COLS)
                else:
                    _bwd_dq_add(dq, dq_smem, dq_desc, bh0, ia, n_m, m_start, WG, BLOCK_M, DQ_COLS, True)
            # b's dV, dQ_part (warpgroup 1) and dK
            dv = warpgroup_mma(p_a, do_b, dv, is_async=True)
            if not DQ_A:
                dq = warpgroup_mma(_bwd_ds_operand(ds_smem, ds0 + 1, 1, ds_ready, j, WG, KEYS, False), dq_b,
                                   dq_zero, use_acc=False, is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds_b, a_layout), q_b, dk, is_async=True)
                dk, dv, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dq))
            else:
                dk = warpgroup_mma(gl.convert_layout(ds_b, a_layout), q_b, dk, is_async=True)
                dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            mbarrier.arrive(q_empty.index(buf_a))
            mbarrier.arrive(q_empty.index(buf_b), pred=valid_b)
            mbarrier.arrive(do_empty.index(buf_b), pred=valid_b)
            if not DQ_A:
                if valid_b:
                    if DQ_FRAG:
                        _bwd_dq_red(dq, DQ32, bh0, ib, n_m, m_start, L_PAD, 0, BLOCK_M, DQ_COLS, DQ_COLS)
                    else:
                        _bwd_dq_add(dq, dq_smem, dq_desc, bh0, ib, n_m, m_start, WG, BLOCK_M, DQ_COLS, True)
        return dk, dv

    @gluon.jit
    def _step_pair(q_smem, do_smem, j, total, n_m, m_start, steps, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """Iteration j's steps a and b: their indices in the tile, whether b exists (else it runs on a's buffers),
        ring slots (the tile's steps after ``steps`` others), first query rows, and Q and dO tiles."""
        HEAD_DIM: gl.constexpr = q_smem.shape[-1]
        ia = 2 * j
        ib = ia + 1
        valid_b = ib < total
        buf_a = (steps + ia) % STAGES
        buf_b = gl.where(valid_b, (steps + ib) % STAGES, buf_a)
        m0_a = m_start + (ia % n_m) * BLOCK_M
        m0_b = m_start + (ib % n_m) * BLOCK_M
        q_a = q_smem.index(buf_a).reshape([BLOCK_M, HEAD_DIM])
        do_a = do_smem.index(buf_a).reshape([BLOCK_M, HEAD_DIM])
        q_b = q_smem.index(buf_b).reshape([BLOCK_M, HEAD_DIM])
        do_b = do_smem.index(buf_b).reshape([BLOCK_M, HEAD_DIM])
        return ia, ib, valid_b, buf_a, buf_b, m0_a, m0_b, q_a, do_a, q_b, do_b

    @gluon.jit
    def _bwd_steps_dkdv(q_smem, do_smem, lse_smem, delta_smem, q_full, q_empty, do_full, do_empty, k_tile, v_tile, dk,
                        dv, s_zero, masks, n_m, m_start, total, qk_scale, cap_scale, BLOCK_M: gl.constexpr,
                        KEYS: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                        STAGES: gl.constexpr, col_s: gl.constexpr, a_layout: gl.constexpr):
        """Single steps without dQ, pipelined: each step issues the next one's S^T and dP^T (``_bwd_dkdv_products``).
        The loop's back-edge sits after a step's S^T and dP^T were waited for: with them in flight across it, ptxas
        serializes every wgmma."""
        HEAD_DIM: gl.constexpr = q_smem.shape[-1]
        dtype: gl.constexpr = q_smem.dtype
        if total > 0:
            s_t, dp_t = _bwd_step_issue(q_smem.index(0).reshape([BLOCK_M, HEAD_DIM]),
                                        do_smem.index(0).reshape([BLOCK_M, HEAD_DIM]), k_tile, v_tile, q_full,
                                        do_full, 0, 0, s_zero)
            p_a, ds_t = _bwd_step_finish(s_t, dp_t, lse_smem, delta_smem, 0, m_start, masks, qk_scale, cap_scale,
                                         BLOCK_M, KEYS, CAUSAL, INTERVALS, SOFTCAP, dtype, col_s, a_layout)
            for i in range(total - 1):
                dk, dv, s_t, dp_t = _bwd_dkdv_products(p_a, ds_t, q_smem, do_smem, q_full, q_empty, do_full,
                                                       do_empty, k_tile, v_tile, dk, dv, s_zero, i, BLOCK_M, STAGES,
                                                       a_layout, True)
                p_a, ds_t = _bwd_step_finish(s_t, dp_t, lse_smem, delta_smem, (i + 1) % STAGES,
                                             m_start + ((i + 1) % n_m) * BLOCK_M, masks, qk_scale, cap_scale, BLOCK_M,
                                             KEYS, CAUSAL, INTERVALS, SOFTCAP, dtype, col_s, a_layout)
            dk, dv, _, _ = _bwd_dkdv_products(p_a, ds_t, q_smem, do_smem, q_full, q_empty, do_full, do_empty, k_tile,
                                              v_tile, dk, dv, s_zero, total - 1, BLOCK_M, STAGES, a_layout, False)
        return dk, dv

    @gluon.jit
    def _bwd_dkdv_products(p_a, ds_t, q_smem, do_smem, q_full, q_empty, do_full, do_empty, k_tile, v_tile, dk, dv,
                           s_zero, i, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, a_layout: gl.constexpr,
                           NEXT: gl.constexpr):
        """Step i's dV and dK from its P^T and dS^T, and (NEXT) step i+1's S^T issued once dV has run (P^T's
        registers free), behind dK, and its dP^T once dK has: (dK, dV, S^T, dP^T; s_zero for the last two without
        NEXT)."""
        HEAD_DIM: gl.constexpr = q_smem.shape[-1]
        buf = i % STAGES
        nxt = (i + 1) % STAGES
        phase = ((i + 1) // STAGES) & 1
        s_t = s_zero
        dp_t = s_zero
        dv = warpgroup_mma(p_a, do_smem.index(buf).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_smem.index(buf).reshape([BLOCK_M, HEAD_DIM]), dk,
                           is_async=True)
        dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv, ))
        mbarrier.arrive(do_empty.index(buf))
        if NEXT:
            mbarrier.wait(q_full.index(nxt), phase=phase)
            s_t = warpgroup_mma(k_tile, q_smem.index(nxt).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), s_zero,
                                use_acc=False, is_async=True)
            dk = warpgroup_mma_wait(num_outstanding=1, deps=(dk, ))
            mbarrier.arrive(q_empty.index(buf))
            mbarrier.wait(do_full.index(nxt), phase=phase)
            dp_t = warpgroup_mma(v_tile, do_smem.index(nxt).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), s_zero,
                                 use_acc=False, is_async=True)
        else:
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
            mbarrier.arrive(q_empty.index(buf))
        return dk, dv, s_t, dp_t

    @gluon.jit
    def _bwd_step_pairs_dkdv(q_smem, do_smem, lse_smem, delta_smem, q_full, q_empty, do_full, do_empty, k_tile,
                             v_tile, dk, dv, s_zero, masks, n_m, m_start, total, steps, qk_scale,
                             BLOCK_M: gl.constexpr, KEYS: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                             col_s: gl.constexpr, a_layout: gl.constexpr, EARLY: gl.constexpr):
        """``_bwd_step_pairs`` without dQ (the tile's steps after ``steps`` others in the rings): a's dV and dK
        products run under b's S^T and dP^T, and every product is waited for before the loop's back-edge."""
        dtype: gl.constexpr = q_smem.dtype
        for j in range(gl.cdiv(total, 2)):
            ia, ib, valid_b, buf_a, buf_b, m0_a, m0_b, q_a, do_a, q_b, do_b = _step_pair(q_smem, do_smem, j, total, n_m,
                                                                                        m_start, steps, BLOCK_M, STAGES)
            p_a, ds_a = _bwd_step_ds(q_a, do_a, k_tile, v_tile, lse_smem, delta_smem, q_full, do_full, buf_a,
                                     ((steps + ia) // STAGES) & 1, s_zero, m0_a, masks, qk_scale, 0.0, BLOCK_M, KEYS,
                                     CAUSAL, False, False, col_s, a_layout, EARLY)
            dv = warpgroup_mma(p_a, do_a, dv, is_async=True)
            mbarrier.wait(q_full.index(buf_b), phase=((steps + ib) // STAGES) & 1, pred=valid_b)
            if EARLY:
                lse2 = gl.where(valid_b, lse_smem.index(buf_b).reshape([BLOCK_M]).load(col_s), float("inf"))
            s_t = warpgroup_mma(k_tile, q_b.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_full.index(buf_b), phase=((steps + ib) // STAGES) & 1, pred=valid_b)
            if EARLY:
                delta = delta_smem.index(buf_b).reshape([BLOCK_M]).load(col_s)
            dp_t = warpgroup_mma(v_tile, do_b.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(ds_a, a_layout), q_a, dk, is_async=True)
            if not EARLY:
                lse2 = gl.where(valid_b, lse_smem.index(buf_b).reshape([BLOCK_M]).load(col_s), float("inf"))
            dv, s_t = warpgroup_mma_wait(num_outstanding=2, deps=(dv, s_t))
            mbarrier.arrive(do_empty.index(buf_a))
            p_a, p_ds = _bwd_probs(s_t, lse2, m0_b, masks, qk_scale, 0.0, BLOCK_M, KEYS, CAUSAL, False, False, dtype,
                                   col_s, a_layout)
            if not EARLY:
                delta = delta_smem.index(buf_b).reshape([BLOCK_M]).load(col_s)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, ))
            ds_b = (p_ds * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
            dv = warpgroup_mma(p_a, do_b, dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(ds_b, a_layout), q_b, dk, is_async=True)
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            mbarrier.arrive(q_empty.index(buf_a))
            mbarrier.arrive(q_empty.index(buf_b), pred=valid_b)
            mbarrier.arrive(do_empty.index(buf_b), pred=valid_b)
        return dk, dv

    @gluon.jit
    def _bwd_step_ds(q_tile, do_tile, k_tile, v_tile, lse_smem, delta_smem, q_full, do_full, buf, phase, s_zero, m0,
                     masks, qk_scale, cap_scale, BLOCK_M: gl.constexpr, KEYS: gl.constexpr, CAUSAL: gl.constexpr,
                     INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr, col_s: gl.constexpr, a_layout: gl.constexpr,
                     EARLY: gl.constexpr):
        """A step's S^T = K Q^T and dP^T = V dO^T, issued as their tiles arrive and waited for: (P^T as dV's register
        operand, dS^T = P^T (dP^T - delta) in the input dtype). EARLY: the step's logsumexp and delta read as their
        tiles arrive, ahead of the products (the deterministic mode's dK/dV pass, see ``WS_DKDV_STAGES``)."""
        if EARLY:
            mbarrier.wait(q_full.index(buf), phase=phase)
            lse2 = lse_smem.index(buf).reshape([BLOCK_M]).load(col_s)
            s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_full.index(buf), phase=phase)
            delta = delta_smem.index(buf).reshape([BLOCK_M]).load(col_s)
            dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))
            p_a, p_ds = _bwd_probs(s_t, lse2, m0, masks, qk_scale, cap_scale, BLOCK_M, KEYS, CAUSAL, INTERVALS,
                                   SOFTCAP, q_tile.dtype, col_s, a_layout)
            dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, ))
            return p_a, (p_ds * (dp_t - gl.expand_dims(delta, 0))).to(q_tile.dtype)
        s_t, dp_t = _bwd_step_issue(q_tile, do_tile, k_tile, v_tile, q_full, do_full, buf, phase, s_zero)
        return _bwd_step_finish(s_t, dp_t, lse_smem, delta_smem, buf, m0, masks, qk_scale, cap_scale, BLOCK_M, KEYS,
                                CAUSAL, INTERVALS, SOFTCAP, q_tile.dtype, col_s, a_layout)

    @gluon.jit
    def _bwd_step_issue(q_tile, do_tile, k_tile, v_tile, q_full, do_full, buf, phase, s_zero):
        """Issues a step's S^T = K Q^T and dP^T = V dO^T as their tiles arrive."""
        mbarrier.wait(q_full.index(buf), phase=phase)
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_full.index(buf), phase=phase)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return s_t, dp_t

    @gluon.jit
    def _bwd_step_finish(s_t, dp_t, lse_smem, delta_smem, buf, m0, masks, qk_scale, cap_scale, BLOCK_M: gl.constexpr,
                         KEYS: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                         dtype: gl.constexpr, col_s: gl.constexpr, a_layout: gl.constexpr):
        """Waits for a step's S^T and dP^T (issued in that order, nothing after them): (P^T as dV's register
        operand, dS^T = P^T (dP^T - delta) in dtype)."""
        lse2 = lse_smem.index(buf).reshape([BLOCK_M]).load(col_s)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))
        p_a, p_ds = _bwd_probs(s_t, lse2, m0, masks, qk_scale, cap_scale, BLOCK_M, KEYS, CAUSAL, INTERVALS, SOFTCAP,
                               dtype, col_s, a_layout)
        delta = delta_smem.index(buf).reshape([BLOCK_M]).load(col_s)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, ))
        return p_a, (p_ds * (dp_t - gl.expand_dims(delta, 0))).to(dtype)

    @gluon.jit
    def _bwd_probs(s_t, lse2, m0, masks, qk_scale, cap_scale, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
                   CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr, dtype: gl.constexpr,
                   col_s: gl.constexpr, a_layout: gl.constexpr):
        """(P^T in the input dtype as dV's register operand, P^T times dS^T's cap factor in fp32) from S^T: P^T =
        exp2(S^T * qk_scale - lse) (SOFTCAP: of tanh(S^T * cap_scale), the factor 1 - tanh^2), 0 where a query does
        not see a key (causal; INTERVALS: query i keeps keys [row_lo[i], row_hi[i]]) and for keys past S."""
        offs_n, keys0, RowLo, RowHi, L, S, seen_lo, seen_hi, ragged = masks
        if SOFTCAP:
            s_t = _tanh(s_t * cap_scale)
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        if CAUSAL:
            if m0 < keys0 + KEYS:  # only the blocks that cross the diagonal pay for the mask
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_s)
                p_t = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1), p_t, 0.0)
        if INTERVALS:
            if m0 < seen_lo or m0 + BLOCK_M - 1 > seen_hi:
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_s)
                row_lo = gl.load(RowLo + offs_m, mask=offs_m < L, other=S)
                p_t = gl.where(gl.expand_dims(offs_n, 1) >= gl.expand_dims(row_lo, 0), p_t, 0.0)
                row_hi = gl.load(RowHi + offs_m, mask=offs_m < L, other=-1)
                p_t = gl.where(gl.expand_dims(offs_n, 1) <= gl.expand_dims(row_hi, 0), p_t, 0.0)
        if ragged:  # keys past S (zeros in K and V): P = 0, whatever the row's logsumexp
            p_t = gl.where(gl.expand_dims(offs_n < S, 1), p_t, 0.0)
        p_a = gl.convert_layout(p_t.to(dtype), a_layout)
        if SOFTCAP:  # through the cap to the raw score
            p_t = p_t * (1.0 - s_t * s_t)
        return p_a, p_t

    @gluon.jit
    def _bwd_ds_publish(ds_ready, idx, OWN_DQ: gl.constexpr):
        """After this warpgroup stored its keys' dS^T into ds_smem[idx]: visible to the tensor cores, for dQ_part = dS
        K by this warpgroup alone (OWN_DQ) or by both (ds_ready[idx] counts this warpgroup's arrival)."""
        fence_async_shared()
        if OWN_DQ:
            gl.thread_barrier()
        else:
            mbarrier.arrive(ds_ready.index(idx))

    @gluon.jit
    def _bwd_ds_operand(ds_smem, idx, bar, ds_ready, use, WG: gl.constexpr, KEYS: gl.constexpr,
                        OWN_DQ: gl.constexpr):
        """dS of ds_smem[idx] as dQ_part's A operand: this warpgroup's keys (OWN_DQ), or both warpgroups' once the
        other's arrived at ds_ready[bar] (``use``: how many times it was waited for before)."""
        if OWN_DQ:
            ds = ds_smem.index(idx).slice(WG * KEYS, KEYS)
        else:
            mbarrier.wait(ds_ready.index(bar), phase=use & 1)
            ds = ds_smem.index(idx)
        return ds.permute((1, 0))

    @gluon.jit
    def _bwd_dq_add(dq, dq_smem, dq_desc, bh0, i, n_m, m_start, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                    DQ_COLS: gl.constexpr, ALL_COLS: gl.constexpr):
        """Adds this warpgroup's dQ_part of step i to the fp32 dQ by a TMA reduction, not waited for. The step's head
        and first row are recomputed from i here rather than kept live across the step: fewer registers spill."""
        tma.store_wait(0)  # the previous reduction has read dq_smem
        gl.thread_barrier()
        dq_smem.index(WG).reshape([BLOCK_M, DQ_COLS]).store(dq)
        fence_async_shared()
        col: gl.constexpr = 0 if ALL_COLS else WG * DQ_COLS  # ALL_COLS: every head dim, else its share
        _tma_reduce_add(dq_desc, [bh0 + i // n_m, m_start + (i % n_m) * BLOCK_M, col], dq_smem.index(WG))

    @gluon.jit
    def _bwd_dq_red(dq, DQ32, bh0, i, n_m, m_start, L_PAD, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                    DQ_COLS: gl.constexpr, HEAD_DIM: gl.constexpr):
        """Adds this warpgroup's 64 x 64 dQ_part of step i (head dims WG * 64 on) to the fp32 dQ by 16-byte atomics
        from registers, not waited for: no shared-memory tile, fence or barrier. The columns are permuted in registers
        (no data movement) so that a thread's 16 values of a row are contiguous, and dq32 holds each (64-row block,
        64-column part) tile in the order of the accumulator's fragments, so that a warp's atomics cover 512 contiguous
        bytes (four whole L2 lines; in dq32's row layout they would touch 32-byte pieces of eight rows)."""
        gl.static_assert(BLOCK_M == 64 and DQ_COLS == 64,
                         "fragment-order tiles are 64 x 64 (D128 single steps, D64 step pairs)")
        dq_p = dq.reshape([BLOCK_M, DQ_COLS // 8, 4, 2]).permute((0, 2, 1, 3)).reshape([BLOCK_M, DQ_COLS])
        # the same registers, renumbered so that a thread's 16 contiguous columns come first (row + 8 last)
        layout: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
                                                          [[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                                          [[16, 0], [32, 0]], [], [BLOCK_M, DQ_COLS])
        dq_p = gl.convert_layout(dq_p, layout)
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, layout))
        # element (r, c) at index (r // 8, c // 4 % 4, r % 8, c // 16, c % 4) of a (8, 4, 8, 4, 4) tile: the k-th
        # atomic of warp w's row half h (rows 16 w + 8 h + lane // 4) is the tile's (2 w + h, k) slice
        tile = (((bh0 + i // n_m).to(gl.int64) * (L_PAD // BLOCK_M) + (m_start // BLOCK_M + i % n_m))
                * (HEAD_DIM // DQ_COLS) + WG)
        ptrs = (DQ32 + tile * (BLOCK_M * DQ_COLS) + gl.expand_dims(r // 8 * 512 + r % 8 * 16, 1)
                + gl.expand_dims(c // 4 % 4 * 128 + c // 16 * 4 + c % 4, 0))
        gl.atomic_add(ptrs, dq_p, sem="relaxed")

    @gluon.jit
    def _bwd_store_dkdv(dk, dv, DK, DV, b, hk, keys0, S, scale, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                        stride_dvb, stride_dvh, stride_dvn, stride_dvd, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr):
        """dK (times the softmax scale) and dV of the warpgroup's keys, in the outputs' dtype and strides, through a
        layout of 16-byte row pieces (the accumulator's holds 4-byte pairs spread over 8 rows): 1.00-1.10x
        forward+backward (H200, one noisy run)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
        offs_n = keys0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        rows = gl.expand_dims(offs_n < S, 1)
        dk_ptrs = (DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh
                   + gl.expand_dims(offs_n, 1) * stride_dkn + gl.expand_dims(offs_d, 0) * stride_dkd)
        gl.store(dk_ptrs, gl.convert_layout((dk * scale).to(DK.dtype.element_ty), layout), mask=rows)
        dv_ptrs = (DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh
                   + gl.expand_dims(offs_n, 1) * stride_dvn + gl.expand_dims(offs_d, 0) * stride_dvd)
        gl.store(dv_ptrs, gl.convert_layout(dv.to(DV.dtype.element_ty), layout), mask=rows)

    @gluon.jit(do_not_specialize=["deal"])
    def _attn_bwd_hopper(q_desc, k_desc, v_desc, do_desc, dq_desc, stats_desc, DQ32, DK, DV, RowLo, RowHi, ColLo,
                         ColHi, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                         stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                         H, GROUP, L, S, BH, L_PAD, deal, qk_scale, scale, cap_scale,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                         INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr, DS_LAYOUT: gl.constexpr,
                         STAGES: gl.constexpr, STEP_PAIRS: gl.constexpr, DQ: gl.constexpr, OWN_DQ: gl.constexpr,
                         PIPELINED: gl.constexpr, DQ_FRAG: gl.constexpr, EARLY: gl.constexpr,
                         PERSISTENT: gl.constexpr):
        """One key block's dK, dV and (DQ) its parts of dQ (PERSISTENT: the key blocks of every num_programs-th tile of
        ``deal``): a producer warpgroup (this program's 4 warps) and two consumer warpgroups with its registers. Without
        PERSISTENT, ``deal`` > 1 deals the key blocks of that many heads together (``_head_group``)."""
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], stats_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], stats_desc.layout)
        if DQ:
            ds_smem = gl.allocate_shared_memory(dtype, [4 if STEP_PAIRS else 2, BLOCK_N, BLOCK_M], DS_LAYOUT)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        else:  # not read: the ring takes their 64 KB (D128)
            ds_smem = q_smem
            dq_smem = q_smem
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()) if PERSISTENT else kv_bar
        q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        if PERSISTENT:
            mbarrier.init(kv_empty, count=2)  # both consumers are done with a tile's K and V
        for i in gl.static_range(STAGES):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(do_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
            mbarrier.init(do_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
        fence_async_shared()
        gl.warp_specialize([
            (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                             delta_smem, kv_bar, kv_empty, q_full, q_empty, do_full, do_empty, ColLo, ColHi, H,
                             GROUP, L, S, BH, deal, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, STAGES, PERSISTENT)),
            (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc,
                             DQ32, kv_bar, kv_empty, q_full, q_empty, do_full, do_empty, ds_ready, DK, DV, RowLo,
                             RowHi, ColLo, ColHi, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb,
                             stride_dvh, stride_dvn, stride_dvd, H, GROUP, L, S, L_PAD, deal, qk_scale, scale,
                             cap_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, SOFTCAP, STAGES,
                             STEP_PAIRS, DQ, OWN_DQ, PIPELINED, DQ_FRAG, EARLY, PERSISTENT)),
            (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, dq_desc,
                             DQ32, kv_bar, kv_empty, q_full, q_empty, do_full, do_empty, ds_ready, DK, DV, RowLo,
                             RowHi, ColLo, ColHi, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb,
                             stride_dvh, stride_dvn, stride_dvd, H, GROUP, L, S, L_PAD, deal, qk_scale, scale,
                             cap_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, SOFTCAP, STAGES,
                             STEP_PAIRS, DQ, OWN_DQ, PIPELINED, DQ_FRAG, EARLY, PERSISTENT)),
        ], [4, 4], [240, 240])


# ----------------------------------------------------------------------------- backward: dQ

# (BLOCK_M queries, BLOCK_N keys, warps) per head dim: a program owns one query block (Q, dO resident, dQ in
# registers) while key blocks stream through TMA rings (K three deep, V two), two programs an SM. The fastest of three
# or four candidates each on an H200 (bf16, B*L = 16384, H*D = 2048, L 1K-16K, with the Gluon dK/dV): forward+backward
# 1.03-1.10x the Triton dQ kernel at D128 and 1.00-1.06x at D64 from 2**37 flops up. Block j-1's dQ product is issued
# behind block j's S and dP and runs under block j's softmax (FA3's intra-warpgroup overlap): 1.02-1.05x
# forward+backward over waiting for it within its own step at D128, 0.97-1.03x at D64 (H100, L 2K-16K). D256: 32-key
# blocks (one program an SM, 148 KB of shared memory; 64-key blocks need more than the SM has), one warpgroup with the
# 64 x 256 dQ in its registers (203-206, no spills): forward+backward 1.04-1.08x the Triton dQ's (with the Gluon dK/dV;
# H200, L 1K-16K); two warpgroups splitting the columns as the dK/dV kernel's do, 0.92-0.99x.
_DQ_CONFIGS = {64: (64, 64, 4), 128: (64, 64, 4), 256: (64, 32, 4)}
dq_enabled = True  # False: the Triton dQ kernel (A/B timing)


def attention_backward_dq(q, k, v, grad_out, lse, delta, is_causal: bool, qk_scale: float, scale: float,
                          dq: torch.Tensor, intervals: tuple[torch.Tensor, ...] | None = None,
                          cap_scale: float = 0.0, out: torch.Tensor | None = None,
                          stats: torch.Tensor | None = None) -> None:
    """Writes dQ (any strides); arguments as ``attention_backward_dkdv``'s. With the forward's ``out`` (any strides)
    it also forms ``delta`` = rowsum(dO * O) of its query block and writes it, for the dK/dV pass after it: no
    separate pass over O and dO (50 us of a 1 ms backward at 16K tokens, H*D = 2048, H100); with ``stats`` (and
    ``out``), into ``stats`` instead, with the base-2 logsumexp, in the layout ``attention_backward`` reads."""
    B, H, L, D = q.shape
    S = k.shape[2]
    block_m, block_n, warps = _DQ_CONFIGS[D]
    grid = (cdiv(L, block_m), B * H)
    row_lo, row_hi = intervals[:2] if intervals is not None else (lse, lse)
    if stats is not None:  # each program writes its block's rows, the padding's too
        assert out is not None and block_m == ONE_PASS_BLOCK_M and stats.shape == (2, B * H, cdiv(L, block_m) * block_m)
    launch(_attn_bwd_dq_hopper, grid,
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(grad_out, block_m),
        lse, delta, dq, out if out is not None else dq, row_lo, row_hi, stats if stats is not None else lse,
        *dq.stride(), *(out.stride() if out is not None else (0, 0, 0, 0)), H, H // k.shape[1], L, S,
        B * H, stats.shape[-1] if stats is not None else 0, qk_scale, scale, cap_scale,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=is_causal, INTERVALS=intervals is not None,
        SOFTCAP=cap_scale > 0.0, FORM_DELTA=out is not None, STATS=stats is not None,
        BH_GROUP=1, num_warps=warps,  # one head at a time (see CAUSAL_HEAD_GROUP)
    )


if gluon is not None:

    @gluon.jit
    def _dq_probs(s, lse2, qk_scale, cap_scale, offs_m, m0, start_n, row_lo, row_hi, seen_lo, seen_hi,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                  col_s: gl.constexpr):
        """P of the key block from ``start_n`` for S = Q K^T, masked; SOFTCAP: times the cap's derivative 1 - tanh^2
        (what dS needs: dS = P (dP - delta) then)."""
        if SOFTCAP:
            s = _tanh(s * cap_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if CAUSAL:
            if start_n + BLOCK_N > m0:  # only the blocks that cross the diagonal pay for the mask
                offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_s)
                p = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0), p, 0.0)
        if INTERVALS:
            if start_n < seen_lo or start_n + BLOCK_N - 1 > seen_hi:
                offs_n = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=col_s), 0)
                p = gl.where((offs_n >= gl.expand_dims(row_lo, 1)) & (offs_n <= gl.expand_dims(row_hi, 1)), p, 0.0)
        if SOFTCAP:  # masked scores: p = 0 already
            p = p * (1.0 - s * s)
        return p

    @gluon.jit
    def _attn_bwd_dq_hopper(q_desc, k_desc, v_desc, do_desc, Lse, Delta, DQ, Out, RowLo, RowHi, Stats,
                            stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                            stride_ob, stride_oh, stride_om, stride_od,
                            H, GROUP, L, S, BH, l_pad, qk_scale, scale, cap_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, SOFTCAP: gl.constexpr,
                            FORM_DELTA: gl.constexpr, STATS: gl.constexpr, BH_GROUP: gl.constexpr,
                            num_warps: gl.constexpr):
        """One query block: S = Q K^T and dP = dO V^T for each key block, P = exp(S - lse), dS = P (dP - delta),
        dQ += dS K (dS from registers), block j-1's dQ product in flight while block j's S and dP are formed.
        SOFTCAP: as the dK/dV kernel's. FORM_DELTA: delta = rowsum(dO * O) formed here (O read once from Out) and
        written to Delta for the dK/dV pass, or (STATS) to Stats[1] and the base-2 logsumexp to Stats[0], (BH, l_pad)
        each, padding rows included (+inf and 0 there)."""
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

        bh, b, h, hk, m0, offs_m, row_lo, row_hi, lo, n, seen_lo, seen_hi = _query_block(
            RowLo, RowHi, H, GROUP, L, S, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, BH_GROUP, row_s)

        q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [3, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qdo_bar, count=1)
        for i in gl.static_range(3):
            mbarrier.init(k_bar.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(v_bar.index(i), count=1)
        fence_async_shared()

        mbarrier.expect(qdo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], qdo_bar, q_smem)
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], qdo_bar, do_smem)
        for i in gl.static_range(3):
            _load(k_desc, b, hk, lo + i * BLOCK_N, k_bar.index(i), k_smem.index(i), i < n)
        for i in gl.static_range(2):
            _load(v_desc, b, hk, lo + i * BLOCK_N, v_bar.index(i), v_smem.index(i), i < n)
        q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])
        do_tile = do_smem.reshape([BLOCK_M, HEAD_DIM])

        # key rows past S are zeros in K, adding nothing to dQ
        lse2, delta = _step_stats(Lse, Delta, bh, offs_m, L, True)  # FORM_DELTA: delta replaced below
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if FORM_DELTA:  # O's tile straight from global memory (no shared memory left at D128 for two programs)
            tile: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                  warps_per_cta=[num_warps, 1], order=[1, 0])
            rows_o = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, tile))
            cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, tile))
            o = gl.load(Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
                        + gl.expand_dims(rows_o, 1).to(gl.int64) * stride_om + gl.expand_dims(cols_o, 0) * stride_od,
                        mask=gl.expand_dims(rows_o < L, 1) & gl.expand_dims(cols_o < HEAD_DIM, 0), other=0.0)
        mbarrier.wait(qdo_bar, phase=0)
        if FORM_DELTA:  # rows past L: zero O (and dO, as the TMA reads them), so delta 0
            do_rows = do_smem.reshape([BLOCK_M, HEAD_DIM]).load(tile)
            delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do_rows.to(gl.float32), axis=1), row_s)
            if STATS:
                gl.store(Stats + bh.to(gl.int64) * l_pad + offs_m, lse2)
                gl.store(Stats + (BH + bh).to(gl.int64) * l_pad + offs_m, delta)
            else:
                gl.store(Delta + bh.to(gl.int64) * L + offs_m, delta, mask=offs_m < L)
        # block 0 (every program has one: ``_query_block``): its dS, no dQ product before it
        mbarrier.wait(k_bar.index(0), phase=0)
        s = warpgroup_mma(q_tile, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(0), phase=0)
        dp = warpgroup_mma(do_tile, v_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        p = _dq_probs(s, lse2, qk_scale, cap_scale, offs_m, m0, lo, row_lo, row_hi, seen_lo, seen_hi, BLOCK_N,
                      CAUSAL, INTERVALS, SOFTCAP, col_s)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
        _load(v_desc, b, hk, lo + 2 * BLOCK_N, v_bar.index(0), v_smem.index(0), 2 < n)
        ds = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)
        for j in range(1, n):
            kb = j % 3
            vb = j % 2
            kb_prev = (j + 2) % 3
            mbarrier.wait(k_bar.index(kb), phase=(j // 3) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(kb).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            mbarrier.wait(v_bar.index(vb), phase=(j // 2) & 1)
            dp = warpgroup_mma(do_tile, v_smem.index(vb).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
            dq_acc = warpgroup_mma(ds, k_smem.index(kb_prev).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=2, deps=(s, ))  # products retire in order: S, dP, dQ
            p = _dq_probs(s, lse2, qk_scale, cap_scale, offs_m, m0, lo + j * BLOCK_N, row_lo, row_hi, seen_lo,
                          seen_hi, BLOCK_N, CAUSAL, INTERVALS, SOFTCAP, col_s)
            dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp, ))
            # this slot's V is read: it takes block j + 2's
            _load(v_desc, b, hk, lo + (j + 2) * BLOCK_N, v_bar.index(vb), v_smem.index(vb), j + 2 < n)
            ds_j = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_acc, ))
            # block j-1's K is read: its slot takes block j + 2's
            _load(k_desc, b, hk, lo + (j + 2) * BLOCK_N, k_bar.index(kb_prev), k_smem.index(kb_prev), j + 2 < n)
            ds = ds_j
        dq_acc = warpgroup_mma(ds, k_smem.index((n + 2) % 3).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_acc, ))
        mbarrier.invalidate(qdo_bar)
        for i in gl.static_range(3):
            mbarrier.invalidate(k_bar.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(v_bar.index(i))

        offs_mo = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        ptrs = (DQ + b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
                + gl.expand_dims(offs_mo, 1) * stride_dqm + gl.expand_dims(offs_d, 0) * stride_dqd)
        gl.store(ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(offs_mo < L, 1))
