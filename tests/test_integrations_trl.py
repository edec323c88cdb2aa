"""fusedlayers.integrations.trl: TRL's trainers with their per-token log-probs computed by
fl.linear_log_prob_statistics in place of TRL's chunked kernel.

    from fusedlayers.integrations import trl as fltrl
    fltrl.apply()                 # before or after building the trainer
    trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()

The kernel: ours against TRL's ``ChunkedLogProbFunction`` against a float64 full-logits reference on the same inputs
(the five outputs and the gradients, by the project's parity rule, tests/parity.py), and called by a model given
TRL's fused head as ``add_fused_lm_head`` calls it: every position on CPU, only the scored ones where TRL has Triton
(forced here), a micro-batch with none, a bf16 model's head under ``cast_lm_head_to_fp32``, ZeRO-3's fallback.

The trainers: DPO (sigmoid, IPO, precomputed reference log-probs, TRL's scored-positions call, our Triton kernels
under the interpreter), KTO, GRPO (grpo / dapo, with and without a KL term against a reference model), RLOO and SFT
train a tiny randomly initialised Llama (from a config, no download; fp32 on CPU) for 3 optimizer steps of SGD
(gradient accumulation 2) three times from the same weights and seed: stock TRL, applied, and a float64 run whose
heads compute full logits (the reference). Asserted: every call TRL's fused heads made went to fusedlayers (counted:
as many as the stock run made of TRL's kernel, none to TRL's kernel while applied); each call's outputs within the
parity rule of TRL's kernel on the same inputs (checked in the call); every value logged at every step and the final
weights those of the stock run up to fp32 rounding (test_recipes' tolerances); the per-step losses and the final
weights as close to the float64 run's as the stock run's by the parity rule. GRPO / RLOO sample their completions
(seeded) in every run: the same ones, checked by what they log of them.

Tested with TRL 1.16.0 (the integration supports 1.15.x and 1.16.x: ``fltrl.SUPPORTED_TRL``), transformers 5.24,
torch 2.13 on CPU.
"""
from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import datasets  # noqa: E402
import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402
from trl.kernels import ChunkedLogProbFunction as TRLKernel  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

import fusedlayers as fl  # noqa: E402
import fusedlayers.functional as flf  # noqa: E402
from fusedlayers.integrations import trl as fltrl  # noqa: E402
from tests.conftest import INTERPRETER  # noqa: E402
from tests.parity import assert_parity, loss_floor  # noqa: E402
from tests.test_recipes import (  # noqa: E402
    CONFIG,
    TOLERANCE,
    WORDS,
    _assert_same_weights,
    _checkpointing,
    _tiny_llama,
    _tokenizer,
    _train,
)

SUPPORTED = Version(trl.__version__).release[:2] in fltrl.SUPPORTED_TRL
pytestmark = pytest.mark.skipif(not SUPPORTED, reason=f"TRL {trl.__version__} is not supported by the integration")

OUTPUTS = fltrl.OUTPUTS
STEPS, BATCH, ACCUMULATION = 3, 4, 2
# What GRPO / RLOO log of the completions they sampled: the float64 reference run samples the same ones.
COMPLETIONS = ("num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length", "reward",
               "reward_std")
# Logged values that are not functions of the computation (wall-clock times).
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


# --------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(autouse=True)
def _one_thread():
    """Products of a few dozen rows gain nothing from threads, and lose 100x where the cores are shared (pytest-xdist,
    another process): spinning threads wait for each other at every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _stock_trl_after():
    """No test leaves the integration applied (it is process-wide)."""
    yield
    fltrl.revert()
    assert trl_utils._ChunkedLogProbFunction is TRLKernel


@pytest.fixture(autouse=True)
def _quiet_datasets(request):
    if datasets.is_progress_bar_enabled():  # TRL's dataset preparation (Dataset.map) shows progress bars
        datasets.disable_progress_bars()
        request.addfinalizer(datasets.enable_progress_bars)


# --------------------------------------------------------------------------------------------------------------
# the reference head, the spy


def reference_head(hidden, weight, bias, targets, temperature, softcap=None, logit_scale=1.0):
    """TRL's five outputs from full logits in float64 (differentiable in log_probs and entropy)."""
    z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = z.log_softmax(-1)
    log_probs = log_p.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    with torch.no_grad():
        stats = (torch.logsumexp(2 * log_p, -1), z.mean(-1), z.argmax(-1) == targets)
    return log_probs, entropy, *stats


