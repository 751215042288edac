"""Typed method options (selfspec.config.options): each method's keys are one dataclass, the YAML
holds every default, each check sits beside its field and runs once."""

import dataclasses

import pytest

from selfspec.config import checks, conf_dir, load_method_config, method_config
from selfspec.config.options import Options, Ref, key, nullable
from selfspec.decoding import METHODS, check_method, decoder_class
from selfspec.decoding.part_options import ContextFirst, Gated


def test_every_method_yaml_sets_exactly_its_options_fields():
    """The one home of defaults: conf/method/<name>.yaml sets every field of the method's options
    (a field has no default in Python) and nothing else; the parts' keys come with the options
    class they derive from."""
    for name in METHODS:
        cls = decoder_class(name)
        yaml_keys = set(load_method_config(name)) - {"name"}
        assert yaml_keys == set(cls.Options.keys()), name
        for f in dataclasses.fields(cls.Options):
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (name, f.name)
        assert cls.gated == issubclass(cls.Options, Gated), name
        assert cls.context_first == issubclass(cls.Options, ContextFirst), name


def test_every_method_config_reads_to_its_typed_record():
    """Each conf/method/*.yaml (the variants too) reads to a frozen record of its method's class
    (the separate-draft peers' need their draft model named)."""
    for path in sorted((conf_dir() / "method").glob("*.yaml")):
        cfg = method_config(path.stem)
        if cfg.name == "hf_assisted":
            cfg.assistant = "tiny-random"
        if cfg.name == "llama_cpp_speculative":
            cfg.draft = "tiny-random"
        options = check_method(cfg)
        assert type(options) is decoder_class(str(cfg.name)).Options, path.stem
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options, "anything", 1)


@dataclasses.dataclass(frozen=True)
class Example(Options):
    renamed = {"old": "high", "gone": "{prefix}.low (a sentence)"}

    high: int = key(checks.integer, 1, why="the top")
    low: int = key(checks.integer, 0, Ref("high"), why="at most {prefix}.high={high}")
    note: str | None = key(nullable(checks.text))

    def validate(self, prefix):
        if self.note == "veto":
            raise checks.refuse(f"{prefix}.note", self.note, "not veto")


def test_fields_check_in_order_with_earlier_bounds_and_rules_between_keys():
    cfg = {"high": 3, "low": 2.0, "note": None}
    assert Example.read(cfg, "job.x") == Example(3, 2, None)
    assert Example.read(cfg).values() == {"high": 3, "low": 2, "note": None}
    with pytest.raises(checks.ConfigError, match=r"job\.x\.low=4 is not allowed: must be in \[0, 3\] "
                                                 r"\(at most job\.x\.high=3\)"):
        Example.read({**cfg, "low": 4}, "job.x")
    with pytest.raises(checks.ConfigError, match=r"method\.high=0 is not allowed: must be >= 1 \(the top\)"):
        Example.read({**cfg, "high": 0, "low": 9})  # the first bad key in field order is named
    with pytest.raises(checks.ConfigError, match=r"method\.note=veto is not allowed: not veto"):
        Example.read({**cfg, "note": "veto"})
    with pytest.raises(checks.ConfigError, match=r"method\.old was renamed: set method\.high instead"):
        Example.read({**cfg, "old": 1})
    with pytest.raises(checks.ConfigError, match=r"set job\.x\.low \(a sentence\) instead"):
        Example.read({**cfg, "gone": 1}, "job.x")


def test_a_method_config_is_checked_once_with_todays_messages():
    """The messages the old hand-written readers gave, from the fields now (one per kind of rule)."""
    cases = [
        ("del", {"min_draft": 9, "max_draft": 4},
         r"method\.min_draft=9 is not allowed: must be in \[0, 4\] \(smallest speculation length, at most "
         r"max_draft=4\)"),
        ("del", {"head_cost": 0.5, "cost_model": "layers"}, r"method\.head_cost=0\.5 is not allowed: set only with "
         r"cost_model=measured or parameters"),
        ("knapspec", {"window": 7}, r"method\.window=7 is not allowed: must be in \[1, \d+\]"),
        ("adadecode", {"gamma": 0.5}, r"method\.gamma was renamed: set method\.threshold instead"),
        ("draft_verify", {"draft_exit": "adaptive"}, r"method\.draft_exit was renamed: set method\.draft_stop "
         r"\(\{rule: adaptive\}"),
        ("ppd", {"ngram": {"max_ngram": 3, "min_ngram": 1}}, r"method\.ngram config lacks method\.ngram\.max_draft"),
        ("draft_verify", {"max_draf": 4}, r"method\.max_draf is not a key of method draft_verify"),
    ]
    for name, keys, message in cases:
        with pytest.raises(checks.ConfigError, match=message):
            check_method(method_config(name, **keys))


