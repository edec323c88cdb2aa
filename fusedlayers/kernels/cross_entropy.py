"""Triton kernels for cross-entropy over (rows, classes) logits with class-index targets.

Per row r with target t, logsumexp L, C classes, smoothing e and z-loss weight z:

    loss_r = L - (1 - e) * x[t] - (e / C) * sum_c x[c] + z * L^2           (0 where t == ignore_index)
    dloss_r / dx[c] = (1 + 2 z L) * softmax(x)[c] - e / C - (1 - e) * [c == t]

Kernels, working on (BLOCK_M rows x BLOCK_N columns) tiles and looping over the columns, in fp32:

- ``_ce_fwd_kernel``: one pass over each row. Online max / sum (the running sum is rescaled when the
  block max grows), plus the row sum when smoothing; writes the per-row loss and logsumexp (fp32).
- ``_ce_reduce_kernel``: one program: the sum of the row losses and the count of non-ignored rows, the
  mean or sum written in the output dtype (the reduction in one launch, deterministic).
- ``_ce_bwd_kernel``: one pass: reads the row and its saved logsumexp, writes
  g_r * (softmax - smoothed one-hot) (g_r / count for "mean"). The output is a new tensor for
  ``fl.cross_entropy``; ``linear_cross_entropy`` writes it over its own logits chunk (``out=x``).

Long rows (CUDA) run one row per program with (BLOCK_N, num_warps) autotuned once per size class; the
choice is cached and later launches skip the autotuner. In-place launches never autotune (a tuning run
would read its own output): they use a cached choice or ``DEFAULT_LONG_ROW``.

Rows whose target is ``ignore_index`` are never read: loss 0, gradient 0. A target outside [0, C) that is
not ``ignore_index`` is never used as an address: its loss and its gradient row are NaN (the CPU path
raises before any kernel runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch, next_power_of_2

# Rows at least this long run one row per program with the column block autotuned (CUDA).
LONG_ROW = 4096
# (BLOCK_N, num_warps) candidates for long rows, forward and backward.
LONG_ROW_CONFIGS = [(2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]
# Untuned (BLOCK_N, num_warps) for long rows, by kernel: the autotuner's picks on an H200 for 32K-128K rows.
DEFAULT_LONG_ROW = {"fwd": (8192, 8), "bwd": (16384, 32)}


# ----------------------------------------------------------------------------- shared pieces


@triton.jit
def _targets(t_ptr, rows, n_rows, n_cols, stride_t, ignore_index):
    """Targets of a block of rows (int64), which rows count (valid) and which targets are in [0, C)."""
    in_rows = rows < n_rows
    t = tl.load(t_ptr + rows.to(tl.int64) * stride_t, mask=in_rows, other=0).to(tl.int64)
    valid = in_rows & (t != ignore_index)
    in_range = (t >= 0) & (t < n_cols)
    return t, valid, in_range


@triton.jit
def _row_stats(x_ptr, rows64, active, n_cols, stride_xr, stride_xc,
               HAS_SMOOTHING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """logsumexp (and the plain sum when smoothing) of each active row, reading it once (online softmax)."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    sum_x = tl.zeros((BLOCK_M,), tl.float32)
    base = x_ptr + rows64[:, None] * stride_xr
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = active[:, None] & (cols[None, :] < n_cols)
        x = tl.load(base + cols[None, :] * stride_xc, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows not (yet) seen: keep s = 0, no NaN
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
        if HAS_SMOOTHING:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=1)
    # s >= 1 for rows that saw a finite value; rows that saw none keep -inf (no log(0) warning)
    return m + tl.log(tl.maximum(s, 1e-30)), sum_x


@triton.jit
def _row_loss(x_ptr, rows64, t, valid, in_range, lse, sum_x, n_cols, stride_xr, stride_xc, smoothing, z_loss,
              HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr):
    x_t = tl.load(x_ptr + rows64 * stride_xr + tl.where(in_range, t, 0) * stride_xc,
                  mask=valid & in_range, other=0.0).to(tl.float32)
    loss = lse - (1.0 - smoothing) * x_t
    if HAS_SMOOTHING:
        loss -= smoothing / n_cols * sum_x
    if HAS_Z:
        loss += z_loss * lse * lse
    loss = tl.where(in_range, loss, float("nan"))
    return tl.where(valid, loss, 0.0)


