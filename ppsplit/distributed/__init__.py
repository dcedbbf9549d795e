"""Multi-process pipeline: one rank per stage over ``torch.distributed`` (``pipeline``), and the launcher behind
``ppsplit run`` / ``python -m ppsplit.run`` (``launch``)."""
from ppsplit.distributed.pipeline import (DEFAULT_TIMEOUT, PipelineError, PipelineRank, Stats, agree, for_pipelining,
                                          group_stages, init)

__all__ = ["DEFAULT_TIMEOUT", "PipelineError", "PipelineRank", "Stats", "agree", "for_pipelining", "group_stages",
           "init"]
