"""Model level: every layer choice gives its stock twin's loss and parameter gradients (float64, dropout off,
same weights and batch) in the GPT-2 shaped and the Llama shaped model, keeps its parameter names/shapes, and
stays causal."""

from __future__ import annotations

import math
import unittest.mock

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import layers
from models.callbacks import peak_flops
from models.data import CharTokenizer, RandomWindows, SequentialWindows
from models.gpt import GPT, GPTConfig
from models.layers import ATTENTION, CHECKPOINT, LOSS, REGISTRIES, SOFTMAX
from models.lit import lr_lambda

STOCK = dict(attention="stock", softmax="stock", loss="stock", quant="none", checkpoint="none")
SMALL = dict(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)  # head dim 16
# Llama shaped: 4 query heads sharing 2 key/value heads, no biases, SwiGLU width 128 (8/3 * 32 rounded up)
LLAMA = dict(SMALL, n_head=4, n_kv_head=2, bias=False, norm="rmsnorm", mlp="swiglu", position="rotary")
ARCHS = {"gpt": SMALL, "llama": LLAMA}


def stock_twin(key: str, name: str) -> str | None:
    """The stock choice computing the same math as ``name`` (None: ``name`` is stock itself, or quant, which
    changes the math on purpose). Fused norm/mlp/position choices are named ``fused_<stock twin>``."""
    if key == "quant" or name in ("stock", "none"):
        return None
    if key in ("attention", "softmax", "loss"):
        return "stock"
    if key == "checkpoint":
        return "none"
    return name.removeprefix("fused_") if name.startswith("fused_") else None


PARITY = [
    (key, name, stock_twin(key, name))
    for key, registry in REGISTRIES.items()
    for name in registry.names()
    if stock_twin(key, name) is not None
]


def _batch(B: int = 3, T: int = 16, V: int = 37, ignore: bool = True):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    if ignore:
        targets[0, :3] = -100  # ignored positions must be ignored by every loss
    return idx, targets


def assert_same_loss_and_grads(other: GPT, stock: GPT, idx, targets) -> torch.Tensor:
    """``other``'s loss and every parameter gradient equal ``stock``'s (float64 tolerances); returns other's loss."""
    loss_s, grads_s = _loss_and_grads(stock, idx, targets)
    loss_o, grads_o = _loss_and_grads(other, idx, targets)
    torch.testing.assert_close(loss_o, loss_s, rtol=1e-10, atol=1e-12)
    assert grads_o.keys() == grads_s.keys()
    for n in grads_s:
        torch.testing.assert_close(grads_o[n], grads_s[n], rtol=1e-8, atol=1e-12, msg=f"grad of {n}")
    return loss_o


