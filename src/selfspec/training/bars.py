"""Progress bars of the training jobs (``progress`` in conf/train.yaml): tqdm on stderr, with an ETA."""

from __future__ import annotations


def bar(iterable=None, *, enabled: bool, **kwargs):
    """A tqdm bar on stderr (``desc``, ``total``, ``unit`` ...); a no-op one when not ``enabled``.
    Log lines printed while it runs go above it when :func:`tqdm.contrib.logging.logging_redirect_tqdm`
    is active (the demo does that)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not enabled, dynamic_ncols=True, mininterval=1.0, **kwargs)
