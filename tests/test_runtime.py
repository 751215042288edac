"""The shared runtime: the skinny linear kernel, the cost model and the runtime benchmark."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from selfspec.measure.costs import CostCurve, context_cache, time_forward, weight_bytes
from selfspec.models import kernels

ROOT = Path(__file__).resolve().parents[1]

needs_kernel = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                  reason="the skinny kernel needs AVX2")


@needs_kernel
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (192, 64), (40, 8), (1001, 64)])
def test_skinny_linear_matches_torch(shape):
    kernels.load()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g)
    for rows in (1, 2, 3, 5, 8, 13, 32):
        x = torch.randn(1, rows, shape[1], generator=g)
        torch.testing.assert_close(kernels.skinny_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_rows_are_bit_identical_to_one_row_calls(dtype):
    """Row i of a k-row product equals the 1-row product of row i exactly, for every k: a
    verification pass sees the linear outputs one-token decoding would (bfloat16: also a prefill
    longer than MAX_ROWS, which takes the kernel too)."""
    kernels.load()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(999, 576, generator=g).to(dtype)  # odd: the last weight row of a task is a tile of its own
    x = torch.randn(40, 576, generator=g).to(dtype)
    singles = torch.cat([kernels.skinny_linear(x[i:i + 1], w) for i in range(40)])
    for k in (2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 32, 40):
        assert torch.equal(kernels.skinny_linear(x[:k], w), singles[:k]), k


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_avx512_path_is_bit_identical_to_avx2(dtype):
    """The AVX-512 path (chosen at runtime where the CPU has AVX-512) gives exactly the AVX2 path's
    bits: K not a multiple of 16 (584), N odd and not a multiple of the 8-row tile, 1..32 rows
    (bfloat16: the path that widens to float32)."""
    kernels.load()
    isa = torch.ops.selfspec.skinny_isa
    if isa("auto") != "avx512":
        pytest.skip("no AVX-512 on this CPU: the AVX-512 path of the skinny kernel cannot run")
    g = torch.Generator().manual_seed(4)
    torch.ops.selfspec.skinny_bf16("widen")
    try:
        for n, k in ((999, 576), (1001, 584), (13, 64), (3, 8), (7, 1544)):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(32, k, generator=g).to(dtype)
            for rows in (1, 2, 5, 6, 7, 12, 13, 32):
                assert isa("avx2") == "avx2"
                ref = kernels.skinny_linear(x[:rows], w)
                assert isa("avx512") == "avx512"
                assert torch.equal(kernels.skinny_linear(x[:rows], w), ref), (n, k, rows)
    finally:
        isa("auto")
        torch.ops.selfspec.skinny_bf16("auto")


@needs_kernel
def test_the_avx512_crossover_is_this_cpus_and_recorded():
    """``auto`` takes the float32 kernel's AVX-512 path on an AMD family 25 (a Zen 4: its AVX2 path's 5- and
    6-row blocks run at their arithmetic's speed, and its tiles reread long x rows) from 5 rows and over
    weights of 1,024 columns or more, elsewhere from 7 rows, read against /proc/cpuinfo; the crossover is
    part of the kernels' paths (a profile's machine), can be moved and restored, refuses nonsense, and
    leaves every row's bits as one-row calls give them on either side of it."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    first = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.split("\n\n")[0].splitlines()))
    if "vendor_id" not in first:
        pytest.skip("no /proc/cpuinfo to read the CPU's vendor and family from")
    kernels.load()
    crossover = torch.ops.selfspec.skinny_crossover
    zen4 = first["vendor_id"] == "AuthenticAMD" and int(first["cpu family"]) == 25
    expected = [5, 1024] if zen4 else [7, 0]
    assert crossover(0, 0) == expected
    assert kernels.paths()["float32_avx512_from"] == {"rows": expected[0], "columns": expected[1] or None}
    g = torch.Generator().manual_seed(5)
    try:
        assert crossover(2, -2) == [2, 0] and kernels.paths()["float32_avx512_from"] == {"rows": 2, "columns": None}
        assert crossover(0, 600) == [2, 600]
        for columns in (584, 1032):  # below and above the column rule
            w, x = torch.randn(301, columns, generator=g), torch.randn(9, columns, generator=g)
            singles = torch.cat([kernels.skinny_linear(x[i:i + 1], w) for i in range(9)])
            for k in range(2, 10):
                assert torch.equal(kernels.skinny_linear(x[:k], w), singles[:k]), (columns, k)
        with pytest.raises(RuntimeError, match="skinny_crossover: rows >= 1"):
            crossover(-2, 0)
        with pytest.raises(RuntimeError, match="skinny_crossover: k >= 1"):
            crossover(0, -3)
    finally:
        assert crossover(-1, -1) == expected


@needs_kernel
def test_the_kernel_paths_benchmark_times_single_linears(capsys):
    """``scripts/bench_kernel_paths.py --linears`` (where the crossover lies per shape) prints a cell per shape and
    row count with each path's time, and refuses a shape the kernel cannot take and a path it does not time."""
    spec = importlib.util.spec_from_file_location("bench_kernel_paths", ROOT / "scripts" / "bench_kernel_paths.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--linears", "24x64,8x32", "--paths", "float32:auto,float32:avx2", "--ks", "1,3", "--rounds", "1",
            "--repeats", "1", "--stream-mb", "0.02"]
    before = kernels.paths()
    assert bench.main(args) == 0
    assert kernels.paths() == before  # the paths set back as a run takes them
    lines = capsys.readouterr().out.splitlines()
    assert "medians, ms: auto / avx2" in lines[0]
    assert lines[1].split() == ["out", "x", "in", "1", "rows", "3", "rows"]
    for line, shape in zip(lines[2:], ("24x64", "8x32")):
        cells = line.split()
        times = [float(c) for c in cells[1:] if c != "/"]  # "a / b" per row count: one time per path
        assert cells[0] == shape and len(cells) == 7 and len(times) == 4 and min(times) > 0
    with pytest.raises(SystemExit, match="not OUTxIN"):
        bench.main(["--linears", "24x60"])
    with pytest.raises(SystemExit, match="skinny kernel's float32 paths"):
        bench.main(["--linears", "24x64", "--paths", "float32:torch"])


#: the paths of a bfloat16 linear (csrc/bf16_dot.h): widening to float32, VDPBF16PS, AMX tiles, and
#: the AMX path's code with its tile instructions done in software (any CPU with AVX-512-BF16)
BF16_PATHS = ("widen", "avx512_bf16", "amx", "amx_emulated")


@contextlib.contextmanager
def bf16_path(path: str):
    """bfloat16 products by ``path`` inside the block (skipped, with the reason, where this CPU cannot
    run it), ``auto`` after."""
    kernels.load()
    try:
        assert torch.ops.selfspec.skinny_bf16(path) == path
    except RuntimeError as err:
        pytest.skip(str(err).splitlines()[0])
    try:
        yield
    finally:
        torch.ops.selfspec.skinny_bf16("auto")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel lists them (/proc/cpuinfo), or an empty set."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