def _loss_and_grads(model: GPT, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_every_fused_choice_has_a_stock_twin() -> None:
    for key in ("norm", "mlp", "position"):
        for name in REGISTRIES[key].names():
            assert not name.startswith("fused_") or name.removeprefix("fused_") in REGISTRIES[key], name
    assert {k for k, _, _ in PARITY} == {"attention", "softmax", "loss", "checkpoint", "norm", "mlp", "position"}


def _parity_cases():
    for arch, base in ARCHS.items():
        for key, name, twin in PARITY:
            if key in ("attention", "softmax", "loss", "checkpoint"):
                positions = ["learned", "rotary"] if arch == "gpt" else [base["position"]]
                yield from ((arch, key, name, twin, {"position": p}) for p in positions)
            else:  # norm / mlp / position: the stock twin's own model, in both shapes
                yield arch, key, name, twin, {}


CASES = list(_parity_cases())


@pytest.mark.parametrize(
    ("arch", "key", "name", "twin", "extra"), CASES,
    ids=[f"{a}-{k}={n}" + "".join(f"-{v}" for v in e.values()) for a, k, n, _, e in CASES],
)
def test_choice_matches_stock(arch: str, key: str, name: str, twin: str, extra: dict) -> None:
    base = {**ARCHS[arch], **STOCK, **extra}
    torch.manual_seed(0)
    stock = GPT(GPTConfig(**{**base, key: twin})).double()
    other = GPT(GPTConfig(**{**base, key: name})).double()
    other.load_state_dict(stock.state_dict())  # strict: same parameter names and shapes
    assert [(n, p.shape) for n, p in other.named_parameters()] == [
        (n, p.shape) for n, p in stock.named_parameters()
    ]
    idx, targets = _batch()
    loss_s, grads_s = _loss_and_grads(stock, idx, targets)
    loss_o, grads_o = _loss_and_grads(other, idx, targets)
    assert math.isfinite(loss_s.item()) and loss_s.item() > 1.0  # not trivially zero
    torch.testing.assert_close(loss_o, loss_s, rtol=1e-10, atol=1e-12)
    assert grads_o.keys() == grads_s.keys()
    for n in grads_s:
        assert grads_s[n].abs().max() > 0, n  # every parameter really gets a gradient
        torch.testing.assert_close(grads_o[n], grads_s[n], rtol=1e-8, atol=1e-12, msg=f"grad of {n}")
    # logits (inference path) too
    stock.eval(), other.eval()
    torch.testing.assert_close(other(idx), stock(idx), rtol=1e-10, atol=1e-12)


QUANT_STOCK = {  # name -> (bits, group size or None for per output channel): what the stock twin does
    "int8": (8, None),
    "int4": (4, 32),
}


def _stock_fake_quant(weight, bits: int, group: int | None):
    """Symmetric fake quantization in plain torch ops, as torch.fake_quantize_per_channel_affine computes it
    (round(w * (1 / scale)) half to even, clamp, straight-through estimator with the clipping mask), scale
    max|w| / ((qmax - qmin) / 2) computed in fp32 per output channel or per group. (torch's own op takes the
    inverse scale in float32, which moves float64 values near a rounding boundary; here it is float64.)"""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    w = weight.reshape(-1, group) if group else weight
    amax = w.detach().float().abs().amax(1, keepdim=True)
    scale = (amax / ((qmax - qmin) / 2)).clamp_min(torch.finfo(torch.float32).eps).to(w.dtype)
    r = torch.round(w.detach() * (1.0 / scale))
    keep = (r >= qmin) & (r <= qmax)
    wq = r.clamp(qmin, qmax) * scale + (w - w.detach()) * keep
    return wq.reshape(weight.shape)


@pytest.mark.parametrize("quant", [n for n in REGISTRIES["quant"].names() if n != "none"])
def test_quant_matches_stock_fake_quantization(quant: str) -> None:
    bits, group = QUANT_STOCK[quant]
    torch.manual_seed(0)
    stock = GPT(GPTConfig(**SMALL)).double()
    other = GPT(GPTConfig(**SMALL, quant=quant)).double()
    other.load_state_dict(stock.state_dict())
    assert [(n, p.shape) for n, p in other.named_parameters()] == [
        (n, p.shape) for n, p in stock.named_parameters()
    ]
    linears = [m for m in stock.modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 4 * SMALL["n_layer"]
    for lin in linears:  # the stock twin: every Linear computes with torch's fake-quantized weight
        lin.forward = lambda x, lin=lin: torch.nn.functional.linear(
            x, _stock_fake_quant(lin.weight, bits, group), lin.bias
        )
    idx, targets = _batch()
    loss_o = assert_same_loss_and_grads(other, stock, idx, targets)
    # and the quantization really changes the model (this is not the float model)
    plain = GPT(GPTConfig(**SMALL)).double()
    plain.load_state_dict(other.state_dict())
    assert (plain(idx, targets) - loss_o).abs() > 1e-6


def test_stock_loss_is_cross_entropy_of_the_logits() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL)).double()
    idx, targets = _batch()
    ref = torch.nn.functional.cross_entropy(model(idx).reshape(-1, SMALL["vocab_size"]), targets.reshape(-1))
    torch.testing.assert_close(model(idx, targets), ref)


