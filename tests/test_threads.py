"""The thread policy (selfspec.decoding.threads): a decoding step's outputs do not depend on the
thread count it ran on, the policy follows the steps' measured cost, the prompt's prefill keeps
the configured count, and ``threads`` is checked before a model loads."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import cpu_like_profile, method_config
from selfspec import numerics
from selfspec.config.checks import ConfigError
from selfspec.decoding import build_decoder, threads as threads_module
from selfspec.decoding.threads import ThreadPolicy, why_not_adaptive
from selfspec.decoding.vanilla import Vanilla
from selfspec.models.layered import LayeredModel

#: methods that need no trained artefact, each drafting on a peaked random model
METHODS = [
    {"name": "vanilla"},
    {"name": "draft_verify", "skip_attn": [1], "skip_mlp": [1], "max_draft": 4, "never_slower": False},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "never_slower": False},
    {"name": "del", "max_draft": 4, "cost_model": "parameters", "never_slower": False},
    {"name": "adadecode", "head_kind": "lm_head", "layers": [1], "threshold": 0.3},
    {"name": "ngram", "never_slower": False},
]
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42, 8, 61, 200, 13] * 2


@pytest.fixture(scope="module")
def wide():
    """A random Llama as wide as SmolLM2 (hidden 576, 9 heads, 3 KV heads, MLP 1536), 3 layers and
    a 4096-token vocabulary: wide enough that every operator splits its work between threads."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
                                      tie_word_embeddings=True))
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(30)  # peaked distributions: drafts get accepted
    return LayeredModel(hf.float(), name="wide-random", linear_kernel="auto")


def _decoder(model, method, **kw):
    kw.setdefault("profile", cpu_like_profile(model))  # the n-gram lookup's priced schedule needs one
    return build_decoder(method_config(method["name"], **{k: v for k, v in method.items() if k != "name"}), model, **kw)


class Alternate:
    """Arms that take turns, whatever the timings: every other step on one thread."""

    cost = {True: 9.0, False: 1.0}  # as under contention, so the policy consults the arms
    preferred = False
    probing = False

    def __init__(self) -> None:
        self._turns = itertools.cycle([True, False])

    def choose(self) -> bool:
        return next(self._turns)

    def record(self, arm, units, seconds) -> None:
        pass


class FlatProfile:
    """A profile that prices every step at one second."""

    def price(self, ops) -> float:
        return 1.0


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two CPU threads")
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["name"])
def test_a_generation_is_the_same_on_one_thread_two_and_alternating(wide, method):
    configured = torch.get_num_threads()
    runs = {}
    try:
        for label, n in (("one", 1), ("two", 2)):
            torch.set_num_threads(n)
            g = _decoder(wide, method).generate(PROMPT, 24)
            runs[label] = (g.tokens, [s.row() for s in g.trace])
        torch.set_num_threads(2)
        policy = ThreadPolicy(FlatProfile(), threads=2, arms=Alternate())
        dec = _decoder(wide, method)
        dec.threads = policy
        g = dec.generate(PROMPT, 24)
        runs["alternating"] = (g.tokens, [s.row() for s in g.trace])
        assert g.stats.get("steps_one_thread", 0) >= len(g.trace) // 2 - 1
        assert torch.get_num_threads() == 2  # the configured count is back after the generation
    finally:
        torch.set_num_threads(configured)
    assert runs["one"] == runs["two"] == runs["alternating"]
    if method["name"] != "vanilla":
        assert sum(r["drafted"] for r in runs["one"][1] if r.get("drafted")) > 0, "nothing drafted: no verification ran"


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two CPU threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_passes_give_the_same_bits_on_one_thread_and_two(wide, dtype):
    """Every pass a decoding step makes (1..32 rows after a context), and its logits, bit for bit."""
    model = LayeredModel(wide.hf.to(dtype), name="wide-random", linear_kernel="auto")
    ids = torch.randint(0, 4096, (1, 120), generator=torch.Generator().manual_seed(1))
    configured = torch.get_num_threads()

    def passes(n_threads):
        torch.set_num_threads(n_threads)
        out = []
        with torch.inference_mode():
            for k in (1, 3, 8, 32):
                cache = model.new_cache(160)
                model.forward(ids[:, :80], cache)
                out.append(model.logits(model.forward(ids[:, 80:80 + k], cache)))
        return out

    try:
        one, two = passes(1), passes(2)
    finally:
        torch.set_num_threads(configured)
        wide.hf.float()
    assert all(torch.equal(a, b) for a, b in zip(one, two))


