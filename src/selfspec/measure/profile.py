"""A machine's cost profile for one model shape, and the prediction of a recorded run's time from it.

PPD §4 writes a method's speedup as ``τ(n) / L_fp(n)``: the acceptance length ``τ`` is the
algorithm's and the forward latency ``L_fp`` is the machine's. The ledger
(:mod:`selfspec.models.ledger`) records every step's model work as ops; a profile holds what each
op costs on one machine, so a run's time can be predicted from its trace alone, here or on any
other machine with a profile of the same model shape:

* ``attention[context][rows]``: one attention sublayer over ``rows`` new rows after ``context``
  cached positions; ``mlp[rows]``: one MLP sublayer. Measured as whole passes (all layers; all
  MLPs left out), divided by the layer count, so a pass's fixed costs (embedding, rotary tables,
  mask) are spread over its layers;
* ``head[vocab][rows]``: the LM-head product of ``rows`` states, full and truncated vocabularies;
* ``linear[rows]``: an exit head's ``d × d`` transform;
* ``tree[size]`` and ``pass[context][rows]``: whole tree passes (PPD) and whole chain passes
  (all layers and the head on every row) at the context nearest 512, the ``L_fp(n)`` curve,
  kept for reading and checks;
* ``warp[nucleus][vocab][rows]``: sampled token selection, ``rows`` logit rows warped into the
  target distribution (temperature, and top-p when ``nucleus`` is 1: a sort of the vocabulary),
  at the full and truncated vocabularies. Top-k is priced as the warp it runs within;
* ``host``: the seconds of a plain greedy step beyond what its ops cost measured alone: selecting
  the token, the host sync, and what running inside a decoding loop adds to the isolated passes;
* ``walk`` (optional; 0 where absent): what one walk of the layers costs beyond its sublayers (the
  call into the runtime, its rotary rows, the ledger's record), charged once per layer walk: a
  decoder that walks its layers in several calls (AdaDecode between its exit heads, a draft, early
  exit's remainder) pays it per call, and the ``attention`` table is measured net of it. Measured on
  a CPU (every layer walked one at a time against all in one walk); a GPU profile has none;
* ``host_steps`` (optional): what a drafting step's own host work adds to ``host``, by the step's
  source (:class:`~selfspec.decoding.base.StepTrace`): ``tree`` for PPD's candidate tree
  (choosing it, laying it out, the prompt tokens' top-k, reading the candidates back: a few hundred
  small device operations, 1-1.5 ms a step on an H100 against a 3.2 ms SmolLM2 step), ``context``
  for an n-gram lookup. (By tree size it did not vary monotonically on a CPU: 1.7-5.2 ms a step for
  mean trees of 3-13 nodes, so one figure per source is kept.)
  Measured by running those methods (random prompt tokens and trees): the seconds of their
  ``draft``, ``tree`` and ``host`` components less the ops priced there;
* ``host_draft`` (optional; 0 where absent): what each token a chain drafts with the model itself adds
  to the host work of its step (a ``self`` step of Draft & Verify, a quantised self-draft, KnapSpec,
  CLaSp, SWIFT, early exit, DEL, AdaDecode): the drafter's call into the runtime for the token, the
  draft's pick. A cheap draft (a quantised copy: a third of a step) makes it a share that matters.
  Measured by running drafts of a fixed length through the skip-set drafter, less their priced ops;
* ``spans`` (optional; a profile measured with static-shape passes, ``capture`` static or graphs):
  per context, the cache slots the measured passes attended over. A static pass runs at its
  bucket's rows and attends over its whole (padded, masked) cache, so a walk that recorded its
  bucket and slots (:class:`~selfspec.models.ledger.LayerOp`) is priced at those: a 5-row pass at
  the 8-row price, a pass over a pooled cache of 1,280 slots at the slots' price, not its context's;
* ``quantised`` (optional; a CPU profile whose runtime runs quantised copies of the weights):
  per format (``int8``, ``int4``: :mod:`selfspec.models.quantised`), ``attention``, ``mlp`` and ``head``
  tables as above, measured over that copy: what a quantised self-draft's walks and head products
  cost (a walk or head op records its format, :class:`~selfspec.models.ledger.LayerOp`). A run whose
  ops read a format the profile did not measure is refused before it decodes;
* ``eager`` (optional): ``attention`` and ``mlp`` tables as above, measured with the static-pass
  runner off. A profile measured with CUDA graphs (``model.capture`` ``graphs``) prices its
  tables as captured passes; a decoding pass that ran eagerly (a ledger walk flagged so, or, in a
  trace recorded without capture, one wider than the largest bucket) is priced from ``eager``.
  Format-3 GPU profiles measured before it have none: :meth:`Profile.unpriced` counts the passes
  they cannot price, and a prediction that needs them is withheld with that count rather than
  priced as captured. On a CPU both are the same pass.

A prediction charges each op to its component, and ``host`` once per step to the component of
the step's last layer walk (the pass whose result the step waits for: ``plain``, ``verify`` or
``prefill``), where the decoding loop's phase timers find that time too; ``host_steps`` goes to
``host``. Costs between measured points are interpolated linearly (in rows, then in context) and
extrapolated along the last measured segment past the last measured row count, never below its
cost: on a GPU a pass is memory-bound and costs about the same from 32 rows to 128 (the H100
profiles: 8.1 ms for a Vicuna-7B pass of 1 row, 10.0 ms for 32), so pricing a 105-row PPD tree
in proportion to rows (3.3x the 32-row cost) made its projection 0.89x against the paper's 2.24x;
on a CPU the segments are close to proportional anyway. Profiles measure up to 128 rows, and a
profile measured with CUDA graphs up to the largest bucket (256 rows), the widest pass it replays.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from selfspec.models.capture import BUCKETS, bucket

log = logging.getLogger(__name__)
from selfspec.models.ledger import COMPONENTS, HeadOp, LayerOp, Op, as_op
from selfspec.store.runinfo import cpu_id, cpu_name

__all__ = ["FORMAT", "Profile", "ProfileMismatch", "machine_name", "model_shape"]

FORMAT = 3
#: how this selfspec measures a profile's tables, part of a cached profile's file name (so a cache
#: measured the old way is measured again) and recorded in the profile (``measurement``): 2 = the
#: CPU's caches pushed out before every timed run, and ``walk`` measured (1 or absent: neither); 3 =
#: and the quantised copies' tables (``quantised``)
MEASUREMENT = 3
#: rows measured at every context (a chain of k + 1, a tree: PPD's paper trees reach 120 rows; with
#: CUDA graphs also the largest bucket, :func:`selfspec.evaluation.profiling.measure_profile`);
#: prefill-sized rows at context 0
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
PREFILL_ROWS = (64, 128, 256, 512)
CONTEXTS = (0, 128, 512, 1024)
#: the sampling settings whose warps ``warp`` measures, by ``nucleus`` (top-p sorts the vocabulary)
WARP_SETTINGS = {1: {"temperature": 0.6, "top_p": 0.95}, 0: {"temperature": 0.6}}
#: rows warped at once: one at a time (chain verification), more for a tree or a batch of drafts
WARP_ROWS = (1, 4, 16)
#: rows of the quantised tables (a draft chain's one row, a batch's or a verification-sized pass's few)
QUANT_ROWS = (1, 2, 4, 8, 16)
#: truncated vocabularies measured besides the full head, as fractions of it
VOCAB_FRACTIONS = (1, 1 / 4, 1 / 16)
#: PPD tree sizes (candidate nodes) whose host work ``host_steps`` measures (with 3 prompt tokens,
#: passes of up to ~20, ~60 and ~100 rows: every one within the largest bucket, so captured on a GPU)
HOST_TREE_NODES = (4, 12, 24)
#: the ledger components where a drafting step's host work shows (tree layout, candidates, lookups)
HOST_WORK = ("draft", "tree", "host")


class ProfileMismatch(ValueError):
    """A profile of another model shape than the run's."""