@pytest.mark.parametrize("softmax", SOFTMAX.names())
@pytest.mark.parametrize("attention", ATTENTION.names())
def test_attention_is_causal(attention: str, softmax: str) -> None:
    """Changing a future token never changes the logits of earlier positions."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, attention=attention, softmax=softmax)).double().eval()
    idx, _ = _batch(ignore=False)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % SMALL["vocab_size"]
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-12)
    assert (a[:, 10] - b[:, 10]).abs().max() > 1e-6


def test_every_choice_combination_has_the_same_parameters() -> None:
    names = None
    for att in ATTENTION.names():
        for loss in LOSS.names():
            for ck in CHECKPOINT.names():
                m = GPT(GPTConfig(**SMALL, attention=att, loss=loss, checkpoint=ck))
                shapes = [(n, tuple(p.shape)) for n, p in m.named_parameters()]
                assert names is None or shapes == names
                names = shapes


@pytest.mark.parametrize("key", list(REGISTRIES))
def test_unknown_choice_lists_valid_names(key: str) -> None:
    valid = ", ".join(REGISTRIES[key].names())
    with pytest.raises(ValueError, match=f"unknown model.{key}='nope'; valid names: {valid}$"):
        GPTConfig(**SMALL, **{key: "nope"})


def test_bad_model_sizes() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(**{**SMALL, "n_head": 3})
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(**{**SMALL, "dropout": 1.5})
    with pytest.raises(ValueError, match="block_size"):
        GPT(GPTConfig(**SMALL))(torch.zeros(1, 17, dtype=torch.long))


def test_rotary_has_no_position_parameters_and_learned_has_them() -> None:
    learned = {n for n, _ in GPT(GPTConfig(**SMALL, position="learned")).named_parameters()}
    rotary = {n for n, _ in GPT(GPTConfig(**SMALL, position="rotary")).named_parameters()}
    assert learned - rotary == {"pos.wpe.weight"}


def test_rotary_is_transformers_rotate_half() -> None:
    """Our rotary choice rotates as Llama's ``apply_rotary_pos_emb`` with cos/sin of ``cat(freqs, freqs)``."""
    model = GPT(GPTConfig(**LLAMA)).double()
    q, k = torch.randn(2, 4, 16, 8, dtype=torch.float64), torch.randn(2, 2, 16, 8, dtype=torch.float64)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.outer(torch.arange(16, dtype=torch.float64), inv_freq).repeat(1, 2)

    def rotate_half(x):
        return torch.cat((-x[..., 4:], x[..., :4]), -1)

    expected = [x * angles.cos() + rotate_half(x) * angles.sin() for x in (q, k)]
    for got, want in zip(model.pos.rotate(q, k), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the stored cos/sin are float32


def test_llama_shape() -> None:
    """GQA projects n_head + 2 n_kv_head heads; SwiGLU has Llama's names and default width; RMSNorm has no bias."""
    model = GPT(GPTConfig(**LLAMA))
    block = model.blocks[0]
    assert block.attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32) and block.attn.qkv.bias is None
    assert [n for n, _ in block.mlp.named_parameters()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert block.mlp.gate_proj.weight.shape == (128, 32)  # 8/3 * 32 = 85.3, rounded up to a multiple of 64
    assert isinstance(block.ln_1, torch.nn.RMSNorm) and isinstance(model.ln_f, torch.nn.RMSNorm)
    assert GPT(GPTConfig(**{**LLAMA, "mlp_hidden": 40})).blocks[0].mlp.up_proj.weight.shape == (40, 32)
    with pytest.raises(ValueError, match=r"model.n_head \(4\) must be a multiple of model.n_kv_head \(3\)"):
        GPTConfig(**{**LLAMA, "n_kv_head": 3})
    with pytest.raises(ValueError, match="model.mlp_hidden must be a positive int or null"):
        GPTConfig(**{**LLAMA, "mlp_hidden": 0})


LLAMA_FUSED = dict(LLAMA, attention="custom", loss="fused_linear", norm="fused_rmsnorm", mlp="fused_swiglu",
                   position="fused_rotary")


class _TopLevelOps(TorchDispatchMode):
    """Records the aten/custom ops a forward+backward dispatches (an op's own insides are not seen): (name, output
    shape, output dtype) of each."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor):
            self.ops.append((str(func.overloadpacket), tuple(first.shape), first.dtype))
        return out


@pytest.mark.parametrize("norm", ["fused_rmsnorm", "fused_layernorm"])
def test_fused_model_moves_no_activation_but_the_qkv_gradient(norm: str) -> None:
    """The all-fused Llama-shaped step under (CPU) autocast runs no layout glue on the activations: no cast (the fused
    norms write the autocast dtype the matmuls read), no residual add outside the norms, no copy; its backward
    concatenates q, k and v's gradients into the projection's once per block, and sums the two gradients of the
    MLP's input (gate and up) and of the embeddings (the first block's norm input and residual); the norms write the
    gradient of their bf16 input (a block's output) directly, no cast."""
    cfg = GPTConfig(**{**LLAMA_FUSED, "norm": norm, "bias": norm == "fused_layernorm"})
    model, (idx, targets) = GPT(cfg), _batch()
    acts = {(3, 16, 32), (3, 16, 64), (3, 16, 128)}  # the residual stream, the qkv projection, the MLP's hidden
    with _TopLevelOps() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)
        forward = list(rec.ops)
        loss.backward()
    backward = rec.ops[len(forward):]
    glue = ("aten._to_copy", "aten.copy_", "aten.clone", "aten.add", "aten.add_", "aten.cat")
    assert [op for op in forward if op[0] in glue and op[1] in acts] == []
    norm_out = [op[2] for op in forward if op[0].startswith("fusedlayers.") and op[0].endswith("_norm")]
    assert norm_out == [torch.bfloat16] * (2 * cfg.n_layer + 1)
    moved = [op for op in backward if op[0] in glue and op[1] in acts]
    assert sorted(op[:2] for op in moved) == sorted(
        [("aten.cat", (3, 16, 64))] * cfg.n_layer + [("aten.add", (3, 16, 32))] * (cfg.n_layer + 1))


