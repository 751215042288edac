"""The main job on the embedded default (``make demo``): train, search, evaluate, report.

    python scripts/demo.py                          # SmolLM2-135M on CPU (docs/2026-11-27-cpu-results.md: measured time)
    python scripts/demo.py --model tiny-random --small --out /tmp/demo   # the pipeline in ~1 min
    python scripts/demo.py --skip-search bo         # the paper's timed BO for the skip set (slower)

Steps, each the entry function of the project's own command, on the config that command would
compose (``selfspec.config.compose`` with the same Hydra overrides, small budgets), so there is one
source of truth per step and no interpreter start-up between steps. The model is loaded once and
handed to every step (``run_job(cfg, loaded)``, ``evaluate(cfg, out, loaded)``):

1. fetch the offline assets                     selfspec.store.assets.fetch_all      (make assets)
2. AdaDecode heads (mixed-domain data)          selfspec.train.run_job         (job=heads job.data=mixed)
3. Draft & Verify skip set (CNN/DM + XSum dev)  selfspec.train.run_job         (job=skips job.tasks=[cnndm,xsum]
                                                job.search=bo_model: BO on the cost model, nothing timed
                                                per candidate; --skip-search bo for the paper's timed BO)
4. PPD prompt tokens, then the sparse tree      selfspec.train.run_job         (job=prompts ; job=ppd_tree)
5. vanilla, AdaDecode, Draft & Verify, PPD, DEL, n-gram drafts and the transformers peers on a few
   examples of each task, interleaved in one job per task        selfspec.evaluation.evaluate   (python -m selfspec.evaluate)
   then sampling runs (XSum, HumanEval: the Draft & Verify paper's temperature and top-p; vanilla,
   AdaDecode, Draft & Verify, PPD, DEL, n-gram): rows labelled "lossless (distribution)", PPD's lossy (†)
   then every run projected onto the shipped profiles of its model's shape (the H100 and H200
   ones among them)                              selfspec.project.run_projection (python -m selfspec.project)
6. the runtime benchmark: v(k), prefill, vanilla vs generate, bandwidth  (make bench-runtime)
7. tables, plots, index.html                    selfspec.report.run_report     (python -m selfspec.report)

Each step prints the equivalent command line and its wall time; the last lines list every step's
time and CPU time, and the machine's load average (``os.getloadavg``) at the start and the end:
other work on the machine slows every step's wall time, while its CPU time stays about the same.
Then, per task run and method with a cost ledger, its speedup in words
(:func:`selfspec.reporting.breakdown.in_words`: ``AdaDecode 0.72× = τ 1.21 / 1.68 steps (verification
1.00, exit heads 0.31, ...)``).
Long steps show tqdm bars with an ETA on stderr (heads data, training steps, skip-search
evaluations, examples; ``--no-progress`` turns them off); log lines print above the bars.
Each job runs inside its own run directory (W&B writes there).

Everything is logged to W&B offline (``logger=wandb``, ``WANDB_MODE=offline``; ``wandb sync``
uploads later, as the demo's last lines say) and written under ``--out`` (artefacts in ``<out>/artefacts``, runs and the report
in ``<out>/demo/<time>/``). The last lines printed say where the report is and the headline speedups.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("xsum", "cnndm", "humaneval", "gsm8k", "mtbench")
PEERS = ("hf_generate", "hf_prompt_lookup", "hf_early_exit")
#: sampling settings as in the papers (temperature, top-p): Draft & Verify Table 1 for text
#: (conf/experiment/dv_text.yaml) and Table 2 for code (conf/experiment/dv_code.yaml). AdaDecode
#: reports greedy decoding only and PPD's non-greedy rows use the model's default temperature, so
#: every method's sampling row here uses the Draft & Verify setting of the task
SAMPLING = {"xsum": (0.2, 0.85), "cnndm": (0.2, 0.85), "humaneval": (0.6, 0.95)}
#: the methods compared with AdaDecode (the method under test) and vanilla in every task's job: the
#: other three papers' methods (DEL with the mixed-domain heads trained in step 2) and n-gram drafts
METHODS = ("draft_verify", "ppd", "del_heads", "ngram")
#: methods of the sampling runs (besides vanilla and AdaDecode): the lossless ones and PPD (typical
#: acceptance, lossy)
SAMPLING_METHODS = METHODS

#: budgets per step: "full" is the demo on the embedded default, "small" exercises the pipeline
BUDGETS = {
    "full": {
        "heads": ["job.n_prompts=15", "job.n_heldout=5", "job.gen_tokens=32", "job.steps=100",
                  "job.eval_every=50", "job.ckpt_every=50", "job.max_prompt_tokens=256"],
        # the cost-model BO: 30 suggestions, each scored without timing (a smaller acquisition
        # optimiser: ~4x cheaper per suggestion at 2L = 60); the timed BO: job.iterations=8 and
        # job.max_new_tokens=16 fit the budget (--skip-search bo)
        "skips": ["job.iterations=30", "job.n_prompts=4", "job.max_new_tokens=16", "job.max_prompt_tokens=256",
                  "job.acq_n_random=2000", "job.acq_n_smart=2"],
        "skips_bo": ["job.iterations=8", "job.n_prompts=4", "job.max_new_tokens=16", "job.max_prompt_tokens=256"],
        # 40 steps: a step costs ~12 CPU-s on 2 cores (backward through the whole model at 192 tokens);
        # at 80 steps this was the demo's most expensive step (docs/2026-11-27-cpu-results.md: measured step times)
        "prompts": ["job.steps=40", "job.n_conversations=200", "job.held_out=8", "job.context_length=192",
                    "job.eval_every=20", "job.ckpt_every=20"],
        "ppd_tree": ["job.sizes=[1,2,4,8,16]", "job.n_prompts=3", "job.max_new_tokens=24"],
        # 32 tokens: nine methods and peers (hf_early_exit alone ~4x vanilla's time here) on five
        # tasks, greedy, then six methods sampled on two tasks, fit the 20-minute budget; warm-up
        # generations only need to touch every code path once (8 tokens)
        "evaluate": {"n": 3, "max_new_tokens": 32, "warmup": 1, "warmup_max_new_tokens": 8},
    },
    "small": {
        "heads": ["job.n_prompts=4", "job.n_heldout=2", "job.gen_tokens=8", "job.gen_batch=4", "job.steps=4",
                  "job.eval_every=4", "job.ckpt_every=4", "job.log_every=2", "job.max_prompt_tokens=64"],
        "skips": ["job.iterations=2", "job.n_prompts=2", "job.max_new_tokens=6", "job.max_prompt_tokens=64",
                  "job.plot=false", "job.acq_n_random=200", "job.acq_n_smart=0"],
        "skips_bo": ["job.iterations=2", "job.n_prompts=2", "job.max_new_tokens=6", "job.max_prompt_tokens=64",
                     "job.plot=false"],
        "prompts": ["job.steps=4", "job.n_conversations=12", "job.held_out=2", "job.context_length=64",
                    "job.inserts=4", "job.eval_inserts=4", "job.eval_every=4", "job.ckpt_every=4", "job.log_every=2"],
        "ppd_tree": ["job.sizes=[1,2,4]", "job.n_prompts=2", "job.max_new_tokens=6",
                     "job.latency_context=32", "job.plot=false"],
        # not a demo step: the documented commands' test budget (tests/test_readme.py) for `make draft-vocab`
        "draft_vocab": ["job.n_prompts=3", "job.n_heldout=2", "job.gen_tokens=8", "job.gen_batch=4",
                        "job.max_prompt_tokens=64", "job.sizes=[64,1024]"],
        "evaluate": {"n": 1, "max_new_tokens": 8, "warmup": 0, "warmup_max_new_tokens": 8},
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="conf/model name (default: the embedded SmolLM2-135M)")
    p.add_argument("--small", action="store_true", help="tiny budgets: checks the pipeline, not the speedups")
    p.add_argument("--out", type=Path, default=ROOT / "outputs", help="outputs root (artefacts, runs, report)")
    p.add_argument("--tasks", nargs="+", default=None, choices=TASKS, help=f"default: {' '.join(TASKS)}")
    p.add_argument("--n", type=int, default=None, help="examples per task (default: 3; --small: 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="token budget per example")
    p.add_argument("--logger", choices=("wandb", "none"), default="wandb", help="W&B (offline) or nothing")
    p.add_argument("--reuse-artefacts", action="store_true",
                   help="skip a training step whose artefact already exists under --out")
    p.add_argument("--skip-search", choices=("bo_model", "bo", "greedy"), default="bo_model",
                   help="Draft & Verify skip-set search: bo_model (BO on the cost model, default), bo (the "
                        "paper's BO of measured time per token), greedy (the layer-importance pass)")
    p.add_argument("--sampling", nargs="*", default=["xsum", "humaneval"], choices=sorted(SAMPLING),
                   help="tasks that also get a sampling run at the paper's temperature and top-p "
                        "(default: xsum humaneval; none: --sampling with no task)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars (stderr)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the model's dtype: auto (default) is bfloat16 where this CPU multiplies bfloat16 on its "
                        "dot-product units (AMX or AVX-512-BF16), else the model config's (choose_dtype)")
    return p.parse_args(argv)


def choose_dtype(requested: str, model: str) -> tuple[str, str]:
    """The demo's model dtype and why. ``auto``: on a CPU whose bfloat16 linears run on its
    dot-product units (:func:`selfspec.models.kernels.paths`: AMX tiles or VDPBF16PS) bfloat16,
    where a step reads half the bytes and a pass of several tokens multiplies on those units (on
    AMD Zen 4 a step measured 0.75 of float32's and an 8-token pass 1.8 steps, against float32's
    2.3; AMX, meant to make such a pass cost about a step, is not yet measured:
    docs/2026-12-01-bfloat16-on-the-cpu.md); elsewhere the model config's dtype (bfloat16 there
    would widen every value to float32: slower passes)."""
    from selfspec.config import model_config
    from selfspec.models import kernels

    configured = str(model_config(model).dtype)
    if requested != "auto":
        return requested, "as --dtype asked"
    paths = kernels.paths() or {}
    bf16 = paths.get("bfloat16")
    if bf16 in ("amx", "avx512_bf16"):
        units = "AMX tiles" if bf16 == "amx" else "AVX-512-BF16 dot products"
        return "bfloat16", (f"this CPU multiplies bfloat16 on its {units} (skinny_bf16 path {bf16}): a step reads half "
                            f"float32's bytes and a pass of several tokens multiplies on those units, not widened to "
                            f"float32 (--dtype float32 for the model config's {configured})")
    why = "the CPU kernels cannot run here" if not paths else "this CPU has no bfloat16 dot-product units"
    return configured, f"{why}, so the model config's {configured} (bfloat16 linears would widen to float32)"


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.budget = BUDGETS["small" if args.small else "full"]
        self.out = args.out.resolve()
        self.run_dir = self.out / "demo" / time.strftime("%Y-%m-%d_%H-%M-%S")
        self.group = f"demo-{self.run_dir.name}"
        self.timings: dict[str, float] = {}
        #: CPU seconds of this process per step (all threads): what the step costs without other load
        self.cpu: dict[str, float] = {}
        self.loaded = None  # the model every step shares, loaded by :meth:`load`
        self.progress = "false" if args.no_progress else "true"
        #: the model's dtype and why it was chosen (:func:`choose_dtype`), said before the first step
        self.dtype, self.dtype_reason = choose_dtype(args.dtype, args.model)

    # --- helpers ---------------------------------------------------------------------------------
    def common(self) -> list[str]:
        return [f"model={self.args.model}", f"model.dtype={self.dtype}", f"logger={self.args.logger}"] + (
            [f"logger.group={self.group}"] if self.args.logger == "wandb" else [])

    @contextlib.contextmanager
    def step(self, name: str, command: str, run_dir: Path | None = None):
        """Time a step and print its command line; inside ``run_dir`` (the job's run directory)."""
        print(f"\n=== {name}: {command}", flush=True)
        t0, c0 = time.perf_counter(), time.process_time()
        if run_dir is None:
            yield
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.chdir(run_dir):
                yield
        self.timings[name] = time.perf_counter() - t0
        self.cpu[name] = time.process_time() - c0
        print(f"=== {name} done in {self.timings[name]:.0f}s (CPU {self.cpu[name]:.0f}s)", flush=True)

    def artefact(self, kind: str, suffix: str | None = None) -> Path:
        name = f"{self.args.model}-{suffix}" if suffix else self.args.model
        return self.out / "artefacts" / kind / name

    def train(self, job: str, artefact: Path, extra: list[str] = ()) -> None:
        from selfspec.config import compose
        from selfspec.train import run_job

        if self.args.reuse_artefacts and (artefact / "meta.json").exists():
            print(f"=== {job}: reusing {artefact}")
            return
        budget = self.budget["skips_bo" if job == "skips" and self.args.skip_search == "bo" else job]
        overrides = [f"job={job}", *self.common(), *extra, *budget, f"progress={self.progress}"]
        cfg = compose(overrides, config_name="train")
        with self.step(f"train {job}", "python -m selfspec.train " + " ".join(overrides), self.run_dir / "train" / job):
            run_job(cfg, self.loaded)

    # --- steps -----------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model once; every step gets it (no reload per step)."""
        from selfspec.config import model_config
        from selfspec.models.loading import load_model

        with self.step("load model", f"model={self.args.model} model.dtype={self.dtype}"):
            cfg = model_config(self.args.model)
            cfg.dtype = self.dtype
            self.loaded = load_model(cfg)

    def fetch(self) -> None:
        from selfspec.store import assets

        with self.step("fetch assets", "python scripts/fetch_assets.py"):
            for name, path in assets.fetch_all().items():
                print(f"  {name:14s} {path}")

    def runtime(self) -> Path:
        """The runtime benchmark (``make bench-runtime``); its ``runtime.json`` joins the report's inputs."""
        from selfspec.evaluation.runtime import format_report, runtime_report
        from selfspec.store.files import write_json

        small = self.args.small
        cmd = f"python scripts/bench_runtime.py --model {self.args.model}" + (
            " --contexts 64 --ks 1,2,4 --repeats 1" if small else " --contexts 512 --repeats 5") + (
            f" -- model.dtype={self.dtype}")
        with self.step("runtime benchmark", cmd):
            report = runtime_report(self.loaded,
                                    (1, 2, 4) if small else (1, 2, 4, 8, 16, 32), (64,) if small else (512,),
                                    8 if small else 32, 1 if small else 5)
            print(format_report(report))
            out = self.run_dir / "runtime" / "runtime.json"
            write_json(out, report)  # atomic, every figure finite or null, as the report reads it
        return out.parent

    def train_all(self) -> None:
        self.train("heads", self.artefact("heads", "mixed"), ["job.data=mixed"])
        self.train("skips", self.artefact("skip_set"), ["job.tasks=[cnndm,xsum]", f"job.search={self.args.skip_search}"])
        self.train("prompts", self.artefact("prompts"))
        self.train("ppd_tree", self.artefact("ppd_tree"))

    def peers(self) -> list[str]:
        from selfspec.config import model_config

        peers = list(PEERS)
        cfg = model_config(self.args.model)
        layers = (cfg.get("random") or {}).get("num_hidden_layers")
        if layers is not None and layers <= 8:  # hf_early_exit drafts with the first 8 layers
            peers.remove("hf_early_exit")
        return peers

    def evaluate(self) -> Path:
        """One job per task: vanilla, AdaDecode (under test), Draft & Verify, PPD and the peers."""
        from selfspec.config import compose
        from selfspec.evaluation import evaluate

        ev = self.budget["evaluate"]
        sweep = self.run_dir / "eval"
        compare = ",".join([*METHODS, *self.peers()])
        shared = ["method=adadecode", "method.heads_task=mixed", f"compare=[{compare}]", *self.common(),
                  f"n_examples={self.args.n or ev['n']}",
                  f"max_new_tokens={self.args.max_new_tokens or ev['max_new_tokens']}",
                  f"warmup={ev['warmup']}", f"warmup_max_new_tokens={ev['warmup_max_new_tokens']}",
                  f"progress={self.progress}", "+report.table=main"]
        tasks = self.args.tasks or list(TASKS)
        jobs = [(task, f"{i}_{task}_{self.args.model}_adadecode", [f"task={task}", *shared])
                for i, task in enumerate(tasks)]
        # sampling runs: the lossless methods' rows "lossless (distribution)", PPD's lossy
        sampled = ",".join(SAMPLING_METHODS)
        for task in [t for t in tasks if t in (self.args.sampling or ())]:
            temperature, top_p = SAMPLING[task]
            overrides = [o.replace(f"compare=[{compare}]", f"compare=[{sampled}]") for o in shared]
            jobs.append((f"{task} T={temperature}", f"{len(jobs)}_{task}_{self.args.model}_adadecode_T{temperature}",
                         [f"task={task}", *overrides, f"sampling.temperature={temperature}",
                          f"sampling.top_p={top_p}"]))
        for name, run, overrides in jobs:
            out = sweep / run
            cfg = compose(overrides, config_name="evaluate")
            with self.step(f"evaluate {name}", "python -m selfspec.evaluate " + " ".join(overrides), out):
                evaluate(cfg, out, self.loaded)
        return sweep

    def project(self, sweep: Path) -> None:
        """The evaluation runs projected onto every shipped profile of their model's shape (the GPU
        profiles among them), which the report shows beside the measured speedups."""
        from selfspec.config import compose
        from selfspec.measure.profile import SHIPPED
        from selfspec.project import run_projection

        overrides = [f"inputs=[{sweep}]", f"profile={SHIPPED}"]
        with self.step("project", "python -m selfspec.project " + " ".join(overrides)):
            run_projection(compose(overrides, config_name="project"))

    def report(self, inputs: list[Path]):
        from selfspec.config import compose
        from selfspec.report import run_report

        t0, c0 = time.perf_counter(), time.process_time()
        cfg = compose([f"inputs=[{','.join(map(str, inputs))}]", f"output_dir={self.run_dir / 'report'}",
                       f"artefacts_dir={self.out / 'artefacts'}", "wandb.enabled=false"], config_name="report")
        result = run_report(cfg)
        self.timings["report"] = time.perf_counter() - t0
        self.cpu["report"] = time.process_time() - c0
        return result

    def main(self) -> int:
        from tqdm.contrib.logging import logging_redirect_tqdm

        t0, c0 = time.perf_counter(), time.process_time()
        load0 = load_average()
        print(f"=== dtype {self.dtype}: {self.dtype_reason}", flush=True)
        with logging_redirect_tqdm():  # log lines print above the progress bars, not through them
            self.fetch()
            self.load()
            self.train_all()
            sweep = self.evaluate()
            self.project(sweep)
            runtime = self.runtime()
            result = self.report([sweep, runtime])
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        print("\n=== timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in self.timings.items()) + f"; total {total:.0f}s")
        print("=== CPU seconds (this process, all threads): " + ", ".join(
            f"{k} {v:.0f}s" for k, v in self.cpu.items()) + f"; total {cpu:.0f}s")
        print(f"=== load average (1, 5, 15 min; {os.cpu_count()} CPUs): at the start {load0}, "
              f"at the end {load_average()}")
        from selfspec.reporting.tables import LINES_HEADING, ledger_lines

        spent = ledger_lines(result.records)
        if spent:  # per method with a cost ledger, its speedup in words
            print(LINES_HEADING)
            print("\n".join(f"  {line}" for line in spent))
        if self.args.logger == "wandb":
            print(f"W&B (offline) runs in group {self.group}; upload them with: "
                  f"find {self.run_dir} -type d -name 'offline-run-*' -exec wandb sync {{}} +")
        print(f"Report: {result.index}  (tables: {result.out_dir / 'tables'}, plots: {result.out_dir / 'plots'})")
        print("Headline speedups (vs vanilla, same examples):")
        for line in result.headline:
            print(f"  {line.split(' · ', 1)[1]}")
        return 0


def load_average() -> str:
    """The machine's 1-, 5- and 15-minute load averages (what ``uptime`` prints)."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    args = parse_args(argv)
    os.environ["SELFSPEC_OUTPUTS"] = str(args.out.resolve())  # default artefact paths of every step
    if args.logger == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
    return Demo(args).main()


if __name__ == "__main__":
    sys.exit(main())
