"""Peer baselines: ``transformers``' own ``generate`` and its speculative variants, as Decoders.

They run in the same sweep as selfspec's methods, on the same examples, with the same EOS /
stop strings / token budget, so their speedups are comparable (docs/design.md §3, benchmark
conventions):

``hf_generate``       plain ``generate`` (Hugging Face's runtime and dynamic KV cache)
``hf_prompt_lookup``  prompt lookup decoding (``prompt_lookup_num_tokens``): drafts copied from
                      n-gram matches in the context
``hf_early_exit``     self-speculation with the model's first ``assistant_early_exit`` layers
                      and the LM head as drafter (LayerSkip, Elhoushi et al. 2024, §4)
``hf_assisted``       assisted generation with a separate draft model (Leviathan et al. 2023)

These cannot use the layered decoding loop, so :meth:`HFPeer.generate` calls
``model.generate`` and returns a :class:`~selfspec.decoding.base.Generation`. Acceptance is
recorded by wrapping the candidate generator ``transformers`` builds for the call
(``get_candidates`` gives the drafted length, ``update_candidate_strategy(input_ids, scores,
num_matches)`` the committed length); every step commits ``num_matches + 1`` tokens, so ``tau``
and the acceptance rate follow selfspec's conventions. Batch size 1, like ``transformers``'
assisted decoding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, ClassVar, Sequence

import torch

from selfspec.config import checks
from selfspec.config.options import Options, key, nullable
from selfspec.decoding.base import DecodeState, Decoder, Generation
from selfspec.decoding.sampling import Sampling
from selfspec.measure.costs import synchronizer


class HFPeer(Decoder):
    """``transformers.GenerationMixin.generate`` behind the Decoder interface."""

    name = "hf_generate"
    title = "HF generate"
    lossless = True
    own_loop = False
    #: whether generate drafts candidates (assisted decoding); plain generate commits 1 per step
    speculative: ClassVar[bool] = False
    #: transformers' assisted generation decodes one sequence at a time: no batch (plain generate batches)
    batches: ClassVar[bool] = False

    def __init__(self, model, generate_kwargs: dict[str, Any] | None = None, **common) -> None:
        super().__init__(model, **common)
        self.hf = model.hf
        self.generate_kwargs = dict(generate_kwargs or {})
        self._steps: list[tuple[int, int]] = []  # (drafted, committed) per verification step
        # built once: transformers' stop-string criterion preprocesses the whole vocabulary
        # (~0.5 s), which `generate(stop_strings=...)` would repeat on every call
        self._stopping = None
        if self.stop_strings:
            from transformers import StopStringCriteria, StoppingCriteriaList

            self._stopping = StoppingCriteriaList([StopStringCriteria(self.tokenizer, list(self.stop_strings))])

    # --- configuration ---------------------------------------------------------------------
    def sampling_kwargs(self, sampling: Sampling) -> dict[str, Any]:
        if sampling.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k or None}

    @contextlib.contextmanager
    def _configured(self):
        """Per-call settings that transformers reads from a model's generation config."""
        yield

    # --- decoding --------------------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: Sampling | None = None
    ) -> Generation:
        prompt, n_prompt, sampling = self.generation_inputs(prompt_ids, max_new_tokens, sampling)
        eos = sorted(self.eos_token_ids)
        kwargs = dict(
            self.generate_kwargs,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
            **self.sampling_kwargs(sampling),
        )
        if self._stopping is not None:
            kwargs["stopping_criteria"] = self._stopping
        self._steps = []
        sync = synchronizer(self.model.device)
        with torch.random.fork_rng(devices=[self.model.device] if self.model.device.type == "cuda" else []):
            torch.manual_seed(sampling.seed)
            with self._configured(), self._recording(), torch.inference_mode():
                sync()
                t0 = time.perf_counter()
                out = self.hf.generate(prompt, **kwargs)
                sync()
                seconds = time.perf_counter() - t0
        new = out[0, n_prompt:].tolist()
        if not self.speculative:
            self._steps = [(0, 1)] * len(new)
        return self._generation(prompt[0].tolist(), new, seconds, max_new_tokens, sampling)

    def _generation(self, prompt: list[int], new: list[int], seconds: float, max_new_tokens: int,
                    sampling: Sampling) -> Generation:
        """Cut ``new`` exactly as the layered loop would (EOS, stop strings, budget)."""
        state = DecodeState(list(prompt), len(prompt), cache=None, sampling=sampling, generator=None)
        reason = self._commit(state, new, max_new_tokens)
        if reason is None:  # transformers stopped on a criterion the cut did not see again
            reason = "stop" if self.stop_strings else "length"
        tokens = state.tokens[len(prompt):]
        drafted, accepted, verified, left = [], [], [], len(tokens)
        for d, c in self._steps:  # keep the steps that produced the kept tokens
            if left <= 0:
                break
            drafted.append(d)
            accepted.append(min(c, left))
            verified.append(c)
            left -= c
        stats = {"forward_passes": len(accepted)}
        return Generation(
            tokens=tokens, prompt_len=len(prompt), seconds=seconds, steps=len(accepted),
            accepted_per_step=accepted, drafted_per_step=drafted, stop_reason=reason, stats=stats,
            verified_per_step=verified,
        )

    @contextlib.contextmanager
    def _recording(self):
        """Wrap the candidate generator transformers builds for this call to log each step."""
        if not self.speculative:
            yield
            return
        build = self.hf._get_candidate_generator
        steps = self._steps

        def recorded(*args, **kwargs):
            gen = build(*args, **kwargs)
            get_candidates, update = gen.get_candidates, gen.update_candidate_strategy
            drafted = [0]

            def get_candidates_logged(input_ids, *a, **k):
                candidate_ids, candidate_logits = get_candidates(input_ids, *a, **k)
                drafted[0] = candidate_ids.shape[1] - input_ids.shape[1]
                return candidate_ids, candidate_logits

            def update_logged(input_ids, scores, num_matches):
                steps.append((drafted[0], int(num_matches) + 1))
                return update(input_ids, scores, num_matches)

            gen.get_candidates, gen.update_candidate_strategy = get_candidates_logged, update_logged
            return gen

        self.hf._get_candidate_generator = recorded
        try:
            yield
        finally:
            del self.hf._get_candidate_generator  # the instance attribute; the method shows again

    def step(self, state: DecodeState, budget: int) -> list[int]:  # pragma: no cover
        raise NotImplementedError(f"{self.name} decodes through transformers' generate")


