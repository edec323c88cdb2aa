"""fusedlayers.post_training: parity with TRL 1.16's own loss code, fed the same hidden states.

The reference for each loss is TRL's code, not a re-derivation: the trainers' loss methods run on stub trainers
(``object.__new__(Trainer)`` with only the attributes the method reads) whose model is ``_LM``, a stub that answers
TRL's fused-head call ``model(..., labels=..., fused_lm_head=True)`` from FULL logits (``F.linear`` then
``log_softmax``) -- so TRL's loss code runs on exact log-probs, and its backward gives the gradients of the same
hidden states and head weight that ours are compared with:

- DPO: ``DPOTrainer._compute_loss`` (and ``compute_ref_log_probs`` for ``precompute_ref_log_probs``);
- KTO: ``KTOTrainer._compute_loss`` (its ``_compute_kl_logps`` on the stub: the KL reference point);
- GRPO: ``GRPOTrainer._compute_loss`` (its ``_get_per_token_logps_and_entropies`` on the stub);
- ORPO / CPO / SimPO: ``get_batch_loss_metrics`` of ``trl.experimental``'s ``ORPOTrainer`` / ``CPOTrainer``, whose
  ``concatenated_forward`` (the NLL term, ``get_batch_logps``) calls the stub's plain forward for the logits;
- generalized JSD: ``GKDTrainer.generalized_jsd_loss`` on full student and teacher logits.

Compared: the loss, the gradients of the hidden states and the head weight, and the metrics TRL logs (ours
reduced as the trainer reduces them, under TRL's names). fp64 to rounding (TRL's fp64 run is the reference), fp32 by
the project's parity rule (tests/parity.py: TRL in fp32 is the stock result, TRL in fp64 the reference). TRL's fp64
runs use float64 as the default dtype (TRL makes some constants with ``torch.tensor(x)``) and keep ORPO's log-probs
fp64 (its ``odds_ratio_loss`` casts them to fp32). Each batch has a sequence with no labelled token; others have no
labelled token at all. A few fp32 cases also run the Triton kernels (under the interpreter on CPU); chunking, the
modules and the argument checks are tested against our own functions.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import fusedlayers as fl
from fusedlayers import post_training as flp
from tests.conftest import INTERPRETER
from tests.parity import FLOOR, assert_parity, loss_floor

VOCAB, HIDDEN, TEACHER_HIDDEN = 37, 16, 24
DTYPES = [torch.float64, torch.float32]
TRITON = pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (CPU runs)")
BACKENDS = ["reference", pytest.param("triton", marks=TRITON)]
GRAD = ("hidden", "weight")  # the leaves whose gradients are compared (the policy's / student's)
# Metrics that are fractions of counts (k / n): one flag more or less is 1 / n off, far above fp32 rounding.
COUNT_RATIOS = {"rewards/accuracies", "mean_token_accuracy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "cispo_clip_ratio"}


def _trl(module: str, name: str):
    """A TRL object (the test is skipped without TRL 1.16+: its trainers' internals are what is compared)."""
    pytest.importorskip("trl", minversion="1.16")
    return getattr(pytest.importorskip(module), name)


# ----------------------------------------------------------------------------- TRL stubs


class _Accelerator:
    """What the trainers' loss code calls on ``accelerate.Accelerator``: one CPU process."""

    device = torch.device("cpu")
    num_processes = 1
    is_main_process = True
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return contextlib.nullcontext()

    def unwrap_model(self, model):
        return model


class _LM(torch.nn.Module):
    """A causal LM whose backbone output for a batch of ``input_ids`` is a given (S, L, H) tensor (looked up by
    value among ``sequences``), with the head ``weight``. ``fused_lm_head=True`` answers as TRL's
    ``add_fused_lm_head`` forward (hidden[:, :-1] against labels[:, 1:], every field 0 where the label is -100),
    computed from the full logits; otherwise it returns the logits, as the original forward. ``transform``: the
    (logit_scale, softcap) a model applies to its head's output (Cohere's scale, Gemma 2's cap)."""

    def __init__(self, weight, sequences, temperature=1.0, transform=(1.0, None)):
        super().__init__()
        self.weight, self.sequences, self.temperature, self.transform = weight, sequences, temperature, transform
        self.is_gradient_checkpointing = False  # read by trl's disable_gradient_checkpointing

    def _logits(self, hidden):
        logits = F.linear(hidden, self.weight) * self.transform[0]
        cap = self.transform[1]
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids, attention_mask=None, labels=None, fused_lm_head=False, use_cache=None):
        hidden = next(h for ids, h in self.sequences if ids.shape == input_ids.shape and torch.equal(ids, input_ids))
        if not fused_lm_head:
            return SimpleNamespace(logits=self._logits(hidden))
        logits = self._logits(hidden[:, :-1]) / self.temperature
        labels = labels[:, 1:]
        mask = labels != -100
        log_p = logits.log_softmax(-1)
        log_probs = log_p.gather(-1, labels.where(mask, 0)[..., None]).squeeze(-1).masked_fill(~mask, 0)
        entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(~mask, 0)
        output = _trl("trl.trainer.utils", "FusedCausalLMOutput")
        return output(loss=-log_probs.sum() / mask.sum().clamp(min=1), log_probs=log_probs, entropy=entropy,
                      mean_logits=logits.mean(-1).masked_fill(~mask, 0).detach(),
                      is_top1=(logits.argmax(-1) == labels) & mask, label_mask=mask)


