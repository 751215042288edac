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
* ``host_steps`` (optional): what a drafting step's own host work adds to ``host``, by the step's
  source (:class:`~selfspec.decoding.base.StepTrace`): ``tree`` for PPD's candidate tree
  (choosing it, laying it out, the prompt tokens' top-k, reading the candidates back: a few hundred
  small device operations, 1-1.5 ms a step on an H100 against a 3.2 ms SmolLM2 step), ``context``
  for an n-gram lookup. (By tree size it did not vary monotonically on a CPU: 1.7-5.2 ms a step for
  mean trees of 3-13 nodes, so one figure per source is kept.)
  Measured by running those methods (random prompt tokens and trees): the seconds of their
  ``draft``, ``tree`` and ``host`` components less the ops priced there;
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
on a CPU the segments are close to proportional anyway. Profiles now measure up to 128 rows.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from selfspec.models.ledger import COMPONENTS

__all__ = ["FORMAT", "Profile", "ProfileMismatch", "machine_name", "measure_profile", "model_shape"]

FORMAT = 3
#: rows measured at every context (a chain of k + 1, a tree: PPD's paper trees reach 120 rows);
#: prefill-sized rows at context 0
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
PREFILL_ROWS = (64, 128, 256, 512)
CONTEXTS = (0, 128, 512, 1024)
#: the sampling settings whose warps ``warp`` measures, by ``nucleus`` (top-p sorts the vocabulary)
WARP_SETTINGS = {1: {"temperature": 0.6, "top_p": 0.95}, 0: {"temperature": 0.6}}
#: rows warped at once: one at a time (chain verification), more for a tree or a batch of drafts
WARP_ROWS = (1, 4, 16)
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


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict[str, Any]:
    """The machine a profile describes: device, its name, threads, and the libraries that run it
    (torch, transformers and the digest of the runtime's CPU operators' sources)."""
    import importlib.metadata as md

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    versions = {}
    for pkg in ("torch", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    # the runtime's CPU operators: a profile measured before they changed is not this runtime's
    from selfspec.models.kernels import source_digest

    versions["selfspec-kernels"] = source_digest()
    return {"device": device.type, "hardware": gpu or cpu_name(), "threads": torch.get_num_threads(),
            "versions": versions}


def machine_name(info: dict[str, Any]) -> str:
    """A short file-name-safe label of a machine: ``cpu-amd-epyc-7b13-2t``, ``cpu-intel-xeon-2t`` (from
    "Intel(R) Xeon(R) Processor") or ``cuda-nvidia-h100...``."""
    words = "".join(c if c.isalnum() else "-" for c in info["hardware"].lower()).split("-")
    words = [w for w in words if w and w not in {"processor", "core", "with", "radeon", "graphics", "cpu", "r", "tm"}]
    tail = f"-{info['threads']}t" if info["device"] == "cpu" else ""
    return f"{info['device']}-{'-'.join(words[:5])}{tail}"


class Curve:
    """Measured costs by one variable, sorted once: linear between measured points, the first
    before them, and past the last along the last segment's slope, never below the last point
    (``past="slope"``, the default: by rows, module docstring; attention by context) or in
    proportion to ``x`` (``past="proportional"``)."""

    __slots__ = ("xs", "ys", "past")

    def __init__(self, points: dict[int, float], past: str = "slope") -> None:
        self.xs = sorted(points)
        self.ys = [points[x] for x in self.xs]
        self.past = past

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
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
        return ValueError(f"profile {where}: {what}; measure it again (make profile) or pick another profile")

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
    if data.get("eager") is not None:
        for name, depth in (("attention", 2), ("mlp", 1)):
            walk((data["eager"] or {}).get(name), depth, f"eager.{name}")
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
                             f"this selfspec reads format {FORMAT}; measure it again (make profile)")
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
        #: the tables price captured passes (a GPU profile measured with graphs on)
        self.captures = data["model"].get("capture") == "graphs"
        eager = data.get("eager")
        self._eager = None if not eager else (
            {int(c): Curve(num(row)) for c, row in eager["attention"].items()}, Curve(num(eager["mlp"])))
        #: seconds a drafting step's host work adds, by the step's source (``host_steps``)
        self.host_steps = {k: float(v) for k, v in (data.get("host_steps") or {}).items()}
        if not self.plain_step() > 0:  # a priced schedule divides by what a pass costs
            raise ValueError(f"profile {where}: it prices a plain step at {self.plain_step()!r} s: measure it again "
                             "(make profile) or pick another profile")

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
        """Whether this profile was measured on the machine ``info`` (:func:`machine`) describes."""
        mine = self.machine
        return all(mine.get(k) == info.get(k) for k in ("device", "hardware", "threads"))

    def summary(self) -> dict[str, Any]:
        """What a run records of the profile it was costed with."""
        m = self.machine
        return {"name": self.name, "path": self.path, "device": m["device"], "hardware": m["hardware"],
                "threads": m.get("threads"), "measured": self.data.get("measured")}

    # --- costs ---------------------------------------------------------------------------------
    def attention_cost(self, rows: int, context: int, eager: bool = False) -> float:
        table = self._eager[0] if eager else self._attention
        return Curve({c: curve(rows) for c, curve in table.items()}, past="slope")(context)

    @property
    def decoding_rows(self) -> int:
        """The most rows measured at a decoding context (after cached positions): wider passes are
        extrapolated (a profile's wider rows at context 0 are prefills, measured as those run)."""
        return max((max(row) for c, row in self.attention.items() if c > 0), default=max(self.attention[0]))

    def eager(self, op: list) -> bool:
        """Whether a layer walk ``op`` is priced as an eager pass apart from the captured tables: the
        profile captures, and the walk ran eagerly (flagged in the ledger) or, in a trace recorded
        without capture, is a decoding pass wider than the largest bucket (it would run eagerly)."""
        if not self.captures:
            return False
        if len(op) > 6:
            return bool(op[6])
        from selfspec.models.capture import BUCKETS

        return op[5] > 0 and op[2] > BUCKETS[-1]

    def unpriced(self, trace: Iterable[dict[str, Any]]) -> int:
        """Layer walks of ``trace`` this profile cannot price: eager passes, measured by a profile
        that captures and has no eager tables (a format-3 GPU profile)."""
        if self._eager is not None or not self.captures:
            return 0
        return sum(1 for step in trace for op in step.get("ops") or () if op[1] == "L" and self.eager(op))

    def host_step(self, step: dict[str, Any]) -> float:
        """What a step's own host work adds to :attr:`host` (``host_steps``), by its source."""
        return self.host_steps.get(step.get("source"), 0.0)

    def head(self, rows: int, vocab: int) -> float:
        return Curve({v: cost(rows) for v, cost in self._head.items()})(vocab)

    def op(self, op: list) -> float:
        """Seconds of one ledger op (:mod:`selfspec.models.ledger`)."""
        kind = op[1]
        if kind == "L":
            rows, attention, mlp, context = op[2:6]
            eager = self._eager is not None and self.eager(op)
            return (attention * self.attention_cost(rows, context, eager)
                    + mlp * (self._eager[1] if eager else self._mlp)(rows))
        if kind == "H":
            return self.head(op[2], op[3])
        if kind == "X":
            return self._linear(op[2])
        if kind == "W":
            by_vocab = self._warp[int(op[4])]
            return Curve({v: cost(op[2]) for v, cost in by_vocab.items()})(op[3])
        raise ValueError(f"unknown ledger op {op!r}")

    def price(self, ops: list[list]) -> float:
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
            if sampled and not any(op[1] == "W" for op in ops):
                raise ValueError("a sampled step of the trace has no warp op: the run was recorded before sampled "
                                 "selection was in the cost ledger; evaluate it again to predict its time")
            for op in ops:
                out[op[0]] += self.op(op)
            # a step's own overhead (selecting the token, the host sync) follows its last pass
            last = next((op[0] for op in reversed(ops) if op[1] == "L"), "host")
            out[last] += host
            out["host"] += self.host_step(step)
        return out

    def pass_cost(self, rows: int, context: int = 512) -> float:
        """Seconds of a full pass of ``rows`` new tokens after ``context`` cached ones: every layer,
        the head on every row, the host (a verification of ``rows - 1`` drafts)."""
        n = self.shape["num_layers"]
        return (n * (self.attention_cost(rows, context) + self._mlp(rows))
                + self.head(rows, self.shape["vocab_size"]) + self.host)

    def plain_step(self, context: int = 512) -> float:
        """Seconds of vanilla's step at ``context``: a pass of one row (:meth:`pass_cost`)."""
        return self.pass_cost(1, context)

    # --- files ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, path) -> "Profile":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no profile at {path}: measure one with `make profile MODEL=...` "
                                    f"or name a shipped one ({', '.join(shipped()) or 'none shipped'})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path} is not valid JSON ({e}): measure it again (make profile)") from None
        return cls(data, str(path))

    def save(self, path) -> Path:
        from selfspec.tracking.local import write_json

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.data)
        self.path = str(path)
        return path