class HFGenerate(HFPeer):
    """Plain ``generate``: the runtime check of selfspec's vanilla (same tokens, its own speed); in a
    batch (the evaluation's ``batch_size > 1``), transformers' own batched ``generate``
    (:meth:`generate_batch`)."""

    batches = True

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       sampling: Sampling | None = None) -> list[Generation]:
        """The prompts as one batch through transformers' ``generate``, padded on the left (the peer
        of a batch of selfspec's sequences): each sequence cut as :meth:`generate` cuts one (EOS,
        stop strings, budget), and each timed with the batch's seconds (its latency: every sequence
        waits for the batch). Padding changes a row's arithmetic, so a sequence may part from its
        single-prompt tokens at a near-tie."""
        sampling = sampling or Sampling()
        for p in prompts:
            self.prompt_tensor(p, max_new_tokens)  # an empty prompt or budget stops here
        eos = sorted(self.eos_token_ids)
        pad = eos[0] if eos else 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.as_tensor(list(p))
            mask[row, width - len(p):] = 1
        kwargs = dict(self.generate_kwargs, attention_mask=mask.to(self.model.device), max_new_tokens=max_new_tokens,
                      eos_token_id=eos or None, pad_token_id=pad, **self.sampling_kwargs(sampling))
        if self._stopping is not None:
            kwargs["stopping_criteria"] = self._stopping
        sync = synchronizer(self.model.device)
        with torch.random.fork_rng(devices=[self.model.device] if self.model.device.type == "cuda" else []):
            torch.manual_seed(sampling.seed)
            with torch.inference_mode():
                sync()
                t0 = time.perf_counter()
                out = self.hf.generate(ids.to(self.model.device), **kwargs)
                sync()
                seconds = time.perf_counter() - t0
        gens = []
        for row, p in enumerate(prompts):
            new = out[row, width:].tolist()
            self._steps = [(0, 1)] * len(new)
            gens.append(self._generation(list(p), new, seconds, max_new_tokens, sampling))
        return gens

    name = "hf_generate"


class HFPromptLookup(HFPeer):
    """Prompt lookup decoding (Saxena 2023): drafts are the tokens that followed the last
    n-gram (``max_matching_ngram_size``) earlier in the context, ``prompt_lookup_num_tokens`` of them."""

    name = "hf_prompt_lookup"
    title = "HF prompt lookup"
    speculative = True

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        """Keys (conf/method/hf_prompt_lookup.yaml): ``generate``'s own, both >= 1."""

        prompt_lookup_num_tokens: int = key(checks.integer, 1, why="drafted tokens per step")
        max_matching_ngram_size: int = key(checks.integer, 1)

    @classmethod
    def from_config(cls, model, options: Options, **common):
        return cls(model, options.values(), **common)


