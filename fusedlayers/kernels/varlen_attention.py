"""Triton launchers of variable-length (packed) attention: the attention kernels of ``kernels/
scaled_dot_product_attention.py`` in their INTERVALS mode, which describes them. The packed (total, H, D) tensors are
seen as one batch row, (1, H, total, D), through their strides: never copied or padded."""

from __future__ import annotations

import torch

from fusedlayers.kernels import scaled_dot_product_attention as _attention


def _as_row(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.transpose(0, 1).unsqueeze(0)


def varlen_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             intervals: tuple[torch.Tensor, ...], dropout, scale: float, softcap: float,
                             out: torch.Tensor, lse: torch.Tensor, keys_per_row: float) -> None:
    """Writes ``out`` (total_q, H, Dv) and ``lse`` (H, total_q): query row i attends keys [row_lo[i], row_hi[i]] of
    ``intervals`` = (row_lo, row_hi, col_lo, col_hi) (int32); ``dropout`` as ``attention_forward``'s."""
    _attention.attention_forward(_as_row(query), _as_row(key), _as_row(value), None, dropout, False, scale,
                                 _as_row(out), lse.unsqueeze(0), softcap=softcap, intervals=intervals,
                                 keys_per_row=keys_per_row)


def varlen_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, intervals: tuple[torch.Tensor, ...], dropout,
                              scale: float, softcap: float, dq: torch.Tensor | None, dk: torch.Tensor | None,
                              dv: torch.Tensor | None, keys_per_row: float) -> None:
    """Writes the gradients asked for (not None) into ``dq``, ``dk``, ``dv`` (packed, as the inputs)."""
    _attention.attention_backward(
        _as_row(grad_out), _as_row(query), _as_row(key), _as_row(value), _as_row(out), lse.unsqueeze(0), None,
        dropout, False, scale, _as_row(dq), _as_row(dk), _as_row(dv), None, query.dtype == torch.float32,
        softcap=softcap, intervals=intervals, keys_per_row=keys_per_row)