class ReferenceKernel:
    """In place of TRL's kernel for the float64 reference runs: the full-logits head in float64."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0,
              outputs=OUTPUTS):
        out = reference_head(hidden, weight, bias, targets, temperature, softcap, logit_scale)
        wanted = ("log_probs", *outputs)
        return tuple(v if name in wanted else None for name, v in zip(OUTPUTS, out, strict=True))


def assert_outputs_parity(fused, stock, reference, what=""):
    """TRL's five outputs (None where not computed): ours against TRL's kernel against the float64 reference."""
    for name, f, s, r in zip(OUTPUTS, fused, stock, reference, strict=True):
        assert (f is None) == (s is None), f"{what}{name}: {f is None=} but {s is None=}"
        if f is None:
            continue
        assert f.shape == s.shape and f.dtype == s.dtype, f"{what}{name}: {f.shape}/{f.dtype} != {s.shape}/{s.dtype}"
        if name == "is_top1":
            assert torch.equal(f, s) and torch.equal(f, r), f"{what}{name}"
            continue
        # values as large as the logsumexp, less a number of that size: known to a rounding of its size
        floor = loss_floor(f, r) if name in ("log_probs", "entropy", "log_sum_sq_probs") else None
        assert_parity(f, s, r.to(f.dtype if f.dtype == torch.float64 else torch.float64), what + name, floor=floor)


@pytest.fixture
def kernels(monkeypatch):
    """Counts of what TRL's fused heads ran: ``trl``, the calls of TRL's kernel through the global its heads call;
    ``fused``, the calls of fl.linear_log_prob_statistics (each checked against TRL's kernel and the float64
    reference on the same inputs); ``rows``, the tokens they scored. Reverts the integration afterwards."""
    counts = {"trl": 0, "fused": 0, "rows": 0}
    original = trl_utils._ChunkedLogProbFunction

    class CountedTRLKernel:
        @staticmethod
        def apply(*args):
            counts["trl"] += 1
            return original.apply(*args)

    fused = flf.linear_log_prob_statistics

    def spy(input, linear_weight, target, **kwargs):
        counts["fused"] += 1
        counts["rows"] += target.numel()
        out = fused(input, linear_weight, target, **kwargs)
        args = [v.detach() if v is not None else None for v in (input, linear_weight, kwargs["linear_bias"])]
        transform = kwargs["temperature"], kwargs["softcap"], kwargs["logit_scale"]
        with torch.no_grad():
            stock = TRLKernel.apply(*args[:3], target, transform[0], 32768, *transform[1:], kwargs["outputs"])
            reference = ReferenceKernel.apply(*args[:3], target, transform[0], 0, *transform[1:], kwargs["outputs"])
        assert_outputs_parity(out, stock, reference, f"call {counts['fused']}: ")
        return out

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", CountedTRLKernel)
    monkeypatch.setattr(flf, "linear_log_prob_statistics", spy)
    fltrl.fallbacks.clear()
    yield counts
    fltrl.revert()  # before monkeypatch restores TRL's kernel (ours saved the counted one)
    fltrl.fallbacks.clear()


@contextlib.contextmanager
def _float64_reference(monkeypatch):
    """The float64 reference run: TRL's heads on ReferenceKernel, float64 the default dtype (TRL's losses make
    some constants with torch.tensor(x))."""
    with monkeypatch.context() as m:
        m.setattr(trl_utils, "_ChunkedLogProbFunction", ReferenceKernel)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(default)


# --------------------------------------------------------------------------------------------------------------
# the kernel, called as TRL calls it


def _head_problem(n=40, hidden=24, vocab=101, bias=False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 2
    b = torch.randn(vocab, generator=g) * 0.5 if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    return x, w, b, t


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("transform", [(1.0, None, 1.0), (0.7, None, 1.0), (0.9, 2.5, 1.0), (1.3, None, 0.8),
                                       (0.6, 3.0, 1.7)], ids=["plain", "temperature", "softcap", "scale", "all"])
def test_kernel_parity(bias, transform):
    """ChunkedLogProbFunction.apply (ours) against TRL's kernel against the float64 full-logits head: the five
    outputs, and the gradients of the hidden states, weight and bias for upstream gradients of log_probs and
    entropy (both: GRPO's entropy bonus trains on the entropy)."""
    x, w, b, t = _head_problem(bias=bias)
    temperature, softcap, scale = transform
    leaves = [v for v in (x, w, b) if v is not None]
    runs = {}
    for name, kernel in (("fused", fltrl.ChunkedLogProbFunction), ("stock", TRLKernel), ("reference", ReferenceKernel)):
        ins = [v.detach().clone().requires_grad_() for v in leaves]
        out = kernel.apply(ins[0], ins[1], ins[2] if b is not None else None, t, temperature, 32768, softcap, scale,
                           OUTPUTS)
        g = torch.randn(t.shape, generator=torch.Generator().manual_seed(2), dtype=out[0].dtype)
        h = torch.randn(t.shape, generator=torch.Generator().manual_seed(3), dtype=out[0].dtype)
        torch.autograd.backward(out[:2], [g, h])
        runs[name] = out, [v.grad for v in ins]
    assert_outputs_parity(runs["fused"][0], runs["stock"][0], runs["reference"][0])
    for name, f, s, r in zip(("hidden", "weight", "bias"), *(runs[k][1] for k in ("fused", "stock", "reference")),
                             strict=False):
        assert f.dtype == s.dtype
        assert_parity(f, s, r, f"grad {name}")


@pytest.mark.parametrize("outputs", [("log_probs",), ("log_probs", "entropy"), OUTPUTS[1:]],
                         ids=["log_probs", "entropy", "trl_default"])
def test_kernel_outputs_contract(outputs):
    """None where TRL's kernel gives None (log_probs always); is_top1 bool; the statistics without gradient, the
    entropy with."""
    x, w, b, t = _head_problem(bias=True)
    x.requires_grad_()
    fused = fltrl.ChunkedLogProbFunction.apply(x, w, b, t, 1.0, 32768, None, 1.0, outputs)
    stock = TRLKernel.apply(x, w, b, t, 1.0, 32768, None, 1.0, outputs)
    for name, f, s in zip(OUTPUTS, fused, stock, strict=True):
        assert (f is None) == (s is None), name
        if f is not None:
            assert (f.dtype, f.shape, f.requires_grad) == (s.dtype, s.shape, s.requires_grad), name


def _lm_batch(vocab, batch=3, length=9, seed=0):
    """input_ids, attention_mask (right padding), labels (-100 on a prompt of 3 and on padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return ids, mask, labels


@pytest.mark.parametrize("compact", [False, True], ids=["all_positions", "scored_positions"])
def test_fused_lm_head_model(compact, kernels, monkeypatch):
    """A model given TRL's fused head (add_fused_lm_head, every output requested, a temperature): log-probs,
    statistics, the loss and the gradients of every parameter, stock and applied. TRL scores every position on CPU
    (labels clamped, the ignored ones zeroed after) and only the scored positions where it has Triton
    (``compact``, forced here): both reach our function."""
    if compact:
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    model = _tiny_llama()
    trl_utils.add_fused_lm_head(model, temperature=0.8, outputs=OUTPUTS)
    ids, mask, labels = _lm_batch(model.config.vocab_size)
    results = []
    for applied in (False, True):
        model.zero_grad()
        with fltrl.applied() if applied else contextlib.nullcontext():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in model.parameters()]))
    (stock, stock_grads), (fused, fused_grads) = results
    assert kernels["trl"] == 1 and kernels["fused"] == 1
    scored = int((labels[:, 1:] != -100).sum())
    assert kernels["rows"] == (scored if compact else labels[:, 1:].numel())
    for name in (*OUTPUTS, "loss", "label_mask"):
        f, s = getattr(fused, name), getattr(stock, name)
        assert f.dtype == s.dtype and f.shape == s.shape, name
        torch.testing.assert_close(f, s, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
    assert fused.log_probs[labels[:, 1:] == -100].eq(0).all()
    for (name, _), f, s in zip(model.named_parameters(), fused_grads, stock_grads, strict=True):
        torch.testing.assert_close(f, s, **TOLERANCE, msg=lambda m, name=name: f"grad {name}: {m}")


def test_fused_lm_head_all_ignored_batch(kernels, monkeypatch):
    """A micro-batch without a scored token (TRL scores none where it has Triton): zero log-probs and a loss that
    is a differentiable zero, as TRL's."""
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    model = _tiny_llama()
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask, _ = _lm_batch(model.config.vocab_size)
    with fltrl.applied():
        out = model(input_ids=ids, attention_mask=mask, labels=torch.full_like(ids, -100), fused_lm_head=True)
    out.loss.backward()
    assert kernels["fused"] == 1 and kernels["rows"] == 0
    assert out.loss.item() == 0 and not out.log_probs.any() and not out.entropy.any()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_fused_lm_head_fp32_head_of_a_bf16_model(kernels):
    """``cast_lm_head_to_fp32=True`` (GRPO / RLOO's option) on a bf16 model upcasts only the hidden states: the head
    is cast to fp32 for the products, as TRL's kernel casts its tiles, and its gradient arrives in bf16."""
    model = _tiny_llama().to(torch.bfloat16)
    trl_utils.add_fused_lm_head(model, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    ids, mask, labels = _lm_batch(model.config.vocab_size)
    results = []
    for applied in (False, True):
        model.zero_grad()
        with fltrl.applied() if applied else contextlib.nullcontext():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (out.loss + out.entropy.sum()).backward()
        results.append((out, model.lm_head.weight.grad.clone()))
    (stock, stock_grad), (fused, fused_grad) = results
    assert kernels["fused"] == 1 and fused.log_probs.dtype == torch.float32 and fused_grad.dtype == torch.bfloat16
    torch.testing.assert_close(fused.log_probs, stock.log_probs, **TOLERANCE)
    torch.testing.assert_close(fused.entropy, stock.entropy, **TOLERANCE)
    torch.testing.assert_close(fused_grad, stock_grad, rtol=1.6e-2, atol=1e-5)  # bf16 rounding of the gradient


def test_zero3_falls_back_to_trl_kernel(kernels, monkeypatch):
    """Under DeepSpeed ZeRO-3 TRL's kernel computes (its backward gathers the partitioned head again): counted in
    fallbacks, nothing through ours."""
    monkeypatch.setattr(fltrl, "_zero3", lambda: True)
    model = _tiny_llama()
    trl_utils.add_fused_lm_head(model)
    ids, mask, labels = _lm_batch(model.config.vocab_size)
    with fltrl.applied():
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).loss.backward()
    assert kernels == {"trl": 1, "fused": 0, "rows": 0} and fltrl.fallbacks == {"zero3": 1}


# --------------------------------------------------------------------------------------------------------------
# apply / revert


def test_apply_revert_applied():
    """apply() replaces the global TRL's heads call (idempotent), revert() puts TRL's back, applied() for a block
    (leaving it applied where it was on entering)."""
    stock = trl_utils._ChunkedLogProbFunction
    assert stock is TRLKernel and not fltrl.is_applied()
    try:
        fltrl.apply()
        fltrl.apply()
        assert trl_utils._ChunkedLogProbFunction is fltrl.ChunkedLogProbFunction and fltrl.is_applied()
        fltrl.revert()
        assert trl_utils._ChunkedLogProbFunction is stock and not fltrl.is_applied()
        fltrl.revert()  # not applied: nothing to do
        assert trl_utils._ChunkedLogProbFunction is stock
        with fltrl.applied():
            assert fltrl.is_applied()
            with fltrl.applied():
                assert fltrl.is_applied()
            assert fltrl.is_applied()
        assert trl_utils._ChunkedLogProbFunction is stock
    finally:
        fltrl.revert()


def test_revert_leaves_a_later_replacement(monkeypatch):
    """Something that replaced ours after apply() stays on revert(): it is not ours to remove."""
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", TRLKernel)  # restored last, after the test
    fltrl.apply()
    other = type("Other", (), {})
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", other)
    fltrl.revert()
    assert trl_utils._ChunkedLogProbFunction is other and not fltrl._original


@pytest.mark.parametrize("version", ["1.14.2", "1.17.0", "1.17.0.dev0", "2.0.0", "not-a-version"])
def test_unsupported_trl_version_raises(version, monkeypatch):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"supports TRL 1\.15\.x, 1\.16\.x .*TRL {version} is installed"):
        fltrl.apply()
    assert trl_utils._ChunkedLogProbFunction is TRLKernel


