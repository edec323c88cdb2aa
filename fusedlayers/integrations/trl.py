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

``DPOTrainer`` and ``GRPOTrainer`` (``fltrl.DPOTrainer(...)``, TRL's arguments) go one step further: subclasses of
TRL's whose loss is :func:`fusedlayers.post_training.linear_dpo_loss` / ``linear_grpo_loss``, computed in one pass
over the head (three products per token instead of four); TRL's model call still runs (its backbone, wrappers and
hooks), only the head's work moves into the loss. Settings the fused losses do not cover run TRL's own
``_compute_loss`` (see each class).

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
        if _captured is not None:  # a fused-loss trainer's forward: it computes the loss from these itself
            _captured.append((hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale))
            return (hidden.new_zeros(hidden.shape[0], dtype=torch.float32), None, None, None, None)
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


# ----------------------------------------------------------------------------- DPOTrainer with the fused loss


_captured: list | None = None  # set while a fused trainer's forward takes the head's inputs (see _capture_head)


@contextlib.contextmanager
def _capture_head():
    """While active, the fused LM head's call records its inputs (the labelled hidden states, the head weight and
    bias, the labels, temperature, soft-cap, scale) instead of computing log-probs: the loss is then computed from
    them by ``fusedlayers.post_training`` in one pass. The model is still called as TRL calls it (through DDP, FSDP
    or PEFT wrappers, whose hooks run), only the head's work moves."""
    global _captured
    _captured = []
    try:
        yield _captured
    finally:
        _captured = None


def _head_transform(captured) -> dict:
    """The logit transform TRL's fused head was called with (``final_logit_softcapping`` and ``logit_scale``, which
    TRL reads from the model's config: Gemma's cap, Cohere's and Granite's scales) as the losses' keywords."""
    *_, softcap, logit_scale = captured
    return {"logit_scale": float(logit_scale), "softcap": None if softcap is None else float(softcap)}


def dpo_trainer_class():
    """``trl.DPOTrainer`` with its loss computed by :func:`fusedlayers.post_training.linear_dpo_loss` (a class made on
    first use, so that importing this module does not import TRL's trainers)."""
    global _DPOTrainer
    if _DPOTrainer is None:
        _DPOTrainer = _make_dpo_trainer()
    return _DPOTrainer


_DPOTrainer = None


