"""Running stages in one process: ``SplitModel`` and CUDA-graph capture."""
