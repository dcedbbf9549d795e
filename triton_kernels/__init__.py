"""Custom ops that the stage graphs call: tap stores, plain and fused. Importing registers them.

Installed as ``ppsplit.triton_kernels`` (a top-level ``triton_kernels`` package belongs to other projects).
Every op has a plain torch path for CPU tensors, so the graphs run anywhere.
"""
from ppsplit.triton_kernels.fused_norm import (  # noqa: F401  (registers torch.ops.ppsplit.*)
    HAVE_TRITON, KINDS, NORM_KINDS, add_norm, add_norm_store, add_store, norm, norm_reference, norm_store, tap_store,
)
from ppsplit.triton_kernels.attention import attention_reference, cache_attention  # noqa: F401,E402
from ppsplit.triton_kernels.recurrent import gated_delta_scan, ssm_scan  # noqa: F401,E402
from ppsplit.triton_kernels.cache import cache_write  # noqa: F401,E402
from ppsplit.triton_kernels.paged import paged_attention, paged_conv1d, paged_write, slot_mapping  # noqa: F401,E402
from ppsplit.triton_kernels.fp8 import fp8_linear  # noqa: F401,E402
from ppsplit.triton_kernels.pointwise import rope, silu_mul  # noqa: F401,E402
from ppsplit.triton_kernels.mxfp4 import mxfp4_grouped_mm  # noqa: F401,E402
from ppsplit.triton_kernels.qkv import linear_rope_write  # noqa: F401,E402
