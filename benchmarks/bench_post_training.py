"""Benchmark the post-training losses fused with the LM head (``fusedlayers.post_training``) and
``fl.linear_log_probs`` against Liger-Kernel's chunked losses, TRL's fused LM head and plain PyTorch (GPU),
forward+backward, bf16 hidden states and heads, every row on the same GPU in one run:

1. ``log_probs``: ``fl.linear_log_probs`` (upstream gradient random per token) against ``fl.linear_cross_entropy``
   at the same shape, Liger's fused linear cross-entropy, TRL's ``ChunkedLogProbFunction`` (the kernel of its fused LM
   head) and full logits (``F.linear`` + fp32 ``log_softmax`` + gather); N = 16384 tokens, H 4096, V 128256.
2. ``dpo``: 8 preference pairs (16 sequences, chosen first) x 1024 tokens with a reference model given as its own
   hidden states and head: ``linear_dpo_loss``, ``LigerFusedLinearDPOLoss``, TRL-style (``ChunkedLogProbFunction`` for
   policy and reference, then ``DPOTrainer``'s sigmoid loss) and full logits.
3. ``grpo``: 8 groups x 8 completions = 64 sequences x 512 tokens, loss_type "dapo", on-policy (ratio 1), beta 0 (no
   reference; ``--grpo-beta`` adds one): ``linear_grpo_loss``, ``LigerFusedLinearGRPOLoss``, TRL-style
   (``ChunkedLogProbFunction`` with the entropy, as ``GRPOTrainer`` asks for it, then its token-level clipped loss)
   and full logits.
4. ``jsd``: 8 x 1024 tokens, student and teacher heads H 4096 x V 128256, beta 0.5:
   ``linear_generalized_jsd_loss``, ``LigerFusedLinearJSDLoss`` (soft loss only), TRL's ``ChunkedDivergenceFunction``
   (``DistillationTrainer``'s kernel, where the installed TRL has it) and full logits of both with ``GKDTrainer``'s
   ``generalized_jsd_loss`` on them (bf16, as the trainer gets them from the models).

Matmul-bound: each row reports its time, TFLOP/s counting the products the loss needs at the least (policy
forward, dX, dW, plus one forward per reference or teacher model), its time over those products alone (cuBLAS,
bf16, same shapes, timed in the same rounds), over Liger's, and the peak memory allocated beyond the inputs
(including the returned gradients of the hidden states and the head), also over the full-logits row's. The loss
column lets the rows be checked against each other (log_probs: the mean negative log-prob, i.e. the cross-entropy).

    python benchmarks/bench_post_training.py [--out benchmarks/results/<device>-post_training.md]
                                             [--only log_probs|dpo|grpo|jsd] [--rounds 5] [--prompt 0]
                                             [--grpo-beta 0.0] [--smoke]

``--prompt P`` ignores the first P targets of every sequence (a prompt): our losses and TRL's head skip those rows,
Liger and full logits compute them; the products alone count the labelled rows. ``--smoke``: tiny shapes, runs on
the CPU in seconds (wall-clock timing, no peak memory, the rows that need CUDA skipped) to check the script.
Each implementation is timed in ``--rounds`` interleaved rounds (its best round reported, its slowest shown).
Liger-Kernel and TRL are optional; their rows are skipped, with the reason printed, when they do not import.
Liger (0.8.5) runs as its losses default to (torch.compile on, its chunk sizes), with the settings that make it
compute the same loss; its GRPO backward upcasts the logits' gradient and takes dX and dW as fp32 products.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the tree measured, installed or not

from bench_cross_entropy import peak_extra_bytes  # noqa: E402  (the same measurement as the other benchmarks)
from timing import median_ms, report, time_rounds  # noqa: E402

import fusedlayers as fl  # noqa: E402

BF16 = torch.bfloat16
GiB = 2**30
IGNORE = -100
FULL = dict(H=4096, V=128256, lp_tokens=16384, dpo=(16, 1024), grpo=(64, 512), jsd=(8, 1024))
SMOKE = dict(H=32, V=1000, lp_tokens=64, dpo=(4, 16), grpo=(8, 16), jsd=(2, 16))
DPO_BETA, JSD_BETA, GRPO_EPSILON = 0.1, 0.5, 0.2
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (TRL 1.16), what its fused head passes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- optional implementations


def optional(what: str, load):
    """``load()``, or None with the reason printed (the package is missing, or does not import on this machine)."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001
        print(f"{what} unavailable ({type(e).__name__}: {str(e)[:200]}): no {what} row")
        return None


