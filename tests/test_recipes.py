"""Recipes that are tests: fusedlayers in the Hugging Face training stacks is one line, and changes nothing else.

    from fusedlayers.integrations import transformers as flt

    # transformers.Trainer: apply before building the Trainer
    model = flt.apply(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)

    # TRL's SFTTrainer: the same line, before building the trainer (attention, norms, MLP and rotary fused; TRL
    # computes the loss with its own chunked LM head, which it adds to the model)
    model = flt.apply(model)
    trainer = trl.SFTTrainer(model=model, args=sft_config, train_dataset=dataset, processing_class=tokenizer)

    # a plain Accelerate loop: apply before accelerator.prepare
    model = flt.apply(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    # loading: in place of AutoModelForCausalLM
    model = flt.AutoFusedModelForCausalLM.from_pretrained(path)

Each test trains a tiny randomly initialised Llama (from a config, no download; fp32 on CPU) for a few optimizer steps
twice from the same initial weights -- the stock model (SDPA attention), and the same model applied -- and asserts
that the fused ops ran (their calls counted) and that the per-step losses, the per-step gradient norms and the final
weights are the stock run's, up to fp32 rounding (see TOLERANCE).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="4.54")

from fusedlayers.integrations import transformers as flt  # noqa: E402  (after the skip: it needs transformers)

PAD, EOS = 0, 1
WORDS = ("the a cat dog bird fish sat ran flew swam on under over near mat log tree pond big small red blue green "
         "and then it was very quite happy sad").split()
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64, attention_dropout=0.0, pad_token_id=PAD, eos_token_id=EOS,
              bos_token_id=None)
LAYERS = CONFIG["num_hidden_layers"]
STEPS, BATCH, ACCUMULATION = 3, 4, 2
MICRO_BATCHES = STEPS * ACCUMULATION

# Tolerances. The two runs compute the same functions; only the order of fp32 roundings differs (the fused ops
# accumulate blockwise, in other orders than MKL's matmuls and torch's SDPA): losses, gradient norms and TRL's
# metrics agree to about 1e-7 relative (observed <= 2e-7), inside assert_close's fp32 defaults (rtol 1.3e-6,
# atol 1e-5; a loss 1e-5 off, relative, fails them). The optimizer is plain SGD (lr 0.1: the weights move by ~1e-2 in
# 3 steps) so that the final weights are w0 - lr * (sum of gradients), linear in the gradients: they agree to a few
# ulps (observed <= 1.2e-7 on the norms' weights of ~1, one ulp; <= 1.2e-8 on the others, of ~0.02). rtol 1e-5 with
# atol 1e-6 (8 ulps of 1.0, 1e-4 of the distance moved) is a fp32-rounding bound with a margin of ~100x, which a
# wrong gradient (a missing factor, a token counted twice, a document seeing another) cannot meet.
# Not AdamW: Adam divides each element's step by the root of its squared gradients, so an element whose gradient
# nearly cancels gets a step of about lr whatever its size, and rounding-level differences in it become differences
# of a sizeable fraction of lr (observed up to 2.2e-5 after 3 steps at lr 1e-3, stock against fused; Adam also hides
# a wrong scale of the loss, which SGD's weights show).
TOLERANCE = dict(rtol=1.3e-6, atol=1e-5)  # losses, gradient norms: assert_close's fp32 defaults
WEIGHT_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
OPTIMIZER = dict(optim="sgd", learning_rate=0.1)


# --------------------------------------------------------------------------------------------------------------
# the pieces: a model, a tokenizer, data


def _tiny_llama():
    """A tiny randomly initialised Llama with stock (SDPA) attention, fp32, no dropout."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def _pair():
    """(stock model, applied model): the same initial weights."""
    model = _tiny_llama()
    applied = flt.apply(copy.deepcopy(model))
    assert all(flt.is_applied(applied).values()) and not any(flt.is_applied(model).values())
    return model, applied


