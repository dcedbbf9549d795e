"""Helpers of the trace pass: the positioned KV cache handed to the model, and export-failure blame."""
