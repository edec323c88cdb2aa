"""TRL's trainers on fusedlayers' log-prob kernel.

    from fusedlayers.integrations import trl as fltrl
    fltrl.apply()                     # TRL's fused LM heads now compute with fl.linear_log_prob_statistics
    trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=args, ...)
    trainer.train()
    fltrl.revert()                    # TRL's own kernel again

    with fltrl.applied():             # or for a block only
        trainer.train()

TRL 1.15 and 1.16 compute every per-token log-probability their DPO, KTO, GRPO, RLOO and SFT trainers train on
(and AsyncGRPO's) in ``trl.trainer.utils.add_fused_lm_head``: the trainer patches the model's forward so that
``model(..., labels=labels, fused_lm_head=True)`` runs the backbone, then hands the hidden states, the output
embedding's weight and bias and the shifted labels to ``_ChunkedLogProbFunction.apply`` (TRL's
``trl.kernels.ChunkedLogProbFunction``), which returns ``(log_probs, entropy, log_sum_sq_probs, mean_logits,
is_top1)``. That name is a global of ``trl.trainer.utils`` read at each call, so :func:`apply` replaces it there by
:class:`ChunkedLogProbFunction`, whose ``apply`` takes the same arguments and returns the same outputs, computed by
``fl.linear_log_prob_statistics`` (the Triton kernels on CUDA, the PyTorch reference on CPU). It is process-wide and
takes effect for heads TRL added before it too (a trainer built before :func:`apply` trains on ours). The argument
mapping: ``final_logit_softcapping`` is ``softcap``, TRL's ``logit_scale`` and ``temperature`` are ours, ``outputs``
the same names; TRL's ``chunk_size`` (the width of its vocabulary tiles) is not used: ours chunks over the tokens,
each chunk against the whole vocabulary, sized as ``fl.linear_cross_entropy``'s.

Everything else stays TRL's: the patched forward (backbone call, label shift, which positions are scored, the
autocast / ``cast_lm_head_to_fp32`` handling, FSDP2's gathered head), every trainer's loss (DPO's loss types, KTO,
GRPO's clipped objective and KL term, ...), metrics, reference models, generation.

Where the outputs differ from TRL's kernel: by rounding only (fp32 accumulation both, in other orders); heads in fp64
get fp64 outputs (TRL's kernel accumulates in fp32 whatever the input); under autocast on CPU our products run in
fp32 (``fl.linear_cross_entropy``'s rule: CPU has no fast 16-bit matmul), where TRL's round the logits to the autocast
dtype, so there the two differ by that rounding (ours is the exact one). A head in another dtype than the hidden
states outside autocast (``cast_lm_head_to_fp32=True`` upcasts the hidden states only) is cast to theirs first, as
TRL's kernel casts each tile. Under DeepSpeed ZeRO-3 the call goes to TRL's kernel (counted in :data:`fallbacks`,
logged once): its backward gathers the partitioned head again, ours would see the empty partition.

Supported: TRL 1.15.x and 1.16.x (:data:`SUPPORTED_TRL`; tested with 1.16.0, on CPU), whose ``add_fused_lm_head``
makes that call; :func:`apply` raises on other versions rather than patch a name whose call it does not know.
Needs the optional extra: ``pip install "fusedlayers[trl]"``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys

import torch

from fusedlayers import functional as _fl  # looked up at call time (tests wrap its functions)

__all__ = ["SUPPORTED_TRL", "OUTPUTS", "ChunkedLogProbFunction", "apply", "revert", "applied", "is_applied",
           "fallbacks"]

#: The TRL releases (major, minor) whose ``add_fused_lm_head`` calls ``_ChunkedLogProbFunction.apply(hidden, weight,
#: bias, labels, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)`` for five outputs (1.14
#: and before call it with other arguments, for two).
SUPPORTED_TRL = ((1, 15), (1, 16))

#: TRL's own outputs, in order; its default ``outputs`` is every one of them.
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

#: Calls passed to TRL's kernel, per reason (``zero3``).
fallbacks: collections.Counter[str] = collections.Counter()

logger = logging.getLogger(__name__)
_NAME = "_ChunkedLogProbFunction"  # the global of trl.trainer.utils that add_fused_lm_head's forward calls
# [what the global held before apply()] while applied, else []: TRL's kernel, or None (TRL 1.15 without Triton has none)
_original: list = []


def _trl_utils():
    """``trl.trainer.utils`` of a supported TRL, imported now (importing TRL takes seconds: not at our import)."""
    try:
        import trl
        from packaging.version import Version
        from trl.trainer import utils
    except ImportError as error:
        raise ImportError("fusedlayers.integrations.trl needs TRL 1.15 or 1.16: pip install \"fusedlayers[trl]\" "
                          f"({type(error).__name__}: {error})") from error
    version = getattr(trl, "__version__", "unknown")
    try:
        release = Version(version).release[:2]
    except ValueError:
        release = None
    if release not in SUPPORTED_TRL or not hasattr(utils, _NAME) or not hasattr(utils, "add_fused_lm_head"):
        supported = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_TRL)
        raise RuntimeError(f"fusedlayers.integrations.trl supports TRL {supported} (whose add_fused_lm_head calls "
                           f"_ChunkedLogProbFunction with the arguments it takes); TRL {version} is installed")
    return utils


def _zero3() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


class ChunkedLogProbFunction:
    """What :func:`apply` puts in place of TRL's ``ChunkedLogProbFunction``: its ``apply`` with ours inside."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=OUTPUTS):
        """TRL's call: hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> its five outputs, each None
        unless in ``outputs`` (log_probs always). ``chunk_size`` is TRL's vocabulary tile width: not used."""
        if _zero3() and _original and _original[0] is not None:
            _fallback("zero3", "DeepSpeed ZeRO-3 partitions the LM head; its backward needs TRL's kernel, which "
                               "gathers the head again")
            return _original[0].apply(hidden, weight, bias, targets, temperature, chunk_size,
                                      final_logit_softcapping, logit_scale, outputs)
        weight, bias = _as_hidden_dtype(hidden, weight, bias)
        return _fl.linear_log_prob_statistics(
            hidden, weight, targets, linear_bias=bias, temperature=float(temperature),
            softcap=None if final_logit_softcapping is None else float(final_logit_softcapping),
            logit_scale=float(logit_scale), outputs=tuple(outputs))


