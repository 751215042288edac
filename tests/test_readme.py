"""The documented commands work as written: every command of the ```bash blocks of README.md and of
docs/usage.md (:data:`PAGES`, the workflows README.md points to) runs, in the pages' order and each
once, in a scratch directory laid out as the repository (its own ``outputs/``), on tiny-random with
small budgets. What cannot run here is listed in :data:`NOT_RUN` with the reason, and checked
as far as it can be (the make target exists, the flags parse, the Hydra overrides compose).

Substitutions, and nothing else: ``MODEL=``/``model=`` become tiny-random, ``N=`` 1; Hydra commands
get small budgets (the demo's ``--small`` ones for training jobs, :data:`SMALL_EVAL` for
evaluations, :data:`SMALL_BENCH` and :data:`SMALL_PROFILE` for ``make bench`` and ``make profile``),
replacing a budget the README sets (``n_examples=50``). A command that names a GGUF
file of your own (``model.gguf_path=/path/to/file.gguf``) keeps its model, and the placeholder
becomes the SmolLM2 asset's GGUF file (:func:`gguf_file`).

The model sources the README's prose sets (``model.gguf_path=...``, ``model.name_or_path=...
model.gguf_file=...``) are composed as written and checked (:func:`prose_model_sources`).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the pages whose commands are run, in this order: the front page, then the workflows in detail (the
#: dated results pages name the commands that measured them; those are measurements, not run here)
PAGES = (README, ROOT / "docs" / "usage.md")
#: what a scratch copy of the repository needs (links: the code under test is this checkout's)
LAYOUT = ("Makefile", "pyproject.toml", "README.md", "conf", "scripts", "src")
MODEL = "tiny-random"
SMALL_EVAL = ["n_examples=1", "max_new_tokens=4", "warmup=0", "progress=false"]
SMALL_BENCH = ["--max-new-tokens", "4", "--warmup", "0"]
SMALL_PROFILE = ["--repeats", "3"]  # `make profile`: medians of 3 timings, not the profile's default
#: the demo's --small budget per training job (scripts/demo.py)
JOB_BUDGET = runpy.run_path(str(ROOT / "scripts" / "demo.py"))["BUDGETS"]["small"]
#: make targets that train, and their job
TRAIN_TARGETS = {"train-heads": "heads", "train-prompts": "prompts", "build-tree": "ppd_tree",
                 "search-skips": "skips", "draft-vocab": "draft_vocab"}
#: the README's training examples train for TASK=xsum; its evaluation examples run other tasks too,
#: which find heads trained on mixed data and a skip set searched for the model (job.data=mixed,
#: job.tasks=[...]): the session's demo trained both for tiny-random (conftest.py demo_run)
PREREQUISITES = (("heads", "tiny-random-mixed"), ("skip_set", "tiny-random"))


def bash_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, one per line, without their trailing comments."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
    lines = (re.sub(r"\s+#\s.*$", "", line).strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def documented_commands() -> list[str]:
    """The commands of :data:`PAGES`, in order, each once (README.md repeats some of docs/usage.md's)."""
    return list(dict.fromkeys(c for page in PAGES for c in bash_commands(page.read_text())))


def documented_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


#: the README's placeholder for a GGUF file of your own
GGUF_PLACEHOLDER = "/path/to/file.gguf"


def gguf_file() -> Path:
    """The GGUF file that stands in for :data:`GGUF_PLACEHOLDER`: the SmolLM2 asset's (the same bytes
    as the embedded default, so its conversion is the default's)."""
    from selfspec.store.assets import asset_path

    return asset_path("smollm2-gguf")


def prose_model_sources(text: str) -> list[str]:
    """The README's inline code that sets a model source (``model.gguf_path=...``, ...), as written."""
    spans = re.findall(r"`(model\.(?:gguf_path|name_or_path|gguf_file)=[^`]*)`", text)
    return [" ".join(span.split()) for span in spans]


# --- what cannot run here, and what is checked instead ----------------------------------------------
def _check_make_target(run, target: str, expect: str):
    out = run(["make", "-n", target]).stdout
    assert expect in out, f"make -n {target} does not run {expect!r}:\n{out}"


def _check_wandb_sync(run, command: str):
    """The path expression finds the offline run the README's ``logger=wandb`` example wrote."""
    found = run(_words(command.split(" -exec ")[0])).stdout.split()
    assert found and all(Path(p).name.startswith("offline-run-") for p in found), found
    assert "PATHS" in run(["wandb", "sync", "--help"]).stdout


def _check_dashboard(run, command: str):
    words = _words(command)
    assert "--entity" in run([*words[:2], "--help"]).stdout
    run([*words[:2], "--markdown", "outputs/dashboard.md"])  # the layout it would save, offline


def _check_slurm(run, command: str):
    """The overrides compose with the Slurm launcher: the sweep's first job's ``--cfg hydra``
    (it prints the config and submits nothing)."""
    words = adapt(command)
    multirun = words.index("selfspec.evaluate") + 1
    if words[multirun] == "-m":
        del words[multirun]
    first = [w.split(",")[0] if "=" in w and "[" not in w else w for w in words]
    out = run([*first, "--cfg", "hydra"]).stdout
    assert "SlurmLauncher" in out and "partition: gpu" in out and "gpus_per_node: 1" in out, out[-2000:]


#: README command -> (why it does not run here, the check made instead)
NOT_RUN = {
    "make demo": ("the demo on SmolLM2-135M (tens of minutes); tests/test_demo.py runs its pipeline on tiny-random",
                  lambda run, cmd: _check_make_target(run, "demo", "scripts/demo.py")),
    "make test": ("the test suite itself, of which this test is part",
                  lambda run, cmd: _check_make_target(run, "test", "pytest")),
    "find outputs -type d -name 'offline-run-*' -exec wandb sync {} +": (
        "uploads to W&B: needs an API key and the network", _check_wandb_sync),
    "python scripts/wandb_dashboard.py --entity <you>": (
        "saves a W&B workspace: needs an API key, the network and wandb-workspaces", _check_dashboard),
    "make TORCH_SPEC=torch gpu-check": ("needs a GPU (without one it refuses, naming --dry-run)",
                                        lambda run, cmd: _check_make_target(run, "gpu-check", "scripts/gpu_check.py")),
    "make gpu-check ARGS=--dry-run": ("tests/test_gpu_check.py runs the same dry run (scripts/gpu_check.py --dry-run)",
                                      lambda run, cmd: _check_make_target(run, "gpu-check", "scripts/gpu_check.py")),
    "make gpu-check ARGS='--budget 120'": ("needs a GPU; tests/test_gpu_check.py runs the budget on the dry run",
                                           lambda run, cmd: _check_make_target(run, "gpu-check", "scripts/gpu_check.py")),
    "python -m selfspec.evaluate -m hydra/launcher=submitit_slurm hydra.launcher.partition=gpu "
    "hydra.launcher.gpus_per_node=1 task=xsum,gsm8k": ("submits to a Slurm cluster", _check_slurm),
    # a minute of converting SmolLM2's GGUF file: run once, by its own test
    "python -m selfspec.evaluate model.gguf_path=/path/to/file.gguf model.name=my-model task=xsum": (
        "test_readme_gguf_path_command_works_as_written runs it as written", lambda run, cmd: None),
}


# --- substitutions ------------------------------------------------------------------------------------
def _merge(overrides: list[str], extra: list[str]) -> list[str]:
    """Hydra overrides with ``extra`` replacing those of the same key."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + extra


def _hydra_budget(overrides: list[str], module: str) -> list[str]:
    """Small budgets for a ``selfspec.train`` / ``selfspec.evaluate`` command line, model tiny-random
    unless the command names a GGUF file of its own."""
    if module == "selfspec.train":
        extra = JOB_BUDGET[next((o.split("=", 1)[1] for o in overrides if o.startswith("job=")), "heads")]
    else:
        extra = SMALL_EVAL
    own_file = any(o.startswith("model.gguf_path=") for o in overrides)
    return _merge(overrides, [*([] if own_file else [f"model={MODEL}"]), *extra])


def _make(words: list[str]) -> list[str]:
    target = next(w for w in words if "=" not in w)
    var = dict(w.split("=", 1) for w in words if "=" in w)
    args = shlex.split(var.get("ARGS", ""))
    if target in TRAIN_TARGETS:
        args = _merge(args, JOB_BUDGET[TRAIN_TARGETS[target]])
        var["MODEL"] = MODEL
    elif target == "profile":
        var["MODEL"] = MODEL
        args = args + SMALL_PROFILE
    elif target in ("evaluate", "bench"):
        var["MODEL"] = MODEL
        args = args + SMALL_BENCH if target == "bench" else _merge(args, SMALL_EVAL)
    elif target == "sweep":  # the Makefile passes no MODEL to a sweep: the preset's model, overridden
        args = _merge(args, [f"model={MODEL}", *SMALL_EVAL])
    if "N" in var:
        var["N"] = "1"
    var["ARGS"] = " ".join(args)
    return ["make", target, *(f"{k}={v}" for k, v in var.items())]


def adapt(command: str) -> list[str]:
    """The README command as run here (see the module docstring)."""
    words = _words(command)
    if GGUF_PLACEHOLDER in command:
        words = [w.replace(GGUF_PLACEHOLDER, str(gguf_file())) for w in words]
    if words[0] == "make":
        return _make(words[1:])
    if "-m" in words and words[words.index("-m") + 1].startswith("selfspec."):
        i = words.index("-m") + 2
        return words[:i] + _hydra_budget(words[i:], words[i - 1])
    return words


# --- the test -------------------------------------------------------------------------------------------
@pytest.fixture
def scratch(tmp_path):
    """A directory laid out as the repository (links) with an empty ``outputs/``; a runner there."""
    for name in LAYOUT:
        (tmp_path / name).symlink_to(ROOT / name)
    venv = Path(sys.prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_API")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT / "src"),
               SELFSPEC_OUTPUTS=str(tmp_path / "outputs"), WANDB_MODE="offline", WANDB_SILENT="true")

    def run(argv: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
        if argv[0] == "make":  # this interpreter's environment, taken as installed (no reinstall into it)
            argv = ["make", f"VENV={venv}", "-o", str(venv / ".installed"), *argv[1:]]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        return proc

    return tmp_path, run


def test_every_readme_command_is_run_or_excluded_with_a_reason():
    commands = documented_commands()
    assert len(commands) >= 15, commands
    stale = [c for c in NOT_RUN if c not in commands]
    assert not stale, f"NOT_RUN names commands the documented pages no longer have: {stale}"
    front = bash_commands(README.read_text())
    assert {"make demo", "make test", "make tables"} <= set(front) and any("train-" in c for c in front)


def test_readme_model_sources_compose_as_written():
    """Finding: the README's ``model.gguf_path=/path/to/file.gguf`` failed with "Key 'gguf_path' is not
    in struct" (and ``model.gguf_file=<file>.gguf`` likewise); only ``+model.gguf_path=`` worked, and
    no test ran the line. Reproduction: compose each model source the README's prose sets, as
    written, on the default model config; now each composes and names that GGUF file."""
    from selfspec.config import compose
    from selfspec.models.loading import check_model_config

    gguf = gguf_file()
    fill = {GGUF_PLACEHOLDER: str(gguf), "<hub repo or directory>": str(gguf.parent), "<file>.gguf": gguf.name}
    spans = prose_model_sources(documented_text())
    assert any(s.startswith("model.gguf_path=") for s in spans) and any("model.gguf_file=" in s for s in spans), spans
    for span in spans:
        for placeholder, value in fill.items():
            span = span.replace(placeholder, value)
        source = check_model_config(compose(shlex.split(span)).model)
        assert (source.kind, Path(source.where)) == ("gguf", gguf), span


@pytest.mark.slow
def test_readme_gguf_path_command_works_as_written(scratch):
    """The README's command that sets ``model.gguf_path`` runs as written, on the SmolLM2 asset's GGUF
    file (the one documented command test_readme_commands_work_as_written leaves to this test)."""
    root, run = scratch
    commands = [c for c in documented_commands() if "model.gguf_path=" + GGUF_PLACEHOLDER in c]
    assert commands, "no documented command sets model.gguf_path"
    for command in commands:
        run(adapt(command))
    assert list((root / "outputs").rglob("summary.json"))


@pytest.mark.slow
def test_readme_commands_work_as_written(scratch, demo_run):
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the README's commands are make targets")
    root, run = scratch
    for kind, name in PREREQUISITES:
        shutil.copytree(demo_run.out / "artefacts" / kind / name, root / "outputs" / "artefacts" / kind / name)
    for command in documented_commands():
        if command in NOT_RUN:
            NOT_RUN[command][1](run, command)
        else:
            run(adapt(command))
    # what the commands left: artefacts, run directories, a report from the named inputs only
    for kind, name in (("heads", "tiny-random-xsum"), ("prompts", "tiny-random"), ("ppd_tree", "tiny-random"),
                       ("skip_set", "tiny-random-xsum")):
        assert (root / "outputs" / "artefacts" / kind / name / "meta.json").is_file(), (kind, name)
    assert len(list((root / "outputs" / "multirun").rglob("summary.json"))) >= 12 + 3 + 2 + 2
    # docs/usage.md's submitit_local sweep ran its jobs through submitit (the only test that runs it)
    (submitit,) = (root / "outputs" / "multirun").rglob(".submitit")
    summaries = list(submitit.parent.glob("*/summary.json"))
    assert len(summaries) == 2 and all(json.loads(p.read_text())["methods"]["vanilla"]["new_tokens"] >= 1
                                       for p in summaries) and list(submitit.iterdir())
    index = (root / "outputs" / "report" / "index.html").read_text()
    assert "from 0 run directories" not in index and "(outputs/multirun)" in index