def test_missing_trl_raises_with_install_hint(monkeypatch):
    for name in ("trl", "trl.trainer", "trl.trainer.utils"):
        monkeypatch.setitem(sys.modules, name, None)  # what `import` finds when a package is missing
    with pytest.raises(ImportError, match=r'pip install "fusedlayers\[trl\]"'):
        fltrl.apply()


def test_import_does_not_import_trl():
    """Importing the integration costs nothing (TRL imports in seconds): TRL is imported by apply()."""
    code = ("import sys; import fusedlayers.integrations.trl as m; "
            "assert 'trl' not in sys.modules and not m.is_applied(); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# --------------------------------------------------------------------------------------------------------------
# the trainers


def _config(cls, tmp_path, **overrides):
    """Deterministic, quiet, CPU, fp32 (TRL's configs default to bf16), nothing saved; 3 steps of plain SGD (see
    test_recipes: the final weights are then linear in the gradients), gradient accumulation 2, a log each step."""
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                logging_steps=1, dataloader_num_workers=0, seed=0, data_seed=0, max_steps=STEPS, bf16=False,
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION, optim="sgd",
                learning_rate=0.1, **_checkpointing(False))
    args.update(overrides)
    return cls(**args)


def _reference_model(dtype):
    """The policy's initial weights, perturbed: log-prob ratios and rewards that are not rounding noise from the
    first step (a reference equal to the policy makes DPO's first rewards 0 +- rounding, and its accuracy a count of
    rounding signs)."""
    model = _tiny_llama()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.02)
    return model.to(dtype)


