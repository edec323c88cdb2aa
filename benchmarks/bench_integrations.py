"""Benchmark the integrations on the GPU: our kernels reached through other people's code.

1. PyTorch SDPA (``fusedlayers.integrations.sdpa``): an unmodified ``F.scaled_dot_product_attention`` call with
   our implementation activated, against calling ``fl.scaled_dot_product_attention`` directly (target: within
   3%) and against torch's own flash kernels; bf16, batch * L = 16384, H * D = 2048, forward and forward+backward.
2. Hugging Face transformers (``fusedlayers.integrations.transformers.apply``): a Llama-style ``LlamaForCausalLM``
   built from a config (no download; ~0.9B parameters, GQA, vocabulary 128256), bf16, one training step
   (forward + backward with labels) with ``attn_implementation="sdpa"`` and the stock loss, against the same
   model after ``apply`` (our attention and the linear+cross-entropy loss; then also RMSNorm, SwiGLU, rotary and
   ``cast_once``):
   tokens/s and peak memory (targets: 1.2x the tokens/s, at most 0.6x the peak). ``--thunder``: the same model under
   ``thunder.jit`` with Thunder's default executors and with ``fl_executor`` first (target: faster with ours), with
   two stand-ins that let Thunder 0.2.6 trace transformers 5 (see ``_let_thunder_trace_transformers``), and our GPT
   (gpt-small) the same way; ``--only thunder``: our GPT alone. ``--window W``: Mistral's architecture instead (the
   same sizes, a sliding window of W tokens: stock SDPA reads transformers' window mask, ours runs the window);
   ``--packed``: documents packed into each row without padding (position_ids restarting: stock SDPA reads the block
   mask transformers builds, ours runs ``fl.varlen_attention``).

    python benchmarks/bench_integrations.py [--out benchmarks/results/h100-integrations.md] [--only sdpa|hf]
                                            [--thunder] [--only thunder] [--window 1024 --seq 8192 --batch 1]
                                            [--packed]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fusedlayers as fl  # noqa: E402
from benchmarks.timing import report, round_order  # noqa: E402

DTYPE = torch.bfloat16


def median_ms(fn) -> float:
    return do_bench(fn, warmup=100, rep=500, return_mode="median")


def sdpa_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fusedlayers.integrations import sdpa as fl_sdpa

    rows = []
    for d, length, causal in [(64, 1024, True), (128, 1024, False), (128, 4096, True), (128, 4096, False)]:
        b, h = 16384 // length, 2048 // d
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        def fwd(f):
            return lambda: f(q, k, v, is_causal=causal)

        def fwd_bwd(f):
            return lambda: torch.autograd.grad(f(q, k, v, is_causal=causal), (q, k, v), grad)

        times = {}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for mode, make in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                times["torch flash", mode] = median_ms(make(F.scaled_dot_product_attention))
                times["fl direct", mode] = median_ms(make(fl.scaled_dot_product_attention))
                fl_sdpa.enable()
                try:
                    calls = fl_sdpa.calls["forward"]
                    times["F.sdpa -> fl", mode] = median_ms(make(F.scaled_dot_product_attention))
                    assert fl_sdpa.calls["forward"] > calls, "the registered implementation did not run"
                finally:
                    fl_sdpa.disable()
        for mode in ("fwd", "fwd+bwd"):
            reg, direct, flash = times["F.sdpa -> fl", mode], times["fl direct", mode], times["torch flash", mode]
            rows.append(f"| D{d} L{length} {'causal' if causal else 'full'} | {mode} | {reg:.3f} | {direct:.3f} | "
                        f"{flash:.3f} | {direct / reg:.3f} | {flash / reg:.2f}x |")
    head = ("| shape (bf16, B*L=16384, H*D=2048) | pass | F.sdpa -> fl (ms) | fl direct (ms) | torch flash (ms) | "
            "direct / registered | vs torch flash |\n| --- | --- | --- | --- | --- | --- | --- |")
    return "## PyTorch SDPA: `activate_flash_attention_impl(\"fusedlayers\")`\n\n" + head + "\n" + "\n".join(rows)


def llama(vocab: int, layers: int, window: int | None = None, seq: int = 8192, hidden: int = 2048,
          intermediate: int = 5632, dtype: torch.dtype = DTYPE):
    """The Llama-style model (16 heads, 4 KV heads); with ``window``, Mistral's architecture (the same layers,
    attention within a sliding window of that many tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    config_cls, model_cls = (MistralConfig, MistralForCausalLM) if window else (LlamaConfig, LlamaForCausalLM)
    extra = {"sliding_window": window} if window else {}
    config = config_cls(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                        num_attention_heads=16, num_key_value_heads=4, vocab_size=vocab,
                        max_position_embeddings=max(8192, seq), attn_implementation="sdpa", tie_word_embeddings=False,
                        **extra)
    torch.manual_seed(0)
    return model_cls(config).to("cuda", dtype)


