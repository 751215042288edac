"""Issue 40: one registry style, and what a method, task, job or family says about itself lives with
it. A method's class carries its title, the registry (``METHODS``) its place in tables; a task's class
its title and its score column, the task registry its place; a job its memory model. Nothing else
keyed by their names defines them."""

from __future__ import annotations

from selfspec.decoding import METHODS, decoder_class, method_rank, method_title
from selfspec.reporting.layouts import PAPER_TASKS, TASK_SCORE, TASK_TITLE, task_order
from selfspec.tasks import TASKS


def test_methods_tasks_jobs_and_families_share_one_registry_style():
    import pytest

    from selfspec.config.registry import Registry
    from selfspec.models.families import FAMILIES
    from selfspec.train import JOBS

    for registry in (METHODS, TASKS, JOBS, FAMILIES):
        assert isinstance(registry, Registry) and len(registry) > 0
        for name in registry:
            assert registry[name] is not None, (registry.what, name)
    assert METHODS.rank("ppd") == list(METHODS).index("ppd") and METHODS.rank("medusa") == len(METHODS)
    # the names are listed without importing what they name, and an unknown name is refused by the
    # registry's own message, naming the known ones
    with pytest.raises(ValueError, match=r"unknown method 'medusa'; choose one of .*vanilla \(conf/method/\)"):
        decoder_class("medusa")
    with pytest.raises(ValueError, match=r"unknown job 'sft'; choose one of draft_vocab, heads"):
        JOBS.lookup("sft")
    with pytest.raises(KeyError, match=r"unknown task 'squad'; known tasks: cnndm, gsm8k"):
        TASKS.lookup("squad")
    with pytest.raises(ValueError, match="not 'module:attribute'"):
        Registry("thing", {"a": "selfspec.decoding"})


def test_every_method_has_its_title_and_place_from_the_registry():
    for i, name in enumerate(METHODS):
        cls = decoder_class(name)
        assert cls.name == name and cls.title, name
        assert method_title(name) == cls.title and method_rank(name) == i
    assert method_title("Medusa") == "Medusa"  # a paper's own row keeps its name, after every method
    assert method_rank("Medusa") == len(METHODS)
    assert [method_title(n) for n in ("vanilla", "draft_verify", "del", "hf_generate")] == [
        "Vanilla", "Draft & Verify", "DEL", "HF generate"]


def test_every_task_has_its_title_and_score_from_its_class():
    assert list(TASKS) == ["xsum", "cnndm", "humaneval", "gsm8k", "mtbench"]  # the papers' order
    assert TASK_TITLE == {**{n: c.title for n, c in TASKS.items()}, **PAPER_TASKS}
    assert TASK_SCORE == {n: c.score_column for n, c in TASKS.items() if c.score_column}
    assert TASK_SCORE["gsm8k"] == ("accuracy", "Acc.") and "mtbench" not in TASK_SCORE
    assert [task_order(t) for t in ("xsum", "mtbench", "alpaca", "unknown")] == [0, 4, 5, 6]


def test_every_job_says_its_own_memory_and_the_memory_model_knows_no_job():
    """A job's memory terms, fitted factors and fallbacks live with it (``JOB.memory``; an
    evaluation's ``runner.MEMORY``); the memory model names no job, and the README's table (the
    command, selfspec.memory) gathers them from the job registry."""
    import inspect

    from selfspec import memory
    from selfspec.evaluation import runner
    from selfspec.measure import peak
    from selfspec.train import JOBS, job_named

    assert memory.jobs() == (*JOBS, "evaluate")
    for name in JOBS:
        assert isinstance(job_named(name).memory, peak.MemoryModel)
        assert memory.memory_model(name) is job_named(name).memory
    assert memory.memory_model("evaluate") is runner.MEMORY
    source = inspect.getsource(peak)
    assert not [n for n in memory.jobs() if f'"{n}"' in source]
    assert not [n for n in memory.jobs() if f'"{n}"' in inspect.getsource(memory)]  # no job is a special case


def test_the_store_names_the_job_the_registry_has_for_each_kind():
    """The artefact kind a job writes is the job's own (``JOB.kind``). The store names the job that
    rebuilds an artefact from its own table (:data:`selfspec.store.artefacts.WRITTEN_BY`): it lies
    below the jobs and imports none of them (issue 71: asking the registry closed a circle of eight
    modules; tests/test_imports.py). That table is the registry's, both ways (issue 53:
    ``store/artefacts.JOBS`` was a second table that nothing held to the jobs), and the registry's
    order runs a job after those whose artefacts it reads."""
    from selfspec.store import artefacts
    from selfspec.train import JOBS

    assert artefacts.WRITTEN_BY == {JOBS[name].kind: name for name in JOBS}
    assert len({JOBS[name].kind for name in JOBS}) == len(JOBS)  # one job per kind
    assert list(JOBS).index("ppd_tree") > list(JOBS).index("prompts")
    assert "job=skips" in artefacts.rebuild_hint(artefacts.Path("/x"), "skip_set")
    assert "job=<job>" in artefacts.rebuild_hint(artefacts.Path("/x"), "medusa_heads")
    assert "job=<job>" in artefacts.rebuild_hint(artefacts.Path("/x"))


def test_an_evaluation_checks_each_method_once(tmp_path, monkeypatch):
    """Issue 40: each method's options were checked twice per run (before the model loaded, then
    again when its decoder was built); the decoders are now built from the options checked first."""
    import selfspec.decoding as decoding
    import selfspec.evaluation.plan as plan
    from selfspec.config import compose
    from selfspec.evaluation import evaluate

    checked = []
    real = decoding.check_method

    def counting(cfg, *a, **k):
        checked.append(str(cfg.name))
        return real(cfg, *a, **k)

    monkeypatch.setattr(decoding, "check_method", counting)
    monkeypatch.setattr(plan, "check_method", counting)
    # profile=null: measuring a profile builds the decoders whose host work it times (ngram, PPD)
    evaluate(compose(["model=tiny-random", "n_examples=1", "max_new_tokens=4", "warmup=0", "progress=false",
                      "logger=none", "profile=null", "method=draft_verify", "method.skip_set=null", "+method.skip_attn=[1]",
                      "+method.skip_mlp=[2]"]), tmp_path / "run")
    assert sorted(checked) == ["draft_verify", "vanilla"]
