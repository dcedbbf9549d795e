"""Custom ops that the stage graphs call: tap stores, plain and fused. Importing registers them.

Installed as ``ppsplit.triton_kernels`` (a top-level ``triton_kernels`` package belongs to other projects).
Every op has a plain torch path for CPU tensors, so the graphs run anywhere.
"""
from ppsplit.triton_kernels.store import tap_store  # noqa: F401  (registers torch.ops.ppsplit.tap_store)
