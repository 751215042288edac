"""Intermediate LM heads: next-token predictors that read an intermediate layer's hidden state.

AdaDecode §3.1 ("lightweight LM heads"): the head at layer ``l`` is ``E_l = E* · T_l`` with
``E*`` the frozen final LM head and ``T_l ∈ R^{d×d}`` trainable, so a head costs ``d²``
parameters instead of ``d·|V|``. It is trained by KL(p* ‖ p_l) against the final layer
(:mod:`selfspec.training.head_distillation`). DEL (and any early-exit method) uses the untrained variant:
the model's own final norm and head applied to an intermediate layer.

Placement of ``T_l``: ``logits = E* · T_l · norm(h)`` (``norm`` = the model's final RMSNorm,
gain included). Why after the norm and not ``E* · norm(T_l · h)``:

* **calibration** — AdaDecode exits when the head's top probability exceeds γ, so the head's
  *confidence* must be learnable. RMSNorm removes the scale of its input, so with
  ``norm(T h)`` no ``T`` can sharpen or flatten the distribution beyond what the final norm's
  gain fixes; with ``T · norm(h)`` the scale of ``T`` sets the temperature.
* **conditioning** — residual-stream magnitudes grow with depth and differ between layers;
  normalising first gives every ``T_l`` an input of the same scale, so one learning rate
  suits all heads.
* with ``T_l = I`` both placements equal the final norm + head applied to layer ``l`` (the
  required initialisation), so nothing is lost at the start of training.

Kinds (ablations of AdaDecode §4.3):

``linear``   ``T_l`` (d×d), initialised to the identity;
``full``     an own head ``W_l`` (|V|×d) on ``norm(h)``, initialised to a copy of ``E*``;
``lm_head``  no parameters: the final norm and head on layer ``l`` (the untrained head).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Iterable

import torch

from selfspec.config import checks
from selfspec.config.options import Options, key, nullable
from selfspec.models import kernels
from selfspec.models.layered import Joins
from selfspec.models.ledger import Ledger, phase
from selfspec.models.quantised import weights_format
from selfspec.store.artefacts import load_artefact, save_artefact

KINDS = ("linear", "full", "lm_head")
ARTEFACT_KIND = "heads"


def default_layers(num_layers: int, n_heads: int = 3) -> list[int]:
    """``n_heads`` evenly spaced layers: after ``round(L·k/(n+1))`` layers, k = 1..n (0-based index).

    32 layers -> [7, 15, 23] (the hidden states after layers 8/16/24, the paper's placement);
    30 layers (SmolLM2-135M) -> [7, 14, 22].
    """
    if n_heads < 1 or n_heads >= num_layers:
        raise ValueError(f"n_heads must be in [1, {num_layers - 1}] for a {num_layers}-layer model, got {n_heads}")
    out = sorted({max(0, math.floor(num_layers * k / (n_heads + 1) + 0.5) - 1) for k in range(1, n_heads + 1)})
    return out


class IntermediateHeads(torch.nn.Module):
    """Heads at ``layers`` of a :class:`~selfspec.models.layered.LayeredModel` (see module doc).

    ``layers`` are 0-based indices: the head at ``l`` reads the hidden state *after* layer
    ``l``. The base model is held as a plain attribute (not a submodule): its weights are
    frozen and never part of this module's parameters or state dict.
    """

    def __init__(self, model, layers: Iterable[int], kind: str = "linear", *, vocab: "DraftVocab | None" = None,
                 path: Path | None = None, meta: dict | None = None, last: bool = False) -> None:
        super().__init__()
        #: the artefact directory and its ``meta.json``, when loaded by :func:`load_heads`
        self.path, self.meta = path, meta or {}
        #: a truncated draft vocabulary (:class:`DraftVocab`); None = every head scores the full vocabulary
        self.vocab = vocab
        if kind not in KINDS:
            raise ValueError(f"head kind must be one of {', '.join(KINDS)}, got {kind!r}")
        layers = [int(i) for i in layers]
        if not layers:
            raise ValueError("heads need at least one layer (method/job config: layers)")
        top = model.num_layers - (1 if last and kind == "lm_head" else 2)  # ``last``: a quantised copy's final head
        bad = [i for i in layers if not 0 <= i <= top]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(
                f"head layers {layers} invalid for {model.name} ({model.num_layers} layers): give distinct "
                f"indices in [0, {top}] (the last layer is the final head itself, an exit only over a quantised copy)"
            )
        self.model = model  # LayeredModel is not an nn.Module: not registered
        self.layers = sorted(layers)
        self.kind = kind
        d, v = model.hidden_size, model.vocab_size
        self.heads = torch.nn.ModuleDict()
        for i in self.layers:
            if kind == "linear":
                lin = torch.nn.Linear(d, d, bias=False, device=model.device, dtype=torch.float32)
                with torch.no_grad():
                    lin.weight.copy_(torch.eye(d))
                self.heads[str(i)] = lin
            elif kind == "full":
                lin = torch.nn.Linear(d, v, bias=False, device=model.device, dtype=torch.float32)
                with torch.no_grad():
                    lin.weight.copy_(model.lm_head_weight.float())
                self.heads[str(i)] = lin

    @classmethod
    def identity(cls, model, layers, kind: str = "linear", vocab: "DraftVocab | None" = None) -> "IntermediateHeads":
        """Untrained heads: each equals the final norm + LM head applied to its layer."""
        return cls(model, layers, kind, vocab=vocab)

    def __contains__(self, layer: int) -> bool:
        return layer in self.heads or (self.kind == "lm_head" and layer in self.layers)

    def logits(self, layer: int, h: torch.Tensor, ledger: Ledger | None = None, joins: Joins | None = None,
               weights: str | None = None, vocab: "DraftVocab | ContextVocab | None" = None) -> torch.Tensor:
        """Float32 logits ``[..., V]`` of the head at ``layer`` for hidden states ``h [..., d]``; with a
        draft vocabulary (:attr:`vocab`) only its rows are computed and the others are ``-inf``.
        ``ledger``: the generation's cost ledger, charged with the head under ``heads``; ``joins``: the
        batch the LM head's product joins (:data:`~selfspec.models.layered.Joins`: the call may yield);
        ``weights``: the LM head product reads that quantised copy's head (an exit over a copy; a
        ``full`` head is a weight of its own and is read as trained); ``vocab``: a generation's own draft
        vocabulary (:attr:`vocab` grown by its context, :meth:`DraftVocab.for_example`), None :attr:`vocab`."""
        with phase(ledger, "heads"):
            return self._logits(layer, h, ledger, joins, weights, self.vocab if vocab is None else vocab)

    def _logits(self, layer: int, h: torch.Tensor, ledger: Ledger | None, joins: Joins | None,
                weights: str | None, vocab) -> torch.Tensor:
        m = self.model
        x = m.final_norm(h)
        head = None if weights is None else m.weight_set(weights).head
        if self.kind == "lm_head":
            return (m.head(x, head, ledger, joins).float() if vocab is None
                    else vocab.logits(x, head, ledger, joins))
        lin = self.heads[str(layer)]
        if self.kind == "full":
            x = x.to(lin.weight.dtype)
            if vocab is not None:
                return vocab.logits(x, lin.weight, ledger, joins)
            if ledger is not None:
                ledger.head(x.numel() // x.shape[-1], lin.out_features)
            return lin(x).float()
        if ledger is not None:
            ledger.linear(x.numel() // x.shape[-1], lin.in_features, lin.out_features)
        x = lin(x.to(lin.weight.dtype)).to(m.dtype)
        return (m.head(x, head, ledger, joins).float() if vocab is None
                else vocab.logits(x, head, ledger, joins))

    def forward(self, hiddens: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``{layer: hidden}`` -> ``{layer: logits}`` for all heads (training)."""
        return {i: self.logits(i, hiddens[i]) for i in self.layers}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The trainable weights by name (``T.<layer>`` or ``W.<layer>``), for the artefact."""
        prefix = "T" if self.kind == "linear" else "W"
        return {f"{prefix}.{i}": self.heads[str(i)].weight.detach() for i in self.layers if str(i) in self.heads}


def heads_contents(heads: IntermediateHeads) -> tuple[dict[str, torch.Tensor], dict]:
    """A head set's artefact: its tensors and the ``meta.json`` fields :func:`load_heads` reads."""
    return heads.tensors(), {"layers": heads.layers, "head_kind": heads.kind}


