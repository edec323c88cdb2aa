"""models/hf.py: Hugging Face transformers causal LMs trained through train.py / GPTLitModule (``model=hf``).

- the wrapper's loss is the plain transformers model's loss on the same batch (float64);
- every fused / other choice (attention, loss, checkpointing) gives the stock choice's loss and parameter
  gradients (float64, tight; the fused ops really run, with no fallback to stock);
- ``fast_dev_run`` through ``models.training.train`` with each architecture, stock and fused;
- a short run's summary, metrics, sample and checkpoint; exact resume; weights-only checkpoints whose
  hyper-parameters are plain containers; checkpoints interchange between stock and fused;
- a ``-m model.attention=stock,custom`` sweep writes its comparison; ``trainer=fsdp`` on 2 CPU processes;
- config errors name the valid choices, at startup.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip(
    "transformers", reason='needs transformers (pip install -e ".[dev]" or "fusedlayers[transformers]")'
)

from hydra import compose, initialize_config_dir  # noqa: E402

from models.hf import ARCH, HF_ATTENTION, HF_CHECKPOINT, HF_LAYERS, HF_LOSS, HFCausalLM, HFConfig  # noqa: E402
from models.lit import GPTLitModule, load_checkpoint  # noqa: E402
from models.training import train  # noqa: E402
from tests.parity import assert_parity, float64_hf_norms  # noqa: E402
from tests.test_train import FAST as GPT_FAST  # noqa: E402
from tests.test_train import make_cfg as gpt_make_cfg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "configs")
ARCHS = ARCH.names()  # llama, qwen2, qwen3, mistral, gemma, gpt2
SMALL = dict(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96)
B, T, V = 3, 16, 37
FUSED = dict(attention="custom", loss="fused_linear", layers="custom")
FAST = ["model=hf", *GPT_FAST]  # a tiny model and short epochs: each run takes seconds
FUSED_OVERRIDES = ["model.attention=custom", "model.loss=fused_linear"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("token_cache"))


def make_cfg(out: Path, cache: str, *overrides: str):
    return gpt_make_cfg(out, cache, *overrides, fast=FAST)


def _model(arch: str, **choices) -> HFCausalLM:
    """float64; the stock norms too (tests/parity.py), where ``model.layers`` is stock."""
    torch.manual_seed(0)
    model = HFCausalLM(HFConfig(arch=arch, **SMALL, **choices)).double().train()
    return float64_hf_norms(model) if model.config.layers == "stock" else model


def _batch(ignore: bool = True):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    if ignore:
        targets[0, :3] = -100  # ignored by every loss
    return idx, targets


def _loss_and_grads(model, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def calls(monkeypatch):
    """Calls of the fused ops the HF choices use, and the integration's fallbacks to stock."""
    import fusedlayers
    import fusedlayers.functional as flf
    from fusedlayers.integrations import transformers as flt

    counts = {"attention": 0, "linear_cross_entropy": 0, "cross_entropy": 0, "layers": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(flf, "scaled_dot_product_attention", counted("attention", flf.scaled_dot_product_attention))
    monkeypatch.setattr(flf, "linear_cross_entropy", counted("linear_cross_entropy", flf.linear_cross_entropy))
    monkeypatch.setattr(fusedlayers, "cross_entropy", counted("cross_entropy", fusedlayers.cross_entropy))
    for name in ("rms_norm", "layer_norm", "swiglu", "rotary_embedding"):
        monkeypatch.setattr(flf, name, counted("layers", getattr(flf, name)))
    flt.fallbacks.clear()
    yield counts
    flt.fallbacks.clear()


# ----------------------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("arch", ARCHS)
def test_wrapper_loss_is_the_plain_transformers_loss(arch) -> None:
    from transformers import AutoModelForCausalLM

    model = _model(arch)
    cfg = model.config.transformers_config()
    plain = float64_hf_norms(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double().train())
    plain.load_state_dict(model.hf.state_dict())  # strict: the same model, the same names
    assert type(plain) is type(model.hf) and type(plain).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    assert cfg.model_type == arch and cfg.vocab_size == V
    assert [n for n, _ in model.named_parameters()] == ["hf." + n for n, _ in plain.named_parameters()]
    idx, targets = _batch()
    loss = model(idx, targets)
    # our (idx, shifted targets) convention: cross entropy of every position's logits, -100 ignored (transformers'
    # loss casts the logits to fp32)
    logits = plain(input_ids=idx).logits
    want = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    # transformers' own convention: labels = the sequence, shifted inside the model
    torch.testing.assert_close(model(idx[:, :-1], idx[:, 1:]), plain(input_ids=idx, labels=idx).loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(model(idx), logits, rtol=1e-12, atol=1e-12)  # no targets: the logits
    torch.testing.assert_close(model(idx, last_only=True), logits[:, -1:], rtol=1e-12, atol=1e-12)


def test_sizes_reach_the_transformers_config() -> None:
    for arch in ARCHS:
        c = HFConfig(arch=arch, **SMALL).transformers_config()
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.max_position_embeddings) == (64, 2, 4, 16)
        assert c.vocab_size == V and c.use_cache is False
        assert c.pad_token_id is None and c.bos_token_id is None and c.eos_token_id is None
        if arch == "gpt2":  # no grouped-query attention: n_kv_head ignored
            assert c.n_inner == 96 and HFConfig(arch=arch, **SMALL).n_kv_head == 4
        else:
            assert (c.num_key_value_heads, c.intermediate_size, c.head_dim) == (2, 96, 16)
    # defaults: n_kv_head = n_head, intermediate_size = 4 n_embd; hf_config passes keywords on and wins
    c = HFConfig(
        arch="llama",
        n_embd=32,
        n_head=2,
        n_kv_head=None,
        hf_config={"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "tie_word_embeddings": True},
    ).transformers_config()
    assert (c.num_key_value_heads, c.intermediate_size, c.tie_word_embeddings) == (2, 128, True)
    assert c.rope_parameters["rope_theta"] == 500.0


PARITY = [  # every choice against all-stock, and fused attention + fused loss together
    *[dict(attention=n) for n in HF_ATTENTION.names() if n != "stock"],
    *[dict(loss=n) for n in HF_LOSS.names() if n != "stock"],
    *[dict(layers=n) for n in HF_LAYERS.names() if n != "stock"],
    *[dict(checkpoint=n) for n in HF_CHECKPOINT.names() if n != "none"],
    FUSED,
]


def _exact_loss_and_grads(model, idx, targets):
    """float64 cross entropy of the model's logits (the inference path), and the parameter gradients."""
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(idx).reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_close(choice, loss, grads, ref_loss, ref_grads) -> None:
    if choice.get("attention") == "eager":  # transformers' eager attention takes its softmax in fp32, also in fp64
        torch.testing.assert_close(loss, ref_loss, rtol=1e-8, atol=0)
        for n in ref_grads:
            atol = 2e-6 * float(ref_grads[n].abs().max())  # measured: up to 3.3e-7 of the largest, per tensor
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=atol, msg=f"grad of {n}")
        return
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-9, atol=1e-12, msg=f"grad of {n}")