@needs_kernel
@pytest.mark.parametrize("path", BF16_PATHS)
def test_bfloat16_path_rows_are_one_row_calls_and_accumulate_in_float32(path):
    """On every bfloat16 path this CPU has, row i of an M-row product equals the one-row product of
    row i bit for bit, for M from 2 to 65 (past MAX_ROWS: a prefill takes the kernel too), and the
    products are the float32 sums of the bfloat16 values, rounded once. Shapes: K a multiple of 32
    and not (584, 40: the dot-product paths' masked last block; the AMX path then takes VDPBF16PS
    for the whole product), N not a multiple of a task's rows or of 16 (AMX's leftover rows)."""
    g = torch.Generator().manual_seed(7)
    with bf16_path(path):
        for n, k in ((999, 576), (1001, 584), (64, 1536), (70, 64), (13, 40), (3, 8)):
            w = torch.randn(n, k, generator=g).to(torch.bfloat16)
            x = torch.randn(65, k, generator=g).to(torch.bfloat16)
            singles = torch.cat([kernels.skinny_linear(x[i:i + 1], w) for i in range(65)])
            exact = x.double() @ w.double().T
            torch.testing.assert_close(singles.double(), exact, rtol=2 ** -7, atol=1e-4)
            for rows in (2, 3, 7, 8, 9, 16, 17, 32, 33, 65):
                assert torch.equal(kernels.skinny_linear(x[:rows], w), singles[:rows]), (n, k, rows)


def kernel_supports_tile_data() -> bool:
    """Whether Linux supports AMX tile data for processes (arch_prctl ARCH_GET_XCOMP_SUPP: bit 18,
    XTILEDATA), asked directly through libc."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    return libc.syscall(158, 0x1021, ctypes.byref(mask)) == 0 and bool(mask.value & (1 << 18))  # SYS_arch_prctl


@needs_kernel
def test_auto_takes_the_fastest_bfloat16_path_the_cpu_has():
    """``auto`` takes AMX where the CPU lists AMX-BF16 and Linux supports tile data (the kernel
    grants it on request), else VDPBF16PS where the CPU lists AVX-512-BF16, else widens: read
    against /proc/cpuinfo and arch_prctl."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU's features from")
    kernels.load()
    amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags and kernel_supports_tile_data()
    expected = ("amx" if amx else "avx512_bf16" if {"avx512_bf16", "avx512bw", "avx512dq"} <= flags else "widen")
    assert torch.ops.selfspec.skinny_bf16("auto") == expected
    with pytest.raises(RuntimeError, match=r"skinny_bf16: \"auto\", \"widen\".*got \"fast\""):
        torch.ops.selfspec.skinny_bf16("fast")


@needs_kernel
def test_skinny_bfloat16_accumulates_in_float32():
    """bfloat16 weights and activations (on this CPU's path) accumulate in float32 and round once:
    within one bfloat16 rounding of the float32 product of the same values."""
    kernels.load()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(192, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 5, 64, generator=g).to(torch.bfloat16)
    y = kernels.skinny_linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2 ** -8, atol=1e-5)


@needs_kernel
def test_kernels_run_on_torchs_openmp_threads():
    """The kernels are compiled with OpenMP, so ``at::parallel_for`` runs on torch's threads (built
    without it, they ran on one thread whatever ``torch.set_num_threads`` said), and the library
    shares the OpenMP runtime torch loaded instead of starting a second thread pool."""
    kernels.load()
    libs = list(kernels._build_dir().glob("*.so"))
    assert libs and all(b"GOMP_parallel" in lib.read_bytes() for lib in libs)
    if Path("/proc/self/maps").exists():  # a fresh process: other libraries (scikit-learn) vendor their own
        code = ("import torch; from selfspec.models import kernels; kernels.load(); "
                "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len(eval(proc.stdout.strip().splitlines()[-1])) == 1, proc.stdout


needs_onednn = pytest.mark.skipif(kernels.wide_path() != "onednn", reason="this torch has no oneDNN matmul")


@needs_kernel
@needs_onednn
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (1536, 8960), (4000, 576), (64, 64), (40, 8)])
def test_wide_float32_passes_take_onednn_with_rows_and_threads_apart(shape):
    """A float32 pass of more than MAX_ROWS rows (the prompt's prefill) is oneDNN's matmul, close to
    torch's; each row's bits are the same in passes of other row counts and on one thread and two
    (the thread policy runs a wide pass on either): the bits the runtime's arithmetic promises."""
    kernels.load()
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    x = torch.randn(1, 300, shape[1], generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = kernels.linear(x, w, b)
        assert torch.equal(full, kernels.wide_linear(x, w, b))
        torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-4, atol=1e-3)
        for rows in (33, 40, 64, 129):
            assert torch.equal(kernels.linear(x[:, :rows], w, b), full[:, :rows]), rows
        torch.set_num_threads(1)
        for rows in (33, 300):
            assert torch.equal(kernels.linear(x[:, :rows], w, b), full[:, :rows]), rows
    finally:
        torch.set_num_threads(threads)
    assert kernels.paths()["float32_wide"] == "onednn"


@needs_kernel
@needs_onednn
def test_wide_passes_keep_autograd_and_torch_kernel_on_torchs_gemm(monkeypatch):
    """A product that needs a gradient (PPD's prompt training) or a model on ``linear_kernel=torch``
    stays on ``F.linear``: oneDNN's call records no backward."""
    calls = []
    monkeypatch.setattr(kernels, "wide_linear", lambda *a: calls.append(1) or F.linear(*a))
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(40, 8)
    kernels.linear(x, w).sum().backward()
    assert calls == []
    kernels.linear(x, w.detach(), skinny=False)
    assert calls == []
    kernels.linear(x, w.detach())
    assert calls == [1]


@needs_kernel
@needs_onednn
def test_bench_prefill_script_times_both_libraries():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_prefill.py"), "--model", "tiny-random",
                           "--task", "humaneval", "--n", "1", "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("humaneval")]
    assert rows == ["torch", "onednn"], proc.stdout


def test_kernel_choice_is_refused_or_explained():
    with pytest.raises(ValueError, match=r"model.linear_kernel='fast' is not one of auto, skinny, torch"):
        kernels.resolve("fast", torch.device("cpu"), torch.float32)
    with pytest.raises(kernels.KernelUnavailable, match=r"linear_kernel=skinny: .*float32 or bfloat16.*float16"):
        kernels.resolve("skinny", torch.device("cpu"), torch.float16)
    assert kernels.resolve("auto", torch.device("cpu"), torch.float16) == "torch"
    assert kernels.resolve("torch", torch.device("cpu"), torch.float32) == "torch"


