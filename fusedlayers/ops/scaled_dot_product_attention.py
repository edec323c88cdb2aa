"""Attention ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, autocast, CPU reference.

Ops (``fusedlayers.functional.scaled_dot_product_attention`` validates the input and calls them):

- ``scaled_dot_product_attention(q, k, v, attn_mask, seed, dropout_p, is_causal, scale, layout=0) -> (out, lse)``:
  q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv) with H a multiple of H_kv (grouped-query
  attention reads key/value head h // (H // H_kv); nothing is expanded). ``attn_mask`` None, bool
  (True = keep) or additive float, broadcastable to (B, H, L, S); ``is_causal`` keeps key j for query i
  when j <= i (top-left, as F.scaled_dot_product_attention; may be combined with ``attn_mask``).
  ``seed`` None (no dropout) or an int64 CPU tensor of two values in [0, 2**31): the dropout mask is a
  counter-based hash of (key, query, b*H + h) under it, so the backward regenerates it. Returns the
  output (B, H, L, Dv) and the logsumexp of the scaled, masked scores (B, H, L), float64 for fp32/fp64
  input (``lse_dtype``), fp32 for fp16/bf16, +inf on rows where every key is masked (their output is 0).
  Any head dims D, Dv >= 0 (the Triton kernels pad D and Dv to a power of two inside the kernel, by masked
  loads; D or Dv > 256 runs the reference below on the inputs' device). ``layout`` (``LAYOUT_*``, from
  ``torch_layout``) is the kind of kernel torch's own SDPA runs for the same call: it picks the memory
  layout of the output and of the gradients (torch's), and how the backward forms delta = sum_j P dP (see
  ``attention_backward_reference``): as torch's math path (``MATH_LAYOUTS``, and fp32) or as its fused
  kernels (rowsum(dO * O)).
- ``scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse, attn_mask, seed, dropout_p,
  is_causal, scale, need_dq, need_dk, need_dv, need_dmask, layout=0) -> (dq, dk, dv, ds)``: the gradients asked
  for (an empty tensor for the others); ``ds`` is d(loss)/d(scores) as (B, H, L, S), the gradient of an
  additive float mask before it is summed to the mask's shape. An op of its own, so torch.compile traces
  forward and backward without a graph break.

Forward saves only q, k, v, the output and the logsumexp; the backward recomputes the probabilities
block by block (FlashAttention-2). Both the Triton kernels and the PyTorch reference below run the same
blockwise algorithm with O(L) memory beyond inputs and outputs (the reference processes all queries
against one block of keys at a time). float64 always runs the reference.

Dropout from outside: ``draw_dropout_seed()`` is the seed ``fl.scaled_dot_product_attention`` draws (so
``torch.manual_seed(s); seed = draw_dropout_seed()`` gives the seed of a call made after
``torch.manual_seed(s)``), and ``dropout_keep_mask(seed, batch_shape, L, S, p)`` the keep mask it applies.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autocast_cast, register_autograd

try:
    from fusedlayers.kernels import scaled_dot_product_attention as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None

# Keys per step of the reference (its working set is (B, H, L, REFERENCE_BLOCK_N)).
REFERENCE_BLOCK_N = 128
PHILOX_ROUNDS = 7
_M32 = 0xFFFFFFFF


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the saved logsumexp: float64 for fp32 (and fp64) inputs, float32 for fp16/bf16 ones.

    The backward forms each probability as exp(s - lse). An fp32 lse is off by up to u |lse| (u = 2**-24),
    which becomes the relative error of every probability of the row: for scores in the hundreds that is
    ~1e-5, far more than fp32 softmax's own error (torch's math path subtracts the row max, exactly). So fp32
    inputs keep lse = m + log(l) unrounded in a float64 (m the row max, both fp32), and the backward splits it
    back into hi + lo (fp32 each) and computes exp((s - hi) - lo). For 16-bit inputs u |lse| is far below
    their own rounding."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


def split_lse(lse: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hi, lo) in ``acc`` with hi + lo == lse (to ~u^2): lo = 0 where lse is not finite (+inf: no keys)."""
    hi = lse.to(acc)
    lo = torch.where(torch.isfinite(hi), lse - hi.to(lse.dtype), 0.0).to(acc)
    return hi, lo


# The Triton kernels pad head dims to a power of two of at most this (BLOCK_D); larger run the reference.
KERNEL_MAX_HEAD_DIM = 256


def _run_kernel(q: Tensor, v: Tensor) -> bool:
    return (q.dtype != torch.float64 and 0 < v.shape[-1] and max(q.shape[-1], v.shape[-1]) <= KERNEL_MAX_HEAD_DIM
            and use_triton(q) and kernels is not None)


