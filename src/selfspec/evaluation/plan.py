"""The evaluation's plan: every config check, and what the run reads before the model loads (:func:`prepare`).

Bad input stops before the model loads: every config value (run options, sampling, task, each
method's options, the model config, the logger) is checked, whether the task can be scored here
(HumanEval: whether bubblewrap can isolate its programs, ``task.isolation``), and the task's
examples are read and checked first, so a typo never costs a model load. What the checks found is a
frozen :class:`RunPlan`: what the loop (:mod:`selfspec.evaluation.loop`) needs of the config. The
checks that need the loaded model (a quantised copy it cannot run, a method's steps that overflow its
context) come with the methods' decoders (:func:`build_runs`), before anything is written.

``n_samples`` > 1 (sampling only) generates each example that many times per method, sample ``i``
seeded ``sampling.seed + i`` for every method (:func:`sample_sampling`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.config import check_primary_keys, checks, load_method_config
from selfspec.config.options import Options
from selfspec.decoding import Decoder, Sampling, build_decoder, check_method, decoder_class
from selfspec.evaluation.profiling import profile_spec
from selfspec.measure.peak import shape_of


@dataclass(frozen=True)
class RunPlan:
    """What :func:`prepare` checked and read before the model loads: every config value the loop and the
    summary read (:mod:`selfspec.evaluation.loop`), each read once (the summary records the config whole
    beside them, and the run's identity its model, task and sampling sections)."""

    sampling: Sampling
    task: Any
    examples: list
    budget: int
    under_test: str
    #: label -> resolved config of every method, in run order (the baseline first: :func:`method_configs`)
    method_cfgs: dict[str, DictConfig]
    n_samples: int
    #: each method's options as :func:`check_methods` checked them, by label
    method_options: dict[str, Options]
    #: ``profile`` resolved (None, ``auto`` or a profile file), once per run
    profile: str | None = None
    #: sequences decoded at once (``batch_size``)
    batch_size: int = 1
    #: ``threads`` as checked (auto, adaptive or fixed; :func:`resolve_threads` once the model is loaded)
    threads: str = "auto"
    #: torch's global seed (``seed``)
    seed: int = 0
    #: untimed generations per method (``warmup``) and each one's token budget (``warmup_max_new_tokens``,
    #: at most the run's)
    warmup: int = 0
    warmup_tokens: int = 1
    #: the tqdm bar (``progress``)
    progress: bool = False
    #: the thresholds that flag a run as measured under load (``contention``, ``contention_spike``)
    contention: float = 1.5
    contention_spike: float = 1.6

    @property
    def baseline(self) -> str:
        """The baseline's label: the first method."""
        return next(iter(self.method_cfgs))


@dataclass
class MethodRun:
    """One method of the run: its label (config file name), resolved config and built decoder."""

    name: str
    cfg: DictConfig
    decoder: Decoder


@dataclass(frozen=True)
class Built:
    """What the run built once the model loaded (:func:`build_runs`): the loaded model, the run's cost
    profile (None without one), ``threads`` resolved, every method's decoder in run order and the
    examples' prompts, by id."""

    loaded: Any
    profile: Any
    threads: str
    runs: list[MethodRun]
    prompts: dict[Any, list[int]]


def prepare(cfg: DictConfig, label: str | None = None) -> RunPlan:
    """Check every config value and read the task's examples — all that can fail without a model."""
    from selfspec.models.loading import check_model_config
    from selfspec.tracking import check_logger, run_tags

    profile = _check_run_options(cfg)
    sampling = Sampling.from_config(cfg.sampling)
    n_samples = _n_samples(cfg, sampling)
    task = _task(cfg)
    budget = _budget(cfg, task)
    under_test = label or method_label(cfg)
    method_cfgs = method_configs(cfg, under_test)
    method_options = check_methods(method_cfgs, under_test)
    _check_priced_choices(profile, method_cfgs, method_options)
    batch_size = int(cfg.batch_size)
    _check_batched_methods(profile, method_cfgs, method_options, batch_size)
    _check_sampled_methods(sampling, method_cfgs)
    check_model_config(cfg.model)
    _check_for_model(cfg, method_cfgs, method_options, under_test, budget)
    check_logger(cfg.get("logger"), run_tags(cfg, "evaluate", under_test))
    task.check_scoring()  # after the config values: it asks the machine (HumanEval: bubblewrap)
    examples = task.examples()
    if batch_size > len(examples):  # issue 68: 1e9 slots forked up front grew memory without bound
        raise checks.refuse("batch_size", batch_size, f"at most the {len(examples)} examples selected (n_examples "
                            "and the task's pool)", "a batch decodes one sequence per example at a time")
    return RunPlan(sampling, task, examples, budget, under_test, method_cfgs, n_samples, method_options, profile,
                   batch_size, threads=str(cfg.threads), seed=int(cfg.seed), warmup=int(cfg.warmup),
                   warmup_tokens=min(int(cfg.warmup_max_new_tokens), budget), progress=bool(cfg.progress),
                   contention=float(cfg.contention), contention_spike=float(cfg.contention_spike))


def method_label(cfg: DictConfig) -> str:
    """The run's label of ``cfg.method``: its config file name (``method=<label>``).

    Variants share a decoder (``draft_verify_static`` has ``name: draft_verify``), so results are
    labelled by config file. Read from Hydra's choices inside ``@hydra.main``, else ``cfg.method.name``.
    """
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("method")
        if choice:
            return str(choice)
    return str(cfg.method.name)


def method_configs(cfg: DictConfig, label: str | None = None) -> dict[str, DictConfig]:
    """Label -> resolved config of the baseline, the method under test and ``compare``, in run order.

    ``baseline`` and ``compare`` name files of ``conf/method/``; their interpolations resolve
    against the run's config, as if composed as ``method=<name>``. A label given twice runs once.
    """
    label = label or method_label(cfg)
    compare = cfg.get("compare") or []
    names = [str(cfg.baseline), label] + [str(c) for c in ([compare] if isinstance(compare, str) else compare)]
    out: dict[str, DictConfig] = {}
    for name in names:
        if name in out:
            continue
        m = cfg.method if name == label else load_method_config(name)
        root = OmegaConf.to_container(cfg, resolve=False)
        root["method"] = OmegaConf.to_container(m, resolve=False)
        out[name] = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(root), resolve=True))["method"]
    return out


