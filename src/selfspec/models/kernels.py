"""The layered runtime's CPU operators: few-row linears that cost about one row, masked GQA
attention without copies, and the norm and rotary embedding as one operator each. The runtime
calls them explicitly (:mod:`selfspec.models.layered`); no module's ``forward`` is replaced, so
transformers' own ``generate`` (the HF peers, the tests' reference) runs the library's code.

A decoding step multiplies one token's hidden state by every weight matrix; a verification pass
multiplies k of them. On a memory-bound machine both should cost about the same (the weights
are read once either way), but the BLAS behind ``torch.nn.functional.linear`` on the AVX2 CPUs
this project is developed on takes 2-3x as long for 8 rows as for one, which makes every
verification pass expensive (the break-even τ of a speculative method rises with it).

``csrc/skinny_linear.cpp`` is a small AVX2 kernel for 1..``MAX_ROWS`` rows: each block of weight
rows is read once for all rows of the input, and each output element is computed by the same
instruction sequence whatever the number of rows, so a k-token verification pass produces
bit-identical linear outputs to k one-token steps. On a CPU with AVX-512 an AVX-512 path of the
kernel runs passes of more than 6 rows, chosen at runtime (the build flags stay AVX2): bit-identical to the
AVX2 path, 1.07-1.31x faster from 7 to 32 rows on SmolLM2 on a Xeon and slower below. On a Zen 4 it runs passes
of 5 rows or more, and every pass over weights of 1,024 columns or more, where it is faster there
(``csrc/skinny_linear.cpp``; ``scripts/bench_kernel_paths.py``; ``torch.ops.selfspec.skinny_isa`` forces either
path, for tests, and ``torch.ops.selfspec.skinny_crossover`` moves the crossover).

bfloat16 weights and activations take the kernel for every row count, prefill included (torch's
bfloat16 GEMM on an AVX2 CPU is 4x slower), accumulated in float32 and rounded to bfloat16 once, by
the fastest path the CPU has (``csrc/bf16_dot.cpp``; ``torch.ops.selfspec.skinny_bf16`` reports or
forces it): AMX tiles (TDPBF16PS) where the CPU has AMX-BF16, VDPBF16PS where it has AVX-512-BF16,
else each value widened exactly to float32 and float32 FMAs. Each path's rows are independent of
the pass by construction (every output element's instruction sequence is fixed by the weight's
shape), so bfloat16 stays lossless as float32 is; the paths give different bits from one another,
so a process takes one path for every pass, and attention's bfloat16 scores follow it.
Attention is made batch-invariant too (:func:`rowwise_attention`). It is compiled once per machine and
Python environment (:func:`build_name`) with ``torch.utils.cpp_extension`` into the selfspec cache and registered as
``torch.ops.selfspec.skinny_linear``.

Model config key ``linear_kernel``: ``auto`` (this kernel on a CPU with AVX2 in float32 or
bfloat16, else torch's), ``skinny`` (this kernel, or an error saying why it cannot run),
``torch`` (always torch's).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KERNELS = ("auto", "skinny", "torch")
#: rows (tokens) up to which the skinny kernel runs in float32; longer inputs (prefill) take :func:`wide_linear`
MAX_ROWS = 32
#: dtypes in which attention of up to MAX_ROWS query rows (decoding steps, verification passes,
#: trees) runs row by row (:func:`rowwise_attention`): exact, so a k-token pass attends as k
#: one-token steps. With the kernel it is also the fastest path measured here (SmolLM2-135M, 2
#: cores, ctx 512, fp32: a one-token step 48 ms against 57 ms through transformers' SDPA call, a
#: 16-token pass 92 against 98 ms); without it (float16, or no kernel) one SDPA call per row. A
#: benchmark empties the set to measure the cost (scripts/bf16_consistency.py)
ROWWISE_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
SOURCE = Path(__file__).with_name("csrc") / "skinny_linear.cpp"
ATTENTION_SOURCE = Path(__file__).with_name("csrc") / "rowwise_attention.cpp"
HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("avx2.h", "bf16_dot.h", "isa.h", "prefetch.h", "quant_tiles.h"))
LAYER_OPS_SOURCE = Path(__file__).with_name("csrc") / "layer_ops.cpp"
LAYER_WALK_SOURCE = Path(__file__).with_name("csrc") / "layer_walk.cpp"
QUANT_SOURCE = Path(__file__).with_name("csrc") / "quant_linear.cpp"

#: compiler flags. ``-fopenmp`` makes ``at::parallel_for`` (inlined into the kernels) run on torch's
#: OpenMP threads: without it the kernels ran on one thread whatever ``torch.set_num_threads`` said
#: (a 2-core machine ran the linears at half speed). The extension links ``libgomp.so.1`` by
#: soname, so it shares the runtime torch has already loaded instead of starting a second pool.
#: ``-ffp-contract=off``: a product and a sum stay two roundings, as in torch's elementwise ops
#: (``csrc/layer_ops.cpp``); the kernels that fuse do so with explicit FMA instructions.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)

class KernelUnavailable(RuntimeError):
    """The skinny kernel cannot run here (no AVX2, no compiler, wrong device or dtype)."""


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """12 hex digits naming the operators' sources, torch's version and the compiler flags: a
    build, and a cost profile measured with it (:func:`selfspec.measure.profile.machine`), belong
    to one digest."""
    return hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES) + b"".join(header.read_bytes() for header in HEADERS)
                          + torch.__version__.encode() + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def build_name() -> str:
    """The build folder's name: ``skinny-<source digest>-<environment digest>``. The second names
    what torch's builder writes into its build file besides the sources and flags: the include and
    library paths of this environment's torch and Python, and the compiler (``CXX``). Environments
    that share one cache (two venvs, ``SELFSPEC_CACHE``) then build once each, not on every switch
    (issue 52: each venv's build invalidated the other's, 12 full rebuilds in an hour)."""
    import sysconfig

    from torch.utils import cpp_extension

    paths = [*cpp_extension.include_paths(), *cpp_extension.library_paths(), sysconfig.get_paths()["include"],
             os.environ.get("CXX", "c++")]
    environment = hashlib.sha256("\0".join(paths).encode()).hexdigest()[:12]
    return f"skinny-{source_digest()}-{environment}"


def _build_dir() -> Path:
    """The build folder, its path resolved: torch's build file records the staged sources' absolute
    paths, so a cache reached through a symbolic link (a linked ``SELFSPEC_CACHE``, a home directory
    on another disk) rebuilt the kernels (~40 s) at every switch between the two spellings."""
    from selfspec.store.assets import cache_dir

    return (cache_dir() / "kernels" / build_name()).resolve()


#: the sources, compiled together into one library
SOURCES = (SOURCE, Path(__file__).with_name("csrc") / "bf16_dot.cpp", ATTENTION_SOURCE, LAYER_OPS_SOURCE,
           LAYER_WALK_SOURCE, QUANT_SOURCE)


def _stage_sources(folder: Path) -> list[str]:
    """Copies of the sources (and the header they include) inside the build folder, rewritten
    only when their content differs. torch's build file records the sources' absolute paths, so
    building from these copies lets checkouts that share one cache (``SELFSPEC_CACHE``) share
    one build instead of rebuilding on every switch."""
    staged = folder / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for source in (*SOURCES, *HEADERS):
        copy = staged / source.name
        data = source.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return [str(staged / source.name) for source in SOURCES]


@functools.lru_cache(maxsize=1)
def load() -> None:
    """Compile (once per machine and environment: ~15 s) and register ``torch.ops.selfspec.skinny_linear``,
    ``torch.ops.selfspec.rowwise_attention``, ``torch.ops.selfspec.rms_norm``,
    ``torch.ops.selfspec.rotary`` and ``torch.ops.selfspec.layer_walk``.

    One process builds at a time: an OS-level lock on the build folder (:mod:`selfspec.store.locks`),
    which dies with its holder; a process that finds it held says in a line what it waits for.
    Holding it, a ``lock`` file of torch's builder can only be a leftover of an interrupted build
    (torch's builder would wait for it forever), so it is removed.

    Raises :class:`KernelUnavailable` with the reason when the CPU lacks AVX2/FMA or the build fails.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise KernelUnavailable(f"the skinny linear kernel needs AVX2; this CPU reports {capability}")
    from selfspec.store.locks import hold

    folder = _build_dir()
    with contextlib.ExitStack() as held:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held.enter_context(hold(folder / "selfspec-build.lock", f"kernel build folder {folder}",
                                    wait=f"the CPU kernels (built once per machine and environment, ~15 s) are being built in {folder}"))
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            _load_read_only(folder, err)
            return
        (folder / "lock").unlink(missing_ok=True)
        from torch.utils.cpp_extension import load as build

        held.enter_context(_own_ninja())
        try:
            build("selfspec_skinny", _stage_sources(folder), extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                  build_directory=str(folder), is_python_module=False, verbose=False)
        except (OSError, RuntimeError, ImportError) as err:  # no compiler / ninja, compile error
            raise KernelUnavailable(f"building {SOURCE.name} in {folder} failed: {err}") from err


@contextlib.contextmanager
def _own_ninja():
    """Within the block, ``ninja`` on ``PATH`` is this environment's (the ``ninja`` package, a
    dependency), whatever ``PATH`` the process was given. torch's builder runs the first ``ninja`` on
    ``PATH``, and ninjas of other versions (Debian's 1.11 in ``/usr/bin``, pip's 1.13) keep build logs
    of other formats: each discards the other's log and rebuilds everything (found 2026-12-02: a
    process with the environment's ``bin`` on ``PATH``, such as an activated venv or the README's
    test, and one without it rebuilt the kernels, ~40 s, at every switch; three builds in one
    ``make test``). Where the package's program is not found, ``PATH`` is left as it is."""
    try:
        from ninja import BIN_DIR
    except ImportError:
        BIN_DIR = ""
    if not BIN_DIR or not os.access(os.path.join(BIN_DIR, "ninja"), os.X_OK):
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([BIN_DIR, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _load_read_only(folder: Path, err: OSError) -> None:
    """A kernel cache this process may not write (a shared, read-only warm cache; issue 39: it could
    not be used at all, even with ``model.linear_kernel=torch``, for want of the build lock): load
    the library built there (its folder is named by the sources' digest, so it is these sources'),
    or say that there is none to load."""
    built = folder / "selfspec_skinny.so"
    if not built.is_file():
        raise KernelUnavailable(f"the kernel cache {folder} cannot be written ({err.strerror}) and holds no build "
                                "of these sources: build it once where it can be written (make install), or set "
                                "SELFSPEC_CACHE to a writable directory") from None
    torch.ops.load_library(str(built))


def paths() -> dict[str, Any] | None:
    """The paths this process's CPU kernels take: ``float32`` (``avx2`` or ``avx512``, the path of a
    many-row pass; the two give the same bits) and ``float32_avx512_from`` (where ``float32`` is ``avx512``:
    ``{"rows": r, "columns": c}``, a pass of r rows or more, or over weights of c columns or more (None:
    no such rule), takes it; a cost, not bits), ``bfloat16`` (``widen``, ``avx512_bf16`` or
    ``amx``: each its own bits and costs) and ``float32_wide`` (:func:`wide_path`), or None where the kernels cannot run here. Part of what
    a machine is to a cost profile (:func:`selfspec.measure.profile.machine`) and to a run's record. The quantised
    drafts' kernel (``torch.ops.selfspec.quant_path()``) takes its AVX-512-VNNI path exactly where ``float32`` is
    ``avx512`` and the CPU (its family and model, also recorded) has VNNI, with the AVX2 path's bits, so it
    needs no entry of its own."""
    try:
        load()
    except KernelUnavailable:
        return None
    rows, columns = torch.ops.selfspec.skinny_crossover(0, 0)
    return {"float32": torch.ops.selfspec.skinny_isa(""), "float32_avx512_from": {"rows": rows, "columns": columns or None},
            "bfloat16": torch.ops.selfspec.skinny_bf16(""), "float32_wide": wide_path()}


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the skinny kernel (float32, or bfloat16 with float32
    accumulation; CPU, contiguous weight)."""
    y = torch.ops.selfspec.skinny_linear(x, weight)
    return y if bias is None else y + bias


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of ``[..., V]`` logits along the last dimension: the first maximum of each row (a NaN
    counts as the maximum), ``torch.argmax``'s indices, taken as ``torch.max``'s. On the CPU
    ``torch.max`` finds them 1.6-4x faster (one row of SmolLM2's 49,152 logits on 2 Zen 4 cores: float32
    45 us either way, bfloat16 46 against 192; eight rows 222 against 351 and 177 against 729), and a
    greedy token is picked for every step, every draft and every verified row."""
    return logits.max(-1).indices


def _wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records these inputs (the CPU operators have no backward: PPD's prompt
    training back-propagates through the runtime, and then takes the library's path)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, skinny: bool = True,
           rows_apart: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: the skinny kernel when ``skinny`` (the model's kernel is
    ``skinny``) and the input suits it; a wider float32 input (more than :data:`MAX_ROWS` rows) by
    :func:`wide_linear` (oneDNN) where torch has it; else ``F.linear``. ``rows_apart``: a float32 input of more
    than :data:`MAX_ROWS` rows runs in blocks of at most that many through the skinny kernel, so that
    each row's arithmetic is its own pass's (a batch of several sequences' few-row passes,
    :meth:`selfspec.models.layered.LayeredModel.run_batched`), where ``F.linear`` would block the rows
    together. A quantised ``weight`` (packed int8, uint8 or int16 rows, :mod:`selfspec.models.quantised`: a
    draft's) runs through its own kernel (``csrc/quant_linear.cpp``), whose rows never depend on the call's."""
    if weight.dtype in (torch.int8, torch.uint8, torch.int16):
        if not skinny:
            raise KernelUnavailable("a quantised weight runs on the CPU kernels (model.linear_kernel=skinny or auto "
                                    "on a CPU with AVX2); this model's linears are torch's")
        y = torch.ops.selfspec.quant_linear(x, weight)
        return y if bias is None else y + bias
    if skinny and x.dtype == weight.dtype and x.device.type == "cpu" and not _wants_grad(x):
        if x.shape[-1] % 8 == 0:
            if x.dtype == torch.bfloat16 or x.numel() <= MAX_ROWS * x.shape[-1]:
                # bfloat16: every row count (prefill too), so that a prompt row equals a decoding row
                return skinny_linear(x, weight, bias)
            if rows_apart:
                rows = x.reshape(1, -1, x.shape[-1])
                out = torch.cat([skinny_linear(block, weight, bias) for block in rows.split(MAX_ROWS, dim=1)], dim=1)
                return out.view(*x.shape[:-1], -1)
        if x.dtype == torch.float32 and wide_path() == "onednn" and not _wants_grad(*(t for t in (weight, bias) if t is not None)):
            return wide_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@functools.lru_cache(maxsize=1)
def wide_path() -> str:
    """Which library multiplies a float32 pass of more than :data:`MAX_ROWS` rows on the CPU (the
    prompt's prefill, PPD's larger trees) when the runtime's kernels are on: ``onednn`` (oneDNN's
    matmul, torch's ``mkldnn._linear_pointwise``) where torch has it, else ``torch`` (``F.linear``,
    MKL's GEMM). On AMD CPUs MKL multiplies float32 with AVX2 code even where the CPU has AVX-512
    (``MKL_CBWR`` and ``MKL_ENABLE_INSTRUCTIONS`` do not move it), oneDNN with the CPU's widest:
    on a Zen 5, 2 threads, 480-500 GFLOPS against MKL's 205-225 for prefill shapes, and
    SmolLM2's XSum prompts prefill in 0.6 s instead of 0.85, Qwen2.5-Coder-1.5B's in 4.1 s instead of
    8.2 (docs/2026-12-06-prefill-on-onednn.md). Its bits are its own (not
    MKL's). oneDNN promises the same bits on every call with one thread count; across thread counts
    and row counts it gave the same bits here for every shape tried (SmolLM2's, Qwen's, Llama-3-8B's
    linears, 33-300 rows, 1-32 threads), ``tests/test_runtime.py`` checks that on each machine the
    tests run on, and the thread policy (:mod:`selfspec.decoding.threads`), which runs a wide pass on
    either count, is refused where :func:`wide_thread_dependence` finds it otherwise. Part of :func:`paths`: a cost profile measured with the other library's prefill is not
    this one's."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if torch.backends.mkldnn.is_available() and mkldnn is not None and hasattr(mkldnn, "_linear_pointwise"):
        return "onednn"
    return "torch"


@functools.lru_cache(maxsize=8)
def wide_thread_dependence(threads: int) -> str | None:
    """Why a wide float32 pass (:func:`wide_linear`) may give other bits on one thread than on
    ``threads`` here, or None: it gave the same bits on products of the shapes where a library would
    split a sum between threads first (few rows and outputs, long inputs) and of model-sized ones. oneDNN
    promises the same bits at one thread count only; this is what lets the thread policy switch counts."""
    if wide_path() != "onednn" or threads < 2:
        return None
    g = torch.Generator().manual_seed(0)
    current = torch.get_num_threads()
    try:
        for rows, k, n in ((33, 8192, 64), (40, 14336, 512), (33, 576, 1536), (64, 1536, 8960)):
            x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
            torch.set_num_threads(threads)
            many = wide_linear(x, w)
            torch.set_num_threads(1)
            if not torch.equal(many, wide_linear(x, w)):
                return (f"oneDNN's matmul (the prefill's and wider passes' linears) gave other bits on 1 and {threads} "
                        f"threads for a {rows}x{k} @ {k}x{n} product")
    finally:
        torch.set_num_threads(current)
    return None


def wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` of a float32 CPU pass by oneDNN's matmul (:func:`wide_path`): no
    autograd (the caller keeps products that need a gradient on ``F.linear``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _layer_ops_apply(*tensors: torch.Tensor) -> bool:
    """Whether the fused layer operators take these inputs: CPU, float32 or bfloat16, no gradient wanted."""
    t = tensors[0]
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) and not _wants_grad(*tensors)


def rms_norm(module: torch.nn.Module, x: torch.Tensor, enabled: bool = True, unit_offset: bool = False
             ) -> torch.Tensor:
    """The family's RMSNorm ``module`` on ``x``: one operator (``csrc/layer_ops.cpp``, the same
    arithmetic) on CPU when ``enabled`` (the kernels are built), else the module.

    ``unit_offset``: the module is Gemma's (``Gemma3RMSNorm``: the normalised x times ``1 + weight``,
    both in float32, rounded to the dtype once; its epsilon is ``eps``), not Llama's (``x`` rounded
    to the dtype, times ``weight``; ``variance_epsilon``). The operator follows either form."""
    weight = module.weight
    if enabled and _layer_ops_apply(x, weight) and x.dtype == weight.dtype:
        eps = module.eps if unit_offset else module.variance_epsilon
        return torch.ops.selfspec.rms_norm(x, weight, float(eps), unit_offset)
    return module(x)


def rotary(apply, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, enabled: bool = True):
    """The family's ``apply_rotary_pos_emb`` (``apply``) on q and k: one operator on CPU when
    ``enabled`` (the same products and sum, each rounded as torch rounds them), else ``apply``."""
    if (enabled and _layer_ops_apply(q, k, cos) and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.dim() == 4 and q.shape[0] == k.shape[0] == 1 and cos.shape[0] == 1 and q.shape[-1] % 2 == 0):
        return torch.ops.selfspec.rotary(q, k, cos, sin)
    return apply(q, k, cos, sin)


@functools.lru_cache(maxsize=1)
def _attention_kernel() -> bool:
    """Whether ``torch.ops.selfspec.rowwise_attention`` is built here (else row-wise SDPA calls)."""
    try:
        load()
    except KernelUnavailable as err:
        log.warning("row-wise attention: one SDPA call per row (the kernel is unavailable: %s)", err)
        return False
    return True


def rowwise_attention(query, key, value, allowed=None, scaling=None) -> torch.Tensor:
    """Attention of ``query`` (``[1, H, q, D]``) computed one query row at a time, each exactly as
    a one-token decoding step computes it: row ``i`` attends over the keys its boolean mask row
    allows (``allowed``: ``[..., q, kv]``, shared by all heads; None = every key), in key order.

    SDPA's CPU kernels block the queries of a call together, so row ``i`` of a ``q``-row call
    differs in the last bits from a one-row call (in float32 too); in bfloat16 those bits flip
    argmaxes at near-ties (docs/design/runtime.md §4). With the kernel (``csrc/rowwise_attention.cpp``,
    float32 / bfloat16, one call for all rows) the row-invariance is by construction; without it,
    each row makes the SDPA call a one-token step makes (a view of the cache when its keys are a
    prefix, else gathered in order; no mask; ``enable_gqa``), which is exact too but costs one
    SDPA call per row. Returns ``[1, H, q, D]``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.dtype in (torch.float32, torch.bfloat16) and query.shape[-1] % 8 == 0 and _attention_kernel():
        mask = allowed if allowed is not None else torch.empty(0, dtype=torch.bool)
        return torch.ops.selfspec.rowwise_attention(query, key, value, mask, float(scale))
    if allowed is None:
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    allowed = allowed.reshape(allowed.shape[-2], allowed.shape[-1])
    kv = allowed.shape[-1]
    blocked = ~allowed
    lead = torch.where(blocked.any(-1), blocked.int().argmax(-1), kv)  # allowed keys before the first blocked one
    counts, lead = allowed.sum(-1).tolist(), lead.tolist()
    rows = []
    for i, (n, first) in enumerate(zip(counts, lead)):
        if n == first:  # a prefix of the cache: the view a decoding step attends over
            k, v = key[:, :, :n], value[:, :, :n]
        else:
            idx = allowed[i].nonzero().squeeze(-1)
            k, v = key.index_select(2, idx), value.index_select(2, idx)
        rows.append(F.scaled_dot_product_attention(query[:, :, i:i + 1], k, v, scale=scaling, enable_gqa=True))
    return torch.cat(rows, dim=2)


def grouped_attention(query, key, value, mask, scaling: float) -> torch.Tensor:
    """Attention of ``query`` ``[1, H, q, D]`` over ``key``/``value`` ``[1, KV, kv, D]`` under a
    ``mask`` shared by every head (``[1, 1, q, kv]``, boolean or additive), with each KV group's
    ``G = H / KV`` query heads stacked as ``G·q`` rows of its KV head: one SDPA call over the keys
    and values as the cache holds them. transformers' SDPA wrapper repeats the keys and values to
    every query head whenever a mask is given and more than one query row attends (``repeat_kv``:
    a copy of the whole buffer per layer, 4x the K/V of a Llama-3-8B static pass over its padded
    cache); stacking repeats only the mask's rows. Returns ``[1, q, H, D]``."""
    b, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    stacked = query.reshape(b, key.shape[1], groups * rows, dim)
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask.repeat(1, 1, groups, 1),
                                         scale=scaling, is_causal=False)
    return out.reshape(b, heads, rows, -1).transpose(1, 2).contiguous()


def attention(attend: Callable, module, query, key, value, mask, scaling: float, **kwargs):
    """Attention of ``query`` over ``key``/``value`` (``[1, H, q, D]``, ``[1, KV, kv, D]``) in the
    runtime; returns ``[1, q, H, D]``. ``attend`` is the family's attention function (transformers'
    SDPA wrapper or the family's eager attention), which runs wherever none of these apply:

    * on CPU in :data:`ROWWISE_DTYPES` under SDPA, a one-token step (no mask) and a pass of up to
      :data:`MAX_ROWS` query rows with a boolean mask (verification passes, trees) run through
      :func:`rowwise_attention`, so a k-token pass attends exactly as k one-token steps;
    * longer ones (prefill) with grouped-query attention let the kernel share K/V heads
      (``enable_gqa``) instead of copying them once per query head, as transformers does whenever
      a mask is given; the outputs are the same;
    * elsewhere (a GPU) a masked pass with grouped-query attention stacks each group's query heads
      (:func:`grouped_attention`): every static pass has a mask over its padded buffer, so
      transformers would copy the buffer's keys and values to every query head, layer by layer.

    With a gradient wanted (PPD's prompt training back-propagates through attention; the row-wise
    kernel has no backward), it is ``attend``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attend is not sdpa_attention_forward or query.shape[0] != 1 or _wants_grad(query, key, value):
        return attend(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)[0]
    grouped = (mask is not None and getattr(module, "num_key_value_groups", 1) > 1
               and mask.shape[:-2].numel() == 1 and query.shape[1] % key.shape[1] == 0)
    if query.device.type != "cpu":
        if grouped and not kwargs:
            return grouped_attention(query, key, value, mask, scaling)
        return attend(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)[0]
    rows = query.shape[2]
    if query.dtype in ROWWISE_DTYPES and (mask is None and rows == 1 or mask is not None and rows <= MAX_ROWS
                                          and mask.dtype == torch.bool and mask.shape[:-2].numel() == 1):
        return rowwise_attention(query, key, value, mask, scaling).transpose(1, 2).contiguous()
    if not grouped:
        return attend(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)[0]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=False,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def resolve(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel ``linear_kernel=kernel`` means here: ``skinny`` or ``torch``.

    ``auto`` takes ``skinny`` on a CPU in float32 or bfloat16 when it builds, and says so in the log when it
    does not; an explicit ``skinny`` that cannot run raises :class:`KernelUnavailable`.
    """
    if kernel not in KERNELS:
        raise ValueError(f"model.linear_kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "torch":
        return "torch"
    why = None
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        why = (f"it runs on CPU in float32 or bfloat16, this model is on {device.type} in "
               f"{str(dtype).replace('torch.', '')}")
    else:
        try:
            load()
        except KernelUnavailable as err:
            why = str(err)
    if why is None:
        return "skinny"
    if kernel == "skinny":
        raise KernelUnavailable(f"model.linear_kernel=skinny: {why}; use model.linear_kernel=auto or torch")
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        log.warning("linear kernel: torch's (the skinny kernel is unavailable: %s)", why)
    return "torch"


def main() -> int:
    """``make kernels`` (a step of ``make test`` and ``make demo``'s set-up): build the CPU kernels for this
    machine and environment into the asset cache now, so that the first run or test loads them
    instead of compiling them (~40 s on 2 cores) inside its own time. Where they cannot run here
    it says why and succeeds: runs then use torch's linears (``model.linear_kernel=auto``)."""
    import time

    start = time.monotonic()
    try:
        load()
    except KernelUnavailable as err:
        print(f"selfspec's CPU kernels: unavailable here ({err}); runs use torch's linears")
        return 0
    print(f"selfspec's CPU kernels: ready in {_build_dir()} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["KERNELS", "MAX_ROWS", "KernelUnavailable", "argmax", "attention", "build_name", "grouped_attention", "linear", "load",
           "paths",
           "resolve", "rms_norm", "rotary",
           "rowwise_attention", "skinny_linear"]