def ours(name: str):
    # the post-training losses were written alongside this benchmark: a tree without them still runs the others
    def load():
        import fusedlayers.post_training as pt

        return getattr(pt, name)

    return optional(f"fusedlayers.post_training.{name}", load)


def liger(name: str):
    def load():
        if name == "LigerFusedLinearCrossEntropyLoss":  # Triton kernels; the chunked losses are PyTorch
            if DEVICE != "cuda":
                raise RuntimeError("its Triton kernels need CUDA")
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            return LigerFusedLinearCrossEntropyLoss
        import liger_kernel.chunked_loss

        return getattr(liger_kernel.chunked_loss, name)

    return optional(f"Liger {name}", load)


def _trl_trainer_utils_shim() -> None:
    """TRL's chunked log-prob kernel needs torch and Triton only, but its backward imports
    ``trl.trainer.utils.maybe_gather_lm_head_ctx``, whose module pulls in TRL's trainer dependencies (pandas,
    datasets). Where those are missing, that context manager is what it is for a plain (unsharded) weight: none."""
    try:
        import trl.trainer.utils  # noqa: F401
    except ImportError:
        import contextlib
        import types

        import trl.trainer

        shim = types.ModuleType("trl.trainer.utils")
        shim.maybe_gather_lm_head_ctx = lambda *args, **kwargs: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = trl.trainer.utils = shim
        print("note: trl.trainer.utils does not import here (TRL's trainer dependencies are missing); its "
              "maybe_gather_lm_head_ctx is a no-op for the unsharded heads measured, and is replaced by one")


def trl_kernel(name: str):
    def load():
        _trl_trainer_utils_shim()
        if name == "ChunkedDivergenceFunction":
            from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

            return ChunkedDivergenceFunction
        from trl.kernels import ChunkedLogProbFunction

        return ChunkedLogProbFunction

    return optional(f"TRL {name}", load)


# ----------------------------------------------------------------------------- shared pieces of the rows


def checked(loss):
    """A row's result: the scalar to differentiate, and the value shown in the loss column."""
    return loss, loss.detach()


def trl_log_probs(chunked, x, w, t, outputs=("log_probs",)):
    """TRL's fused LM head (``add_fused_lm_head`` on a Triton device): the labelled rows only go through
    ``ChunkedLogProbFunction``, scattered back to (S, T) with 0 elsewhere. Returns (log_probs, entropy or None)."""
    mask = t != IGNORE
    out = chunked.apply(x[mask], w, None, t[mask], 1.0, TRL_VOCAB_CHUNK, None, 1.0, outputs)
    return [None if o is None else o.new_zeros(mask.shape).masked_scatter(mask, o) for o in out[:2]]


def full_log_probs(x, w, t):
    """Per-token log-probs from the whole logits tensor, upcast to fp32 (as training code commonly does: bf16
    log-probs summed over a sequence would lose the reward margins), 0 on ignored targets."""
    logits = F.linear(x, w).float()
    lp = logits.log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill(t == IGNORE, 0.0)


def dpo_sigmoid(logps, ref_logps, beta):
    """DPOTrainer's "sigmoid" loss on per-sequence sums (the batch is [chosen, rejected])."""
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -F.logsigmoid(beta * delta).mean()