def _words(g: random.Random, low: int, high: int) -> str:
    return " ".join(g.choice(WORDS) for _ in range(g.randint(low, high)))


def _preference_data(n=16, seed=0):
    g = random.Random(seed)
    return datasets.Dataset.from_list([{"prompt": _words(g, 2, 6), "chosen": _words(g, 1, 5),
                                        "rejected": _words(g, 1, 5)} for _ in range(n)])


def _unpaired_data(n=16, seed=0):
    g = random.Random(seed)
    return datasets.Dataset.from_list([{"prompt": _words(g, 2, 6), "completion": _words(g, 1, 5),
                                        "label": i % 3 != 0} for i in range(n)])


def _prompts(n=8, seed=0):
    g = random.Random(seed)
    return datasets.Dataset.from_dict({"prompt": [_words(g, 2, 5) for _ in range(n)]})


def _reward(completions, **kwargs):
    """More "cat"s and longer completions are better."""
    return [c.split().count("cat") / max(1, len(c.split())) + 0.1 * len(c.split()) for c in completions]


def _assert_same_logs(stock_logs, fused_logs, keys=None):
    """Every numeric value the trainer logged at every step (not the timings), or those in ``keys``, up to fp32
    rounding."""
    stock_steps = [log for log in stock_logs if "loss" in log]
    fused_steps = [log for log in fused_logs if "loss" in log]
    assert len(stock_steps) == len(fused_steps) == STEPS, stock_logs
    for step, (s, f) in enumerate(zip(stock_steps, fused_steps, strict=True)):
        assert s.keys() == f.keys()
        names = [k for k in s if k not in TIMINGS and isinstance(s[k], (int, float)) and (keys is None or k in keys)]
        stock = torch.tensor([s[k] for k in names], dtype=torch.float64)
        fused = torch.tensor([f[k] for k in names], dtype=torch.float64)
        torch.testing.assert_close(fused, stock, **TOLERANCE, msg=lambda m, step=step, names=names: f"{step}: {names}: "
                                   f"{m}")


