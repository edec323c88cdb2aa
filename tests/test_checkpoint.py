"""fl.checkpoint / fl.CheckpointedBlock: exact gradients, RNG/autocast/module state, policies, DDP.

Gradients are compared bitwise (torch.equal) against the same block run without checkpointing: the
recompute runs the very same kernels on the very same inputs, so anything but equality is a bug.
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import os
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlayers as fl
from fusedlayers.ops import checkpoint as ckpt

aten = torch.ops.aten
POLICIES = ["full", "selective"]


class Block(nn.Module):
    """A small pre-LN GPT block (SDPA attention, GELU MLP) with dropout everywhere."""

    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.25, attn_p: float | None = None) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.attn_p = p if attn_p is None else attn_p
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.attn_p if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


def grads_of(tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def assert_equal_lists(got, want, what="gradient"):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, f"{what} {i}: expected None"
        else:
            assert g is not None, f"{what} {i}: missing"
            assert torch.equal(g, w), f"{what} {i}: max diff {(g.double() - w.double()).abs().max().item():.3e}"


def train_step(fn, block, x, seed=1):
    """Forward + backward of fn(x) under a fixed seed: (output, grads of x and params, next random draw)."""
    for t in [x, *block.parameters()]:
        t.grad = None
    torch.manual_seed(seed)
    y = fn(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), grads_of([x, *block.parameters()]), torch.rand(3)


def make_block(**kw):
    torch.manual_seed(0)
    return Block(**kw), torch.randn(2, 8, 16, requires_grad=True)


# ----------------------------------------------------------------------------- exact gradients


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("api", ["function", "module"])
def test_bitwise_gradients_with_dropout(policy, api):
    block, x = make_block()
    want = train_step(block, block, x)
    fn = (lambda t: fl.checkpoint(block, t, policy=policy)) if api == "function" else \
        fl.CheckpointedBlock(block, policy=policy)
    got = train_step(fn, block, x)
    assert torch.equal(got[0], want[0])
    assert_equal_lists(got[1], want[1])
    # the recompute does not move the global RNG: later random draws are those of the unwrapped run
    assert torch.equal(got[2], want[2])


def test_preserve_rng_state_false_gives_other_gradients():
    block, x = make_block()
    want = train_step(block, block, x)
    got = train_step(lambda t: fl.checkpoint(block, t, preserve_rng_state=False), block, x)
    assert torch.equal(got[0], want[0])  # the forward is the same...
    # ...but the recompute draws other dropout masks, so the gradients differ (the flag matters)
    assert not all(torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True))
    # and with dropout off the flag changes nothing
    block.eval()
    want = train_step(block, block, x)
    got = train_step(lambda t: fl.checkpoint(block, t, preserve_rng_state=False), block, x)
    assert_equal_lists(got[1], want[1])


@pytest.mark.parametrize("policy", POLICIES)
def test_autograd_grad(policy):
    block, x = make_block()
    params = list(block.parameters())
    torch.manual_seed(1)
    want = torch.autograd.grad(block(x).square().sum(), [x, *params])
    torch.manual_seed(1)
    got = torch.autograd.grad(fl.checkpoint(block, x, policy=policy).square().sum(), [x, *params])
    assert_equal_lists(list(got), list(want))
    assert all(p.grad is None for p in params) and x.grad is None
    # a subset of the inputs only
    torch.manual_seed(1)
    (gx,) = torch.autograd.grad(fl.checkpoint(block, x, policy=policy).square().sum(), [x])
    assert torch.equal(gx, want[0])


@pytest.mark.parametrize("policy", POLICIES)
def test_inputs_without_grad_still_give_parameter_gradients(policy):
    block, x = make_block()
    x = x.detach()
    want = train_step(block, block, x)
    got = train_step(lambda t: fl.checkpoint(block, t, policy=policy), block, x)
    assert got[1][0] is None and want[1][0] is None
    assert all(g is not None for g in got[1][1:])
    assert_equal_lists(got[1], want[1])


def test_kwargs_and_structured_outputs():
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    x = torch.randn(3, 6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)

    def fn(a, *, shift, scale=1.0, name="", extra=None):
        h = F.dropout(lin(a) * scale + shift, 0.5)
        return {"y": h.tanh(), "pair": (h.sigmoid(), len(name)), "name": name, "none": extra}

    def run(call):
        for t in (x, bias, *lin.parameters()):
            t.grad = None
        torch.manual_seed(3)
        out = call()
        (out["y"].sum() + out["pair"][0].square().sum()).backward()
        return out, grads_of([x, bias, *lin.parameters()])

    want, gw = run(lambda: fn(x, shift=bias, scale=2.0, name="abc"))
    got, gg = run(lambda: fl.checkpoint(fn, x, shift=bias, scale=2.0, name="abc"))
    assert got["name"] == "abc" and got["pair"][1] == 3 and got["none"] is None
    assert torch.equal(got["y"], want["y"]) and torch.equal(got["pair"][0], want["pair"][0])
    assert_equal_lists(gg, gw)


@pytest.mark.parametrize("outer", POLICIES)
@pytest.mark.parametrize("inner", POLICIES)
def test_nested_checkpoints(outer, inner):
    torch.manual_seed(0)
    b1, b2 = Block(), Block()
    x = torch.randn(2, 8, 16, requires_grad=True)
    params = [*b1.parameters(), *b2.parameters()]

    def plain(t):
        return b2(b1(t) * 2)

    def nested(t):
        return b2(fl.checkpoint(b1, t, policy=inner) * 2)

    def run(fn):
        for p in [x, *params]:
            p.grad = None
        torch.manual_seed(5)
        y = fn(x)
        y.square().sum().backward()
        return y.detach(), grads_of([x, *params])

    want = run(plain)
    with ckpt._capture_frames() as frames:
        got = run(lambda t: fl.checkpoint(nested, t, policy=outer))
    assert torch.equal(got[0], want[0])
    assert_equal_lists(got[1], want[1])
    # outer forward, inner forward, and (full) inner forward again inside the outer recompute; a selective outer
    # replays its recorded ops instead of calling the function, so the inner checkpoint is not called again
    assert len(frames) == (3 if outer == "full" else 2)


def test_retain_graph_and_second_backward():
    block, x = make_block()
    torch.manual_seed(1)
    y = block(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    want = grads_of([x, *block.parameters()])
    for t in [x, *block.parameters()]:
        t.grad = None
    torch.manual_seed(1)
    y = fl.checkpoint(block, x).sum()
    y.backward(retain_graph=True)
    y.backward()  # a second backward pass recomputes again
    assert_equal_lists(grads_of([x, *block.parameters()]), want)


# ----------------------------------------------------------------------------- autocast, module state


@pytest.mark.parametrize("policy", POLICIES)
def test_autocast_bf16_cpu(policy):
    block, x = make_block()

    def run(fn, enabled=True):
        for t in [x, *block.parameters()]:
            t.grad = None
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            y = fn(x)
        y.float().square().sum().backward()  # backward (and so the recompute) outside autocast
        return y, grads_of([x, *block.parameters()])

    want = run(block)
    got = run(lambda t: fl.checkpoint(block, t, policy=policy))
    assert got[0].dtype == want[0].dtype
    assert torch.equal(got[0], want[0])
    assert_equal_lists(got[1], want[1])
    # autocast mattered: in fp32 the gradients differ (so a recompute in fp32 could not match)
    fp32 = run(block, enabled=False)
    assert not torch.equal(fp32[1][1], want[1][1])


class EmaScale(nn.Module):
    """Updates a running statistic in forward and uses the updated value (an observer-like module)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.ones(()))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.5).add_(0.5 * x.abs().mean())
        return x / self.running


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("api", ["function", "module"])
def test_module_state_updated_once(policy, api):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), EmaScale(), nn.Linear(8, 4))
    ref = copy.deepcopy(net)
    x = torch.randn(10, 6, requires_grad=True)
    call = (lambda t: fl.checkpoint(net, t, policy=policy)) if api == "function" else \
        fl.CheckpointedBlock(net, policy=policy)

    for step in range(2):
        for m, fn in ((ref, ref), (net, call)):
            for t in [x, *m.parameters()]:
                t.grad = None
            torch.manual_seed(10 + step)
            fn(x).square().sum().backward()
            if m is ref:
                want = grads_of([x, *ref.parameters()])
        assert_equal_lists(grads_of([x, *net.parameters()]), want)
        assert_equal_lists([b for _, b in net.named_buffers()], [b for _, b in ref.named_buffers()], "buffer")
    assert int(net[1].num_batches_tracked) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_closure_module_state_updated_once(policy):
    """BatchNorm reached through a closure: its running stats are updated by the forward only (a selective replay
    runs batch_norm on private copies of their pre-forward values)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5)
    x = torch.randn(7, 5, requires_grad=True)
    with ckpt._capture_frames() as frames:
        fl.checkpoint(lambda t: bn(t).relu(), x, policy=policy).sum().backward()
    assert (frames[0].tape is not None) == (policy == "selective")
    ref = nn.BatchNorm1d(5)
    ref(x)
    assert torch.equal(bn.running_mean, ref.running_mean) and torch.equal(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 1


def test_is_recomputing_flag():
    seen = []

    def fn(t):
        seen.append(ckpt.is_recomputing())
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    fl.checkpoint(fn, x).sum().backward()
    assert seen == [False, True] and not ckpt.is_recomputing()


# ----------------------------------------------------------------------------- errors


def test_recompute_shape_mismatch_raises():
    calls = []

    def fn(t):
        calls.append(1)
        return (t[: 4 - len(calls)] * 2).sin().sum()  # a different slice on the second call

    x = torch.randn(4, requires_grad=True)
    y = fl.checkpoint(fn, x)
    with pytest.raises(ckpt.CheckpointError, match=r"shape \(2,\).*forward saved shape \(3,\)"):
        y.backward()


def test_recompute_dtype_mismatch_raises():
    state = {"dtype": torch.float32}

    def fn(t):
        return t.to(state["dtype"]).exp().sum()

    x = torch.randn(4, requires_grad=True)
    y = fl.checkpoint(fn, x)
    state["dtype"] = torch.float64
    with pytest.raises(ckpt.CheckpointError, match="dtype torch.float64.*dtype torch.float32"):
        y.backward()


def test_recompute_saving_fewer_tensors_raises():
    state = {"deep": True}

    def fn(t):
        h = t.exp()
        return h.sin().cos() if state["deep"] else h

    x = torch.randn(4, requires_grad=True)
    y = fl.checkpoint(fn, x)
    state["deep"] = False
    with pytest.raises(ckpt.CheckpointError, match="saved 1 tensors for backward but the forward saved 3"):
        y.sum().backward()


def test_input_changed_in_place_after_forward_raises():
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    y = fl.checkpoint(lambda a: (a * w).sin(), x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_argument_validation():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="function must be callable"):
        fl.checkpoint(x, x)
    with pytest.raises(TypeError, match="preserve_rng_state must be a bool"):
        fl.checkpoint(torch.sin, x, preserve_rng_state=1)
    with pytest.raises(ValueError, match="policy must be one of"):
        fl.checkpoint(torch.sin, x, policy="everything")
    with pytest.raises(TypeError, match="policy must be"):
        fl.checkpoint(torch.sin, x, policy=3)
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        fl.CheckpointedBlock(torch.sin)
    with pytest.raises(ValueError, match="policy must be one of"):
        fl.CheckpointedBlock(nn.Linear(2, 2), policy="some")


def test_no_grad_mode_just_calls_function():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad(), ckpt._capture_frames() as frames:
        y = fl.checkpoint(torch.sin, x)
    assert frames == [] and not y.requires_grad and torch.equal(y, x.sin())


# ----------------------------------------------------------------------------- memory: what is kept


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def test_full_policy_frees_intermediates():
    refs = []

    def fn(t):
        h = t.exp()
        refs.append(weakref.ref(h))
        return h.sin()

    x = torch.randn(5, requires_grad=True)
    y_plain = fn(x)  # exp's output is kept by sin's backward
    assert refs[-1]() is not None
    y = fl.checkpoint(fn, x)  # ...but not under checkpoint
    assert refs[-1]() is None
    y.sum().backward()
    y_plain.sum().backward()


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_keeps_and_recomputes_what_it_says(policy):
    """Selective keeps exactly the outputs of the expensive ops and re-runs only the cheap ones."""
    B, T, d = 2, 8, 16
    block, x = make_block(p=0.0)  # no dropout: CPU SDPA is then one op (flash_attention_for_cpu)
    # what plain autograd saves for this block
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        block(x)
    with ckpt._capture_frames() as frames:
        y = fl.checkpoint(block, x, policy=policy)
    (frame,) = frames
    assert len(frame.metas) == len(packed)  # handles for every tensor autograd saves, nothing kept
    held = [e for e in frame.cache if e is not None]
    kept = [e[0]._schema.name for e in held]
    kept_bytes = sum(t.numel() * t.element_size() for _, out, _, _ in held
                     for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    with _OpCounter() as counter:
        y.sum().backward()
    ran = {op._schema.name: n for op, n in counter.counts.items()}
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    if policy == "full":
        assert kept == [] and kept_bytes == 0
        # the recompute re-runs the matmuls and the attention; it stops after the last saved tensor
        # (fc2's input), so fc2's addmm does not run again
        assert ran.get("aten::addmm") == 3 and ran.get(sdpa) == 1
    else:
        # qkv, attention, proj, fc1 are kept; fc2's output is not needed by the recompute: dropped
        assert kept == ["aten::addmm", sdpa, "aten::addmm", "aten::addmm"]
        f32 = 4
        assert kept_bytes == f32 * B * T * (3 * d + d + d + 4 * d) + f32 * B * 2 * T  # + logsumexp (B, H, T)
        assert "aten::addmm" not in ran and sdpa not in ran
    # the cheap ops run again in both
    assert ran.get("aten::native_layer_norm") == 2 and ran.get("aten::gelu") == 1


class MathAttentionBlock(nn.Module):
    """Attention written out as matmuls: softmax(q @ k^T * scale) with dropout, then @ v, then a projection."""

    def __init__(self, d: int = 8, heads: int = 2, p: float = 0.25) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        probs = F.dropout(torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1), self.p, self.training)
        return x + self.proj((probs @ v).transpose(1, 2).reshape(B, T, C))


def math_block_step(policy):
    """One training step of a MathAttentionBlock (T=16 > 2 * head dim 4), unwrapped and checkpointed with
    ``policy`` (same seeds): (the checkpoint's frame, its step's results, the unwrapped step's results)."""
    torch.manual_seed(0)
    block, x = MathAttentionBlock(), torch.randn(2, 16, 8, requires_grad=True)
    want = train_step(block, block, x)
    with ckpt._capture_frames() as frames:
        got = train_step(lambda t: fl.checkpoint(block, t, policy=policy), block, x)
    return frames[0], got, want


def replayed(frame) -> list[str]:
    """The ops a selective frame's recompute runs again (not handed back from the cache), by name, in order."""
    tape = frame.tape
    return [tape.ops[i].op._schema.name.removeprefix("aten::") for i in tape.order
            if tape.ops[i].kept < 0 or frame.cache[tape.ops[i].kept] is None]


def test_selective_keeps_probabilities_and_copies():
    """Written-out attention under "selective": the softmax outputs and the copies of q, k^T, v and the attention
    output are kept; nothing in the recompute reads the qkv matmul's output or probs @ v's (their copies are kept),
    so they are freed after forward, and the recompute runs neither the scores (q @ k^T, scaling) nor the softmax:
    views and the dropout only. Gradients stay bitwise equal, dropout included."""
    frame, got, want = math_block_step("selective")
    held = [e[0]._schema.name for e in frame.cache if e is not None]
    assert held == ["aten::clone", "aten::clone", "aten::_softmax", "aten::clone", "aten::clone"], held
    assert len(frame.cache) == len(held) + 3  # qkv, probs @ v and proj: freed
    assert set(replayed(frame)) == {"view", "t", "_unsafe_view", "expand", "empty_like", "bernoulli_", "div_", "mul"}
    assert_equal_lists(got[1], want[1])
    assert torch.equal(got[2], want[2])


def test_keep_matmuls_recomputes_attention_scores():
    """Megatron-LM's choice (``keep_matmuls``): q @ k^T (T*T per head from two T*hd factors) is recomputed with the
    softmax and dropout after it; the qkv matmul and probs @ v are kept."""
    frame, got, want = math_block_step(ckpt.keep_matmuls)
    held = [e for e in frame.cache if e is not None]
    assert [e[0]._schema.name for e in held] == ["aten::addmm", "aten::bmm"]  # qkv and probs @ v
    assert held[1][1].shape == (2 * 2, 16, 4)
    assert frame.cache[-1] is None  # proj's output: nothing the recompute runs reads it, freed after forward
    ops = replayed(frame)
    assert ops.count("bmm") == 1 and "_softmax" in ops and "addmm" not in ops  # the scores, not probs @ v
    assert_equal_lists(got[1], want[1])  # bitwise, dropout on the recomputed probabilities included
    assert torch.equal(got[2], want[2])


def test_selective_copies_again_what_the_recompute_holds_anyway():
    """A kept copy whose source the recompute needs anyway (sin saves exp's output) is not held twice: it is freed
    after forward and copied again."""
    def fn(t):
        h = t.exp()
        return h.clone() * h.sin()

    x = torch.randn(5, requires_grad=True)
    want = torch.autograd.grad(fn(x).sum(), x)[0]
    with ckpt._capture_frames() as frames:
        y = fl.checkpoint(fn, x, policy="selective")
    assert len(frames[0].cache) == 1 and frames[0].cache[0] is None
    assert replayed(frames[0]) == ["exp", "clone", "sin"]
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], want)


