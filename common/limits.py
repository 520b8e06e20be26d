"""Bounds every receiver enforces on the wire, shared with the CLIs so that a value a server
would refuse is refused up front (no heavy imports here)."""

MAX_LAYERS = 8  # sampled layers (fanout entries) per request
MAX_FANOUT = 100_000  # neighbours per node per layer; -1 takes all