def _assert_parity_with_reference(fused_logs, stock_logs, reference_logs, fused, stock, reference):
    """The per-step losses and the final weights of the fused and stock fp32 runs against the float64 run's."""
    losses = [torch.tensor([log["loss"] for log in logs if "loss" in log], dtype=torch.float64)
              for logs in (fused_logs, stock_logs, reference_logs)]
    fused_loss, stock_loss = losses[0].float(), losses[1].float()  # the Trainer logs the fp32 loss as a Python float
    assert_parity(fused_loss, stock_loss, losses[2], "loss", floor=loss_floor(fused_loss, losses[2]))
    for (name, f), s, r in zip(fused.named_parameters(), stock.parameters(), reference.parameters(), strict=True):
        assert_parity(f.detach(), s.detach(), r.detach(), name)


def _train_runs(build, kernels, monkeypatch, apply_after_building=False, backend="auto"):
    """Stock, applied and float64 reference runs of ``build(model) -> trainer``, each from the same initial weights
    and seed: (logs, models), in that order. Asserts that the applied run made as many calls as the stock run made
    of TRL's kernel, every one to ours (none to TRL's)."""
    logs, models = [], []
    for run in ("stock", "fused", "reference"):
        model = _tiny_llama().to(torch.float64 if run == "reference" else torch.float32)
        if run == "fused" and not apply_after_building:
            fltrl.apply()
        with contextlib.ExitStack() as stack:
            if run == "reference":
                stack.enter_context(_float64_reference(monkeypatch))
            if run == "fused":
                stack.enter_context(fl.use_backend(backend))
            trainer = build(model)
            if run == "fused" and apply_after_building:
                fltrl.apply()  # the heads TRL added call the global at each call: they compute with ours all the same
            logs.append(_train(trainer))
        models.append(trainer.model)
        fltrl.revert()
        if run == "stock":
            stock_calls = kernels["trl"]
            assert stock_calls >= STEPS * ACCUMULATION and kernels["fused"] == 0
        elif run == "fused":
            assert kernels["trl"] == stock_calls and kernels["fused"] == stock_calls, kernels
            assert not fltrl.fallbacks
    return logs, models


