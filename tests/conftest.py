import os
import tempfile

# Inductor's on-disk cache is shared by every checkout on the machine and keys a compiled graph without the schemas
# of the custom ops it calls: another branch's ppsplit ops would be called with this one's arguments. One per run.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ppsplit-inductor-")

import torch

# Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings

import pytest

from tests.support import tiny_model

warnings.filterwarnings("ignore", message=".*Consider using tensor.detach.*")

_TRACED: dict = {}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and on a busy 2-core machine far faster (no spin-waiting).
    A module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def traced_cache():
    """(model, traced graph) per architecture: one trace serves every split of that model."""
    import ppsplit

    def get(arch: str):
        if arch not in _TRACED:
            model = tiny_model(arch)
            _TRACED[arch] = (model, ppsplit.trace_model(model))
        return _TRACED[arch]

    return get


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
