"""The forward's GPU time right after a backward of each mode, with the SM clock, power and throttle reasons that
nvidia-smi reads then (does the deterministic mode's longer backward leave the forward at a lower clock?).

    python benchmarks/experiments/attention_clock_after_backward.py   # GPU
"""

import subprocess

import torch

import fusedlayers as fl


def smi() -> str:
    query = "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


def forward_after_backward(q, k, v, grad, causal: bool, deterministic: bool, calls: int = 10) -> tuple[float, str]:
    """Median microseconds of a forward that follows the previous call's backward, and nvidia-smi's reading while
    the last calls still run."""
    times = []
    with fl.use_deterministic_attention(deterministic):
        for _ in range(calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fl.scaled_dot_product_attention(q, k, v, is_causal=causal)
            end.record()
            torch.autograd.grad(out, (q, k, v), grad)
            times.append((start, end))
    reading = smi()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[calls // 2] * 1000, reading


def main():
    for D, L, causal in ((128, 16384, True), (128, 4096, False), (64, 16384, False)):
        B, H = 16384 // L, 2048 // D
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        for round_ in range(2):
            for deterministic in (False, True):
                forward_after_backward(q, k, v, grad, causal, deterministic, calls=5)  # warm-up
                us, reading = forward_after_backward(q, k, v, grad, causal, deterministic)
                print(f"D{D} L{L} causal={causal} round {round_} deterministic={deterministic}: forward {us:.0f} us "
                      f"({reading})", flush=True)


if __name__ == "__main__":
    main()