# ----------------------------------------------------------------------------- memory layouts (torch's)

# The layout of the output (and of the gradients) that torch's F.scaled_dot_product_attention gives, which
# depends on the kernel torch picks for the call. Output / gradients of q, k, v:
LAYOUT_CONTIGUOUS = 0  # math path: output contiguous / dq, dv contiguous, dk (..., E, S)-major unless GQA
LAYOUT_LIKE_QUERY = 1  # CPU flash kernel: output empty_like(query) / (B, L, H, E)-major
LAYOUT_BLHE = 2  # CUDA memory-efficient kernel: output (B, L, H, Ev)-major / as LAYOUT_LIKE_QUERY
LAYOUT_LIKE_QUERY_T = 3  # CUDA flash kernel: empty_like(query.transpose(1, 2)).transpose(1, 2) / as above
LAYOUT_QUERY_ORDER = 4  # cuDNN: dense, its dims in query's stride order / as above
LAYOUT_CONTIGUOUS_DK = 5  # math path where at::matmul folds to a 2-D product or GQA repeats K: dk contiguous too
MATH_LAYOUTS = (LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS_DK)
_CUDA_CHOICE_LAYOUT = {0: LAYOUT_CONTIGUOUS, 1: LAYOUT_LIKE_QUERY_T, 2: LAYOUT_BLHE, 3: LAYOUT_QUERY_ORDER}


def torch_cpu_takes_flash(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                          enable_gqa: bool) -> bool:
    """Whether torch's CPU SDPA runs its flash kernel for this call (else its math path): the checks of
    ``use_flash_attention_cpp`` (aten/src/ATen/native/transformers/sdp_utils_cpp.{h,cpp}) in Python, so that
    torch.compile traces them (tests compare this with ``torch._fused_sdp_choice``)."""
    if dropout_p > 0.0:
        return False
    # torch.nn.attention.sdpa_kernel can switch the flash kernel off (torch.compile cannot trace the flag: on)
    if not torch.compiler.is_compiling() and not torch.backends.cuda.flash_sdp_enabled():
        return False
    if not query.dim() == key.dim() == value.dim() == 4:
        return False
    B, H, L, E = query.shape
    if not B == key.shape[0] == value.shape[0]:
        return False
    H_k, S = key.shape[1], key.shape[2]
    if enable_gqa:
        if H_k != value.shape[1] or H_k == 0 or H % H_k != 0:
            return False
    elif not H == H_k == value.shape[1]:
        return False
    if attn_mask is not None:
        if attn_mask.requires_grad or attn_mask.dim() not in (2, 4):
            return False
        if attn_mask.shape[-2] not in (L, 1) or attn_mask.shape[-1] not in (S, 1):
            return False
        if attn_mask.dim() == 4 and (attn_mask.shape[0] not in (1, B) or attn_mask.shape[1] not in (1, H)):
            return False
    if not E == key.shape[3] == value.shape[3] or L == 0 or S == 0:
        return False
    return query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1


def torch_layout(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                 is_causal: bool, scale: float | None, enable_gqa: bool) -> int:
    """The ``LAYOUT_*`` of torch's output for F.scaled_dot_product_attention(query, key, value, ...) (the
    caller's tensors, before any reshaping). CPU: exact (``torch_cpu_takes_flash``). CUDA in eager code:
    torch's own kernel choice (``torch._fused_sdp_choice``) mapped to the layout that kernel allocates;
    under torch.compile, which cannot trace that call, an approximation of it (``_torch_cuda_guess``)."""
    if query.is_cuda:
        if torch.compiler.is_compiling():
            return _torch_cuda_guess(query, key, value, attn_mask, enable_gqa)
        try:
            choice = int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                 enable_gqa=enable_gqa))
        except RuntimeError:  # no kernel torch would run: its math path
            choice = 0
        return _CUDA_CHOICE_LAYOUT.get(choice, LAYOUT_CONTIGUOUS)
    return LAYOUT_LIKE_QUERY if torch_cpu_takes_flash(query, key, value, attn_mask, dropout_p, enable_gqa) \
        else LAYOUT_CONTIGUOUS