def _make_dpo_trainer():
    import trl
    from trl.models.utils import disable_gradient_checkpointing

    from fusedlayers import post_training

    class DPOTrainer(trl.DPOTrainer):
        """TRL's ``DPOTrainer`` whose DPO loss runs fused with the LM head (``linear_dpo_loss``): the policy's
        log-probs, the loss and its gradients in one pass over chunks of pairs, three head products per token
        instead of TRL's four. Same arguments, same loss and logged metrics as TRL's (tested against it); any setting
        the fused loss does not cover (f-divergences other than reverse KL, WPO weighting, ``ld_alpha``, MoE router
        losses, PEFT without a reference model, the aot losses, DeepSpeed
        ZeRO-3, whose head is gathered only inside the model's call) runs TRL's own ``_compute_loss``."""

        def __init__(self, *args, **kwargs):
            apply()
            super().__init__(*args, **kwargs)

        def _fused_loss_applies(self) -> bool:
            return (self.f_divergence_type == "reverse_kl" and self.ld_alpha is None and not self.use_weighting
                    and not self.aux_loss_enabled and all(t in post_training.DPO_LOSS_TYPES for t in self.loss_types)
                    and (self.precompute_ref_logps or self.ref_model is not None) and not _zero3())

        def _compute_loss(self, model, inputs, return_outputs):
            if return_outputs or not self._fused_loss_applies():
                return super()._compute_loss(model, inputs, return_outputs)
            mode = "train" if self.model.training else "eval"
            completion_mask = inputs["completion_mask"]
            labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
            model_kwargs = {k: v for k, v in inputs.items()
                            if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")}
            model_kwargs["use_cache"] = False
            with _capture_head() as captured:
                model(**model_kwargs, labels=labels, fused_lm_head=True)
            hidden_rows, weight, bias, _, temperature, *_ = captured[-1]
            target = labels[:, 1:].to(weight.device)
            mask = target != -100
            # TRL's head gets every position (devices without Triton) or the labelled ones only: back at their
            # positions either way (the loss gathers its own rows, by pairs)
            if hidden_rows.shape[0] == mask.numel():
                hidden = hidden_rows.reshape(*mask.shape, -1)
            else:
                hidden = hidden_rows.new_zeros(*mask.shape, hidden_rows.shape[-1]).masked_scatter(
                    mask[..., None], hidden_rows)
            if self.precompute_ref_logps:
                ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
            else:
                with torch.no_grad(), disable_gradient_checkpointing(self.model,
                                                                     self.args.gradient_checkpointing_kwargs):
                    ref_outputs = self.ref_model(**model_kwargs, labels=labels, fused_lm_head=True)
                ref = ref_outputs.log_probs[:, -target.shape[1]:].sum(1)
            loss, m = post_training.linear_dpo_loss(
                hidden, weight, target, ref_log_probs=ref.to(weight.device), linear_bias=bias, beta=self.beta,
                loss_type=self.loss_types, loss_weights=self.loss_weights, label_smoothing=self.label_smoothing,
                discopop_tau=self.args.discopop_tau, temperature=temperature, token_statistics=True,
                **_head_transform(captured[-1]))
            self._log_dpo_metrics(mode, inputs, mask, m)
            return loss

        def _log_dpo_metrics(self, mode, inputs, mask, m):
            """The metrics DPOTrainer._compute_loss logs, from the fused loss's values (the same reductions)."""
            gather = self.accelerator.gather_for_metrics
            metrics = self._metrics[mode]
            tokens = gather(mask.sum()).sum()
            metrics["entropy"].append((gather((m["entropy"] * mask).sum()).sum() / tokens).item()
                                      if tokens > 0 else 0.0)
            if mode == "train":
                num_tokens_in_batch = gather(inputs["attention_mask"].sum()).sum().item()
                self._total_train_tokens += num_tokens_in_batch // self._tp_size
            metrics["num_tokens"] = [self._total_train_tokens]
            chosen_mask, rejected_mask = mask.chunk(2, dim=0)
            chosen_logits, rejected_logits = m["mean_logits"].chunk(2, dim=0)
            for name, logits, part in (("chosen", chosen_logits, chosen_mask), ("rejected", rejected_logits,
                                                                                rejected_mask)):
                total = gather(logits[part].sum()).sum().item()
                count = gather(part.sum()).sum().item()
                metrics[f"logits/{name}"].append(total / count if count > 0 else 0.0)
            chosen_top1 = m["is_top1"].chunk(2, dim=0)[0]
            correct = gather((chosen_top1 & chosen_mask).sum())
            total = gather(chosen_mask.sum()).sum()
            metrics["mean_token_accuracy"].append((correct.sum() / total).item() if total > 0 else 0.0)
            gather_all = self.accelerator.gather
            metrics["rewards/chosen"].append(gather_all(m["chosen_rewards"]).mean().item())
            metrics["rewards/rejected"].append(gather_all(m["rejected_rewards"]).mean().item())
            metrics["rewards/accuracies"].append(gather_all(m["reward_accuracies"]).mean().item())
            metrics["rewards/margins"].append(gather_all(m["reward_margins"]).mean().item())
            metrics["logps/chosen"].append(gather_all(m["chosen_logps"]).mean().item())
            metrics["logps/rejected"].append(gather_all(m["rejected_logps"]).mean().item())

    return DPOTrainer




# ----------------------------------------------------------------------------- GRPOTrainer with the fused loss


def grpo_trainer_class():
    """``trl.GRPOTrainer`` with its loss computed by :func:`fusedlayers.post_training.linear_grpo_loss`."""
    global _GRPOTrainer
    if _GRPOTrainer is None:
        _GRPOTrainer = _make_grpo_trainer()
    return _GRPOTrainer


_GRPOTrainer = None
_GRPO_MODEL_INPUTS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                      "old_per_token_logps", "ref_per_token_logps", "num_items_in_batch")