@pytest.mark.slow
@needs_kernel
def test_kernel_builds_are_shared_between_checkouts_once_per_environment_and_never_wait_on_a_dead_build(tmp_path):
    """Issue 20. Reproduction (before): two checkouts sharing one ``SELFSPEC_CACHE`` rebuilt the
    kernels on every switch (torch's build file records the sources' absolute paths), and a build
    killed midway left torch's ``lock`` file, on which every later process slept silently until it
    was 10 minutes old. Issue 52's probe: two venvs sharing one cache rebuilt them on every switch
    too (12 full rebuilds in an hour): the folder was named by the sources, torch's version and the
    flags, but torch's builder writes the venv's include and library paths into its build file.
    Now: one build serves both checkouts, a link to the cache and a process with another ``ninja``
    first on its ``PATH`` (:func:`~selfspec.models.kernels._own_ninja`), a leftover ``lock`` is no obstacle,
    a process that finds a build in progress says what it waits for, and each environment has its
    own folder, built once: switching environments four times builds twice. The processes build a
    one-function stand-in for the kernels' sources through the same :func:`~selfspec.models.kernels.load`
    (folder, lock, staging, ninja and torch's builder are what is tested, and the real sources took
    ~40 s a build, twice: 118 s of the test; every other test builds and runs those)."""
    import shutil
    import threading

    cache = tmp_path / "cache"
    checkouts = []
    for name in ("a", "b"):
        shutil.copytree(Path(kernels.__file__).parents[1], tmp_path / name / "selfspec",
                        ignore=shutil.ignore_patterns("__pycache__"))
        checkouts.append(tmp_path / name)
    tools = os.path.dirname(sys.executable)  # where ninja is, for the second environment
    env = {**os.environ, "SELFSPEC_CACHE": str(cache), "PATH": f"{tools}:{os.environ.get('PATH', '')}"}
    stand_in = tmp_path / "stand_in.cpp"
    stand_in.write_text("extern \"C\" int selfspec_stand_in() { return 1; }\n")
    load = ("import logging, pathlib; logging.basicConfig(); from selfspec.models import kernels; "
            f"kernels.SOURCES, kernels.HEADERS = (pathlib.Path({str(stand_in)!r}),), (); kernels.load(); "
            "print(kernels._build_dir())")

    def build(checkout, timeout=600, python=sys.executable, **extra):
        return subprocess.run([python, "-c", load], env={**env, "PYTHONPATH": str(checkout), **extra},
                              capture_output=True, text=True, timeout=timeout, check=True)

    build(checkouts[0])
    (library,) = cache.glob("kernels/skinny-*/selfspec_skinny.so")
    built = library.stat().st_mtime_ns
    build(checkouts[1], timeout=120)  # the other checkout: no rebuild
    assert library.stat().st_mtime_ns == built
    # the same cache through a symbolic link (found 2026-12-02: the Slurm test's jobs, whose cache
    # links the machine's, rebuilt the kernels the test's own process had built, and back): no rebuild
    (tmp_path / "linked").symlink_to(cache)
    build(checkouts[1], timeout=120, SELFSPEC_CACHE=str(tmp_path / "linked"))
    assert library.stat().st_mtime_ns == built
    # another ninja first on PATH (found 2026-12-02: Debian's 1.11 and the environment's 1.13 keep
    # build logs of other formats, and each rebuilt everything the other had built): not run
    other = tmp_path / "other-ninja"
    other.mkdir()
    (other / "ninja").write_text(f"#!/bin/sh\ntouch {other / 'ran'}\nexit 1\n")
    (other / "ninja").chmod(0o755)
    build(checkouts[1], timeout=120, PATH=f"{other}{os.pathsep}{env['PATH']}")
    assert not (other / "ran").exists() and library.stat().st_mtime_ns == built
    (library.parent / "lock").touch()  # what a build killed midway leaves
    build(checkouts[0], timeout=120)
    assert library.stat().st_mtime_ns == built and not (library.parent / "lock").exists()
    # a build in progress (the lock held until the waiting process has said so): it is named
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from selfspec.store.locks import hold\n"
                               f"with hold({str(library.parent / 'selfspec-build.lock')!r}, 'x'):\n"
                               "    print('held', flush=True); sys.stdin.readline()"],
                              env={**env, "PYTHONPATH": str(checkouts[1])}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    release = threading.Timer(120, holder.stdin.close)  # a waiter that never says so fails, not hangs
    release.start()
    waiter = subprocess.Popen([sys.executable, "-c", load], env={**env, "PYTHONPATH": str(checkouts[0])},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = None
    for line in iter(waiter.stderr.readline, ""):
        if f"waiting for pid {holder.pid}" in line:
            said = line
            break
    release.cancel()
    holder.stdin.close()  # the build in progress ends
    holder.wait(timeout=60)
    waiter.communicate(timeout=120)
    assert said and waiter.returncode == 0 and library.stat().st_mtime_ns == built
    # a second environment on the same cache: its own folder, built once; switching back and forth
    # builds nothing more, and the first environment's build is still the one made above
    second = str(_second_environment(tmp_path / "venv"))
    folders: dict[str, tuple[Path, int]] = {}
    for python in [sys.executable, second] * 2:
        out = build(checkouts[0], python=python)
        so = (Path(out.stdout.strip().splitlines()[-1]) / "selfspec_skinny.so").resolve()
        assert folders.setdefault(python, (so, so.stat().st_mtime_ns)) == (so, so.stat().st_mtime_ns), python
    assert folders[sys.executable] == (library.resolve(), built) and folders[second][0] != library.resolve()
    assert len(list(cache.glob("kernels/skinny-*/selfspec_skinny.so"))) == 2


def test_the_kernel_build_folder_is_one_per_environment(monkeypatch):
    """The build folder's name is the same for every process of one environment, and another where
    torch's builder would write other paths into its build file (another venv's torch)."""
    import torch.utils.cpp_extension as cpp

    here = kernels.build_name()
    assert here == kernels.build_name() and here.startswith(f"skinny-{kernels.source_digest()}-")
    monkeypatch.setattr(cpp, "include_paths", lambda *a, **k: ["/another/venv/site-packages/torch/include"])
    kernels.build_name.cache_clear()
    try:
        assert kernels.build_name() != here
    finally:
        kernels.build_name.cache_clear()


def _second_environment(root: Path) -> Path:
    """A virtual environment whose torch is the running one's seen through a symlink of its own (so
    torch's builder writes this environment's paths), every other package the running one's."""
    site = Path(torch.__file__).resolve().parents[1]
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(root)], check=True,
                   capture_output=True, timeout=300)
    (own,) = root.glob("lib/python*/site-packages")
    (own / "torch").symlink_to(site / "torch")
    (own / "zz-first-environment.pth").write_text(f"{site}\n")
    return root / "bin" / "python"


