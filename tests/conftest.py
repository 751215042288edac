"""Shared fixtures: the tiny random model (fast logic tests) and the embedded SmolLM2 (slow)."""

from __future__ import annotations

import os

import pytest

import selfspec  # noqa: F401  first: it sets MKL's reproducibility mode before torch's first product
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny():
    """tiny-random: 4 Llama layers, hidden 64, SmolLM2's tokenizer."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    return load_model(model_config("tiny-random"))


@pytest.fixture(scope="session")
def smol():
    """The embedded default SmolLM2-135M-Instruct (float32, CPU)."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    return load_model(model_config("smollm2-135m"))


def cpu_like_profile(model, quantised: bool = False):
    """A cost profile of ``model``'s shape with fixed prices shaped like the 2-core CPU's (a pass of
    2, 4, 8 and 16 rows costs 1.1, 1.3, 2 and 3.5 steps): decisions priced with it are the same
    on every machine (the ``priced`` draft schedule's tests; ``method=ngram`` needs a profile).
    ``quantised``: with prices of passes over the int8 and int4 copies too (a third of the target's)."""
    from selfspec.measure.profile import FORMAT, Profile, model_shape

    rows = {"1": 1.0, "2": 1.1, "4": 1.3, "8": 2.0, "16": 3.5, "32": 6.5}
    ms = {k: v * 1e-3 for k, v in rows.items()}
    shape = model_shape(model)
    copies = {fmt: {"attention": {"0": {k: 0.0 for k in rows}, "512": {k: 0.0 for k in rows}},
                    "mlp": {k: v / 3 for k, v in ms.items()}, "head": {str(shape["vocab_size"]): {k: 0.0 for k in rows}}}
              for fmt in ("int8", "int4")} if quantised else None
    return Profile({
        "format": FORMAT, "name": "cpu-like",
        "model": {"name": model.name, "shape": shape, "linear_kernel": "skinny", "capture": "off"},
        "machine": {"device": "cpu", "hardware": "Synthetic CPU", "threads": 2, "versions": {}},
        "attention": {"0": {k: 0.0 for k in rows}, "512": {k: 0.0 for k in rows}},
        "mlp": ms, "head": {str(shape["vocab_size"]): {k: 0.0 for k in rows}}, "linear": ms,
        "warp": {w: {str(shape["vocab_size"]): {k: 0.0 for k in rows}} for w in ("0", "1")},
        "tree": {}, "pass": {}, "host": 0.0, **({"quantised": copies} if copies else {}),
    })


#: a thin measuring plan (:func:`thin_profile`): the profiler runs every stage, on few points, once each
THIN_PLAN = {"rows": (1, 2), "prefill_rows": (8,), "contexts": (0, 16), "repeats": 1}


def thin_profile(model, **kw):
    """This machine's profile of ``model`` measured on :data:`THIN_PLAN` (seconds, not profile=auto's
    minute): for tests where what is priced or kept matters, not the figures."""
    from selfspec.evaluation.profiling import measure_profile

    return measure_profile(model, **THIN_PLAN, **kw)


@pytest.fixture(scope="session")
def tiny_profile(tiny):
    """:func:`cpu_like_profile` of the tiny model."""
    return cpu_like_profile(tiny.model)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module, then torch's setting back: a reference loop runs transformers'
    forward op by op, and on the shared 2-core machine its OpenMP threads waited on each other (15x
    slower at load 8). Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def peaked_llama():
    """A random Llama whose distributions are peaked (initializer range 0.6, 256 tokens, 6 layers,
    no tokenizer), so a draft's top probability is spread around the thresholds; the tiny models'
    are all near 1/V. The reference tests of Draft & Verify, KnapSpec and CLaSp run on it."""
    from omegaconf import OmegaConf

    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    cfg = OmegaConf.merge(model_config("tiny-random"), {"tokenizer": None, "random": {
        "vocab_size": 256, "num_hidden_layers": 6, "seed": 3, "initializer_range": 0.6}})
    return load_model(cfg).model


