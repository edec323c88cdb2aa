"""Experiment, not routed: the D128 one-pass backward with 80-query steps (64 + 16, FA3's kBlockM for non-causal
hdim128), dense, not causal. dQ's 16-query part is added by fp32 atomics and dK/dV are stored from the accumulator
layout, so that shared memory fits (223 KB; ptxas for sm_90a: 204 / 220 bytes spilled). Gluon tensors need
power-of-two shapes, so each step is an A part of 64 queries and a B part of 16: two S^T / dP^T tiles, two Q / dO
TMA boxes, dQ_A = dS_A K (64 queries x 64 columns a warpgroup, as the kept kernel)
and dQ_B^T = K^T dS_B^T (64 columns x 16 queries, swapped: wgmma's M is 64).

    attention_backward80(q, k, v, grad_out, stats, dq32, qk_scale, scale, dq, dk, dv)   # stats padded to 80 rows

On a GPU, `python benchmarks/experiments/attention_backward_80_queries.py` checks its gradients against the kept one
pass and times both backwards.
"""
import torch
from triton.testing import do_bench

from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hk
from fusedlayers.kernels import cdiv, launch
from fusedlayers.kernels import scaled_dot_product_attention as K
from fusedlayers.kernels._scaled_dot_product_attention_hopper import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

MA, MB, BLOCK_N = 64, 16, 128
STEP = MA + MB


def _stats_desc(stats, rows):
    l_pad = stats.shape[-1]
    return hk._new_descriptor(stats, [stats.shape[0] * stats.shape[1], l_pad], [l_pad, 1], [1, rows],
                              hk._stats_layout())