def _torch_cuda_guess(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, enable_gqa: bool) -> int:
    """torch's CUDA kernel choice, roughly (for torch.compile): its fused kernels need 4-D inputs of one batch
    size, equal (or grouped) heads, nonzero lengths and a contiguous last dim; flash takes fp16/bf16 without
    a mask and E == Ev <= 256, memory-efficient attention the rest with head dims a multiple of 8."""
    dims_ok = query.dim() == key.dim() == value.dim() == 4 and query.shape[0] == key.shape[0] == value.shape[0]
    if not dims_ok or query.shape[2] == 0 or key.shape[2] == 0:
        return LAYOUT_CONTIGUOUS
    H, H_k = query.shape[1], key.shape[1]
    heads_ok = H == H_k == value.shape[1] or (enable_gqa and H_k == value.shape[1] and H_k > 0 and H % H_k == 0)
    if not heads_ok or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return LAYOUT_CONTIGUOUS
    E, Ev = query.shape[-1], value.shape[-1]
    if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and E == Ev <= 256:
        return LAYOUT_LIKE_QUERY_T
    if query.dtype != torch.float64 and E % 8 == 0 and Ev % 8 == 0 and E > 0 and Ev > 0:
        return LAYOUT_BLHE
    return LAYOUT_CONTIGUOUS


def _dense_in_order(t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, order: list[int]) -> Tensor:
    """A new dense tensor of ``shape`` whose dims are laid out outermost-first in ``order``."""
    stored = t.new_empty([shape[i] for i in order], dtype=dtype)
    return stored.permute([order.index(i) for i in range(len(shape))])


def _new_output(q: Tensor, shape: tuple[int, ...], dtype: torch.dtype, layout: int) -> Tensor:
    """The output (B, H, L, Dv) in ``layout``."""
    same_shape = tuple(q.shape) == tuple(shape)
    if layout == LAYOUT_LIKE_QUERY and same_shape:
        return torch.empty_like(q, dtype=dtype)
    if layout == LAYOUT_LIKE_QUERY_T and same_shape:
        return torch.empty_like(q.transpose(1, 2), dtype=dtype).transpose(1, 2)
    if layout == LAYOUT_QUERY_ORDER and same_shape:  # dims by decreasing stride (ties: the later dim inner)
        order = sorted(range(4), key=lambda i: (-q.stride(i), i))
        return _dense_in_order(q, shape, dtype, order)
    if layout == LAYOUT_BLHE:
        return _dense_in_order(q, shape, dtype, [0, 2, 1, 3])
    return q.new_empty(shape, dtype=dtype)


def _dense(t: Tensor) -> bool:
    """Whether t's elements fill its storage span without gaps or overlaps, in some dim order."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _new_grad(t: Tensor, layout: int, transposed: bool) -> Tensor:
    """The gradient of q, k or v (B, H_t, n, d) in the layout torch's backward gives: after CUDA's flash and cuDNN
    kernels laid out as t (dense t; a leaf's .grad then needs no copy into t's layout, which autograd makes
    otherwise: 0.3 ms of a 1.4 ms backward at L = 2048 on an H100), after the other fused kernels (B, n, H_t, d)-major;
    after the math path contiguous, or (B, H_t, d, n)-major (``transposed``: dk without GQA, the gradient of k^T in
    q @ k^T)."""
    if layout in (LAYOUT_LIKE_QUERY_T, LAYOUT_QUERY_ORDER) and _dense(t):
        return torch.empty_like(t)  # keeps a dense tensor's strides
    if layout not in MATH_LAYOUTS:
        return _dense_in_order(t, tuple(t.shape), t.dtype, [0, 2, 1, 3])
    if transposed:
        return _dense_in_order(t, tuple(t.shape), t.dtype, [0, 1, 3, 2])
    return t.new_empty(t.shape)


# ----------------------------------------------------------------------------- dropout (Philox, in PyTorch)


def _mul32(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * b for int64 tensors a in [0, 2**32) and a constant b < 2**32,
    without overflowing int64 (b split in 16-bit halves)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_part = a * b_lo  # < 2**48
    t = a * b_hi + (lo_part >> 16)  # < 2**49
    return t >> 16, ((t & 0xFFFF) << 16) | (lo_part & 0xFFFF)


def philox_keep(seed0: int, seed1: int, rows: Tensor, cols: Tensor, bh: Tensor, threshold: int) -> Tensor:
    """Dropout keep mask, bit-identical to the Triton kernels' ``_dropout_keep``: Philox-4x32-7 of the
    counter (col, row, bh, 0) under the key (seed0, seed1); kept where the first output word's top 31
    bits are >= threshold. ``rows``, ``cols``, ``bh``: int64 tensors that broadcast together."""
    shape = torch.broadcast_shapes(rows.shape, cols.shape, bh.shape)
    c0 = cols.expand(shape) & _M32
    c1 = rows.expand(shape) & _M32
    c2 = bh.expand(shape) & _M32
    c3 = torch.zeros(shape, dtype=torch.int64, device=cols.device)
    k0, k1 = seed0 & _M32, seed1 & _M32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul32(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul32(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return (c0 >> 1) >= threshold


def dropout_params(seed: Tensor | None, dropout_p: float) -> tuple[int, int, int, float]:
    """(seed0, seed1, threshold on 31 random bits, 1 / (1 - p)); p == 1 drops everything (scale 0)."""
    if seed is None or dropout_p <= 0.0:
        return 0, 0, 0, 1.0
    seed0, seed1 = (int(x) for x in seed.tolist())
    if dropout_p >= 1.0:
        return seed0, seed1, 2**31 - 1, 0.0
    return seed0, seed1, min(int(dropout_p * 2**31), 2**31 - 1), 1.0 / (1.0 - dropout_p)


def draw_dropout_seed() -> Tensor:
    """The dropout seed of one attention call: two int64 values in [0, 2**31) from torch's CPU generator."""
    return torch.randint(0, 2**31, (2,), dtype=torch.int64)