def save_heads(path, heads: IntermediateHeads, loaded_model, **meta) -> Path:
    """Save a head set as an artefact (``kind="heads"``); ``meta`` may hold task, train_config,
    metrics and any extra fields for ``meta.json``."""
    task = meta.pop("task", None)
    train_config = meta.pop("train_config", None)
    metrics = meta.pop("metrics", None)
    tensors, fields = heads_contents(heads)
    return save_artefact(path, ARTEFACT_KIND, tensors, loaded_model, task=task,
                         train_config=train_config, metrics=metrics, extra={**fields, **meta},
                         kernel_paths=kernels.paths())


def load_heads(path, model, vocab: "DraftVocab | None" = None) -> IntermediateHeads:
    """Load a head set saved by :func:`save_heads` (scoring ``vocab``'s rows where one is given);
    ``model`` (LoadedModel or LayeredModel) is checked against the artefact's fingerprint. The tensors are named by their layer (``T.<layer>``,
    ``W.<layer>``): ``meta.json``'s ``layers`` must be increasing and name exactly the tensors
    the file holds, so no tensor is ever read as another layer's."""
    from selfspec.store.artefacts import ArtefactError, rebuild_hint

    layered = getattr(model, "model", model)
    art = load_artefact(path, ARTEFACT_KIND, model, device=layered.device)
    layers, kind = art.meta.get("layers"), art.meta.get("head_kind")
    fix = rebuild_hint(art.path, ARTEFACT_KIND)
    if kind not in KINDS or not isinstance(layers, list) or not all(type(i) is int for i in layers):
        raise ArtefactError(f"heads artefact {path} has no valid 'layers'/'head_kind' in meta.json; {fix}")
    if layers != sorted(set(layers)):
        raise ArtefactError(f"heads artefact {path}: meta.json layers {layers} are not distinct and increasing, "
                            f"as save_heads writes them; {fix}")
    prefix = "T" if kind == "linear" else "W"
    want = {f"{prefix}.{i}" for i in layers} if kind != "lm_head" else set()
    if set(art.tensors) != want:
        raise ArtefactError(f"heads artefact {path}: its tensors {sorted(art.tensors)} are not the layers of meta.json "
                            f"({sorted(want)}); {fix}")
    heads = IntermediateHeads(layered, layers, kind, vocab=vocab, path=art.path, meta=art.meta)
    with torch.no_grad():
        for i in heads.layers if kind != "lm_head" else []:
            weight, saved = heads.heads[str(i)].weight, art.tensors[f"{prefix}.{i}"]
            if saved.shape != weight.shape:
                raise ArtefactError(f"heads artefact {path}: tensor {prefix}.{i} has shape {tuple(saved.shape)}, the "
                                    f"model needs {tuple(weight.shape)}; {fix}")
            weight.copy_(saved)
    heads.requires_grad_(False)
    return heads


