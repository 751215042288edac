"""PPD's trainable prompt tokens: ``m`` prompt tokens × ``n_ept`` ensemble prompt tokens (PPD §3.1–3.2).

The only trainable parameters of PPD are these embeddings, ``[m, n_ept, hidden]``; the base model
stays frozen. They are fed to the layered model as hidden states (``forward(..., h=...)``), never
as vocabulary ids. Prompt tokens are initialised from ordinary token embeddings (PPD §5,
"Training"). The guess of prompt token ``p`` is the average of its EPTs' logits (PPD §3.2).

Saved and loaded as a ``kind="prompts"`` artefact (:mod:`selfspec.store.artefacts`).
"""

from __future__ import annotations

from pathlib import Path

import torch

KIND = "prompts"


class PromptTokens(torch.nn.Module):
    """Embedding table ``embeddings[p, e]`` = EPT ``e`` of prompt token ``p + 1``."""

    def __init__(self, embeddings: torch.Tensor) -> None:
        super().__init__()
        if embeddings.dim() != 3:
            raise ValueError(f"prompt embeddings must be [m, n_ept, hidden], got shape {tuple(embeddings.shape)}")
        self.embeddings = torch.nn.Parameter(embeddings)

    @property
    def m(self) -> int:
        """Number of prompt tokens (the maximal token distance guessed)."""
        return int(self.embeddings.shape[0])

    @property
    def n_ept(self) -> int:
        return int(self.embeddings.shape[1])

    @property
    def hidden_size(self) -> int:
        return int(self.embeddings.shape[2])

    @classmethod
    def init_from_tokens(cls, model, m: int, n_ept: int, seed: int = 0) -> "PromptTokens":
        """Initialise every EPT from the embedding of a random ordinary token (PPD §5)."""
        if m < 1 or n_ept < 1:
            raise ValueError(f"need at least one prompt token and one EPT, got m={m}, n_ept={n_ept}")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.vocab_size, (m * n_ept,), generator=g).to(model.device)
        with torch.no_grad():
            emb = model.embed(ids).detach().clone().view(m, n_ept, -1)
        return cls(emb.to(dtype=model.dtype))

    def gather(self, p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Embeddings of prompt slots (``p`` 0-based prompt index, ``e`` EPT): ``[n, hidden]``."""
        return self.embeddings[p, e]

    def chain(self, m: int | None = None) -> torch.Tensor:
        """All EPTs of prompt tokens ``1…m`` in prompt-major order: ``[m * n_ept, hidden]``."""
        m = self.m if m is None else m
        return self.embeddings[:m].reshape(m * self.n_ept, -1)

    @staticmethod
    def ensemble(logits: torch.Tensor) -> torch.Tensor:
        """``[..., n_ept, V]`` EPT logits -> ``[..., V]`` averaged logits (PPD §3.2)."""
        return logits.mean(dim=-2)

    def num_bytes(self) -> int:
        return self.embeddings.numel() * self.embeddings.element_size()


def prompts_contents(prompts: PromptTokens) -> tuple[dict[str, torch.Tensor], dict]:
    """A ``prompts`` artefact: its tensors and the ``meta.json`` fields of its shape."""
    return {"embeddings": prompts.embeddings.detach()}, {"m": prompts.m, "n_ept": prompts.n_ept}


def save_prompts(path: str | Path, prompts: PromptTokens, loaded_model, *, train_config=None,
                 metrics=None, task: str | None = None) -> Path:
    from selfspec.models.kernels import paths
    from selfspec.store.artefacts import save_artefact

    tensors, fields = prompts_contents(prompts)
    return save_artefact(path, KIND, tensors, loaded_model, task=task, train_config=train_config,
                         metrics=metrics, extra=fields, kernel_paths=paths())


def load_prompts(path: str | Path, loaded_model=None, model=None) -> PromptTokens:
    """Load a ``prompts`` artefact; checks it was trained for ``loaded_model`` (fingerprint) or,
    given only the layered ``model``, its name, hidden size and layer count."""
    from selfspec.store.artefacts import ArtefactError, load_artefact

    art = load_artefact(path, KIND, loaded_model)
    model = model if model is not None else (loaded_model.model if loaded_model is not None else None)
    if model is not None:
        for key, have in (("model", model.name), ("hidden_size", model.hidden_size),
                          ("num_layers", model.num_layers)):
            if art.meta.get(key) != have:
                raise ArtefactError(
                    f"prompts artefact {path} was trained for model {art.meta.get('model')!r} "
                    f"({key}={art.meta.get(key)}) but the loaded model {model.name!r} has {key}={have}; "
                    "train prompts for this model (python -m selfspec.train job=prompts model=...)"
                )
    emb = art.tensors["embeddings"]
    if model is not None:
        emb = emb.to(device=model.device, dtype=model.dtype)
    p = PromptTokens(emb)
    p.requires_grad_(False)
    return p