def dropout_keep_mask(seed: Tensor, batch_shape, L: int, S: int, dropout_p: float,
                      device: torch.device | str = "cpu") -> Tensor:
    """The keep mask (bool, (*batch_shape, L, S), True = kept) that attention with ``dropout_p`` applies under
    ``seed`` (``draw_dropout_seed()``), for an output of batch shape ``batch_shape`` (the broadcast batch dims
    of query, key and value, heads last: e.g. (B, H)). Kept probabilities are scaled by 1 / (1 - dropout_p)."""
    batch_shape = tuple(batch_shape)
    seed0, seed1, threshold, _ = dropout_params(seed, dropout_p)
    if dropout_p <= 0.0:
        return torch.ones((*batch_shape, L, S), dtype=torch.bool, device=device)
    n = 1
    for size in batch_shape:
        n *= size
    bh = torch.arange(n, device=device).view(*batch_shape, 1, 1)  # b * H + h: the flat batch index
    rows = torch.arange(L, device=device).view(L, 1)
    cols = torch.arange(S, device=device).view(1, S)
    return philox_keep(seed0, seed1, rows, cols, bh, threshold)


# ----------------------------------------------------------------------------- reference (PyTorch)


class _Blocks:
    """Shared set-up of the reference: queries grouped per key/value head, (B, H_kv, G*L, D), so that one
    block of keys serves all the query heads of its group without copying K/V."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seed: Tensor | None,
                 dropout_p: float, is_causal: bool, scale: float, window: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, intervals: tuple[Tensor, ...] | None = None, offsets: tuple[int, int] = (0, 0)):
        self.acc = _accumulator(q.dtype)
        # (first query row, first key) of this piece of a larger problem (the varlen reference's chunks): the key
        # intervals hold absolute key indices, and the dropout mask hashes absolute (row, key) as the kernels do.
        # Offsets given as (B,) tensors: each batch entry is its own piece of one problem (batch index 0 to dropout)
        self.pieces = isinstance(offsets[0], Tensor)
        self.row0, self.col0 = (o.view(-1, 1, 1, 1) if self.pieces else o for o in offsets)
        B, H, L, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        G = H // H_kv
        self.B, self.H, self.L, self.S, self.G, self.H_kv = B, H, L, S, G, H_kv
        self.k, self.v, self.scale, self.is_causal = k, v, scale, is_causal
        self.window, self.softcap = window, softcap
        # keys past the last one a window reaches (query L - 1 sees keys up to L - 1 + right) are never read
        self.key_end = S if window[1] < 0 else max(0, min(S, L + window[1]))
        # (row_lo, row_hi, ...): query row i attends keys [row_lo[i], row_hi[i]] ((L,), or (B, L) per batch entry)
        self.intervals = intervals
        self.q = q.reshape(B, H_kv, G * L, D).to(self.acc)
        self.rows = torch.arange(G * L, device=q.device) % L  # query index of each grouped row
        # (B, H_kv, G, L, S) view of the expanded mask: a block of it is sliced per step (no full copy)
        self.mask = mask.expand(B, H, L, S).view(B, H_kv, G, L, S) if mask is not None else None
        self.seed0, self.seed1, self.threshold, self.inv_keep = dropout_params(seed, dropout_p)
        self.dropout = seed is not None and dropout_p > 0.0
        if self.dropout:
            b = torch.arange(B, device=q.device).view(B, 1, 1, 1) * (not self.pieces)
            hk = torch.arange(H_kv, device=q.device).view(1, H_kv, 1, 1)
            g = (torch.arange(G * L, device=q.device) // L).view(1, 1, G * L, 1)
            self.bh = b * H + hk * G + g  # b * H + h of each grouped row
            self.rows_i64 = self.rows.view(1, 1, G * L, 1) + self.row0

    def blocks(self, block_n: int):
        for n0 in range(0, self.key_end, block_n):
            yield n0, min(n0 + block_n, self.key_end)

    def scores(self, n0: int, n1: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(scaled masked scores (B, H_kv, G*L, n), key block, value block, d(capped)/d(raw) score or None), in the
        accumulator dtype. Soft-capping (``softcap`` c > 0) maps the scaled score x to c * tanh(x / c) before the
        mask is added (Gemma 2's order); the window keeps key j for query i when i - left <= j <= i + right (-1:
        unbounded on that side; top-left aligned, as is_causal)."""
        kb = self.k[:, :, n0:n1].to(self.acc)
        vb = self.v[:, :, n0:n1].to(self.acc)
        s = torch.matmul(self.q, kb.transpose(-1, -2)) * self.scale
        dcap = None
        if self.softcap > 0.0:
            t = torch.tanh(s / self.softcap)
            s, dcap = self.softcap * t, 1.0 - t * t
        if self.mask is not None:
            mb = self.mask[..., n0:n1].reshape(self.B, self.H_kv, self.G * self.L, n1 - n0)
            if mb.dtype == torch.bool:
                s = s.masked_fill(~mb, float("-inf"))
            else:
                s = s + mb.to(self.acc)
        cols = torch.arange(n0, n1, device=s.device)
        if self.is_causal:
            s = s.masked_fill(cols[None, :] > self.rows[:, None], float("-inf"))
        left, right = self.window
        if left >= 0:
            s = s.masked_fill(cols[None, :] < self.rows[:, None] - left, float("-inf"))
        if right >= 0:
            s = s.masked_fill(cols[None, :] > self.rows[:, None] + right, float("-inf"))
        if self.intervals is not None:
            lo, hi = (t.to(torch.int64).view(-1, self.L)[:, self.rows].view(-1, 1, self.G * self.L, 1) - self.col0
                      for t in self.intervals[:2])
            s = s.masked_fill((cols < lo) | (cols > hi), float("-inf"))
        return s, kb, vb, dcap

    def keep(self, n0: int, n1: int) -> Tensor:
        cols = torch.arange(n0, n1, device=self.q.device).view(1, 1, 1, n1 - n0) + self.col0
        return philox_keep(self.seed0, self.seed1, self.rows_i64, cols, self.bh, self.threshold)