def test_fused_norm_autocast_output_is_what_the_matmul_reads() -> None:
    """Writing the norms' output in the autocast dtype changes nothing the matmuls see: the loss is bitwise that of the
    same model whose norms write fp32 (cast by F.linear), the gradients equal but for the order in which the MLP
    input's two gradients are summed (bf16 now, fp32 before). (The stock loss: the fused one computes bf16 matmuls in
    fp32 on a CPU, where it reads fp32 input unrounded.)"""
    torch.manual_seed(0)
    model, (idx, targets) = GPT(GPTConfig(**{**LLAMA_FUSED, "loss": "stock"})), _batch()

    def loss_and_grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    with unittest.mock.patch.object(layers, "matmul_dtype", lambda x: None):
        loss_fp32, grads_fp32 = loss_and_grads()
    assert torch.equal(loss, loss_fp32)
    # the one difference, a bf16 rounding (2**-8 relative) of a gradient sum, reaches every earlier gradient linearly:
    # each within a few such roundings of its tensor's largest element
    for g, g32 in zip(grads, grads_fp32, strict=True):
        torch.testing.assert_close(g, g32, rtol=0, atol=4 * 2**-8 * g32.abs().max().item())


@pytest.mark.parametrize("attention", ATTENTION.names())
def test_grouped_query_attention_is_repeated_heads(attention: str) -> None:
    """GQA equals multi-head attention whose key/value projection repeats each kv head's rows."""
    torch.manual_seed(0)
    gqa = GPT(GPTConfig(**{**LLAMA, "attention": attention})).double()
    mha = GPT(GPTConfig(**{**LLAMA, "n_kv_head": 4})).double()
    state = gqa.state_dict()
    for name in [n for n in state if n.endswith("attn.qkv.weight")]:
        q, k, v = state[name].split((32, 16, 16))
        state[name] = torch.cat((q, k.view(2, 8, 32).repeat_interleave(2, 0).view(32, 32),
                                 v.view(2, 8, 32).repeat_interleave(2, 0).view(32, 32)))
    mha.load_state_dict(state)
    idx, targets = _batch()
    torch.testing.assert_close(gqa(idx, targets), mha(idx, targets), rtol=1e-10, atol=1e-12)