SHIPPED = Path(__file__).resolve().parent.parent / "profiles"


def shipped() -> dict[str, Path]:
    """Profiles shipped with the package (``selfspec/profiles/*.json``), by name."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.json"))}


@functools.lru_cache(maxsize=1)
def shipped_models() -> dict[str, str]:
    """The model each shipped profile was measured for, by profile name (read once)."""
    return {name: Profile.load(path).data["model"]["name"] for name, path in shipped().items()}


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
    """A shipped profile measured on a machine like this one (device, hardware, threads, library
    versions) for this model's shape and runtime (linear kernel, capture), or None."""
    info = machine(model.device)
    for path in shipped().values():
        p = Profile.load(path)
        m = p.data["model"]
        if (p.describes(info) and p.machine.get("versions") == info["versions"] and p.shape == model_shape(model)
                and m.get("linear_kernel") == model.linear_kernel and m.get("capture") == model.capture):
            return p
    return None


def default_path(model, device: torch.device) -> Path:
    """Where this machine's profile of ``model`` is kept: the asset cache, keyed by machine, model
    (its name and its shape's digest) and runtime (kernel, capture), and the library versions."""
    from selfspec.assets import cache_dir

    info = machine(device)
    tag = "-".join(f"{k}{v}" for k, v in sorted(info["versions"].items()))
    shape = model_shape(model)
    runtime = f"{model.linear_kernel}-{model.capture}-{shape['dtype']}"
    # the shape's digest too: a random model reshaped under the same name is another model (issue 39)
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    return cache_dir() / "profiles" / f"{machine_name(info)}__{model.name}-{digest}__{runtime}__{tag}.json"


