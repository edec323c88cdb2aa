"""Test setup shared by every suite.

Without a GPU, Triton's interpreter is switched on before fusedlayers (and so Triton's @jit) is
imported, so that ``backend='triton'`` runs the kernels on CPU tensors. With a GPU it stays off and
the ``cuda``-marked tests run the compiled kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusedlayers  # noqa: E402,F401  (registers the ops after the environment is set)

HAS_CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