def _make_grpo_trainer():
    import trl
    from trl.trainer.utils import nanmax, nanmin

    from fusedlayers import post_training

    class GRPOTrainer(trl.GRPOTrainer):
        """TRL's ``GRPOTrainer`` whose policy loss runs fused with the LM head (``linear_grpo_loss``): the
        log-probs, the clipped objective, the KL term and their gradients in one pass over chunks of sequences
        (three head products per token instead of TRL's four). Same arguments, loss and logged metrics as TRL's
        (tested against it); settings the fused loss does not cover (sapo and vespo losses, the entropy mask and
        bonus, off-policy masking, vLLM importance-sampling correction, tool masks, MoE
        router losses, vision inputs, DeepSpeed ZeRO-3) run TRL's own
        ``_compute_loss``."""

        def __init__(self, *args, **kwargs):
            apply()
            super().__init__(*args, **kwargs)

        def _fused_loss_applies(self, inputs) -> bool:
            return (self.loss_type in post_training.GRPO_LOSS_TYPES and self.top_entropy_quantile >= 1.0
                    and self.off_policy_mask_threshold is None and not self._entropy_bonus_enabled
                    and not (self.use_vllm and self.vllm_importance_sampling_correction)
                    and not self.aux_loss_enabled
                    and set(inputs) <= set(_GRPO_MODEL_INPUTS) and not _zero3())

        def _compute_loss(self, model, inputs):
            if not self._fused_loss_applies(inputs):
                return super()._compute_loss(model, inputs)
            mode = "train" if self.model.training else "eval"
            completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], mask], dim=1)
            keep = completion_ids.size(1)
            labels = input_ids.masked_fill(attention_mask == 0, -100)  # as _get_per_token_logps_and_entropies
            labels[:, :-keep] = -100
            with self.accelerator.autocast(), _capture_head() as captured:
                model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
            hidden_rows, weight, bias, _, temperature, *_ = captured[-1]
            scored = labels[:, 1:].to(weight.device) != -100
            if hidden_rows.shape[0] == scored.numel():
                hidden = hidden_rows.reshape(*scored.shape, -1)
            else:
                hidden = hidden_rows.new_zeros(*scored.shape, hidden_rows.shape[-1]).masked_scatter(
                    scored[..., None], hidden_rows)
            hidden = hidden[:, -keep:]
            target = completion_ids.masked_fill(mask == 0, -100).to(weight.device)
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            num_items = None
            if self.loss_type in ("dapo", "cispo"):  # TRL's normalizer: the tokens of the whole accumulated batch
                num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
                if mode == "train":
                    num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            with self.accelerator.autocast():
                loss, m = post_training.linear_grpo_loss(
                    hidden, weight, target, inputs["advantages"], old_log_probs=inputs.get("old_per_token_logps"),
                    ref_log_probs=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
                    linear_bias=bias, beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                    delta=self.args.delta, loss_type=self.loss_type,
                    kl_bias_correction=self.args.use_bias_correction_kl,
                    importance_sampling_level=self.importance_sampling_level,
                    max_completion_length=self.max_completion_length, num_items_in_batch=num_items,
                    temperature=temperature, token_statistics=True, **_head_transform(captured[-1]))
            if self.loss_type not in ("dapo", "cispo"):  # TRL divides these by the accumulation steps
                loss = loss / accumulation
            self._log_grpo_metrics(mode, mask, inputs["advantages"], m)
            return loss

        def _log_grpo_metrics(self, mode, mask, advantages, m):
            """The metrics GRPOTrainer._compute_loss logs, from the fused loss's per-token values (its code)."""
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            metrics = self._metrics[mode]

            def masked_seq_mean(x):
                if x.shape[1] == 1:
                    return x.squeeze(1)
                return (x * mask).sum(-1) / mask.sum(-1)

            def global_masked_mean(x):
                if x.shape[1] == 1:
                    local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
                else:
                    local_sum, local_count = (x * mask).sum(), mask.sum().float()
                totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
                return (totals[0] / totals[1].clamp(min=1.0)).item()

            if self.beta != 0.0:
                metrics["kl"].append(global_masked_mean(m["per_token_kl"]))
            metrics["entropy"].append(global_masked_mean(m["per_token_entropy"]))
            coef_1 = m["coef_1"]
            if self.loss_type == "cispo":
                clipped = (coef_1 > self.epsilon_high) & (advantages > 0)
                metrics["cispo_clip_ratio"].append(global_masked_mean(clipped.float()))
                return
            low = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
            high = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
            metrics["clip_ratio/low_mean"].append(global_masked_mean(low.float()))
            metrics["clip_ratio/high_mean"].append(global_masked_mean(high.float()))
            metrics["clip_ratio/region_mean"].append(global_masked_mean((low | high).float()))
            metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low.float()))).item())
            metrics["clip_ratio/high_max"].append(
                nanmax(self.accelerator.gather(masked_seq_mean(high.float()))).item())

    return GRPOTrainer


def __getattr__(name: str):
    if name == "DPOTrainer":  # made on first use: importing TRL's trainers takes seconds
        return dpo_trainer_class()
    if name == "GRPOTrainer":
        return grpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