def _tokenizer(padding_side: str = "right"):
    """A word-level tokenizer built in-process (no download): <pad> 0, <eos> 1, <unk> 2, then WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    assert len(vocab) <= CONFIG["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>", padding_side=padding_side)


def _texts(n: int = 24, seed: int = 0) -> list[str]:
    """n sentences of 3 to 14 words (so batches need padding)."""
    g = random.Random(seed)
    return [" ".join(g.choice(WORDS) for _ in range(g.randint(3, 14))) for _ in range(n)]


def _tokenized(tokenizer, n: int = 24) -> list[dict]:
    return [{"input_ids": tokenizer(text)["input_ids"] + [EOS]} for text in _texts(n)]


def _assert_same_weights(stock, fused, **tolerance):
    for (name, p), (fused_name, q) in zip(stock.named_parameters(), fused.named_parameters(), strict=True):
        assert name == fused_name
        torch.testing.assert_close(q, p, **(tolerance or WEIGHT_TOLERANCE), msg=lambda m, name=name: f"{name}: {m}")


def _assert_same_logs(stock_logs, fused_logs, keys=("loss", "grad_norm"), **tolerance):
    """The per-step values the Trainer logged (logging_steps=1)."""
    for key in keys:
        stock = torch.tensor([log[key] for log in stock_logs if key in log], dtype=torch.float64)
        fused = torch.tensor([log[key] for log in fused_logs if key in log], dtype=torch.float64)
        assert len(stock) == STEPS, (key, stock_logs)
        torch.testing.assert_close(fused, stock, **(tolerance or TOLERANCE), msg=lambda m, key=key: f"{key}: {m}")


@pytest.fixture
def calls(monkeypatch):
    """Calls of the fused functions (looked up at call time by the integration); linear_cross_entropy's `reduction`s
    ("sum" where the Trainer passed num_items_in_batch). Clears flt.fallbacks; restores transformers' rotary function
    (which apply replaces in the modeling module while an applied model lives) afterwards."""
    import fusedlayers.functional as flf

    counts = {"linear_cross_entropy": [], "scaled_dot_product_attention": 0, "varlen_attention": 0, "rms_norm": 0,
              "swiglu": 0, "rotary_embedding": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            if name == "linear_cross_entropy":
                counts[name].append(kwargs.get("reduction", "mean"))
            else:
                counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in counts:
        monkeypatch.setattr(flf, name, counted(name, getattr(flf, name)))
    flt.fallbacks.clear()
    yield counts
    flt.fallbacks.clear()
    for name, (stock_rotary, _) in list(flt._rotary_patches.items()):
        sys.modules[name].apply_rotary_pos_emb = stock_rotary
        del flt._rotary_patches[name]


# --------------------------------------------------------------------------------------------------------------
# transformers.Trainer


def _training_arguments(tmp_path, cls=None, **overrides):
    """Deterministic, quiet, CPU, nothing saved or reported; 3 optimizer steps of SGD, a log (loss, grad_norm) each."""
    cls = cls or transformers.TrainingArguments
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                logging_steps=1, dataloader_num_workers=0, seed=0, data_seed=0, max_steps=STEPS,
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION, **OPTIMIZER)
    args.update(overrides)
    return cls(**args)


def _checkpointing(on: bool = True) -> dict:
    """Activation checkpointing: `activation_checkpointing` from transformers 5.x on (`gradient_checkpointing` is its
    deprecated alias there), `gradient_checkpointing` before."""
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def _is_checkpointing(model) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):  # transformers 5.x (is_gradient_checkpointing: deprecated)
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def _forwards(model) -> list:
    """One entry per forward of the model's backbone: the micro-batches trained on."""
    seen = []
    model.get_decoder().register_forward_pre_hook(lambda module, args: seen.append(None))
    return seen


def _train(trainer) -> list[dict]:
    trainer.remove_callback(transformers.PrinterCallback)  # disable_tqdm=True prints every log otherwise
    trainer.train()
    return trainer.state.log_history


