"""Test setup shared by every suite.

Without a GPU, Triton's interpreter is switched on before fusedlayers (and so Triton's @jit) is
imported, so that ``backend='triton'`` runs the kernels on CPU tensors. With a GPU it stays off and
the ``cuda``-marked tests run the compiled kernels.
"""

import os

# pytest-xdist (-n auto) runs a worker per core: each worker's torch, and the processes its tests start, take their
# share of the cores, since threads that spin-wait for each other at every op on shared cores make small ops many times
# slower (a float64 gradcheck of 7 x 9 logits: 14 s alone, 54-137 s beside another worker with two threads each)
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _XDIST_WORKERS:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