def model_shape(model) -> dict[str, Any]:
    """What a step's cost depends on in a model: its family and sizes, dtype (a
    :class:`~selfspec.models.layered.LayeredModel`)."""
    cfg = model.config
    return {
        "model_type": str(getattr(cfg, "model_type", "")),
        "num_layers": int(model.num_layers),
        "hidden_size": int(model.hidden_size),
        "intermediate_size": int(getattr(cfg, "intermediate_size", 0)),
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(model.num_kv_heads),
        "head_dim": int(model.head_dim),
        "vocab_size": int(model.vocab_size),
        "dtype": str(model.dtype).replace("torch.", ""),
    }


def machine(device: torch.device) -> dict[str, Any]:
    """The machine a profile describes: device, its name, threads, and the libraries that run it
    (torch, transformers and the digest of the runtime's CPU operators' sources); on a CPU also the
    kernels' paths and, where the system says, the CPU's family, model and AVX-512
    (:func:`~selfspec.store.runinfo.cpu_id`)."""
    import importlib.metadata as md

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    versions = {}
    for pkg in ("torch", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    # the runtime's CPU operators: a profile measured before they changed is not this runtime's
    from selfspec.models.kernels import paths, source_digest

    versions["selfspec-kernels"] = source_digest()
    info = {"device": device.type, "hardware": gpu or cpu_name(), "threads": torch.get_num_threads(),
            "versions": versions}
    if device.type == "cpu":
        # which instructions the kernels run here: CPUs of one name (a VM's "AMD EPYC") may differ
        info["kernel_paths"] = paths()
        # and which generation: one name covers several ("AMD EPYC": Zen 3, 4 and 5), each its own costs
        info |= cpu_id()
    return info


def machine_name(info: dict[str, Any]) -> str:
    """A short file-name-safe label of a machine: ``cpu-amd-epyc-7b13-2t``, ``cpu-intel-xeon-2t`` (from
    "Intel(R) Xeon(R) Processor") or ``cuda-nvidia-h100...``; a CPU whose bfloat16 products run on
    its dot-product units says which (``cpu-amd-epyc-avx512-bf16-2t``, ``cpu-intel-xeon-amx-2t``):
    CPUs of one name may differ there, and so do their bfloat16 costs. An AMD CPU whose family the
    info records (:func:`machine`) says its generation, ``zen3`` (family 25 without AVX-512),
    ``zen4`` (25 with it), ``zen5`` (26), else ``f<family>`` rather than a guess
    (``cpu-amd-epyc-zen5-avx512-bf16-2t``): a VM's "AMD EPYC" with AVX-512-BF16 is a Zen 4 or a Zen 5,
    each with its own costs. Intel's name stays without one (its AMX label tells Sapphire Rapids and
    later apart); an info recorded before the family was (an old profile's machine) keeps the name
    it had then."""
    words = "".join(c if c.isalnum() else "-" for c in info["hardware"].lower()).split("-")
    words = [w for w in words if w and w not in {"processor", "core", "with", "radeon", "graphics", "cpu", "r", "tm"}]
    bf16 = (info.get("kernel_paths") or {}).get("bfloat16", "widen")
    units = f"-{bf16.replace('_', '-')}" if info["device"] == "cpu" and bf16 != "widen" else ""
    tail = f"{units}-{info['threads']}t" if info["device"] == "cpu" else ""
    if "amd" in words and info.get("cpu_family") is not None:
        tail = f"-{amd_generation(info['cpu_family'], info.get('cpu_avx512'))}{tail}"
    return f"{info['device']}-{'-'.join(words[:5])}{tail}"


def amd_generation(family: int, avx512: bool | None) -> str:
    """An AMD CPU's generation from its family number and AVX-512 (:func:`machine_name`): family 25
    is Zen 3 without AVX-512 and Zen 4 with it, 26 is Zen 5; any other, or 25 with AVX-512 not
    recorded, is ``f<family>``."""
    if family == 26:
        return "zen5"
    if family == 25 and avx512 is not None:
        return "zen4" if avx512 else "zen3"
    return f"f{family}"


class Curve:
    """Measured costs by one variable, sorted once: linear between measured points; before them the
    first (``before="first"``, the default) or in proportion to ``x`` (``before="proportional"``: a
    head product by its vocabulary rows); past the last along the last segment's slope, never below
    the last point (``past="slope"``, the default: by rows, module docstring; attention by context) or
    in proportion to ``x`` (``past="proportional"``)."""

    __slots__ = ("xs", "ys", "past", "before")

    def __init__(self, points: dict[int, float], past: str = "slope", before: str = "first") -> None:
        self.xs = sorted(points)
        self.ys = [points[x] for x in self.xs]
        self.past = past
        self.before = before

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0] * max(x, 0) / xs[0] if self.before == "proportional" and xs[0] > 0 else ys[0]
        if x >= xs[-1]:
            if self.past == "slope":
                if len(xs) < 2:
                    return ys[-1]
                return max(ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2]), ys[-1])
            return ys[-1] * x / xs[-1] if xs[-1] > 0 else ys[-1]
        i = bisect.bisect_left(xs, x)
        if xs[i] == x:
            return ys[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


#: a profile's cost tables, by how deep their numbers sit: {key: seconds}, {key: {key: seconds}}...
_TABLES = {"attention": 2, "mlp": 1, "head": 2, "linear": 1, "warp": 3, "tree": 1, "pass": 2}


def _check_tables(data: dict[str, Any], where: str) -> None:
    """Refuse a profile whose identity or cost tables are missing or malformed, or whose costs are
    not finite and non-negative (issue 39: such a profile gave raw KeyError/IndexError, or priced
    runs with NaN or negative seconds), naming the file and the first bad entry. (A measured table
    may hold a 0: a tiny model's MLP is the difference of two timings, clamped at 0; that every step
    costs something is checked once the profile is built.)"""
    def bad(what: str) -> ValueError:
        return ValueError(f"profile {where}: {what}; {remedy(where)}")

    model, machine_ = data.get("model"), data.get("machine")
    if not isinstance(data.get("name"), str) or not isinstance(model, dict) or not isinstance(machine_, dict):
        raise bad("it lacks its name, model or machine")
    shape = model.get("shape")
    if not isinstance(shape, dict) or not all(k in shape for k in ("model_type", "num_layers", "hidden_size",
                                                                   "vocab_size", "dtype")):
        raise bad("it does not name the model shape it was measured for (model.shape)")
    if not all(k in machine_ for k in ("device", "hardware")):
        raise bad("it does not name its machine (machine.device, machine.hardware)")

    def walk(table: Any, depth: int, key: str) -> None:
        if depth == 0:
            if isinstance(table, bool) or not isinstance(table, (int, float)) or not math.isfinite(table) or table < 0:
                raise bad(f"{key} is {table!r}, not a finite number of seconds >= 0")
            return
        if not isinstance(table, dict) or not table:
            raise bad(f"{key} is missing or empty")
        for k, v in table.items():
            try:
                int(k)
            except (TypeError, ValueError):
                raise bad(f"{key} has the key {k!r}, not a number") from None
            walk(v, depth - 1, f"{key}[{k}]")

    for name, depth in _TABLES.items():
        if name not in ("tree", "pass") or data.get(name):  # the whole passes: a record, priced by the ops
            walk(data.get(name), depth, name)
    host = data.get("host")
    if isinstance(host, bool) or not isinstance(host, (int, float)) or not math.isfinite(host) or host < 0:
        raise bad(f"host is {host!r}, not a finite number of seconds >= 0")
    for name in ("walk", "host_draft"):
        value = data.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad(f"{name} is {value!r}, not a finite number of seconds >= 0")
    if data.get("eager") is not None:
        for name, depth in (("attention", 2), ("mlp", 1)):
            walk((data["eager"] or {}).get(name), depth, f"eager.{name}")
    quantised = data.get("quantised")
    if quantised is not None:
        if not isinstance(quantised, dict):
            raise bad(f"quantised is {quantised!r}, not a table of formats")
        for fmt, tables in quantised.items():
            for name, depth in (("attention", 2), ("mlp", 1), ("head", 2)):
                walk((tables or {}).get(name) if isinstance(tables, dict) else None, depth, f"quantised.{fmt}.{name}")
    spans = data.get("spans")
    if spans is not None:
        if not isinstance(spans, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                  for v in spans.values()):
            raise bad(f"spans is {spans!r}, not a table of cache slots by context")
        for k in spans:
            try:
                int(k)
            except (TypeError, ValueError):
                raise bad(f"spans has the key {k!r}, not a number") from None
    steps = data.get("host_steps")
    if steps is not None:
        if not isinstance(steps, dict):
            raise bad(f"host_steps is {steps!r}, not a table")
        for source in ("tree", "context"):
            if source in steps:
                walk(steps[source], 0, f"host_steps.{source}")


class Profile:
    """A cost profile (module docstring), as stored in its JSON file."""

    def __init__(self, data: dict[str, Any], path: str | None = None) -> None:
        where = path or (data.get("name") if isinstance(data, dict) else None) or "in memory"
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"profile {where}: format {found!r}, "
                             f"this selfspec reads format {FORMAT}; {remedy(path)}")
        _check_tables(data, where)
        self.data = data
        self.path = path
        num = lambda table: {int(k): float(v) for k, v in table.items()}  # noqa: E731
        #: the measured tables (seconds), keyed by numbers
        self.attention = {int(c): num(row) for c, row in data["attention"].items()}
        self.mlp = num(data["mlp"])
        self.head_cost = {int(v): num(row) for v, row in data["head"].items()}
        self.linear_cost = num(data["linear"])
        # ... as curves, sorted once (a gate prices every step with them)
        self._contexts = sorted(self.attention)
        self._attention = {c: Curve(row) for c, row in self.attention.items()}
        self._mlp, self._linear = Curve(self.mlp), Curve(self.linear_cost)
        self._head = {v: Curve(row) for v, row in self.head_cost.items()}
        self.warp_cost = {int(k): {int(v): num(row) for v, row in t.items()} for k, t in data["warp"].items()}
        self._warp = {k: {v: Curve(row) for v, row in t.items()} for k, t in self.warp_cost.items()}
        self.host = float(data["host"])
        #: seconds one layer walk costs beyond its sublayers (``walk``; 0 in profiles without it)
        self.walk = float(data.get("walk", 0.0))
        #: the tables price captured passes (a GPU profile measured with graphs on)
        self.captures = data["model"].get("capture") == "graphs"
        #: the tables were measured with static-shape passes (``capture`` static or graphs): each at
        #: its bucket's rows over a padded cache, so a walk is priced at the bucket it runs in and,
        #: where both record it, by the cache slots its attention spans (``spans``: per measured
        #: context, the slots its passes spanned) rather than by its context
        self.static = data["model"].get("capture") in ("static", "graphs")
        self.spans = {int(c): int(n) for c, n in (data.get("spans") or {}).items()}
        eager = data.get("eager")
        self._eager = None if not eager else (
            {int(c): Curve(num(row)) for c, row in eager["attention"].items()}, Curve(num(eager["mlp"])))
        #: per quantised format, its (attention curves by context, MLP curve, head curves by vocabulary)
        self._quantised = {fmt: ({int(c): Curve(num(row)) for c, row in t["attention"].items()}, Curve(num(t["mlp"])),
                                 {int(v): Curve(num(row)) for v, row in t["head"].items()})
                           for fmt, t in (data.get("quantised") or {}).items()}
        #: seconds each self-drafted token adds to its step's host work (``host_draft``; 0 in profiles without it)
        self.host_draft = float(data.get("host_draft", 0.0))
        #: seconds a drafting step's host work adds, by the step's source (``host_steps``)
        self.host_steps = {k: float(v) for k, v in (data.get("host_steps") or {}).items()}
        #: the most rows measured at a decoding context (after cached positions); a profile's wider
        #: rows at context 0 are prefills, measured as those run
        self.decoding_rows = max((max(row) for c, row in self.attention.items() if c > 0),
                                 default=max(self.attention[0]))
        if not self.plain_step() > 0:  # a priced schedule divides by what a pass costs
            raise ValueError(f"profile {where}: it prices a plain step at {self.plain_step()!r} s: {remedy(path)}")

    # --- identity ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def shape(self) -> dict[str, Any]:
        return self.data["model"]["shape"]

    @property
    def machine(self) -> dict[str, Any]:
        return self.data["machine"]

    def check_shape(self, shape: dict[str, Any], what: str = "the run", any_dtype: bool = False) -> None:
        """Refuse a profile of another model shape, naming what differs. ``any_dtype``: the same
        architecture in another dtype passes (a projection: a trace is the algorithm's, not the
        dtype's)."""
        diff = [f"{k}: profile {self.shape.get(k)!r}, {what} {v!r}" for k, v in shape.items()
                if self.shape.get(k) != v and not (any_dtype and k == "dtype")]
        if diff:
            raise ProfileMismatch(f"profile {self.name} ({self.path or 'in memory'}) is of another model shape "
                                  f"than {what} ({'; '.join(diff)}): measure one for this model "
                                  f"(make profile MODEL=...) or pick a profile of its shape")

    def describes(self, info: dict[str, Any]) -> bool:
        """Whether this profile was measured on the machine ``info`` (:func:`machine`) describes: its
        device, hardware, threads and, on a CPU, the kernels' paths and the CPU's family, model and
        AVX-512 (a profile recorded before them describes no CPU that records them: one named
        ``cpu-amd-epyc-avx512-bf16-2t`` may be a Zen 4's or a Zen 5's)."""
        return not self.differences(info)

    def differences(self, info: dict[str, Any]) -> dict[str, tuple]:
        """What of :meth:`describes`'s machine record differs between this profile's and ``info``:
        ``{key: (this profile's, info's)}``."""
        mine = self.machine
        return {k: (mine.get(k), info.get(k)) for k in ("device", "hardware", "threads", "kernel_paths",
                                                          "cpu_family", "cpu_model", "cpu_avx512")
                if mine.get(k) != info.get(k)}

    def summary(self) -> dict[str, Any]:
        """What a run records of the profile it was costed with (``plan``: the thinner plan it was
        measured with where its measurement had a budget, :mod:`selfspec.evaluation.profiling`)."""
        m = self.machine
        return {"name": self.name, "path": self.path, "device": m["device"], "hardware": m["hardware"],
                "threads": m.get("threads"), "measured": self.data.get("measured"),
                "others_busy": self.data.get("others_busy")} | ({"plan": self.data["plan"]} if "plan" in self.data else {})

    # --- costs ---------------------------------------------------------------------------------
    @property
    def formats(self) -> tuple[str, ...]:
        """The quantised weight formats whose passes this profile prices (``quantised``)."""
        return tuple(self._quantised)

    def _tables(self, weights: str) -> tuple:
        """The quantised tables of format ``weights``, or a :class:`ValueError` saying the profile has none."""
        found = self._quantised.get(weights)
        if found is None:
            raise ValueError(f"profile {self.name} has no prices of passes over {weights} weights (measured by a "
                             f"selfspec before quantised drafts, or where they cannot run): measure it again "
                             f"(make profile, or profile=auto)")
        return found

    def attention_cost(self, rows: int, context: int, eager: bool = False, span: int | None = None,
                       weights: str = "") -> float:
        """Seconds of one attention sublayer on ``rows`` new rows after ``context`` cached positions
        (``eager``: from the eager tables); ``span``, a static pass's cache slots, prices it by the
        slots it attends over where the profile records the slots its own passes spanned; ``weights``:
        over that quantised copy (its own tables)."""
        if weights:
            return Curve({c: curve(rows) for c, curve in self._tables(weights)[0].items()}, past="slope")(context)
        table = self._eager[0] if eager else self._attention
        if span and self.spans and not eager:
            return Curve({self.spans[c]: curve(rows) for c, curve in table.items() if c in self.spans})(span)
        return Curve({c: curve(rows) for c, curve in table.items()}, past="slope")(context)

    def ran(self, op: LayerOp, eager: bool = False) -> tuple[int, int | None]:
        """The rows and cache slots a walk ``op`` is priced at: as recorded where the profile's tables
        are of dynamic passes or the walk ran eagerly; else the bucket it ran in (recorded by a
        static pass, or the one its rows take on a runtime with static passes: a trace recorded
        without them, projected) and the slots its attention spanned (None where not recorded)."""
        if eager or not self.static:
            return op.rows, None
        return op.padded or bucket(max(op.rows, 1)) or op.rows, op.span or None

    def mlp_cost(self, rows: int, weights: str = "") -> float:
        """Seconds of one MLP sublayer on ``rows`` rows (``weights``: over that quantised copy)."""
        return self._tables(weights)[1](rows) if weights else self._mlp(rows)

    def layer_cost(self, rows: int, context: int) -> float:
        """Seconds of one decoder layer (attention and MLP) on ``rows`` new tokens after ``context``."""
        return self.attention_cost(rows, context) + self.mlp_cost(rows)

    def eager(self, op: LayerOp) -> bool:
        """Whether a layer walk ``op`` is priced as an eager pass apart from the captured tables: the
        profile captures, and the walk ran eagerly (flagged in the ledger) or, in a trace recorded
        without capture, is a decoding pass wider than the largest bucket (it would run eagerly)."""
        if not self.captures:
            return False
        return op.eager or (op.context > 0 and op.rows > BUCKETS[-1])

    def _unpriced(self, trace: Iterable[dict[str, Any]]) -> tuple[int, int, int]:
        """Decoding walks of ``trace`` a profile that captures cannot price: ``(eager, wide, widest)``,
        the eager ones when it has no eager tables, and the captured ones wider than
        :attr:`decoding_rows` with the widest of them. A CPU profile prices every walk."""
        eager = wide = widest = 0
        if not self.captures:
            return eager, wide, widest
        for step in trace:
            for op in map(as_op, step.get("ops") or ()):
                if op.kind != "L":
                    continue
                if self.eager(op):
                    eager += self._eager is None
                elif op.context > 0 and op.rows > self.decoding_rows:
                    wide, widest = wide + 1, max(widest, op.rows)
        return eager, wide, widest

    def unpriced(self, trace: Iterable[dict[str, Any]]) -> int:
        """How many walks of ``trace`` this profile cannot price (:meth:`why_unpriced`)."""
        eager, wide, _ = self._unpriced(trace)
        return eager + wide

    def why_unpriced(self, trace: Iterable[dict[str, Any]]) -> str | None:
        """Why this profile cannot price ``trace`` (None: it can). A format-3 GPU profile, measured
        with CUDA graphs before eager tables and decoding rows past 32 existed, has no price for an
        eager pass, and its wider rows are context-0 prefills run eagerly then (they price a 64-row
        MLP below a 32-row one): a prediction from either is withheld, not extrapolated."""
        eager, _, widest = self._unpriced(trace)
        why = []
        if eager:
            why.append(f"{eager} eager decoding passes: profile {self.name} was measured with CUDA graphs and has "
                       "no eager prices")
        if widest:
            why.append(f"passes of {widest} rows: profile {self.name} measured decoding passes up to "
                       f"{self.decoding_rows} rows")
        return "; ".join(why) + " (measure it again with this selfspec)" if why else None

    def host_step(self, source: str | None, drafted: int = 0, guessed: int = 0) -> float:
        """What a step's own host work adds to :attr:`host` (``host_steps``), by its source
        (:attr:`~selfspec.decoding.base.StepTrace.source`), and ``host_draft`` per token a ``self`` step
        ``drafted`` with a call of its own: less the ``guessed`` ones, which rode in another's pass
        (:attr:`~selfspec.decoding.base.StepTrace.guessed`)."""
        return self.host_steps.get(source, 0.0) + (self.host_draft * (drafted - guessed) if source == "self" else 0.0)

    def head(self, rows: int, vocab: int, weights: str = "") -> float:
        """Seconds of a head product of ``rows`` states against ``vocab`` rows (``weights``: of that
        quantised copy's head): fewer rows than the smallest measured (a sixteenth of the vocabulary) in
        proportion to them, as a product that reads its rows costs (a draft vocabulary's context rows: a
        few hundred; priced as the smallest measured before 2026-12-07, 16,384 rows on Gemma 3)."""
        heads = self._tables(weights)[2] if weights else self._head
        return Curve({v: cost(rows) for v, cost in heads.items()}, before="proportional")(vocab)

    def head_layers(self, vocab: int, context: int = 512) -> float:
        """A head of ``vocab`` rows on one state, in units of one decoder layer on one token at
        ``context``: DEL's exit-head cost and the draft vocabulary job's head cost."""
        layer = self.layer_cost(1, context)
        return self.head(1, vocab) / layer if layer > 0 else float("inf")

    def _joined(self, op) -> float:
        """Seconds of a batch's joined pass ``op`` (a walk or head product of several sequences' rows). Its
        linears keep each row's arithmetic its own (``rows_apart``): in float32 on a CPU, blocks of at most
        :data:`~selfspec.models.kernels.MAX_ROWS` rows through the skinny kernel, where a single pass that
        wide takes a library's GEMM (the prefill's: :func:`~selfspec.models.kernels.wide_path`). So it is
        priced as its blocks, the walk's host work once."""
        from selfspec.models.kernels import MAX_ROWS

        if self.machine.get("device") != "cpu" or self.shape.get("dtype") != "float32" or op.rows <= MAX_ROWS:
            return self.op(op)
        full, rest = divmod(op.rows, MAX_ROWS)
        blocks = [MAX_ROWS] * full + ([rest] if rest else [])
        walk = self.walk if op.kind == "L" else 0.0
        return sum(self.op(op._replace(rows=n)) for n in blocks) - walk * (len(blocks) - 1)

    def op(self, op: "Op | list") -> float:
        """Seconds of one ledger op (:mod:`selfspec.models.ledger`; a record or a trace's stored list). A
        walk or head product that ran in a batch's pass with other sequences' rows costs its rows' share
        of that pass: the pass priced at all its rows (at this op's own context), times this op's rows
        over them. So a batch's sequences are priced at what their steps cost the batch, and their
        shares add up to the pass (the speculation gate decides per sequence from that,
        :mod:`selfspec.decoding.gate`)."""
        op = as_op(op)
        if op.kind in ("L", "H") and op.shared and op.shared >= op.rows:
            return self._joined(op._replace(rows=op.shared, shared=0)) * op.rows / op.shared
        if op.kind == "L" and op.weights:  # a walk over a quantised copy (a draft's): its own tables, dynamic
            return (self.walk + op.attention * self.attention_cost(op.rows, op.context, weights=op.weights)
                    + op.mlp * self.mlp_cost(op.rows, op.weights))
        if op.kind == "L":
            eager = self._eager is not None and self.eager(op)
            rows, span = self.ran(op, eager)
            return (self.walk + op.attention * self.attention_cost(rows, op.context, eager, span)
                    + op.mlp * (self._eager[1] if eager else self._mlp)(rows))
        if op.kind == "H":
            return self.head(op.rows, op.vocab, op.weights)
        if op.kind == "X":
            return self._linear(op.rows)
        by_vocab = self._warp[int(op.nucleus)]
        return Curve({v: cost(op.rows) for v, cost in by_vocab.items()})(op.vocab)

    def price(self, ops: "Iterable[Op | list]") -> float:
        """Predicted seconds of one step from its ledger ops, the step's plain host time included."""
        return sum(self.op(op) for op in ops) + self.host

    def predict(self, trace: Iterable[dict[str, Any]], sampled: bool = False) -> dict[str, float]:
        """Seconds per component (:data:`~selfspec.models.ledger.COMPONENTS`) of a generation from
        its step trace (``StepTrace.row()`` dicts with their ``ops``): every op costed (a sampling
        run's warps among them), and the profile's host time once per step (``host_steps`` too, by
        the step's source). ``sampled``: the run
        sampled, so every step must carry the warp of the token it sampled; a trace recorded before
        warps were ops is refused rather than priced without them."""
        host = self.host
        out = dict.fromkeys(COMPONENTS, 0.0)
        for step in trace:
            ops = step.get("ops")
            if ops is None:
                raise ValueError("a step of the trace has no ops: the run was recorded before the cost ledger; "
                                 "evaluate it again to predict its time")
            ops = [as_op(op) for op in ops]
            if sampled and not any(op.kind == "W" for op in ops):
                raise ValueError("a sampled step of the trace has no warp op: the run was recorded before sampled "
                                 "selection was in the cost ledger; evaluate it again to predict its time")
            for op in ops:
                out[op.component] += self.op(op)
            # a step's own overhead (selecting the token, the host sync) follows its last pass
            last = next((op.component for op in reversed(ops) if op.kind == "L"), "host")
            out[last] += host
            out["host"] += self.host_step(step.get("source"), int(step.get("drafted") or 0),
                                          int(step.get("guessed") or 0))
        return out

    def pass_cost(self, rows: int, context: int = 512) -> float:
        """Seconds of a full pass of ``rows`` new tokens after ``context`` cached ones: one walk of every
        layer, the head on every row, the host (a verification of ``rows - 1`` drafts)."""
        return (self.walk + self.shape["num_layers"] * self.layer_cost(rows, context)
                + self.head(rows, self.shape["vocab_size"]) + self.host)

    def draft_pass_cost(self, rows: int, context: int, *, weights: str = "", skip=None, vocab: int | None = None) -> float:
        """Seconds of one of a chain drafter's passes of ``rows`` rows after ``context`` cached positions:
        the ledger ops it records (a walk over ``weights``, the quantised copy its linears and head read,
        "" the target's, leaving out the sublayers of the :class:`~selfspec.models.passes.SkipSet` ``skip``;
        the head on every row, ``vocab`` of its rows, a draft vocabulary's or the model's) and its call's
        host work (``host_draft``)."""
        layers = self.shape["num_layers"]
        skip_attn, skip_mlp = (len(skip.attn), len(skip.mlp)) if skip else (0, 0)
        ops = [LayerOp("draft", rows, layers - skip_attn, layers - skip_mlp, context, weights=weights),
               HeadOp("draft", rows, self.shape["vocab_size"] if vocab is None else vocab, weights)]
        return sum(self.op(op) for op in ops) + self.host_draft

    def plain_step(self, context: int = 512) -> float:
        """Seconds of vanilla's step at ``context``: a pass of one row (:meth:`pass_cost`)."""
        return self.pass_cost(1, context)

    # --- files ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, path) -> "Profile":
        from selfspec.store.files import read_text

        path = Path(path)
        try:
            text = read_text(path)  # a regular file of bounded size; its figures are checked below
        except FileNotFoundError:
            raise FileNotFoundError(f"no profile at {path}: measure one with `make profile MODEL=...` "
                                    f"or name a shipped one ({', '.join(shipped()) or 'none shipped'})") from None
        except ValueError as e:
            raise ValueError(f"profile {e}: {remedy(path)}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path} is not valid JSON ({e}): {remedy(path)}") from None
        return cls(data, str(path))

    def save(self, path) -> Path:
        from selfspec.store.files import write_json

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.data)
        self.path = str(path)
        return path