def _budget(cfg: DictConfig, task) -> int:
    n = cfg.get("max_new_tokens")
    if n is None:
        return task.cfg.max_new_tokens
    return checks.integer("max_new_tokens", n, 1, why="null = the task's max_new_tokens")


def _task(cfg: DictConfig):
    from selfspec.tasks import build_task, model_chat

    chat = model_chat(cfg)
    n = cfg.get("n_examples")
    if n is None:
        return build_task(cfg.task, model_chat=chat)
    return build_task(cfg.task, model_chat=chat,
                      n_examples=checks.integer("n_examples", n, 1, why="null = the task's n_examples"))


def _n_samples(cfg: DictConfig, sampling: Sampling) -> int:
    """``n_samples``: generations per example and method; more than one only under sampling."""
    n = checks.integer("n_samples", cfg.n_samples, 1, why="generations per example and method")
    if n > 1 and sampling.greedy:
        raise checks.refuse("n_samples", n, "must be 1 under greedy decoding (sampling.temperature=0), whose "
                            "samples are all identical", why="set sampling.temperature > 0 to draw several samples")
    return n


def sample_sampling(sampling: Sampling, index: int) -> Sampling:
    """The sampling settings of sample ``index``: seed ``sampling.seed + index``, the same for every method."""
    return replace(sampling, seed=sampling.seed + index)


def _check_run_options(cfg: DictConfig) -> str | None:
    """The keys of conf/evaluate.yaml read outside the groups (``n_examples`` and
    ``max_new_tokens`` are checked where they are read), after a top-level key it does not have; returns
    ``profile`` resolved (:func:`~selfspec.evaluation.profiling.profile_spec`), once per run."""
    check_primary_keys(cfg, "evaluate")
    checks.seed("seed", cfg.seed)
    checks.integer("warmup", cfg.warmup, 0, why="untimed generations per method")
    checks.integer("warmup_max_new_tokens", cfg.warmup_max_new_tokens, 1)
    checks.flag("progress", cfg.progress)
    checks.flag("memory_check", cfg.memory_check)
    checks.number("contention", cfg.contention, 1.0, low_open=True,
                  why="the baseline's measured / predicted time that flags a run as measured under load")
    checks.number("contention_spike", cfg.contention_spike, 1.0, low_open=True,
                  why="a generation's measured / predicted time, over its method's median and its example's least, "
                      "that flags it as spoiled")
    profile = profile_spec(cfg)
    _threads_spec(cfg, profile)
    _batch_size(cfg)
    return profile


def _batch_size(cfg: DictConfig) -> int:
    """``batch_size``: sequences decoded at once (:mod:`selfspec.evaluation.batches`). More than one is
    refused before the model loads where a batch cannot run: passes at static shapes (``model.capture``
    resolving to static or graphs: a batch runs dynamic passes) and ``threads=adaptive`` (it switches
    torch's threads between one sequence's steps, which a batch shares)."""
    from selfspec.models import capture
    from selfspec.models.loading import resolve_device

    size = checks.integer("batch_size", cfg.batch_size, 1, why="sequences decoded at once")
    if size > 1:
        mode = capture.resolve(str(cfg.model.capture), resolve_device(str(cfg.model.device)))
        if mode != "off":
            raise checks.refuse("batch_size", size, f"1 with model.capture resolving to {mode}",
                                "a batch runs dynamic passes: set model.capture=off, or batch_size=1")
        if str(cfg.threads) == "adaptive":
            raise checks.refuse("batch_size", size, "1 with threads=adaptive",
                                "adaptive threads switch torch's threads between one sequence's steps, which a "
                                "batch shares: set threads=fixed, or batch_size=1")
    return size


