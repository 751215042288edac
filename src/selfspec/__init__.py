"""selfspec: lossless self-speculative decoding — train, evaluate, compare."""

__version__ = "0.1.0"
