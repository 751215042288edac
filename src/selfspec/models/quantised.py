"""Quantised copies of the target's own weights, for drafting (issue 69; ML-SpecQD, arXiv 2503.13565 §3:
the target's weights cast to 4 bits draft for it; QuantSpec, arXiv 2502.10424).

On a memory-bound CPU a pass costs about what it reads. A draft over a copy of every linear and the LM
head rounded per block of 32 values reads about 0.28 (``int8``), 0.16 (``int4``) or 0.19 (``q4_1``, its
linears) of float32's bytes, and agrees with the target on most greedy tokens, so it is a draft that costs a fraction of a step. Its
tokens are only proposals: verification runs the target's own weights, so the output is the target's.

Formats (one packed row per weight row, ``csrc/quant_linear.cpp`` reads them):

``int8``  one scale per 32 values, ``s = amax / 127``, ``q = round(w / s)`` (llama.cpp's Q8_0 rounding);
          a ``torch.int8`` tensor ``[N, K + K/8]``: the K values, then K/32 float32 scales as bytes.
``int4``  one scale per 32 values, symmetric, ``s = amax / 7``, ``q = round(w / s)`` in [-7, 7], stored as
          ``q + 8``; a ``torch.uint8`` tensor ``[N, K/2 + K/8]``: per pair of blocks 32 bytes, byte j holding
          the first block's value j (low nibble) and the second's (high nibble), then the scales (a row's last
          block without a pair: 16 bytes, value j low and value j + 16 high).
``q4_1``  llama.cpp's Q4_1 scheme with float32 scale and minimum: per block of 32, ``m = min(w)``,
          ``s = (max(w) - m) / 15``, ``q = round((w - m) / s)`` in [0, 15], ``w = s q + m``; a ``torch.int16``
          tensor ``[N, 3K/8]`` (the dtype marks the format; its bytes are what count): the nibbles as
          ``int4``'s, blocks in pairs (``q`` itself, no offset), then K/32 float32 scales, then K/32 float32 minimums.
          A block whose values lie on an evenly spaced grid of at most 16 levels from its minimum is held
          on that grid (``s`` its step), exactly: so the blocks of a GGUF file's Q4_1 tensors and of its
          Q4_K ones (scale ``d sc``, minimum ``dmin m``), the file's own weights. SmolLM2's embedded file is
          Q4_1, and its q4_1 copy holds every one of its 3,317,760 linear blocks exactly: the draft reads the
          target's own weights at 0.19 of float32's bytes, and differs from it only where the kernel rounds
          the activations (in two int8 terms, about 15 bits: its greedy drafts agreed with the target on 576
          of 576 tokens). Gemma 3's and Qwen's files are Q4_K_M: their Q4_K tensors are held exactly (a
          quarter of Gemma's linear weights, 85% of Qwen's); their Q5_0, Q6_K and Q8_0 tensors, with more
          levels a block, are rounded again. Its LM head is ``int8`` (:func:`head_format`), which holds a
          Q4_1 file's Q8_0 token embedding exactly.

The copy is made from the loaded target (float32 or bfloat16, read as float32) at the first draft that
asks for it, held once per model (:meth:`selfspec.models.layered.LayeredModel.weight_set`), and never
written over the target's weights; the embedding table is the target's own (a lookup reads one row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "FORMATS", "WeightSet", "copied_weights", "dequantise", "head_format", "packed_bytes", "problem",
           "quantise", "weights_format"]

#: the quantised formats a pass may read (``Pass.weights``), besides the target's own (None)
FORMATS = ("int8", "int4", "q4_1")
#: values per block (one scale each)
BLOCK = 32
#: the largest magnitude of a stored value, per format
_LEVELS = {"int8": 127, "int4": 7}
#: the packed dtype of each format (the dtype tells a packed weight's format: :func:`weights_format`)
_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "q4_1": torch.int16}
#: the format of a copy's LM head where it is not the copy's own (:func:`head_format`)
_HEAD_FORMATS = {"q4_1": "int8"}


def head_format(fmt: str) -> str:
    """The format of the LM head of a copy in format ``fmt``: its own, but q4_1's head is int8, as a Q4_1 GGUF
    file keeps its token embedding (the tied head) in Q8_0, which the int8 format holds exactly."""
    return _HEAD_FORMATS.get(fmt, fmt)


def copied_weights(model) -> list[torch.Tensor]:
    """The target's weights a copy holds (of ``model``, a :class:`~selfspec.models.layered.LayeredModel`), in
    the order a pass reads them: per layer q|k|v, output, gate|up, down; then the LM head (last)."""
    fam = model.family
    return [w for i in range(model.num_layers) for w in (model._qkv[i][0], fam.out_proj(i).weight,
                                                         model._gate_up[i][0], fam.down_proj(i).weight)] + [fam.lm_head.weight]


def weights_format(weight: torch.Tensor) -> str | None:
    """The format of a weight the runtime multiplies by: None for the target's own (a float tensor),
    ``int8``, ``int4`` or ``q4_1`` for a quantised copy's packed rows."""
    return next((fmt for fmt, dtype in _DTYPES.items() if weight.dtype == dtype), None)


