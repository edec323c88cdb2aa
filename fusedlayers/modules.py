"""nn.Module drop-ins for their stock PyTorch twins (same arguments, same parameter names)."""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from fusedlayers import functional as F

__all__ = ["Softmax"]


class Softmax(nn.Module):
    """Drop-in for ``nn.Softmax(dim)``, running ``fl.softmax``."""

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim
        if dim is None:  # nn.Softmax's legacy implicit dim, with its warning
            warnings.warn("Implicit dimension choice for softmax has been deprecated. "
                          "Change the call to include dim=X as an argument.", stacklevel=2)
            dim = 0 if input.dim() in (0, 1, 3) else 1
        return F.softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