def attention_backward80(q, k, v, grad_out, stats, dq32, qk_scale, scale, dq, dk, dv):
    B, H, L, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    assert D == 128 and stats.shape[-1] % STEP == 0
    dq_a = hk._new_descriptor(dq32, [B * H, L, D], [L * D, D, 1], [1, MA, D // 2], hk._dq_layout(MA, D // 2))
    launch(_attn_bwd80, (cdiv(S, BLOCK_N), B * H_kv),
           hk._descriptor(q, MA), hk._descriptor(q, MB), hk._descriptor(k, BLOCK_N), hk._descriptor(v, BLOCK_N),
           hk._descriptor(grad_out, MA), hk._descriptor(grad_out, MB), dq_a, dq32, _stats_desc(stats, MA),
           _stats_desc(stats, MB), dk, dv, *dk.stride(), *dv.stride(), H, H // H_kv, L, S, B * H, qk_scale, scale,
           HEAD_DIM=D, DSA_LAYOUT=hk._ds_layout(BLOCK_N, MA, q.dtype), DSB_LAYOUT=hk._ds_layout(BLOCK_N, MB, q.dtype),
           STAGES=2, num_warps=4)
    hk._dq_scale(dq32, dq, scale)


@gluon.jit
def _producer(qa_desc, qb_desc, k_desc, v_desc, doa_desc, dob_desc, sa_desc, sb_desc, qa_smem, qb_smem, doa_smem,
              dob_smem, k_smem, v_smem, lsea_smem, lseb_smem, dela_smem, delb_smem, kv_bar, q_full, q_empty, do_full,
              do_empty, H, GROUP, L, S, BH, STAGES: gl.constexpr):
    n0, b, hk_, n_m, m_start, total = hk._bwd_program(H, H, H, GROUP, L, S, 80, 128, False, False)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk_, n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, hk_, n0, 0], kv_bar, v_smem)
    q_bytes: gl.constexpr = (qa_desc.block_type.nbytes + qb_desc.block_type.nbytes + sa_desc.block_type.nbytes
                             + sb_desc.block_type.nbytes)
    for i in range(total):
        buf = i % STAGES
        empty_phase = ((i // STAGES) & 1) ^ 1
        h = hk_ * GROUP + i // n_m
        m0 = (i % n_m) * 80
        row = b * H + h
        mbarrier.wait(q_empty.index(buf), phase=empty_phase, pred=i >= STAGES)
        mbarrier.expect(q_full.index(buf), q_bytes)
        tma.async_copy_global_to_shared(qa_desc, [b, h, m0, 0], q_full.index(buf), qa_smem.index(buf))
        tma.async_copy_global_to_shared(qb_desc, [b, h, m0 + 64, 0], q_full.index(buf), qb_smem.index(buf))
        tma.async_copy_global_to_shared(sa_desc, [row, m0], q_full.index(buf), lsea_smem.index(buf))
        tma.async_copy_global_to_shared(sb_desc, [row, m0 + 64], q_full.index(buf), lseb_smem.index(2 * buf))
        mbarrier.wait(do_empty.index(buf), phase=empty_phase, pred=i >= STAGES)
        mbarrier.expect(do_full.index(buf), q_bytes)
        tma.async_copy_global_to_shared(doa_desc, [b, h, m0, 0], do_full.index(buf), doa_smem.index(buf))
        tma.async_copy_global_to_shared(dob_desc, [b, h, m0 + 64, 0], do_full.index(buf), dob_smem.index(buf))
        tma.async_copy_global_to_shared(sa_desc, [BH + row, m0], do_full.index(buf), dela_smem.index(buf))
        tma.async_copy_global_to_shared(sb_desc, [BH + row, m0 + 64], do_full.index(buf), delb_smem.index(2 * buf))


@gluon.jit
def _probs(s_t, lse2, qk_scale, offs_n, S, dtype: gl.constexpr, a_layout: gl.constexpr):
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
    p_t = gl.where(gl.expand_dims(offs_n < S, 1), p_t, 0.0)  # keys past S
    return gl.convert_layout(p_t.to(dtype), a_layout), p_t


@gluon.jit
def _consumer(qa_smem, qb_smem, doa_smem, dob_smem, k_smem, v_smem, lsea_smem, lseb_smem, dela_smem, delb_smem,
              dsa_smem, dsb_smem, dqa_smem, DQ32, dqa_desc, kv_bar, q_full, q_empty, do_full, do_empty,
              ds_ready, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
              stride_dvd, H, GROUP, L, S, qk_scale, scale, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr):
    KEYS: gl.constexpr = 64
    COLS: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = qa_smem.dtype
    sa_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    sb_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dqa_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, COLS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cola: gl.constexpr = gl.SliceLayout(0, sa_layout)
    colb: gl.constexpr = gl.SliceLayout(0, sb_layout)

    n0, b, hk_, n_m, m_start, total = hk._bwd_program(H, H, H, GROUP, L, S, 80, 128, False, False)
    keys0 = n0 + WG * KEYS
    offs_na = keys0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, sa_layout))
    offs_nb = keys0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, sb_layout))
    k_all = k_smem.reshape([128, HEAD_DIM])
    k_tile = k_all.slice(WG * KEYS, KEYS)
    v_tile = v_smem.reshape([128, HEAD_DIM]).slice(WG * KEYS, KEYS)
    k_cols = k_all.slice(WG * COLS, COLS, dim=1)  # [128 keys, this warpgroup's 64 head dims]
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    sa_zero = gl.zeros([KEYS, 64], gl.float32, layout=sa_layout)
    sb_zero = gl.zeros([KEYS, 16], gl.float32, layout=sb_layout)
    dqa_zero = gl.zeros([64, COLS], gl.float32, layout=dqa_layout)
    dqb_zero = gl.zeros([COLS, 16], gl.float32, layout=sb_layout)
    bh0 = b * H + hk_ * GROUP
    mbarrier.wait(kv_bar, phase=0)
    for i in range(total):
        buf = i % STAGES
        phase = (i // STAGES) & 1
        qa = qa_smem.index(buf).reshape([64, HEAD_DIM])
        qb = qb_smem.index(buf).reshape([16, HEAD_DIM])
        doa = doa_smem.index(buf).reshape([64, HEAD_DIM])
        dob = dob_smem.index(buf).reshape([16, HEAD_DIM])
        mbarrier.wait(q_full.index(buf), phase=phase)
        sa = warpgroup_mma(k_tile, qa.permute((1, 0)), sa_zero, use_acc=False, is_async=True)
        sb = warpgroup_mma(k_tile, qb.permute((1, 0)), sb_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_full.index(buf), phase=phase)
        dpa = warpgroup_mma(v_tile, doa.permute((1, 0)), sa_zero, use_acc=False, is_async=True)
        dpb = warpgroup_mma(v_tile, dob.permute((1, 0)), sb_zero, use_acc=False, is_async=True)
        lsea = lsea_smem.index(buf).reshape([64]).load(cola)
        lseb = lseb_smem.index(2 * buf).reshape([16]).load(colb)
        sa, sb = warpgroup_mma_wait(num_outstanding=2, deps=(sa, sb))
        pa_op, pa = _probs(sa, lsea, qk_scale, offs_na, S, dtype, a_layout)
        pb_op, pb = _probs(sb, lseb, qk_scale, offs_nb, S, dtype, a_layout)
        dela = dela_smem.index(buf).reshape([64]).load(cola)
        delb = delb_smem.index(2 * buf).reshape([16]).load(colb)
        dpa, dpb = warpgroup_mma_wait(num_outstanding=0, deps=(dpa, dpb))
        dsa = (pa * (dpa - gl.expand_dims(dela, 0))).to(dtype)
        dsb = (pb * (dpb - gl.expand_dims(delb, 0))).to(dtype)
        dsa_buf = dsa_smem.index(i % 2)
        dsb_buf = dsb_smem.index(i % 2)
        dsa_buf.slice(WG * KEYS, KEYS).store(dsa)
        dsb_buf.slice(WG * KEYS, KEYS).store(dsb)
        dv = warpgroup_mma(pa_op, doa, dv, is_async=True)
        dv = warpgroup_mma(pb_op, dob, dv, is_async=True)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(i % 2))
        dk = warpgroup_mma(gl.convert_layout(dsa, a_layout), qa, dk, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dsb, a_layout), qb, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(do_empty.index(buf))
        mbarrier.wait(ds_ready.index(i % 2), phase=(i // 2) & 1)
        dqa = warpgroup_mma(dsa_buf.permute((1, 0)), k_cols, dqa_zero, use_acc=False, is_async=True)
        dqb = warpgroup_mma(k_cols.permute((1, 0)), dsb_buf, dqb_zero, use_acc=False, is_async=True)
        dqa, dqb = warpgroup_mma_wait(num_outstanding=0, deps=(dqa, dqb))
        tma.store_wait(0)  # the previous step's reductions have read dq smem
        gl.thread_barrier()
        dqa_smem.index(WG).reshape([64, COLS]).store(dqa)
        fence_async_shared()
        row = bh0 + i // n_m
        m0 = (i % n_m) * 80
        hk._tma_reduce_add(dqa_desc, [row, m0, WG * COLS], dqa_smem.index(WG))
        qrows = m0 + 64 + gl.arange(0, 16, layout=colb)
        cols = WG * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(1, sb_layout))
        ptrs = DQ32 + (row.to(gl.int64) * L + gl.expand_dims(qrows, 0)) * HEAD_DIM + gl.expand_dims(cols, 1)
        gl.atomic_add(ptrs, dqb, mask=gl.expand_dims(qrows < L, 0), sem="relaxed")
        mbarrier.arrive(q_empty.index(buf))
    tma.store_wait(0)
    offs_n = keys0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    rows = gl.expand_dims(offs_n < S, 1)
    dk_ptrs = (DK + b.to(gl.int64) * stride_dkb + hk_.to(gl.int64) * stride_dkh
               + gl.expand_dims(offs_n, 1) * stride_dkn + gl.expand_dims(offs_d, 0) * stride_dkd)
    gl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=rows)
    dv_ptrs = (DV + b.to(gl.int64) * stride_dvb + hk_.to(gl.int64) * stride_dvh
               + gl.expand_dims(offs_n, 1) * stride_dvn + gl.expand_dims(offs_d, 0) * stride_dvd)
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=rows)


