"""The decoder interface and the one decoding loop every method shares.

A method implements :meth:`Decoder.step`: from the current state (all committed tokens, the
last of which — the *pending* token — is not yet in the layer cache) produce one or more new
tokens, leaving the cache holding every committed token but the new pending one. The loop
around it — prefill, stopping at EOS / stop strings / the token budget, timing, statistics —
lives here once, so every method stops exactly where vanilla stops.

Statistics convention (used everywhere in selfspec): a **step** is one call that commits
tokens (prefill counts as one step, which commits the first token; under early exit's
``prefill: draft``, LayerSkip's code, it drafts from the prompt and commits a round's tokens). ``tau`` — *mean accepted
tokens per step* — **includes the bonus token**, as Spec-Bench's τ does: vanilla has
``tau == 1.0``. The acceptance rate is accepted draft tokens / drafted tokens (LayerSkip's
definition; the bonus token is not a draft token).

Every step also leaves a :class:`StepTrace` (``Generation.trace``): its shape, independent of the
machine under greedy decoding — where its drafts came from, how many, from which exit layer,
how wide the verification was, how many were accepted and committed, the controller's state after
it, and whether the speculation gate made it plain.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Sequence

import torch

from selfspec.config.options import Options
from selfspec.decoding.carried import Carries
from selfspec.decoding.draft_exit import DraftStop
from selfspec.decoding.part_options import PARTS, ContextFirst, Gated
from selfspec.decoding.sampling import Sampling, select
from selfspec.measure.costs import synchronizer
from selfspec.models.cache import LayerCache
from selfspec.models.layered import Joins, LayeredModel
from selfspec.models.ledger import Ledger, Op, phase


#: why the n-gram drafts' ``priced`` schedule (:mod:`selfspec.decoding.ngram`) needs the run's cost profile:
#: here, where :meth:`Decoder.needs_profile` reads it for every method that drafts from the context first
PRICED_NEEDS_PROFILE = ("draft_schedule=priced chooses each draft's length from this machine's cost profile, and "
                        "the run has none: set profile=auto (evaluate finds or measures it) or a profile file, or "
                        "give the method draft_schedule=adaptive")


def _forked(obj, memo: dict) -> Any:
    """``obj`` copied, with every part it holds that carries state (:class:`Carries`) forked too and its
    carried attributes deep copies (:meth:`Decoder.fork`)."""
    if id(obj) in memo:
        return memo[id(obj)]
    import copy

    twin = memo[id(obj)] = copy.copy(obj)
    twin.restore(obj.snapshot())
    for name, value in vars(twin).items():
        if isinstance(value, Carries):
            setattr(twin, name, _forked(value, memo))
    return twin


@dataclass
class StepTrace:
    """The shape of one step (module docstring). A method fills in what its step did on
    ``DecodeState.trace_step``; the loop records what was committed."""

    #: ``prefill``, ``plain`` (no drafts), ``self`` (the model drafted), ``context`` (n-gram
    #: drafts), ``tree`` (PPD's candidate tree)
    source: str = "plain"
    #: draft tokens verified this step (a tree: its candidate nodes)
    drafted: int = 0
    #: draft tokens accepted (the bonus token excluded)
    accepted: int = 0
    #: draft tokens a lookup guessed and the drafter kept (``draft_ngram``): they rode as rows of another
    #: token's pass, with no call of their own
    guessed: int = 0
    #: tokens the step committed (after the loop cut at EOS, a stop string or the budget)
    committed: int = 0
    #: most drafts the drafter meant to propose this step (Draft & Verify's K, DEL's γ)
    draft_limit: int | None = None
    #: layer the drafts came from (early exit, DEL: the exit layer ℓ)
    exit_layer: int | None = None
    #: per draft, the layer of the head that predicted it (AdaDecode's early exits)
    exits: tuple[int, ...] | None = None
    #: rows of the verification pass (k + 1 for a chain, the tree's size for PPD, the prompt for prefill)
    width: int = 1
    #: PPD: nodes of the verified tree (root included)
    tree_size: int | None = None
    #: the speculation gate made this step a plain one
    gated: bool = False
    #: the method's controller after the step (Draft & Verify's threshold and acceptance EMA, DEL's
    #: plan, PPD's tree state), None for methods without one
    controller: dict[str, Any] | None = None
    #: the model work of the step, per component (:mod:`selfspec.models.ledger`): what a machine
    #: profile costs (:mod:`selfspec.measure.profile`)
    ops: list[Op] | None = None

    def row(self) -> dict[str, Any]:
        """The trace as a plain dict without the fields left at their defaults (its ops as the
        ledger's compact lists, :meth:`~selfspec.models.ledger.LayerOp.row`)."""
        out = {k: v for k, v in vars(self).items() if k == "source" or v != _TRACE_DEFAULTS[k]}
        if self.ops is not None:
            out["ops"] = [op.row() for op in self.ops]
        return out


_TRACE_DEFAULTS = vars(StepTrace())


@dataclass
class Generation:
    """What :meth:`Decoder.generate` returns for one prompt."""

    tokens: list[int]
    prompt_len: int
    seconds: float
    steps: int
    accepted_per_step: list[int]
    drafted_per_step: list[int]
    stop_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    #: one :class:`StepTrace` per step, prefill first
    trace: list[StepTrace] = field(default_factory=list)
    #: measured seconds per cost component (:data:`selfspec.models.ledger.COMPONENTS`); they add
    #: up to ``seconds``
    ledger: dict[str, float] = field(default_factory=dict)
    #: tokens each step's verification gave (its accepted drafts and its own token) before the output
    #: was cut at EOS, a stop string or the budget; ``accepted_per_step`` holds what was kept. None: no
    #: cut was seen (a peer that reports only what it kept)
    verified_per_step: list[int] | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        """Mean accepted tokens per step, bonus token included (vanilla = 1.0)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens the verification accepted over the steps that drafted (each step's bonus token
        left out), counted before the output was cut at EOS, a stop string or the budget: drafts the
        target agreed with past the end were accepted, only not kept. Counted after the cut, a short
        answer's last drafts looked rejected (Gemma 3's GSM8K answers of 6-20 tokens, ended by a stop
        string: 0.63 after the cut)."""
        verified = self.accepted_per_step if self.verified_per_step is None else self.verified_per_step
        return sum(max(a - 1, 0) for a, d in zip(verified, self.drafted_per_step) if d)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens (LayerSkip's definition); None when nothing was drafted."""
        drafted = sum(self.drafted_per_step)
        return self.accepted_drafts / drafted if drafted else None

    def summary(self) -> dict[str, Any]:
        out = {
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "steps": self.steps,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "stop_reason": self.stop_reason,
        }
        out.update(self.stats)
        return out


@dataclass
class DecodeState:
    """Mutable state of one generation, handed to :meth:`Decoder.step`."""

    tokens: list[int]
    prompt_len: int
    cache: LayerCache
    sampling: Sampling
    generator: torch.Generator | None
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    #: per step, the tokens it gave before the cut (:attr:`Generation.verified_per_step`)
    verified_per_step: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    #: per-example method state (what :meth:`Decoder.begin` creates; e.g. a drafter's buffers)
    example: Any = None
    #: per-example state of the decoder's context drafter (``Decoder.context``; None without one)
    context: Any = None
    #: per-example state of the lookup drafting for the method's own drafter (``Drafter.lookup``; None without one)
    lookup: Any = None
    #: the draft vocabulary this generation drafts with (``Decoder.draft_vocab``'s, grown by the generation's
    #: own tokens with ``draft_vocab_context``: :meth:`selfspec.models.heads.DraftVocab.for_example`); None: the
    #: full head
    vocab: Any = None
    #: draft tokens proposed in the current step (a method sets it; the loop records it)
    drafted: int = 0
    #: the current step's trace (the method fills it in) and the finished steps' traces
    trace_step: StepTrace = field(default_factory=StepTrace)
    trace: list[StepTrace] = field(default_factory=list)
    #: the generation's cost ledger, charged with sampled selection's warps (None outside one)
    ledger: Ledger | None = None
    #: the batch of generations this one decodes in (:data:`~selfspec.models.layered.Joins`), or None
    #: (alone): a method hands it to every model call of its step (``joins=state.joins``), each of
    #: which may then yield to the other sequences; the decoder holds no batch and reads none
    joins: Joins | None = None

    @property
    def pending(self) -> int:
        """The last committed token, whose K/V are not yet in the cache."""
        return self.tokens[-1]

    @property
    def n_cached(self) -> int:
        """Positions every layer must hold after a step: all committed tokens but the pending one."""
        return len(self.tokens) - 1

    def pending_ids(self, device) -> torch.Tensor:
        return torch.tensor([[self.tokens[-1]]], device=device)

    def count(self, key: str, value: float = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + value

    def steps_from(self, source: str) -> int:
        """Finished steps whose drafts came from ``source`` (:attr:`StepTrace.source`: ``context``
        for the n-gram drafts a self-drafting method verifies first)."""
        return sum(t.source == source for t in self.trace)

    def gated_steps(self) -> int:
        """Finished steps the speculation gate made plain (:attr:`StepTrace.gated`)."""
        return sum(t.gated for t in self.trace)


class Decoder(Carries):
    """Base of every decoding method (docs/design.md §2.3).

    Subclasses set :attr:`name`, :attr:`lossless`, implement :meth:`step`, may override
    :meth:`prefill`, :meth:`begin` (per-example state) and :meth:`finish` (per-example
    statistics), declare their method config's keys as :attr:`Options` (checked with no model)
    and build themselves from those options in :meth:`from_config`.
    """

    name: ClassVar[str] = "base"
    #: the method's title in tables, figures and the report (its paper's name)
    title: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    #: whether the method stays lossless under sampling too (keeps the target distribution)
    lossless_sampling: ClassVar[bool] = True
    #: extra cache positions a step may write beyond the committed tokens (drafts, trees)
    lookahead: int = 0
    #: the method config's keys, typed and checked (:mod:`selfspec.config.options`); a method
    #: whose options derive from :class:`~selfspec.decoding.part_options.Gated` or
    #: :class:`~selfspec.decoding.part_options.ContextFirst` takes those parts too
    Options: ClassVar[type[Options]] = Options
    #: whether the method config takes ``never_slower`` (:mod:`selfspec.decoding.gate`): methods
    #: whose step can give way to a plain step (set from :attr:`Options`)
    gated: ClassVar[bool] = False
    #: whether the method config takes the ``ngram`` sub-config (drafts from the context first,
    #: :func:`selfspec.decoding.chain.context_step`): the self-drafting methods (set from :attr:`Options`)
    context_first: ClassVar[bool] = False
    #: the decoder's own attributes whose policy state carries over between examples
    #: (:mod:`selfspec.decoding.carried`; SWIFT's layer search): none by default, its parts' carry
    carries: ClassVar[tuple[str, ...]] = ()
    #: whether the decoder's steps run in :meth:`generate`'s loop (the thread policy steers those,
    #: :mod:`selfspec.decoding.threads`); the HF peers' steps run in transformers' ``generate``
    own_loop: ClassVar[bool] = True
    #: whether the decoder decodes in a batch of several sequences (the evaluation's ``batch_size``):
    #: every method of selfspec's loop does (:mod:`selfspec.models.batch`)
    batches: ClassVar[bool] = True
    #: whether the decoder samples (``sampling.temperature > 0``): every method of selfspec's loop does;
    #: a peer that decodes greedily only is refused in a sampled run before the model loads
    samples: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.gated = issubclass(cls.Options, Gated)
        cls.context_first = issubclass(cls.Options, ContextFirst)

    def __init__(
        self,
        model: LayeredModel,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        tokenizer=None,
        *,
        gate=None,
        context=None,
        draft_vocab=None,
        reads: dict[str, Any] | None = None,
        threads=None,
        profile=None,
    ) -> None:
        """The parts every decoder may be built with (:func:`selfspec.decoding.build_decoder`
        assembles them from the method config; nothing is attached after construction):

        * ``gate``: the speculation gate (:class:`~selfspec.decoding.gate.SpeculationGate`) when
          ``never_slower`` is on; None = always speculate (decoders built directly: tests, the
          skip search);
        * ``context``: the context drafter (:class:`selfspec.decoding.ngram.ContextDrafter`) when
          the method's ``ngram`` sub-config is set (only for :attr:`context_first` methods);
        * ``draft_vocab``: a truncated draft vocabulary (:class:`selfspec.models.heads.DraftVocab`,
          ``method.draft_vocab``); None = the full head;
        * ``reads``: the trained artefacts the method itself reads (name -> directory);
        * ``threads``: the thread policy (:class:`~selfspec.decoding.threads.ThreadPolicy`) when
          the evaluation's ``threads`` is adaptive; None = torch's threads throughout;
        * ``profile``: this machine's cost profile of the model
          (:class:`~selfspec.measure.profile.Profile`) when the run has one; None = none. The gate
          and the thread policy are built with it; a decoder that builds its own context drafter
          (``method=ngram``) hands it on, for the ``priced`` draft schedule.
        """
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        if context is not None and not self.context_first:
            raise ValueError(f"method {self.name} takes no context drafter (no ngram sub-config)")
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.tokenizer = tokenizer
        self.gate = gate
        self.context = context
        self.draft_vocab = draft_vocab
        self.reads = {k: v for k, v in (reads or {}).items() if v}
        self.threads = threads
        self.profile = profile

    @property
    def artefacts(self) -> dict[str, Any]:
        """Trained artefacts the decoder reads (name -> directory), for run records and W&B
        lineage: its own (``reads``) and the draft vocabulary's."""
        vocab = getattr(self.draft_vocab, "path", None)
        return {**self.reads, **({"draft_vocab": vocab} if vocab else {})}

    @property
    def room(self) -> int:
        """Cache positions a step may write beyond the committed tokens: the method's own
        :attr:`lookahead` (drafts, trees) or a context draft's k + 1, whichever is more."""
        return max(self.lookahead, self.context.max_draft + 1 if self.context is not None else 0)

    def cache_length(self, n_prompt: int, max_new_tokens: int) -> int:
        """Cache positions a generation of ``max_new_tokens`` after ``n_prompt`` prompt tokens takes:
        every token, the last one's step and the :attr:`room` a step writes past them (what the
        evaluation reserves in the model's pooled cache before anything is timed)."""
        return n_prompt + max_new_tokens + self.room + 1

    @classmethod
    def lossless_under(cls, sampling: Sampling) -> bool:
        """Whether a generation under ``sampling`` is lossless: vanilla's output under greedy
        decoding, the target distribution under sampling (PPD's typical acceptance is not)."""
        return cls.lossless and (sampling.greedy or cls.lossless_sampling)

    # --- hooks -----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, model: LayeredModel, options: Options, **common) -> "Decoder":
        """Build from the checked :attr:`Options` of the method config (model-dependent checks
        happen here); ``common`` holds the parts (:meth:`__init__`) and eos/stop/tokenizer.
        Default: the method's own keys as keyword arguments."""
        return cls(model, **options.values(without=PARTS), **common)

    @classmethod
    def check_run(cls, options: Options, layers: int, budget: int | None = None) -> None:
        """What the checked ``options`` ask of a model of ``layers`` layers, known before it loads
        (:func:`selfspec.measure.peak.shape_of`): a key naming a layer the model does not have is
        refused by name (:class:`~selfspec.config.checks.ConfigError`; issue 52: they were refused
        only after the load). With ``budget`` (the run's max_new_tokens), a setting the budget leaves
        without effect is said in a warning. :func:`selfspec.decoding.build_decoder` checks the
        layers again against the model it builds on. Default: nothing to check."""

    @classmethod
    def models_read(cls, options: Options) -> tuple[str, ...]:
        """The model configs (conf/model/) the method reads besides the run's model (a separate draft
        model's), whose files' digests a run's identity holds (:func:`selfspec.evaluation.identity.run_identity`).
        Default: none."""
        return ()

    @classmethod
    def needs_profile(cls, options: Options) -> tuple[str, str] | None:
        """The first of the method's checked ``options`` (:func:`~selfspec.decoding.check_method`) that
        prices its choices with the run's cost profile, as ``("key=value", why)``, or None; evaluate
        refuses it with ``profile=null`` before the model loads. Default: drafts from the context
        first with ``ngram.draft_schedule: priced``; a method with a priced choice of its own adds it."""
        context = options.ngram if isinstance(options, ContextFirst) else None
        if context and context.draft_schedule == "priced":
            return "ngram.draft_schedule=priced", PRICED_NEEDS_PROFILE
        return None

    @classmethod
    def new_gate(cls, profile=None):
        """The speculation gate ``never_slower`` gives this method (default settings; ``profile``:
        price steps with it, :mod:`selfspec.decoding.gate`)."""
        from selfspec.decoding.gate import SpeculationGate

        return SpeculationGate(profile=profile)

    def reserve(self, length: int) -> None:
        """Make room for generations of up to ``length`` positions before anything is timed. Default:
        nothing (the runner sizes the model's pooled cache for the decoders of its own loop); a peer
        with a runtime of its own (llama.cpp) sizes that."""

    def begin(self, state: DecodeState) -> None:
        """Per-example set-up before prefill: per-example state goes on ``state.example``, not on
        the decoder (default: the context drafter's state, ``state.context``, when there is one;
        an override calls this)."""
        if self.context is not None:
            state.context = self.context.new_example(state)

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> int:
        """Run the prompt through the model; return the first new token."""
        h = self.model.forward(prompt, state.cache, start=0, ledger=state.ledger, joins=state.joins)
        return int(select(self.model.logits(h[:, -1], state.ledger, state.joins), state.sampling, state.generator,
                          state.ledger)[0])

    def first_step(self, state: DecodeState, prompt: torch.Tensor, budget: int) -> list[int]:
        """The step that reads the prompt (traced as ``prefill``): default :meth:`prefill`, which
        commits one token; a method whose authors draft from the prompt itself overrides it
        (early exit's ``prefill: draft``, LayerSkip's code)."""
        return [self.prefill(state, prompt)]

    def step(self, state: DecodeState, budget: int) -> list[int]:
        """Commit one or more tokens (at most ``budget`` are used); see the module docstring."""
        raise NotImplementedError

    def finish(self, state: DecodeState) -> None:
        """Per-example statistics after the loop (default: nothing)."""

    def after_plain_step(self, state: DecodeState) -> None:
        """After a step the speculation gate made plain: bring per-example state in line
        (default: nothing; PPD restarts from state 0)."""

    def speculated(self, state: DecodeState) -> bool:
        """Whether the step just taken counts as speculative for the gate (default: it drafted; a
        step that drafted nothing cost a plain step)."""
        return state.drafted > 0

    def _gated_step(self, state: DecodeState, budget: int) -> list[int]:
        """:meth:`step`, or with a speculation gate (:mod:`selfspec.decoding.gate`) that finds
        speculation does not pay here, :meth:`plain_step`: no drafting, planning or learning, so it
        costs what a vanilla step costs. Both outcomes are costed for the gate: priced from the
        step's ledger ops with the gate's profile (deterministic: greedy and sampling), or timed on
        the wall clock (greedy decoding only, so seeded sampling stays reproducible)."""
        gate = self.gate
        if gate is None or not (state.sampling.greedy or gate.deterministic):
            return self.step(state, budget)
        t0 = time.perf_counter()
        if gate.speculate():
            new = self.step(state, budget)
            speculated = self.speculated(state)
        else:
            new = self.plain_step(state)
            self.after_plain_step(state)
            speculated = False
            state.count("plain_steps_gated")
            state.trace_step = StepTrace(gated=True)
        ledger = state.ledger
        step = state.trace_step
        gate.record(speculated, len(new), gate.price(ledger.ops, step.source, step.drafted, step.guessed)
                    if gate.deterministic and ledger is not None else time.perf_counter() - t0)
        return new

    def plain_step(self, state: DecodeState) -> list[int]:
        """One autoregressive step: the pending token through the full model, the next token
        selected from its logits (vanilla's step; a gated method's step when speculation does not
        pay). Scratch K/V past the committed tokens (drafts, trees) is dropped first. Charged to
        the ledger's ``plain`` component."""
        with phase(state.ledger, "plain"):
            state.cache.truncate(state.n_cached)
            h = self.model.forward(state.pending_ids(self.model.device), state.cache, start=state.n_cached,
                                   ledger=state.ledger, joins=state.joins)
            return [int(select(self.model.logits(h[:, -1], state.ledger, state.joins), state.sampling, state.generator,
                               state.ledger)[0])]

    # --- state carried across examples -------------------------------------------------------
    @property
    def parts(self) -> tuple[Any, ...]:
        """The parts the decoder holds (None where it has none): the speculation gate, the thread
        policy, the context drafter; a chain method adds its drafter."""
        return (self.gate, self.threads, self.context)

    def carried_state(self) -> list[tuple[Carries, dict[str, Any]]]:
        """A snapshot of the policy state that carries over between examples (:mod:`selfspec.decoding.carried`:
        the decoder's own and its parts'), for :meth:`restore_carried`."""
        return [(p, p.snapshot()) for p in (self, *self.parts) if isinstance(p, Carries)]

    @staticmethod
    def restore_carried(saved: list[tuple[Carries, dict[str, Any]]]) -> None:
        """Put back a :meth:`carried_state` snapshot."""
        for part, snapshot in saved:
            part.restore(snapshot)

    def fork(self) -> "Decoder":
        """A decoder with this one's configuration and artefacts whose policy state that carries over
        between examples (and the per-example state its parts keep, such as a draft-stop rule's) is a
        copy of its own: a batch's slots (:mod:`selfspec.models.batch`) each decode their own stream
        of examples, as one decoder decodes a run's."""
        return _forked(self, {})

    def carried(self) -> list[str]:
        """The policy state that carries over from one example to the next
        (:mod:`selfspec.decoding.carried`), by name: the decoder's own carried attributes
        (``search``), then its parts' (``gate``, ``threads``, ``context.acceptance``,
        ``drafter.draft_stop``, ``drafter.lookup.acceptance``), less an attribute that holds nothing (None: the n-gram lookup's
        acceptance table under a schedule other than ``priced``) and a draft-stop rule with nothing
        that changes (a static threshold). What a new process starts afresh when it resumes a run,
        and what makes a sampled sequence of a batch differ from its batch-1 output (README, "Batches":
        a batch slot learns it from its own examples)."""
        def held(obj, prefix: str = ""):  # the parts among an object's attributes, one level down too
            for name, part in vars(obj).items():
                if part is not None and any(part is p for p in self.parts):
                    yield prefix + name, part
                    if not prefix:
                        yield from held(part, f"{name}.")

        holders = [("", self), *held(self)]
        names = []
        for name, part in holders:
            if not isinstance(part, Carries):
                continue
            if part.carries is None:
                names.append(name)
                continue
            names += [f"{name}.{a}" if name else a for a in part.carries if getattr(part, a) is not None
                      and not (isinstance(getattr(part, a), DraftStop) and getattr(part, a).state() is None)]
        return names

    @contextlib.contextmanager
    def kept_state(self) -> Iterator[None]:
        """Generations inside leave the policy state that carries over between examples as they
        found it: the evaluation's warm-up, after which the measured examples start where a fresh
        decoder starts."""
        saved = self.carried_state()
        try:
            yield
        finally:
            self.restore_carried(saved)

    def generate_timed(self, prompt_ids, max_new_tokens: int, sampling: Sampling | None = None, attempts: int = 3
                       ) -> tuple["Generation", int]:
        """:meth:`generate`, timed apart from the building of static passes: on a model whose passes
        take static shapes, a generation that built passes inside it (under ``capture=graphs`` each a
        CUDA graph capture, whose cost its seconds include) is run again from the same carried state
        (the same tokens: sampling is seeded per generation), up to ``attempts`` generations in all.
        Returns the generation and the passes built inside it (0 unless every attempt built some).
        The evaluation, the skip search's timed objective and ``make gpu-check`` time through here."""
        steps = self.model.steps if self.own_loop else None
        for attempt in range(max(1, attempts)):
            saved = self.carried_state() if steps is not None and attempt < attempts - 1 else None
            built = steps.built if steps is not None else 0
            gen = self.generate(prompt_ids, max_new_tokens, sampling)
            new = steps.built - built if steps is not None else 0
            if not new or saved is None:
                return gen, new
            self.restore_carried(saved)
        raise AssertionError("unreachable")

    # --- the loop --------------------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: Sampling | None = None,
        joins: Joins | None = None,
    ) -> Generation:
        """Decode up to ``max_new_tokens`` after ``prompt_ids``. ``joins``: the batch of generations this
        one decodes in (:class:`selfspec.models.batch.Batch`: its job hands it here), whose passes its
        steps' passes join (:attr:`DecodeState.joins`); None: alone."""
        prompt, n_prompt, sampling = self.generation_inputs(prompt_ids, max_new_tokens, sampling)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(sampling.seed)
        cache = self.model.new_cache(self.cache_length(n_prompt, max_new_tokens), reuse=True)
        state = DecodeState(prompt[0].tolist(), n_prompt, cache, sampling, generator, joins=joins)
        if self.draft_vocab is not None:
            state.vocab = self.draft_vocab.for_example(state)
        sync = synchronizer(self.model.device)
        ledger = state.ledger = Ledger(self.model.device)  # passed to the passes that record into it
        threads = self.threads
        try:
            if threads is not None:
                threads.full()
            sync()
            t0 = time.perf_counter()
            ledger.start()
            self.begin(state)
            with torch.inference_mode():
                state.trace_step = StepTrace("prefill", width=n_prompt)
                with phase(ledger, "prefill"):
                    first = self.first_step(state, prompt, max_new_tokens)
                reason = self._commit(state, first, max_new_tokens)
                while reason is None:
                    state.drafted = 0
                    state.trace_step = StepTrace()
                    if threads is not None and not threads.choose():
                        state.count("steps_one_thread")
                    new = self._gated_step(state, max_new_tokens - (len(state.tokens) - n_prompt))
                    if threads is not None:
                        threads.record(ledger.ops)
                    reason = self._commit(state, new, max_new_tokens)
            ledger.stop()
            sync()
            seconds = time.perf_counter() - t0
            ledger.seconds["host"] += seconds - sum(ledger.seconds.values())  # the loop's own edges
        finally:
            if threads is not None:
                threads.full()
        self.finish(state)
        if state.vocab is not None:
            state.stats.update(state.vocab.stats())
        return Generation(
            tokens=state.tokens[n_prompt:],
            prompt_len=n_prompt,
            seconds=seconds,
            steps=len(state.accepted_per_step),
            accepted_per_step=state.accepted_per_step,
            drafted_per_step=state.drafted_per_step,
            stop_reason=reason,
            stats=state.stats,
            trace=state.trace,
            ledger=ledger.seconds,
            verified_per_step=state.verified_per_step,
        )

    def generation_inputs(self, prompt_ids, max_new_tokens: int, sampling: Sampling | None
                          ) -> tuple[torch.Tensor, int, Sampling]:
        """What every :meth:`generate` starts from (this loop's and the peers'): the sampling settings
        (None: greedy), the ``[1, n]`` prompt on the model's device (:meth:`prompt_tensor`: an empty
        prompt or budget stops here) and its length ``n``; returned as ``(prompt, n, sampling)``."""
        sampling = sampling or Sampling()
        prompt = self.prompt_tensor(prompt_ids, max_new_tokens)
        return prompt, prompt.shape[1], sampling

    def prompt_tensor(self, prompt_ids, max_new_tokens: int) -> torch.Tensor:
        """``[1, n]`` prompt on the model's device; an empty prompt or budget stops here."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.model.device).view(1, -1)
        if prompt.shape[1] == 0:
            raise ValueError("the prompt is empty: give at least one token (e.g. BOS)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return prompt

    def _commit(self, state: DecodeState, new: list[int], max_new_tokens: int) -> str | None:
        """Append ``new`` (cut at EOS / stop string / budget); return why to stop, or None."""
        reason = None
        state.verified_per_step.append(len(new))
        n_done = len(state.tokens) - state.prompt_len
        if n_done + len(new) >= max_new_tokens:
            new = new[: max_new_tokens - n_done]
            reason = "length"
        for j, t in enumerate(new):
            if t in self.eos_token_ids:
                new, reason = new[: j + 1], "eos"
                break
        start = len(state.tokens)
        state.tokens.extend(new)
        if self.stop_strings:
            cut = self._stop_string_end(state, start)
            if cut is not None:
                del state.tokens[cut:]
                reason = "stop"
        state.accepted_per_step.append(len(state.tokens) - start)
        state.drafted_per_step.append(state.drafted)
        step = state.trace_step
        step.drafted, step.committed = state.drafted, len(state.tokens) - start
        if state.ledger is not None:
            step.ops = state.ledger.take_ops()
        state.trace.append(step)
        return reason

    def _stop_string_end(self, state: DecodeState, start: int) -> int | None:
        """End index (exclusive) of the first token completing a stop string in the new tokens."""
        gen_start = state.prompt_len
        window = max(gen_start, start - 16)
        tail = self.tokenizer.decode(state.tokens[window:])
        if not any(s in tail for s in self.stop_strings):
            return None
        for end in range(max(start, gen_start) + 1, len(state.tokens) + 1):
            text = self.tokenizer.decode(state.tokens[gen_start:end])
            if any(s in text for s in self.stop_strings):
                return end
        return None