def test_tied_embeddings_and_scaled_init() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(**{**SMALL, "n_layer": 8, "n_embd": 64})
    m = GPT(cfg)
    assert m.lm_head_weight is m.wte.weight
    std = m.blocks[0].attn.proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.002
    assert abs(m.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.002
    llama = GPT(GPTConfig(**{**LLAMA, "n_layer": 8, "n_embd": 64}))
    mlp = llama.blocks[0].mlp
    assert abs(mlp.down_proj.weight.std().item() - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.002
    assert abs(mlp.gate_proj.weight.std().item() - 0.02) < 0.002 and abs(mlp.up_proj.weight.std().item() - 0.02) < 0.002


def test_generate_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(0)
    m = GPT(GPTConfig(**SMALL)).eval()
    state = torch.get_rng_state()
    a = m.generate(torch.zeros(1, 1, dtype=torch.long), 20, generator=torch.Generator().manual_seed(3))
    b = m.generate(torch.zeros(1, 1, dtype=torch.long), 20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (1, 21)
    assert torch.equal(torch.get_rng_state(), state)
    long = m.generate(torch.zeros(1, 1, dtype=torch.long), 30, top_k=3, generator=torch.Generator())
    assert long.shape == (1, 31)  # longer than block_size: the context is cropped


def test_flops_per_token_formula() -> None:
    cfg = GPTConfig(**SMALL)
    m = GPT(cfg)
    n = sum(p.numel() for p in m.parameters())
    assert m.flops_per_token() == 6 * n + 12 * 2 * 2 * 16 * 16


def test_lr_schedule() -> None:
    lrs = [lr_lambda(s, 10, 100, 0.1) for s in range(120)]
    assert lrs[0] < lrs[5] < lrs[9] < 1.0 and abs(lrs[10] - 1.0) < 1e-12
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert abs(lrs[55] - 0.55) < 1e-12 and lrs[100] == lrs[119] == 0.1


def test_peak_flops_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert peak_flops("NVIDIA H200", "bf16-mixed") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16-mixed") == 756e12
    assert peak_flops("cpu", "bf16-mixed") is None


def test_random_windows_are_a_function_of_the_batch_index() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    seen = [0]
    w = RandomWindows(tokens, block_size=8, batch_size=4, batches_per_epoch=5, seed=7, start=lambda: seen[0])
    first = list(w)
    assert len(first) == 5
    x, y = first[0]
    assert x.shape == (4, 8) and torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
    seen[0] = 7  # resumed after 7 batches: the rest of the 2nd epoch
    rest = list(w)
    assert len(rest) == 3
    assert torch.equal(rest[0][0], w.batch(7)[0]) and not torch.equal(w.batch(7)[0], w.batch(8)[0])
    other_rank = RandomWindows(tokens, 8, 4, 5, seed=7, start=lambda: 0, rank=1)
    assert not torch.equal(other_rank.batch(0)[0], first[0][0])


def test_sequential_windows_cover_val_without_overlap() -> None:
    tokens = np.arange(100, dtype=np.uint16)
    ds = SequentialWindows(tokens, block_size=10)
    assert len(ds) == 9
    xs = torch.cat([ds[i][0] for i in range(len(ds))])
    assert torch.equal(xs, torch.arange(90))
    assert len(SequentialWindows(tokens, 10, max_windows=3)) == 3


def test_char_tokenizer_roundtrip() -> None:
    tok = CharTokenizer.train("hello world\n")
    assert tok.decode(tok.encode("hold")) == "hold" and tok.vocab_size == 9
    with pytest.raises(ValueError, match="not in the tokenizer"):
        tok.encode("z")


def test_bpe_tokenizer_roundtrip() -> None:
    pytest.importorskip("tokenizers")
    from models.data import BPETokenizer, tokenizer_from_json

    text = "In the beginning God created the heaven and the earth.\n" * 50
    tok = BPETokenizer.train(text, 300)
    ids = tok.encode("the heaven and the earth")
    assert len(ids) < len("the heaven and the earth")  # merges learned
    again = tokenizer_from_json(tok.to_json())
    assert again.decode(ids) == "the heaven and the earth"


def test_stock_paths_do_not_import_fusedlayers() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch\n"
        "from models.gpt import GPT, GPTConfig\n"
        "from models.lit import GPTLitModule\n"
        "from models.training import train\n"
        "m = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=32, position='rotary'))\n"
        "m(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).backward()\n"
        "assert 'fusedlayers' not in sys.modules, 'stock model imported fusedlayers'\n"
    )
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("position", ["learned", "rotary", "fused_rotary"])
def test_packed_documents_equal_each_document_alone(arch: str, position: str) -> None:
    """data.pack=true: documents packed in one row (cu_seqlens) give the loss and gradients of the stock model run on
    each document by itself (positions from 0, no attention across documents), token-weighted (float64)."""
    torch.manual_seed(0)
    cfg = {**ARCHS[arch], "position": position}
    packed = GPT(GPTConfig(**{**cfg, "attention": "custom"})).double()
    stock = GPT(GPTConfig(**{**cfg, "attention": "stock"})).double()
    stock.load_state_dict(packed.state_dict())
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 37, (n + 1,), generator=g) for n in (5, 1, 16, 9)]  # up to block_size tokens each
    x = torch.cat([d[:-1] for d in docs])[None]
    y = torch.cat([d[1:] for d in docs])[None]
    cu = torch.tensor([0, *torch.tensor([len(d) - 1 for d in docs]).cumsum(0).tolist()], dtype=torch.int32)
    loss_p, grads_p = _loss_and_grads_packed(packed, x, y, cu)
    stock.zero_grad(set_to_none=True)
    n_tokens = sum(len(d) - 1 for d in docs)
    loss_s = sum(stock(d[None, :-1], d[None, 1:]) * (len(d) - 1) for d in docs) / n_tokens
    loss_s.backward()
    torch.testing.assert_close(loss_p, loss_s.detach(), rtol=1e-10, atol=1e-12)
    for n, p in stock.named_parameters():
        torch.testing.assert_close(grads_p[n], p.grad, rtol=1e-8, atol=1e-12, msg=f"grad of {n}")
    # the boundaries matter: with the first two documents taken as one, the loss changes
    merged = torch.cat((cu[:1], cu[2:]))
    assert (packed(x, y, cu_seqlens=merged) - loss_p).abs() > 1e-6