@needs_kernel
def test_kernel_runs_inside_the_runtime_only(tiny, prompt_ids, monkeypatch):
    """transformers' own generate (the HF peers, the tests' reference) runs the library's code:
    no module's forward is replaced and the config's attention implementation is the user's;
    selfspec's runtime calls the skinny kernel explicitly, and both give the same tokens."""
    from selfspec.decoding.vanilla import Vanilla

    from conftest import hf_greedy

    assert tiny.model.linear_kernel == "skinny"
    assert not [m for m in tiny.model.hf.modules() if "forward" in vars(m)]
    assert tiny.model.config._attn_implementation == "sdpa"
    calls = []
    real = kernels.skinny_linear
    monkeypatch.setattr(kernels, "skinny_linear", lambda *a: calls.append(1) or real(*a))
    ref = hf_greedy(tiny, prompt_ids, 12)
    assert calls == []
    out = Vanilla(tiny.model).generate(prompt_ids, 12).tokens
    assert calls and out == ref


def test_cost_curve_interpolates_and_reports_ratios():
    curve = CostCurve("m", "cpu", "float32", "torch", {512: {1: 0.01, 2: 0.012, 8: 0.02}, 128: {1: 0.008, 8: 0.01}},
                      layer=0.001, head=0.004)
    assert curve.v(1) == 1.0 and curve.v(8) == pytest.approx(2.0) and curve.v(8, 128) == pytest.approx(1.25)
    assert curve.v(5) == pytest.approx((0.012 + (0.02 - 0.012) * 3 / 6) / 0.01)
    assert curve.v(16) == pytest.approx((0.02 + (0.02 - 0.012) / 6 * 8) / 0.01)  # extrapolated
    assert curve.head_in_layers == pytest.approx(4.0)
    assert json.loads(json.dumps(curve.to_dict()))["seconds"]["512"]["8"] == 0.02


def test_a_head_timed_above_a_whole_step_leaves_the_runtime_report_readable(tmp_path):
    """A tiny model's head timed alone can take longer than its whole step on a noisy machine (a clean
    clone's demo, 2026-12-07: head 3.66 ms, step 2.05): the layer's cost is then not resolved. It was
    infinity, written as ``Infinity`` into runtime.json, which the report refused to read, and the
    report's runtime section went missing."""
    from selfspec.reporting.build import runtime_reports
    from selfspec.store.files import write_json

    curve = CostCurve("m", "cpu", "float32", "torch", {64: {1: 0.002, 2: 0.002}}, layer=0.0, head=0.0037)
    assert curve.head_in_layers is None
    write_json(tmp_path / "runtime" / "runtime.json", {"curve": curve.to_dict(), "head_in_layers": curve.head_in_layers,
                                                       "share": float("inf")})
    (found,) = runtime_reports([tmp_path / "runtime"])
    assert found["head_in_layers"] is None and found["share"] is None


def test_time_forward_leaves_the_cache_as_it_was(tiny):
    model = tiny.model
    cache = context_cache(model, 16, 8)
    keys = [k.clone() for k in cache.keys]
    assert time_forward(model, cache, 16, 8, repeats=2) > 0
    assert cache.lengths == [16] * model.num_layers
    assert all(torch.equal(a[:, :, :16], b[:, :, :16]) for a, b in zip(keys, cache.keys))
    with pytest.raises(ValueError, match="needs n"):
        time_forward(model, cache, 16)


def test_weight_bytes_counts_a_tied_head_once(tiny):
    model = tiny.model
    params = sum(p.numel() * 4 for p in model.hf.parameters())
    untied = params - model.embedding_bytes  # embedding rows are looked up, not read
    assert weight_bytes(model) == untied


def test_bench_runtime_script(tmp_path):
    """The figures, and the profile measured with the repeats asked for (``--repeats`` once set the
    runtime figures' only: the profile took its own 5 whatever was given)."""
    out, profile = tmp_path / "runtime.json", tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_runtime.py"), "--model", "tiny-random",
                           "--contexts", "32,64", "--ks", "1,2,4", "--repeats", "1", "--new-tokens", "8",
                           "--out", str(out), "--profile-out", str(profile)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(profile.read_text())["repeats"] == 1
    assert "v(k)" in proc.stdout and "ratio" in proc.stdout and "bandwidth" in proc.stdout
    r = json.loads(out.read_text())
    assert set(r["v"]) == {"32", "64"} and r["v"]["64"]["1"] == 1.0
    assert r["same_tokens_as_generate"] is True and r["vanilla_over_generate"] > 0
    assert 0 < r["bandwidth_fraction"] and r["linear_kernel"] in ("skinny", "torch")