@pytest.mark.parametrize("choice", PARITY, ids=[" ".join(f"{k}={v}" for k, v in c.items()) for c in PARITY])
@pytest.mark.parametrize("arch", ARCHS)
def test_choice_matches_stock(arch, choice, calls) -> None:
    """float64. (1) Attention / checkpointing: the logits and the gradients of their exact cross entropy equal
    the stock model's, tightly (``eager``: to fp32 precision, its softmax is fp32). (2) The training loss
    (``forward(idx, targets)``, the loss choice): ``fused_linear`` and ``custom`` compute in float64 and equal
    that exact loss and gradients tightly; the ``stock`` loss is transformers' own, which casts the logits to
    fp32 (also from fp64): the parity rule of tests/parity.py, fused against stock."""
    from fusedlayers.integrations import transformers as flt

    stock, other = _model(arch), _model(arch, **choice)
    assert list(other.state_dict()) == list(stock.state_dict())  # the same names: checkpoints interchange
    other.load_state_dict(stock.state_dict())
    idx, targets = _batch()
    ref_loss, ref_grads = _exact_loss_and_grads(stock, idx, targets)
    assert not any(calls.values())  # the stock model runs no fused op
    loss, grads = _exact_loss_and_grads(other, idx, targets)
    assert grads.keys() == ref_grads.keys()
    assert all(ref_grads[n].abs().max() > 0 for n in ref_grads)  # every parameter really gets a gradient
    _assert_close(choice, loss, grads, ref_loss, ref_grads)
    assert calls["attention"] == (2 if choice.get("attention") == "custom" else 0)  # our attention, both layers

    loss, grads = _loss_and_grads(other, idx, targets)
    if other.config.loss == "stock":
        stock_loss, stock_grads = _loss_and_grads(stock, idx, targets)
        assert loss.dtype == stock_loss.dtype == torch.float32  # transformers' ForCausalLMLoss
        if choice.get("attention") == "eager":
            _assert_close(choice, loss, grads, stock_loss, stock_grads)
        else:
            assert_parity(loss, stock_loss, ref_loss, "loss")
            for n in ref_grads:
                assert_parity(grads[n], stock_grads[n], ref_grads[n], f"grad of {n}")
    else:
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-9, atol=1e-12, msg=f"grad of {n}")
    # the fused ops ran, in every layer, and nothing fell back to stock
    assert calls["attention"] == (4 if choice.get("attention") == "custom" else 0)
    assert calls["linear_cross_entropy"] == (choice.get("loss") == "fused_linear")
    assert calls["cross_entropy"] == (choice.get("loss") == "custom")
    assert (calls["layers"] > 0) == (choice.get("layers") == "custom")
    assert not flt.fallbacks, dict(flt.fallbacks)
    layers = choice.get("layers") == "custom"
    assert flt.is_applied(other.hf) == {
        "attention": choice.get("attention") == "custom",
        "loss": choice.get("loss") == "fused_linear",
        "norm": layers, "mlp": layers, "rotary": layers, "cast_once": layers,
    }


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_is_the_gpts_sampler_on_the_hf_logits(arch) -> None:
    model = _model(arch, **FUSED).float().eval()
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    rng = torch.get_rng_state()
    a = model.generate(prompt, 20, 0.8, None, torch.Generator().manual_seed(0))  # past block_size: cropped
    b = model.generate(prompt, 20, 0.8, None, torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    assert a.shape == (2, 25) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)
    assert int(a.min()) >= 0 and int(a.max()) < V
    # top_k=1 is greedy: transformers' own greedy generate (within block_size) gives the same tokens
    greedy = model.generate(prompt, 8, 1.0, 1)
    want = model.hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy, want)


