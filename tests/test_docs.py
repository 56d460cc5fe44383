"""The docs keep up with the code: the generated config reference is current, every shipped config
loads and validates, every subcommand's help has examples, and every `mspretrain ...` command
line shown in a help epilog or in docs/*.md parses with today's CLI."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mspretrain import config as cfgmod
from mspretrain.cli import COMMANDS, build_parser, main
from mspretrain.ops import config_doc

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def test_config_reference_is_up_to_date():
    path = DOCS / "config-reference.md"
    assert path.is_file(), f"docs/config-reference.md is missing; generate it with: {config_doc.REGENERATE}"
    assert path.read_text(encoding="utf-8") == config_doc.render(), (
        f"docs/config-reference.md is out of date with mspretrain/config.py; regenerate it with: {config_doc.REGENERATE}")


def test_every_config_field_is_documented():
    assert config_doc.undocumented() == [], (
        "add a # comment beside the field in config.py or an entry to MEANINGS in mspretrain/ops/config_doc.py")


def test_reference_lists_every_field_with_its_default():
    text = config_doc.render()
    base = cfgmod.Config()
    for section in cfgmod.SECTIONS:
        assert f"\n## {section}\n" in text
        for name in type(getattr(base, section)).__dataclass_fields__:
            assert f"| `{section}.{name}` |" in text
    # Spot-check values against the dataclasses, not against the renderer's own helpers.
    assert "| `optim.eps` | float | `1e-08` |" in text
    assert '| `schedule.warmup_steps` | int or string | `"auto"` |' in text
    assert "one of: fp32, fp16, bf16" in text


def test_comments_are_read_from_the_source():
    comments = config_doc.field_comments()
    assert comments["model.n_kv_heads"].startswith("0 = same as n_heads")
    assert comments["data.sources"].startswith("Corpus mixing")  # a comment block above the field
    assert "model.dim" not in comments  # no comment there: MEANINGS supplies it


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads_and_validates(path):
    cfg = cfgmod.load(path)
    cfgmod.validate(cfg)
    assert cfg.train.max_steps or cfg.train.max_tokens


def test_the_910b_config_is_the_field_reports_run():
    cfg = cfgmod.load(ROOT / "configs" / "llama2-7b-910b.toml")
    assert cfgmod.micro_batches(cfg, 8) == (1, 32)  # 256 = 1 x 32 accumulated x 8 devices
    assert (cfg.data.seq_len, cfg.train.global_batch, cfg.precision.dtype) == (2048, 256, "fp16")
    p = cfg.precision
    assert (p.init_scale, p.scale_warmup_to, p.scale_warmup_steps) == (64.0, 1024.0, 500)
    assert p.allreduce_dtype == "fp16"  # the field report's gradient compression, lm_head exempt
    assert (cfg.schedule.kind, cfg.schedule.warmup_steps) == ("cosine", "auto")
    assert (cfg.checkpoint.every, cfg.checkpoint.keep_last, cfg.device.target) == (1000, 10, "ascend")


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def _command_lines(text: str) -> list[str]:
    """`mspretrain ...` invocations in a block of text (comments and shell chaining removed)."""
    out = []
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip().lstrip("$ ").strip()
        for part in re.split(r"\s*(?:&&|;|\|)\s*", line):
            part = part.split("  #")[0].strip()
            if part.startswith("mspretrain ") and "..." not in part:
                out.append(part)
    return out


def _assert_parses(line: str, where: str) -> None:
    argv = shlex.split(line)[1:]
    name = next((a for a in argv if not a.startswith("-")), None)
    assert name in COMMANDS, f"{where}: unknown command in: {line}"
    parser = build_parser(name)
    try:
        _, extra = parser.parse_known_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: `{line}` does not parse (exit {exc.code})") from None
    bad = [e for e in extra if "=" not in e or e.startswith("-")]
    assert not bad, f"{where}: `{line}` has unrecognized arguments {bad}"


def test_top_level_help_lists_every_command(capsys):
    out = _help(capsys, ["--help"])
    for name in COMMANDS:
        assert f"    {name}" in out
    assert "examples:" in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_subcommand_help_has_examples_that_parse(capsys, name):
    out = _help(capsys, [name, "--help"])
    assert "usage: mspretrain " + name in out
    epilog = out.split("examples:", 1)
    assert len(epilog) == 2, f"`mspretrain {name} --help` has no examples epilog (EXAMPLES in mspretrain/commands/{name}.py)"
    lines = _command_lines(epilog[1])
    assert any(shlex.split(line)[1] == name for line in lines), f"`mspretrain {name} --help` shows no `mspretrain {name} ...` example"
    for line in lines:
        _assert_parses(line, f"`mspretrain {name} --help`")


DOC_FILES = sorted(DOCS.glob("*.md"))


def shell_blocks(text: str) -> list[str]:
    """Bodies of the fenced ```bash / ```sh / ```console / unlabeled code blocks of a Markdown text."""
    blocks, body, lang = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, lang = [], line[3:].strip()
            else:
                if lang in ("", "bash", "sh", "console"):
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def test_shell_blocks_reads_fences():
    text = "a\n```bash\nmspretrain eval r\n```\nmspretrain sets x\n```python\nmspretrain = 1\n```\n"
    assert shell_blocks(text) == ["mspretrain eval r"]


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_commands_in_the_docs_parse(path):
    for block in shell_blocks(path.read_text(encoding="utf-8")):
        for line in _command_lines(block):
            _assert_parses(line, str(path.relative_to(ROOT)))