SCHEDULES = ("constant", "heuristic", "heuristic_transient")


class _AssistantSchedule(HFPeer):
    """Peers whose drafter reads ``num_assistant_tokens(_schedule)`` from its generation config."""

    speculative = True
    assistant_hf: Any = None
    num_assistant_tokens: int | None = None
    schedule: str | None = None

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        """``num_assistant_tokens`` (>= 1) and ``num_assistant_tokens_schedule``; null = transformers'
        default."""

        num_assistant_tokens: int | None = key(nullable(checks.integer), 1,
                                               why="drafted tokens per step; null = transformers' default")
        num_assistant_tokens_schedule: str | None = key(nullable(checks.choice), SCHEDULES,
                                                        why="null = transformers' default")

    def _set_schedule(self, options: Options) -> None:
        self.num_assistant_tokens = options.num_assistant_tokens
        self.schedule = options.num_assistant_tokens_schedule

    @contextlib.contextmanager
    def _configured(self):
        gc = self.assistant_hf.generation_config
        saved = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule)
        if self.num_assistant_tokens is not None:
            gc.num_assistant_tokens = self.num_assistant_tokens
        if self.schedule is not None:
            gc.num_assistant_tokens_schedule = self.schedule
        try:
            yield
        finally:
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = saved


class HFEarlyExit(_AssistantSchedule):
    """LayerSkip-style self-speculation (Elhoushi et al. 2024, §4): the first
    ``assistant_early_exit`` layers + LM head draft, the full model verifies. Meant for models
    trained with early-exit loss (``layerskip-*`` configs); any model works, with low acceptance."""

    name = "hf_early_exit"
    title = "HF early exit"

    @dataclasses.dataclass(frozen=True)
    class Options(_AssistantSchedule.Options):
        """The schedule's keys and ``assistant_early_exit`` (>= 1; below the layer count, checked
        with the model)."""

        assistant_early_exit: int = key(checks.integer, 1, why="layers that draft; below the model's layer count")

    @classmethod
    def check_run(cls, options: Options, layers: int, budget: int | None = None) -> None:
        """``assistant_early_exit`` below the model's layer count."""
        checks.integer("method.assistant_early_exit", options.assistant_early_exit, 1, layers - 1,
                       why=f"layers that draft; the model has {layers}")

    @classmethod
    def from_config(cls, model, options: Options, **common):
        exit_layer = options.assistant_early_exit
        peer = cls(model, {"assistant_early_exit": exit_layer}, **common)
        peer.assistant_hf = model.hf
        peer._set_schedule(options)
        return peer


def draft_model_option(name: str, value: Any) -> str:
    """A separate draft model's key (``hf_assisted``'s ``assistant``, ``llama_cpp_speculative``'s ``draft``):
    a model config of conf/model/, checked to exist; null is refused, naming the key."""
    from selfspec.config import group_options

    if value is None:
        raise checks.refuse(name, value, f"set {name}=<model config name of the draft model> (conf/model/), sharing "
                            "the target's tokenizer")
    return checks.choice(name, value, group_options("model"), why="a model config of conf/model/")


class HFAssisted(_AssistantSchedule):
    """Assisted generation with a separate draft model (``method.assistant``: a model config
    name, e.g. a Qwen2.5-Coder 0.5B drafting for 1.5B); target and draft share a tokenizer."""

    name = "hf_assisted"
    title = "HF assisted"

    @dataclasses.dataclass(frozen=True)
    class Options(_AssistantSchedule.Options):
        """The schedule's keys and ``assistant`` (:func:`draft_model_option`)."""

        assistant: str = key(draft_model_option)

    @classmethod
    def models_read(cls, options: Options) -> tuple[str, ...]:
        return (options.assistant,)

    @classmethod
    def from_config(cls, model, options: Options, **common):
        from selfspec.config import model_config
        from selfspec.models.loading import load_model

        name = options.assistant
        draft = load_model(model_config(name))
        tok = common.get("tokenizer")
        if tok is not None and draft.tokenizer is not None and draft.tokenizer.get_vocab() != tok.get_vocab():
            raise ValueError(f"method.assistant={name}: its tokenizer differs from the target's; "
                             "pick a draft model of the same family")
        draft.model.hf.to(device=model.device)
        peer = cls(model, {"assistant_model": draft.model.hf}, **common)
        peer.assistant_hf = draft.model.hf
        peer._set_schedule(options)
        return peer
