"""Compiling: from a Hugging Face model (or checkpoint) to stages and to a compiled folder.

``api`` (split_model, trace_model), ``writer`` (compile_model), ``measure`` (the time policy), the checkpoint
readers and transformers' weight conversions, the demo model, and the torch.compile backend. Needs transformers."""