def test_selective_replays_what_the_forward_ran():
    """The recompute replays the forward's recorded ops: a function that would run other ops when called again
    (here a different slice; full raises CheckpointError for it) still gets the forward's gradients."""
    calls = []

    def fn(t):
        calls.append(1)
        return (t[: 4 - len(calls)] * 2).sin().sum()

    x = torch.randn(4, requires_grad=True)
    want = torch.autograd.grad((x[:3] * 2).sin().sum(), x)[0]
    got = torch.autograd.grad(fl.checkpoint(fn, x, policy="selective"), x)[0]
    assert torch.equal(got, want) and len(calls) == 1


class _WrittenOutsideTheDispatcher(torch.autograd.Function):
    """Doubles its input, writing the result the way a custom kernel launch does: into a tensor it allocated, out of
    sight of dispatch modes. Its backward reads that saved result."""

    @staticmethod
    def forward(ctx, t):
        out = torch.empty_like(t)
        with torch._C._DisableTorchDispatch():
            out.copy_(t * 2)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


def test_selective_runs_the_function_again_when_it_computes_outside_the_dispatcher():
    """A replay of the recorded ops would leave such an output unwritten (``empty_like`` only): the forward sees
    aten ops run with grad mode off (an autograd.Function's forward), drops the tape, and the recompute calls the
    function again. Gradients stay exact."""
    def fn(t):
        return _WrittenOutsideTheDispatcher.apply(t.sin()).exp()

    x = torch.randn(6, requires_grad=True)
    want = torch.autograd.grad(fn(x).sum(), x)[0]
    for policy in ("selective", lambda op, *args, **kwargs: True):
        with ckpt._capture_frames() as frames:
            y = fl.checkpoint(fn, x, policy=policy)
        assert frames[0].tape is None
        assert torch.equal(torch.autograd.grad(y.sum(), x)[0], want)