def grpo_dapo(lp, advantages, mask, ref_lp, beta):
    """GRPOTrainer's token-level clipped loss, loss_type "dapo", on-policy (old log-probs = the current ones,
    detached), normalized by the batch's completion tokens (num_items_in_batch of one process, one step)."""
    coef_1 = torch.exp(lp - lp.detach())
    coef_2 = torch.clamp(coef_1, 1 - GRPO_EPSILON, 1 + GRPO_EPSILON)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        per_token = per_token + beta * (torch.exp(ref_lp - lp) - (ref_lp - lp) - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def generalized_jsd(student_logits, teacher_logits, labels, beta):
    """GKDTrainer.generalized_jsd_loss (TRL, 0 < beta < 1, temperature 1, reduction "batchmean"), as written there."""
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    beta = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
    mixture_log_probs = torch.logsumexp(
        torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]), dim=0)
    kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
    mask = labels != IGNORE
    jsd = (beta * kl_teacher + (1 - beta) * kl_student)[mask]
    return jsd.sum() / mask.sum().clamp_min(1)


def inputs(n_seq: int, seq: int, shape: dict, prompt: int, seed: int = 0):
    """bf16 hidden states (S, T, H) and head (V, H) that need gradients, targets (S, T) with the first ``prompt``
    of each sequence ignored. Logits come out ~N(0, 1), like a trained head's spread."""
    torch.manual_seed(seed)
    h, v = shape["H"], shape["V"]
    x = torch.randn(n_seq, seq, h, device=DEVICE).to(BF16).requires_grad_()
    w = (torch.randn(v, h, device=DEVICE) / h**0.5).to(BF16).requires_grad_()
    t = torch.randint(0, v, (n_seq, seq), device=DEVICE)
    t[:, :prompt] = IGNORE
    return x, w, t


def near(x, w, scale: float = 0.05):
    """A reference model close to the policy (its own hidden states and head, no gradient): log-ratios of a few
    units per sequence, so the DPO loss is neither saturated nor trivial."""
    xr = x.detach() + scale * torch.randn_like(x)
    wr = w.detach() + scale / w.shape[1] ** 0.5 * torch.randn_like(w)
    return xr, wr


# ----------------------------------------------------------------------------- the sections' rows


def log_probs_impls(x, w, t):
    """Each: a closure returning (scalar to differentiate, mean NLL to check). The log-prob rows take a random
    upstream gradient per token, as a loss built on them would give (backprop of (lp * g).sum() is the same)."""
    g = torch.randn(t.shape, device=DEVICE)
    valid = t != IGNORE

    def lp_row(log_probs):
        def run():
            lp = log_probs()
            return (lp * g).sum(), -lp.detach()[valid].mean()

        return run

    impls = [("fusedlayers linear_log_probs", "ours", lp_row(lambda: fl.linear_log_probs(x, w, t))),
             ("fusedlayers linear_cross_entropy", "ours CE", lambda: checked(fl.linear_cross_entropy(x, w, t)))]
    liger_ce = liger("LigerFusedLinearCrossEntropyLoss")
    if liger_ce is not None:
        module = liger_ce()
        impls.append(("Liger LigerFusedLinearCrossEntropyLoss", "liger", lambda: checked(module(w, x, t))))
    chunked = trl_kernel("ChunkedLogProbFunction")
    if chunked is not None:
        impls.append(("TRL ChunkedLogProbFunction", "trl", lp_row(lambda: trl_log_probs(chunked, x, w, t)[0])))
    impls.append(("stock (full logits, fp32 log_softmax)", "stock", lp_row(lambda: full_log_probs(x, w, t))))
    return impls