def test_bench_runtime_refuses_repeats_below_one_before_a_model_loads(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_runtime", ROOT / "scripts" / "bench_runtime.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr("selfspec.models.loading.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        script.main(["--model", "tiny-random", "--repeats", "0", "--profile-only"])


def test_decode_rates_leave_the_prefill_out(tiny, monkeypatch):
    """A decoder whose call costs a prefill plus a fixed time per token decodes at exactly
    1 / (time per token), however long the prefill."""
    from selfspec.decoding import base, peers, vanilla
    from selfspec.evaluation import runtime

    def fake(step):
        def generate(self, prompt, max_new_tokens, sampling=None):
            return base.Generation(tokens=[0] * max_new_tokens, prompt_len=len(prompt),
                                   seconds=3.0 + step * max_new_tokens, steps=max_new_tokens,
                                   accepted_per_step=[1] * max_new_tokens,
                                   drafted_per_step=[0] * max_new_tokens, stop_reason="length")
        return generate

    monkeypatch.setattr(vanilla.Vanilla, "generate", fake(0.05))
    monkeypatch.setattr(peers.HFPeer, "generate", fake(0.08))
    rates = runtime.decode_rates(tiny, 16, 9, 2)
    assert rates["vanilla"] == pytest.approx(20.0) and rates["hf_generate"] == pytest.approx(12.5)
    with pytest.raises(ValueError, match="at least 2 new tokens"):
        runtime.decode_rates(tiny, 16, 1, 1)


def test_masked_gqa_attention_shares_heads_and_matches_transformers(tiny):
    """Inside the runtime a masked grouped-query attention longer than ``MAX_ROWS`` (prefill) runs
    with ``enable_gqa`` (no K/V copy); its output equals transformers' own SDPA path bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny.model
    attn = model.hf.model.layers[0].self_attn
    assert attn.num_key_value_groups > 1
    g = torch.Generator().manual_seed(0)
    n = kernels.MAX_ROWS + 3
    q = torch.randn(1, 4, n, model.head_dim, generator=g)
    k = torch.randn(1, 2, n + 7, model.head_dim, generator=g)
    v = torch.randn(1, 2, n + 7, model.head_dim, generator=g)
    mask = model.causal_mask(n, 7)
    stock, _ = sdpa_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
    fast = kernels.attention(sdpa_attention_forward, attn, q, k, v, mask, attn.scaling)
    assert torch.equal(fast, stock)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_rows_equal_one_token_steps(tiny, dtype, monkeypatch):
    """Inside the runtime each row of a masked attention of up to ``MAX_ROWS`` queries equals, bit
    for bit, the one-token decoding step's attention (no mask, the keys it may see): causal rows over a prefix
    of the cache, tree rows over their ancestors gathered in order (SDPA's own masked call on the
    same rows need not: it blocks the queries together). With one key/value head a one-row call
    takes one query head per task, a 12-row call all heads of the group per task (with two, both
    take a group per task): a head's arithmetic is the same."""

    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    assert {torch.float32, torch.bfloat16} <= kernels.ROWWISE_DTYPES  # the default
    model = tiny.model
    attn = model.hf.model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    past, n = 40, 12
    q = torch.randn(1, 4, n, model.head_dim, generator=g).to(dtype)
    k = torch.randn(1, 2, past + n, model.head_dim, generator=g).to(dtype)
    v = torch.randn(1, 2, past + n, model.head_dim, generator=g).to(dtype)
    tree = torch.ones(n, past + n, dtype=torch.bool)
    tree[:, past:] = torch.eye(n, dtype=torch.bool)
    tree[1:, past] = True  # a root, children of it, and a chain 0 -> 3 -> 5
    tree[5, past + 3] = True
    for mask in (model.causal_mask(n, past), model.prepare_mask(tree)):
        rows = kernels.attention(sdpa, attn, q, k, v, mask, attn.scaling)
        for i in range(n):
            idx = mask[0, 0, i].nonzero().squeeze(-1)
            # the one-token decoding step over exactly those keys
            one = kernels.attention(sdpa, attn, q[:, :, i:i + 1], k.index_select(2, idx), v.index_select(2, idx),
                                    None, attn.scaling)
            assert torch.equal(rows[:, i], one[:, 0]), i
    q1, k1, v1 = q[:, :2], k[:, :1], v[:, :1]  # one key/value head of two query heads
    rows = kernels.attention(sdpa, attn, q1, k1, v1, model.causal_mask(n, past), attn.scaling)
    for i in range(n):
        one = kernels.attention(sdpa, attn, q1[:, :, i:i + 1], k1[:, :, :past + i + 1], v1[:, :, :past + i + 1],
                                None, attn.scaling)
        assert torch.equal(rows[:, i], one[:, 0]), i


#: attention shapes: (query heads, key/value heads, head dimension, keys, rows): head dimensions of
#: 8 to 256 (masked last vectors), one key/value head to one per query head, odd key counts
ATTENTION_SHAPES = ((9, 3, 64, 100, 1), (9, 3, 64, 101, 12), (4, 1, 8, 33, 5), (8, 8, 24, 50, 3),
                    (6, 2, 256, 70, 9), (12, 3, 128, 40, 32))


def attention_masks(rows: int, keys: int, g: torch.Generator):
    """A causal mask, a scattered one (a tree's rows see their ancestors only) and none."""
    causal = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    scattered = torch.rand(rows, keys, generator=g) < 0.6
    scattered[:, 0] = True
    return causal, scattered, torch.empty(0, dtype=torch.bool)


@needs_kernel
@pytest.mark.parametrize("path", ["float32", "widen"])
def test_attention_on_avx512_gives_the_avx2_bits(path):
    """Row-wise attention's AVX-512 value pass (every head of a row sharing each key's values) gives
    exactly the AVX2 loop's bits, in float32 and in bfloat16 with widened scores and values: causal
    and scattered (tree) masks, one row and many."""
    kernels.load()
    isa = torch.ops.selfspec.skinny_isa
    if isa("auto") != "avx512":
        pytest.skip("no AVX-512 on this CPU: row-wise attention has only its AVX2 path")
    dtype = torch.float32 if path == "float32" else torch.bfloat16
    g = torch.Generator().manual_seed(9)
    with bf16_path(path) if dtype == torch.bfloat16 else contextlib.nullcontext():
        try:
            for heads, kv_heads, dim, keys, rows in ATTENTION_SHAPES:
                q = torch.randn(1, heads, rows, dim, generator=g).to(dtype)
                k, v = (torch.randn(1, kv_heads, keys, dim, generator=g).to(dtype) for _ in range(2))
                for allowed in attention_masks(rows, keys, g):
                    isa("avx2")
                    ref = torch.ops.selfspec.rowwise_attention(q, k, v, allowed, 0.125)
                    isa("auto")
                    assert torch.equal(torch.ops.selfspec.rowwise_attention(q, k, v, allowed, 0.125), ref), \
                        (heads, kv_heads, dim, rows)
        finally:
            isa("auto")


@needs_kernel
@pytest.mark.parametrize("path", ["avx512_bf16", "amx", "amx_emulated"])
def test_bfloat16_attention_on_dot_product_paths(path):
    """Where bfloat16 products take a dot-product path, attention's scores are float32 sums of the
    bfloat16 query and keys, and its weights exp(s - max) are rounded to bfloat16 before the value
    product (as torch's CPU flash attention rounds them), normalised by the float32 sum of the
    unrounded weights: against that computed in float64, within the output's bfloat16 rounding; and
    each row equals the one-row call over its keys bit for bit."""
    g = torch.Generator().manual_seed(10)
    with bf16_path(path):
        for heads, kv_heads, dim, keys, rows in ATTENTION_SHAPES:
            q = torch.randn(1, heads, rows, dim, generator=g).to(torch.bfloat16)
            k, v = (torch.randn(1, kv_heads, keys, dim, generator=g).to(torch.bfloat16) for _ in range(2))
            for allowed in attention_masks(rows, keys, g)[:2]:
                out = torch.ops.selfspec.rowwise_attention(q, k, v, allowed, 0.125)
                for h in range(heads):
                    kh, vh = k[0, h // (heads // kv_heads)].double(), v[0, h // (heads // kv_heads)].double()
                    for i in range(rows):
                        keep = allowed[i].nonzero().squeeze(-1)
                        s = (q[0, h, i].double() @ kh[keep].T * 0.125).float()
                        p = torch.exp((s - s.max()).double())
                        exact = p.float().to(torch.bfloat16).double() @ vh[keep] / p.sum()
                        torch.testing.assert_close(out[0, h, i].double(), exact, rtol=2 ** -8, atol=1e-3)
                for i in range(rows):
                    one = torch.ops.selfspec.rowwise_attention(q[:, :, i:i + 1], k, v, allowed[i:i + 1], 0.125)
                    assert torch.equal(one[:, :, 0], out[:, :, i]), (heads, dim, rows, i)


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("model", ["tiny-random", "tiny-gemma3"])
def test_k_token_pass_equals_k_one_token_steps_on_every_bfloat16_path(model, path):
    """On every bfloat16 path this CPU has (the linears' products, and with them attention's
    scores), a k-token pass's logits equal k one-token steps' bit for bit."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    cfg = model_config(model)
    cfg.dtype = "bfloat16"
    with bf16_path(path):
        m = load_model(cfg).model
        ids = torch.randint(0, m.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            cache = m.new_cache(64)
            m.forward(ids[:, :24], cache, start=0)
            steps = torch.cat([m.logits(m.forward(ids[:, j:j + 1], cache)[:, -1]) for j in range(24, 40)])
            for k in (2, 5, 16):
                cache.truncate(24)
                assert torch.equal(m.logits(m.forward(ids[:, 24:24 + k], cache))[0], steps[:k]), k


@pytest.mark.parametrize("model", ["tiny-random", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_k_token_pass_equals_k_one_token_steps(dtype, model, monkeypatch):
    """The whole runtime is batch-invariant: the logits of a k-token verification pass equal those
    of k one-token decoding steps bit for bit (linears, norms, rotary and attention), in bfloat16
    and float32, for every supported family (Qwen2's q/k/v biases ride the fused projection;
    Qwen3's per-head q/k norms run the library's row-wise RMSNorm; Gemma 3's norms, q/k norms
    included, run the fused operator in Gemma's ``(1 + w)`` form, and its sliding layers' window of
    8 is passed, so a pass's rows are narrowed each by its own position); in bfloat16 a last-bit
    difference flips argmaxes at near-ties (docs/design/runtime.md §4)."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    assert {torch.float32, torch.bfloat16} <= kernels.ROWWISE_DTYPES  # the default
    cfg = model_config(model)
    cfg.dtype = dtype
    model = load_model(cfg).model
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.vocab_size, (1, 40), generator=g)
    prompt, new = ids[:, :24], ids[0, 24:]
    with torch.inference_mode():
        cache = model.new_cache(64)
        model.forward(prompt, cache, start=0)
        steps = torch.cat([model.logits(model.forward(new[j].view(1, 1), cache)[:, -1]) for j in range(len(new))])
        for k in (2, 5, 16):
            cache.truncate(24)
            assert torch.equal(model.logits(model.forward(new[:k].view(1, -1), cache))[0], steps[:k]), k


def test_fused_projections_are_the_librarys_sublayers(tiny):
    """Each layer's q/k/v and gate/up weights are views of one matrix, and the runtime's
    sublayers (one product each, the fused norm and rotary operators inside the runtime) equal the
    library's own attention and MLP forward on the same input within float32 rounding."""
    from transformers import DynamicCache

    m = tiny.model
    layer = m.hf.model.layers[1]
    weight, _, sizes = m._qkv[1]
    rows = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    offsets = [0, sizes[0], sizes[0] + sizes[1]]
    for mod, off in zip(rows, offsets):
        assert mod.weight.data_ptr() == weight[off].data_ptr() and mod.weight.is_contiguous()
    assert layer.mlp.up_proj.weight.data_ptr() == m._gate_up[1][0][m._gate_up[1][2][0]].data_ptr()
    g = torch.Generator().manual_seed(4)
    past, n = 6, 5
    h = torch.randn(1, n, m.hidden_size, generator=g)
    rope = m.rope(m.positions(past, n), h)
    mask = m.causal_mask(n, past)
    cache = m.new_cache(past + n)
    with torch.inference_mode():
        m.forward(torch.arange(past).unsqueeze(0), cache, start=0)
        ref_cache = DynamicCache()  # the library's own cache, holding the same past of layer 1
        ref_cache.update(*(t[:, :, :past].clone() for t in cache.layer_kv(1)), 1)
        ref_attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=rope,
                                      attention_mask=mask, past_key_values=ref_cache)
        ref_attn = h + ref_attn
        ref_mlp = h + layer.mlp(layer.post_attention_layernorm(h))
        out_attn = m.attention(1, h, rope, cache, mask)
        out_mlp = m.mlp(1, h)
    torch.testing.assert_close(out_attn, ref_attn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_mlp, ref_mlp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref_cache.layers[1].values, cache.layer_kv(1)[1], rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_have_the_librarys_arithmetic(dtype):
    """The fused rotary operator equals transformers' ``apply_rotary_pos_emb`` bit for bit (strided
    q and k as the projections leave them); the fused RMSNorm equals ``LlamaRMSNorm`` bit for bit
    in bfloat16 and within the last bit in float32 (the mean of squares is summed in another order),
    and each of its rows is the same whatever the other rows."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    kernels.load()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 5, 9, 64, generator=g).transpose(1, 2).to(dtype)
    k = torch.randn(1, 5, 3, 64, generator=g).transpose(1, 2).to(dtype)
    angle = torch.randn(1, 5, 32, generator=g)
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    out_q, out_k = kernels.rotary(apply_rotary_pos_emb, q, k, cos, sin)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    norm = norm.to(dtype)
    x = torch.randn(1, 7, 576, generator=g).to(dtype)
    with torch.inference_mode():
        fused = kernels.rms_norm(norm, x)
        rows = torch.cat([kernels.rms_norm(norm, x[:, i:i + 1]) for i in range(7)], dim=1)
    assert torch.equal(fused, rows)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, norm(x))
    else:
        torch.testing.assert_close(fused, norm(x), rtol=4e-7, atol=1e-6)


# --- llama.cpp as a peer (the optional extra) ----------------------------------------------------
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (the optional extra: make llamacpp)")


def _rope_halves(x, angles):
    """transformers' rotary embedding of one head: dimension j turns with j + d/2."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angles.cos() - b * angles.sin(), b * angles.cos() + a * angles.sin()], -1)


def _rope_adjacent(x, angles):
    """llama.cpp's ``llama`` rotary embedding of one head: dimension 2j turns with 2j + 1."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * angles.cos() - b * angles.sin(), b * angles.cos() + a * angles.sin()], -1).flatten(-2)


def test_gguf_rows_turn_in_llama_cpps_rotary_pairs():
    """A projection's rows reordered for llama.cpp, then turned by llama.cpp's rotary embedding, give
    transformers' rotated query reordered alike: the same attention scores (q . k) either way."""
    from selfspec.models.gguf_export import rope_pairs_adjacent

    g = torch.Generator().manual_seed(6)
    heads, d, hidden = 3, 8, 16
    w_q, w_k = torch.randn(heads * d, hidden, generator=g), torch.randn(heads * d, hidden, generator=g)
    h_q, h_k = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
    angles = torch.rand(d // 2, generator=g) * 6
    hf_q = _rope_halves((w_q @ h_q).view(heads, d), angles)
    hf_k = _rope_halves((w_k @ h_k).view(heads, d), angles * 0.3)
    cpp_q = _rope_adjacent((rope_pairs_adjacent(w_q, heads) @ h_q).view(heads, d), angles)
    cpp_k = _rope_adjacent((rope_pairs_adjacent(w_k, heads) @ h_k).view(heads, d), angles * 0.3)
    torch.testing.assert_close(cpp_q, rope_pairs_adjacent(hf_q.reshape(-1), heads).view(heads, d))
    torch.testing.assert_close((cpp_q * cpp_k).sum(-1), (hf_q * hf_k).sum(-1))


def test_pre_tokenizer_names():
    from selfspec.models.gguf_export import pre_tokenizer_name

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert pre_tokenizer_name(byte_level) == "gpt-2"
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, byte_level]}) == "smollm"
    assert pre_tokenizer_name({"type": "Metaspace"}) == "default" and pre_tokenizer_name(None) == "default"


def test_gguf_is_written_from_the_loaded_weights_and_cached(tiny, tmp_path, monkeypatch):
    """The file holds the loaded model's own values (the query/key rows reordered), the Llama
    hyperparameters and the tokenizer; it is written once per weights digest, dtype and fingerprint."""
    from gguf import GGUFReader

    from selfspec.models import gguf_export

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    path = gguf_export.cached_gguf(tiny.model, tiny.tokenizer)
    assert path.parent == tmp_path / "gguf" and tiny.weights_digest in path.name and "float32" in path.name
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    hf = tiny.model.hf
    layer = hf.model.layers[1]
    cfg = hf.config

    def values(name):
        t = tensors[name]
        return torch.from_numpy(t.data.copy()).reshape(list(reversed(t.shape.tolist())))

    assert torch.equal(values("token_embd.weight"), hf.model.embed_tokens.weight.detach())
    assert torch.equal(values("output.weight"), hf.lm_head.weight.detach())  # tiny-random's head is untied
    assert torch.equal(values("blk.1.attn_v.weight"), layer.self_attn.v_proj.weight.detach())
    assert torch.equal(values("blk.1.attn_k.weight"), gguf_export.rope_pairs_adjacent(
        layer.self_attn.k_proj.weight.detach(), cfg.num_key_value_heads))
    assert len(tensors) == 3 + 9 * cfg.num_hidden_layers and all(t.tensor_type.name == "F32" for t in tensors.values())

    def field(key):
        f = reader.fields[key]
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0].name == "STRING" else value[0].item()

    assert field("general.architecture") == "llama" and field("llama.block_count") == cfg.num_hidden_layers
    assert field("llama.attention.head_count_kv") == cfg.num_key_value_heads
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.eos_token_id") == tiny.tokenizer.eos_token_id
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == tiny.model.vocab_size
    written = path.stat().st_mtime_ns
    assert gguf_export.cached_gguf(tiny.model, tiny.tokenizer) == path and path.stat().st_mtime_ns == written
    monkeypatch.setattr(tiny.model, "weights_digest", "0123456789abcdef")
    assert gguf_export.gguf_path(tiny.model) != path