def attention_forward_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seed: Tensor | None, dropout_p: float,
    is_causal: bool, scale: float, block_n: int = REFERENCE_BLOCK_N, window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, intervals: tuple[Tensor, ...] | None = None, offsets: tuple[int, int] = (0, 0),
) -> tuple[Tensor, Tensor]:
    """FlashAttention-2 forward in PyTorch: online softmax over blocks of ``block_n`` keys."""
    st = _Blocks(q, k, v, mask, seed, dropout_p, is_causal, scale, window, softcap, intervals, offsets)
    B, H, L, DV = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    rows = (B, st.H_kv, st.G * L)
    m = torch.full(rows, float("-inf"), dtype=st.acc, device=q.device)
    l_sum = torch.zeros(rows, dtype=st.acc, device=q.device)
    acc = torch.zeros((*rows, DV), dtype=st.acc, device=q.device)
    for n0, n1 in st.blocks(block_n):
        s, _, vb, _ = st.scores(n0, n1)
        m_new = torch.maximum(m, s.amax(-1))
        m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows masked so far: exp(-inf) = 0, no NaN
        p = torch.exp(s - m_sub[..., None])
        alpha = torch.exp(m - m_sub)
        l_sum = l_sum * alpha + p.sum(-1)
        if st.dropout:
            p = p * st.keep(n0, n1)
        acc = acc * alpha[..., None] + torch.matmul(p, vb)
        m = m_new
    has_keys = l_sum > 0
    inv = torch.where(has_keys, 1.0 / l_sum, 0.0) * st.inv_keep
    out = (acc * inv[..., None]).reshape(B, H, L, DV).to(q.dtype)
    lse_t = lse_dtype(q.dtype)
    lse = torch.where(has_keys, m.to(lse_t) + torch.log(l_sum).to(lse_t), float("inf")).reshape(B, H, L)
    return out, lse


