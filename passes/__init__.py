"""The pass pipeline, one file per pass (installed as ``ppsplit.passes``)::

    HF model -> trace -> annotate -> plan -> partition -> taps -> fuse -> emit
"""
