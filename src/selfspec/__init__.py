"""selfspec: lossless self-speculative decoding — train, evaluate, compare."""

from selfspec import numerics

# before any matrix product: MKL reads its reproducibility mode once, at its first call
numerics.set_default()

__version__ = "0.1.0"