def test_flops_per_token_counts_the_head_not_the_input_embeddings() -> None:
    untied, tied = _model("llama"), _model("gpt2")  # llama: own lm_head; gpt2: tied to wte, plus wpe
    n = sum(p.numel() for p in untied.parameters())
    attn = 12 * 2 * 4 * 16 * 16  # 12 L H Q T
    assert untied.flops_per_token() == 6 * (n - V * 64) + attn
    n = sum(p.numel() for p in tied.parameters())  # wte counted once (it is the head); wpe is a lookup
    assert tied.flops_per_token() == 6 * (n - 16 * 64) + attn
    assert tied.flops_per_token(seq_len=8) == 6 * (n - 16 * 64) + attn // 2


def test_compile_leaves_the_fused_loss_eager() -> None:
    """``compile=true``: the whole wrapper, or with ``fused_linear`` the base model only (dynamo does not trace the
    fused loss's swap of the LM head's forward). In place: the names do not change."""
    for loss, whole in (("stock", True), ("fused_linear", False)):
        model = _model("llama", loss=loss)
        names = list(model.state_dict())
        model.compile()
        assert (model._compiled_call_impl is not None) == whole
        assert (model.hf.base_model._compiled_call_impl is not None) != whole
        assert list(model.state_dict()) == names


