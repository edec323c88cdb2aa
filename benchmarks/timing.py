"""Timing and reporting helpers shared by the benchmarks."""

from __future__ import annotations

import torch


def kernel_ms(fn, calls: int = 20) -> float:
    """GPU time per call of ``fn``: its kernels' own durations, summed by torch.profiler over ``calls`` calls.

    Leaves out the time the GPU waits for the CPU between kernels, which a wall-clock timer (do_bench) counts:
    where the host cannot issue the work as fast as the GPU runs it, the two differ, and this one is the
    device's share. Works where CUDA-graph capture does not (ops that sync with the host)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def time_rounds(timed: list[tuple], rounds: int) -> list[list[float]]:
    """ms per call of each ``(fn, timer)`` in ``timed``, in ``rounds`` interleaved rounds (round r times every fn once,
    in order): a slow phase of a shared host, seconds long, then costs one round of several rows instead of every
    measurement of one row. Returns each fn's times, one per round; the benchmarks report the best round and show
    the slowest."""
    times = [[] for _ in timed]
    for _ in range(rounds):
        for fn_times, (fn, timer) in zip(times, timed, strict=True):
            fn_times.append(timer(fn))
    return times


def report(text: str, out: str | None) -> None:
    """Print a benchmark's Markdown report and, when ``out`` is given, write it there."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