def heads_artefact_dir(model_name: str, data: str | None, kind: str = "linear") -> Path:
    """Where ``job=heads`` saves: ``outputs/artefacts/heads/<model>-<data>`` (``data`` = the task
    the heads were trained on, or ``mixed``), ``-full`` appended for the full-parameter heads."""
    from selfspec.store.artefacts import default_artefact_dir

    tag = (data or "") + ("-full" if kind == "full" else "")
    return default_artefact_dir("heads", model_name, tag or None)


def first_artefact(directory, data: str | None) -> tuple[Path | None, list[str]]:
    """The first of ``directory(data)``, ``directory("mixed")``, ``directory(None)`` that holds an
    artefact, and the directories tried."""
    tried = []
    for d in dict.fromkeys([data, "mixed", None]):
        candidate = directory(d)
        if (candidate / "meta.json").exists():
            return candidate, tried
        tried.append(str(candidate))
    return None, tried


def find_heads(model_name: str, path=None, data: str | None = None, kind: str = "linear") -> Path:
    """The heads artefact a method reads: ``path`` if given, else the first that exists of
    ``<model>-<data>``, ``<model>-mixed``, ``<model>`` (AdaDecode, early exit and DEL alike)."""
    if path:
        return Path(str(path))
    found, tried = first_artefact(lambda d: heads_artefact_dir(model_name, d, kind), data)
    if found is not None:
        return found
    task = f" TASK={data}" if data and data != "mixed" else ""
    full = ' ARGS="job.kind=full"' if kind == "full" else ""
    raise FileNotFoundError(
        f"no {kind} heads for model {model_name!r} (looked in {', '.join(tried)}): train them with "
        f"`make train-heads MODEL={model_name}{task}{full}`, or point the method at an artefact directory"
    )


# --- truncated draft vocabularies (FR-Spec, arXiv 2502.14856; VocabTrim, arXiv 2506.22694) ------
VOCAB_KIND = "draft_vocab"