def test_a_bfloat16_models_gguf_holds_its_weight_matrices_in_bf16(tmp_path, monkeypatch):
    """A bfloat16 run's file holds the bytes its steps read: every weight matrix as BF16, equal bit for
    bit to the loaded model's (the query/key rows reordered), the norms' vectors in float32."""
    from gguf import GGUFReader

    from selfspec.config import model_config
    from selfspec.models import gguf_export
    from selfspec.models.loading import load_model

    cfg = model_config("tiny-random")
    cfg.dtype = "bfloat16"
    loaded = load_model(cfg)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    path = gguf_export.cached_gguf(loaded.model, loaded.tokenizer)
    assert path.name.endswith(".bf16.gguf") and "bfloat16" in path.name
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    hf = loaded.model.hf

    def bits(name):
        t = tensors[name]
        assert t.tensor_type.name == "BF16", (name, t.tensor_type.name)
        return torch.from_numpy(t.data.copy().view("int16")).reshape(list(reversed(t.shape.tolist())))

    layer = hf.model.layers[1]
    assert torch.equal(bits("blk.1.ffn_down.weight"), layer.mlp.down_proj.weight.detach().view(torch.int16))
    assert torch.equal(bits("blk.1.attn_q.weight"), gguf_export.rope_pairs_adjacent(
        layer.self_attn.q_proj.weight.detach(), hf.config.num_attention_heads).view(torch.int16))
    assert torch.equal(bits("token_embd.weight"), hf.model.embed_tokens.weight.detach().view(torch.int16))
    norm = tensors["blk.1.attn_norm.weight"]
    assert norm.tensor_type.name == "F32"
    assert torch.equal(torch.from_numpy(norm.data.copy()), layer.input_layernorm.weight.detach().float())


