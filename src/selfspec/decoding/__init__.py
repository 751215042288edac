"""Decoding methods behind one :class:`~selfspec.decoding.base.Decoder` interface.

``build_decoder(cfg.method, model, ...)`` builds the method a config names; :data:`METHODS` (the
one registry style, :mod:`selfspec.config.registry`) names each method's class.
"""

from __future__ import annotations

import functools

from selfspec.config import checks
from selfspec.config.options import Options
from selfspec.config.registry import Registry
from selfspec.decoding.base import DecodeState, Decoder, Generation
from selfspec.decoding.part_options import ContextFirst, Gated
from selfspec.decoding.sampling import Sampling

#: method name -> its decoder class (imported on first use); the order is the tables' row order
#: (:func:`method_rank`), each method's title its class's (:func:`method_title`)
METHODS = Registry("method", {
    "vanilla": "selfspec.decoding.vanilla:Vanilla",
    "draft_verify": "selfspec.decoding.draft_verify:DraftVerify",
    "adadecode": "selfspec.decoding.adadecode:AdaDecode",
    "adadecode_noverify": "selfspec.decoding.adadecode:AdaDecodeNoVerify",
    "ppd": "selfspec.decoding.ppd:PPD",
    "early_exit": "selfspec.decoding.early_exit:EarlyExit",
    "del": "selfspec.decoding.early_exit:DEL",
    "swift": "selfspec.decoding.swift:Swift",
    "knapspec": "selfspec.decoding.knapspec:KnapSpec",
    "clasp": "selfspec.decoding.knapspec:CLaSp",
    "quant_draft": "selfspec.decoding.quant_draft:QuantDraft",
    "ngram": "selfspec.decoding.ngram:NgramLookup",
    "hf_generate": "selfspec.decoding.peers:HFGenerate",
    "hf_prompt_lookup": "selfspec.decoding.peers:HFPromptLookup",
    "hf_early_exit": "selfspec.decoding.peers:HFEarlyExit",
    "hf_assisted": "selfspec.decoding.peers:HFAssisted",
    "llama_cpp": "selfspec.decoding.llamacpp:LlamaCpp",
    "llama_cpp_speculative": "selfspec.decoding.llamacpp:LlamaCppSpeculative",
}, lambda name, known: ValueError(f"unknown method {name!r}; choose one of {', '.join(known)} (conf/method/)"))


def decoder_class(name: str) -> type[Decoder]:
    return METHODS.lookup(name)


def method_title(name: str) -> str:
    """A method's title in tables and figures (its class's :attr:`~Decoder.title`); another name
    (a paper's own row, e.g. Medusa) as it is."""
    return METHODS[name].title if name in METHODS else name


def method_rank(name: str) -> int:
    """A method's place in tables (:data:`METHODS`' order); other names after every method."""
    return METHODS.rank(name)


@functools.lru_cache(maxsize=None)
def _yaml_keys(conf: str, name: str) -> tuple[str, ...]:
    from selfspec.config import load_method_config

    return tuple(load_method_config(name))


def check_method(method_cfg, prefix: str = "method") -> Options:
    """The checked options of a ``method`` config (the decoder's :attr:`~Decoder.Options`), without
    a model.

    Every key of the decoder's own YAML (``conf/method/<name>.yaml``, where each default is
    written, and only there) must be present, and a key the decoder does not read is refused
    (:class:`~selfspec.config.checks.ConfigError`)."""
    from selfspec.config import conf_dir

    cls = decoder_class(str(method_cfg.name))
    checks.required_keys(prefix, method_cfg, _yaml_keys(str(conf_dir()), cls.name),
                         f"conf/method/{cls.name}.yaml (or a method config whose defaults list names it)")
    options = cls.Options.read(method_cfg, prefix)
    checks.known_keys(prefix, [k for k in method_cfg if k != "name"], [*cls.Options.keys(), "name"],
                      f"method {cls.name}")
    return options


def build_decoder(method_cfg, model, *, profile=None, threads: str = "fixed", options: Options | None = None,
                  **common) -> Decoder:
    """Build the decoder a ``method`` config group names (``method.name``) from its parts, all at
    construction (:class:`~selfspec.decoding.base.Decoder`): a speculation gate
    (:meth:`Decoder.new_gate`) when its ``never_slower`` is on — pricing steps with ``profile``
    (a :class:`~selfspec.measure.profile.Profile` of this model) when one is given, else timing
    them — and a context drafter (:class:`~selfspec.decoding.ngram.ContextDrafter`) when its
    ``ngram`` is set; with ``threads="adaptive"``, a thread policy
    (:class:`~selfspec.decoding.threads.ThreadPolicy`, pricing with ``profile``) for a decoder
    whose steps run in :meth:`Decoder.generate`'s loop. ``options``: the config's options as
    :func:`check_method` returned them already (an evaluation checks every method before its model
    loads), else they are checked here."""
    cls = decoder_class(str(method_cfg.name))
    options = options if options is not None else check_method(method_cfg)
    cls.check_run(options, model.num_layers)
    gate = cls.new_gate(profile) if isinstance(options, Gated) and options.never_slower else None
    if threads not in ("adaptive", "fixed"):
        raise ValueError(f"threads must be adaptive or fixed here, got {threads!r}")
    if threads == "adaptive" and cls.own_loop:
        from selfspec.decoding.threads import ThreadPolicy

        common["threads"] = ThreadPolicy(profile)
    context = options.ngram if isinstance(options, ContextFirst) else None
    if context is not None:
        from selfspec.decoding.ngram import ContextDrafter

        context = ContextDrafter(model, context, profile=profile)
    return cls.from_config(model, options, gate=gate, context=context, profile=profile, **common)


__all__ = ["Decoder", "DecodeState", "Generation", "Sampling", "build_decoder", "check_method", "decoder_class",
           "method_rank", "method_title", "METHODS"]
