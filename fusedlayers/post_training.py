"""Post-training losses fused with the LM head: preference optimisation (DPO and its loss types, ORPO, CPO, SimPO,
KTO), RL (GRPO's policy loss and its aggregations) and distillation (generalized JSD).

Each loss takes the model's last hidden states and its head weight instead of logits, so the (tokens x vocabulary)
logits never exist whole, and equals the loss the TRL trainer of the same name computes from full logits (TRL 1.16:
``DPOTrainer._compute_loss``, ``ORPOTrainer`` / ``CPOTrainer`` in ``trl.experimental``, ``KTOTrainer._compute_loss``,
``GRPOTrainer._compute_loss``, ``GKDTrainer.generalized_jsd_loss``), with the same hyperparameters. Each returns
``(loss, metrics)``: the scalar loss and a dict of the detached values the trainer logs beside it.

Shapes: ``input`` (S, T, H) hidden states of S sequences, ``target`` (S, T) the next-token labels aligned with
them (already shifted: ``target[s, t]`` is the token predicted from ``input[s, t]``), ``ignore_index`` (-100) on the
prompt and padding. Only the labelled rows go through the head. Preference losses take TRL's concatenated batch:
the first S/2 sequences chosen, the last S/2 rejected, pair i = (i, S/2 + i).

How: the labelled rows are gathered in groups that the loss needs together (a chosen/rejected pair, a sequence) and
go through the head a chunk of whole groups at a time (``fusedlayers.ops.linear_log_probs.chunked_linear_log_probs``):
cuBLAS computes the chunk's logits, a Triton pass their log-probs (and entropy), the loss of those groups is taken
in PyTorch on the per-token values (a few numbers per token), its gradient with respect to them turned back into
the logits' gradient by a second Triton pass over the chunk, then the input's and weight's gradients -- three
products per token in all, the minimum, and the gradients are ready when the forward returns (backward scales
them). A reference model given as its own hidden states and head costs one forward product (no gradient).

The head's gradient is accumulated over the chunks in the weight's own dtype by default (as Liger's chunked losses
do): it is then the gradient itself, with no fp32 (V, H) accumulator and no final cast -- a bf16 head of 128256 x
4096 saves 2 GiB at the peak -- at the cost of a rounding per chunk (a few chunks per call; fp32 master weights
under autocast accumulate in fp32 anyway). ``accumulation_dtype=torch.float32`` asks for the fp32 accumulator.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedlayers import _validate as v
from fusedlayers.backend import use_triton
from fusedlayers.functional import _check_logit_transform, _head_compute_dtype, linear_log_probs
from fusedlayers.ops._eager import call
from fusedlayers.ops.linear_cross_entropy import (
    _accumulator,
    _addmm_acc_,
    _in_place_allowed,
    _scale_in_place,
    chunk_logits_,
    default_chunk_size,
    linear_cross_entropy_scale_grad,
    matmul_dtype,
    transform_reference,
)
from fusedlayers.ops.linear_log_probs import chunked_linear_log_probs

try:
    from fusedlayers.kernels import post_training as kernels
except ImportError:  # no Triton: the PyTorch rows run everywhere
    kernels = None

__all__ = ["linear_dpo_loss", "linear_orpo_loss", "linear_cpo_loss", "linear_simpo_loss", "linear_kto_loss",
           "linear_grpo_loss", "linear_generalized_jsd_loss", "LinearDPOLoss", "LinearORPOLoss", "LinearCPOLoss",
           "LinearSimPOLoss", "LinearKTOLoss", "LinearGRPOLoss", "LinearGeneralizedJSDLoss", "DPO_LOSS_TYPES",
           "GRPO_LOSS_TYPES"]

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sft", "sigmoid_norm")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo")
JSD_BUFFER_BYTES = 512 * 2**20


# ----------------------------------------------------------------------------- the fused head pass


class _Head(NamedTuple):
    """How the head's logits x become the distribution's: z = softcap * tanh(logit_scale * x / softcap) (softcap
    None: logit_scale * x), then z / temperature -- TRL's ``final_logit_softcapping``, ``logit_scale`` (Cohere,
    Granite, ...) and ``temperature``."""

    temperature: float
    logit_scale: float
    softcap: float | None


def _head(temperature, logit_scale, softcap) -> _Head:
    temperature = v.check_number("temperature", temperature)
    if not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return _Head(temperature, *_check_logit_transform(logit_scale, softcap))


class _Rows:
    """The labelled rows of S sequences, in group order: x (N, H), target (N,), the sequence of each row and each
    sequence's row count; ``seq_bounds`` split the sequences into chunks of whole groups of ``group`` consecutive
    sequences, as many groups per chunk as fit ``budget_rows`` (at least one), and ``bounds`` are their rows."""

    def __init__(self, input: Tensor, target: Tensor, ignore_index: int, order: Tensor | None, group: int,
                 budget_rows: int):
        if order is not None:  # reorder sequences so that a group is consecutive (a gather, differentiable)
            input, target = input[order], target[order]
        valid = target != ignore_index
        self.order, self.valid = order, valid
        self.lengths = valid.sum(1)
        self.x = input[valid]
        self.target = target[valid]
        self.n_seq = target.shape[0]
        self.seq = torch.repeat_interleave(torch.arange(self.n_seq, device=target.device), self.lengths,
                                           output_size=self.x.shape[0])
        row_start = [0]
        for n in self.lengths.tolist():  # one host sync: the chunk bounds are host numbers
            row_start.append(row_start[-1] + n)
        self.seq_bounds = [0]
        for g in range(group, self.n_seq + group, group):
            g = min(g, self.n_seq)
            if row_start[g] - row_start[self.seq_bounds[-1]] > budget_rows and self.seq_bounds[-1] != g - group:
                self.seq_bounds.append(g - group)
        self.seq_bounds.append(self.n_seq)
        self.bounds = [row_start[s] for s in self.seq_bounds]

    def tokens(self, values: Tensor) -> Tensor:
        """Per-row values as (S, T), in the caller's sequence order, 0 at the ignored tokens."""
        out = values.new_zeros(self.valid.shape).masked_scatter(self.valid, values)
        return out if self.order is None else out.new_empty(out.shape).index_copy_(0, self.order, out)

    def seq_sums(self, values: Tensor, start: int, stop: int, first: int, last: int) -> Tensor:
        """Per-sequence sums of the values of rows [start, stop), which are those of sequences [first, last)."""
        return values.new_zeros(last - first).index_add(0, self.seq[start:stop] - first, values)