@pytest.mark.parametrize("policy", ["selective", ckpt.keep_matmuls])
@pytest.mark.parametrize("attention,position", [("stock", "learned"), ("sdpa", "rotary"), ("custom", "rotary")])
def test_selective_replay_on_the_project_gpt(attention, position, policy):
    """The project's GPT blocks (each attention and position kind, dropout) checkpointed selectively: every
    block's recompute is a replay of its recorded ops (nothing in them computes outside the dispatcher), and the
    gradients are bitwise those of the unwrapped model."""
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.2,
                    attention=attention, position=position)
    model = GPT(cfg)
    idx = torch.randint(0, 32, (2, 16))

    def grads(wrap):
        blocks = [b.forward for b in model.blocks]
        for b, forward in zip(model.blocks, blocks, strict=True):
            b.forward = wrap(forward)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(idx, idx).backward()
        for b, forward in zip(model.blocks, blocks, strict=True):
            b.forward = forward
        return [p.grad for p in model.parameters()]

    want = grads(lambda forward: forward)
    with ckpt._capture_frames() as frames:
        got = grads(lambda forward: lambda *a: fl.checkpoint(forward, *a, policy=policy))
    assert len(frames) == cfg.n_layer and all(frame.tape is not None for frame in frames)
    if attention == "stock" and policy == "selective":  # its scores (before the kept softmax) are not rerun
        assert all("bmm" not in replayed(frame) and "_softmax" not in replayed(frame) for frame in frames)
    assert_equal_lists(got, want)