def _assert_runs(logs, models, completions=False):
    """The applied run is the stock run (logs and weights) up to fp32 rounding, and as close to the float64 run as
    stock by the parity rule. ``completions``: the float64 run sampled the same completions (its logged completion
    lengths and rewards are the stock run's)."""
    _assert_same_logs(logs[0], logs[1])
    _assert_same_weights(models[0], models[1])
    if completions:
        _assert_same_logs(logs[0], logs[2], keys=COMPLETIONS)
    _assert_parity_with_reference(logs[1], logs[0], logs[2], models[1], models[0], models[2])


DPO_VARIANTS = {
    "sigmoid": dict(loss_type=["sigmoid"]),
    "ipo": dict(loss_type=["ipo"]),
    "sigmoid_precomputed_ref": dict(loss_type=["sigmoid"], precompute_ref_log_probs=True),
    "sigmoid_scored_positions": dict(loss_type=["sigmoid"]),  # TRL's call where it has Triton: only scored positions
    "sigmoid_triton": dict(loss_type=["sigmoid"]),  # our Triton kernels (under the interpreter on CPU)
}


@pytest.mark.parametrize("variant", list(DPO_VARIANTS))
def test_dpo_trainer(variant, kernels, monkeypatch, tmp_path):
    """DPOTrainer with a reference model (its log-probs on the fly, or precomputed over the dataset when the trainer
    is built): the policy's head asks for log_probs, entropy, mean_logits and is_top1 (its logged metrics), the
    reference's for log_probs."""
    if variant == "sigmoid_triton" and not (INTERPRETER or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 (CPU runs)")
    if variant == "sigmoid_scored_positions":
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    data = _preference_data()

    def build(model):
        args = _config(trl.DPOConfig, tmp_path, beta=0.1, dataset_num_proc=None, **DPO_VARIANTS[variant])
        return trl.DPOTrainer(model=model, ref_model=_reference_model(model.dtype), args=args, train_dataset=data,
                              processing_class=_tokenizer())

    backend = "triton" if variant == "sigmoid_triton" else "auto"
    _assert_runs(*_train_runs(build, kernels, monkeypatch, backend=backend))


def test_kto_trainer(kernels, monkeypatch, tmp_path):
    """KTOTrainer (desirable and undesirable completions, the KL reference point from mismatched pairs) with a
    reference model."""
    data = _unpaired_data()

    def build(model):
        args = _config(trl.KTOConfig, tmp_path, beta=0.1, dataset_num_proc=None)
        return trl.KTOTrainer(model=model, ref_model=_reference_model(model.dtype), args=args, train_dataset=data,
                              processing_class=_tokenizer())

    _assert_runs(*_train_runs(build, kernels, monkeypatch))


@pytest.mark.parametrize("beta", [0.0, 0.05], ids=["no_kl", "kl"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_trainer(loss_type, beta, kernels, monkeypatch, tmp_path):
    """GRPOTrainer: 4 completions of at most 6 tokens sampled per prompt at temperature 0.9 (transformers' generate,
    seeded by the Trainer: the same completions in every run), a reward function; with beta > 0 a reference model
    (which TRL loads from the policy's path) and the KL term. The policy's head asks for log_probs and entropy.
    Applied after building the trainer."""
    _tiny_llama().save_pretrained(tmp_path / "tiny")
    data = _prompts()

    def build(model):
        # from a path: TRL loads the reference model from it
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=model.dtype)
        args = _config(trl.GRPOConfig, tmp_path, loss_type=loss_type, beta=beta, num_generations=4,
                       max_completion_length=6, temperature=0.9)
        return trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                               processing_class=_tokenizer(padding_side="left"))

    _assert_runs(*_train_runs(build, kernels, monkeypatch, apply_after_building=True), completions=True)


def test_rloo_trainer(kernels, monkeypatch, tmp_path):
    """RLOOTrainer, GRPO's setting, with a KL term against the reference model."""
    _tiny_llama().save_pretrained(tmp_path / "tiny")
    data = _prompts()

    def build(model):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=model.dtype)
        args = _config(trl.RLOOConfig, tmp_path, beta=0.05, num_generations=4, max_completion_length=6,
                       temperature=0.9)
        return trl.RLOOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                               processing_class=_tokenizer(padding_side="left"))

    _assert_runs(*_train_runs(build, kernels, monkeypatch), completions=True)


