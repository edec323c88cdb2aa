"""Triton kernels and their launchers, one module per op (no torch.library code here)."""


# Launch arithmetic in plain Python: triton.cdiv / triton.next_power_of_2 are constexpr functions in newer Triton,
# a few microseconds per call on the host.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
