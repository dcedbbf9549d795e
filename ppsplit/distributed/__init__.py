"""Multi-process serving: one rank per stage over ``torch.distributed`` (``engine``: ``PipelineEngine``), its
transport (``transport``), a stage in ``torch.distributed.pipelining`` (``pipelining``), and the launcher behind
``ppsplit run`` / ``python -m ppsplit.run`` (``launch``)."""
from ppsplit.distributed.engine import PipelineEngine, Stats
from ppsplit.serve.runner import buckets_up_to
from ppsplit.distributed.pipelining import for_pipelining
from ppsplit.distributed.transport import DEFAULT_TIMEOUT, PipelineError, agree, backend_for, init

__all__ = ["DEFAULT_TIMEOUT", "PipelineEngine", "PipelineError", "Stats", "agree", "backend_for", "buckets_up_to",
           "for_pipelining", "init"]