def test_sub_configs_are_typed_records_whose_defaults_live_in_yaml_once():
    """``draft_stop`` and ``ngram`` read to frozen records like a method's own keys (issue 53): each
    rule's defaults are written once, in conf/method/draft_stop/<rule>.yaml, and the context
    drafts' in conf/method/ngram/chain.yaml; method YAMLs pick them in their defaults lists and
    write no copy (the adaptive rule's values were in Python, and γ0 = 0.6 was written twice)."""
    from omegaconf import OmegaConf

    from selfspec.decoding import draft_exit
    from selfspec.decoding.part_options import ScheduledLookup

    for rule, record in draft_exit.RULES.items():
        written = OmegaConf.to_container(OmegaConf.load(conf_dir() / "method" / "draft_stop" / f"{rule}.yaml"))
        assert written.pop("rule") == rule and set(written) == set(record.keys()), rule
        for f in dataclasses.fields(record):
            assert f.default is dataclasses.MISSING, (rule, f.name)
        read = draft_exit.draft_stop_option("method.draft_stop", {"rule": rule, **written}, dynamic=True)
        assert type(read) is record and read.config() == {"rule": rule, **written}
    assert not [n for n in dir(draft_exit) if n.startswith("ADAPTIVE_")]
    for f in dataclasses.fields(draft_exit.AdaptiveThreshold):
        assert f.init is False or f.name == "settings", f.name  # the rule's settings are the record's
    chain = OmegaConf.to_container(OmegaConf.load(conf_dir() / "method" / "ngram" / "chain.yaml"))
    assert set(chain) == set(ScheduledLookup.keys())
    written = {p.name: OmegaConf.to_container(OmegaConf.load(p)) for p in (conf_dir() / "method").glob("*.yaml")}
    copies = [name for name, w in written.items() if "rule" in (w.get("draft_stop") or {})
              or "draft_schedule" in (w.get("ngram") or {})]
    assert not copies, f"a sub-config written again instead of picked from its group: {copies}"


def test_a_sub_config_is_checked_once_per_build_and_the_profile_once_per_run(monkeypatch, tiny):
    """Draft & Verify's ``draft_stop`` was checked three times per build (the options, the drafter,
    its reset) and ``profile`` resolved three times per run (issue 53): once each now."""
    from selfspec.config import compose
    from selfspec.decoding import build_decoder
    from selfspec.decoding.draft_exit import AdaptiveStop
    from selfspec.evaluation import plan as planning, profiling, runner
    from selfspec.train import job_named
    from selfspec.training import driver

    read = AdaptiveStop.read.__func__
    reads = []
    monkeypatch.setattr(AdaptiveStop, "read", classmethod(lambda cls, *a, **k: reads.append(a) or read(cls, *a, **k)))
    dec = build_decoder(method_config("draft_verify", skip_attn=[1], skip_mlp=[2]), tiny.model)
    dec.drafter.reset_draft_stop()
    dec.generate(tiny.tokenizer("a b c")["input_ids"], 4)
    assert len(reads) == 1

    resolve = profiling.profile_spec
    resolved = []
    monkeypatch.setattr(planning, "profile_spec", lambda cfg: resolved.append(cfg.profile) or resolve(cfg))
    plan = runner.prepare(compose(["model=tiny-random", "method=ngram", "n_examples=1", "threads=auto"]))
    assert resolved == ["auto"] and plan.profile == "auto"
    resolved.clear()
    monkeypatch.setattr(profiling, "profile_spec", lambda cfg: resolved.append(cfg.profile) or resolve(cfg))
    opts, spec = driver.prepare(job_named("draft_vocab"), compose(["model=tiny-random", "job=draft_vocab"], "train"))
    assert resolved == ["auto"] and spec == "auto"
    with pytest.raises(checks.ConfigError, match=r"profile=null is not allowed: .*job=draft_vocab \(each candidate"
                                                 r"'s head cost\) prices its passes"):
        driver.prepare(job_named("draft_vocab"), compose(["model=tiny-random", "job=draft_vocab", "profile=null"], "train"))
