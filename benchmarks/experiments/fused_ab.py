"""Session 10: the one-pass Hopper backward (ordered fp32 dQ additions) vs the two passes: parity at odd shapes
(against float64), determinism (two runs bitwise equal), then fwd+bwd TFLOP/s of both and cuDNN, best of 3
interleaved rounds, bf16, B*L = 16384, H*D = 2048."""
import os, time
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hp

print(torch.cuda.get_device_name(), flush=True)
PARITY = os.environ.get("PARITY", "1") == "1"


def grads(q, k, v, g, causal, fused, config=None):
    hp.fused_enabled, hp.fused_config = fused, config
    qs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fl.scaled_dot_product_attention(*qs, is_causal=causal, enable_gqa=True)
    o.backward(g)
    hp.fused_enabled, hp.fused_config = False, None
    return [t.grad for t in qs]


if PARITY:
    min_flops, hp.MIN_FLOPS = hp.MIN_FLOPS, 0
    for B, H, Hk, L, S, D, causal in ((2, 4, 2, 1000, 777, 128, False), (1, 6, 3, 1031, 1031, 64, True),
                                      (3, 2, 1, 300, 4100, 128, True), (1, 2, 2, 129, 129, 64, False),
                                      (1, 8, 2, 2048, 2048, 128, True), (2, 4, 4, 1500, 2100, 64, False),
                                      (1, 4, 1, 4100, 300, 128, True)):
        torch.manual_seed(0)
        q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hk, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True).backward(g.double())
        t0 = time.time()
        a = grads(q, k, v, g, causal, True)
        torch.cuda.synchronize()
        dt = time.time() - t0
        a2 = grads(q, k, v, g, causal, True)
        b = grads(q, k, v, g, causal, False)
        det = all(torch.equal(x, y) for x, y in zip(a, a2))
        errs = []
        for name, x, y, r in zip("qkv", a, b, ref):
            scale = r.grad.abs().max().item()
            errs.append(f"d{name} {(x.double() - r.grad).abs().max().item() / scale:.1e}/"
                        f"{(y.double() - r.grad).abs().max().item() / scale:.1e}")
        print(f"B{B} H{H}/{Hk} L{L} S{S} D{D} causal={int(causal)}: deterministic={det} fused/two-pass err "
              + " ".join(errs) + f" ({dt:.1f}s first call)", flush=True)
    hp.MIN_FLOPS = min_flops

VARIANTS = {128: [None], 64: [None, (128, 64, 8)]}
for D in [int(x) for x in os.environ.get("DS", "128,64").split(",") if x]:
    H = 2048 // D
    for L in [int(x) for x in os.environ.get("LS", "4096,16384").split(",")]:
        for causal in (False, True):
            B = 16384 // L
            q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                       for _ in range(3))
            g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
            f = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)

            def step(fn):
                o = fn(q, k, v, is_causal=causal)
                o.backward(g)
                q.grad = k.grad = v.grad = None

            def fl_step(fused, config):
                hp.fused_enabled, hp.fused_config = fused, config
                return f / triton.testing.do_bench(lambda: step(fl.scaled_dot_product_attention)) / 1e9

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return f / triton.testing.do_bench(lambda: step(F.scaled_dot_product_attention)) / 1e9
            cases = {"two-pass": lambda: fl_step(False, None), "cudnn": cudnn}
            for c in VARIANTS[D]:
                cases[f"fused{c or ''}"] = lambda c=c: fl_step(True, c)
            res = {}
            for _ in range(3):
                for name, fn in cases.items():
                    res[name] = max(res.get(name, 0), fn())
            hp.fused_enabled, hp.fused_config = False, None
            line = " ".join(f"{n} {r:.0f}" for n, r in res.items())
            best = max(r for n, r in res.items() if n.startswith("fused"))
            print(f"D{D} L{L} causal={int(causal)}: {line} | fused/two-pass {best / res['two-pass']:.2f} "
                  f"fused/cudnn {best / res['cudnn']:.2f}", flush=True)
