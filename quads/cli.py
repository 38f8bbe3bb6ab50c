"""The ``quads`` command line: ``quads train | compare | diagnose | eval | pretrain | outliers | bench | export``.

Each subcommand lives in the module named in ``COMMANDS`` and exposes ``register(parser)`` (add its
flags to an ``argparse`` sub-parser) and ``run(args) -> int``. Only the module of the command being run is
imported (most import torch, a second or more), so ``quads --help`` stays fast and one broken optional
dependency does not take down every command.

Exit codes: 0 done, 2 a user mistake (``quads.errors.UsageError``, raised at any depth, printed as one
line), 130 interrupted (Ctrl-C; one line), anything else as the command documents.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("quads.rl.cli", "GRPO training with a quantized rollout engine (the main job)"),
    "compare": ("quads.experiments.compare", "run several recipes with the same seeds and data; one report"),
    "diagnose": ("quads.experiments.diagnose", "decompose the rollout/trainer log-prob gap by error source"),
    "eval": ("quads.evaluate", "pass@k of a checkpoint on a task's held-out split or a dataset file"),
    "pretrain": ("quads.pretrain_cli", "supervised warm start of the built-in model on a task"),
    "outliers": ("quads.outliers_cli", "inject activation outlier channels into a checkpoint (same BF16 function)"),
    "bench": ("quads.bench", "GPU kernel and engine benchmarks against cuBLAS BF16 / FP8"),
    "export": ("quads.export", "export a trained policy as an NVFP4 checkpoint serving engines load"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` (default ``sys.argv[1:]``) gets its flags."""
    from quads import __version__

    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)

    parser = argparse.ArgumentParser(
        prog="quads",
        description="NVFP4 rollouts that are safe for GRPO of Mixture-of-Experts models.",
    )
    parser.add_argument("--version", action="version", version=f"quads {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name != chosen:
            continue
        try:
            importlib.import_module(module).register(p)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith(module.rsplit(".", 1)[0]):
                raise
            p.set_defaults(_missing=f"`quads {name}` is not available in this build ({e.name} missing)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    from quads.errors import UsageError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except UsageError as e:
        print(f"quads {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"quads {args.command}: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
