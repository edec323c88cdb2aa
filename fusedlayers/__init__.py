"""fusedlayers: fused transformer layers with Triton kernels (CUDA) and PyTorch references (CPU).

Importing the package registers the ops in the ``torch.ops.fusedlayers`` namespace.
"""

import torch

from fusedlayers import qat
from fusedlayers.backend import current_backend, use_backend, use_deterministic_attention
from fusedlayers.functional import *  # noqa: F403
from fusedlayers.functional import __all__ as _functional_all
from fusedlayers.modules import *  # noqa: F403
from fusedlayers.modules import __all__ as _modules_all
from fusedlayers.ops._eager import register_inductor_fallbacks

if torch.__version__ < "2.13":  # see register_inductor_fallbacks: costs importing inductor (about a second)
    register_inductor_fallbacks()

__version__ = "0.1.0"
__all__ = ["qat", "use_backend", "current_backend", "use_deterministic_attention", *_functional_all, *_modules_all]