def _trainer(cls, **attributes):
    """A trainer of class ``cls`` without its __init__: the attributes its loss methods read."""
    trainer = object.__new__(cls)
    defaults = dict(accelerator=_Accelerator(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                    _total_train_tokens=0, _tp_size=1, aux_loss_enabled=False)
    for name, value in {**defaults, **attributes}.items():
        setattr(trainer, name, value)
    return trainer


def _logged(trainer) -> dict[str, float]:
    """The metrics the trainer's loss method just logged."""
    return {k: v[-1] for k, v in trainer._metrics["train"].items()}


@contextlib.contextmanager
def _default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _fp64_stays_fp64():
    """ORPO's ``odds_ratio_loss`` casts the log-probs to fp32 (``.float()``) whatever their dtype; for the fp64
    reference that cast leaves fp64 tensors as they are (TRL's arithmetic, in fp64)."""
    float_ = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else float_(self, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.float = float_


# ----------------------------------------------------------------------------- the comparison


def _run(fn, data, dtype):
    """fn(**data) with the floating tensors in ``dtype`` (those named in GRAD as leaves requiring grad) -> loss,
    metrics (in ``dtype``) and the gradients of the GRAD leaves after loss.backward()."""
    tensors = {k: v.to(dtype).requires_grad_(k in GRAD) if v is not None and v.is_floating_point() else v
               for k, v in data.items()}
    loss, metrics = fn(**tensors)
    loss.backward()
    metrics = {k: torch.as_tensor(v, dtype=dtype).detach() for k, v in metrics.items()}
    return loss.detach(), metrics, {k: tensors[k].grad for k in GRAD}


def _check(case, dtype, backend="reference", labelled=True):
    """``case`` = (ours, theirs, data): our loss, metrics (each under the name TRL logs it) and gradients vs TRL's
    in ``dtype`` vs TRL's in fp64 (for fp64 these are the reference itself: ours must equal them to rounding).
    Returns the reference's metrics."""
    ours, theirs, data = case
    with fl.use_backend(backend):
        f_loss, f_metrics, f_grads = _run(ours, data, dtype)
    with _default_dtype(dtype):
        stock = _run(theirs, data, dtype)
    reference = stock
    if dtype != torch.float64:
        with _default_dtype(torch.float64):
            reference = _run(theirs, data, torch.float64)
    (s_loss, s_metrics, s_grads), (r_loss, r_metrics, r_grads) = stock, reference
    assert f_loss.dtype == s_loss.dtype == dtype
    assert_parity(f_loss, s_loss, r_loss, "loss", floor=loss_floor(f_loss, r_loss))
    assert f_metrics and set(f_metrics) <= set(s_metrics), f"TRL logs no {sorted(set(f_metrics) - set(s_metrics))}"
    for name, value in f_metrics.items():
        floor = loss_floor(value, r_metrics[name])
        if name in COUNT_RATIOS:  # TRL's are fp32 (flags.float()), or the default dtype's: equal to fp32 rounding
            floor = max(floor, FLOOR[torch.float32])
        assert_parity(value, s_metrics[name], r_metrics[name], name, floor=floor)
    for name in GRAD:
        assert f_grads[name].dtype == dtype
        assert (f_grads[name].abs().max() > 0) == labelled, f"grad {name}: zero iff no token is labelled"
        assert_parity(f_grads[name], s_grads[name], r_grads[name], f"grad {name}")
    return r_metrics


def _id(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "defaults"
    if isinstance(value, tuple):  # DPO's (loss types, weights)
        return "+".join(value[0])
    return str(value)


# ----------------------------------------------------------------------------- batches


def _tokens(prompt_lens, completion_lens):
    """TRL's right-padded batch (prompt then completion then padding): input_ids, attention_mask,
    completion_mask."""
    p, c = torch.tensor(prompt_lens), torch.tensor(completion_lens)
    pos = torch.arange(int((p + c).max()))
    attention = pos < (p + c)[:, None]
    completion = (pos >= p[:, None]) & attention
    ids = torch.randint(1, VOCAB, attention.shape).where(attention, 0)
    return {"input_ids": ids, "attention_mask": attention.long(), "completion_mask": completion.long()}


def _heads(n_seq, length):
    """Policy and reference hidden states (n_seq, length, H) and heads (V, H); the reference is sharper, so that
    the log-ratios are mostly positive (KTO's KL estimate is then above its clamp at 0)."""
    return {"hidden": torch.randn(n_seq, length, HIDDEN, dtype=torch.float64),
            "weight": torch.randn(VOCAB, HIDDEN, dtype=torch.float64) / HIDDEN**0.5 * 2,
            "ref_hidden": torch.randn(n_seq, length, HIDDEN, dtype=torch.float64),
            "ref_weight": torch.randn(VOCAB, HIDDEN, dtype=torch.float64) / HIDDEN**0.5 * 3}


def _shifted_labels(input_ids, completion_mask):
    """Our target: TRL's labels (input_ids, -100 off the completion) at the positions that predict them."""
    return input_ids.masked_fill(completion_mask == 0, -100)[:, 1:]


def _ref(precompute, ref_hidden, ref_weight, target, temperature=1.0, per_sequence=True):
    """Our reference: log-probs computed beforehand (fl.linear_log_probs; per sequence for the preference
    losses), or its hidden states and head."""
    if not precompute:
        return {"ref_input": ref_hidden, "ref_linear_weight": ref_weight}
    log_probs = fl.linear_log_probs(ref_hidden, ref_weight, target, temperature=temperature)
    return {"ref_log_probs": log_probs.sum(-1) if per_sequence else log_probs}


# Three pairs (chosen then rejected) with prompts of 1-3 tokens; the second chosen completion has one token, the
# second rejected one none.
PROMPTS, COMPLETIONS = [2, 1, 3, 2, 2, 1], [4, 1, 5, 3, 0, 4]
# The reference-free losses average over each completion: every one has a token.
REF_FREE_COMPLETIONS = [4, 3, 5, 3, 1, 4]
EMPTY = [0] * 6


def _sequence_data(prompts=PROMPTS, completions=COMPLETIONS):
    tokens = _tokens(prompts, completions)
    heads = _heads(*tokens["input_ids"].shape)
    # every third completion token is the policy's most likely one (TRL's token accuracy is then not 0)
    top1 = F.linear(heads["hidden"][:, :-1], heads["weight"]).argmax(-1)
    pick = tokens["completion_mask"][:, 1:].bool() & (torch.arange(top1.shape[1]) % 3 == 0)
    tokens["input_ids"][:, 1:][pick] = top1[pick]
    return {**heads, **tokens}


# ----------------------------------------------------------------------------- DPO

DPO_CASES = [*flp.DPO_LOSS_TYPES, (["sigmoid", "sft"], [1.0, 0.5]), (["hinge", "ipo", "apo_zero"], [0.3, 1.0, 2.0])]


def _dpo(loss_type, precompute, beta=0.1, label_smoothing=None, discopop_tau=0.05, completions=COMPLETIONS,
         token_statistics=True, chunk_size=5, transform=(1.0, None)):
    """DPOTrainer._compute_loss (reverse KL, TRL's defaults otherwise) vs linear_dpo_loss (with
    ``token_statistics``, also the entropy, mean logits and token accuracy TRL logs)."""
    DPOTrainer = _trl("trl.trainer.dpo_trainer", "DPOTrainer")
    types, weights = ([loss_type], None) if isinstance(loss_type, str) else loss_type
    if label_smoothing is None:  # robust's flip probability, EXO's epsilon (which must be > 0)
        label_smoothing = 0.1 if {"robust", "exo_pair"} & set(types) else 0.0

    def theirs(hidden, weight, ref_hidden, ref_weight, **inputs):
        model = _LM(weight, [(inputs["input_ids"], hidden)], transform=transform)
        ref_model = _LM(ref_weight, [(inputs["input_ids"], ref_hidden)], transform=transform)
        trainer = _trainer(
            DPOTrainer, beta=beta, loss_types=types, loss_weights=weights or [1.0] * len(types),
            f_divergence_type="reverse_kl", ld_alpha=None, precompute_ref_logps=precompute, use_weighting=False,
            label_smoothing=label_smoothing, model=model, ref_model=None if precompute else ref_model,
            args=SimpleNamespace(discopop_tau=discopop_tau, gradient_checkpointing_kwargs=None))
        if precompute:  # what TRL stores in the dataset before training
            inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = trainer.compute_ref_log_probs(ref_model, inputs)
        return trainer._compute_loss(model, inputs, return_outputs=False), _logged(trainer)

    def ours(hidden, weight, ref_hidden, ref_weight, input_ids, attention_mask, completion_mask):
        target = _shifted_labels(input_ids, completion_mask)
        loss, m = flp.linear_dpo_loss(hidden[:, :-1], weight, target, beta=beta,
                                      loss_type=loss_type if weights is None else types, loss_weights=weights,
                                      label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                                      token_statistics=token_statistics, chunk_size=chunk_size,
                                      logit_scale=transform[0], softcap=transform[1],
                                      **_ref(precompute, ref_hidden[:, :-1], ref_weight, target))
        metrics = {"rewards/chosen": m["chosen_rewards"].mean(), "rewards/rejected": m["rejected_rewards"].mean(),
                   "rewards/accuracies": m["reward_accuracies"].mean(), "rewards/margins": m["reward_margins"].mean(),
                   "logps/chosen": m["chosen_logps"].mean(), "logps/rejected": m["rejected_logps"].mean()}
        if token_statistics:  # per token (S, T): reduced as DPOTrainer does (over all tokens, the chosen, ...)
            mask = target != -100
            chosen = torch.zeros_like(mask)
            chosen[: len(mask) // 2] = True
            n, n_chosen, n_rejected = (v.sum().clamp(min=1) for v in (mask, mask & chosen, mask & ~chosen))
            metrics |= {"entropy": m["entropy"][mask].sum() / n,
                        "logits/chosen": m["mean_logits"][mask & chosen].sum() / n_chosen,
                        "logits/rejected": m["mean_logits"][mask & ~chosen].sum() / n_rejected,
                        "mean_token_accuracy": m["is_top1"][mask & chosen].sum() / n_chosen}
            assert not m["entropy"][~mask].any() and not m["is_top1"][~mask].any()  # 0 at the ignored tokens
        return loss, metrics

    return ours, theirs, _sequence_data(completions=completions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precompute", [False, True], ids=["ref_model", "precomputed"])
@pytest.mark.parametrize("loss_type", DPO_CASES, ids=_id)
def test_dpo_equals_trl(loss_type, precompute, dtype):
    # the token statistics with a reference head, without them with precomputed reference log-probs
    metrics = _check(_dpo(loss_type, precompute, token_statistics=not precompute), dtype)
    assert 0 < metrics["mean_token_accuracy"] < 1 and 0 < metrics["rewards/accuracies"] < 1


@pytest.mark.parametrize("loss_type, hyper", [
    ("robust", dict(beta=0.3, label_smoothing=0.25)), ("exo_pair", dict(beta=0.05, label_smoothing=1e-3)),
    # TRL 1.16's "sigmoid" reads no label smoothing (a list with "robust" shares it)
    ((["sigmoid", "robust"], [1.0, 0.5]), dict(label_smoothing=0.1)), ("sigmoid", dict(label_smoothing=0.2)),
    ("discopop", dict(beta=0.5, discopop_tau=0.2)), ("ipo", dict(beta=0.5)), ("sppo_hard", dict(beta=1.0)),
], ids=_id)
def test_dpo_hyperparameters_equal_trl(loss_type, hyper):
    _check(_dpo(loss_type, False, **hyper), torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transform", [(0.3, None), (1.0, 0.5), (2.0, 1.5)], ids=["scale", "softcap", "both"])
def test_dpo_of_scaled_or_soft_capped_logits_equals_trl(transform, dtype):
    """Models that scale or soft-cap their logits (TRL's ``logit_scale``, ``final_logit_softcapping``): policy and
    reference heads through the same transform, the token statistics of the transformed logits."""
    _check(_dpo("sigmoid", False, transform=transform), dtype)


# ----------------------------------------------------------------------------- KTO

KTO_LABELS = [True, False, True, True, False, False]  # sequence 4 (undesirable) has an empty completion


def _kto(loss_type, weights, precompute, label=KTO_LABELS, beta=0.1, completions=COMPLETIONS, kl_ref_scale=1.0,
         chunk_size=5):
    """KTOTrainer._compute_loss (with its _compute_kl_logps for "kto") vs linear_kto_loss. ``kl_ref_scale`` scales
    the reference's hidden states of the KL completions (small: a flat reference, a negative KL estimate)."""
    KTOTrainer = _trl("trl.trainer.kto_trainer", "KTOTrainer")
    calculate_kl = loss_type == "kto"  # as KTOTrainer: apo_zero_unpaired has no reference point
    kl_tokens = _tokens([1, 2, 2, 3, 1, 2], [3, 5, 2, 4, 4, 1])  # the mismatched completions of the KL estimate
    kl_shape = (*kl_tokens["input_ids"].shape, HIDDEN)
    data = {**_sequence_data(completions=completions), "label": torch.tensor(label),
            "kl_hidden": torch.randn(kl_shape, dtype=torch.float64),
            "ref_kl_hidden": torch.randn(kl_shape, dtype=torch.float64) * kl_ref_scale,
            **{f"KL_{k}": v for k, v in kl_tokens.items()}}

    def theirs(hidden, weight, ref_hidden, ref_weight, kl_hidden, ref_kl_hidden, **batch):
        model = _LM(weight, [(batch["input_ids"], hidden), (batch["KL_input_ids"], kl_hidden)])
        ref_model = _LM(ref_weight, [(batch["input_ids"], ref_hidden), (batch["KL_input_ids"], ref_kl_hidden)])
        trainer = _trainer(KTOTrainer, beta=beta, precompute_ref_logps=precompute, loss_type=loss_type,
                           desirable_weight=weights[0], undesirable_weight=weights[1], calculate_KL=calculate_kl,
                           model=model, ref_model=None if precompute else ref_model,
                           args=SimpleNamespace(gradient_checkpointing_kwargs=None))
        if precompute:
            batch["ref_logps"], batch["ref_KL_logps"] = trainer.compute_ref_log_probs(ref_model, batch)
        return trainer._compute_loss(model, batch, return_outputs=False), _logged(trainer)

    def ours(hidden, weight, ref_hidden, ref_weight, kl_hidden, ref_kl_hidden, label, **batch):
        target = _shifted_labels(batch["input_ids"], batch["completion_mask"])
        kl_target = _shifted_labels(batch["KL_input_ids"], batch["KL_completion_mask"])
        kl = {}
        if calculate_kl:  # per-sequence log-probs of the KL completions, policy (no gradient) and reference
            kl = {"kl_log_probs": fl.linear_log_probs(kl_hidden[:, :-1], weight.detach(), kl_target).sum(-1),
                  "ref_kl_log_probs": fl.linear_log_probs(ref_kl_hidden[:, :-1], ref_weight, kl_target).sum(-1)}
        loss, m = flp.linear_kto_loss(hidden[:, :-1], weight, target, label, beta=beta, loss_type=loss_type,
                                      desirable_weight=weights[0], undesirable_weight=weights[1],
                                      chunk_size=chunk_size, **kl,
                                      **_ref(precompute, ref_hidden[:, :-1], ref_weight, target))
        metrics = {"kl": m["kl"]}
        if label.any():
            metrics |= {"rewards/chosen": m["chosen_rewards"].mean(), "logps/chosen": m["logps"][label].mean()}
        if not label.all():
            metrics |= {"rewards/rejected": m["rejected_rewards"].mean(), "logps/rejected": m["logps"][~label].mean()}
        if label.any() and not label.all():
            metrics["rewards/margins"] = m["chosen_rewards"].mean() - m["rejected_rewards"].mean()
        return loss, metrics

    return ours, theirs, data


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precompute", [False, True], ids=["ref_model", "precomputed"])
@pytest.mark.parametrize("loss_type, weights", [("kto", (1.0, 1.0)), ("kto", (1.33, 0.7)),
                                                ("apo_zero_unpaired", (1.0, 1.0)), ("apo_zero_unpaired", (0.5, 2.0))])
def test_kto_equals_trl(loss_type, weights, precompute, dtype):
    metrics = _check(_kto(loss_type, weights, precompute), dtype)
    if loss_type == "kto":  # the reference point is exercised (not clamped to 0)
        assert metrics["kl"] > 0


def test_kto_negative_kl_estimate_is_clamped_as_trl():
    metrics = _check(_kto("kto", (1.0, 1.0), False, kl_ref_scale=0.05), torch.float64)
    assert metrics["kl"] == 0  # clamped (the estimate is negative)


@pytest.mark.parametrize("label", [[True] * 6, [False] * 6], ids=["desirable", "undesirable"])
def test_kto_one_kind_only_equals_trl(label):
    _check(_kto("kto", (1.5, 0.75), False, label=label), torch.float64)


# ----------------------------------------------------------------------------- GRPO

GRPO_SETTINGS = {
    # beta 0, the sampling policy's log-probs given, asymmetric clipping
    "old": dict(beta=0.0, old=True, epsilon_low=0.1, epsilon_high=0.35),
    # the KL term (reference log-probs precomputed), no old log-probs (the ratio is 1), a temperature
    "kl-precomputed": dict(beta=0.04, old=False, ref="precomputed", temperature=0.7),
    # the KL term (reference head), old log-probs, two-sided clipping (delta), a temperature
    "kl-ref-delta": dict(beta=0.1, old=True, ref="model", delta=1.3, epsilon_low=0.15, temperature=1.3),
}


def _grpo(loss_type, level, setting, completions=(4, 6, 0, 5, 2), chunk_size=5, transform=(1.0, None)):
    """GRPOTrainer._compute_loss (its _get_per_token_logps_and_entropies on the stub) vs linear_grpo_loss. The batch
    as TRL's: left-padded prompts, right-padded completions (the third one empty), the advantages, the sampling
    policy's per-token log-probs (the current ones, perturbed), and the reference's (its generation step's)."""
    GRPOTrainer = _trl("trl.trainer.grpo_trainer", "GRPOTrainer")
    s = {"epsilon_low": 0.2, "epsilon_high": 0.2, "delta": None, "temperature": 1.0, "ref": None, **setting}
    if loss_type == "cispo":  # CISPO's epsilon_high caps the ratio itself
        s["epsilon_high"] = 1.1
    prompts, completions = torch.tensor([2, 3, 1, 3, 2]), torch.tensor(completions)
    n, p, c = len(prompts), int(prompts.max()), 6
    prompt_mask = torch.arange(p) >= p - prompts[:, None]
    completion_mask = torch.arange(c) < completions[:, None]
    data = {**_heads(n, p + c),
            "prompt_ids": torch.randint(1, VOCAB, (n, p)).where(prompt_mask, 0), "prompt_mask": prompt_mask.long(),
            "completion_ids": torch.randint(1, VOCAB, (n, c)).where(completion_mask, 0),
            "completion_mask": completion_mask.long(),
            "advantages": torch.tensor([1.2, -0.7, 0.3, 0.9, -1.5], dtype=torch.float64)}
    completion = slice(p - 1, -1)  # the positions that predict the completion's tokens
    if s["old"]:
        target = data["completion_ids"].masked_fill(~completion_mask, -100)
        logits = F.linear(data["hidden"][:, completion], data["weight"]) / s["temperature"]
        current = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
        # per-token noise, and per-sequence shifts so that sequence-level ratios are clipped on both sides too
        shift = torch.tensor([-0.2, 0.4, 0.0, -0.5, -0.5], dtype=torch.float64)[:, None]
        data["old_per_token_logps"] = (current + 0.3 * torch.randn_like(current) + shift).masked_fill(
            ~completion_mask, 0)
    num_items = int(completions.sum()) + 5  # "dapo", "cispo": the generation batch's count (several micro-batches)
    max_completion_length = c + 2  # "dr_grpo"'s constant

    def theirs(hidden, weight, ref_hidden, ref_weight, **inputs):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        model = _LM(weight, [(input_ids, hidden)], s["temperature"], transform)
        trainer = _trainer(
            GRPOTrainer, loss_type=loss_type, beta=s["beta"], epsilon_low=s["epsilon_low"],
            epsilon_high=s["epsilon_high"], importance_sampling_level=level, top_entropy_quantile=1.0,
            off_policy_mask_threshold=None, use_vllm=False, _entropy_bonus_enabled=False,
            current_gradient_accumulation_steps=1, max_completion_length=max_completion_length, model=model,
            args=SimpleNamespace(delta=s["delta"], use_bias_correction_kl=False, steps_per_generation=1,
                                 report_to=[]),
            state=SimpleNamespace(global_step=0))  # (read by TRL's profiling decorator)
        inputs["num_items_in_batch"] = torch.tensor(num_items)
        if s["beta"]:  # as TRL's generation step computes them
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                    _LM(ref_weight, [(input_ids, ref_hidden)], s["temperature"], transform), input_ids, attention_mask,
                    inputs["completion_ids"].shape[1])[0]
        return trainer._compute_loss(model, inputs), _logged(trainer)

    def ours(hidden, weight, ref_hidden, ref_weight, prompt_ids, prompt_mask, completion_ids, completion_mask,
             advantages, old_per_token_logps=None):
        target = completion_ids.masked_fill(completion_mask == 0, -100)
        ref = {}
        if s["ref"]:
            ref = _ref(s["ref"] == "precomputed", ref_hidden[:, completion], ref_weight, target, s["temperature"],
                       per_sequence=False)
        loss, m = flp.linear_grpo_loss(
            hidden[:, completion], weight, target, advantages, old_log_probs=old_per_token_logps, beta=s["beta"],
            epsilon_low=s["epsilon_low"], epsilon_high=s["epsilon_high"], delta=s["delta"], loss_type=loss_type,
            importance_sampling_level=level, max_completion_length=max_completion_length,
            num_items_in_batch=num_items, temperature=s["temperature"], chunk_size=chunk_size, logit_scale=transform[0],
            softcap=transform[1], **ref)
        metrics = {"entropy": m["entropy"]}
        if s["beta"]:
            metrics["kl"] = m["kl"]
        # the clip ratios (at the sequence level: over the sequences, one ratio each, as TRL's)
        if loss_type == "cispo":
            metrics["cispo_clip_ratio"] = m["cispo_clip_ratio"]
        else:
            metrics |= {"clip_ratio/low_mean": m["clip_ratio_low"], "clip_ratio/high_mean": m["clip_ratio_high"],
                        "clip_ratio/region_mean": m["clip_ratio"]}
        return loss, metrics

    return ours, theirs, data


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", GRPO_SETTINGS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", flp.GRPO_LOSS_TYPES)
def test_grpo_equals_trl(loss_type, level, setting, dtype):
    metrics = _check(_grpo(loss_type, level, GRPO_SETTINGS[setting]), dtype)
    if GRPO_SETTINGS[setting]["old"]:  # the clipping is exercised
        if loss_type == "cispo":
            assert 0 < metrics["cispo_clip_ratio"] < 1
        else:
            assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transform", [(0.3, None), (2.0, 1.5)], ids=["scale", "both"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_of_scaled_or_soft_capped_logits_equals_trl(loss_type, transform, dtype):
    """A model that scales or soft-caps its logits, with old log-probs, a reference head, KL and a temperature."""
    _check(_grpo(loss_type, "token", GRPO_SETTINGS["kl-ref-delta"], transform=transform), dtype)


# ----------------------------------------------------------------------------- ORPO, CPO, SimPO


def _pair_batch(input_ids, attention_mask, completion_mask):
    """The experimental trainers' batch: chosen_* and rejected_* (labels: -100 off the completion)."""
    n = input_ids.shape[0] // 2
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    return {f"{kind}_{key}": value[part] for kind, part in (("chosen", slice(0, n)), ("rejected", slice(n, None)))
            for key, value in (("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels))}


def _pair_metrics(m, extra=()):
    return {"rewards/chosen": m["chosen_rewards"].mean(), "rewards/rejected": m["rejected_rewards"].mean(),
            "rewards/accuracies": m["reward_accuracies"].mean(), "rewards/margins": m["reward_margins"].mean(),
            **{k: m[k] for k in extra}}


def _orpo(beta=0.1, nll_target=True, chunk_size=5):
    """ORPOTrainer.get_batch_loss_metrics (its concatenated_forward on the stub's logits) vs linear_orpo_loss. TRL's
    NLL term covers every token of the chosen sequences, the prompt's too: ``nll_target`` gives ours those labels.
    Without it ours covers the completions, the same where the prompts are of one token (a sequence's first token
    is never predicted)."""
    ORPOTrainer = _trl("trl.experimental.orpo.orpo_trainer", "ORPOTrainer")

    def theirs(hidden, weight, ref_hidden, ref_weight, **tokens):
        trainer = _trainer(ORPOTrainer, beta=beta, is_encoder_decoder=False, padding_value=0)
        model = _LM(weight, [(tokens["input_ids"], hidden)])
        with _fp64_stays_fp64() if hidden.dtype == torch.float64 else contextlib.nullcontext():
            return trainer.get_batch_loss_metrics(model, _pair_batch(**tokens))

    def ours(hidden, weight, ref_hidden, ref_weight, input_ids, attention_mask, completion_mask):
        nll = {"nll_target": _shifted_labels(input_ids, attention_mask)} if nll_target else {}
        loss, m = flp.linear_orpo_loss(hidden[:, :-1], weight, _shifted_labels(input_ids, completion_mask),
                                       beta=beta, chunk_size=chunk_size, **nll)
        return loss, _pair_metrics(m, ("nll_loss", "log_odds_ratio", "log_odds_chosen"))

    return ours, theirs, _sequence_data(PROMPTS if nll_target else [1] * 6, REF_FREE_COMPLETIONS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nll_target", [True, False], ids=["nll_target", "completion_nll"])
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_equals_trl(beta, nll_target, dtype):
    _check(_orpo(beta, nll_target), dtype)


CPO_CASES = [
    ("sigmoid", {}), ("sigmoid", dict(label_smoothing=0.2, cpo_alpha=0.5)), ("hinge", dict(beta=0.3)),
    ("ipo", dict(beta=0.5)), ("simpo", dict(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.7)),
    ("simpo", dict(beta=2.5, simpo_gamma=1.0, label_smoothing=0.1, cpo_alpha=0.3)),
    ("sigmoid", dict(alpha=0.25)), ("simpo", dict(alpha=-0.5, beta=2.0)),  # AlphaPO's rewards
]


def _cpo(loss_type, hyper, simpo_function=False, chunk_size=5):
    """CPOTrainer.get_batch_loss_metrics (its concatenated_forward on the stub's logits) vs linear_cpo_loss (or
    linear_simpo_loss)."""
    CPOTrainer = _trl("trl.experimental.cpo.cpo_trainer", "CPOTrainer")
    h = {"beta": 0.1, "label_smoothing": 0.0, "cpo_alpha": 1.0, "simpo_gamma": 0.5, "alpha": 0.0, **hyper}

    def theirs(hidden, weight, ref_hidden, ref_weight, **tokens):
        trainer = _trainer(CPOTrainer, loss_type=loss_type, is_encoder_decoder=False, pad_token_id=0, **h)
        return trainer.get_batch_loss_metrics(_LM(weight, [(tokens["input_ids"], hidden)]), _pair_batch(**tokens))

    def ours(hidden, weight, ref_hidden, ref_weight, input_ids, attention_mask, completion_mask):
        target = _shifted_labels(input_ids, completion_mask)
        if simpo_function:
            loss, m = flp.linear_simpo_loss(hidden[:, :-1], weight, target, chunk_size=chunk_size,
                                            **{k: v for k, v in h.items() if k != "alpha"})
        else:
            loss, m = flp.linear_cpo_loss(hidden[:, :-1], weight, target, loss_type=loss_type, chunk_size=chunk_size,
                                          **h)
        return loss, _pair_metrics(m, ("nll_loss",))  # (TRL's is 0 with cpo_alpha=0: it skips the NLL)

    return ours, theirs, _sequence_data(PROMPTS, REF_FREE_COMPLETIONS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type, hyper", CPO_CASES, ids=_id)
def test_cpo_equals_trl(loss_type, hyper, dtype):
    _check(_cpo(loss_type, hyper), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hyper", [dict(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0),
                                   dict(beta=2.5, simpo_gamma=1.2, label_smoothing=0.1, cpo_alpha=0.0),
                                   dict(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.4)], ids=_id)
def test_simpo_equals_trls_cpo(hyper, dtype):
    """SimPO as TRL runs it: CPOTrainer with loss_type="simpo" (cpo_alpha=0: no NLL term)."""
    _check(_cpo("simpo", hyper, simpo_function=True), dtype)


# ----------------------------------------------------------------------------- generalized JSD


def _transformed(logits, transform):
    """A model's post-processing of its head's logits: * logit_scale, then softcap * tanh(. / softcap)."""
    logits = logits * transform[0]
    return logits if transform[1] is None else torch.tanh(logits / transform[1]) * transform[1]


def _jsd(beta, temperature, labelled=True, reduction="batchmean", num_items=None, all_ignored=False, chunk_size=5,
         student_transform=(1.0, None), teacher_transform=(1.0, None)):
    """GKDTrainer.generalized_jsd_loss on full student and teacher logits (teacher hidden size 24, the student's 16)
    vs linear_generalized_jsd_loss; the per-token divergences are TRL's with reduction="none" summed over the
    vocabulary. The transforms: what each model does to its head's logits before TRL sees them."""
    GKDTrainer = _trl("trl.experimental.gkd.gkd_trainer", "GKDTrainer")
    shape = (3, 7)
    target = None
    if labelled:
        target = torch.randint(0, VOCAB, shape)
        target[:, :2] = -100
        target[1, 4:] = -100
        if all_ignored:
            target[:] = -100
    data = {"hidden": torch.randn(*shape, HIDDEN, dtype=torch.float64),
            "weight": torch.randn(VOCAB, HIDDEN, dtype=torch.float64) / HIDDEN**0.5 * 2,
            "teacher_hidden": torch.randn(*shape, TEACHER_HIDDEN, dtype=torch.float64),
            "teacher_weight": torch.randn(VOCAB, TEACHER_HIDDEN, dtype=torch.float64) / TEACHER_HIDDEN**0.5 * 3,
            "labels": target}
    kw = dict(beta=beta, temperature=temperature, num_items_in_batch=num_items)

    def theirs(hidden, weight, teacher_hidden, teacher_weight, labels):
        student = _transformed(F.linear(hidden, weight), student_transform)
        with torch.no_grad():
            teacher = _transformed(F.linear(teacher_hidden, teacher_weight), teacher_transform)
            per_token = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature,
                                                        reduction="none").sum(-1).reshape(-1)
        return GKDTrainer.generalized_jsd_loss(student, teacher, labels, reduction=reduction, **kw), {"jsd": per_token}

    def ours(hidden, weight, teacher_hidden, teacher_weight, labels):
        return flp.linear_generalized_jsd_loss(
            hidden, weight, teacher_hidden, teacher_weight, labels, reduction=reduction, chunk_size=chunk_size,
            logit_scale=student_transform[0], softcap=student_transform[1], teacher_logit_scale=teacher_transform[0],
            teacher_softcap=teacher_transform[1], **kw)

    return ours, theirs, data


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("labelled", [True, False], ids=["labels", "no_labels"])
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.0, 1.5), (0.5, 1.0), (1.0, 0.7), (0.3, 2.0)])
def test_generalized_jsd_equals_trl(beta, temperature, labelled, reduction, dtype):
    _check(_jsd(beta, temperature, labelled, reduction), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("student, teacher", [((0.3, None), (1.0, None)), ((1.0, 0.5), (1.0, 0.5)),
                                              ((2.0, 1.5), (1.0, None)), ((1.0, None), (0.5, 0.8))],
                         ids=["student-scale", "both-softcap", "student-both", "teacher-both"])
def test_generalized_jsd_of_scaled_or_soft_capped_logits_equals_trl(student, teacher, beta, dtype):
    """Student and teacher models that scale or soft-cap their logits (Gemma 2's ``final_logit_softcapping``,
    Cohere's ``logit_scale``), each its own: TRL's loss on the transformed logits."""
    _check(_jsd(beta, 0.8, student_transform=student, teacher_transform=teacher), dtype)


@TRITON
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_kernel_of_transformed_logits_equals_trl(beta):
    """The same through the Triton row kernel (the interpreter; fp32, the kernel's dtype here)."""
    for student, teacher in (((2.0, 1.5), (0.5, 0.8)), ((1.0, 0.5), (1.0, None))):
        _check(_jsd(beta, 0.8, student_transform=student, teacher_transform=teacher), torch.float32, "triton")


def test_generalized_jsd_transform_arguments_are_checked():
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    for kwargs, name in (({"logit_scale": 0.0}, "logit_scale"), ({"softcap": -1.0}, "softcap"),
                         ({"teacher_logit_scale": float("inf")}, "teacher_logit_scale"),
                         ({"teacher_softcap": 0.0}, "teacher_softcap")):
        with pytest.raises(ValueError, match=name):
            flp.linear_generalized_jsd_loss(x, w, x, w, **kwargs)


@pytest.mark.parametrize("labelled", [True, False], ids=["labels", "no_labels"])
@pytest.mark.parametrize("num_items", [11, torch.tensor(30)], ids=["int", "tensor"])
def test_generalized_jsd_num_items_in_batch_equals_trl(num_items, labelled):
    for beta in (0.0, 0.5, 1.0):
        _check(_jsd(beta, 0.9, labelled, num_items=num_items), torch.float64)


# ----------------------------------------------------------------------------- no labelled token

NOTHING_LABELLED = {
    "dpo-sigmoid": lambda: _dpo("sigmoid", False, completions=EMPTY),  # pairs of log-ratio 0: log 2 each
    "dpo-ipo": lambda: _dpo("ipo", True, completions=EMPTY, token_statistics=False),
    "kto": lambda: _kto("kto", (1.33, 0.7), False, completions=EMPTY),
    "grpo": lambda: _grpo("grpo", "token", GRPO_SETTINGS["old"], completions=(0,) * 5),
    "dapo-sequence": lambda: _grpo("dapo", "sequence", GRPO_SETTINGS["old"], completions=(0,) * 5),
    "grpo-kl": lambda: _grpo("bnpo", "token", GRPO_SETTINGS["kl-ref-delta"], completions=(0,) * 5),  # kl 0
    "cispo-sequence": lambda: _grpo("cispo", "sequence", GRPO_SETTINGS["old"], completions=(0,) * 5),
    "jsd": lambda: _jsd(0.5, 1.0, all_ignored=True),
}


@pytest.mark.parametrize("case", NOTHING_LABELLED)
def test_no_labelled_token_equals_trl(case):
    """Every completion empty: TRL's loss (sequences still count where it counts them), zero gradients."""
    _check(NOTHING_LABELLED[case](), torch.float64, labelled=False)


# ----------------------------------------------------------------------------- the Triton kernels

TRITON_CASES = {
    "dpo": lambda: _dpo((["sigmoid", "sft"], [1.0, 0.5]), False, chunk_size=3),
    "dpo-ipo-precomputed": lambda: _dpo("ipo", True),
    "kto": lambda: _kto("kto", (1.33, 0.7), False),
    "grpo-token": lambda: _grpo("dapo", "token", GRPO_SETTINGS["kl-ref-delta"]),
    "grpo-sequence": lambda: _grpo("grpo", "sequence", GRPO_SETTINGS["kl-precomputed"]),
    "cispo": lambda: _grpo("cispo", "token", GRPO_SETTINGS["old"]),
    "orpo": lambda: _orpo(),
    "simpo": lambda: _cpo("simpo", dict(beta=2.0, cpo_alpha=0.5)),
    "jsd-0": lambda: _jsd(0.0, 1.4),
    "jsd-0.5": lambda: _jsd(0.5, 0.8),
    "jsd-1": lambda: _jsd(1.0, 1.0, labelled=False, reduction="sum"),
}


@TRITON
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_kernels_equal_trl(case):
    _check(TRITON_CASES[case](), torch.float32, "triton")


# ----------------------------------------------------------------------------- chunking, modules, errors

CHUNKED = {
    "dpo": lambda chunk: _dpo((["sigmoid", "sft"], [1.0, 0.5]), False, chunk_size=chunk),
    "kto": lambda chunk: _kto("kto", (1.33, 0.7), True, chunk_size=chunk),
    "grpo-sequence": lambda chunk: _grpo("grpo", "sequence", GRPO_SETTINGS["kl-ref-delta"], chunk_size=chunk),
    "dapo": lambda chunk: _grpo("dapo", "token", GRPO_SETTINGS["old"], chunk_size=chunk),
    "orpo": lambda chunk: _orpo(chunk_size=chunk),
    "cpo": lambda chunk: _cpo("ipo", {}, chunk_size=chunk),
    "jsd": lambda chunk: _jsd(0.3, 1.5, chunk_size=chunk),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", CHUNKED)
def test_chunk_size_does_not_change_the_result(loss, backend):
    """One row per chunk (a group of sequences still goes whole), a small odd chunk, the default: the same loss,
    metrics and gradients (to fp32 rounding: only the order of sums changes)."""
    results = []
    for chunk_size in (1, 3, None):
        torch.manual_seed(0)  # the same data each time
        ours, _, data = CHUNKED[loss](chunk_size)
        with fl.use_backend(backend):
            results.append(_run(ours, data, torch.float32))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-6)


def _module_cases():
    x, w = torch.randn(4, 5, HIDDEN), torch.randn(VOCAB, HIDDEN) / 2
    t = torch.randint(0, VOCAB, (4, 5))
    t[:, :2] = -100
    ref_seq, ref_tok = -torch.rand(4) * 10, -torch.rand(4, 5)
    xt, wt = torch.randn(4, 5, TEACHER_HIDDEN), torch.randn(VOCAB, TEACHER_HIDDEN) / 2
    return [
        (flp.LinearDPOLoss, dict(beta=0.2, loss_type=["ipo", "sft"], loss_weights=[1.0, 0.3]), (x, w, t),
         dict(ref_log_probs=ref_seq)),
        (flp.LinearORPOLoss, dict(beta=0.3), (x, w, t), {}),
        (flp.LinearCPOLoss, dict(loss_type="hinge", cpo_alpha=0.5), (x, w, t), {}),
        (flp.LinearSimPOLoss, dict(simpo_gamma=0.7, chunk_size=3), (x, w, t), {}),
        (flp.LinearKTOLoss, dict(desirable_weight=1.5), (x, w, t, torch.tensor([True, False, False, True])),
         dict(ref_log_probs=ref_seq)),
        (flp.LinearGRPOLoss, dict(loss_type="bnpo", beta=0.04), (x, w, t, torch.randn(4)),
         dict(ref_log_probs=ref_tok, old_log_probs=ref_tok.flip(0))),
        (flp.LinearGeneralizedJSDLoss, dict(beta=0.3, temperature=0.8), (x, w, xt, wt, t), {}),
    ]


@pytest.mark.parametrize("case", range(7), ids=lambda i: _module_cases()[i][0].__name__)
def test_modules_equal_the_functions(case):
    """A module's constructor arguments are the function's keyword arguments (a call's own keywords override
    them): the same loss, metrics and gradients, bitwise."""
    cls, hyper, tensors, kwargs = _module_cases()[case]
    module = cls(**hyper)
    assert isinstance(module, torch.nn.Module) and all(f"{k}=" in repr(module) for k in hyper)

    def run(call, **extra):
        x, w = (v.clone().requires_grad_() for v in tensors[:2])
        loss, metrics = call(x, w, *tensors[2:], **kwargs, **extra)
        loss.backward()
        return loss, metrics, x.grad, w.grad

    def function(*args, **extra):
        return cls.function(*args, **{**hyper, **extra})

    plain, overridden = run(module), run(module, beta=0.5)
    torch.testing.assert_close(plain, run(function), rtol=0, atol=0)
    torch.testing.assert_close(overridden, run(function, beta=0.5), rtol=0, atol=0)
    assert overridden[0] != plain[0]  # beta=0.5 was used


def test_module_rejects_unknown_arguments():
    with pytest.raises(TypeError, match="bogus"):
        flp.LinearDPOLoss(bogus=1)
    with pytest.raises(TypeError, match="advantages"):  # a tensor argument is not a hyperparameter
        flp.LinearGRPOLoss(advantages=torch.zeros(2))


def _valid_call(loss):
    """A valid call's arguments for each function (4 sequences of 5 tokens)."""
    x, w = torch.randn(4, 5, HIDDEN), torch.randn(VOCAB, HIDDEN)
    t = torch.randint(0, VOCAB, (4, 5))
    t[:, :2] = -100
    base = {"input": x, "linear_weight": w, "target": t}
    return {
        "dpo": (flp.linear_dpo_loss, {**base, "ref_log_probs": torch.zeros(4)}),
        "orpo": (flp.linear_orpo_loss, base),
        "cpo": (flp.linear_cpo_loss, base),
        "simpo": (flp.linear_simpo_loss, base),
        "kto": (flp.linear_kto_loss, {**base, "label": torch.tensor([1, 0, 1, 0]), "ref_log_probs": torch.zeros(4)}),
        "grpo": (flp.linear_grpo_loss, {**base, "advantages": torch.randn(4)}),
        "jsd": (flp.linear_generalized_jsd_loss, {"student_input": x, "student_weight": w,
                                                  "teacher_input": torch.randn(4, 5, TEACHER_HIDDEN),
                                                  "teacher_weight": torch.randn(VOCAB, TEACHER_HIDDEN), "target": t}),
    }[loss]


ODD = {"input": torch.randn(3, 5, HIDDEN), "target": torch.randint(0, VOCAB, (3, 5))}


@pytest.mark.parametrize("loss, changes, error, match", [
    ("dpo", {**ODD, "ref_log_probs": torch.zeros(3)}, ValueError, "even"),
    ("orpo", ODD, ValueError, "even"),
    ("cpo", ODD, ValueError, "even"),
    ("simpo", ODD, ValueError, "even"),
    ("dpo", {"target": torch.zeros(4, 4, dtype=torch.long)}, ValueError, "target"),
    ("dpo", {"target": torch.zeros(4, 5)}, TypeError, "target"),
    ("dpo", {"target": torch.full((4, 5), VOCAB)}, IndexError, "target"),
    ("dpo", {"input": torch.randn(4, 5, HIDDEN + 1)}, ValueError, "linear_weight"),
    ("dpo", {"input": torch.randn(20, HIDDEN)}, ValueError, "input"),
    ("dpo", {"input": torch.zeros(4, 5, HIDDEN, dtype=torch.long)}, TypeError, "input"),
    ("dpo", {"loss_type": "aot"}, ValueError, "loss_type"),
    ("dpo", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, ValueError, "loss_weights"),
    ("dpo", {"ref_log_probs": None}, ValueError, "reference"),
    ("dpo", {"ref_input": torch.randn(4, 5, HIDDEN), "ref_linear_weight": torch.randn(VOCAB, HIDDEN)}, ValueError,
     "either"),
    ("dpo", {"ref_log_probs": None, "ref_input": torch.randn(4, 5, HIDDEN)}, ValueError, "ref_linear_weight"),
    ("dpo", {"ref_log_probs": torch.zeros(4, 5)}, ValueError, "ref_log_probs"),
    ("dpo", {"ref_log_probs": None, "ref_input": torch.randn(4, 6, HIDDEN),
             "ref_linear_weight": torch.randn(VOCAB, HIDDEN)}, ValueError, "ref_input"),
    ("dpo", {"beta": "0.1"}, TypeError, "beta"),
    ("dpo", {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    ("orpo", {"nll_target": torch.zeros(4, 4, dtype=torch.long)}, ValueError, "nll_target"),
    ("orpo", {"nll_target": torch.full((4, 5), -100)}, ValueError, "nll_target"),  # differs where target labels
    ("orpo", {"nll_target": torch.zeros(4, 5)}, TypeError, "nll_target"),
    ("cpo", {"loss_type": "kto"}, ValueError, "loss_type"),
    ("kto", {"label": torch.ones(3, dtype=torch.bool)}, ValueError, "label"),
    ("kto", {"label": [1, 0, 1, 0]}, TypeError, "label"),
    ("kto", {"loss_type": "sigmoid"}, ValueError, "loss_type"),
    ("kto", {"kl_log_probs": torch.zeros(4)}, ValueError, "kl_log_probs"),
    ("grpo", {"advantages": torch.zeros(3)}, ValueError, "advantages"),
    ("grpo", {"advantages": torch.zeros(4, dtype=torch.long)}, TypeError, "advantages"),
    ("grpo", {"old_log_probs": torch.zeros(4)}, ValueError, "old_log_probs"),
    ("grpo", {"loss_type": "sapo"}, ValueError, "loss_type"),
    ("grpo", {"importance_sampling_level": "seq"}, ValueError, "importance_sampling_level"),
    ("grpo", {"beta": 0.04}, ValueError, "reference"),
    ("grpo", {"beta": 0.04, "ref_log_probs": torch.zeros(4)}, ValueError, "ref_log_probs"),
    ("jsd", {"teacher_weight": torch.randn(VOCAB + 1, TEACHER_HIDDEN)}, ValueError, "teacher_weight"),
    ("jsd", {"teacher_input": torch.randn(4, 6, TEACHER_HIDDEN)}, ValueError, "teacher_input"),
    ("jsd", {"student_input": torch.randn(4, 5, HIDDEN + 1)}, ValueError, "student_input"),
    ("jsd", {"target": torch.zeros(4, 6, dtype=torch.long)}, ValueError, "target"),
    ("jsd", {"beta": 1.5}, ValueError, "beta"),
    ("jsd", {"temperature": 0.0}, ValueError, "temperature"),
    ("jsd", {"reduction": "none"}, ValueError, "reduction"),
])
def test_bad_input_names_the_argument(loss, changes, error, match):
    function, kwargs = _valid_call(loss)
    function(**kwargs)  # the unchanged call is valid
    with pytest.raises(error, match=match):
        function(**{**kwargs, **changes})


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


def _cuda_problem(n_seq=4, n_tok=64, hidden=64, vocab=32003, dtype=torch.bfloat16):
    x = torch.randn(n_seq, n_tok, hidden, device="cuda").to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5).to(dtype)
    t = torch.randint(0, vocab, (n_seq, n_tok), device="cuda")
    t[:, : n_tok // 4] = -100  # prompts
    return x, w, t


def _full_logits_seq(x, w, t):
    """Per-sequence sums of full-logit log-probs (logits in the input's dtype, as F.linear gives them)."""
    lp = F.linear(x, w).float().log_softmax(-1)
    keep = t != -100
    return (lp.gather(-1, t.where(keep, 0)[..., None]).squeeze(-1) * keep).sum(-1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulation_dtype", [None, torch.float32])
def test_cuda_dpo_parity(dtype, accumulation_dtype):
    x, w, t = _cuda_problem(dtype=dtype)
    ref = torch.randn(4, device="cuda") * 10 - 100

    def stock(x, w):
        seq = _full_logits_seq(x, w, t) - ref
        return -F.logsigmoid(0.1 * (seq[:2] - seq[2:])).mean()

    fused_in = [v.detach().clone().requires_grad_() for v in (x, w)]
    stock_in = [v.detach().clone().requires_grad_() for v in (x, w)]
    ref_in = [v.detach().double().requires_grad_() for v in (x, w)]
    fused, _ = flp.linear_dpo_loss(*fused_in, t, ref_log_probs=ref, accumulation_dtype=accumulation_dtype,
                                   chunk_size=96)
    expected = stock(*stock_in)
    exact = stock(*ref_in)
    for value in (fused, expected, exact):
        value.backward()
    # the loss is a function of sequence sums of ~50 log-probs (~500 in magnitude), times beta: known to that
    # sum's rounding
    floor = 1e-6 * 0.1 * _full_logits_seq(x.double(), w.double(), t).abs().max().item()
    assert_parity(fused, expected.to(fused.dtype), exact.to(fused.dtype), "loss", floor=floor)
    for name, f, s, r in zip(("input", "linear_weight"), fused_in, stock_in, ref_in, strict=True):
        assert f.grad.dtype == f.dtype
        assert_parity(f.grad, s.grad, r.grad.to(f.dtype), f"grad {name}")


@pytest.mark.cuda
def test_cuda_grpo_and_jsd_parity():
    x, w, t = _cuda_problem(dtype=torch.float32)
    adv = torch.randn(4, device="cuda")
    old = torch.randn(4, 64, device="cuda") * 0.1 - 10
    leaves = [v.detach().clone().requires_grad_() for v in (x, w)]
    loss, metrics = flp.linear_grpo_loss(*leaves, t, adv, old_log_probs=old, loss_type="grpo", chunk_size=50)
    loss.backward()
    xs, ws = (v.detach().double().requires_grad_() for v in (x, w))
    lp = F.linear(xs, ws).log_softmax(-1)
    keep = t != -100
    tok = lp.gather(-1, t.where(keep, 0)[..., None]).squeeze(-1)
    coef = torch.exp(tok - old.double())
    per_token = -torch.min(coef * adv.double()[:, None], coef.clamp(0.8, 1.2) * adv.double()[:, None])
    expected = ((per_token * keep).sum(-1) / keep.sum(-1)).mean()
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(leaves[0].grad.double(), xs.grad, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(leaves[1].grad.double(), ws.grad, rtol=1e-3, atol=1e-5)

    teacher_x = torch.randn(4, 64, 96, device="cuda")
    teacher_w = torch.randn(32003, 96, device="cuda") / 10
    student = [v.detach().clone().requires_grad_() for v in (x, w)]
    loss, _ = flp.linear_generalized_jsd_loss(*student, teacher_x, teacher_w, t, beta=0.5, temperature=0.9)
    loss.backward()
    sx, sw = (v.detach().double().requires_grad_() for v in (x, w))
    ls = (F.linear(sx, sw) / 0.9).log_softmax(-1)[keep]
    lt = (F.linear(teacher_x.double(), teacher_w.double()) / 0.9).log_softmax(-1)[keep]
    lm = torch.logaddexp(ls + math.log(0.5), lt + math.log(0.5))
    expected = (0.5 * (lt.exp() * (lt - lm)).sum(-1) + 0.5 * (ls.exp() * (ls - lm)).sum(-1)).sum() / keep.sum()
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(student[0].grad.double(), sx.grad, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(student[1].grad.double(), sw.grad, rtol=1e-3, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_cuda_jsd_of_transformed_logits(beta):
    """The row kernel compiled for the GPU with each head's scale and soft-cap (fp32 heads, a vocabulary of
    32003) against the written-out divergence in fp64."""
    x, w, t = _cuda_problem(dtype=torch.float32)
    keep = t != -100
    teacher_x = torch.randn(4, 64, 96, device="cuda")
    teacher_w = torch.randn(32003, 96, device="cuda") / 10
    (s_scale, s_cap), (t_scale, t_cap) = (2.0, 1.5), (0.5, 0.8)
    student = [v.detach().clone().requires_grad_() for v in (x, w)]
    loss, _ = flp.linear_generalized_jsd_loss(*student, teacher_x, teacher_w, t, beta=beta, temperature=0.9,
                                              logit_scale=s_scale, softcap=s_cap, teacher_logit_scale=t_scale,
                                              teacher_softcap=t_cap)
    loss.backward()
    sx, sw = (v.detach().double().requires_grad_() for v in (x, w))
    ls = (_transformed(F.linear(sx, sw), (s_scale, s_cap)) / 0.9).log_softmax(-1)[keep]
    teacher = _transformed(F.linear(teacher_x.double(), teacher_w.double()), (t_scale, t_cap))
    lt = (teacher / 0.9).log_softmax(-1)[keep]
    if beta == 0:
        per_token = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1:
        per_token = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        per_token = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    expected = per_token.sum() / keep.sum()
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(student[0].grad.double(), sx.grad, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(student[1].grad.double(), sw.grad, rtol=1e-3, atol=1e-6)


@pytest.mark.cuda
def test_cuda_dpo_memory():
    """bf16 head, default accumulation: the peak beyond the inputs is the gradients (W's, the input's) plus one
    logits chunk, nothing (tokens x vocabulary)-sized."""
    x, w, t = _cuda_problem(n_seq=8, n_tok=512, hidden=256, vocab=32000)
    x.requires_grad_()
    w.requires_grad_()
    ref = torch.randn(8, device="cuda")

    def step():
        x.grad = w.grad = None
        loss, _ = flp.linear_dpo_loss(x, w, t, ref_log_probs=ref, chunk_size=1024)
        loss.backward()

    step()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    extra = torch.cuda.max_memory_allocated() - base
    bound = w.numel() * 2 + 2 * x.numel() * 2 + 1024 * 32000 * 2  # grad_W, grad_x and the gathered rows, one chunk
    assert extra <= bound + 16 * 2**20 < 8 * 512 * 32000 * 2, (extra, bound)