def dpo_impls(x, w, t, xr, wr):
    impls = []
    dpo = ours("linear_dpo_loss")
    if dpo is not None:
        impls.append(("fusedlayers linear_dpo_loss", "ours", lambda: checked(
            dpo(x, w, t, ref_input=xr, ref_linear_weight=wr, beta=DPO_BETA)[0])))
        impls.append(("fusedlayers linear_dpo_loss, fp32 grad_W accumulator", "ours fp32", lambda: checked(
            dpo(x, w, t, ref_input=xr, ref_linear_weight=wr, beta=DPO_BETA, accumulation_dtype=torch.float32)[0])))

    def on_linear_log_probs():  # TRL's loss code on fl.linear_log_probs: what fusedlayers.integrations.trl runs
        mask = t != IGNORE
        logps = torch.zeros(mask.shape, device=DEVICE).masked_scatter(
            mask, fl.linear_log_probs(x[mask], w, t[mask])).sum(-1)
        with torch.no_grad():
            ref_logps = torch.zeros(mask.shape, device=DEVICE).masked_scatter(
                mask, fl.linear_log_probs(xr[mask], wr, t[mask])).sum(-1)
        return checked(dpo_sigmoid(logps, ref_logps, DPO_BETA))

    impls.append(("fl.linear_log_probs x2 + sigmoid (TRL integration)", "ours lp", on_linear_log_probs))
    liger_dpo = liger("LigerFusedLinearDPOLoss")
    if liger_dpo is not None:
        # chosen then rejected along the batch, as ours; sums of log-probs (average_log_prob=False), as TRL
        module = liger_dpo(beta=DPO_BETA, use_ref_model=True, average_log_prob=False, compiled=DEVICE == "cuda")
        impls.append(("Liger LigerFusedLinearDPOLoss", "liger",
                      lambda: checked(module(w, x, t, None, xr, wr)[0])))
    chunked = trl_kernel("ChunkedLogProbFunction")
    if chunked is not None:
        def trl_style():
            logps = trl_log_probs(chunked, x, w, t)[0].sum(-1)
            with torch.no_grad():
                ref_logps = trl_log_probs(chunked, xr, wr, t)[0].sum(-1)
            return checked(dpo_sigmoid(logps, ref_logps, DPO_BETA))

        impls.append(("TRL-style (ChunkedLogProbFunction x2 + sigmoid)", "trl", trl_style))

    def stock():
        logps = full_log_probs(x, w, t).sum(-1)
        with torch.no_grad():
            ref_logps = full_log_probs(xr, wr, t).sum(-1)
        return checked(dpo_sigmoid(logps, ref_logps, DPO_BETA))

    impls.append(("stock (full logits, fp32 log_softmax)", "stock", stock))
    return impls


def grpo_impls(x, w, t, advantages, beta, ref):
    xr, wr = ref if ref is not None else (None, None)
    mask = t != IGNORE
    impls = []
    grpo = ours("linear_grpo_loss")
    if grpo is not None:
        kw = dict(ref_input=xr, ref_linear_weight=wr) if ref is not None else {}
        impls.append(("fusedlayers linear_grpo_loss", "ours", lambda: checked(
            grpo(x, w, t, advantages, beta=beta, epsilon_low=GRPO_EPSILON, epsilon_high=GRPO_EPSILON,
                 loss_type="dapo", **kw)[0])))
    liger_grpo = liger("LigerFusedLinearGRPOLoss")
    if liger_grpo is not None:
        # Liger gathers every position's target (no ignore_index): ignored ones become token 0, masked out by
        # attention_mask; its default beta is 0.04 with a reference, so both are set
        module = liger_grpo(beta=beta, use_ref_model=ref is not None, loss_type="dapo", epsilon_low=GRPO_EPSILON,
                            epsilon_high=GRPO_EPSILON, compiled=DEVICE == "cuda")
        ids, attention = t.clamp(min=0), mask.long()
        impls.append(("Liger LigerFusedLinearGRPOLoss", "liger", lambda: checked(
            module(x, w, ids, attention, advantages, ref_input=xr, ref_weight=wr)[0])))
    chunked = trl_kernel("ChunkedLogProbFunction")
    if chunked is not None:
        def trl_style():
            lp, _ = trl_log_probs(chunked, x, w, t, ("log_probs", "entropy"))  # the entropy GRPOTrainer logs
            ref_lp = None
            if ref is not None:
                with torch.no_grad():
                    ref_lp = trl_log_probs(chunked, xr, wr, t)[0]
            return checked(grpo_dapo(lp, advantages, mask, ref_lp, beta))

        impls.append(("TRL-style (ChunkedLogProbFunction + dapo loss)", "trl", trl_style))

    def stock():
        lp = full_log_probs(x, w, t)
        ref_lp = None
        if ref is not None:
            with torch.no_grad():
                ref_lp = full_log_probs(xr, wr, t)
        return checked(grpo_dapo(lp, advantages, mask, ref_lp, beta))

    impls.append(("stock (full logits, fp32 log_softmax)", "stock", stock))
    return impls