def test_sft_trainer(kernels, monkeypatch, tmp_path):
    """SFTTrainer: its NLL loss is the fused head's too (and entropy, is_top1 for its metrics)."""
    g = random.Random(0)
    data = datasets.Dataset.from_dict({"text": [_words(g, 3, 14) for _ in range(32)]})

    def build(model):
        args = _config(trl.SFTConfig, tmp_path, max_length=32, dataset_num_proc=None)
        return trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer())

    _assert_runs(*_train_runs(build, kernels, monkeypatch))


# --------------------------------------------------------------------------------------------------------------
# fltrl.DPOTrainer: the DPO loss fused with the head


def _count_calls(monkeypatch, name: str) -> list:
    """The loss_type of every call of fusedlayers.post_training's ``name`` from now on."""
    from fusedlayers import post_training

    calls = []
    fused_loss = getattr(post_training, name)

    def spy(*args, **kwargs):
        calls.append(kwargs["loss_type"])
        return fused_loss(*args, **kwargs)

    monkeypatch.setattr(post_training, name, spy)
    return calls


FUSED_DPO_VARIANTS = {
    "sigmoid": dict(loss_type=["sigmoid"]),
    "ipo": dict(loss_type=["ipo"]),
    "robust_smoothed": dict(loss_type=["robust"], label_smoothing=0.1),
    "sigmoid_and_sft": dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    "sigmoid_precomputed_ref": dict(loss_type=["sigmoid"], precompute_ref_log_probs=True),
    "sigmoid_scored_positions": dict(loss_type=["sigmoid"]),  # TRL's head where it has Triton: labelled rows only
}


@pytest.mark.parametrize("variant", list(FUSED_DPO_VARIANTS))
def test_fused_dpo_trainer(variant, monkeypatch, tmp_path):
    """fltrl.DPOTrainer against trl.DPOTrainer: every logged value at every step (loss, rewards, margins,
    accuracies, log-probs, entropy, logits, token accuracy) and the final weights, and both against the float64
    stock run; every loss of the fused run came from linear_dpo_loss."""
    calls = _count_calls(monkeypatch, "linear_dpo_loss")
    if variant == "sigmoid_scored_positions":
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    data = _preference_data()
    logs, models = [], []
    for run in ("stock", "fused", "reference"):
        model = _tiny_llama().to(torch.float64 if run == "reference" else torch.float32)
        with contextlib.ExitStack() as stack:
            if run == "reference":
                stack.enter_context(_float64_reference(monkeypatch))
            args = _config(trl.DPOConfig, tmp_path, beta=0.1, dataset_num_proc=None, **FUSED_DPO_VARIANTS[variant])
            cls = fltrl.DPOTrainer if run == "fused" else trl.DPOTrainer
            trainer = cls(model=model, ref_model=_reference_model(model.dtype), args=args, train_dataset=data,
                          processing_class=_tokenizer())
            logs.append(_train(trainer))
        models.append(trainer.model)
        fltrl.revert()
        assert len(calls) == (STEPS * ACCUMULATION if run != "stock" else 0) or run == "reference", calls
        if run == "fused":
            assert isinstance(trainer, trl.DPOTrainer) and len(calls) == STEPS * ACCUMULATION
    _assert_runs(logs, models)