def _trainer_run(model, tmp_path, data, collator, **overrides):
    args = _training_arguments(tmp_path, **overrides)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    return _train(trainer), trainer


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_trainer_left_padding_gradient_accumulation(checkpointing, calls, tmp_path):
    """transformers.Trainer, gradient accumulation 2, left-padded batches from
    DataCollatorForLanguageModeling(mlm=False) (labels = input ids, -100 on padding): the Trainer passes
    num_items_in_batch, so each micro-batch's loss is its summed token loss over the tokens of the whole accumulated
    batch -- the fused loss computes exactly that (reduction "sum", one call per micro-batch). With activation
    checkpointing every layer's fused ops run twice (forward, and the recompute in backward)."""
    tokenizer = _tokenizer(padding_side="left")
    data = _tokenized(tokenizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    assert collator(data[:BATCH])["attention_mask"][:, 0].eq(0).any()  # left padding
    stock, fused = _pair()

    stock_logs, stock_trainer = _trainer_run(stock, tmp_path, data, collator, **_checkpointing(checkpointing))
    assert not any(calls.values())
    fused_logs, fused_trainer = _trainer_run(fused, tmp_path, data, collator, **_checkpointing(checkpointing))

    assert stock_trainer.model_accepts_loss_kwargs and fused_trainer.model_accepts_loss_kwargs  # num_items_in_batch
    assert calls["linear_cross_entropy"] == ["sum"] * MICRO_BATCHES
    passes = 2 if checkpointing else 1  # forward, and the recompute in backward
    assert calls["scaled_dot_product_attention"] == calls["rotary_embedding"] == passes * LAYERS * MICRO_BATCHES
    assert calls["swiglu"] == passes * LAYERS * MICRO_BATCHES
    assert calls["rms_norm"] == (passes * 2 * LAYERS + 1) * MICRO_BATCHES
    assert not calls["varlen_attention"] and not flt.fallbacks
    assert _is_checkpointing(stock) == _is_checkpointing(fused) == checkpointing
    _assert_same_logs(stock_logs, fused_logs)
    _assert_same_weights(stock, fused)


def test_trainer_bf16_cast_once_is_stock(calls, tmp_path, monkeypatch):
    """Trainer's mixed precision (``bf16=True``: fp32 weights, the step under bf16 autocast) with ``cast_once``: each
    layer's q/k/v and gate/up read one bf16 copy of their input, and three steps with gradient accumulation log the
    stock losses and gradient norms and end at the stock weights, bit for bit (the tiny model's inputs are below the
    size where sharing is switched on by default: the threshold is off here)."""
    monkeypatch.setattr(flt, "CAST_ONCE_MIN_ELEMENTS", 0)
    made = []
    shared_cast = flt._SharedCast.apply
    monkeypatch.setattr(flt._SharedCast, "apply", lambda *a: (made.append(a[1]), shared_cast(*a))[1])
    tokenizer = _tokenizer(padding_side="left")
    data = _tokenized(tokenizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    stock = _tiny_llama()
    fused = flt.apply(copy.deepcopy(stock), **{**dict.fromkeys(flt._PARTS, False), "cast_once": True})

    stock_logs, _ = _trainer_run(stock, tmp_path, data, collator, bf16=True)
    assert not made
    fused_logs, _ = _trainer_run(fused, tmp_path, data, collator, bf16=True)
    assert made == [torch.bfloat16] * 2 * LAYERS * MICRO_BATCHES  # attention and MLP of every layer, every forward
    _assert_same_logs(stock_logs, fused_logs, rtol=0, atol=0)
    _assert_same_weights(stock, fused, rtol=0, atol=0)


def test_trainer_padding_free_flattening(calls, tmp_path):
    """Padding-free packing with transformers.DataCollatorWithFlattening: each batch is one row of documents with
    position_ids restarting; transformers builds a block-diagonal causal mask (stock SDPA reads it), the fused attention
    runs fl.varlen_attention on the documents instead (no mask). Gradient accumulation 2, num_items_in_batch."""
    tokenizer = _tokenizer()
    data = _tokenized(tokenizer)
    collator = transformers.DataCollatorWithFlattening()
    batch = collator(data[:BATCH])
    assert batch["input_ids"].shape[0] == 1 and batch["position_ids"].eq(0).sum() == BATCH
    stock, fused = _pair()

    stock_logs, _ = _trainer_run(stock, tmp_path, data, collator)
    fused_logs, _ = _trainer_run(fused, tmp_path, data, collator)

    assert calls["varlen_attention"] == LAYERS * MICRO_BATCHES and not calls["scaled_dot_product_attention"]
    assert calls["linear_cross_entropy"] == ["sum"] * MICRO_BATCHES and not flt.fallbacks
    _assert_same_logs(stock_logs, fused_logs)
    _assert_same_weights(stock, fused)


def test_auto_fused_from_pretrained_with_trainer(calls, tmp_path):
    """flt.AutoFusedModelForCausalLM.from_pretrained(path) trains exactly as
    flt.apply(AutoModelForCausalLM.from_pretrained(path)) (the same ops on the same numbers: bitwise), and as the stock
    loaded model up to rounding."""
    _tiny_llama().save_pretrained(tmp_path / "tiny")
    tokenizer = _tokenizer(padding_side="left")
    data = _tokenized(tokenizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)

    loaded = flt.AutoFusedModelForCausalLM.from_pretrained(tmp_path / "tiny")
    applied = flt.apply(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny"))
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    assert all(flt.is_applied(loaded).values()) and loaded.dtype == stock.dtype == torch.float32
    assert loaded.config._attn_implementation == flt.NAME and stock.config._attn_implementation == "sdpa"

    logs = [_trainer_run(model, tmp_path, data, collator)[0] for model in (loaded, applied, stock)]

    assert calls["linear_cross_entropy"] == ["sum"] * 2 * MICRO_BATCHES and not flt.fallbacks
    _assert_same_logs(logs[1], logs[0], rtol=0, atol=0)
    _assert_same_weights(applied, loaded, rtol=0, atol=0)
    _assert_same_logs(logs[2], logs[0])
    _assert_same_weights(stock, loaded)


# --------------------------------------------------------------------------------------------------------------
# TRL's SFTTrainer


SFT_MODES = {
    "padding": dict(max_length=32),
    "packing": dict(packing=True, max_length=32),  # best-fit decreasing packing: padding-free rows of documents
    "padding_free": dict(padding_free=True, max_length=None),  # no packing: each batch flattened into one row
}


@pytest.mark.parametrize("mode", list(SFT_MODES))
def test_sft_trainer(mode, calls, tmp_path, request):
    """TRL's SFTTrainer on a text dataset (tokenized by SFTTrainer with an in-process tokenizer, EOS appended), with
    padding, packing and padding-free batches; gradient accumulation 2, activation checkpointing on (TRL's default,
    given explicitly), fp32 (bf16=False: TRL's default is bf16).

    SFTTrainer computes the loss itself: it gives the model its own chunked LM head (trl's add_fused_lm_head) and calls
    the model with fused_lm_head=True, which runs the backbone and never the model's causal-LM loss -- so the fused
    loss does not run here (nor do the logits exist: TRL does not build them either); the fused attention, norms, MLP
    and rotary do, in the backbone."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    if datasets.is_progress_bar_enabled():  # SFTTrainer's dataset preparation (Dataset.map) shows progress bars
        datasets.disable_progress_bars()
        request.addfinalizer(datasets.enable_progress_bars)

    dataset = datasets.Dataset.from_dict({"text": _texts(32)})
    stock, fused = _pair()
    logs, forwards = [], []
    for model in (stock, fused):
        args = _training_arguments(tmp_path, cls=trl.SFTConfig, bf16=False, dataset_num_proc=None,
                                   **_checkpointing(True), **SFT_MODES[mode])
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer())
        assert trainer.padding_free == (mode != "padding")
        forwards.append(_forwards(model))
        logs.append(_train(trainer))
        if model is stock:
            assert not any(calls.values())

    # the micro-batches trained on: 6, but 5 when packing (10 rows of 32 tokens: 3 micro-batches an epoch)
    micro_batches = len(forwards[1])
    assert micro_batches == len(forwards[0]) >= STEPS
    assert _is_checkpointing(stock) and _is_checkpointing(fused)
    assert not calls["linear_cross_entropy"]  # TRL's own loss (see the docstring)
    attention = "scaled_dot_product_attention" if mode == "padding" else "varlen_attention"
    other = "varlen_attention" if mode == "padding" else "scaled_dot_product_attention"
    assert calls[attention] == 2 * LAYERS * micro_batches and not calls[other]  # forward and recompute
    assert calls["rotary_embedding"] == calls["swiglu"] == 2 * LAYERS * micro_batches and not flt.fallbacks
    _assert_same_logs(logs[0], logs[1], keys=("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"))
    _assert_same_weights(stock, fused)


@pytest.mark.parametrize("when", ["apply_after", "revert_after"])
def test_sft_trainer_apply_or_revert_after_building(when, calls, tmp_path, request):
    """SFTTrainer wraps the model's forward when it is built. Applying after that wraps TRL's forward in ours (which
    passes TRL's fused_lm_head calls through), and reverting after that leaves TRL's forward in place (ours, which it
    calls, then passes everything to stock): both train as the stock model does, with the parts applied or not."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    if datasets.is_progress_bar_enabled():
        datasets.disable_progress_bars()
        request.addfinalizer(datasets.enable_progress_bars)

    dataset = datasets.Dataset.from_dict({"text": _texts(32)})
    stock, fused = _pair()
    if when == "apply_after":
        flt.revert(fused)
    logs = []
    for model in (stock, fused):
        args = _training_arguments(tmp_path, cls=trl.SFTConfig, bf16=False, dataset_num_proc=None,
                                   **_checkpointing(False), **SFT_MODES["padding"])
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer())
        if model is fused:
            flt.apply(model) if when == "apply_after" else flt.revert(model)
        logs.append(_train(trainer))
    applied = when == "apply_after"
    assert flt.is_applied(fused) == dict.fromkeys(flt._PARTS, applied)
    assert bool(calls["scaled_dot_product_attention"]) == applied and not calls["linear_cross_entropy"]
    _assert_same_logs(logs[0], logs[1], keys=("loss", "grad_norm"))
    _assert_same_weights(stock, fused)


# --------------------------------------------------------------------------------------------------------------
# a plain Accelerate loop


def _accelerate_run(model, data, collator) -> torch.Tensor:
    """Accelerate's documented loop: prepare, accumulate 2 micro-batches, accelerator.backward. The losses of every
    micro-batch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False, collate_fn=collator)
    optimizer = torch.optim.SGD(model.parameters(), lr=OPTIMIZER["learning_rate"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    try:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
    finally:  # Accelerate's state is process-wide: leave none behind for the next test
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return torch.stack(losses)


def test_accelerate_loop(calls):
    """A plain Accelerate training loop (CPU, gradient accumulation 2 through accelerator.accumulate, right-padded
    batches): each micro-batch's mean loss, fused, and the weights after it, as stock's."""
    pytest.importorskip("accelerate")
    tokenizer = _tokenizer()
    data = _tokenized(tokenizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    stock, fused = _pair()

    stock_losses = _accelerate_run(stock, data, collator)
    fused_losses = _accelerate_run(fused, data, collator)

    assert len(fused_losses) == len(data) // BATCH == MICRO_BATCHES
    assert calls["linear_cross_entropy"] == ["mean"] * MICRO_BATCHES and not flt.fallbacks
    assert calls["scaled_dot_product_attention"] == LAYERS * MICRO_BATCHES
    torch.testing.assert_close(fused_losses, stock_losses, **TOLERANCE)
    _assert_same_weights(stock, fused)
