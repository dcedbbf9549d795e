"""EAGLE-3: the drafter on the last stage, its checkpoint formats, and speculative decoding."""