def _check_batched_methods(profile: str | None, method_cfgs: dict[str, DictConfig], options: dict[str, Options],
                           size: int) -> None:
    """Under ``batch_size > 1``, a method that cannot decode a batch (transformers' assisted generation and
    llama.cpp decode one sequence at a time) is refused, naming it, rather than run one sequence at a time behind the
    user's back; so is a speculation gate timed on the wall clock (``never_slower`` with
    ``profile=null``: a sequence's step shares its passes with the batch's other sequences)."""
    if size == 1:
        return
    for name, m in method_cfgs.items():
        if not decoder_class(str(m.name)).batches:
            raise checks.ConfigError(f"batch_size={size} with method {name}: it decodes one sequence at a time "
                                     f"({decoder_class(str(m.name)).title}); leave it out or set batch_size=1")
        if profile is None and getattr(options[name], "never_slower", False):
            raise checks.ConfigError(f"batch_size={size} with method {name}'s never_slower=true and profile=null: "
                                     "its gate would time steps that share their passes with the batch's other "
                                     "sequences; set profile=auto, method.never_slower=false, or batch_size=1")


def _check_sampled_methods(sampling: Sampling, method_cfgs: dict[str, DictConfig]) -> None:
    """Under sampling, a peer that decodes greedily only (llama.cpp) is refused, naming it, rather than
    run greedily beside methods that sample."""
    if sampling.greedy:
        return
    for name, m in method_cfgs.items():
        if not decoder_class(str(m.name)).samples:
            raise checks.ConfigError(f"sampling.temperature={sampling.temperature} with method {name}: it decodes "
                                     "greedily only; leave it out or set sampling.temperature=0")


def _threads_spec(cfg: DictConfig, profile: str | None) -> str:
    """``threads``: auto, adaptive or fixed; ``adaptive`` where it cannot run is refused before the
    model loads (:func:`selfspec.decoding.threads.why_not_adaptive`), with the profile it needs
    judged from ``profile`` (the resolved key: a profile file is read once the model is loaded)."""
    from selfspec.decoding.threads import THREADS, why_not_adaptive

    value = checks.choice("threads", cfg.threads, THREADS, why="CPU threads per decoding step")
    if value == "adaptive":
        from selfspec.models.loading import resolve_device

        why = why_not_adaptive(resolve_device(str(cfg.model.device)), profile or None)
        if why:
            raise checks.refuse("threads", value, "auto or fixed here", why)
    return value


def resolve_threads(plan: RunPlan, device: torch.device, profile) -> str:
    """What ``threads`` resolves to for this run: adaptive or fixed (``auto``: adaptive where it
    can run)."""
    from selfspec.decoding.threads import why_not_adaptive

    if plan.threads == "auto":
        return "fixed" if plan.batch_size > 1 or why_not_adaptive(device, profile) else "adaptive"
    return plan.threads


@contextlib.contextmanager
def _in_method_config(name: str, under_test: str) -> Iterator[None]:
    """A config error inside, of a baseline / compare method, names its config file."""
    try:
        yield
    except checks.ConfigError as err:
        if name == under_test:
            raise
        raise checks.ConfigError(f"{err} (in conf/method/{name}.yaml, run as baseline or compare)") from None


def check_methods(method_cfgs: dict[str, DictConfig], under_test: str) -> dict[str, Options]:
    """Every method config's checked options (:func:`~selfspec.decoding.check_method`), by label,
    without a model (the run builds its decoders from them: each method is checked once per run); an
    error in a baseline / compare method names its config file."""
    options = {}
    for name, m in method_cfgs.items():
        with _in_method_config(name, under_test):
            options[name] = check_method(m)
    return options


