"""Intermediate LM heads: next-token predictors that read an intermediate layer's hidden state.

AdaDecode §3.1 ("lightweight LM heads"): the head at layer ``l`` is ``E_l = E* · T_l`` with
``E*`` the frozen final LM head and ``T_l ∈ R^{d×d}`` trainable, so a head costs ``d²``
parameters instead of ``d·|V|``. It is trained by KL(p* ‖ p_l) against the final layer
(:mod:`selfspec.training.heads`). DEL (and any early-exit method) uses the untrained variant:
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

import math
from pathlib import Path
from typing import Iterable

import torch

from selfspec.artefacts import load_artefact, save_artefact

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

    def __init__(self, model, layers: Iterable[int], kind: str = "linear") -> None:
        super().__init__()
        self.path = None  # the artefact directory, when loaded by load_heads
        if kind not in KINDS:
            raise ValueError(f"head kind must be one of {', '.join(KINDS)}, got {kind!r}")
        layers = [int(i) for i in layers]
        if not layers:
            raise ValueError("heads need at least one layer (method/job config: layers)")
        bad = [i for i in layers if not 0 <= i < model.num_layers - 1]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(
                f"head layers {layers} invalid for {model.name} ({model.num_layers} layers): give distinct "
                f"indices in [0, {model.num_layers - 2}] (the last layer is the final head itself)"
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
                    lin.weight.copy_(model.lm_head.weight.float())
                self.heads[str(i)] = lin

    @classmethod
    def identity(cls, model, layers, kind: str = "linear") -> "IntermediateHeads":
        """Untrained heads: each equals the final norm + LM head applied to its layer."""
        return cls(model, layers, kind)

    def __contains__(self, layer: int) -> bool:
        return layer in self.heads or (self.kind == "lm_head" and layer in self.layers)

    def logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[..., V]`` of the head at ``layer`` for hidden states ``h [..., d]``."""
        m = self.model
        x = m.final_norm(h)
        if self.kind == "lm_head":
            return m.lm_head(x).float()
        lin = self.heads[str(layer)]
        if self.kind == "full":
            return lin(x.to(lin.weight.dtype)).float()
        return m.lm_head(lin(x.to(lin.weight.dtype)).to(m.dtype)).float()

    def forward(self, hiddens: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``{layer: hidden}`` -> ``{layer: logits}`` for all heads (training)."""
        return {i: self.logits(i, hiddens[i]) for i in self.layers}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The trainable weights by name (``T.<layer>`` or ``W.<layer>``), for the artefact."""
        prefix = "T" if self.kind == "linear" else "W"
        return {f"{prefix}.{i}": self.heads[str(i)].weight.detach() for i in self.layers if str(i) in self.heads}


def save_heads(path, heads: IntermediateHeads, loaded_model, **meta) -> Path:
    """Save a head set as an artefact (``kind="heads"``); ``meta`` may hold task, train_config,
    metrics and any extra fields for ``meta.json``."""
    task = meta.pop("task", None)
    train_config = meta.pop("train_config", None)
    metrics = meta.pop("metrics", None)
    extra = {"layers": heads.layers, "head_kind": heads.kind, **meta}
    return save_artefact(path, ARTEFACT_KIND, heads.tensors(), loaded_model, task=task,
                         train_config=train_config, metrics=metrics, extra=extra)


def load_heads(path, model) -> IntermediateHeads:
    """Load a head set saved by :func:`save_heads`; ``model`` (LoadedModel or LayeredModel) is
    checked against the artefact's fingerprint."""
    layered = getattr(model, "model", model)
    art = load_artefact(path, ARTEFACT_KIND, model, device=layered.device)
    layers, kind = art.meta.get("layers"), art.meta.get("head_kind")
    if layers is None or kind not in KINDS:
        raise ValueError(f"heads artefact {path} has no valid 'layers'/'head_kind' in meta.json; retrain it")
    heads = IntermediateHeads(layered, layers, kind)
    prefix = "T" if kind == "linear" else "W"
    with torch.no_grad():
        for i in heads.layers if kind != "lm_head" else []:
            key = f"{prefix}.{i}"
            if key not in art.tensors:
                raise ValueError(f"heads artefact {path} lacks tensor {key!r}; retrain it")
            heads.heads[str(i)].weight.copy_(art.tensors[key])
    heads.meta = art.meta
    heads.path = art.path
    heads.requires_grad_(False)
    return heads


def heads_artefact_dir(model_name: str, data: str | None, kind: str = "linear") -> Path:
    """Where ``job=heads`` saves: ``outputs/artefacts/heads/<model>-<data>`` (``data`` = the task
    the heads were trained on, or ``mixed``), ``-full`` appended for the full-parameter heads."""
    from selfspec.artefacts import default_artefact_dir

    tag = (data or "") + ("-full" if kind == "full" else "")
    return default_artefact_dir("heads", model_name, tag or None)


def find_heads(model_name: str, path=None, data: str | None = None, kind: str = "linear") -> Path:
    """The heads artefact a method reads: ``path`` if given, else the first that exists of
    ``<model>-<data>``, ``<model>-mixed``, ``<model>`` (AdaDecode, early exit and DEL alike)."""
    if path:
        return Path(str(path))
    tried = []
    for d in dict.fromkeys([data, "mixed", None]):
        candidate = heads_artefact_dir(model_name, d, kind)
        if (candidate / "meta.json").exists():
            return candidate
        tried.append(str(candidate))
    task = f" TASK={data}" if data and data != "mixed" else ""
    full = ' ARGS="job.kind=full"' if kind == "full" else ""
    raise FileNotFoundError(
        f"no {kind} heads for model {model_name!r} (looked in {', '.join(tried)}): train them with "
        f"`make train-heads MODEL={model_name}{task}{full}`, or point the method at an artefact directory"
    )