@triton.jit
def _grad_sweep(x_ptr, dx_ptr, rows64, in_rows, t, valid, in_range, lse, g, n_cols,
                stride_xr, stride_xc, stride_dr, smoothing, z_loss,
                HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = g * ((1 + 2 z L) softmax(x) - e / C - (1 - e) onehot(t)); zeros for ignored rows."""
    g = tl.where(in_range, g, float("nan"))
    if HAS_Z:
        a = g * (1.0 + 2.0 * z_loss * lse)
    else:
        a = g
    c_target = g * (1.0 - smoothing)
    c_smooth = g * (smoothing / n_cols)
    x_base = x_ptr + rows64[:, None] * stride_xr
    dx_base = dx_ptr + rows64[:, None] * stride_dr
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_cols = cols[None, :] < n_cols
        x = tl.load(x_base + cols[None, :] * stride_xc, mask=valid[:, None] & in_cols, other=0.0).to(tl.float32)
        d = a[:, None] * tl.exp(x - lse[:, None])
        if HAS_SMOOTHING:
            d -= c_smooth[:, None]
        d = tl.where(cols[None, :] == t[:, None], d - c_target[:, None], d)
        d = tl.where(valid[:, None], d, 0.0)
        tl.store(dx_base + cols[None, :], d.to(dx_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _ce_fwd_kernel(
    x_ptr, t_ptr, loss_ptr, lse_ptr, n_rows, n_cols, stride_xr, stride_xc, stride_t, ignore_index,
    smoothing, z_loss, cols_key, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    t, valid, in_range = _targets(t_ptr, rows, n_rows, n_cols, stride_t, ignore_index)
    lse, sum_x = _row_stats(x_ptr, rows64, valid, n_cols, stride_xr, stride_xc, HAS_SMOOTHING, BLOCK_M, BLOCK_N)
    lse = tl.where(valid, lse, 0.0)
    loss = _row_loss(x_ptr, rows64, t, valid, in_range, lse, sum_x, n_cols, stride_xr, stride_xc, smoothing,
                     z_loss, HAS_SMOOTHING, HAS_Z)
    tl.store(loss_ptr + rows64, loss, mask=rows < n_rows)
    tl.store(lse_ptr + rows64, lse, mask=rows < n_rows)


@triton.jit
def _ce_bwd_kernel(
    x_ptr, t_ptr, lse_ptr, g_ptr, count_ptr, dx_ptr, n_rows, n_cols, stride_xr, stride_xc, stride_t, stride_g,
    stride_dr, ignore_index, smoothing, z_loss, cols_key, MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = g_r * dloss_r/dx, g_r = g[r * stride_g] (stride 0: one factor for all rows), / count if MEAN."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    in_rows = rows < n_rows
    t, valid, in_range = _targets(t_ptr, rows, n_rows, n_cols, stride_t, ignore_index)
    lse = tl.load(lse_ptr + rows64, mask=valid, other=0.0)
    g = tl.load(g_ptr + rows64 * stride_g, mask=in_rows, other=0.0).to(tl.float32)
    if MEAN:
        g = g / tl.load(count_ptr).to(tl.float32)
    _grad_sweep(x_ptr, dx_ptr, rows64, in_rows, t, valid, in_range, lse, g, n_cols, stride_xr, stride_xc,
                stride_dr, smoothing, z_loss, HAS_SMOOTHING, HAS_Z, BLOCK_N)


@triton.jit
def _ce_reduce_kernel(loss_ptr, t_ptr, out_ptr, count_ptr, n_rows, stride_t, ignore_index,
                      MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum(loss) (/ count for MEAN), count = number of rows whose target is not ignore_index."""
    total = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        inside = rows < n_rows
        total += tl.load(loss_ptr + rows, mask=inside, other=0.0)
        t = tl.load(t_ptr + rows.to(tl.int64) * stride_t, mask=inside, other=0).to(tl.int64)
        count += (inside & (t != ignore_index)).to(tl.int32)
    n_valid = tl.sum(count, axis=0)
    result = tl.sum(total, axis=0)
    if MEAN:
        result = result / n_valid.to(tl.float32)  # 0 / 0 = NaN when every row is ignored, as torch
    tl.store(out_ptr, result.to(out_ptr.dtype.element_ty))
    tl.store(count_ptr, n_valid.to(tl.int64))


# ----------------------------------------------------------------------------- configs


def _prune(configs, named_args, **kwargs):
    """Drop column blocks more than twice the row length (all the same once the row fits)."""
    n_cols = named_args["cols_key"]
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= max(2048, 2 * next_power_of_2(n_cols))]
    return kept or configs[:1]


def _autotuned(kernel):
    configs = [triton.Config({"BLOCK_M": 1, "BLOCK_N": n}, num_warps=w) for n, w in LONG_ROW_CONFIGS]
    # cols_key: the row length rounded up to a power of two (one tuning per size class, not per length)
    return triton.autotune(configs, key=["cols_key", "HAS_SMOOTHING", "HAS_Z"],
                           prune_configs_by={"early_config_prune": _prune})(kernel)