def _loss_and_grads_packed(model, x, y, cu):
    model.zero_grad(set_to_none=True)
    loss = model(x, y, cu_seqlens=cu)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_packing_needs_the_custom_attention() -> None:
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match="model.attention=custom"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long),
              cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


def test_packed_documents_batches() -> None:
    """Whole documents (lines ending in the newline token), packed within the token budget, a function of the batch
    index; documents longer than block_size + 1 are cut."""
    from models.data import PackedDocuments, document_spans

    nl = 0
    lengths = [4, 1, 9, 30, 2, 6, 3]  # tokens before each newline
    tokens = np.concatenate([np.concatenate((np.arange(1, n + 1), [nl])) for n in lengths]).astype(np.uint16)
    spans = document_spans(tokens, nl, 8)
    assert (spans[:, 1] - spans[:, 0]).max() <= 8 and (spans[:, 1] - spans[:, 0]).min() >= 2
    assert spans[0].tolist() == [0, 5] and spans[1].tolist() == [5, 7]  # "1 2 3 4 \n", "1 \n"
    assert tokens[spans[:, 1] - 1].tolist().count(nl) == len(lengths)  # every line's end closes a piece
    data = PackedDocuments(tokens, nl, block_size=7, batch_size=2, batches_per_epoch=3, seed=5, start=lambda: 0)
    x, y, cu = data.batch(4)
    assert x.shape == y.shape and x.shape[0] == 1 and x.shape[1] <= 2 * 7 and cu[-1] == x.shape[1]
    docs = {tuple(tokens[a:b].tolist()) for a, b in spans}
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        assert (x[0, a].item(), *y[0, a:b].tolist()) in docs  # x and y of one whole document
        assert torch.equal(x[0, a + 1:b], y[0, a:b - 1])
    assert all(torch.equal(p, q) for p, q in zip(data.batch(4), (x, y, cu), strict=True))
    assert not torch.equal(data.batch(5)[0], x) or not torch.equal(data.batch(6)[0], x)
    # the padded baseline: one document per row, targets -100 past its end
    padded = PackedDocuments(tokens, nl, block_size=7, batch_size=3, batches_per_epoch=3, seed=5, start=lambda: 0,
                             pad=True)
    x, y = padded.batch(0)
    assert x.shape == y.shape == (3, 7)
    for row in range(3):
        n = int((y[row] != -100).sum())
        assert n >= 1 and (y[row, n:] == -100).all() and torch.equal(x[row, 1:n], y[row, :n - 1])
        assert (x[row, 0].item(), *y[row, :n].tolist()) in docs