SHIPPED = Path(__file__).resolve().parent.parent / "profiles"


def shipped() -> dict[str, Path]:
    """Profiles shipped with the package (``selfspec/profiles/*.json``), by name."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.json"))}


def remedy(path: str | Path | None) -> str:
    """What to do about a profile that cannot be read: measure it again (``make profile``), or pick
    another; for one that ships with selfspec (a damaged copy: issue 68), restore selfspec's file
    (:func:`~selfspec.store.files.restore_hint`), or measure this machine's own."""
    if path is not None and Path(path).resolve().parent == SHIPPED.resolve():
        from selfspec.store.files import restore_hint

        return (f"it ships with selfspec and is damaged: {restore_hint(path)}, or measure this machine's own "
                "(make profile) and run with profile=auto")
    return "measure it again (make profile) or pick another profile"


def readable_shipped() -> Iterator[Profile]:
    """The shipped profiles that can be read, in name order; a malformed one is skipped with a warning
    naming its file and the remedy (issue 68: one such file stopped every ``profile=auto`` run without
    a cached profile, and every report, though only a run of its own machine and model would use it)."""
    for path in shipped().values():
        try:
            yield Profile.load(path)
        except (OSError, ValueError) as err:
            log.warning("skipping a shipped profile that cannot be read: %s", err)