def test_callable_policy():
    block, x = make_block()
    calls = []

    def keep_gelu(op, *args, **kwargs):
        calls.append(op)
        return op is aten.gelu.default

    want = train_step(block, block, x)
    with ckpt._capture_frames() as frames:
        got = train_step(lambda t: fl.checkpoint(block, t, policy=keep_gelu), block, x)
    assert [e[0] for e in frames[0].cache] == [aten.gelu.default]
    assert aten.addmm.default in calls  # asked about every op
    assert_equal_lists(got[1], want[1])

    # "keep everything": views and mutating ops are still recomputed, gradients stay exact
    with ckpt._capture_frames() as frames:
        got = train_step(lambda t: fl.checkpoint(block, t, policy=lambda op, *a, **k: True), block, x)
    ops = [entry[0] for entry in frames[0].cache if entry is not None]
    assert aten.addmm.default in ops and all(ckpt._keepable(op) for op in ops)
    assert aten.view.default not in ops and aten.transpose.int not in ops and aten.bernoulli_.float not in ops
    assert_equal_lists(got[1], want[1])
    assert torch.equal(got[2], want[2])  # kept random ops moved the RNG as the forward did


def test_expensive_op_names():
    assert ckpt.is_expensive_op(aten.mm.default) and ckpt.is_expensive_op(aten.addmm.default)
    assert ckpt.is_expensive_op(aten._scaled_dot_product_flash_attention.default)
    assert not ckpt.is_expensive_op(aten.gelu.default) and not ckpt.is_expensive_op(aten.native_layer_norm.default)
    # our fused ops, matched by name as they land
    for name in ("scaled_dot_product_attention", "linear_cross_entropy"):
        if hasattr(torch.ops.fusedlayers, name):
            assert ckpt.is_expensive_op(getattr(torch.ops.fusedlayers, name).default)
    for name in ("softmax", "cross_entropy"):
        if hasattr(torch.ops.fusedlayers, name):
            assert not ckpt.is_expensive_op(getattr(torch.ops.fusedlayers, name).default)