@pytest.mark.parametrize(("attention", "softmax"), [("sdpa", "stock"), ("custom", "stock"), ("stock", "custom")])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_window_matches_stock(arch: str, attention: str, softmax: str) -> None:
    """model.window: every attention choice equals the stock attention with the window (float64), and a window
    narrower than the sequence changes the result."""
    torch.manual_seed(0)
    base = {**ARCHS[arch], "window": 4}
    stock = GPT(GPTConfig(**base)).double()
    other = GPT(GPTConfig(**{**base, "attention": attention, "softmax": softmax})).double()
    other.load_state_dict(stock.state_dict())
    idx, targets = _batch()
    loss = assert_same_loss_and_grads(other, stock, idx, targets)
    full = GPT(GPTConfig(**{**base, "window": None})).double()
    full.load_state_dict(stock.state_dict())
    assert (full(idx, targets) - loss).abs() > 1e-6
    wide = GPT(GPTConfig(**{**base, "window": 16})).double()  # as wide as the block: no window
    wide.load_state_dict(stock.state_dict())
    torch.testing.assert_close(wide(idx, targets), full(idx, targets), rtol=1e-10, atol=1e-12)


def test_window_in_packed_documents() -> None:
    torch.manual_seed(0)
    cfg = {**SMALL, "window": 3}
    packed = GPT(GPTConfig(**{**cfg, "attention": "custom"})).double()
    stock = GPT(GPTConfig(**cfg)).double()
    stock.load_state_dict(packed.state_dict())
    docs = [torch.randint(0, 37, (n + 1,), generator=torch.Generator().manual_seed(n)) for n in (9, 2, 14)]
    x, y = torch.cat([d[:-1] for d in docs])[None], torch.cat([d[1:] for d in docs])[None]
    cu = torch.tensor([0, 9, 11, 25], dtype=torch.int32)
    want = sum(stock(d[None, :-1], d[None, 1:]) * (len(d) - 1) for d in docs) / 25
    torch.testing.assert_close(packed(x, y, cu_seqlens=cu), want, rtol=1e-10, atol=1e-12)


def test_bad_window() -> None:
    with pytest.raises(ValueError, match="model.window must be an int >= 0"):
        GPTConfig(**SMALL, window=-1)
