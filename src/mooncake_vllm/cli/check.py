"""``mooncake-vllm check``: check a deployment before and after moving to vLLM V1.

Exit codes: 0 clean, 2 warnings only, 3 blocking errors, 1 the tool failed
(bad input). Nothing imports vLLM; an offline check takes well under 0.5 s.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit codes: 0 clean, 2 warnings only, 3 blocking errors, 1 the tool itself failed (bad input). "
                     "Rules: --list-rules; silence one with --ignore ID.")
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="launch scripts, mooncake*.json configs, env files or directories "
                             "(default: the current environment and installed packages)")
    parser.add_argument("--target-vllm", metavar="X.Y.Z", help="check against this vLLM (default: the installed one)")
    parser.add_argument("--target-mooncake", metavar="X.Y.Z",
                        help="check against this Mooncake (default: the installed one)")
    parser.add_argument("--format", choices=("text", "json", "markdown"), default="text", help="output format")
    parser.add_argument("--fix", metavar="OUTDIR",
                        help="write the migrated V1 mooncake_config.json and launch_v1.sh into OUTDIR")
    parser.add_argument("--force", action="store_true", help="let --fix overwrite existing files")
    parser.add_argument("--probe", action="store_true",
                        help="also run live checks (master, metadata, stale entries, RDMA devices, libraries)")
    parser.add_argument("--timeout", type=float, default=1.0, metavar="S", help="seconds per live probe (default 1)")
    parser.add_argument("--ignore", action="append", default=[], metavar="ID",
                        help="silence a rule by ID or name (repeatable, or comma-separated)")
    parser.add_argument("--list-rules", action="store_true", help="print the rule catalogue and exit")


def _list_rules() -> str:
    from mooncake_vllm.checker.catalogue import RULES

    return "".join(f"{r.id}  {r.severity:<7}  {r.name}{'  (--probe)' if r.probe else ''}\n" for r in RULES.values())


def run(args: argparse.Namespace) -> int:
    """Run the check; print the report to stdout, tool errors to stderr."""
    from mooncake_vllm.errors import ConfigError, UnsupportedVersionError

    if args.list_rules:
        sys.stdout.write(_list_rules())
        return 0
    from mooncake_vllm.checker import render, run_check
    from mooncake_vllm.checker.report import EXIT_TOOL

    try:
        if args.fix:
            from mooncake_vllm.checker.fix import check_outdir

            check_outdir(args.fix, force=args.force)
        result, ctx = run_check(args.paths, target_vllm=args.target_vllm, target_mooncake=args.target_mooncake,
                                probe=args.probe, ignore=args.ignore, timeout=args.timeout)
        written: list[str] = []
        notes: list[str] = []
        if args.fix:
            from mooncake_vllm.checker.fix import write_migration

            written = write_migration(ctx, args.fix, force=args.force, notes=notes)
    except ConfigError as exc:  # bad input: one message listing every problem
        count = len(exc.problems)
        problems = "\n".join(f"  - {p}" for p in exc.problems)
        print(f"mooncake-vllm check: cannot check {exc.source}: {count} problem{'s' * (count != 1)}\n{problems}",
              file=sys.stderr)
        return EXIT_TOOL
    except (UnsupportedVersionError, OSError) as exc:
        print(f"mooncake-vllm check: {exc}", file=sys.stderr)
        return EXIT_TOOL
    sys.stdout.write(render(result, args.format))
    for note in notes:
        print(note, file=sys.stderr)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return result.exit_code