_KERNELS = {"fwd": (_ce_fwd_kernel, _autotuned(_ce_fwd_kernel)), "bwd": (_ce_bwd_kernel, _autotuned(_ce_bwd_kernel))}
_tuned_configs: dict[tuple, tuple[int, int]] = {}  # (kernel, cols_key, flags, dtype, device) -> (BLOCK_N, warps)


def _short_row_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): several rows per program, ~4K elements per tile."""
    block_n = min(next_power_of_2(max(n_cols, 1)), LONG_ROW)
    block_m = max(1, min(16, 4096 // block_n))
    elements = block_m * block_n
    return block_m, block_n, 4 if elements <= 2048 else 8


def _launch(name: str, x: torch.Tensor, args: tuple, consts: dict, may_tune: bool = True) -> None:
    kernel, tuned = _KERNELS[name]
    n_rows, n_cols = x.shape
    if n_cols < LONG_ROW or x.device.type != "cuda":
        block_m, block_n, num_warps = _short_row_config(n_cols)
        launch(kernel, (cdiv(n_rows, block_m),), *args, **consts, BLOCK_M=block_m, BLOCK_N=block_n,
               num_warps=num_warps)
        return
    key = (name, next_power_of_2(n_cols), consts.get("HAS_SMOOTHING"), consts.get("HAS_Z"), x.dtype,
           x.device)
    config = _tuned_configs.get(key)
    if config is None and may_tune:
        tuned[(n_rows,)](*args, **consts)
        best = getattr(tuned, "best_config", None)
        if best is not None:
            _tuned_configs[key] = (best.kwargs["BLOCK_N"], best.num_warps)
        return
    block_n, num_warps = config or DEFAULT_LONG_ROW[name]
    launch(kernel, (n_rows,), *args, **consts, BLOCK_M=1, BLOCK_N=min(block_n, next_power_of_2(n_cols)),
           num_warps=num_warps)


def _consts(smoothing: float, z_loss: float) -> dict:
    return dict(HAS_SMOOTHING=smoothing != 0.0, HAS_Z=z_loss != 0.0)


# ----------------------------------------------------------------------------- launchers


def cross_entropy_forward(
    x: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float, z_loss: float,
    loss: torch.Tensor | None = None, lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp (fp32, shape (rows,)) of 2-D logits ``x`` (any strides) and 1-D ``target``.

    ``loss``/``lse``: optional contiguous fp32 outputs to write into.
    """
    n_rows, n_cols = x.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=x.device) if loss is None else loss
    lse = torch.empty(n_rows, dtype=torch.float32, device=x.device) if lse is None else lse
    if n_rows == 0:
        return loss, lse
    args = (x, target, loss, lse, n_rows, n_cols, x.stride(0), x.stride(1), target.stride(0), ignore_index,
            float(smoothing), float(z_loss), next_power_of_2(n_cols))
    _launch("fwd", x, args, _consts(smoothing, z_loss))
    return loss, lse


def cross_entropy_reduce(loss_rows: torch.Tensor, target: torch.Tensor, ignore_index: int, mean: bool,
                         out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum or mean of the fp32 row losses as a 0-d ``out_dtype`` tensor, 0-d int64 count of kept rows)."""
    out = torch.empty((), dtype=out_dtype, device=loss_rows.device)
    count = torch.empty((), dtype=torch.int64, device=loss_rows.device)
    n_rows = loss_rows.shape[0]
    block = min(4096, max(128, next_power_of_2(max(n_rows, 1))))
    launch(_ce_reduce_kernel, (1,), loss_rows, target, out, count, n_rows, target.stride(0) if n_rows else 1,
           ignore_index, MEAN=mean, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out, count


def cross_entropy_backward(
    grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
    smoothing: float, z_loss: float, out: torch.Tensor, count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write g_r * d loss_r / d x into ``out`` (2-D, unit column stride) and return it. ``out`` may be ``x``
    itself when the caller owns ``x`` (each element is read before it is written, by the same program).

    ``grad``: 0-d (one factor for every row) or (rows,); divided by ``count`` (0-d) when given ("mean").
    ``lse``: from the forward.
    """
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        return out
    assert out.stride(1) == 1 and out.shape == x.shape
    stride_g = 0 if grad.dim() == 0 else grad.stride(0)
    in_place = out.data_ptr() == x.data_ptr()
    args = (x, target, lse, grad, count if count is not None else grad, out, n_rows, n_cols, x.stride(0),
            x.stride(1), target.stride(0), stride_g, out.stride(0), ignore_index, float(smoothing), float(z_loss),
            next_power_of_2(n_cols))
    _launch("bwd", x, args, dict(MEAN=count is not None, **_consts(smoothing, z_loss)), may_tune=not in_place)
    return out