def test_selective_keeps_fused_attention_output():
    if not hasattr(torch.ops.fusedlayers, "scaled_dot_product_attention"):
        pytest.skip("fused attention op not registered")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))

    def attn(a, b, c):
        with fl.use_backend("reference"):
            return fl.scaled_dot_product_attention(a, b, c, dropout_p=0.3, is_causal=True)

    torch.manual_seed(2)
    attn(q, k, v).square().sum().backward()
    want = grads_of([q, k, v])
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(2)
    with ckpt._capture_frames() as frames:
        y = fl.checkpoint(attn, q, k, v, policy="selective")
    y.square().sum().backward()
    assert [e[0]._schema.name for e in frames[0].cache] == ["fusedlayers::scaled_dot_product_attention"]
    assert_equal_lists(grads_of([q, k, v]), want)


# ----------------------------------------------------------------------------- CheckpointedBlock


def test_checkpointed_block_is_a_drop_in():
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), nn.BatchNorm1d(8))
    wrapped = nn.Sequential(fl.CheckpointedBlock(Block()), nn.BatchNorm1d(8))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    wrapped.load_state_dict(plain.state_dict())  # strict: same keys
    for (n, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    plain.load_state_dict(wrapped.state_dict())
    cb = wrapped[0]
    assert isinstance(cb.module, Block) and cb.heads == 2 and cb.qkv is cb.module.qkv
    wrapped.eval()
    assert not cb.training and not cb.module.training and not cb.module.ln1.training
    wrapped.train()
    assert cb.module.training
    wrapped.double()
    assert cb.module.qkv.weight.dtype == torch.float64
    assert "policy=full" in repr(cb)
    # a wrapped BatchNorm keeps its running stats under the unwrapped names
    bn = fl.CheckpointedBlock(nn.BatchNorm1d(3))
    assert set(bn.state_dict()) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}