def train_step(model, ids, position_ids=None, autocast: bool = False):
    # a training step keeps no KV cache; position_ids restarting at each document: padding-free packing.
    # autocast: fp32 master weights, bf16 compute (mixed-precision training as Trainer's bf16=True runs it)
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, position_ids=position_ids, labels=ids, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss


def measure_step(model, ids, position_ids=None, autocast: bool = False) -> tuple[float, float, float]:
    """(ms per step, peak GB beyond the weights, loss)."""
    step = lambda: train_step(model, ids, position_ids, autocast)
    loss = step().item()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    ms = do_bench(step, warmup=3, rep=30, return_mode="median")
    return ms, peak, loss


def liger(model):
    """Liger-Kernel's patch of a Llama instance: RoPE, RMSNorm, SwiGLU and the fused linear cross-entropy. It also
    replaces the class's forward (process-wide), so it runs last."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)
    return model


def packed_positions(batch: int, seq: int) -> torch.Tensor:
    """position_ids of documents of 64 to seq / 2 tokens (log-uniform, seed 0) packed into each row, restarting at
    each document (as transformers' DataCollatorWithFlattening makes them)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        pos = []
        while len(pos) < seq:
            n = int(torch.exp(torch.empty(()).uniform_(4.16, float(torch.log(torch.tensor(seq / 2))), generator=g)))
            pos += range(min(n, seq - len(pos)))
        rows.append(pos)
    return torch.tensor(rows, device="cuda")


def _let_thunder_trace_transformers() -> None:
    """Two stand-ins, for this benchmark's process only, without which Thunder 0.2.6 cannot trace transformers 5's
    Llama (both seen on CPU with transformers 5.17): transformers' output collector (a context variable that, when a
    compiler traces it, becomes a module global that Thunder refuses to assign a dict to) is replaced by one that
    collects nothing, which is all a training step asks of it; and K/V heads are repeated before SDPA instead of
    passing ``enable_gqa``, which Thunder 0.2.6's SDPA symbol does not take. (The model's own DynamicCache, which
    Thunder also fails on, is off: ``use_cache=False``.) The computation is the model's own."""
    import transformers.integrations.sdpa_attention as sdpa_attention
    import transformers.utils.output_capturing as output_capturing

    class NoCollector:
        def get(self):
            return None

        def set(self, value):
            return None

        def reset(self, token):
            return None

    output_capturing._active_collector = NoCollector()
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False


def _thunder_jit(model, with_ours: bool):
    import thunder

    from fusedlayers.integrations.thunder import fl_executor

    if type(model).__module__.startswith("transformers."):
        _let_thunder_trace_transformers()

    executors = [fl_executor, *thunder.get_default_executors()] if with_ours else thunder.get_default_executors()
    return thunder.jit(model, executors=executors)


def hf_rows(batch: int, seq: int, layers: int, thunder: bool, window: int | None = None, packed: bool = False,
            hidden: int = 2048, intermediate: int = 5632, master_fp32: bool = False, rounds: int = 1):
    from fusedlayers.integrations import transformers as flt

    vocab = 128256
    stock = llama(vocab, layers, window, seq, hidden, intermediate, torch.float32 if master_fp32 else DTYPE)
    n_params = sum(p.numel() for p in stock.parameters()) / 1e9
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    positions = packed_positions(batch, seq) if packed else None
    parts = dict.fromkeys(flt._PARTS, False)
    variants = {  # name -> a function of a copy of the stock model; each part added to the one above
        "fl apply (attention + linear CE)": lambda m: flt.apply(m, **{**parts, "attention": True, "loss": True}),
        "fl apply (+ RMSNorm)": lambda m: flt.apply(m, **{**parts, "attention": True, "loss": True, "norm": True}),
        "fl apply (+ SwiGLU)": lambda m: flt.apply(m, rotary=False, cast_once=False),
        "fl apply (+ rotary)": lambda m: flt.apply(m, cast_once=False),
        "fl apply (all: + cast_once)": flt.apply,
    }
    if thunder:
        variants["thunder.jit (default executors)"] = lambda m: _thunder_jit(m, False)
        variants["thunder.jit + fl_executor"] = lambda m: _thunder_jit(m, True)
    models = {"stock (sdpa, HF loss)": stock}
    for name, make in variants.items():
        try:
            models[name] = make(copy.deepcopy(stock))
        except Exception as e:  # one failing variant must not lose the others' numbers
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    results: dict[str, list] = {name: [] for name in models}

    def run(name, model):
        torch.cuda.empty_cache()
        try:
            results[name].append(measure_step(model, ids, positions, master_fp32))
        except Exception as e:
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        print(name, results[name][-1:], flush=True)

    for round_ in range(rounds):  # interleaved rounds, each in a shuffled order
        for name in round_order(models, round_):
            run(name, models[name])
    if not window and not thunder:  # Liger patches LlamaForCausalLM's forward for the whole process: last
        name = "Liger-Kernel (RoPE, RMSNorm, SwiGLU, fused linear CE)"
        results[name] = []
        try:
            model = liger(copy.deepcopy(stock))
            for _ in range(rounds):
                run(name, model)
        except ImportError as e:
            print(f"{name}: skipped ({e})", flush=True)
            del results[name]
    best = {name: min(r) if r else None for name, r in results.items()}  # the fastest round of each
    base_ms, base_peak, _ = best["stock (sdpa, HF loss)"]
    rows = [f"| {name} | {batch * seq / r[0] * 1e3:,.0f} | {r[0]:.1f} | {max(x[0] for x in results[name]):.1f} | "
            f"{r[1]:.2f} | {base_ms / r[0]:.2f}x | {r[1] / base_peak:.2f}x | {r[2]:.4f} |"
            if r else f"| {name} | failed | | | | | | |"
            for name, r in best.items()]
    head = ("| model | tokens/s | ms/step | slowest round ms | peak GB (beyond weights) | speed vs stock | "
            "memory vs stock | loss |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    arch = f"MistralForCausalLM, sliding window {window}" if window else "LlamaForCausalLM"
    if packed:
        arch += ", documents of 64 to seq / 2 tokens packed without padding (position_ids)"
    precision = "fp32 master weights under bf16 autocast" if master_fp32 else "bf16"
    title = (f"## Hugging Face {arch} ({n_params:.2f}B parameters: {layers} layers, hidden {hidden}, MLP "
             f"{intermediate}, 16 heads, 4 KV heads, vocabulary {vocab}), {precision}, batch {batch} x {seq}, "
             f"forward + backward with labels; the best of {rounds} interleaved round(s)")
    return title + "\n\n" + head + "\n" + "\n".join(rows)


def thunder_rows(batch: int, seq: int):
    """Our GPT (gpt-small sizes, vocabulary 50304) with torch's SDPA and F.cross_entropy (the ops fl_executor claims),
    bf16, one training step: eager, thunder.jit with its default executors, and with fl_executor first."""
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=50304, block_size=seq, n_layer=12, n_head=12, n_embd=768, attention="sdpa",
                         loss="stock")).to("cuda", DTYPE)
    idx = torch.randint(0, 50304, (batch, seq + 1), device="cuda")

    def step(model):
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return loss

    results = {}
    for name, make in (("eager", lambda m: m), ("thunder.jit (default executors)", lambda m: _thunder_jit(m, False)),
                       ("thunder.jit + fl_executor", lambda m: _thunder_jit(m, True))):
        torch.cuda.empty_cache()
        try:
            model = make(copy.deepcopy(base))
            loss = step(model).item()
            ms = do_bench(lambda model=model: step(model), warmup=3, rep=30, return_mode="median")
            results[name] = (ms, loss)
        except Exception as e:
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            results[name] = None
        print(name, results[name], flush=True)
    default = results.get("thunder.jit (default executors)")
    rows = [f"| {name} | {batch * seq / r[0] * 1e3:,.0f} | {r[0]:.1f} | "
            f"{default[0] / r[0]:.2f}x | {r[1]:.4f} |" if r and default else
            (f"| {name} | {batch * seq / r[0] * 1e3:,.0f} | {r[0]:.1f} | - | {r[1]:.4f} |" if r else
             f"| {name} | failed | | | |") for name, r in results.items()]
    return (f"## Lightning Thunder: our GPT (gpt-small, attention=sdpa, loss=stock), bf16, batch {batch} x {seq}, "
            "forward + backward\n\n| model | tokens/s | ms/step | speed vs thunder default | loss |\n"
            "| --- | --- | --- | --- | --- |\n" + "\n".join(rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--only", choices=("sdpa", "hf", "thunder"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--window", type=int, default=None, help="hf: Mistral's architecture with this sliding window "
                        "(e.g. --window 1024 --seq 8192 --batch 1)")
    parser.add_argument("--packed", action="store_true", help="hf: documents packed into each row without padding "
                        "(position_ids restarting: stock SDPA reads the block mask, ours runs varlen)")
    parser.add_argument("--thunder", action="store_true", help="also the model under thunder.jit, with and without "
                        "our executor (needs lightning-thunder)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--master-fp32", action="store_true", help="hf: fp32 weights, the step under bf16 autocast")
    parser.add_argument("--rounds", type=int, default=1, help="hf: interleaved rounds; each row's best is reported")
    args = parser.parse_args()
    sections = [f"# Integrations benchmark\n\n{datetime.date.today()}, {torch.cuda.get_device_name()}, "
                f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}; "
                "do_bench medians."]
    if args.only in (None, "sdpa"):
        sections.append(sdpa_rows())
    if args.only in (None, "hf"):
        sections.append(hf_rows(args.batch, args.seq, args.layers, args.thunder, args.window, args.packed,
                                args.hidden, args.intermediate, args.master_fp32, args.rounds))
    if args.only == "thunder" or (args.only is None and args.thunder):
        sections.append(thunder_rows(8, 1024))
    report("\n\n".join(sections) + "\n", args.out)


if __name__ == "__main__":
    main()
