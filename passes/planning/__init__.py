"""Helpers of the plan pass: exact min-max balancing, flop counts, half-layer planning."""