def test_gguf_writer_names_what_it_does_not_cover(tiny):
    from selfspec.models import gguf_export

    cfg = tiny.model.hf.config
    saved = cfg.rope_parameters
    try:
        cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
        assert "yarn" in gguf_export.export_problem(tiny.model.hf)
    finally:
        cfg.rope_parameters = saved
    assert gguf_export.export_problem(tiny.model.hf) is None


def test_llama_cpp_is_skipped_in_one_line_when_not_installed(tiny, monkeypatch):
    from selfspec.decoding import llamacpp
    from selfspec.evaluation import runtime

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert llamacpp.import_llama_cpp() is None
    r = runtime.runtime_report(tiny, ks=(1, 2), contexts=(16,), new_tokens=3, repeats=1)
    assert r["llama_cpp"] == {"skipped": llamacpp.NOT_INSTALLED} and set(r["peers"]) == {"vanilla", "hf_generate"}
    text = runtime.format_report(r)
    assert text.count("llama.cpp") == 1
    assert "llama.cpp: skipped (llama-cpp-python not installed; `make llamacpp`)" in text.splitlines()


@needs_llama_cpp
def test_llama_cpp_decodes_the_same_tokens_as_vanilla(tiny, tmp_path, monkeypatch):
    """The GGUF file written from tiny-random loads in llama.cpp, which then decodes, from the same
    prompt ids (no BOS added), the tokens vanilla decodes, and tokenizes text as the tokenizer does."""
    from selfspec.decoding.vanilla import Vanilla
    from selfspec.decoding.llamacpp import LlamaCpp

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, tiny.model.vocab_size, (40,), generator=g).tolist()
    peer = LlamaCpp(tiny.model, tokenizer=tiny.tokenizer, threads=1)
    try:
        out = peer.generate(prompt, 16)
        assert out.prompt_len == 40 and out.new_tokens == 16 and out.seconds > 0
        assert out.tokens == Vanilla(tiny.model).generate(prompt, 16).tokens
        assert peer.generate(prompt, 4).tokens == out.tokens[:4]  # a second call starts afresh
        text = "The year 2024 had 366 days; naïve café. <|im_start|>user\n  x = 1"
        assert peer.llm.tokenize(text.encode(), add_bos=False, special=True) == \
            tiny.tokenizer.encode(text, add_special_tokens=False)
    finally:
        peer.close()