def attention_backward_reference(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    seed: Tensor | None, dropout_p: float, is_causal: bool, scale: float,
    need_dq: bool, need_dk: bool, need_dv: bool, need_dmask: bool, block_n: int = REFERENCE_BLOCK_N,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, intervals: tuple[Tensor, ...] | None = None,
    offsets: tuple[int, int] = (0, 0),
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """FlashAttention-2 backward in PyTorch: probabilities recomputed per key block from the logsumexp.

    One difference from the kernels: delta_i = sum_j P_ij dP_ij (the softmax backward's row term) is formed
    in a first pass over the key blocks, as torch's math path forms it, instead of rowsum(dO * O) from the
    saved output. The two are equal in exact arithmetic; the saved output is rounded to the input dtype
    (fp16/bf16: 2**-11 / 2**-8), and where the softmax is nearly one-hot dP_ij - delta_i cancels, so that
    rounding would dominate dS (the kernels accept it for speed, as FlashAttention and torch's fused kernels
    do)."""
    st = _Blocks(q, k, v, mask, seed, dropout_p, is_causal, scale, window, softcap, intervals, offsets)
    B, H, L, D = q.shape
    H_kv, S, G = st.H_kv, st.S, st.G
    acc = st.acc
    do = grad_out.reshape(B, H_kv, G * L, v.shape[-1]).to(acc)
    lse_hi, lse_lo = split_lse(lse.reshape(B, H_kv, G * L, 1), acc)
    need_ds = need_dq or need_dk or need_dmask

    def probs_and_dp(n0: int, n1: int):
        s, kb, vb, dcap = st.scores(n0, n1)
        p = torch.exp((s - lse_hi) - lse_lo)  # 0 where masked (s = -inf) and on fully-masked rows (lse = +inf)
        keep = st.keep(n0, n1) if st.dropout else None
        dp = torch.matmul(do, vb.transpose(-1, -2)) if need_ds else None
        if keep is not None and dp is not None:
            dp = dp * keep * st.inv_keep
        return p, dp, keep, kb, dcap

    delta = torch.zeros((B, H_kv, G * L, 1), dtype=acc, device=q.device)
    if need_ds:
        for n0, n1 in st.blocks(block_n):
            p, dp, _, _, _ = probs_and_dp(n0, n1)
            delta += (p * dp).sum(-1, keepdim=True)
    dq = torch.zeros((B, H_kv, G * L, D), dtype=acc, device=q.device) if need_dq else None
    new = torch.empty if st.key_end == S else torch.zeros  # keys no window reaches get zero gradients
    dk = new(k.shape, dtype=k.dtype, device=k.device) if need_dk else None
    dv = new(v.shape, dtype=v.dtype, device=v.device) if need_dv else None
    ds_all = torch.zeros((B, H, L, S), dtype=acc, device=q.device) if need_dmask else None
    for n0, n1 in st.blocks(block_n):
        p, dp, keep, kb, dcap = probs_and_dp(n0, n1)
        if need_dv:
            p_drop = p * keep * st.inv_keep if keep is not None else p
            dv[:, :, n0:n1] = torch.matmul(p_drop.transpose(-1, -2), do).to(v.dtype)  # sums the group's rows
        if need_ds:
            ds = p * (dp - delta)  # d(loss)/d(capped, masked score): the float mask's gradient
            if need_dmask:
                ds_all[..., n0:n1] = ds.view(B, H, L, n1 - n0)
            if dcap is not None:  # through the soft-cap to the raw score
                ds = ds * dcap
            if need_dq:
                dq += torch.matmul(ds, kb)
            if need_dk:
                dk[:, :, n0:n1] = (torch.matmul(ds.transpose(-1, -2), st.q) * scale).to(k.dtype)
    if need_dq:
        dq = (dq * scale).reshape(B, H, L, D).to(q.dtype)
    return dq, dk, dv, ds_all


# ----------------------------------------------------------------------------- forward op


def _empty_outputs(q: Tensor, v: Tensor, layout: int) -> tuple[Tensor, Tensor]:
    B, H, L = q.shape[:3]
    return (_new_output(q, (B, H, L, v.shape[3]), q.dtype, layout),
            q.new_empty((B, H, L), dtype=lse_dtype(q.dtype)))


@custom_op("fusedlayers::scaled_dot_product_attention")
def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, seed: Tensor | None,
    dropout_p: float, is_causal: bool, scale: float, layout: int = LAYOUT_CONTIGUOUS, window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    B, H, L = query.shape[:3]
    S = key.shape[2]
    out, lse = _empty_outputs(query, value, layout)
    if B * H * L == 0:
        return out, lse
    if S == 0:  # no keys: every row is fully masked
        return out.zero_(), lse.fill_(float("inf"))
    mask = attn_mask.expand(B, H, L, S) if attn_mask is not None else None
    window = (window_left, window_right)
    if _run_kernel(query, value):
        drop = dropout_params(seed, dropout_p) if seed is not None and dropout_p > 0.0 else None
        kernels.attention_forward(query, key, value, mask, drop, is_causal, scale, out, lse, window=window,
                                  softcap=softcap)
        return out, lse
    out_r, lse_r = attention_forward_reference(query, key, value, mask, seed, dropout_p, is_causal, scale,
                                               window=window, softcap=softcap)
    return out.copy_(out_r), lse_r


@scaled_dot_product_attention.register_fake
def _(query, key, value, attn_mask, seed, dropout_p, is_causal, scale, layout=LAYOUT_CONTIGUOUS, window_left=-1,
      window_right=-1, softcap=0.0):
    return _empty_outputs(query, value, layout)


def _forward_setup_context(ctx, inputs, output):
    query, key, value, attn_mask, seed, dropout_p, is_causal, scale, *rest = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale
    # the trailing arguments with defaults: layout, window_left, window_right, softcap (those not passed: defaults)
    ctx.layout, ctx.window_left, ctx.window_right, ctx.softcap = (*rest, *(LAYOUT_CONTIGUOUS, -1, -1, 0.0)[len(rest):])
    ctx.mask_meta = (attn_mask.shape, attn_mask.dtype) if attn_mask is not None else None
    ctx.save_for_backward(query, key, value, out, lse, attn_mask, seed)


def _forward_autograd(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, attn_mask, seed = ctx.saved_tensors
    need_dq, need_dk, need_dv, need_dmask = ctx.needs_input_grad[:4]
    nones = (None,) * (len(ctx.needs_input_grad) - 4)
    if not (need_dq or need_dk or need_dv or need_dmask):
        return None, None, None, None, *nones
    dq, dk, dv, ds = call(
        scaled_dot_product_attention_backward,
        grad_out, query, key, value, out, lse, attn_mask, seed, ctx.dropout_p, ctx.is_causal, ctx.scale,
        need_dq, need_dk, need_dv, need_dmask, ctx.layout, ctx.window_left, ctx.window_right, ctx.softcap,
    )
    dmask = None
    if need_dmask:  # an additive float mask that requires grad: dS summed over its broadcast dims
        mask_shape, mask_dtype = ctx.mask_meta
        dmask = ds.sum_to_size(mask_shape).to(mask_dtype)
    return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, dmask, *nones)


register_autograd(scaled_dot_product_attention, _forward_autograd, _forward_setup_context)


# ----------------------------------------------------------------------------- backward op


def _backward_outputs(query, key, value, need_dq, need_dk, need_dv, need_dmask, layout):
    B, H, L = query.shape[:3]
    S = key.shape[2]

    def none():  # a fresh empty tensor each (outputs may not alias one another)
        return query.new_empty((0,))

    return (_new_grad(query, layout, False) if need_dq else none(),
            _new_grad(key, layout, layout == LAYOUT_CONTIGUOUS) if need_dk else none(),
            _new_grad(value, layout, False) if need_dv else none(),
            query.new_empty((B, H, L, S), dtype=_accumulator(query.dtype)) if need_dmask else none())


@custom_op("fusedlayers::scaled_dot_product_attention_backward")
def scaled_dot_product_attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    attn_mask: Tensor | None, seed: Tensor | None, dropout_p: float, is_causal: bool, scale: float,
    need_dq: bool, need_dk: bool, need_dv: bool, need_dmask: bool, layout: int = LAYOUT_CONTIGUOUS,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, H, L = query.shape[:3]
    S = key.shape[2]
    dq, dk, dv, ds = _backward_outputs(query, key, value, need_dq, need_dk, need_dv, need_dmask, layout)
    if B * H * L * S == 0:  # nothing attends: zero gradients
        return tuple(t.zero_() for t in (dq, dk, dv, ds))
    mask = attn_mask.expand(B, H, L, S) if attn_mask is not None else None
    if _run_kernel(query, value):
        drop = dropout_params(seed, dropout_p) if seed is not None and dropout_p > 0.0 else None
        # delta as torch's math path forms it where torch would run that path (or fp32: accuracy first);
        # else rowsum(dO * O), as torch's fused kernels and FlashAttention do
        exact_delta = layout in MATH_LAYOUTS or query.dtype == torch.float32
        kernels.attention_backward(
            grad_out, query, key, value, out, lse, mask, drop, is_causal, scale,
            dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, ds if need_dmask else None,
            exact_delta, window=(window_left, window_right), softcap=softcap,
        )
        return dq, dk, dv, ds
    grads = attention_backward_reference(
        grad_out, query, key, value, out, lse, mask, seed, dropout_p, is_causal, scale,
        need_dq, need_dk, need_dv, need_dmask, window=(window_left, window_right), softcap=softcap,
    )
    return tuple(dst.copy_(g) if g is not None else dst for dst, g in zip((dq, dk, dv, ds), grads, strict=True))


@scaled_dot_product_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, attn_mask, seed, dropout_p, is_causal, scale,
      need_dq, need_dk, need_dv, need_dmask, layout=LAYOUT_CONTIGUOUS, window_left=-1, window_right=-1, softcap=0.0):
    return _backward_outputs(query, key, value, need_dq, need_dk, need_dv, need_dmask, layout)


