"""Save selfspec's W&B dashboard (a workspace of panels comparing methods) to a project.

    python scripts/wandb_dashboard.py --entity ENTITY --project selfspec
    python scripts/wandb_dashboard.py --markdown outputs/report/dashboard.md   # the layout only, offline

The layout is :data:`selfspec.reporting.dashboard.SECTIONS`; saving needs ``pip install
wandb-workspaces`` and a W&B API key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from selfspec.reporting.dashboard import build_workspace, write_markdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entity", help="W&B entity (user or team) owning the project")
    p.add_argument("--project", default="selfspec", help="W&B project (default: selfspec, as conf/logger/wandb.yaml)")
    p.add_argument("--markdown", type=Path, help="write the layout as Markdown here instead of saving it")
    args = p.parse_args(argv)
    if args.markdown:
        print(write_markdown(args.markdown))
        return 0
    if not args.entity:
        p.error("--entity is required to save the workspace (or use --markdown PATH)")
    workspace = build_workspace(args.entity, args.project)
    workspace.save()
    print(f"saved W&B workspace {workspace.name!r} to {args.entity}/{args.project}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