# --- measuring -------------------------------------------------------------------------------------
def measure_profile(model, *, rows: Iterable[int] = ROWS, prefill_rows: Iterable[int] = PREFILL_ROWS,
                    contexts: Iterable[int] = CONTEXTS, repeats: int = 5, log=None) -> Profile:
    """Measure this machine's profile of ``model`` (module docstring). About a minute for
    SmolLM2-135M on 2 CPU cores; seconds for a tiny model."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.vanilla import Vanilla
    from selfspec.models.costs import context_cache, time_forward
    from selfspec.models.layered import SkipSet

    started = time.time()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    L = model.num_layers
    no_mlp = SkipSet.of(mlp=range(L))
    limit = model.max_context - max(max(rows), 1) - 2
    contexts = sorted({min(int(c), limit) for c in contexts if c >= 0})
    rows, prefill_rows = list(rows), [r for r in prefill_rows if r < model.max_context - 2]
    pass_context = min(contexts, key=lambda c: abs(c - 512))
    attention: dict[int, dict[int, float]] = {}
    mlp: dict[int, list[float]] = {}
    whole: dict[int, dict[int, float]] = {}
    for context in contexts:
        widths = rows + (prefill_rows if context == 0 else [])
        cache = context_cache(model, context, max(widths))
        attention[context] = {}
        if context == pass_context:
            whole[context] = {}
        for n in widths:
            full = time_forward(model, cache, context, n, repeats=repeats, logits_rows=0)
            attn = time_forward(model, cache, context, n, repeats=repeats, logits_rows=0, skip=no_mlp)
            attention[context][n] = attn / L
            mlp.setdefault(n, []).append(max(full - attn, 0.0) / L)
            if n in rows and context == pass_context:
                whole[context][n] = time_forward(model, cache, context, n, repeats=repeats)
        if log:
            log(f"context {context}: attention and MLP sublayers for {len(widths)} row counts")
    eager = _measure_eager(model, rows, contexts, repeats) if model.capture == "graphs" else None
    if log and eager:
        log("eager attention and MLP sublayers (the static-pass runner off)")
    head = _measure_heads(model, rows + prefill_rows[:1], repeats)
    linear = _measure_linear(model, rows, repeats)
    tree = _measure_tree(model, rows, min(contexts[-1], 512), repeats)
    data = {
        "format": FORMAT,
        "name": "",
        "model": {"name": model.name, "shape": model_shape(model), "linear_kernel": model.linear_kernel,
                  "capture": model.capture},
        "machine": machine(model.device),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "load_average": load,
        "seconds_to_measure": None,
        "attention": {str(c): {str(n): t for n, t in row.items()} for c, row in attention.items()},
        "mlp": {str(n): statistics.median(v) for n, v in mlp.items()},
        "head": {str(v): {str(n): t for n, t in row.items()} for v, row in head.items()},
        "linear": {str(n): t for n, t in linear.items()},
        "tree": {str(n): t for n, t in tree.items()},
        "pass": {str(c): {str(n): t for n, t in row.items()} for c, row in whole.items()},
        "warp": {str(k): {str(v): {str(n): t for n, t in row.items()} for v, row in table.items()}
                 for k, table in _measure_warps(model, repeats).items()},
        "host": 0.0,
    } | ({"eager": eager} if eager else {})
    data["name"] = f"{machine_name(data['machine'])}__{model.name}"
    profile = Profile(data)
    # the host time of a plain step: vanilla's measured greedy steps less what their ops cost (a
    # sampled step's warp is an op of its own)
    decoder = Vanilla(model)
    prompt = list(range(10, 10 + max(1, min(256, model.max_context // 4))))
    new = max(2, min(48, model.max_context - len(prompt) - 2))
    decoder.generate(prompt, new, Sampling())  # warm-up
    hosts = []
    for _ in range(max(1, repeats // 2)):
        g = decoder.generate(prompt, new, Sampling())
        steps = [t.row() for t in g.trace[1:]]
        model_time = sum(profile.op(op) for s in steps for op in s["ops"])
        hosts.append(max(0.0, (g.ledger["plain"] + g.ledger["host"] - model_time) / len(steps)))
    data["host"] = profile.host = statistics.median(hosts)
    data["host_steps"] = _measure_host_steps(model, profile, prompt, new, repeats)
    profile.host_steps = dict(data["host_steps"])
    if log:
        log(f"host work of drafting steps: {data['host_steps']}")
    data["seconds_to_measure"] = round(time.time() - started, 1)
    return profile


def _measure_eager(model, rows: list[int], contexts: list[int], repeats: int) -> dict[str, dict]:
    """The ``eager`` tables (module docstring): attention and MLP sublayers at decoding contexts,
    with the static-pass runner off, as a decoding pass no bucket holds runs."""
    from selfspec.models.costs import context_cache, time_forward
    from selfspec.models.layered import SkipSet

    L, no_mlp, steps = model.num_layers, SkipSet.of(mlp=range(model.num_layers)), model.steps
    attention: dict[str, dict[str, float]] = {}
    mlp: dict[int, list[float]] = {}
    model.steps = None
    try:
        for context in [c for c in contexts if c > 0]:
            cache = context_cache(model, context, max(rows))
            attention[str(context)] = {}
            for n in rows:
                full = time_forward(model, cache, context, n, repeats=repeats, logits_rows=0)
                attn = time_forward(model, cache, context, n, repeats=repeats, logits_rows=0, skip=no_mlp)
                attention[str(context)][str(n)] = attn / L
                mlp.setdefault(n, []).append(max(full - attn, 0.0) / L)
    finally:
        model.steps = steps
    return {"attention": attention, "mlp": {str(n): statistics.median(v) for n, v in mlp.items()}}


def _measure_host_steps(model, profile: "Profile", prompt: list[int], new: int, repeats: int) -> dict[str, Any]:
    """``host_steps`` (module docstring): per drafting step, the seconds beyond its priced ops and
    ``host``: the median over generations of PPD with random prompt tokens and random trees of
    :data:`HOST_TREE_NODES` candidates, and of the n-gram lookup on a prompt that repeats itself
    (so it drafts)."""
    import random

    from selfspec.config import method_config
    from selfspec.decoding import Sampling, build_decoder, check_method
    from selfspec.decoding.ppd import PPD
    from selfspec.decoding.tree import random_trees
    from selfspec.prompts import PromptTokens

    def extra(decoder, tokens: list[int], source: str) -> list[float]:
        decoder.generate(tokens, new, Sampling())  # warm-up (under graphs: the captures)
        per_step = []
        for _ in range(max(1, repeats // 2)):
            g = decoder.generate(tokens, new, Sampling())
            steps = [t.row() for t in g.trace[1:]]
            drafting = [st for st in steps if st["source"] == source]
            if not drafting:
                return []
            # the time outside the passes' own components (verification, plain steps), less the
            # model work inside it (a draft head's product): what the method does on the host
            seconds = sum(g.ledger[k] for k in HOST_WORK)
            priced = sum(profile.op(op) for st in steps for op in st["ops"] if op[0] in HOST_WORK)
            per_step.append(max(0.0, (seconds - priced) / len(drafting)))
        return per_step

    options = check_method(method_config("ppd"))
    g = torch.Generator().manual_seed(0)
    prompts = PromptTokens((torch.randn(3, 2, model.hidden_size, generator=g) * 0.5).to(model.device, model.dtype))
    tree: list[float] = []
    for nodes in HOST_TREE_NODES:
        ppd = PPD(model, prompts, random_trees(3, nodes, 10, random.Random(nodes)), ngram=None,
                  posterior_threshold=options["posterior_threshold"], posterior_alpha=options["posterior_alpha"],
                  state_zero=options["state_zero"])
        tree += extra(ppd, prompt, "tree")
    out: dict[str, Any] = {"tree": statistics.median(tree)} if tree else {}
    segment = prompt[: max(4, len(prompt) // 8)]
    ngram = build_decoder(method_config("ngram", never_slower=False, draft_schedule="adaptive"), model)
    context = extra(ngram, (segment * (len(prompt) // len(segment) + 1))[: len(prompt)], "context")
    if context:
        out["context"] = statistics.median(context)
    return out


def _measure_heads(model, rows: list[int], repeats: int) -> dict[int, dict[int, float]]:
    """LM-head products by rows, for the full vocabulary and truncated ones."""
    from selfspec.models.costs import time_call

    weight = model.lm_head_weight
    out: dict[int, dict[int, float]] = {}
    for fraction in VOCAB_FRACTIONS:
        v = max(1, int(weight.shape[0] * fraction))
        w = weight[:v].contiguous() if v < weight.shape[0] else weight
        out[v] = {}
        for n in rows:
            x = torch.randn(1, n, model.hidden_size, dtype=model.dtype, device=model.device)
            out[v][n] = time_call(lambda: model.head(x, w).float(), model.device, repeats)
    return out


def _measure_warps(model, repeats: int) -> dict[int, dict[int, dict[int, float]]]:
    """Sampled selection's warps (:data:`WARP_SETTINGS`) by nucleus, vocabulary and rows, on
    logits shaped like the model's (a peaked distribution, as a language model's usually is)."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.sampling import warp
    from selfspec.models.costs import time_call

    generator = torch.Generator(device=model.device).manual_seed(0)
    out: dict[int, dict[int, dict[int, float]]] = {}
    for nucleus, setting in WARP_SETTINGS.items():
        s = Sampling(**setting)
        out[nucleus] = {}
        for fraction in VOCAB_FRACTIONS:
            v = max(1, int(model.vocab_size * fraction))
            out[nucleus][v] = {}
            for n in WARP_ROWS:
                logits = 4 * torch.randn(n, v, generator=generator, device=model.device)
                out[nucleus][v][n] = time_call(lambda: warp(logits, s), model.device, repeats)
    return out


def _measure_linear(model, rows: list[int], repeats: int) -> dict[int, float]:
    """An exit head's ``d × d`` transform by rows."""
    from selfspec.models.costs import time_call

    d = model.hidden_size
    lin = torch.nn.Linear(d, d, bias=False, dtype=model.dtype, device=model.device)
    out = {}
    for n in rows:
        x = torch.randn(1, n, d, dtype=model.dtype, device=model.device)
        out[n] = time_call(lambda: lin(x), model.device, repeats)
    return out


def _measure_tree(model, sizes: list[int], context: int, repeats: int) -> dict[int, float]:
    """Whole tree passes (the rows' positions and ancestor mask given, the head on every node) by size."""
    from selfspec.models.costs import context_cache, time_forward

    cache = context_cache(model, context, max(sizes))
    out = {}
    for n in sizes:
        tree = (torch.arange(n, device=model.device), torch.ones(n, n, dtype=torch.bool, device=model.device).tril())
        h = model.embed(torch.zeros(1, n, dtype=torch.long, device=model.device))
        out[n] = time_forward(model, cache, context, h=h, tree=tree, repeats=repeats)
    return out