def first_two_tokens_tv(dec, ids: list[int], sampling, n: int = 400, seed: int = 1, batch: int = 1) -> float:
    """Total variation between the first two tokens ``dec``'s steps emit after ``ids`` (a step from
    the last prompt token, then another if it emitted one token), over ``n`` draws, and the target's
    exact distribution of them, p(a)·p(b|a), under ``sampling`` (a top-k one keeps it small).
    ``batch`` > 1: the draws run as batches of that many sequences (:class:`selfspec.models.batch.Batch`),
    each with its own cache, generator and fork of ``dec``."""
    from selfspec.decoding import DecodeState
    from selfspec.decoding.sampling import warp
    from selfspec.models.batch import Batch

    m = dec.model
    with torch.inference_mode():
        p1 = warp(m.logits(m.forward(torch.tensor([ids]), None, start=0)[0, -1]), sampling)
        exact = {}
        for a in p1.nonzero().view(-1).tolist():
            p2 = warp(m.logits(m.forward(torch.tensor([ids + [a]]), None, start=0)[0, -1]), sampling)
            for b in p2.nonzero().view(-1).tolist():
                exact[(a, b)] = float(p1[a] * p2[b])
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}

    def draw(d, cache, generator, joins=None) -> tuple:
        cache.truncate(len(ids) - 1)
        state = DecodeState(list(ids), len(ids), cache, sampling, generator, joins=joins)
        d.begin(state)
        new = d.step(state, 8)
        if len(new) < 2:
            state.tokens.extend(new)
            new = new + d.step(state, 8)
        return tuple(new[:2])

    with torch.inference_mode():
        prefix = m.new_cache(len(ids) + dec.room + 16)
        m.forward(torch.tensor([ids[:-1]]), prefix, start=0)

    def primed():  # a copy of the prompt's cache, for one sequence of a batch
        cache = m.new_cache(prefix.max_length)
        cache.buffers.copy_(prefix.buffers)
        cache.lengths = list(prefix.lengths)
        return cache

    with torch.inference_mode():
        if batch == 1:
            draws = [draw(dec, prefix, gen) for _ in range(n)]
        else:
            slots = [dec.fork() for _ in range(batch)]
            together = Batch(m, batch)
            draws = together.run([lambda slot, j=j: draw(slots[slot], primed(), torch.Generator().manual_seed(seed + j),
                                                         together) for j in range(n)])
    for pair in draws:
        counts[pair] = counts.get(pair, 0) + 1
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))


@pytest.fixture
def prompt_ids(tiny):
    return tiny.tokenizer("Article: The quick brown fox jumps over the lazy dog.\nSummary:")["input_ids"]


def method_config(name: str, **overrides):
    """``conf/method/<name>.yaml`` as composed (every key set there, nowhere else) with ``overrides``
    on top, as a plain (non-struct) config so that a test may also add a key the method refuses."""
    from selfspec.config import method_config as composed

    return composed(name, **overrides)


def decoding_keys(name: str, keys) -> dict:
    """The checked ``keys`` of ``conf/method/<name>.yaml``, for a decoder built directly."""
    from selfspec.decoding import check_method

    options = check_method(method_config(name))
    return {k: getattr(options, k) for k in keys}


def method_options(name: str, **overrides):
    """The checked options of ``conf/method/<name>.yaml`` with ``overrides`` (:func:`method_config`),
    for a decoder built directly from its record."""
    from selfspec.decoding import check_method

    return check_method(method_config(name, **overrides))


def draft_stop(rule: str, **keys) -> dict:
    """A ``draft_stop`` sub-config: ``conf/method/draft_stop/<rule>.yaml`` (where each rule's defaults
    are written) with ``keys`` on top, as plain data."""
    from omegaconf import OmegaConf

    from selfspec.config import conf_dir

    return {**OmegaConf.to_container(OmegaConf.load(conf_dir() / "method" / "draft_stop" / f"{rule}.yaml")), **keys}


def adaptive_rule(**keys):
    """A fresh :class:`~selfspec.decoding.draft_exit.AdaptiveThreshold` of :func:`draft_stop`'s adaptive
    sub-config with ``keys`` on top."""
    from selfspec.decoding.draft_exit import AdaptiveStop

    return AdaptiveStop.read(draft_stop("adaptive", **keys), "method.draft_stop").rule()


#: PPD's decoding keys as conf/method/ppd.yaml sets them (no context drafts)
PPD_KEYS = {**decoding_keys("ppd", ("posterior_threshold", "posterior_alpha", "state_zero")), "ngram": None}
#: Draft & Verify's options as conf/method/draft_verify.yaml sets them (a decoder built directly takes the record)
DV_OPTIONS = method_options("draft_verify")


def flip_last_byte(path) -> None:
    """Change the last byte of ``path`` in place, keeping its size and restoring its modification
    time (a damaged file that a size and time check would not notice)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def hf_greedy(loaded, ids, n):
    """Reference: transformers' own greedy generate, exactly n new tokens (no EOS stop)."""
    out = loaded.model.hf.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids):].tolist()