MKL = pytest.mark.skipif(numerics.mode() is None, reason="torch has no MKL here (its GEMM's mode is MKL's)")


def _run(code: str, **env) -> str:
    """``code`` in a fresh interpreter with ``env`` (None: removed), its stdout."""
    full = {k: v for k, v in os.environ.items() if k != numerics.VARIABLE}
    full.update({k: v for k, v in env.items() if v is not None})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@MKL
def test_mkl_runs_strict_once_selfspec_is_imported():
    """The prefill's GEMM is MKL's, whose bits depend on the thread count on Intel Xeons (AVX-512)
    unless its reproducibility mode is strict: importing selfspec asks for it before MKL's first
    call, and every run records the mode MKL runs."""
    from selfspec.store.runinfo import hardware

    assert numerics.mode() == numerics.DEFAULT == "AUTO,STRICT"
    assert numerics.thread_dependence() is None
    assert hardware(None)["mkl_cbwr"] == "AUTO,STRICT" and hardware(None)["cpu_capability"]
    assert _run("import torch, selfspec.numerics as n; print(n.mode())") == "AUTO,STRICT"


def _cpu_vendor() -> str:
    """The CPU's vendor as the kernel names it (``GenuineIntel``, ``AuthenticAMD``), "" where unknown."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")


#: the branch MKL reports for ``MKL_CBWR=AVX2`` on each vendor: its own on Intel's CPUs; on AMD's
#: (EPYC Zen 3, AVX2; Zen 4, AVX-512) MKL takes its automatic path and reports AUTO (issue 52)
AVX2_BRANCH = {"GenuineIntel": "AVX2", "AuthenticAMD": "AUTO"}


@MKL
def test_a_mode_the_user_set_is_kept_and_adaptive_threads_refused_under_it():
    """A user's MKL_CBWR is never replaced; one that is not strict is reported (as MKL runs it: on an
    AMD CPU, MKL runs ``AVX2`` as AUTO), and the policy that switches thread counts refuses to run
    under it, naming the setting to change, on every vendor."""
    vendor = _cpu_vendor()
    if vendor not in AVX2_BRANCH:
        pytest.skip(f"MKL's branch for MKL_CBWR=AVX2 is not known for CPU vendor {vendor!r}")
    branch = AVX2_BRANCH[vendor]
    code = ("import os, torch, selfspec\nfrom selfspec.decoding.threads import why_not_adaptive\n"
            "print(os.environ['MKL_CBWR'], selfspec.numerics.mode(), '|', "
            "why_not_adaptive(torch.device('cpu'), object()))")
    out = _run(code, MKL_CBWR="AVX2", OMP_NUM_THREADS="2")
    assert out.startswith(f"AVX2 {branch} | ")
    assert f"MKL runs in the numerical reproducibility mode {branch!r}, not a strict one" in out
    assert "switches thread counts mid-generation" in out and "MKL_CBWR=AVX2: unset it or set MKL_CBWR=AUTO,STRICT" in out
    assert _run(code, MKL_CBWR="AVX2,STRICT", OMP_NUM_THREADS="2") == f"AVX2,STRICT {branch},STRICT | None"


@MKL
def test_mkl_that_ran_before_selfspec_was_imported_is_reported():
    """MKL fixes its mode at its first call: a product before ``import selfspec`` leaves it off,
    and the report says to import selfspec first."""
    out = _run("import torch\ntorch.ones(64, 64) @ torch.ones(64, 64)\nimport selfspec.numerics as n\n"
               "print(n.mode(), '|', n.thread_dependence())")
    assert out.startswith("OFF | MKL runs in the numerical reproducibility mode 'OFF'")
    assert "import selfspec before the first matrix product" in out


def _timed_steps(tiny, monkeypatch, one: float, configured_cost, prompts: int = 2):
    """Generations under a fake clock: a step takes ``one`` seconds on one thread and
    ``configured_cost`` on the configured count (each step priced at 1 s; a callable: of the
    number of steps so far). Returns the generations, the policy and the thread counts the
    prefills ran on; the thread count of every step, in order, is in ``policy.seen``."""
    clock = [0.0]
    taken = [0]
    seen = []
    monkeypatch.setattr(threads_module.time, "perf_counter", lambda: clock[0])
    seen_prefill = []

    class Timed(Vanilla):
        def prefill(self, state, prompt):
            seen_prefill.append(torch.get_num_threads())
            return super().prefill(state, prompt)

        def step(self, state, budget):
            cost = configured_cost(taken[0]) if callable(configured_cost) else configured_cost
            clock[0] += one if torch.get_num_threads() == 1 else cost
            taken[0] += 1
            seen.append(torch.get_num_threads())
            return super().step(state, budget)

    policy = ThreadPolicy(FlatProfile())
    policy.seen = seen
    dec = Timed(tiny.model, threads=policy)
    configured = torch.get_num_threads()
    try:
        return [dec.generate([1, 2, 3, 4], 100) for _ in range(prompts)], policy, seen_prefill
    finally:
        torch.set_num_threads(configured)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two CPU threads")
def test_a_quiet_machine_never_tries_one_thread(tiny, monkeypatch):
    """Steps on the configured count as fast as the profile predicts (or up to ``slack`` slower):
    no sign of contention, so no step is spent probing one thread."""
    for ratio in (1.0, 1.2):
        g, policy, _ = _timed_steps(tiny, monkeypatch, one=1.5, configured_cost=ratio)
        assert sum(x.stats.get("steps_one_thread", 0) for x in g) == 0
        assert policy.arms.cost[False] is None


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two CPU threads")
def test_the_policy_follows_the_measured_cost_and_prefills_on_the_configured_count(tiny, monkeypatch):
    """Fake clock: a step on one thread takes 1 s, on the configured count 2 s (a loaded machine).
    The policy moves to one thread, probes the configured count now and then, and every prefill
    runs on the configured count."""
    configured = torch.get_num_threads()
    g, policy, seen_prefill = _timed_steps(tiny, monkeypatch, one=1.0, configured_cost=2.0)
    one = sum(x.stats.get("steps_one_thread", 0) for x in g)
    steps = sum(len(x.trace) - 1 for x in g)  # the steps after each prefill
    assert one >= 0.9 * steps, (one, steps)  # one thread is cheaper here: nearly every step takes it
    assert one < steps  # and the configured count is probed
    assert not policy.arms.preferred
    assert seen_prefill == [configured, configured]
    assert torch.get_num_threads() == configured


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two CPU threads")
def test_after_a_burst_of_load_the_policy_comes_back_to_the_configured_count(tiny, monkeypatch):
    """Fake clock: the configured count costs 3 s a step for the first 150 steps (another job ran),
    then 1 s again, against 1.5 s on one thread. The policy goes to one thread during the burst
    and is back on the configured count within one probe interval of the burst's end."""
    _, policy, _ = _timed_steps(tiny, monkeypatch, one=1.5, configured_cost=lambda n: 3.0 if n < 150 else 1.0,
                                prompts=4)
    one = [n == 1 for n in policy.seen]
    assert sum(one[:150]) > 120  # the burst moved it to one thread
    assert policy.arms.preferred and policy.arms.cost[True] <= 1.25
    # back within one probe interval (at most max_interval = 64 steps) and the probe's 2 steps
    back = one.index(False, 150)
    assert back <= 150 + 64 + 2 and not any(one[back:]), back