def _as_hidden_dtype(hidden, weight, bias):
    """The head in the hidden states' dtype where autocast does not choose the products' dtype: TRL's kernel casts
    each tile so (``cast_lm_head_to_fp32`` upcasts only the hidden states); ours asks for one dtype. The cast is
    differentiable: the head's gradient arrives in its own dtype, as from TRL's kernel."""
    if torch.is_autocast_enabled(hidden.device.type):
        return weight, bias
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


def _fallback(reason: str, detail: str) -> None:
    if not fallbacks[reason]:
        logger.warning("fusedlayers: %s; TRL's own kernel computes these log-probs (logged once)", detail)
    fallbacks[reason] += 1


def apply() -> None:
    """Make TRL's fused LM heads compute with ``fl.linear_log_prob_statistics`` (process-wide, idempotent). Raises
    ImportError without TRL, RuntimeError for a TRL version other than :data:`SUPPORTED_TRL`."""
    utils = _trl_utils()
    current = getattr(utils, _NAME)
    if current is ChunkedLogProbFunction:
        return
    _original[:] = [current]
    setattr(utils, _NAME, ChunkedLogProbFunction)


def revert() -> None:
    """Give TRL its kernel back (no-op when not applied). Where something replaced ours after :func:`apply`, that
    stays: it is not ours to remove."""
    if not _original:
        return
    import trl.trainer.utils as utils

    if getattr(utils, _NAME) is ChunkedLogProbFunction:
        setattr(utils, _NAME, _original[0])
    _original.clear()


def is_applied() -> bool:
    """Do TRL's fused LM heads compute with ours now?"""
    utils = sys.modules.get("trl.trainer.utils")  # not imported: TRL cannot have been patched
    return utils is not None and getattr(utils, _NAME, None) is ChunkedLogProbFunction


@contextlib.contextmanager
def applied():
    """:func:`apply` for a block; on leaving, :func:`revert` unless it was applied already on entering."""
    was_applied = is_applied()
    apply()
    try:
        yield
    finally:
        if not was_applied:
            revert()
