"""The passes (installed as ``ppsplit.passes``); their order is stated once, in ``ppsplit.passes.pipeline``::

    trace -> annotate -> plan -> partition -> taps -> attention -> fuse -> emit

One file per pass here; their helpers in ``tracing/`` (the cache handed to the model, export blame) and
``planning/`` (balancing, flop counts, half layers); ``rewrites/`` holds what is applied to built stages.
"""