def test_decode_rates_time_other_peers_alike(tiny, monkeypatch):
    """A peer given to decode_rates is timed by the same differencing, its prefill is the time to
    its first token, and its agreement with vanilla is counted token by token."""
    from selfspec.decoding import base, peers, vanilla
    from selfspec.evaluation import runtime

    def fake(step, tokens):
        def generate(self, prompt, max_new_tokens, sampling=None):
            return base.Generation(tokens=tokens[:max_new_tokens], prompt_len=len(prompt),
                                   seconds=2.0 + step * max_new_tokens, steps=max_new_tokens,
                                   accepted_per_step=[1] * max_new_tokens,
                                   drafted_per_step=[0] * max_new_tokens, stop_reason="length")
        return generate

    monkeypatch.setattr(vanilla.Vanilla, "generate", fake(0.05, [1, 2, 3, 4, 5]))
    monkeypatch.setattr(peers.HFPeer, "generate", fake(0.08, [1, 2, 3, 4, 5]))
    other = type("Other", (), {"generate": fake(0.04, [1, 2, 9, 4, 5])})()
    rates = runtime.decode_rates(tiny, 16, 5, 2, {"other": other})
    assert rates["other"] == pytest.approx(25.0) and rates["prefill"]["other"] == pytest.approx(16 / 2.04)
    assert rates["agreement"] == {"vanilla": 5, "hf_generate": 5, "other": 2} and rates["same_tokens"]
    figures = runtime.peer_figures(rates, "other", 1000, 1e5)
    assert figures["bandwidth_fraction"] == pytest.approx(0.25) and not figures["same_tokens"]


def test_decode_rates_pair_each_ratio_within_a_moment(tiny, monkeypatch):
    """On a machine that slows down between repeats (another job starting) each repeat's ratio is
    still the peers' own: its rates are a moment apart, in an order that alternates between
    repeats, so neither peer always runs first; the ratio is the median of those pairs."""
    from selfspec.decoding import base, peers, vanilla
    from selfspec.evaluation import runtime

    calls, slow = [], [1.0]

    def fake(name, step):
        def generate(self, prompt, max_new_tokens, sampling=None):
            calls.append(name)
            gen = base.Generation(tokens=[1] * max_new_tokens, prompt_len=len(prompt),
                                  seconds=slow[0] * (2.0 + step * max_new_tokens), steps=max_new_tokens,
                                  accepted_per_step=[1] * max_new_tokens,
                                  drafted_per_step=[0] * max_new_tokens, stop_reason="length")
            if len(calls) % 6 == 0:  # after every repeat (3 decoders x 2 runs) the machine slows
                slow[0] *= 2
            return gen
        return generate

    monkeypatch.setattr(vanilla.Vanilla, "generate", fake("vanilla", 0.05))
    monkeypatch.setattr(peers.HFPeer, "generate", fake("hf_generate", 0.08))
    other = type("Other", (), {"generate": fake("other", 0.04)})()
    rates = runtime.decode_rates(tiny, 16, 5, 4, {"other": other})
    assert rates["ratio"]["other"] == pytest.approx(1.25) and rates["ratio"]["vanilla"] == 1.0
    assert rates["ratio_range"]["hf_generate"] == [pytest.approx(0.625)] * 2
    firsts = [calls[i] for i in range(0, len(calls), 6)]
    assert firsts == ["other", "vanilla", "other", "vanilla", "other"]
    figures = runtime.peer_figures(rates, "other", 1000, 1e5)
    assert figures["over_vanilla"] == pytest.approx(1.25)


def test_the_bandwidth_roof_reads_the_working_set_once_per_repeat():
    """The roof is the rate of reading a buffer of the given size: its bytes over a read's time."""
    from selfspec.measure.costs import measure_bandwidth

    roof = measure_bandwidth(torch.device("cpu"), 1 << 22, repeats=3)
    assert 1e8 < roof < 1e13


def test_llama_cpp_refusing_the_file_is_one_line_not_a_crash(tiny, monkeypatch):
    from selfspec.decoding import llamacpp
    from selfspec.evaluation import runtime

    def refuse(*args, **kwargs):
        raise ValueError("Failed to load model from file: x.gguf")

    monkeypatch.setattr(llamacpp, "import_llama_cpp", lambda: object())
    monkeypatch.setattr(llamacpp, "LlamaCpp", refuse)
    peer, line = runtime.llama_cpp_peer(tiny, 64)
    assert peer is None and line == ("llama.cpp: FAILED to load the GGUF file of tiny-random "
                                     "(ValueError: Failed to load model from file: x.gguf)")


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_walk_in_one_operator_equals_the_python_walk(dtype, family, monkeypatch):
    """``csrc/layer_walk.cpp`` runs a Llama model's layers (and Qwen2's, with their q/k/v biases) with the
    same operators, in the same order, as the Python walk: hidden states, kept states and cache bit for
    bit, for one-token steps, k-token passes, drafting with skipped sublayers (whose layers' caches stay
    behind) and drafting over a quantised copy of the weights after a prompt; and it is the path taken (a
    family it does not fit falls back)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from selfspec.models.layered import LayeredModel, Pass, SkipSet

    torch.manual_seed(0)
    config, cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    hf = cls(config(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512))
    model = LayeredModel(hf.to(dtype), name="wide", linear_kernel="auto")
    assert model._walk is not None
    taken = []
    original = LayeredModel._walk_in_cpp
    monkeypatch.setattr(LayeredModel, "_walk_in_cpp",
                        lambda self, *a: taken.append(out := original(self, *a)) or out)
    ids = torch.randint(0, 512, (1, 140), generator=torch.Generator().manual_seed(1))

    def run():
        cache, outs = model.new_cache(200), []
        with torch.inference_mode():
            model.forward(ids[:, :80], cache)
            for k in (1, 3, 8, 32):
                # kept states (early exit's exit queries, DEL's shadow tokens): the last rows after layers 0 and 2
                keep = {0: torch.full((min(k, 3), 576), float("nan"), dtype=dtype),
                        2: torch.full((k, 576), float("nan"), dtype=dtype)}
                outs.append(model.forward(ids[:, 80:80 + k], cache, keep=keep).clone())
                outs += [keep[0], keep[2]]
                cache.truncate(81)
            outs.append(model.forward(ids[:, 81:82], cache).clone())
            # drafting with a skip set (Draft & Verify): layer 1's attention and two MLPs left out
            # drafting over the int8 copy (a quantised self-draft)
            for j in range(82, 84):
                outs.append(model.forward(ids[:, j:j + 1], cache, Pass(weights="int8")).clone())
            skip = SkipSet.of(attn=[1], mlp=[0, 2])
            for j in range(84, 87):
                outs.append(model.forward(ids[:, j:j + 1], cache, Pass(skip=skip)).clone())
            outs.append(torch.tensor(cache.lengths))
        return outs + [t[:, :, :87].clone() for t in cache.keys + cache.values]

    walked = run()
    assert sum(out is not None for out in taken) == 10  # every pass after the prompt, kept states, skips, copies
    assert not any(t.isnan().any() for t in walked)
    model._walk = None
    model._weight_sets.clear()  # the copy made again without the operator's weights: the Python walk
    assert all(torch.equal(a, b) for a, b in zip(walked, run()))