class DraftVocab:
    """A truncated-vocabulary draft head: the LM head's rows of the kept tokens ``ids`` only.

    Drafting scores ``|S|`` rows instead of ``|V|`` (SmolLM2: 49,152 rows, several decoder
    layers' worth per draft token). :meth:`logits` still returns float32 logits over the **full**
    vocabulary, ``-inf`` outside ``S``: the argmax is the subset's, the softmax is the truncated
    softmax (a draft-stop rule's confidence is the top probability *within* ``S``), and a sampled
    draft's ``q`` is a proper distribution over ``V`` with zeros outside ``S``, so speculative
    sampling against the full-head target stays lossless. Verification never uses this head.

    The kept rows are a weight of their own, multiplied with the model's linear kernel
    (:meth:`~selfspec.models.layered.LayeredModel.head`), like the LM head itself.
    """

    def __init__(self, model, ids, path=None, meta: dict | None = None, context: bool = False) -> None:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        v = int(model.vocab_size)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().numel() != ids.numel():
            raise ValueError(f"draft vocabulary needs distinct token ids in [0, {v - 1}] for {model.name}, "
                             f"got {ids.numel()} ids; rebuild it with `make draft-vocab MODEL={model.name}`")
        self.model = model
        self.ids = ids.sort().values.to(model.device)
        self.size = int(ids.numel())
        self.vocab_size = v
        self.path = Path(path) if path is not None else None
        self.meta = meta or {}
        #: each generation's context joins the kept set (``method.draft_vocab_context``, :class:`ContextVocab`)
        self.context = bool(context)
        self.weight = self._rows(model.lm_head_weight)
        self._other: dict[int, torch.Tensor] = {}

    def for_example(self, state) -> "DraftVocab | ContextVocab":
        """The vocabulary one generation drafts with (``state``: its
        :class:`~selfspec.decoding.base.DecodeState`): this one, or with :attr:`context` a
        :class:`ContextVocab` that grows by the generation's own tokens."""
        return ContextVocab(self, state) if self.context else self

    def head_weight(self, weight: torch.Tensor | None) -> torch.Tensor:
        """The ``|V|×d`` head ``weight`` stands for (None: the model's LM head)."""
        return self.model.lm_head_weight if weight is None else weight

    def _rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The kept rows of a ``|V|×d`` head, contiguous (the skinny kernel reads them in order)."""
        return weight.detach()[self.ids.to(weight.device)].contiguous()

    def logits(self, x: torch.Tensor, weight: torch.Tensor | None = None, ledger: Ledger | None = None,
               joins: Joins | None = None) -> torch.Tensor:
        """Float32 logits ``[..., V]`` of normalised states ``x [..., d]`` (``weight``: another
        ``|V|×d`` head to truncate, e.g. a full-parameter AdaDecode head; default the LM head):
        the kept rows' scores, ``-inf`` elsewhere (the head recorded in ``ledger`` when given; ``joins``:
        the batch the product joins, :data:`~selfspec.models.layered.Joins`: the call may yield)."""
        rows = self.weight
        if weight is not None and weight is not self.model.lm_head_weight:
            rows = self._other.get(id(weight))
            if rows is None:
                rows = self._other[id(weight)] = self._rows(weight)
        sub = self.score(x, rows, ledger, joins)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)

    def score(self, x: torch.Tensor, rows: torch.Tensor, ledger: Ledger | None = None,
              joins: Joins | None = None) -> torch.Tensor:
        """Float32 scores ``[..., |rows|]`` of ``x`` against some rows of a head (a quantised copy's take
        ``x`` as it is), through the model's head product (recorded in ``ledger``; ``joins``: as :meth:`logits`)."""
        return self.model.head(x if weights_format(rows) else x.to(rows.dtype), rows, ledger, joins).float()

    def model_logits(self, h: torch.Tensor, ledger: Ledger | None = None, weight: torch.Tensor | None = None,
                     joins: Joins | None = None) -> torch.Tensor:
        """The model's final norm and the truncated LM head on hidden states ``h`` (a full-depth
        or skip-set draft: Draft & Verify; ``weight``: another ``|V|×d`` head, a quantised copy's;
        ``joins``: as :meth:`logits`)."""
        return self.logits(self.model.final_norm(h), weight, ledger, joins)

    def stats(self) -> dict:
        """What a run records per generation: the size and the artefact's held-out coverage."""
        return {"draft_vocab_size": self.size, "draft_vocab_coverage": self.meta.get("coverage")}