# ----------------------------------------------------------------------------- attention sinks


class AttentionWithSinks(torch.autograd.Function):
    """Attention with sink logits (gpt-oss's ``s_aux``, one per head; Inkling 2's, one per query row): each row's
    softmax also has a key of score s (its sink logit) and value 0, which takes probability mass and contributes
    nothing. From the op's output O and logsumexp L over the real keys: L' = logaddexp(L, s), O' = O exp(L - L').
    The backward is the op's own backward run with (O', L') in place of (O, L): the probabilities it recomputes from
    L' are the sink softmax's, and delta = rowsum(dO' O') is what a value-0 key leaves it. The sink's gradient is
    -sum over rows of exp(s - L') delta. Rows whose keys are all masked (L = +inf by the op's convention) put all
    their mass on the sink: output 0.

    ``apply(query, key, value, attn_mask, sinks, seed, dropout_p, is_causal, scale, layout, window_left,
    window_right, softcap)`` with the op's (B, H, L, E) arguments and sinks broadcastable to (B, H, L) (3-D);
    returns the output."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, sinks, seed, dropout_p, is_causal, scale, layout, window_left,
                window_right, softcap):
        args = (dropout_p, is_causal, scale)
        extra = (layout, window_left, window_right, softcap)
        out, lse = call(scaled_dot_product_attention, query, key, value, attn_mask, seed, *args, *extra)
        sink = sinks.to(lse.dtype)
        real = lse.masked_fill(lse == float("inf"), float("-inf"))  # all keys masked: no mass on real keys
        lse = torch.logaddexp(real, sink)
        out.copy_(out * torch.exp(real - lse).unsqueeze(-1))  # in place: the op's output layout (torch's)
        ctx.args, ctx.extra = args, extra
        ctx.mask_meta = (attn_mask.shape, attn_mask.dtype) if attn_mask is not None else None
        ctx.save_for_backward(query, key, value, out, lse, attn_mask, seed, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, attn_mask, seed, sinks = ctx.saved_tensors
        need_dq, need_dk, need_dv, need_dmask, need_dsinks = ctx.needs_input_grad[:5]
        dq = dk = dv = dmask = dsinks = None
        if need_dq or need_dk or need_dv or need_dmask:
            dq, dk, dv, ds = call(scaled_dot_product_attention_backward, grad_out, query, key, value, out, lse,
                                  attn_mask, seed, *ctx.args, need_dq, need_dk, need_dv, need_dmask, *ctx.extra)
            dq, dk, dv = (g if need else None for g, need in zip((dq, dk, dv), (need_dq, need_dk, need_dv),
                                                                 strict=True))
            if need_dmask:
                mask_shape, mask_dtype = ctx.mask_meta
                dmask = ds.sum_to_size(mask_shape).to(mask_dtype)
        if need_dsinks:
            delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
            p_sink = torch.exp(sinks.to(lse.dtype) - lse)
            dsinks = (-(p_sink * delta)).sum_to_size(sinks.shape).to(sinks.dtype)
        return dq, dk, dv, dmask, dsinks, *(None,) * 8


# ----------------------------------------------------------------------------- autocast

# As F.scaled_dot_product_attention (in autocast's lower-precision list on CPU and CUDA): inside an
# autocast region, floating inputs (float mask included, fp64 excepted) are cast to the region's dtype.
_autocast_lib = torch.library.Library("fusedlayers", "FRAGMENT")


def _autocast_cast(device_type: str, dtype: torch.dtype, args: tuple) -> tuple:
    """query, key, value and a float mask (args[:4]) of ``device_type`` in ``dtype``, fp64 left as it is."""
    def cast(t):
        eligible = t is not None and t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    return (*(cast(t) for t in args[:4]), *args[4:])


def _register_autocast(device_type: str) -> None:
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)

    def kernel(_keyset, *args):
        args = _autocast_cast(device_type, torch.get_autocast_dtype(device_type), args)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return scaled_dot_product_attention(*args)

    _autocast_lib.impl("scaled_dot_product_attention", kernel, key_name, with_keyset=True)


for _device_type in ("cpu", "cuda"):
    _register_autocast(_device_type)
register_autocast_cast(scaled_dot_product_attention, _autocast_cast)  # the eager fast path does the same