@functools.lru_cache(maxsize=1)
def shipped_models() -> dict[str, str]:
    """The model each readable shipped profile was measured for, by profile name (read once)."""
    return {Path(p.path).stem: p.data["model"]["name"] for p in readable_shipped()}


def resolve(spec: str) -> Path:
    """A profile's file from a path or a shipped profile's name."""
    path = Path(spec).expanduser()
    if path.suffix == ".json" or path.exists():
        return path
    found = shipped()
    if spec in found:
        return found[spec]
    raise FileNotFoundError(f"profile {spec!r} is neither a file nor a shipped profile "
                            f"({', '.join(found) or 'none shipped'})")


def matching_shipped(model) -> "Profile | None":
    """A shipped profile measured on a machine like this one (:meth:`Profile.describes`, and the
    library versions) for this model's shape and runtime (linear kernel, capture), or None."""
    info = machine(model.device)
    for p in readable_shipped():
        m = p.data["model"]
        if (p.describes(info) and p.machine.get("versions") == info["versions"] and p.shape == model_shape(model)
                and m.get("linear_kernel") == model.linear_kernel and m.get("capture") == model.capture):
            return p
    return None


def default_path(model, device: torch.device) -> Path:
    """Where this machine's profile of ``model`` is kept: the asset cache, keyed by machine, model
    shape (its family and a digest of :func:`model_shape`) and runtime (kernel, capture), and the
    library versions. Not by the model's name: what a step costs depends on the shape alone, so a
    model evaluated under another name (a GGUF file given as ``model.gguf_path=... model.name=...``)
    is priced with the profile its shape already has, and a random model reshaped under the same
    name is another model (issue 39)."""
    from selfspec.store.assets import cache_dir

    info = machine(device)
    tag = "-".join(f"{k}{v}" for k, v in sorted(info["versions"].items()))
    shape = model_shape(model)
    runtime = f"{model.linear_kernel}-{model.capture}-{shape['dtype']}-m{MEASUREMENT}"
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    family = "".join(c if c.isalnum() else "-" for c in shape["model_type"]) or "model"
    return cache_dir() / "profiles" / f"{machine_name(info)}__{family}-{digest}__{runtime}__{tag}.json"
