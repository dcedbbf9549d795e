"""Helpers of the TP pass (``ppsplit.passes.tp``): placements and how views move them (``placements``), the
per-op rules that propagate them over a stage graph (``rules``), concrete shapes and the lockstep evaluation of a
TP group's ranks in one process (``evaluate``)."""