def jsd_impls(xs, ws, xt, wt, t):
    hs, ht = xs.shape[-1], xt.shape[-1]
    impls = []
    jsd = ours("linear_generalized_jsd_loss")
    if jsd is not None:
        impls.append(("fusedlayers linear_generalized_jsd_loss", "ours",
                      lambda: checked(jsd(xs, ws, xt, wt, t, beta=JSD_BETA)[0])))
    liger_jsd = liger("LigerFusedLinearJSDLoss")
    if liger_jsd is not None:
        # the soft (JSD) loss alone: its default also adds 0.5 x cross-entropy on the labels
        module = liger_jsd(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA, compiled=DEVICE == "cuda")
        impls.append(("Liger LigerFusedLinearJSDLoss", "liger", lambda: checked(
            module(xs.view(-1, hs), ws, xt.view(-1, ht), wt, t.view(-1)))))
    divergence = trl_kernel("ChunkedDivergenceFunction")
    if divergence is not None:
        def trl_chunked():  # DistillationTrainer's _chunked_divergence_loss: the labelled rows, mean over them
            valid = t.reshape(-1) != IGNORE
            per_token, _ = divergence.apply(xs.reshape(-1, hs)[valid], ws, None, xt.reshape(-1, ht)[valid], wt, None,
                                            JSD_BETA, 1.0, 1.0, None, 1.0, None)
            return checked(per_token.sum() / valid.sum().clamp(min=1))

        impls.append(("TRL ChunkedDivergenceFunction", "trl", trl_chunked))

    def stock():  # GKDTrainer: both models' logits as they return them (bf16), then its loss
        student = F.linear(xs, ws)
        with torch.no_grad():
            teacher = F.linear(xt, wt)
        return checked(generalized_jsd(student, teacher, t, JSD_BETA))

    impls.append(("stock (full logits, GKD generalized_jsd_loss)", "stock", stock))
    return impls


# ----------------------------------------------------------------------------- measuring


