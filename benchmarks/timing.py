"""Timing and reporting helpers shared by the benchmarks."""

from __future__ import annotations

import random

import torch

TENSOR_BYTES = 256 * 2**20  # the memory-bound benchmarks' tensor size (and the copy that calibrates them)


def median_ms(fn) -> float:
    """do_bench's median time of ``fn`` (ms)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of a 256 MiB tensor."""
    src = torch.randn(TENSOR_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * TENSOR_BYTES / (median_ms(lambda: dst.copy_(src)) * 1e-3)


def time_rows(rows: list[dict], copy_bw: float, rounds: int) -> None:
    """Time every row's ``fn`` (popped) in interleaved rounds (``time_rounds``); a row's speed is its best round's
    ``n_bytes`` per second. Adds ms, slowest_ms, tbs (TB/s) and frac (of ``copy_bw``) to each row."""
    for row in rows:  # compile and warm up everything before the first round
        row["fn"]()
    torch.cuda.synchronize()
    for row, times in zip(rows, time_rounds([(row.pop("fn"), median_ms) for row in rows], rounds), strict=True):
        bw = row["n_bytes"] / (min(times) * 1e-3)
        row.update(ms=min(times), slowest_ms=max(times), tbs=bw / 1e12, frac=bw / copy_bw)


def kernel_ms(fn, calls: int = 20) -> float:
    """GPU time per call of ``fn``: its kernels' own durations, summed by torch.profiler over ``calls`` calls.

    Leaves out the time the GPU waits for the CPU between kernels, which a wall-clock timer (do_bench) counts:
    where the host cannot issue the work as fast as the GPU runs it, the two differ, and this one is the
    device's share. Works where CUDA-graph capture does not (ops that sync with the host)."""
    return sum(kernel_us(fn, calls).values()) / 1e3


def kernel_us(fn, calls: int = 20, warmup: int = 1, name=lambda kernel: kernel) -> dict:
    """{``name(kernel)``: its GPU us per call of ``fn``}, summed by torch.profiler over ``calls`` calls after
    ``warmup`` (kernels whose names map to the same key add up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[name(e.name)] = us.get(name(e.name), 0.0) + e.device_time_total / calls
    return us


def round_order(items, round_: int) -> list:
    """``items`` in the order round ``round_`` of interleaved timing runs them: shuffled with the round as the seed, so
    that no item always runs right after the same neighbour; two items take turns going first."""
    items = list(items)
    if len(items) == 2:
        return items if round_ % 2 == 0 else items[::-1]
    random.Random(round_).shuffle(items)
    return items


def time_rounds(timed: list[tuple], rounds: int) -> list[list[float]]:
    """ms per call of each ``(fn, timer)`` in ``timed``, in ``rounds`` interleaved rounds (round r times every fn once,
    in ``round_order``): a slow phase of a shared host, seconds long, then costs one round of several
    rows instead of every measurement of one row, and no row always follows the same neighbour (a heavy row before
    it can leave the GPU hot or its memory pool fragmented). Returns each fn's times, one per round; the benchmarks
    report the best round and show the slowest."""
    times = [[] for _ in timed]
    for r in range(rounds):
        for i in round_order(range(len(timed)), r):
            fn, timer = timed[i]
            times[i].append(timer(fn))
    return times


def report(text: str, out: str | None) -> None:
    """Print a benchmark's Markdown report and, when ``out`` is given, write it there."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


def unstable_rows(rows: list[dict]) -> str:
    """The line that lists the rows (timed by ``time_rows``) whose slowest round took over 3% longer than their best."""
    spread = [f"{r['op']} {r['cols']} {r['mode']} {r['impl']} {r['slowest_ms'] / r['ms']:.2f}x" for r in rows
              if r["slowest_ms"] > 1.03 * r["ms"]]
    return "Rows whose slowest round took over 3% longer than their best: " + (", ".join(spread) or "none")