def packed_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of an ``n × k`` weight in format ``fmt``."""
    return n * {"int8": k + k // 8, "int4": k // 2 + k // 8, "q4_1": k // 2 + k // 4}[fmt]


def packed_dtype(fmt: str) -> torch.dtype:
    """The dtype a packed weight of format ``fmt`` is held in."""
    return _DTYPES[fmt]


def quantise(weight: torch.Tensor, fmt: str, rows: int = 4096, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` (``[N, K]``, K a multiple of 32) in format ``fmt`` (module docstring), ``rows`` rows at a
    time (the float32 copy of a 151,936-row head would otherwise double the memory it takes); written into
    ``out`` (``[N, packed_bytes(fmt, 1, K)]`` bytes as :func:`packed_dtype`) where given, else a new tensor."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: one of {', '.join(FORMATS)}")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"a weight of {k} input features cannot be quantised in blocks of {BLOCK}")
    if out is None:
        out = torch.empty(n, packed_bytes(fmt, 1, k) // packed_dtype(fmt).itemsize, dtype=packed_dtype(fmt))
    for a in range(0, n, rows):
        w = weight[a:a + rows].detach().to(device="cpu", dtype=torch.float32).reshape(-1, k // BLOCK, BLOCK)
        if fmt == "q4_1":
            out[a:a + rows] = _q4_1(w).view(packed_dtype(fmt))
            continue
        level = _LEVELS[fmt]
        scale = w.abs().amax(-1) / level
        q = torch.where(scale.unsqueeze(-1) > 0, w / scale.unsqueeze(-1), torch.zeros_like(w))
        q = q.round().clamp_(-level, level).to(torch.int8)
        scales = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(len(w), -1)
        if fmt == "int8":
            out[a:a + rows] = torch.cat([q.reshape(len(w), k).view(torch.uint8), scales], 1).view(torch.int8)
        else:
            out[a:a + rows] = torch.cat([_nibbles((q + 8).to(torch.uint8)), scales], 1)
    return out


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    """Blocks ``w`` (``[n, K/32, 32]`` float32) in the ``q4_1`` format, as ``[n, 3K/4]`` bytes."""
    n, blocks = w.shape[0], w.shape[1]
    low = w.amin(-1, keepdim=True)
    span = w.amax(-1, keepdim=True) - low
    scale = span / 15
    q = _levels(w, low, scale)
    # a block the min/max fit does not hold exactly may lie on a coarser grid (a Q4_K block): find it. Searched
    # where the rows' first has a block of at most 16 distinct values: a file's tensor is all in one format, and
    # the search (a sort of every block) would only slow down a copy of a float or 5- to 8-bit tensor.
    redo = ((q * scale + low) != w).any(-1)
    if redo.any() and _few_values(_gaps(w[0])).any():
        scale[redo] = span[redo] / _steps(w[redo], low[redo], span[redo])
        q[redo] = _levels(w[redo], low[redo], scale[redo])
    as_bytes = [t.to(torch.float32).contiguous().view(torch.uint8).reshape(n, -1) for t in (scale, low)]
    return torch.cat([_nibbles(q.to(torch.uint8)), *as_bytes], 1)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Levels ``q`` (``[n, K/32, 32]`` uint8, each below 16) as the nibble formats' ``[n, K/2]`` bytes: each pair of
    blocks (0 and 1, 2 and 3, ...) in 32 bytes, byte j holding the even block's value j in its low nibble and the
    odd block's in its high one (the kernel unpacks two blocks from one load); a row's last block without a pair
    in 16 bytes, byte j holding its value j low and value j + 16 high."""
    n, blocks = q.shape[0], q.shape[1]
    paired = blocks - blocks % 2
    parts = [(q[:, 0:paired:2] | (q[:, 1:paired:2] << 4)).reshape(n, paired * 16)]
    if blocks % 2:
        parts.append(q[:, -1, :16] | (q[:, -1, 16:] << 4))
    return torch.cat(parts, 1)


