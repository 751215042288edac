"""The layer cache: preallocated per-layer key/value buffers with independent lengths.

Self-speculative methods need more than the library's caches offer:

* **independent lengths per layer** — AdaDecode defers the deep layers of early-exited tokens
  (AdaDecode §3.2), Draft & Verify drafts with sublayers skipped (Draft & Verify §3.1), DEL
  drafts with the layers below the exit only;
* **O(1) truncate** for rollback after a rejected draft (a length change, no copy);
* **gather** of scattered slots into contiguous positions, to keep the accepted path of a
  token tree (PPD §3.2);
* **no per-token reallocation**: buffers are allocated once for ``max_length`` positions;
* **the position of each slot**, for layers with a sliding attention window (Gemma 3): a slot's
  position is not always its index (a tree pass writes its nodes at their depth's position, the
  skip search packs several sequences into one cache), and a window is a bound on positions.

The runtime (:mod:`selfspec.models.layered`) writes each layer's keys and values here
(:meth:`LayerCache.write`) and attends over what it returns.
"""

from __future__ import annotations

import math

import torch


def _huge_page_block(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor | None:
    """A zeroed tensor of ``shape`` in one block of huge pages (:mod:`selfspec.models.arena`: a step
    reads every cached key and value; SmolLM2 at 512 positions, 2 cores: a step 1-2% faster than from
    torch's 4 KiB pages), for a CPU cache of at least one huge page; else None."""
    from selfspec.models import arena

    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < arena.HUGE_PAGE or not arena.available():
        return None
    return arena.place([shape], dtype)[0]  # an anonymous mapping starts zeroed


class CacheOverflowError(RuntimeError):
    """Raised when a write would pass the preallocated ``max_length``."""


class LayerCache:
    """Per-layer K/V buffers of shape ``[1, kv_heads, max_length, head_dim]``.

    ``lengths[i]`` is how many positions of layer ``i`` hold valid keys/values. A write
    appends at ``lengths[i]``; :meth:`truncate` only moves the length back.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_length <= 0:
            raise ValueError(f"LayerCache max_length must be positive, got {max_length}")
        # every layer's keys and values in one tensor ``[2, L, 1, KV, max_length, D]``: accepting a
        # tree path (:meth:`gather`) moves every layer's slots in one operation, not four per layer
        shape = (2, num_layers, 1, num_kv_heads, max_length, head_dim)
        buffers = _huge_page_block(shape, dtype, device)
        self.buffers = buffers if buffers is not None else torch.zeros(shape, dtype=dtype, device=device)
        # each layer's a view by indexing (not unbind, whose views a training pass may not write in place)
        self.keys = [self.buffers[0, i] for i in range(num_layers)]
        self.values = [self.buffers[1, i] for i in range(num_layers)]
        self.lengths = [0] * num_layers
        self.max_length = max_length
        #: ``[num_layers, max_length]`` positions of the slots written with positions (allocated at
        #: the first such write: only windowed layers write them), or None
        self.positions: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    # --- the runtime's K/V writes (selfspec.models.layered.KV) -------------------------------
    def write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[1, kv_heads, n, head_dim]`` keys/values to layer ``layer_idx``; return all.
        ``positions`` (``[n]``, given by windowed layers) are recorded for :meth:`key_positions`."""
        start = self.lengths[layer_idx]
        end = start + key_states.shape[-2]
        if end > self.max_length:
            raise CacheOverflowError(
                f"layer cache overflow: layer {layer_idx} needs {end} positions but max_length is "
                f"{self.max_length}; raise the decoder's max_length (prompt + max_new_tokens + draft)"
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if positions is not None:
            self.position_buffer(key_states.device)[layer_idx, start:end] = positions
        self.lengths[layer_idx] = end
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            # a training pass: every layer is a view of one tensor, so the next layer's write bumps the
            # version autograd saved with this layer's keys; it attends over a copy (the slots before
            # it, which hold no gradient, and its own rows) and the buffer keeps the values only
            keys[:, :, start:end] = key_states.detach()
            values[:, :, start:end] = value_states.detach()
            return (torch.cat([keys[:, :, :start], key_states], dim=2),
                    torch.cat([values[:, :, :start], value_states], dim=2))
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        return keys[:, :, :end], values[:, :, :end]

    def position_buffer(self, device: torch.device) -> torch.Tensor:
        """:attr:`positions`, allocated at the first write that gives positions."""
        if self.positions is None:
            self.positions = torch.zeros(self.num_layers, self.max_length, dtype=torch.long, device=device)
        return self.positions

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """The positions of layer ``layer_idx``'s valid slots (``[length]``), as its writes gave them."""
        if self.positions is None:
            raise RuntimeError("the cache holds no positions: only writes with positions record them")
        return self.positions[layer_idx, : self.lengths[layer_idx]]

    # --- what the decoders use -------------------------------------------------------------
    def length(self, layer_idx: int) -> int:
        return self.lengths[layer_idx]

    def truncate(self, length: int, layers: range | list[int] | None = None) -> None:
        """Roll layers back to at most ``length`` positions (O(1): the buffers stay)."""
        for i in range(self.num_layers) if layers is None else layers:
            if self.lengths[i] > length:
                self.lengths[i] = length

    def gather(self, start: int, slots: torch.Tensor | list[int], layers=None) -> None:
        """Keep ``slots`` (absolute slot indices, ascending, all ``>= start``) at ``start…``.

        Used to accept a tree path: the accepted nodes' entries are copied to contiguous
        positions after the committed prefix and the layer is cut after them (PPD §3.2). Slots
        already in place (the root alone, or a path of first children) move nothing; otherwise
        every layer's keys and values move in one index operation (the slots' indices reach a GPU
        from pinned memory, without waiting), a subset of ``layers`` in one per layer.
        """
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
        n = len(slots)
        every = range(self.num_layers) if layers is None else layers
        if n and slots != list(range(start, start + n)):
            device = self.buffers.device
            idx = torch.tensor(slots, dtype=torch.long, pin_memory=device.type == "cuda").to(device, non_blocking=True)
            if layers is None or len(set(layers)) == self.num_layers:
                self.buffers[..., start:start + n, :] = self.buffers.index_select(4, idx)
                if self.positions is not None:
                    self.positions[:, start:start + n] = self.positions.index_select(1, idx)
            else:
                for i in every:
                    for buffer in (self.keys[i], self.values[i]):
                        buffer[:, :, start:start + n] = buffer.index_select(2, idx)
                    if self.positions is not None:
                        self.positions[i, start:start + n] = self.positions[i].index_select(0, idx)
        for i in every:
            self.lengths[i] = start + n

    def reset(self) -> None:
        self.lengths = [0] * self.num_layers

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid keys/values of one layer (views, for tests and inspection)."""
        n = self.lengths[layer_idx]
        return self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n]


class Appended:
    """K/V a pass reads without writing them (:class:`selfspec.models.layered.KV`): each layer's first
    ``length`` cached positions followed by the pass's own, concatenated. A gradient-checkpointed
    pass (:meth:`selfspec.models.layered.LayeredModel.forward`'s ``checkpoint``) runs every layer a
    second time in backward; appending to the cache would then write its rows twice."""

    def __init__(self, cache: LayerCache, length: int) -> None:
        self.cache, self.context = cache, length
        self._positions: dict[int, torch.Tensor] = {}

    def length(self, layer_idx: int) -> int:
        """Cached positions a pass reads before its own rows (every layer: the same ``length``)."""
        return self.context

    def write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.context
        keys = torch.cat([self.cache.keys[layer_idx][:, :, :n], key_states], dim=2)
        values = torch.cat([self.cache.values[layer_idx][:, :, :n], value_states], dim=2)
        if positions is not None:
            self._positions[layer_idx] = torch.cat([self.cache.key_positions(layer_idx)[:n], positions])
        return keys, values

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        return self._positions[layer_idx]