def _tiny_gemma2(dtype=torch.float32, perturb=False):
    """A tiny Gemma 2: its final logits soft-capped (and its attention logits), which TRL's fused head reads from
    the config; ``perturb``: the reference's weights (as :func:`_reference_model`)."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**{**CONFIG, "bos_token_id": None}, head_dim=16, final_logit_softcapping=3.0,
                                       attn_logit_softcapping=20.0, sliding_window=16, query_pre_attn_scalar=16)
    config._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(config)
    if perturb:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=0.02)
    return model.to(dtype)


def test_fused_dpo_trainer_of_a_soft_capped_model(monkeypatch, tmp_path):
    """Gemma 2 (final logits soft-capped): the fused DPO loss takes the cap TRL's head is given, and matches
    trl.DPOTrainer's logs and weights at every step."""
    calls = _count_calls(monkeypatch, "linear_dpo_loss")
    data = _preference_data()
    logs, models = [], []
    for cls in (trl.DPOTrainer, fltrl.DPOTrainer):
        args = _config(trl.DPOConfig, tmp_path, beta=0.1, dataset_num_proc=None, loss_type=["sigmoid"])
        trainer = cls(model=_tiny_gemma2(), ref_model=_tiny_gemma2(perturb=True), args=args, train_dataset=data,
                      processing_class=_tokenizer())
        logs.append(_train(trainer))
        models.append(trainer.model)
        fltrl.revert()
    assert len(calls) == STEPS * ACCUMULATION, calls
    _assert_same_logs(logs[0], logs[1])
    _assert_same_weights(models[0], models[1])


def test_fused_dpo_trainer_falls_back_where_the_fused_loss_does_not_apply(monkeypatch, tmp_path):
    """A setting the fused loss does not cover (an f-divergence other than reverse KL) runs TRL's own loss, with the
    same results as trl.DPOTrainer."""
    from fusedlayers import post_training

    monkeypatch.setattr(post_training, "linear_dpo_loss", lambda *a, **k: pytest.fail("the fused loss ran"))
    data = _preference_data()
    logs, models = [], []
    for cls in (trl.DPOTrainer, fltrl.DPOTrainer):
        model = _tiny_llama()
        args = _config(trl.DPOConfig, tmp_path, beta=0.1, dataset_num_proc=None, f_divergence_type="js_divergence")
        trainer = cls(model=model, ref_model=_reference_model(model.dtype), args=args, train_dataset=data,
                      processing_class=_tokenizer())
        logs.append(_train(trainer))
        models.append(trainer.model)
        fltrl.revert()
    _assert_same_logs(logs[0], logs[1])
    _assert_same_weights(models[0], models[1])


# --------------------------------------------------------------------------------------------------------------
# fltrl.GRPOTrainer: GRPO's loss fused with the head


@pytest.mark.parametrize("setting", [dict(loss_type="grpo", beta=0.0), dict(loss_type="dapo", beta=0.05),
                                     dict(loss_type="dr_grpo", beta=0.0, epsilon_high=0.28),
                                     dict(loss_type="bnpo", beta=0.0, importance_sampling_level="sequence")],
                         ids=["grpo", "dapo_kl", "dr_grpo", "bnpo_sequence"])
def test_fused_grpo_trainer(setting, monkeypatch, tmp_path):
    """fltrl.GRPOTrainer against trl.GRPOTrainer (the same sampled completions): every logged value at every step
    (loss, rewards, KL, entropy, clip ratios) and the final weights, and both against the float64 stock run; every
    loss of the fused run came from linear_grpo_loss."""
    calls = _count_calls(monkeypatch, "linear_grpo_loss")
    _tiny_llama().save_pretrained(tmp_path / "tiny")
    data = _prompts()
    logs, models = [], []
    for run in ("stock", "fused", "reference"):
        dtype = torch.float64 if run == "reference" else torch.float32
        with contextlib.ExitStack() as stack:
            if run == "reference":
                stack.enter_context(_float64_reference(monkeypatch))
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=dtype)
            args = _config(trl.GRPOConfig, tmp_path, num_generations=4, max_completion_length=6, temperature=0.9,
                           **setting)
            cls = fltrl.GRPOTrainer if run == "fused" else trl.GRPOTrainer
            trainer = cls(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                          processing_class=_tokenizer(padding_side="left"))
            logs.append(_train(trainer))
        models.append(trainer.model)
        fltrl.revert()
        if run == "stock":
            assert not calls
        if run == "fused":
            assert isinstance(trainer, trl.GRPOTrainer) and len(calls) >= STEPS * ACCUMULATION, calls
    _assert_runs(logs, models, completions=True)