# ----------------------------------------------------------------------------- torch.compile


def test_torch_compile_runs_checkpoint_eagerly():
    block, x = make_block()
    want = train_step(lambda t: block(t) * 2, block, x)
    fn = torch.compile(lambda t: fl.checkpoint(block, t) * 2, backend="eager")
    got = train_step(fn, block, x)
    assert_equal_lists(got[1], want[1])


# ----------------------------------------------------------------------------- DDP (two processes, gloo)


class TwoUses(nn.Module):
    """The same block applied twice (reused parameters), each use checkpointed, plus a head."""

    def __init__(self, checkpoint_fn) -> None:
        super().__init__()
        self.block, self.head = Block(), nn.Linear(16, 3)
        self.checkpoint_fn = checkpoint_fn

    def forward(self, x):
        h = self.checkpoint_fn(self.block, x)
        h = self.checkpoint_fn(self.block, h)
        return self.head(h)


def _plain(module, x):
    return module(x)


def _reentrant(module, x):
    return torch.utils.checkpoint.checkpoint(module, x, use_reentrant=True)


def _ddp_check(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    for find_unused in (False, True):
        torch.manual_seed(0)
        ref = TwoUses(_plain)
        model = copy.deepcopy(ref)
        model.checkpoint_fn = fl.checkpoint
        ddp = DDP(model, find_unused_parameters=find_unused)
        for step in range(2):
            x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            torch.manual_seed(7 + rank)
            ref.zero_grad()
            ref(x).square().sum().backward()
            want = [p.grad.clone() for p in ref.parameters()]
            for g in want:
                dist.all_reduce(g)
                g /= world
            torch.manual_seed(7 + rank)
            ddp.zero_grad()
            ddp(x).square().sum().backward()
            for (name, p), w in zip(model.named_parameters(), want, strict=True):
                torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _ddp_worker(rank: int, world: int, init_file: str) -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a hung worker prints where it hangs
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    _ddp_check(rank, world)  # an exception here reaches the parent through mp.spawn
    dist.barrier()
    # Skip tearing down gloo and the DDP reducer: their destructors sometimes hang at exit on CPU.
    os._exit(0)


def test_ddp_two_processes_gloo(tmp_path):
    """Two ranks, reused parameters, find_unused_parameters False and True: gradients equal the averaged
    gradients of the unwrapped model (no "marked ready twice")."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=False)
    deadline = time.monotonic() + 150
    while not context.join(timeout=2):  # raises if a worker failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the DDP workers did not finish in 150 s")


def test_ddp_reentrant_control_fails(tmp_path):
    """Control for the DDP test: the reentrant design fails in that setting (one process), ours does not."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for fn in (_reentrant, fl.checkpoint):
            torch.manual_seed(0)
            ddp = DDP(TwoUses(fn), find_unused_parameters=True)
            x = torch.randn(2, 8, 16, requires_grad=True)
            if fn is _reentrant:
                with pytest.raises(RuntimeError, match="mark a variable ready only once"):
                    ddp(x).square().sum().backward()
            else:
                for _ in range(2):
                    ddp(x).square().sum().backward()
            del ddp
    finally:
        gc.collect()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_bitwise_gradients_rng_and_autocast(policy):
    torch.manual_seed(0)
    block = Block(d=64, heads=4, p=0.2, attn_p=0.0).cuda()
    x = torch.randn(2, 64, 64, device="cuda", requires_grad=True)
    for dtype in (None, torch.bfloat16):
        def run(fn, dtype=dtype):
            for t in [x, *block.parameters()]:
                t.grad = None
            torch.manual_seed(1)
            with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
                y = fn(x)
            y.float().square().sum().backward()
            return y.detach(), grads_of([x, *block.parameters()]), torch.rand(3, device="cuda")

        with sdpa_kernel(SDPBackend.MATH):  # deterministic attention backward: bitwise comparison
            want = run(block)
            got = run(lambda t: fl.checkpoint(block, t, policy=policy))
        assert torch.equal(got[0], want[0])
        assert_equal_lists(got[1], want[1])
        assert torch.equal(got[2], want[2])


@pytest.mark.cuda
def test_cuda_selective_flash_attention_with_dropout():
    """SDPA's flash kernel with dropout is kept by selective; the replay moves the CUDA RNG past it so the
    dropout after it draws the forward's mask. The flash backward may accumulate dq in a nondeterministic
    order, so gradients are compared to the unwrapped run within that run-to-run noise."""
    torch.manual_seed(0)
    block = Block(d=128, heads=2, p=0.2, attn_p=0.2).cuda().to(torch.bfloat16)
    x = torch.randn(2, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run(fn):
        for t in [x, *block.parameters()]:
            t.grad = None
        torch.manual_seed(1)
        y = fn(x)
        y.float().square().sum().backward()
        return y.detach(), grads_of([x, *block.parameters()])

    with ckpt._capture_frames() as frames:
        got = run(lambda t: fl.checkpoint(block, t, policy="selective"))
    assert any("attention" in e[0]._schema.name for e in frames[0].cache if e is not None)
    want, again = run(block), run(block)
    assert torch.equal(got[0], want[0])
    for g, w, a in zip(got[1], want[1], again[1], strict=True):
        noise = (a.float() - w.float()).abs().max().item()
        assert (g.float() - w.float()).abs().max().item() <= 2 * noise, (noise,)


@pytest.mark.cuda
def test_cuda_batchnorm_updated_once():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).cuda()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8, device="cuda")
    ref(x).sum().backward()
    fl.CheckpointedBlock(net, policy="selective")(x).sum().backward()
    assert_equal_lists([b for _, b in net.named_buffers()], [b for _, b in ref.named_buffers()], "buffer")


@pytest.mark.cuda
def test_cuda_selective_skips_scores_with_kept_probabilities():
    """The skipping on the GPU: written-out attention with dropout (CUDA RNG), softmax outputs kept, the scores
    skipped in the recompute; output and gradients equal to the unwrapped block's within its run-to-run noise."""
    torch.manual_seed(0)
    block = MathAttentionBlock(d=64, heads=4, p=0.2).cuda()
    x = torch.randn(2, 128, 64, device="cuda", requires_grad=True)

    def run(fn):
        for t in [x, *block.parameters()]:
            t.grad = None
        torch.manual_seed(1)
        y = fn(x)
        y.square().sum().backward()
        return y.detach(), grads_of([x, *block.parameters()])

    with ckpt._capture_frames() as frames:
        got = run(lambda t: fl.checkpoint(block, t, policy="selective"))
    assert frames[0].tape is not None
    assert "bmm" not in replayed(frames[0]) and "_softmax" not in replayed(frames[0])
    want, again = run(block), run(block)
    assert torch.equal(got[0], want[0])
    for g, w, a in zip(got[1], want[1], again[1], strict=True):
        noise = (a - w).abs().max().item()
        assert (g - w).abs().max().item() <= 2 * noise, (noise,)