@gluon.jit
def _attn_bwd80(qa_desc, qb_desc, k_desc, v_desc, doa_desc, dob_desc, dqa_desc, DQ32, sa_desc, sb_desc, DK, DV,
                stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                H, GROUP, L, S, BH, qk_scale, scale, HEAD_DIM: gl.constexpr, DSA_LAYOUT: gl.constexpr,
                DSB_LAYOUT: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = qa_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, 128, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, 128, HEAD_DIM], v_desc.layout)
    qa_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, 64, HEAD_DIM], qa_desc.layout)
    qb_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, 16, HEAD_DIM], qb_desc.layout)
    doa_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, 64, HEAD_DIM], doa_desc.layout)
    dob_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, 16, HEAD_DIM], dob_desc.layout)
    lsea_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 64], sa_desc.layout)
    lseb_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, 16], sb_desc.layout)  # TMA: 128 B aligned
    dela_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 64], sa_desc.layout)
    delb_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, 16], sb_desc.layout)
    dsa_smem = gl.allocate_shared_memory(dtype, [2, 128, 64], DSA_LAYOUT)
    dsb_smem = gl.allocate_shared_memory(dtype, [2, 128, 16], DSB_LAYOUT)
    dqa_smem = gl.allocate_shared_memory(gl.float32, [2] + dqa_desc.block_type.shape, dqa_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(do_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_producer, (qa_desc, qb_desc, k_desc, v_desc, doa_desc, dob_desc, sa_desc, sb_desc, qa_smem, qb_smem,
                     doa_smem, dob_smem, k_smem, v_smem, lsea_smem, lseb_smem, dela_smem, delb_smem, kv_bar, q_full,
                     q_empty, do_full, do_empty, H, GROUP, L, S, BH, STAGES)),
        (_consumer, (qa_smem, qb_smem, doa_smem, dob_smem, k_smem, v_smem, lsea_smem, lseb_smem, dela_smem,
                     delb_smem, dsa_smem, dsb_smem, dqa_smem, DQ32, dqa_desc, kv_bar, q_full, q_empty,
                     do_full, do_empty, ds_ready, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb,
                     stride_dvh, stride_dvn, stride_dvd, H, GROUP, L, S, qk_scale, scale, 0, HEAD_DIM, STAGES)),
        (_consumer, (qa_smem, qb_smem, doa_smem, dob_smem, k_smem, v_smem, lsea_smem, lseb_smem, dela_smem,
                     delb_smem, dsa_smem, dsb_smem, dqa_smem, DQ32, dqa_desc, kv_bar, q_full, q_empty,
                     do_full, do_empty, ds_ready, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb,
                     stride_dvh, stride_dvn, stride_dvd, H, GROUP, L, S, qk_scale, scale, 1, HEAD_DIM, STAGES)),
    ], [4, 4], [240, 240])