def _check_for_model(cfg: DictConfig, method_cfgs: dict[str, DictConfig], options: dict[str, Options],
                     under_test: str, budget: int) -> None:
    """Each method's keys bounded by the model's layer count, read from its config without loading
    it (:func:`~selfspec.measure.peak.shape_of`), what the token budget leaves without effect
    (:meth:`~selfspec.decoding.base.Decoder.check_run`), and that the draft vocabulary ``draft_vocab: auto``
    names exists for the model (:func:`~selfspec.models.heads.find_draft_vocab`: found by the model's name)."""
    from selfspec.models.heads import DraftVocabOptions, find_draft_vocab
    from selfspec.models.loading import resolve_device

    layers = shape_of(cfg.model).layers
    for name, m in method_cfgs.items():
        with _in_method_config(name, under_test):
            decoder_class(str(m.name)).check_run(options[name], layers, budget)
            if isinstance(options[name], DraftVocabOptions) and options[name].draft_vocab == "auto":
                try:
                    find_draft_vocab(str(cfg.model.name), options[name].draft_vocab_task)
                except FileNotFoundError as err:
                    raise checks.ConfigError(str(err)) from None
            weights = getattr(options[name], "draft_weights", None)
            if weights is not None and (str(cfg.model.linear_kernel) == "torch"
                                        or resolve_device(str(cfg.model.device)).type != "cpu"):
                raise checks.refuse("method.draft_weights", weights, "null with model.linear_kernel=torch or on a GPU",
                                    "a quantised copy of the weights runs on the runtime's CPU kernels "
                                    "(models/csrc/quant_linear.cpp): model.linear_kernel=auto or skinny on a CPU")


def _check_priced_choices(profile: str | None, method_cfgs: dict[str, DictConfig],
                          options: dict[str, Options]) -> None:
    """A choice a method prices with the run's cost profile (its class's
    :meth:`~selfspec.decoding.base.Decoder.needs_profile`: a context drafter's ``draft_schedule:
    priced``, DEL's ``cost_model: measured``) is refused with ``profile=null`` before the model
    loads, naming the method and the key."""
    if profile is not None:
        return
    for name, m in method_cfgs.items():
        need = decoder_class(str(m.name)).needs_profile(options[name])
        if need is not None:
            raise checks.ConfigError(f"profile=null with method {name}'s {need[0]}: {need[1]}")


def _check_draft_weights(plan: RunPlan, model, profile) -> None:
    """A method whose drafts read a quantised copy (``draft_weights``) is refused, naming it, where the
    loaded model cannot run one (:func:`~selfspec.models.quantised.problem`) or the run's profile has no
    prices of its passes (a profile measured before quantised drafts): before anything is decoded."""
    from selfspec.models.quantised import problem

    for name, options in plan.method_options.items():
        weights = getattr(options, "draft_weights", None)
        if weights is None:
            continue
        with _in_method_config(name, plan.under_test):
            why = problem(model)
            if why is not None:
                raise checks.refuse("method.draft_weights", weights, "null for this model", why)
            if profile is not None and weights not in profile.formats:
                raise checks.ConfigError(
                    f"method.draft_weights={weights}: profile {profile.name} ({profile.path or 'in memory'}) has no prices "
                    f"of passes over {weights} weights (measured before quantised drafts): measure it again "
                    "(profile=auto, or make profile), or set profile=null")


def build_runs(plan: RunPlan, loaded, profile, threads: str) -> list[MethodRun]:
    """Every method's decoder, built before the loop: a missing artefact fails here, with the
    method's message."""
    _check_draft_weights(plan, loaded.model, profile)
    common = dict(eos_token_ids=loaded.eos_token_ids, stop_strings=plan.task.stop, tokenizer=loaded.tokenizer)
    return [MethodRun(name, m, build_decoder(m, loaded.model, profile=profile, threads=threads,
                                             options=plan.method_options[name], **common))
            for name, m in plan.method_cfgs.items()]


def check_room(plan: RunPlan, runs: list[MethodRun], prompts: dict[str, list[int]], model) -> None:
    """Refuse, before anything is written, a method whose generations need more cache positions than
    the model holds: the longest prompt, the budget and what a step writes past the tokens (its
    drafts, its tree). Issue 52: SWIFT's max_draft=1000 failed at the first generation with advice
    naming max_new_tokens, after vanilla's row was written, so the corrected rerun was refused."""
    longest = max(map(len, prompts.values()))
    for run in runs:
        room = run.decoder.room
        need = longest + plan.budget + room + 1
        if need <= model.max_context:
            continue
        k = getattr(plan.method_options[run.name], "max_draft", None)
        drafts = f"method.max_draft={k}" if k is not None else "its drafts and tree"
        lower = ["max_new_tokens", "task.max_prompt_tokens"]
        if k is not None:
            lower.insert(0 if room > plan.budget else 2, "method.max_draft")
        raise checks.ConfigError(
            f"method {run.name}: a step may write {room} cache positions past the tokens ({drafts}), and with the "
            f"longest prompt ({longest} tokens) and max_new_tokens={plan.budget} a generation needs {need}, more than "
            f"the {model.max_context} model {model.name} holds: lower {', '.join(lower[:-1])} or {lower[-1]}")


__all__ = ["Built", "MethodRun", "RunPlan", "build_runs", "check_methods", "check_room", "method_configs",
           "method_label", "prepare", "resolve_threads", "sample_sampling"]
