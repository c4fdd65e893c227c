"""Structured fuzzing of nodes and the switch: generator and oracle."""