def wall_ms(fn, calls: int = 3) -> float:
    """--smoke on the CPU: the median wall-clock time of a few calls (do_bench needs CUDA)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def timer():
    return median_ms if DEVICE == "cuda" else wall_ms


def matmuls_alone(x, w, extra_forwards: int):
    """The products the loss needs at the least, cuBLAS bf16 at the full sizes: x @ W^T, dlogits @ W, dlogits^T @ x,
    and one more x @ W^T per reference/teacher model. The buffers come from the caching allocator on each call,
    so that the (tokens x V) one is not held while the other rows run (it is reused, not allocated anew)."""
    x, w = x.detach(), w.detach()

    def run():
        logits = torch.empty(x.shape[0], w.shape[0], device=DEVICE, dtype=BF16)
        torch.mm(x, w.t(), out=logits)
        torch.mm(logits, w, out=torch.empty_like(x))
        torch.mm(logits.t(), x, out=torch.empty_like(w))
        for _ in range(extra_forwards):
            torch.mm(x, w.t(), out=logits)

    return run


def measure(section: str, impls: list, params: tuple, mm, flops: float, rounds: int) -> tuple[list[dict], dict]:
    """Loss and peak memory of each row first, one at a time (also compiles and warms up), then every row and the
    products alone timed in interleaved rounds (timing.time_rounds: a slow phase of the host costs one round of
    every row instead of every round of one row); each row keeps its best round."""
    rows, timed = [], []
    for name, role, f in impls:
        def fwd_bwd(f=f):
            value, check = f()
            return torch.autograd.grad(value, params), check

        try:
            _, check = fwd_bwd()
            peak = peak_extra_bytes(fwd_bwd) / GiB if DEVICE == "cuda" else None
        except Exception as e:  # noqa: BLE001  (out of memory, or a peer that does not take these inputs)
            print(f"{section} {name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        finally:
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        rows.append(dict(impl=name, role=role, peak=peak, loss=check.item()))
        timed.append((fwd_bwd, timer()))
    timed.append((mm, timer()))
    *times, mm_times = time_rounds(timed, rounds)
    mm_row = dict(impl="matmuls alone (cuBLAS, bf16)", role="matmuls", peak=None, loss=None)
    for row, t in zip([*rows, mm_row], [*times, mm_times], strict=True):
        row.update(ms=min(t), slowest_ms=max(t), tflops=flops / (min(t) * 1e-3) / 1e12)
        print(section, row)
    return rows, mm_row


def table(rows: list[dict], mm_row: dict, products: int) -> str:
    liger_row = next((r for r in rows if r["role"] == "liger"), None)
    stock = next((r for r in rows if r["role"] == "stock"), None)
    lines = [f"| impl | fwd+bwd ms | slowest round ms | TFLOP/s ({products} products) | x matmuls alone | "
             "time / Liger | peak extra GiB | peak / stock | loss |", "|---" * 9 + "|"]
    for r in [*rows, mm_row]:
        vs_liger = f"{r['ms'] / liger_row['ms']:.2f}" if liger_row else "-"
        peak = f"{r['peak']:.2f}" if r["peak"] is not None else "-"
        vs_stock = f"{r['peak'] / stock['peak']:.2f}" if r["peak"] is not None and stock and stock["peak"] else "-"
        loss = f"{r['loss']:.5f}" if r["loss"] is not None else "-"
        lines.append(f"| {r['impl']} | {r['ms']:.2f} | {r['slowest_ms']:.2f} | {r['tflops']:.0f} | "
                     f"{r['ms'] / mm_row['ms']:.2f} | {vs_liger} | {peak} | {vs_stock} | {loss} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the sections


def log_probs_section(shape: dict, rounds: int) -> str:
    n, h, v = shape["lp_tokens"], shape["H"], shape["V"]
    x, w, t = inputs(1, n, shape, 0)
    x, t = x.detach().view(n, h).requires_grad_(), t.view(n)
    rows, mm = measure("log_probs", log_probs_impls(x, w, t), (x, w), matmuls_alone(x, w, 0), 6 * n * h * v, rounds)
    return (f"## linear_log_probs vs linear_cross_entropy: {n} tokens, H {h}, V {v}, every target labelled\n\n"
            "The log-prob rows get a random upstream gradient per token; linear_log_probs recomputes the logits in "
            "backward (4 products), the cross-entropy rows need 3. time / Liger: against Liger's fused linear "
            "cross-entropy. loss: the mean negative log-prob.\n\n"
            + table(rows, mm, 3))


def dpo_section(shape: dict, rounds: int, prompt: int) -> str:
    (n_seq, seq), h, v = shape["dpo"], shape["H"], shape["V"]
    x, w, t = inputs(n_seq, seq, shape, prompt)
    xr, wr = near(x, w)
    n = int((t != IGNORE).sum())
    rows, mm = measure("dpo", dpo_impls(x, w, t, xr, wr), (x, w),
                       matmuls_alone(x.view(-1, h)[:n], w, 1), 8 * n * h * v, rounds)
    return (f"## DPO (sigmoid, beta {DPO_BETA}): {n_seq // 2} pairs ({n_seq} sequences) x {seq} tokens ({prompt} "
            f"prompt), H {h}, V {v}, reference model as its own hidden states and head\n\n" + table(rows, mm, 4))


def grpo_section(shape: dict, rounds: int, prompt: int, beta: float) -> str:
    (n_seq, seq), h, v = shape["grpo"], shape["H"], shape["V"]
    x, w, t = inputs(n_seq, seq, shape, prompt)
    advantages = torch.randn(n_seq, device=DEVICE)  # drawn first: the same with and without a reference
    ref = near(x, w) if beta != 0.0 else None
    n = int((t != IGNORE).sum())
    products = 3 + (ref is not None)
    rows, mm = measure("grpo", grpo_impls(x, w, t, advantages, beta, ref), (x, w),
                       matmuls_alone(x.view(-1, h)[:n], w, products - 3), 2 * products * n * h * v, rounds)
    reference = f"beta {beta}, reference model as its own hidden states and head" if ref else "beta 0, no reference"
    return (f"## GRPO (dapo, epsilon {GRPO_EPSILON}, on-policy): {n_seq // 8} groups x 8 completions = {n_seq} "
            f"sequences x {seq} tokens ({prompt} prompt), H {h}, V {v}, {reference}\n\n" + table(rows, mm, products))


def jsd_section(shape: dict, rounds: int, prompt: int) -> str:
    (n_seq, seq), h, v = shape["jsd"], shape["H"], shape["V"]
    xs, ws, t = inputs(n_seq, seq, shape, prompt)
    xt, wt, _ = inputs(n_seq, seq, shape, prompt, seed=1)  # an unrelated teacher
    xt, wt = xt.detach(), wt.detach()
    n = int((t != IGNORE).sum())
    rows, mm = measure("jsd", jsd_impls(xs, ws, xt, wt, t), (xs, ws),
                       matmuls_alone(xs.view(-1, h)[:n], ws, 1), 8 * n * h * v, rounds)
    return (f"## Generalized JSD distillation (beta {JSD_BETA}): {n_seq} x {seq} tokens ({prompt} prompt), student and "
            f"teacher heads H {h} x V {v}\n\n" + table(rows, mm, 4))


# ----------------------------------------------------------------------------- the report


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def commit() -> str:
    """The commit of the tree measured, and whether tracked files differ from it (read-only git plumbing)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)

    sha = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("diff-index", "--quiet", "HEAD", "--").returncode == 1
    return sha + (" (with uncommitted changes)" if dirty else "")