def _levels_of(nibbles: torch.Tensor, blocks: int) -> torch.Tensor:
    """The levels ``[n, blocks, 32]`` (uint8) that :func:`_nibbles` packed into ``nibbles`` (``[n, blocks * 16]``)."""
    n, paired = nibbles.shape[0], blocks - blocks % 2
    pairs = nibbles[:, :paired * 16].reshape(n, paired // 2, 1, 32)
    q = torch.cat([pairs & 0x0F, pairs >> 4], 2).reshape(n, paired, 32)
    if blocks % 2:
        tail = nibbles[:, paired * 16:]
        q = torch.cat([q, torch.cat([tail & 0x0F, tail >> 4], 1).unsqueeze(1)], 1)
    return q


def _levels(w: torch.Tensor, low: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The level (0 to 15, float32) nearest each value of ``w`` on its block's grid from ``low`` in ``step``s."""
    return torch.where(step > 0, (w - low) / step, torch.zeros_like(w)).round_().clamp_(0, 15)


def _gaps(w: torch.Tensor) -> torch.Tensor:
    """The gaps between each block's (last dimension's) values in ascending order."""
    return w.sort(-1).values.diff(dim=-1)


def _few_values(gaps: torch.Tensor) -> torch.Tensor:
    """Whether each block of :func:`_gaps` holds at most 16 distinct values (as a grid of 15 steps can)."""
    return (gaps > 0).sum(-1) < 16


def _steps(w: torch.Tensor, low: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Per block of ``w`` (``[m, 32]``), the number of steps ``k`` (1 to 15) of the evenly spaced grid from its
    minimum ``low`` to ``low + span`` (``[m, 1]``) that its values lie on, as ``[m, 1]`` float32, the coarsest
    such grid (its step is the one the values were stored with: a finer grid's ``span / k`` can round to a step
    an ulp off); 15, the min/max fit, for a block on no such grid. So a block a file stored in 4 bits with a
    step and minimum of its own (llama.cpp's Q4_K: scale ``d sc``, minimum ``dmin m``, its levels seldom
    reaching both 0 and 15) is held exactly, not rounded again. A block with more than 16 distinct values lies
    on no such grid; one within a 256th of a step of every grid point is taken to lie on it (float32's rounding
    of the file's ``d sc q - dmin m``). The grid is first guessed from the block's smallest gap between two
    values (one step, unless no two of its levels are adjacent), then searched from the coarsest."""
    steps = torch.full_like(span, 15.0)

    def on_grid(x, lo, sp, k):  # does every value of a block lie on the grid of k steps
        step = sp / k
        return ((_levels(x, lo, step) * step + lo - x).abs().amax(-1, keepdim=True) <= step / 256).squeeze(-1)

    gaps = _gaps(w)
    todo = _few_values(gaps)
    smallest = torch.where(gaps > 0, gaps, torch.inf).amin(-1, keepdim=True)
    guess = (span / smallest).round_().clamp_(1, 15)
    for k in [None, *range(1, 15)]:  # the guess, then every grid from the coarsest
        if not todo.any():
            break
        fits = on_grid(w[todo], low[todo], span[todo], guess[todo] if k is None else k)
        hit = todo.nonzero().squeeze(-1)[fits]
        steps[hit] = guess[hit] if k is None else float(k)
        todo[hit] = False
    return steps


def dequantise(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 weight ``[N, k]`` a packed one stands for (tests, agreement studies)."""
    fmt = weights_format(packed)
    raw = packed.view(torch.uint8)
    n, blocks = packed.shape[0], k // BLOCK
    values = k if fmt == "int8" else k // 2
    scales = raw[:, values:values + 4 * blocks].contiguous().view(torch.float32).reshape(n, blocks, 1)
    if fmt == "int8":
        q = raw[:, :values].view(torch.int8).to(torch.float32).reshape(n, blocks, BLOCK)
        return (q * scales).reshape(n, k)
    q = _levels_of(raw[:, :values], blocks).to(torch.float32)
    if fmt == "int4":
        return ((q - 8) * scales).reshape(n, k)
    low = raw[:, values + 4 * blocks:].contiguous().view(torch.float32).reshape(n, blocks, 1)
    return (q * scales + low).reshape(n, k)


def problem(model) -> str | None:
    """Why ``model`` (a :class:`~selfspec.models.layered.LayeredModel`) cannot run passes over a quantised
    copy of its weights, or None: the copy runs on the runtime's CPU kernels, and every linear's input
    features must fill whole blocks of :data:`BLOCK` values."""
    if model.linear_kernel != "skinny":
        return (f"a quantised copy runs on the CPU kernels, and {model.name}'s linears are torch's (model.linear_kernel="
                f"skinny or auto on a CPU with AVX2)")
    widths = {int(w.shape[1]) for w, _, _ in model._qkv + model._gate_up}
    widths |= {int(model.family.out_proj(i).weight.shape[1]) for i in range(model.num_layers)}
    widths |= {int(model.family.down_proj(i).weight.shape[1]) for i in range(model.num_layers)}
    odd = sorted(w for w in widths if w % BLOCK)
    if odd:
        return f"{model.name}'s linears read {odd[0]} features, not whole blocks of {BLOCK}"
    return None


@dataclass
class WeightSet:
    """The weights a pass reads in one format: per layer the fused q|k|v (with the target's bias and the
    split sizes), the output projection, the fused gate|up and the down projection, each packed, and the
    LM head packed; ``walk``: the one-operator walk's weights with these in place of the target's (None
    where the target's walk does not apply). Biases and norms are the target's own (float)."""

    fmt: str
    qkv: list[tuple[torch.Tensor, torch.Tensor | None, list[int]]]
    out: list[tuple[torch.Tensor, torch.Tensor | None]]
    gate_up: list[tuple[torch.Tensor, torch.Tensor | None, list[int]]]
    down: list[tuple[torch.Tensor, torch.Tensor | None]]
    head: torch.Tensor
    walk: dict | None

    @property
    def nbytes(self) -> int:
        """Bytes held (the memory estimate counts them)."""
        packed = [w for w, *_ in self.qkv + self.out + self.gate_up + self.down] + [self.head]
        return sum(t.numel() * t.element_size() for t in packed)


def weight_set(model, fmt: str) -> WeightSet:
    """``model``'s (a :class:`~selfspec.models.layered.LayeredModel`) weights in format ``fmt``: where the
    target's weights sit in huge pages (:mod:`selfspec.models.arena`), the copy does too, laid out in the
    order a pass reads it (per layer q|k|v, output, gate|up, down; then the head), as the target's are: in
    4 KiB pages a streaming read stops its prefetch at every page and misses the TLB on each."""
    fam, n = model.family, model.num_layers
    order = copied_weights(model)  # per layer q|k|v, output, gate|up, down (packed[4i + 0..3]); the head packed[-1]
    places = [None] * len(order)
    fmts = [fmt] * (len(order) - 1) + [head_format(fmt)]
    if model.weights_placed:
        from selfspec.models import arena

        shapes = [(int(w.shape[0]), packed_bytes(f, 1, int(w.shape[1]))) for w, f in zip(order, fmts)]
        places = [v.view(packed_dtype(f)) for v, f in zip(arena.place(shapes, torch.uint8), fmts)]
    packed = [quantise(w, f, out=place) for w, f, place in zip(order, fmts, places)]
    qkv = [(packed[4 * i], b, sizes) for i, (_, b, sizes) in enumerate(model._qkv)]
    out = [(packed[4 * i + 1], fam.out_proj(i).bias) for i in range(n)]
    gate_up = [(packed[4 * i + 2], b, sizes) for i, (_, b, sizes) in enumerate(model._gate_up)]
    down = [(packed[4 * i + 3], fam.down_proj(i).bias) for i in range(n)]
    head = packed[-1]
    walk = None
    if model._walk is not None:
        walk = dict(model._walk, qkv=[w for w, _, _ in qkv], out=[w for w, _ in out], gate_up=[w for w, _, _ in gate_up],
                    down=[w for w, _ in down])
    return WeightSet(fmt, qkv, out, gate_up, down, head, walk)