def test_threads_is_checked_before_the_model_loads(tmp_path):
    from selfspec.config import compose
    from selfspec.evaluation.plan import _check_run_options

    with pytest.raises(ConfigError, match="threads"):
        _check_run_options(compose(["model=tiny-random", "threads=some"]))
    with pytest.raises(ConfigError, match=r"threads.*profile"):
        _check_run_options(compose(["model=tiny-random", "threads=adaptive", "profile=null"]))
    assert why_not_adaptive(torch.device("cuda"), FlatProfile()).startswith("it chooses CPU threads")
    assert why_not_adaptive(torch.device("cpu"), None) is not None


def test_adaptive_threads_are_refused_where_the_wide_product_depends_on_the_thread_count(monkeypatch):
    """oneDNN promises the same bits at one thread count only: the policy, which runs a prefill-wide
    pass (PPD's larger trees) on either count, is refused where a product differs on 1 and N threads."""
    from selfspec.models import kernels

    if torch.get_num_threads() < 2:
        pytest.skip("one thread here: nothing to switch")
    assert kernels.wide_thread_dependence(torch.get_num_threads()) is None  # every CPU the tests ran on
    assert why_not_adaptive(torch.device("cpu"), FlatProfile()) is None
    real = kernels.wide_linear
    monkeypatch.setattr(kernels, "wide_linear", lambda x, w, b=None: real(x, w, b) + (torch.get_num_threads() > 1))
    kernels.wide_thread_dependence.cache_clear()
    try:
        why = why_not_adaptive(torch.device("cpu"), FlatProfile())
    finally:
        kernels.wide_thread_dependence.cache_clear()
    assert why is not None and "oneDNN" in why and "1 and" in why