class _FusedHeadLoss(torch.autograd.Function):
    """loss = the sum over chunks of ``chunk_loss(first, last, start, stop, log_probs, entropy)`` (sequences [first,
    last), rows [start, stop)); the gradients of x, W, b are computed in the forward pass over the chunks (see the
    module's docstring) and scaled by the upstream gradient in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, rows, chunk_loss, head, want_entropy, want_stats, compute_dtype,
                needs, accumulation_dtype):
        total = []

        def row_grads(start, stop, lp, ent):
            first, last = rows.seq_bounds[len(total)], rows.seq_bounds[len(total) + 1]
            with torch.enable_grad():
                lp = lp.detach().requires_grad_()
                ent = ent.detach().requires_grad_() if ent is not None else None
                loss = chunk_loss(first, last, start, stop, lp, ent)
                total.append(loss.detach())
                if not loss.requires_grad:
                    return None, None
                leaves = [t for t in (lp, ent) if t is not None]
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            return grads[0], (grads[1] if ent is not None else None)

        lp, ent, _, stats, gx, gw, gb = chunked_linear_log_probs(
            x, weight, target, bias, -100, head.logit_scale, head.softcap, head.temperature, 0, compute_dtype,
            want_entropy, want_stats,
            row_grads, *needs, bounds=rows.bounds, accumulation_dtype=accumulation_dtype or weight.dtype)
        _save_gradients(ctx, (gx, gw, gb), (x, weight, bias))
        loss = torch.stack(total).sum() if total else x.new_zeros((), dtype=lp.dtype)
        ctx.mark_non_differentiable(*(t for t in (lp, ent, stats) if t is not None))
        return loss, lp, ent, stats

    @staticmethod
    def backward(ctx, grad, *_):
        return (*_scaled_gradients(ctx, grad), *(None,) * 9)


def _save_gradients(ctx, gradients, inputs) -> None:
    ctx.save_for_backward(*gradients)
    ctx.dtypes = tuple(t.dtype if t is not None else None for t in inputs)
    ctx.consumed = False
    ctx.allow_retain_graph = False


def _scaled_gradients(ctx, grad: Tensor) -> list[Tensor | None]:
    """The gradients computed in the forward times the loss's upstream gradient, in the inputs' dtypes: in place
    where a buffer already has its gradient's dtype (the input's always; the weight's with a 16-bit accumulation or
    fp32 master weights), so no second gradient-sized tensor exists; else cast and scaled in one pass."""
    if ctx.consumed:
        raise RuntimeError("a fused post-training loss was backpropagated twice; its gradients, computed in the "
                           "forward, were scaled in place by the first backward. Compute the loss again instead.")
    out = []
    for buffer, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True):
        if buffer is None or dtype is None:
            out.append(None)
        elif buffer.dtype == dtype and _in_place_allowed(ctx, grad) and type(buffer) is Tensor:
            out.append(_scale_in_place(buffer, grad))
            ctx.consumed = True
        else:
            out.append(call(linear_cross_entropy_scale_grad, buffer, grad, dtype))
    return out


def _fused_loss(input, linear_weight, target, linear_bias, chunk_loss, rows: _Rows, head: _Head,
                want_entropy: bool = False, accumulation_dtype: torch.dtype | None = None, want_stats: bool = False):
    """Runs ``chunk_loss`` over the chunks of ``rows`` through the head; returns (loss, per-row log-probs, entropy
    and statistics (mean logit, log sum p^2, is-argmax), detached; the last two None unless asked for)."""
    compute_dtype = _head_compute_dtype(input, linear_weight, linear_bias)
    grad = torch.is_grad_enabled()
    needs = (grad and input.requires_grad, grad and linear_weight.requires_grad,
             grad and linear_bias is not None and linear_bias.requires_grad)
    return _FusedHeadLoss.apply(rows.x, linear_weight, linear_bias, rows.target, rows, chunk_loss, head,
                                want_entropy, want_stats, compute_dtype, needs, accumulation_dtype)


def _acc(input: Tensor) -> torch.dtype:
    """The dtype of the per-token and per-sequence values: fp64 for fp64 input, else fp32."""
    return torch.float64 if input.dtype == torch.float64 else torch.float32


def _budget(input: Tensor, linear_weight: Tensor, chunk_size: int | None) -> int:
    if chunk_size is not None:
        return chunk_size
    dtype = matmul_dtype(_head_compute_dtype(input, linear_weight, None), input.device)
    n_rows = input.shape[0] * input.shape[1]
    return default_chunk_size(n_rows, linear_weight.shape[0], dtype, input.device)


def _reference_log_probs(rows: _Rows, ref_input, ref_linear_weight, ref_linear_bias, target, order, ignore_index,
                         head: _Head) -> Tensor:
    """Per-row log-probs of a reference head (no gradient) for the rows of ``rows``."""
    if order is not None:
        ref_input, target = ref_input[order], target[order]
    valid = target != ignore_index
    with torch.no_grad():
        return linear_log_probs(ref_input[valid].detach(), ref_linear_weight.detach(), rows.target,
                                linear_bias=ref_linear_bias.detach() if ref_linear_bias is not None else None,
                                temperature=head.temperature, logit_scale=head.logit_scale, softcap=head.softcap)


def _reference_sums(rows: _Rows, ref_log_probs, ref_input, ref_linear_weight, ref_linear_bias, target, order,
                    ignore_index, head: _Head, dtype) -> Tensor:
    """The reference's per-sequence log-prob sums in ``rows``' order: ``ref_log_probs`` as given, or from its own
    hidden states and head."""
    if ref_log_probs is not None:
        return (ref_log_probs if order is None else ref_log_probs[order]).detach().to(dtype)
    ref_rows = _reference_log_probs(rows, ref_input, ref_linear_weight, ref_linear_bias, target, order, ignore_index,
                                    head)
    return ref_rows.new_zeros(rows.n_seq).index_add(0, rows.seq, ref_rows)


def _check_sequences(input: Tensor, linear_weight: Tensor, target: Tensor, ignore_index: int, name: str = "input"):
    v.check_float_tensor(name, input)
    v.check_float_tensor("linear_weight", linear_weight)
    v.check_index_tensor("target", target)
    v.check_int("ignore_index", ignore_index)
    if input.dim() != 3 or linear_weight.dim() != 2 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(f"{name} must be (sequences, tokens, H) and linear_weight (V, H) with the same H, got "
                         f"{tuple(input.shape)} and {tuple(linear_weight.shape)}")
    if tuple(target.shape) != tuple(input.shape[:2]):
        raise ValueError(f"target must have {name}'s (sequences, tokens) shape {tuple(input.shape[:2])}, got "
                         f"{tuple(target.shape)}")
    if target.device.type == "cpu":
        v.check_target_range("target", target, linear_weight.shape[0], ignore_index)


def _check_reference(ref_input, ref_linear_weight, ref_log_probs, input, shape_of_log_probs, required=True):
    if ref_log_probs is not None:
        if ref_input is not None or ref_linear_weight is not None:
            raise ValueError("give the reference either as ref_log_probs or as ref_input and ref_linear_weight")
        v.check_float_tensor("ref_log_probs", ref_log_probs)
        if tuple(ref_log_probs.shape) != shape_of_log_probs:
            raise ValueError(f"ref_log_probs must have shape {shape_of_log_probs}, got {tuple(ref_log_probs.shape)}")
        return
    if (ref_input is None) != (ref_linear_weight is None):
        raise ValueError("ref_input and ref_linear_weight go together")
    if ref_input is None:
        if required:
            raise ValueError("this loss needs a reference: ref_log_probs, or ref_input and ref_linear_weight")
        return
    v.check_float_tensor("ref_input", ref_input)
    if tuple(ref_input.shape[:2]) != tuple(input.shape[:2]):
        raise ValueError(f"ref_input must have input's (sequences, tokens) shape {tuple(input.shape[:2])}, got "
                         f"{tuple(ref_input.shape)}")


def _pair_order(n_seq: int, device) -> Tensor:
    """Sequence order that puts chosen i and rejected i (TRL's concatenated batch) next to each other."""
    if n_seq % 2:
        raise ValueError(f"input must hold chosen then rejected sequences (a preference batch): an even count, got "
                         f"{n_seq}")
    half = n_seq // 2
    return torch.stack([torch.arange(half), torch.arange(half, n_seq)], 1).reshape(-1).to(device)


def _pairs(values: Tensor) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) of per-sequence values in pair order."""
    return values[0::2], values[1::2]


# ----------------------------------------------------------------------------- DPO


def _dpo_pair_losses(loss_type: str, beta: float, label_smoothing: float, discopop_tau: float, chosen_lr: Tensor,
                     rejected_lr: Tensor, chosen_len: Tensor, rejected_len: Tensor) -> Tensor:
    """Per-pair loss of one of DPO's loss types, from the pairs' log-ratios (policy - reference, summed over the
    completion) -- DPOTrainer._compute_loss, reverse-KL f-divergence."""
    delta = chosen_lr - rejected_lr
    if loss_type == "sigmoid":  # TRL 1.16's sigmoid reads no label smoothing ("robust" is the smoothed one)
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":  # per-token averages (TRL normalises by the completion length)
        ipo_delta = chosen_lr / chosen_len.clamp(min=1.0) - rejected_lr / rejected_len.clamp(min=1.0)
        return (ipo_delta - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        eps = torch.tensor(label_smoothing, dtype=delta.dtype, device=delta.device)
        qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
        return (qw * (F.logsigmoid(beta * delta) - torch.log1p(-eps))
                + ql * (F.logsigmoid(-beta * delta) - torch.log(eps)))
    if loss_type == "nca_pair":
        cr, rr = beta * chosen_lr, beta * rejected_lr
        return -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
    if loss_type == "sppo_hard":
        return (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * delta)
    if loss_type == "discopop":
        logits = beta * delta
        modulation = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    if loss_type == "sigmoid_norm":
        norm_delta = chosen_lr / chosen_len.clamp(min=1.0) - rejected_lr / rejected_len.clamp(min=1.0)
        return -F.logsigmoid(beta * norm_delta)
    raise AssertionError(loss_type)


def _check_loss_types(loss_type, loss_weights, allowed):
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    for t in types:
        if t not in allowed:
            raise ValueError(f"loss_type must be one of {allowed} (or a list of them), got {t!r}")
    if loss_weights is None:
        loss_weights = [1.0] * len(types)
    if len(loss_weights) != len(types):
        raise ValueError(f"loss_weights must give one weight per loss type ({len(types)}), got {len(loss_weights)}")
    return types, [float(w) for w in loss_weights]


def linear_dpo_loss(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, ref_input: Tensor | None = None,
    ref_linear_weight: Tensor | None = None, ref_log_probs: Tensor | None = None, linear_bias: Tensor | None = None,
    ref_linear_bias: Tensor | None = None, beta: float = 0.1, loss_type: str | list[str] = "sigmoid",
    loss_weights: list[float] | None = None, label_smoothing: float = 0.0, discopop_tau: float = 0.05,
    ignore_index: int = -100, temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None,
    chunk_size: int | None = None, accumulation_dtype: torch.dtype | None = None, token_statistics: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (TRL's ``DPOTrainer``) on a linear head: the mean over pairs of the per-pair loss of ``loss_type`` (a
    name of :data:`DPO_LOSS_TYPES`, or a list combined with ``loss_weights``, as TRL's ``loss_type`` list) of
    the pairs' log-ratios ``log pi(y|x) - log pi_ref(y|x)`` (sums over the completion tokens).

    The reference is ``ref_log_probs`` (S,) (per-sequence sums, TRL's ``ref_chosen_logps`` then
    ``ref_rejected_logps``) or its own hidden states ``ref_input`` (S, T, H) and head ``ref_linear_weight`` /
    ``ref_linear_bias`` (computed without gradient, one product). ``label_smoothing``: the "robust" and
    "exo_pair" types' epsilon (TRL 1.16's "sigmoid" reads none).

    Metrics (per pair): chosen_rewards, rejected_rewards (beta x log-ratio), reward_accuracies, reward_margins,
    chosen_logps, rejected_logps; with ``token_statistics`` also the per-token values DPOTrainer logs, (S, T):
    entropy, mean_logits, is_top1 (computed in the same pass).
    """
    _check_sequences(input, linear_weight, target, ignore_index)
    head = _head(temperature, logit_scale, softcap)
    _check_reference(ref_input, ref_linear_weight, ref_log_probs, input, (input.shape[0],))
    types, weights = _check_loss_types(loss_type, loss_weights, DPO_LOSS_TYPES)
    beta = v.check_number("beta", beta)
    label_smoothing = v.check_fraction("label_smoothing", label_smoothing)
    order = _pair_order(input.shape[0], input.device)
    rows = _Rows(input, target, ignore_index, order, 2, _budget(input, linear_weight, chunk_size))
    n_pairs = input.shape[0] // 2
    ref_seq = _reference_sums(rows, ref_log_probs, ref_input, ref_linear_weight, ref_linear_bias, target, order,
                              ignore_index, head, _acc(input))
    lengths = rows.lengths.to(ref_seq.dtype)
    n_chosen_tokens = rows.lengths[0::2].sum().clamp(min=1).to(ref_seq.dtype)
    policy_seq = []

    def chunk_loss(first, last, start, stop, lp, _):
        seq = rows.seq_sums(lp, start, stop, first, last)
        policy_seq.append(seq.detach())
        chosen, rejected = _pairs(seq)
        ref_chosen, ref_rejected = _pairs(ref_seq[first:last].to(seq.dtype))
        chosen_len, rejected_len = _pairs(lengths[first:last].to(seq.dtype))
        loss = seq.new_zeros(())
        for t, w in zip(types, weights, strict=True):
            if t == "sft":  # the mean NLL of every chosen token of the batch
                chosen_rows = (rows.seq[start:stop] % 2) == 0
                loss = loss + w * -(lp * chosen_rows).sum() / n_chosen_tokens.to(seq.dtype)
                continue
            per_pair = _dpo_pair_losses(t, beta, label_smoothing, discopop_tau, chosen - ref_chosen,
                                        rejected - ref_rejected, chosen_len, rejected_len)
            loss = loss + w * per_pair.sum() / n_pairs
        return loss

    loss, _, entropy, stats = _fused_loss(input, linear_weight, target, linear_bias, chunk_loss, rows, head,
                                          want_entropy=token_statistics, accumulation_dtype=accumulation_dtype,
                                          want_stats=token_statistics)
    seq = torch.cat(policy_seq) if policy_seq else ref_seq.new_zeros(rows.n_seq)
    chosen, rejected = _pairs(seq)
    chosen_rewards = beta * (chosen - _pairs(ref_seq)[0])
    rejected_rewards = beta * (rejected - _pairs(ref_seq)[1])
    metrics = {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
               "reward_accuracies": (chosen_rewards > rejected_rewards).float(),
               "reward_margins": chosen_rewards - rejected_rewards, "chosen_logps": chosen, "rejected_logps": rejected}
    if token_statistics:
        metrics.update(_token_statistics(rows, entropy, stats))
    return loss, metrics