class ContextVocab:
    """One generation's draft vocabulary: a :class:`DraftVocab`'s kept tokens and every token of the
    generation's context (its prompt and the tokens committed since), added as they appear.

    A truncated head always rejects a draft token it does not hold, and what a generation writes next is
    often in what it has read or written already (a summary's names, a program's identifiers): the
    context's tokens are the rows a frequency-ranked set (FR-Spec, arXiv 2502.14856 §3) misses most.
    Their rows are a second, small weight of this generation's own, grown by appending (so the kept rows'
    product still joins a batch's); :meth:`logits` is the kept rows' and these rows' scores, ``-inf``
    elsewhere, so a sampled draft's ``q`` is still a distribution over ``V`` and verification, over the
    full head, keeps the output lossless. The rows added depend only on the generation's own tokens:
    a draft is the same in a batch or alone.
    """

    def __init__(self, vocab: DraftVocab, state) -> None:
        self.vocab = vocab
        self.state = state
        self.path, self.meta = vocab.path, vocab.meta
        self.vocab_size = vocab.vocab_size
        self.held = torch.zeros(vocab.vocab_size, dtype=torch.bool)
        self.held[vocab.ids.cpu()] = True
        #: the context's tokens outside the kept set, in the order they joined
        self.ids = torch.empty(0, dtype=torch.long, device=vocab.ids.device)
        self.seen = 0  # the context's tokens looked at so far
        self._rows: dict[int, torch.Tensor] = {}  # id(head weight) -> its rows of :attr:`ids` (a prefix until grown)

    @property
    def size(self) -> int:
        """Rows a draft head scores now: the kept set's and the context's."""
        return self.vocab.size + int(self.ids.numel())

    def grow(self) -> None:
        """Add the context's tokens not held yet (those committed since the last call)."""
        tokens = self.state.tokens
        if len(tokens) <= self.seen:
            return
        new = torch.tensor(tokens[self.seen:], dtype=torch.long).unique()  # sorted: the same rows every run
        self.seen = len(tokens)
        new = new[~self.held[new]]
        if new.numel():
            self.held[new] = True
            self.ids = torch.cat([self.ids, new.to(self.ids.device)])

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of :attr:`ids` of the ``|V|×d`` head ``weight``, appended to as the context grows."""
        have = self._rows.get(id(weight))
        n = 0 if have is None else int(have.shape[0])
        if n < self.ids.numel():
            more = weight.detach()[self.ids[n:].to(weight.device)]
            have = more.contiguous() if have is None else torch.cat([have, more])
            self._rows[id(weight)] = have
        return have

    def logits(self, x: torch.Tensor, weight: torch.Tensor | None = None, ledger: Ledger | None = None,
               joins: Joins | None = None) -> torch.Tensor:
        """As :meth:`DraftVocab.logits`, the context's rows scored too (a second head product, recorded
        in ``ledger`` as its own)."""
        self.grow()
        out = self.vocab.logits(x, weight, ledger, joins)
        if self.ids.numel():
            out.index_copy_(-1, self.ids, self.vocab.score(x, self.rows(self.vocab.head_weight(weight)), ledger, joins))
        return out

    def model_logits(self, h: torch.Tensor, ledger: Ledger | None = None, weight: torch.Tensor | None = None,
                     joins: Joins | None = None) -> torch.Tensor:
        """As :meth:`DraftVocab.model_logits`."""
        return self.logits(self.vocab.model.final_norm(h), weight, ledger, joins)

    def stats(self) -> dict:
        """The kept set's figures and the context's rows at the end of the generation."""
        return {**self.vocab.stats(), "draft_vocab_context_rows": int(self.ids.numel()),
                "draft_vocab_context_coverage": self.meta.get("context_coverage")}


def draft_logits(model, h: torch.Tensor, vocab: DraftVocab | None = None, ledger: Ledger | None = None,
                 weights: str | None = None, joins: Joins | None = None) -> torch.Tensor:
    """Final norm + LM head on ``h``, truncated to ``vocab`` when one is given (the one place a
    final-head draft is scored: Draft & Verify's drafts), recorded in ``ledger`` when given;
    ``weights``: the head of that quantised copy of the weights (a quantised draft's), None the target's;
    ``joins``: the batch the head product joins (:data:`~selfspec.models.layered.Joins`: the call may yield)."""
    head = None if weights is None else model.weight_set(weights).head
    if vocab is not None:
        return vocab.model_logits(h, ledger, head, joins)
    return model.head(model.final_norm(h), head, ledger, joins).float()


def draft_vocab_tensors(ids: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """A draft vocabulary's artefact tensors: ``ids`` in rank order (most frequent first), their ``counts``."""
    return {"ids": ids.long(), "counts": counts.long()}


def save_draft_vocab(path, ids: torch.Tensor, counts: torch.Tensor, loaded_model, **meta) -> Path:
    """Save a draft vocabulary artefact (``kind="draft_vocab"``, :func:`draft_vocab_tensors`);
    ``meta`` holds task, train_config, metrics and extras."""
    task = meta.pop("task", None)
    train_config = meta.pop("train_config", None)
    metrics = meta.pop("metrics", None)
    return save_artefact(path, VOCAB_KIND, draft_vocab_tensors(ids, counts), loaded_model, task=task,
                         train_config=train_config, metrics=metrics, extra=meta, kernel_paths=kernels.paths())


def load_draft_vocab(path, model, key: str = "method.draft_vocab", context: bool = False) -> DraftVocab:
    """Load a draft vocabulary, checked against ``model`` (LoadedModel or LayeredModel) before its
    tensors are read; a mismatch names the config ``key`` that chose the artefact. ``context``: each
    generation's context joins it (:class:`ContextVocab`)."""
    from selfspec.store.artefacts import ArtefactError

    layered = getattr(model, "model", model)
    try:
        art = load_artefact(path, VOCAB_KIND, model, device="cpu")
    except ArtefactError as err:
        raise ArtefactError(f"{key}={path}: {err}") from None
    if art.meta.get("vocab_size") != layered.vocab_size:
        raise ArtefactError(f"{key}={path}: the draft vocabulary was counted for a {art.meta.get('vocab_size')}-token "
                            f"vocabulary but {layered.name} has {layered.vocab_size}; rebuild it for this model")
    if "ids" not in art.tensors:
        raise ArtefactError(f"{key}={path}: draft_vocab artefact lacks tensor 'ids'; rebuild it")
    return DraftVocab(layered, art.tensors["ids"], art.path, art.meta, context)


def find_draft_vocab(model_name: str, data: str | None = None) -> Path:
    """The artefact ``draft_vocab: auto`` reads: the first that exists of
    ``draft_vocab/<model>-<data>``, ``<model>-mixed``, ``<model>``."""
    from selfspec.store.artefacts import default_artefact_dir

    found, tried = first_artefact(lambda d: default_artefact_dir(VOCAB_KIND, model_name, d), data)
    if found is not None:
        return found
    task = f" TASK={data}" if data and data != "mixed" else ""
    raise FileNotFoundError(
        f"method.draft_vocab=auto: no draft vocabulary for model {model_name!r} (looked in {', '.join(tried)}); "
        f"build one with `make draft-vocab MODEL={model_name}{task}`, or set method.draft_vocab=<artefact dir> or null"
    )


def draft_vocab_option(name: str, value: Any) -> str | Path | None:
    """``draft_vocab``: null (the full LM head), ``auto`` (the artefact ``job=draft_vocab`` wrote
    for this model and ``draft_vocab_task``) or an artefact directory, checked without the model."""
    from selfspec.store.artefacts import artefact_option

    return "auto" if value == "auto" else artefact_option(name, value, VOCAB_KIND)


@dataclasses.dataclass(frozen=True)
class DraftVocabOptions(Options):
    """The keys every self-drafting method shares: ``draft_vocab`` (:func:`draft_vocab_option`),
    ``draft_vocab_task`` and ``draft_vocab_context``."""

    draft_vocab: str | Path | None = key(draft_vocab_option)
    draft_vocab_task: str | None = key(nullable(checks.text),
                                       why="the data `draft_vocab: auto` looks for: a task name or mixed")
    draft_vocab_context: bool = key(checks.flag, why="true: each generation's own tokens join the kept set "
                                    "(its prompt and what it commits; no effect with draft_vocab: null)")


def build_draft_vocab(model, options: DraftVocabOptions, prefix: str = "method") -> DraftVocab | None:
    """The :class:`DraftVocab` ``options`` name, checked against ``model``."""
    value = options.draft_vocab
    if value is None:
        return None
    layered = getattr(model, "model", model)
    path = find_draft_vocab(layered.name, options.draft_vocab_task) if value == "auto" else value
    return load_draft_vocab(path, model, f"{prefix}.draft_vocab", options.draft_vocab_context)
