"""The ``mooncake-vllm`` command line.

Each subcommand lives in its own module ``mooncake_vllm.cli.<module>`` exposing
``configure(parser)`` and ``run(args) -> int``. Modules are imported only when
their command runs, so ``mooncake-vllm check`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

#: command name -> (module under mooncake_vllm.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("up", "start a local Mooncake stack (master, metadata, pool holder) on loopback"),
    "demo": ("demo", "run the end-to-end demo on the embedded local stack"),
    "check": ("check", "check a Mooncake+vLLM deployment before and after moving to V1"),
    "proxy": ("proxy", "run the XpYd prefill/decode proxy"),
    "metadata": ("metadata", "inspect and clean Transfer Engine metadata (list, gc, serve)"),
    "holder": ("holder", "run a process that holds pool memory for vLLM instances"),
    "doctor": ("doctor", "report installed vLLM / Mooncake versions and the engine path"),
    "pool": ("pool", "list, measure and clear the pool's key namespaces (namespaces, stats, clear)"),
}


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    from mooncake_vllm import __version__

    parser = argparse.ArgumentParser(
        prog="mooncake-vllm",
        description="One MooncakeStoreConnector for every vLLM, on Mooncake's KV-cache pool.",
    )
    parser.add_argument("--version", action="version", version=f"mooncake-vllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # configure only the command that runs: imports stay lazy
            _load(module).configure(sp)
    return parser


def _load(module: str):  # noqa: ANN202 - returns a module
    return importlib.import_module(f"mooncake_vllm.cli.{module}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mooncake-vllm`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(args_list)
    args = parser.parse_args(args_list)
    if not args.command:
        parser.print_help()
        return 1
    module = _load(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