def _token_statistics(rows: _Rows, entropy: Tensor, stats: Tensor) -> dict[str, Tensor]:
    """The per-token values TRL's trainers log, (S, T) in the caller's order, 0 (False) at ignored tokens."""
    return {"entropy": rows.tokens(entropy), "mean_logits": rows.tokens(stats[0]),
            "is_top1": rows.tokens(stats[2]).bool()}


# ----------------------------------------------------------------------------- ORPO, CPO, SimPO


def _pairs_fused(input, linear_weight, target, linear_bias, ignore_index, head, chunk_size, pair_loss,
                 accumulation_dtype):
    """A reference-free preference loss: ``pair_loss(chosen_seq, rejected_seq, chosen_len, rejected_len)`` per chunk
    of pairs, summed; returns (loss, per-sequence sums, lengths) in pair order."""
    order = _pair_order(input.shape[0], input.device)
    rows = _Rows(input, target, ignore_index, order, 2, _budget(input, linear_weight, chunk_size))
    lengths = rows.lengths.to(_acc(input))
    policy_seq = []

    def chunk_loss(first, last, start, stop, lp, _):
        seq = rows.seq_sums(lp, start, stop, first, last)
        policy_seq.append(seq.detach())
        chosen, rejected = _pairs(seq)
        chosen_len, rejected_len = _pairs(lengths[first:last].to(seq.dtype))
        return pair_loss(chosen, rejected, chosen_len, rejected_len)

    loss, *_ = _fused_loss(input, linear_weight, target, linear_bias, chunk_loss, rows, head,
                           accumulation_dtype=accumulation_dtype)
    seq = torch.cat(policy_seq) if policy_seq else lengths.new_zeros(rows.n_seq)
    return loss, seq, rows.lengths


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, stable on both sides of log 2 (as TRL's ``log1mexp``)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def linear_orpo_loss(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, nll_target: Tensor | None = None,
    linear_bias: Tensor | None = None, beta: float = 0.1, ignore_index: int = -100, temperature: float = 1.0,
    logit_scale: float = 1.0, softcap: float | None = None, chunk_size: int | None = None,
    accumulation_dtype: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO (TRL's ``ORPOTrainer``): the chosen sequences' NLL (mean over its tokens) minus ``beta`` times the mean
    log-sigmoid of the log odds ratio of the completions' per-token average log-probs; no reference model.

    TRL takes the NLL over the whole chosen sequence, prompt included: ``nll_target`` (S, T) gives those labels
    (the next tokens wherever the attention mask is 1; they must equal ``target`` where it is labelled); without
    it, the NLL covers the completions (``target``'s labelled tokens).

    Metrics: chosen_rewards, rejected_rewards (beta x average log-prob, per pair), reward_accuracies,
    reward_margins, nll_loss, log_odds_ratio (mean log-sigmoid of the log odds), log_odds_chosen (mean log odds).
    """
    _check_sequences(input, linear_weight, target, ignore_index)
    head = _head(temperature, logit_scale, softcap)
    beta = v.check_number("beta", beta)
    n_pairs = input.shape[0] // 2
    scored = target
    if nll_target is not None:
        v.check_index_tensor("nll_target", nll_target)
        if nll_target.shape != target.shape:
            raise ValueError(f"nll_target must have target's shape {tuple(target.shape)}, got "
                             f"{tuple(nll_target.shape)}")
        labelled = target != ignore_index
        if not torch.equal(nll_target[labelled], target[labelled]):
            raise ValueError("nll_target must equal target wherever target is labelled (both are the next tokens)")
        scored = torch.where(labelled, target, nll_target)  # every row either loss reads
    order = _pair_order(input.shape[0], input.device)
    rows = _Rows(input, scored, ignore_index, order, 2, _budget(input, linear_weight, chunk_size))
    in_completion = (target[order] != ignore_index)[rows.valid]  # the rows of the odds ratio
    in_nll = rows.seq % 2 == 0  # chosen sequences (pair order), every scored row
    nll_tokens = in_nll.sum().clamp(min=1)
    lengths = (target != ignore_index).sum(1)[order].to(_acc(input))
    parts = {"seq": [], "nll": [], "ratio": [], "log_odds": []}

    def chunk_loss(first, last, start, stop, lp, _):
        seq = rows.seq_sums(lp * in_completion[start:stop], start, stop, first, last)
        chosen, rejected = _pairs(seq)
        chosen_len, rejected_len = _pairs(lengths[first:last].to(seq.dtype))
        chosen_avg, rejected_avg = chosen / chosen_len, rejected / rejected_len
        log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
        ratio = F.logsigmoid(log_odds)
        nll = -(lp * in_nll[start:stop]).sum() / nll_tokens.to(lp.dtype)
        for name, value in (("seq", seq), ("nll", nll), ("ratio", ratio), ("log_odds", log_odds)):
            parts[name].append(value.detach())
        return nll - beta * ratio.sum() / n_pairs

    loss, *_ = _fused_loss(input, linear_weight, scored, linear_bias, chunk_loss, rows, head,
                           accumulation_dtype=accumulation_dtype)
    avg = torch.cat(parts["seq"]) / lengths
    chosen_rewards, rejected_rewards = beta * avg[0::2], beta * avg[1::2]
    return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
                  "reward_accuracies": (chosen_rewards > rejected_rewards).float(),
                  "reward_margins": chosen_rewards - rejected_rewards,
                  "nll_loss": torch.stack(parts["nll"]).sum(),
                  "log_odds_ratio": torch.cat(parts["ratio"]).mean(),
                  "log_odds_chosen": torch.cat(parts["log_odds"]).mean()}


def linear_cpo_loss(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Tensor | None = None, beta: float = 0.1,
    loss_type: str = "sigmoid", label_smoothing: float = 0.0, cpo_alpha: float = 1.0, simpo_gamma: float = 0.5,
    alpha: float = 0.0, ignore_index: int = -100, temperature: float = 1.0, logit_scale: float = 1.0,
    softcap: float | None = None, chunk_size: int | None = None, accumulation_dtype: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CPO (TRL's ``CPOTrainer``): the mean preference loss of ``loss_type`` ("sigmoid", "hinge", "ipo", "simpo")
    on the policy's log-probs alone (sums; per-token averages for "ipo" and "simpo"), plus ``cpo_alpha`` times
    the chosen completions' NLL (mean over their tokens). "simpo" subtracts the margin ``simpo_gamma / beta``;
    ``alpha`` != 0 is AlphaPO's reward ``(1 - p^-alpha) / alpha``.

    Metrics: chosen_rewards, rejected_rewards, reward_accuracies, reward_margins, nll_loss.
    """
    _check_sequences(input, linear_weight, target, ignore_index)
    head = _head(temperature, logit_scale, softcap)
    if loss_type not in ("sigmoid", "hinge", "ipo", "simpo"):
        raise ValueError(f"loss_type must be one of ('sigmoid', 'hinge', 'ipo', 'simpo'), got {loss_type!r}")
    beta = v.check_number("beta", beta)
    label_smoothing = v.check_fraction("label_smoothing", label_smoothing)
    average = loss_type in ("ipo", "simpo")
    n_pairs = input.shape[0] // 2
    chosen_tokens = (target[:n_pairs] != ignore_index).sum().clamp(min=1)
    nll_parts = []

    def rewards(chosen, rejected):
        if alpha == 0.0:
            return chosen, rejected
        return (1 - torch.exp(chosen).pow(-alpha)) / alpha, (1 - torch.exp(rejected).pow(-alpha)) / alpha

    def pair_loss(chosen, rejected, chosen_len, rejected_len):
        nll = -chosen.sum() / chosen_tokens.to(chosen.dtype)
        nll_parts.append(nll.detach())
        if average:
            chosen, rejected = chosen / chosen_len, rejected / rejected_len
        chosen_r, rejected_r = rewards(chosen, rejected)
        logits = chosen_r - rejected_r
        if loss_type == "simpo":
            logits = logits - simpo_gamma / beta
        if loss_type in ("sigmoid", "simpo"):
            losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                      - F.logsigmoid(-beta * logits) * label_smoothing)
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:
            losses = (logits - 1 / (2 * beta)) ** 2
        return losses.sum() / n_pairs + (cpo_alpha * nll if cpo_alpha != 0 else 0.0)

    loss, seq, lengths = _pairs_fused(input, linear_weight, target, linear_bias, ignore_index, head,
                                      chunk_size, pair_loss, accumulation_dtype)
    if average:
        seq = seq / lengths.to(seq.dtype)
    chosen_r, rejected_r = rewards(seq[0::2], seq[1::2])
    chosen_rewards, rejected_rewards = beta * chosen_r, beta * rejected_r
    return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
                  "reward_accuracies": (chosen_rewards > rejected_rewards).float(),
                  "reward_margins": chosen_rewards - rejected_rewards,
                  # TRL skips the NLL term (and logs 0) when cpo_alpha is 0
                  "nll_loss": torch.stack(nll_parts).sum() if nll_parts and cpo_alpha != 0 else seq.new_zeros(())}


def linear_simpo_loss(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Tensor | None = None, beta: float = 2.0,
    simpo_gamma: float = 0.5, label_smoothing: float = 0.0, cpo_alpha: float = 0.0, ignore_index: int = -100,
    temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None, chunk_size: int | None = None,
    accumulation_dtype: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO, as TRL runs it (``CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``): ``-log sigmoid(beta *
    (avg log pi(chosen) - avg log pi(rejected)) - simpo_gamma)``, averaged over pairs; metrics as
    :func:`linear_cpo_loss`."""
    return linear_cpo_loss(input, linear_weight, target, linear_bias=linear_bias, beta=beta, loss_type="simpo",
                           label_smoothing=label_smoothing, cpo_alpha=cpo_alpha, simpo_gamma=simpo_gamma,
                           ignore_index=ignore_index, temperature=temperature, logit_scale=logit_scale,
                           softcap=softcap, chunk_size=chunk_size, accumulation_dtype=accumulation_dtype)


# ----------------------------------------------------------------------------- KTO


def linear_kto_loss(
    input: Tensor, linear_weight: Tensor, target: Tensor, label: Tensor, *, ref_input: Tensor | None = None,
    ref_linear_weight: Tensor | None = None, ref_log_probs: Tensor | None = None, linear_bias: Tensor | None = None,
    ref_linear_bias: Tensor | None = None, kl_log_probs: Tensor | None = None,
    ref_kl_log_probs: Tensor | None = None, beta: float = 0.1, desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0, loss_type: str = "kto", ignore_index: int = -100, temperature: float = 1.0,
    logit_scale: float = 1.0, softcap: float | None = None, chunk_size: int | None = None,
    accumulation_dtype: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO (TRL's ``KTOTrainer``): unpaired completions, ``label`` (S,) True for desirable. Per sequence, with the
    log-ratio r = log pi - log pi_ref (sums over the completion) and the reference point z: desirable ``1 -
    sigmoid(beta (r - z))``, undesirable ``1 - sigmoid(beta (z - r))``, weighted by ``desirable_weight`` /
    ``undesirable_weight``, averaged over the sequences. z is TRL's KL estimate ``mean(kl_log_probs -
    ref_kl_log_probs).clamp(min=0)`` from the per-sequence log-probs of mismatched completions (policy and
    reference, no gradient), or 0 without them. ``loss_type="apo_zero_unpaired"``: ``1 - sigmoid(beta r)`` /
    ``sigmoid(beta r)``.

    Metrics: chosen_rewards, rejected_rewards (beta x log-ratio of each kind), kl, logps (per sequence).
    """
    _check_sequences(input, linear_weight, target, ignore_index)
    head = _head(temperature, logit_scale, softcap)
    _check_reference(ref_input, ref_linear_weight, ref_log_probs, input, (input.shape[0],))
    if loss_type not in ("kto", "apo_zero_unpaired"):
        raise ValueError(f"loss_type must be 'kto' or 'apo_zero_unpaired', got {loss_type!r}")
    v.check_tensor("label", label)
    if tuple(label.shape) != (input.shape[0],):
        raise ValueError(f"label must have shape ({input.shape[0]},), got {tuple(label.shape)}")
    beta = v.check_number("beta", beta)
    label = label.to(torch.bool)
    if (kl_log_probs is None) != (ref_kl_log_probs is None):
        raise ValueError("kl_log_probs and ref_kl_log_probs go together")
    kl = torch.zeros((), dtype=_acc(input), device=input.device)
    if kl_log_probs is not None:
        kl = (kl_log_probs.detach().to(_acc(input)) - ref_kl_log_probs.detach().to(_acc(input))).mean().clamp(min=0)
    rows = _Rows(input, target, ignore_index, None, 1, _budget(input, linear_weight, chunk_size))
    ref_seq = _reference_sums(rows, ref_log_probs, ref_input, ref_linear_weight, ref_linear_bias, target, None,
                              ignore_index, head, _acc(input))
    n_seq = input.shape[0]
    weights = torch.where(label, torch.tensor(desirable_weight, dtype=ref_seq.dtype, device=label.device),
                          torch.tensor(undesirable_weight, dtype=ref_seq.dtype, device=label.device))
    policy_seq = []

    def chunk_loss(first, last, start, stop, lp, _):
        seq = rows.seq_sums(lp, start, stop, first, last)
        policy_seq.append(seq.detach())
        ratio = seq - ref_seq[first:last].to(seq.dtype)
        z = kl.to(seq.dtype)
        if loss_type == "kto":
            losses = torch.where(label[first:last], 1 - torch.sigmoid(beta * (ratio - z)),
                                 1 - torch.sigmoid(beta * (z - ratio)))
        else:
            losses = torch.where(label[first:last], 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio))
        return (weights[first:last].to(seq.dtype) * losses).sum() / n_seq

    loss, *_ = _fused_loss(input, linear_weight, target, linear_bias, chunk_loss, rows, head,
                           accumulation_dtype=accumulation_dtype)
    seq = torch.cat(policy_seq) if policy_seq else ref_seq.new_zeros(n_seq)
    rewards = beta * (seq - ref_seq)
    # TRL computes (and logs) the KL estimate for "kto" only
    return loss, {"chosen_rewards": rewards[label], "rejected_rewards": rewards[~label],
                  "kl": kl if loss_type == "kto" else torch.zeros_like(kl), "logps": seq}


# ----------------------------------------------------------------------------- GRPO


def linear_grpo_loss(
    input: Tensor, linear_weight: Tensor, target: Tensor, advantages: Tensor, *, old_log_probs: Tensor | None = None,
    ref_input: Tensor | None = None, ref_linear_weight: Tensor | None = None, ref_log_probs: Tensor | None = None,
    linear_bias: Tensor | None = None, ref_linear_bias: Tensor | None = None, beta: float = 0.0,
    epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None, loss_type: str = "dapo",
    importance_sampling_level: str = "token", max_completion_length: int | None = None,
    num_items_in_batch: int | Tensor | None = None, kl_bias_correction: bool = False, temperature: float = 1.0,
    logit_scale: float = 1.0, softcap: float | None = None, ignore_index: int = -100,
    chunk_size: int | None = None, accumulation_dtype: torch.dtype | None = None, token_statistics: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's policy loss (TRL's ``GRPOTrainer._compute_loss``) on a linear head. Per completion token, with the
    ratio ``c = exp(log pi - old_log_probs)`` (``importance_sampling_level="sequence"``: exp of the sequence's
    mean log-ratio) and the sequence's advantage A: ``-min(c A, clamp(c, 1 - epsilon_low, 1 + epsilon_high) A)``
    (``delta`` caps c first; "cispo": ``-min(c, epsilon_high).detach() A log pi``), plus ``beta`` times the k3
    estimate of KL to the reference ``exp(ref - lp) - (ref - lp) - 1`` (times the ratio c with ``kl_bias_correction``,
    TRL's ``use_bias_correction_kl``). Aggregated as ``loss_type``:

    - "grpo": the mean over tokens of each sequence, then over sequences; "luspo": the sum per sequence, mean over
      sequences;
    - "bnpo": the mean over every token of the batch; "dapo" and "cispo": the sum over tokens divided by
      ``num_items_in_batch`` (default: this batch's token count, so "dapo" = "bnpo" within one batch);
    - "dr_grpo": the sum divided by sequences x ``max_completion_length`` (default T).

    ``advantages`` (S,); ``old_log_probs`` (S, T) of the policy that sampled (default: the current ones, detached:
    the ratio is 1); the reference as ``ref_log_probs`` (S, T) or ``ref_input`` / ``ref_linear_weight`` (needed
    when ``beta`` != 0). Metrics: kl (mean over tokens, when beta != 0), clip_ratio_low, clip_ratio_high,
    clip_ratio (region) (or cispo_clip_ratio), entropy (mean over tokens); with ``token_statistics`` also the values
    GRPOTrainer derives its logged metrics from, (S, T) with 0 at ignored tokens: per_token_entropy, per_token_kl
    (beta != 0) and coef_1, the importance ratio after ``delta`` ((S, 1) at the sequence level).
    """
    _check_sequences(input, linear_weight, target, ignore_index)
    head = _head(temperature, logit_scale, softcap)
    n_seq, n_tok = target.shape
    _check_reference(ref_input, ref_linear_weight, ref_log_probs, input, (n_seq, n_tok), required=beta != 0.0)
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    v.check_float_tensor("advantages", advantages)
    if tuple(advantages.shape) not in ((n_seq,), (n_seq, 1)):
        raise ValueError(f"advantages must have shape ({n_seq},), got {tuple(advantages.shape)}")
    if old_log_probs is not None and tuple(old_log_probs.shape) != (n_seq, n_tok):
        raise ValueError(f"old_log_probs must have shape {(n_seq, n_tok)}, got {tuple(old_log_probs.shape)}")
    rows = _Rows(input, target, ignore_index, None, 1, _budget(input, linear_weight, chunk_size))
    valid = target != ignore_index
    adv_rows = advantages.reshape(-1).detach().to(_acc(input))[rows.seq]
    old_rows = old_log_probs[valid].detach().to(_acc(input)) if old_log_probs is not None else None
    ref_rows = None
    if beta != 0.0:
        if ref_log_probs is not None:
            ref_rows = ref_log_probs[valid].detach().to(_acc(input))
        else:
            ref_rows = _reference_log_probs(rows, ref_input, ref_linear_weight, ref_linear_bias, target, None,
                                            ignore_index, head)
    n_tokens = rows.x.shape[0]
    lengths = rows.lengths.to(_acc(input))
    if loss_type in ("dapo", "cispo"):
        normalizer = num_items_in_batch if num_items_in_batch is not None else n_tokens
        normalizer = torch.as_tensor(normalizer, dtype=_acc(input), device=input.device).clamp(min=1.0)
    elif loss_type == "bnpo":
        normalizer = torch.tensor(float(max(n_tokens, 1)), dtype=_acc(input), device=input.device)
    elif loss_type == "dr_grpo":
        normalizer = torch.tensor(float(n_seq * (max_completion_length or n_tok)), dtype=_acc(input),
                                  device=input.device)
    logs = {"low": [], "high": [], "cispo": [], "kl": [], "coef": []}

    def _clip_flags(logs, coef, adv):
        if loss_type == "cispo":
            logs["cispo"].append((coef > epsilon_high) & (adv > 0))
        else:
            logs["low"].append((coef < 1 - epsilon_low) & (adv < 0))
            logs["high"].append((coef > 1 + epsilon_high) & (adv > 0))

    def chunk_loss(first, last, start, stop, lp, _):
        old = old_rows[start:stop].to(lp.dtype) if old_rows is not None else lp.detach()
        adv = adv_rows[start:stop].to(lp.dtype)
        log_ratio = lp - old
        if importance_sampling_level == "sequence":
            seq_mean = rows.seq_sums(log_ratio, start, stop, first, last) / lengths[first:last].clamp(min=1.0)
            log_ratio = seq_mean.to(lp.dtype)[rows.seq[start:stop] - first]
        coef_1 = torch.exp(log_ratio)
        importance = coef_1  # before delta's cap: TRL's bias-corrected KL weighs by it
        if loss_type == "cispo":
            per_token = -torch.clamp(coef_1, max=epsilon_high).detach() * adv * lp
        else:
            coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
            if delta is not None:
                coef_1 = torch.clamp(coef_1, max=delta)
            per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        if importance_sampling_level == "sequence":  # one ratio per sequence: TRL's flags are per sequence
            coef_seq = torch.exp(seq_mean.detach())
            if delta is not None and loss_type != "cispo":
                coef_seq = torch.clamp(coef_seq, max=delta)
            _clip_flags(logs, coef_seq, advantages.reshape(-1)[first:last].detach().to(coef_seq.dtype))
            logs["coef"].append(coef_seq)
        else:
            _clip_flags(logs, coef_1.detach(), adv)
            logs["coef"].append(coef_1.detach())
        if ref_rows is not None:
            ref = ref_rows[start:stop].to(lp.dtype)
            kl = torch.exp(ref - lp) - (ref - lp) - 1
            if kl_bias_correction:
                kl = kl * importance
            logs["kl"].append(kl.detach())
            per_token = per_token + beta * kl
        if loss_type in ("grpo", "luspo"):
            per_seq = rows.seq_sums(per_token, start, stop, first, last)
            if loss_type == "grpo":
                per_seq = per_seq / lengths[first:last].to(lp.dtype).clamp(min=1.0)
            return per_seq.sum() / n_seq
        return per_token.sum() / normalizer.to(lp.dtype)

    loss, _, entropy, _ = _fused_loss(input, linear_weight, target, linear_bias, chunk_loss, rows, head,
                                      want_entropy=True, accumulation_dtype=accumulation_dtype)
    def mean(parts, dtype=torch.float32):  # TRL's global masked mean (flags as fp32): 0 where there is nothing
        values = torch.cat(parts).to(dtype) if parts else lengths.new_zeros(0, dtype=dtype)
        count = max(values.numel(), 1)
        if importance_sampling_level == "sequence":  # TRL counts the sequences in a tensor of the default dtype
            count = torch.tensor(float(count), device=values.device)
        return values.sum() / count

    metrics = {"entropy": entropy.sum() / max(entropy.numel(), 1)}
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = mean(logs["cispo"])
    else:
        metrics.update(clip_ratio_low=mean(logs["low"]), clip_ratio_high=mean(logs["high"]),
                       clip_ratio=mean([a | b for a, b in zip(logs["low"], logs["high"], strict=True)]))
    if beta != 0.0:
        metrics["kl"] = mean(logs["kl"], lengths.dtype)
    if token_statistics:
        metrics["per_token_entropy"] = rows.tokens(entropy)
        if beta != 0.0:
            metrics["per_token_kl"] = rows.tokens(torch.cat(logs["kl"]) if logs["kl"] else entropy.new_zeros(0))
        coef = torch.cat(logs["coef"]) if logs["coef"] else entropy.new_zeros(0)
        metrics["coef_1"] = coef[:, None] if importance_sampling_level == "sequence" else rows.tokens(coef)
    return loss, metrics


# ----------------------------------------------------------------------------- distillation


def _jsd_rows_reference(student: Tensor, teacher: Tensor, beta: float, temperature: float, acc: torch.dtype,
                        student_transform=(1.0, None), teacher_transform=(1.0, None)) -> tuple[Tensor, Tensor]:
    """Per-row generalized JSD and its gradient in the student's logits, written out as TRL's
    ``generalized_jsd_loss`` (see ``fusedlayers.kernels.post_training``), each head's logits first through its
    (logit_scale, softcap)."""
    zs, slope = transform_reference(student.to(acc), *student_transform, temperature)
    zt, _ = transform_reference(teacher.to(acc), *teacher_transform, temperature)
    ls, lt = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    ps = ls.exp()
    if beta == 0:
        pt = lt.exp()
        return (pt * (lt - ls)).sum(-1), (ps - pt) * slope
    if beta == 1:
        kl = (ps * (ls - lt)).sum(-1)
        return kl, ps * ((ls - lt) - kl[:, None]) * slope
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    kl_s = (ps * (ls - lm)).sum(-1)
    kl_t = (lt.exp() * (lt - lm)).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s, (1 - beta) * ps * ((ls - lm) - kl_s[:, None]) * slope


class _FusedJSD(torch.autograd.Function):
    """The summed generalized JSD of row chunks times ``scale``, with the student's gradients computed in the same
    pass (the teacher gets none)."""

    @staticmethod
    def forward(ctx, xs, ws, bs, xt, wt, bt, beta, temperature, scale, chunk_size, compute_dtype, needs,
                accumulation_dtype, student_transform, teacher_transform):
        with torch.autocast(xs.device.type, enabled=False):
            acc = _accumulator(compute_dtype)
            compute_dtype = matmul_dtype(compute_dtype, xs.device)
            use_kernels = compute_dtype != torch.float64 and use_triton(xs)
            n_rows, vocab = xs.shape[0], ws.shape[0]
            loss_rows = torch.zeros(n_rows, dtype=acc, device=xs.device)
            gx = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device) if needs[0] else None
            # the first chunk writes grad_W (no zero fill, no read of zeros); no rows, no chunk: zeros
            new = torch.empty if n_rows else torch.zeros
            gw = new(ws.shape, dtype=accumulation_dtype or ws.dtype, device=xs.device) if needs[1] else None
            gb = torch.zeros(vocab, dtype=acc, device=xs.device) if needs[2] and bs is not None else None
            ws_c, wt_c = ws.to(compute_dtype), wt.to(compute_dtype)
            bs_c = bs.to(compute_dtype) if bs is not None else None
            bt_c = bt.to(compute_dtype) if bt is not None else None
            rows = max(1, min(chunk_size, n_rows))
            s_buf = torch.empty(rows, vocab, dtype=compute_dtype, device=xs.device)
            t_buf = torch.empty(rows, vocab, dtype=compute_dtype, device=xs.device)
            for start in range(0, n_rows, rows):
                stop = min(start + rows, n_rows)
                xs_c = xs[start:stop].to(compute_dtype)
                s = chunk_logits_(s_buf[: stop - start], xs_c, ws_c.t(), bs_c)
                t = chunk_logits_(t_buf[: stop - start], xt[start:stop].to(compute_dtype), wt_c.t(), bt_c)
                if use_kernels:
                    kernels.jsd_rows_(s, t, beta, temperature, scale, loss_rows[start:stop], student_transform,
                                      teacher_transform)
                else:
                    loss_c, grad_c = _jsd_rows_reference(s, t, beta, temperature, acc, student_transform,
                                                         teacher_transform)
                    loss_rows[start:stop] = loss_c
                    s.copy_(grad_c * scale)
                if gx is not None:
                    torch.mm(s, ws_c, out=gx[start:stop])
                if gw is not None:
                    _addmm_acc_(gw, s.t(), xs_c, start == 0)
                if gb is not None:
                    gb += s.sum(0, dtype=acc)
        _save_gradients(ctx, (gx, gw, gb), (xs, ws, bs))
        ctx.mark_non_differentiable(loss_rows)
        return loss_rows.sum() * scale, loss_rows

    @staticmethod
    def backward(ctx, grad, _):
        return (*_scaled_gradients(ctx, grad), *(None,) * 12)


def linear_generalized_jsd_loss(
    student_input: Tensor, student_weight: Tensor, teacher_input: Tensor, teacher_weight: Tensor,
    target: Tensor | None = None, *, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
    reduction: str = "batchmean", num_items_in_batch: int | Tensor | None = None, student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None, logit_scale: float = 1.0, softcap: float | None = None,
    teacher_logit_scale: float = 1.0, teacher_softcap: float | None = None, chunk_size: int | None = None,
    accumulation_dtype: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Generalized JSD distillation loss (TRL's ``GKDTrainer.generalized_jsd_loss``) between a student head
    ``F.linear(student_input, student_weight, student_bias)`` and a teacher head on its own hidden states (its
    hidden size may differ), per token, over the temperature-scaled distributions: ``beta * KL(teacher || M) +
    (1 - beta) * KL(student || M)`` with ``M = (1 - beta) student + beta teacher``; ``beta`` 0 is KL(teacher ||
    student), 1 is KL(student || teacher).

    ``student_input`` (..., H), ``teacher_input`` (..., H_teacher) with the same leading dims, ``target`` (...) or
    None: the tokens whose target is ``ignore_index`` are left out. ``reduction`` as TRL: "batchmean" divides by
    the number of counted tokens (with ``target``) or by the batch size (the leading dim, without), "sum", "mean"
    (by tokens x vocabulary); ``num_items_in_batch`` overrides it with ``sum / num_items_in_batch``. The teacher
    gets no gradient. Both logit tensors exist only a chunk at a time. ``logit_scale`` / ``softcap`` and
    ``teacher_logit_scale`` / ``teacher_softcap``: what each model does to its head's logits before they are returned
    (Cohere's scale, Gemma 2's cap; as for the other losses), applied before the temperature. Metrics: jsd (the
    per-token divergences).
    """
    for name, t in (("student_input", student_input), ("student_weight", student_weight),
                    ("teacher_input", teacher_input), ("teacher_weight", teacher_weight)):
        v.check_float_tensor(name, t)
    if student_weight.dim() != 2 or teacher_weight.dim() != 2 or student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student_weight and teacher_weight must be (V, H) heads over the same vocabulary, got "
                         f"{tuple(student_weight.shape)} and {tuple(teacher_weight.shape)}")
    if student_input.dim() < 1 or student_input.shape[-1] != student_weight.shape[1]:
        raise ValueError(f"student_input {tuple(student_input.shape)} must end with student_weight's in_features "
                         f"{student_weight.shape[1]}")
    if teacher_input.shape[:-1] != student_input.shape[:-1] or teacher_input.shape[-1] != teacher_weight.shape[1]:
        raise ValueError(f"teacher_input must be {(*student_input.shape[:-1], teacher_weight.shape[1])}, got "
                         f"{tuple(teacher_input.shape)}")
    beta = v.check_fraction("beta", beta)
    student_transform = _check_logit_transform(logit_scale, softcap)
    teacher_transform = _check_logit_transform(teacher_logit_scale, teacher_softcap, "teacher_logit_scale",
                                               "teacher_softcap")
    temperature = v.check_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if reduction not in ("batchmean", "sum", "mean"):
        raise ValueError(f"reduction must be 'batchmean', 'sum' or 'mean', got {reduction!r}")
    lead = student_input.shape[:-1]
    xs = student_input.reshape(-1, student_input.shape[-1])
    xt = teacher_input.reshape(-1, teacher_input.shape[-1])
    if target is not None:
        v.check_index_tensor("target", target)
        if target.shape != lead:
            raise ValueError(f"target must have shape {tuple(lead)}, got {tuple(target.shape)}")
        valid = target.reshape(-1) != ignore_index
        xs, xt = xs[valid], xt[valid]
    n_tokens, vocab = xs.shape[0], student_weight.shape[0]
    if num_items_in_batch is not None:
        denominator = float(num_items_in_batch)
    elif reduction == "batchmean":
        denominator = max(n_tokens, 1) if target is not None else max(lead[0] if len(lead) else 1, 1)
    elif reduction == "mean":
        denominator = n_tokens * vocab
    else:
        denominator = 1.0
    compute_dtype = _head_compute_dtype(student_input, student_weight, student_bias)
    grad = torch.is_grad_enabled()
    needs = (grad and student_input.requires_grad, grad and student_weight.requires_grad,
             grad and student_bias is not None and student_bias.requires_grad)
    # two logits buffers (student, teacher): half the usual budget each
    chunk = chunk_size or default_chunk_size(n_tokens, vocab, matmul_dtype(compute_dtype, xs.device), xs.device,
                                             JSD_BUFFER_BYTES)
    loss, jsd = _FusedJSD.apply(xs, student_weight, student_bias, xt.detach(), teacher_weight.detach(),
                                teacher_bias.detach() if teacher_bias is not None else None, beta, temperature,
                                1.0 / denominator, chunk, compute_dtype, needs, accumulation_dtype,
                                student_transform, teacher_transform)
    return loss, {"jsd": jsd.detach()}


# ----------------------------------------------------------------------------- modules


class _LinearLoss(nn.Module):
    """A loss module: the hyperparameters given to the constructor (the function's keyword arguments) are passed to
    ``function`` on every call, with the tensors given to forward."""

    function = None

    def __init__(self, **hyperparameters):
        super().__init__()
        allowed = {p.name for p in inspect.signature(self.function).parameters.values()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY}
        unknown = set(hyperparameters) - allowed
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown arguments {sorted(unknown)}; it takes "
                            f"{sorted(allowed)}")
        self.hyperparameters = hyperparameters

    def forward(self, *tensors, **kwargs) -> tuple[Tensor, dict[str, Tensor]]:
        return type(self).function(*tensors, **{**self.hyperparameters, **kwargs})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters.items())


def _loss_module(name: str, function) -> type:
    doc = (f"``nn.Module`` form of :func:`{function.__name__}`: ``{name}(**hyperparameters)(*tensors, **kwargs)`` "
           f"calls ``{function.__name__}(*tensors, **hyperparameters, **kwargs)``.")
    return type(name, (_LinearLoss,), {"function": staticmethod(function), "__doc__": doc,
                                       "__module__": __name__})


LinearDPOLoss = _loss_module("LinearDPOLoss", linear_dpo_loss)
LinearORPOLoss = _loss_module("LinearORPOLoss", linear_orpo_loss)
LinearCPOLoss = _loss_module("LinearCPOLoss", linear_cpo_loss)
LinearSimPOLoss = _loss_module("LinearSimPOLoss", linear_simpo_loss)
LinearKTOLoss = _loss_module("LinearKTOLoss", linear_kto_loss)
LinearGRPOLoss = _loss_module("LinearGRPOLoss", linear_grpo_loss)
LinearGeneralizedJSDLoss = _loss_module("LinearGeneralizedJSDLoss", linear_generalized_jsd_loss)