def inputs(B, H, Hk, L, D=128):
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hk, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn_like(q)


def lse_of(q, k, v):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    K.attention_forward(q.detach(), k.detach(), v.detach(), None, None, False, q.shape[-1] ** -0.5, out, lse)
    return out, lse


def backward(step, q, k, v, out, lse, do):
    B, H, L, D = q.shape
    scale = D ** -0.5
    qk_scale = K._exponent_scale(q.dtype, scale)
    l_pad = cdiv(L, step) * step
    stats = torch.empty((2, B * H, l_pad), dtype=torch.float32, device="cuda")
    lse2, delta = stats.unbind()
    dq32 = torch.empty((B * H, L, D), dtype=torch.float32, device="cuda")
    launch(K._bwd_preprocess_kernel, (cdiv(l_pad, 64), B * H), out, do, delta, lse, lse2, dq32, *out.stride(),
           *do.stride(), H, L, D, l_pad, BLOCK_M=64, BLOCK_DV=D, LSE2=True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if step == 80:
        attention_backward80(q, k, v, do, stats, dq32, qk_scale, scale, dq, dk, dv)
    else:
        hk.attention_backward(q, k, v, do, stats, dq32, False, qk_scale, scale, dq, dk, dv)
    return dq, dk, dv


if __name__ == "__main__":
    for B, H, Hk, L in [(2, 4, 4, 1000), (1, 8, 2, 2048), (4, 16, 16, 4096), (8, 16, 16, 2048), (1, 16, 16, 16384)]:
        q, k, v, do = inputs(B, H, Hk, L)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        out, lse = lse_of(qd, kd, vd)
        ref = backward(64, qd, kd, vd, out, lse, do)
        new = backward(80, qd, kd, vd, out, lse, do)
        errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                for a, b in zip(new, ref, strict=True)]
        t64 = do_bench(lambda: backward(64, qd, kd, vd, out, lse, do), warmup=50, rep=300)
        t80 = do_bench(lambda: backward(80, qd, kd, vd, out, lse, do), warmup=50, rep=300)
        t64b = do_bench(lambda: backward(64, qd, kd, vd, out, lse, do), warmup=50, rep=300)
        flops = 2.5 * 4 * B * H * L * L * 128
        print(f"B{B} H{H}/{Hk} L{L}: rel err dq dk dv {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e} | bwd ms 64: "
              f"{t64:.3f} {t64b:.3f}  80: {t80:.3f} | 80/64 speed {min(t64, t64b) / t80:.3f} | "
              f"TFLOP/s 80 {flops / t80 / 1e9:.0f}", flush=True)
