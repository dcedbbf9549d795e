"""Core: plain data and small helpers every layer shares (errors, options, the split plan, tensor and fx facts).

Imports torch and nothing of ppsplit above it."""