#: the five training jobs in a few steps each (``train_every_job``): job -> overrides
SMALL_JOBS = {
    "heads": {"task": "gsm8k", "job.n_prompts": 3, "job.n_heldout": 1, "job.gen_tokens": 6, "job.steps": 2,
              "job.eval_every": 0, "job.max_prompt_tokens": 48, "job.layers": "[1,2]"},
    "prompts": {"job.steps": 2, "job.n_conversations": 6, "job.held_out": 2, "job.context_length": 48,
                "job.inserts": 4, "job.eval_inserts": 4},
    "ppd_tree": {"job.n_prompts": 2, "job.max_new_tokens": 10, "job.sizes": "[1,3,5]",
                 "job.plot": "false"},
    "skips": {"task": "xsum", "job.n_prompts": 2, "job.max_new_tokens": 8, "job.max_prompt_tokens": 48,
              "job.iterations": 2, "job.probe_fractions": "[0.5]", "job.plot": "false",
              "+job.decoding.max_draft": 4},
    "draft_vocab": {"task": "gsm8k", "job.n_prompts": 3, "job.n_heldout": 2, "job.gen_tokens": 8,
                    "job.max_prompt_tokens": 48, "job.size": 12},
}
#: where each job's artefact goes under the folder ``train_every_job`` writes into
JOB_DIRS = {"heads": "h", "prompts": "p", "ppd_tree": "t", "skips": "s", "draft_vocab": "v"}


def train_every_job(model: str, out, loaded=None, profile=None, **changes) -> None:
    """Run the five training jobs (:data:`SMALL_JOBS`, with ``changes`` ``{job: {key: value}}`` on
    top) on ``model`` into ``out/<JOB_DIRS[job]>``; each must write its artefact. ``profile``: a
    profile file the jobs price with (default: train.yaml's ``auto``, this machine's, measured once
    into the asset cache when it is not there)."""
    from selfspec.config import compose
    from selfspec.train import run_job

    for job, overrides in SMALL_JOBS.items():
        args = {**overrides, **changes.get(job, {}), "artefact_dir": out / JOB_DIRS[job]}
        if profile is not None:
            args["profile"] = profile
        if job == "ppd_tree":
            args["job.prompts"] = out / JOB_DIRS["prompts"]
        summary = run_job(compose([f"model={model}", "progress=false", f"job={job}",
                                   *(f"{k}={v}" for k, v in args.items())], "train"), loaded)
        assert summary["artefact"], job


def methods_with_artefacts(out) -> list:
    """A method config reading each artefact :func:`train_every_job` wrote into ``out``."""
    return [method_config("adadecode", heads_dir=str(out / "h"), threshold=0.0),
            method_config("ppd", prompts=str(out / "p"), tree=str(out / "t"), never_slower=False),
            method_config("draft_verify", skip_set=str(out / "s"), never_slower=False),
            method_config("del", draft_vocab=str(out / "v"), never_slower=False)]


def rolled_back_steps(dec, ids, steps: int = 8, budget: int = 60) -> int:
    """Prefill ``ids`` and drive ``dec.step`` by hand; after each step every layer must hold exactly
    the full model's K/V of the committed tokens but the pending one (drafts' scratch K/V and
    rejected positions rolled back). Returns how many drafts were rejected."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.base import DecodeState

    model = dec.model
    state = DecodeState(list(ids), len(ids), model.new_cache(200), Sampling(), None)
    rejected = 0
    with torch.inference_mode():
        dec.begin(state)
        dec._commit(state, [dec.prefill(state, torch.tensor([ids]))], budget)
        for _ in range(steps):
            new = dec.step(state, budget)
            rejected += state.drafted - (len(new) - 1)
            dec._commit(state, new, budget)
            ref = model.new_cache(200)
            model.forward(torch.tensor([state.tokens[:-1]]), ref, start=0)
            for i in range(model.num_layers):
                assert state.cache.length(i) == state.n_cached
                torch.testing.assert_close(state.cache.layer_kv(i), ref.layer_kv(i), atol=1e-5, rtol=1e-4)
    return rejected


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The demo's whole pipeline once per session, reduced: tiny-random, ``--small``, every task, W&B
    offline. ``out``: its outputs root (artefacts, runs); ``run_dir``: ``out/demo/<time>`` (train,
    eval, runtime, report); ``printed``: its stdout lines."""
    import contextlib
    import io
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("demo")
    out = root / "outputs"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        # the demo points every default artefact path at --out and logs to W&B offline; restored after
        mp.setenv("SELFSPEC_OUTPUTS", str(out))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.chdir(root)
        mp.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
        import demo

        try:
            with contextlib.redirect_stdout(printed):
                code = demo.main(["--model", "tiny-random", "--small", "--out", str(out), "--logger", "wandb"])
        finally:
            sys.modules.pop("demo", None)
    assert code == 0, printed.getvalue()
    (run_dir,) = (out / "demo").iterdir()
    return SimpleNamespace(out=out, run_dir=run_dir, printed=printed.getvalue().strip().splitlines())
