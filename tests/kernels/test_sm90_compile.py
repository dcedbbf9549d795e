"""The hot paths' Triton kernels compile for an H100/H200 (sm_90) in bf16 and fit its shared memory, and the decode
step's also with programmatic dependent launch (each waits on the device before its first access), checked on a
machine without a GPU (``tests/kernels/sm90.py``: Triton's own compiler and ptxas, no launch). The interpreter runs
the kernels' arithmetic in fp32/fp16; this is what it cannot check."""
import os
import subprocess
import sys

import pytest

from ppsplit.triton_kernels.common import HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def test_kernels_compile_for_sm90_in_bf16():
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this Triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this Triton ships no NVIDIA backend (its ptxas compiles the cubins)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.kernels.sm90"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert done.returncode == 0 and lines and all(line.startswith("ok ") for line in lines), \
        "\n".join(lines) + done.stderr[-3000:]
    assert any(line.startswith("ok rope_write ") for line in lines)
    assert any(line.startswith("ok fp8 grouped experts ") for line in lines)
    assert any(line.startswith("ok mxfp4 grouped experts ") for line in lines)
    assert any(line.startswith("ok paged latent attention, fp8 kv_b_proj ") for line in lines)
    # under programmatic dependent launch: each decode-step kernel waits on the device, the GEMVs prefetch first
    assert any(line.startswith("ok pdl fp8 gemv, gate/up with silu_mul ") for line in lines)
    assert any(line.startswith("ok fp8 gemv, q/k/v with rope_write ") for line in lines)
    assert sum(line.startswith("ok pdl ") for line in lines) == 12