# ------------------------------------------------------------------------------------- training (train.py)
@pytest.mark.parametrize("fused", [False, True], ids=["stock", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fast_dev_run_each_arch(arch, fused, tmp_path, cache_dir) -> None:
    s = train(make_cfg(tmp_path, cache_dir, f"model.arch={arch}", "trainer.fast_dev_run=true",
                       *(FUSED_OVERRIDES if fused else [])))  # fmt: skip
    assert s["status"] == "completed" and s["steps"] == 1
    assert 0 < s["train_loss"] < 10 and 0 < s["val_loss"] < 10 and s["sample"]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_run_resume_metrics_and_weights_only_checkpoints(tmp_path, cache_dir) -> None:
    common = ["trainer.max_steps=6", "callbacks.model_checkpoint.save_top_k=-1", "model.dropout=0.1",
              "callbacks.throughput.skip_steps=1", "callbacks.throughput.peak_flops=1e12"]  # fmt: skip
    full = train(make_cfg(tmp_path / "full", cache_dir, *common))
    assert full["status"] == "completed" and full["steps"] == 6 and [st for st, _ in full["val_history"]] == [3, 6]
    assert full["tokens_per_s"] > 0 and full["mfu"] > 0 and full["peak_mem_gb"] > 0 and full["sample"]
    assert full["val_loss"] < full["unigram_baseline"] + 1.5
    with (tmp_path / "full" / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("perf/mfu") for r in rows) and any(r.get("val/ppl") for r in rows)
    assert "=== step 3" in (tmp_path / "full" / "csv" / "samples.txt").read_text()

    # weights only: tensors and plain containers (the HF model's own keys under `model.hf.`)
    last = tmp_path / "full" / "checkpoints" / "last.ckpt"
    state = load_checkpoint(last)
    hp = state["hyper_parameters"]
    assert type(hp["model"]) is dict and type(hp["model"]["hf_config"]) is dict and hp["model"]["arch"] == "llama"
    assert "model.hf.model.layers.0.self_attn.q_proj.weight" in state["state_dict"]
    module = GPTLitModule.load_from_checkpoint(last, map_location="cpu")
    assert isinstance(module.model, HFCausalLM)

    # resume from step 3: the same weights, optimizer state and val losses as the uninterrupted run
    ckpt3 = next((tmp_path / "full" / "checkpoints").glob("step000003-*.ckpt"))
    resumed = train(make_cfg(tmp_path / "resumed", cache_dir, *common, f"ckpt_path={ckpt3}"))
    assert resumed["steps"] == 6 and resumed["val_history"] == full["val_history"]
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    for k, v in state["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k
    oa, ob = state["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    for k in oa:
        assert torch.equal(oa[k]["exp_avg"], ob[k]["exp_avg"]), k


def test_checkpoints_interchange_between_stock_and_fused(tmp_path, cache_dir) -> None:
    stock = train(make_cfg(tmp_path / "stock", cache_dir, "trainer.max_steps=3"))
    fused = train(make_cfg(tmp_path / "fused", cache_dir, "trainer.max_steps=3", *FUSED_OVERRIDES))
    idx = torch.randint(0, stock["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    for path, other in ((stock["checkpoint"], FUSED), (fused["checkpoint"], dict(attention="stock", loss="stock"))):
        saved = GPTLitModule.load_from_checkpoint(path, map_location="cpu").eval()
        hp = load_checkpoint(path)["hyper_parameters"]
        swapped = GPTLitModule.load_from_checkpoint(path, map_location="cpu", model={**hp["model"], **other}).eval()
        assert swapped.model.config.attention == other["attention"] != saved.model.config.attention
        with torch.no_grad():
            torch.testing.assert_close(swapped(idx, idx), saved(idx, idx), rtol=1e-5, atol=1e-6)
    # and training resumes across the choice: stock checkpoint -> fused run, fused checkpoint -> stock run
    r = train(make_cfg(tmp_path / "s2f", cache_dir, "trainer.max_steps=5", *FUSED_OVERRIDES,
                       f"ckpt_path={stock['checkpoint']}"))  # fmt: skip
    assert r["status"] == "completed" and r["steps"] == 5
    r = train(make_cfg(tmp_path / "f2s", cache_dir, "trainer.max_steps=5", f"ckpt_path={fused['checkpoint']}"))
    assert r["status"] == "completed" and r["steps"] == 5


def test_sweep_compares_stock_and_fused(tmp_path, cache_dir) -> None:
    sweep = tmp_path / "sweep"
    res = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "model.attention=stock,custom", *FAST, "trainer.max_steps=3",
         "callbacks.throughput.skip_steps=1", f"paths.cache_dir={cache_dir}", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with (sweep / "comparison.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [("model.attention=custom" in r["overrides"]) for r in rows] == [False, True]
    for r in rows:
        assert r["status"] == "completed" and r["steps"] == "3" and float(r["tokens_per_s"]) > 0
    assert "model.attention=custom" in (sweep / "comparison.md").read_text() and (sweep / "val_loss.png").exists()
    # the same weights and batches: the same losses (fp32)
    assert abs(float(rows[0]["val_loss"]) - float(rows[1]["val_loss"])) < 1e-4


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)
def test_fsdp_two_processes_match_one(tmp_path, cache_dir) -> None:
    """``trainer=fsdp`` on 2 CPU processes (``HFCausalLM.shard``: each decoder layer a unit) with the fused
    choices: the losses and the gathered checkpoint of one process with the same global batch."""
    common = [*FAST, *FUSED_OVERRIDES, "trainer.max_steps=3", f"paths.cache_dir={cache_dir}"]
    res = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *common, "trainer=fsdp", "trainer.accelerator=cpu",
         "trainer.devices=2", "trainer.precision=32-true", f"hydra.run.dir={tmp_path / 'fsdp'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    two = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    one = train(make_cfg(tmp_path / "one", cache_dir, *FUSED_OVERRIDES, "trainer.max_steps=3", "data.batch_size=8"))
    assert two["world_size"] == 2 and two["steps"] == one["steps"] == 3
    torch.testing.assert_close(two["val_loss"], one["val_loss"], rtol=1e-5, atol=0)
    a, b = load_checkpoint(two["checkpoint"])["state_dict"], load_checkpoint(one["checkpoint"])["state_dict"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def test_default_hf_config() -> None:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model=hf"])
    m = cfg.model
    assert (m.arch, m.n_embd, m.n_layer, m.n_head, m.n_kv_head, m.block_size) == ("llama", 128, 4, 4, 2, 128)
    assert (m.attention, m.loss, m.checkpoint) == ("stock", "stock", "none") and cfg.data.block_size == 128
    for arch in ARCHS:  # every architecture builds from the default sizes
        HFConfig.from_dict({**m, "arch": arch, "hf_config": {}})


def test_config_errors_name_the_valid_choices(tmp_path, cache_dir) -> None:
    for key, registry in (("arch", ARCH), ("attention", HF_ATTENTION), ("loss", HF_LOSS),
                          ("checkpoint", HF_CHECKPOINT)):  # fmt: skip
        valid = ", ".join(registry.names())
        with pytest.raises(ValueError, match=f"unknown model.{key}='nope'; valid names: {valid}"):
            train(make_cfg(tmp_path, cache_dir, f"model.{key}=nope"))
    bad = {
        "model.n_head=3": r"model.n_embd \(32\) must be divisible by model.n_head \(3\)",
        "model.n_kv_head=3": r"model.n_head \(2\) must be a multiple of model.n_kv_head \(3\)",
        "model.n_layer=0": "model.n_layer must be a positive int, got 0",
        "model.intermediate_size=-1": "model.intermediate_size must be a positive int",
        "model.dropout=1.5": r"model.dropout must be in \[0, 1\)",
        "+model.softmax=custom": "unknown key.* model.softmax for an HF model .*valid keys: arch, ",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError, match=message):
            train(make_cfg(tmp_path, cache_dir, override))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert not (tmp_path / "checkpoints").exists()  # at startup: nothing ran