def header(args) -> str:
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (--smoke)"
    command = "python " + " ".join(["benchmarks/bench_post_training.py", *sys.argv[1:]])
    timing = ("do_bench median, the best of" if DEVICE == "cuda" else "median wall-clock time of 3 calls, the best of")
    return (f"# Post-training losses fused with the LM head -- {device}\n\n"
            f"{datetime.date.today()}, commit {commit()}, `{command}`; torch {torch.__version__}, triton "
            f"{version('triton')}, transformers {version('transformers')}, trl {version('trl')}, liger-kernel "
            f"{version('liger-kernel')}, python {platform.python_version()}. bf16 hidden states and heads; "
            "forward+backward = torch.autograd.grad(loss, (hidden states, head)); "
            f"{timing} {args.rounds} interleaved rounds. 'peak extra' is the peak allocation beyond the inputs "
            "(hidden states, heads, targets, reference/teacher), including the returned gradients. TFLOP/s counts "
            "the products the loss needs at the least (policy forward, dX, dW, one forward per reference/teacher) on "
            "the labelled tokens; 'matmuls alone' runs just those (cuBLAS, bf16). 'stock' computes the whole logits "
            "tensor.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    parser.add_argument("--only", choices=("log_probs", "dpo", "grpo", "jsd"))
    parser.add_argument("--rounds", type=int, default=5,
                        help="time every implementation this many times, interleaved; keep the best")
    parser.add_argument("--prompt", type=int, default=0, help="dpo/grpo/jsd: ignore the first PROMPT targets of "
                        "every sequence (our losses and TRL's head skip those rows; Liger and stock do not)")
    parser.add_argument("--grpo-beta", type=float, default=0.0,
                        help="grpo: the KL coefficient; non-zero adds a reference model (one more product)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU without a GPU")
    args = parser.parse_args()
    if DEVICE != "cuda" and not args.smoke:
        sys.exit("bench_post_training.py needs a CUDA GPU (or --smoke to check it on the CPU)")
    shape = SMOKE if args.smoke else FULL
    prompt = args.prompt
    if args.smoke:
        args.rounds = min(args.rounds, 2)
        prompt = min(prompt, 8) or 3  # exercise the ignored rows
    sections = [header(args)]
    if args.only in (None, "log_probs"):
        sections.append(log_probs_section(shape, args.rounds))
    if args.only in (None, "dpo"):
        sections.append(dpo_section(shape, args.rounds, prompt))
    if args.only in (None, "grpo"):
        sections.append(grpo_section(shape, args.rounds, prompt, args.grpo_beta))
    if args.only in (None, "jsd"):
        sections.append(jsd_section(shape, args.rounds, prompt))
    report("\n\n".join(sections) + "\n", args.out)


if __name__ == "__main__":
    main()
