"""The docs keep up with the code: the generated config reference is current, every shipped config
loads and validates, every subcommand's help has examples, and every `mspretrain ...` command
line shown in a help epilog or in docs/*.md parses with today's CLI."""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from mspretrain import budget
from mspretrain.cli import COMMANDS, build_parser, main
from mspretrain.config import doc as config_doc
from mspretrain.config import schema as cfgmod

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def test_config_reference_is_up_to_date():
    path = DOCS / "config-reference.md"
    assert path.is_file(), f"docs/config-reference.md is missing; generate it with: {config_doc.REGENERATE}"
    assert path.read_text(encoding="utf-8") == config_doc.render(), (
        f"docs/config-reference.md is out of date with mspretrain/config/schema.py; regenerate it with: {config_doc.REGENERATE}")


def test_every_config_field_is_documented():
    assert config_doc.undocumented() == [], (
        "add a # comment beside the field in config/schema.py or an entry to MEANINGS in mspretrain/config/doc.py")


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
    # 256 = 4 x 8 accumulated x 8 devices: micro-batch 4 with ZeRO-2 (peak 45.6 of 58 GB, docs/operators.md)
    assert budget.micro_batches(cfg, 8) == (4, 8)
    assert cfg.optim.shard_optimizer and cfg.optim.shard_gradients and cfg.train.recompute
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


# ----------------------------------------------------------------------------------------------
# Every command block in the docs runs, and the numbers it prints are the numbers the docs show.
#
# A ```console block is a session: `$ command` lines, each followed by its output. Each session
# of the docs is either run here (and its output compared line by line, numbers at the precision
# the docs print them) or excluded below with the reason. A new session that is neither fails
# `test_every_console_session_is_run_or_excluded`.

def console_sessions(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every `$ ` line of the ```console blocks of a text."""
    out: list[tuple[str, list[str]]] = []
    body, lang = None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, lang = [], line[3:].strip()
            else:
                body, lang = None, ""
            continue
        if body is None or lang != "console":
            continue
        if line.startswith("$ "):
            out.append((line[2:].strip(), []))
        elif out and line.strip():
            out[-1][1].append(line)
    return out


def test_console_sessions_reads_commands_and_their_output():
    text = "x\n```console\n$ a 1\nout 1\n\n$ b\nout 2\n```\n```bash\n$ c\n```\n"
    assert console_sessions(text) == [("a 1", ["out 1"]), ("b", ["out 2"])]


# Output that is not a property of the code: speeds, durations, ages, dates, scratch paths.
# Everything else in a line (losses, perplexities, counts, parameter numbers) must match exactly
# as printed, i.e. at the precision the docs show.
VOLATILE = (r"[\d,]+ tok/s", r"mfu [\d.]+%", r"eta \S+", r"\b\d+(?:\.\d+)? s\)", r"[\d.]+ tokens/s", r"\d+(?:\.\d+)?(?:s|m|h)(?=\s+\w+$)",
            r"/tmp/\S+", r"\d+\.\d+ minutes")


def line_pattern(expected: str) -> re.Pattern:
    """A doc output line as a regex: the volatile parts are wildcards, the rest is literal."""
    parts, pos = [], 0
    spans = sorted((m.start(), m.end()) for v in VOLATILE for m in re.finditer(v, expected))
    for start, end in spans:
        if start < pos:
            continue
        parts.append(re.escape(expected[pos:start]))
        parts.append(r".+?")
        pos = end
    parts.append(re.escape(expected[pos:]))
    return re.compile("".join(parts).replace(r"\ ", r"\s+"))


def test_line_pattern_keeps_numbers_and_masks_timings():
    p = line_pattern("step 5/40 | loss 6.1547 | lr 9.94e-04 | gnorm 1.504 | 366 tok/s | mfu 1.0% | eta 3m53s")
    assert p.fullmatch("step 5/40 | loss 6.1547 | lr 9.94e-04 | gnorm 1.504 | 1,022 tok/s | mfu 2.8% | eta 0m51s")
    assert not p.fullmatch("step 5/40 | loss 6.1548 | lr 9.94e-04 | gnorm 1.504 | 366 tok/s | mfu 1.0% | eta 3m53s")
    p = line_pattern("kept 1,200 of 1,200 documents (34,800 characters, 0.4 s)")
    assert p.fullmatch("kept 1,200 of 1,200 documents (34,800 characters, 2.6 s)")
    assert not p.fullmatch("kept 1,199 of 1,200 documents (34,800 characters, 0.4 s)")


def compare_output(expected: list[str], actual: str, where: str) -> list[str]:
    """The expected lines that no line of `actual` matches, in order (a `...` line skips ahead)."""
    lines = [ln.rstrip() for ln in actual.splitlines()]
    missing, i = [], 0
    for exp in expected:
        if exp.strip() == "..." or exp.strip() == "^C":
            continue
        pat = line_pattern(exp.rstrip())
        j = next((k for k in range(i, len(lines)) if pat.fullmatch(lines[k])), None)
        if j is None:
            missing.append(f"{where}: {exp}")
        else:
            i = j + 1
    return missing


def transcript(text: str) -> dict[str, list[str]]:
    """`$ command` -> its outputs in order (a command may run twice), from a transcript in the
    walkthrough's format."""
    out: dict[str, list[str]] = {}
    for chunk in ("\n" + text).split("\n$ ")[1:]:
        cmd, _, rest = chunk.partition("\n")
        out.setdefault(cmd.strip(), []).append(rest)
    return out


# Sessions not run here, and why. Keys are (doc, command prefix).
EXCLUDED: dict[tuple[str, str], str] = {
    ("quickstart.md", "mspretrain demo"): "downloads the corpus (85 MB) and trains for minutes; the demo's numbers are "
                                          "measured by the demo itself and recorded in docs/benchmarks.md",
    ("operators.md", "mspretrain selftest"): "a minute of checks; tests/preflight/test_selftest.py runs it",
    ("operators.md", "msrun "): "two MindSpore workers and a scheduler (minutes at load); tests/train/test_distributed.py runs msrun",
    ("operators.md", "mspretrain checkpoints runs/rec"): "needs a checkpoint corrupted by hand; tests/checkpoint/test_checkpoint_verify.py does that",
    ("operators.md", "mspretrain recover runs/rec"): "the same corrupted run dir; tests/checkpoint/test_checkpoint.py runs recover",
    ("operators.md", "mspretrain checkpoints runs/mine"): "ages of a 15-minute-old run; the same table is compared in quickstart.md",
    ("operators.md", "mspretrain diagnose msrun_log"): "the log dir of the msrun rehearsal (excluded above)",
    ("operators.md", "cat runs/dp/ranks/"): "the run dir of the msrun rehearsal (excluded above)",
    ("operators.md", "mspretrain train"): ("--cpu-quota and profiling runs; tests/preflight/test_isolate.py and "
                                     "tests/monitor/test_profiler.py run them"),
    ("operators.md", "mspretrain report"): "the quick start's report, compared there",
    ("operators.md", "mspretrain doctor --config"): "shows the Ascend failure of a CPU box in part (`...`); the disk check is "
                                                    "tests/docs/test_doc_promises.py::test_doctor_takes_the_checkpoint_size_from_the_plan",
}


def _excluded(doc: str, command: str) -> str | None:
    return next((why for (d, prefix), why in EXCLUDED.items() if d == doc and command.startswith(prefix)), None)


# Run here: the quick start (scripts/walkthrough.sh is its sessions 1-6; then, in doc order, every
# other session of quickstart.md it runs, with the ```bash blocks of its two "Continue from" sections,
# in one copy of its workdir) with from-pytorch.md's round trip, the doctor's list of checks and the
# plans (pure arithmetic, deterministic to the digit).
RUN_BY_WALKTHROUGH = ("ls ", "head ", "cp ", "mspretrain prepare", "mspretrain train", "mspretrain checkpoints", "mspretrain eval",
                      "mspretrain generate", "mspretrain export", "python load_hf.py", "mspretrain report", "mspretrain convert",
                      "mspretrain tokenizer extend", "python scripts/tiny_hf_model.py", "python load_qwen.py")
# The sections whose ```bash blocks run too (in order with their sessions): a model made with
# transformers, then the commands on it
BASH_SECTIONS = ("## Continue from a published model", "## Continue from Qwen2.5 / Llama-3")


def _how_run(doc: str, command: str) -> str | None:
    if doc in ("quickstart.md", "from-pytorch.md") and command.startswith(RUN_BY_WALKTHROUGH) and not _excluded(doc, command):
        return "walkthrough"
    if command.startswith("mspretrain plan") or command == "mspretrain doctor" or command.startswith("mspretrain diagnose tests/"):
        return "direct"
    return None


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_every_console_session_is_run_or_excluded(path):
    for command, _ in console_sessions(path.read_text(encoding="utf-8")):
        assert _how_run(path.name, command) or _excluded(path.name, command), (
            f"{path.name}: `$ {command}` is neither run by tests/docs/test_docs.py nor in its EXCLUDED table with a reason")


def _direct_sessions() -> list[tuple[str, str, list[str]]]:
    return [(p.name, cmd, exp) for p in DOC_FILES for cmd, exp in console_sessions(p.read_text(encoding="utf-8"))
            if _how_run(p.name, cmd) == "direct"]


@pytest.mark.parametrize("doc,command,expected", _direct_sessions(), ids=[f"{d}: {c}" for d, c, _ in _direct_sessions()])
def test_direct_sessions_print_what_the_docs_show(doc, command, expected, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    command, _, pipe = command.partition(" | ")
    argv = shlex.split(command)[1:]
    main(argv)
    out = capsys.readouterr()
    actual = out.out + out.err
    if pipe:  # the one filter the docs use: `| grep -E PATTERN`
        grep = shlex.split(pipe)
        assert grep[:2] == ["grep", "-E"] and len(grep) == 3, f"{doc}: run `{pipe}` here, or add the session to EXCLUDED"
        actual = "\n".join(line for line in actual.splitlines() if re.search(grep[2], line))
    if argv == ["doctor"]:
        # the machine's versions and free space differ; the checks (status and name) must not
        expected = [e.split(":")[0] for e in expected if e.startswith("[")]
        actual = "\n".join(a.split(":")[0] for a in actual.splitlines() if a.startswith("["))
        assert len(expected) == len(actual.splitlines()), \
            f"{doc}: `{command}` prints {len(actual.splitlines())} checks, the docs show {len(expected)}"
        expected = [re.sub(r"^\[\s*(ok|warn|fail)\s*\]\s*", "", e) for e in expected]
        actual = "\n".join(re.sub(r"^\[\s*(ok|warn|fail)\s*\]\s*", "", a) for a in actual.splitlines())
    missing = compare_output(expected, actual, f"{doc}: $ {command}")
    assert not missing, "lines the docs show that the command did not print:\n" + "\n".join(missing) + "\n--- actual:\n" + actual


def quickstart_steps(text: str) -> list[tuple[str, str]]:
    """("cmd", command) for each console session and ("bash", body) for each ```bash block of
    BASH_SECTIONS, in the order of the page; ("file", python) for a ```python block whose first
    line names the file the page runs (`# load_qwen.py`)."""
    steps: list[tuple[str, str]] = []
    body, lang, section = None, "", ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line.strip()
        if line.startswith("```"):
            if body is None:
                body, lang = [], line[3:].strip()
                continue
            if lang == "bash" and section in BASH_SECTIONS:
                steps.append(("bash", "\n".join(body)))
            elif lang == "python" and body and re.fullmatch(r"# \w+\.py", body[0].strip()):
                steps.append(("file", "\n".join(body)))
            body = None
            continue
        if body is not None:
            body.append(line)
            if lang == "console" and line.startswith("$ "):
                steps.append(("cmd", line[2:].strip()))
    return steps


def test_quickstart_steps_reads_sessions_bash_blocks_and_named_files():
    text = ("## 1\n```bash\nmake\n```\n```console\n$ a\nout\n```\n## Continue from a published model\n"
            "```bash\nx=1\n```\n```python\n# l.py\nprint(1)\n```\n```python\nprint(2)\n```\n```console\n$ python l.py\n```\n")
    assert quickstart_steps(text) == [("cmd", "a"), ("bash", "x=1"), ("file", "# l.py\nprint(1)"), ("cmd", "python l.py")]


@pytest.fixture(scope="module")
def walkthrough_transcript(walkthrough, tmp_path_factory) -> dict[str, list[str]]:
    """The session's run of scripts/walkthrough.sh (the quick start, sessions 1-6, conftest
    `walkthrough`), then in a copy of its workdir, in the page's order, every other session of
    quickstart.md that is run here (the runs/longer copy of section 4, the inspect and report of
    section 7, both "Continue from" sections with their ```bash blocks and load_qwen.py), then
    from-pytorch.md's round trip: the pages followed literally, each command on what the ones
    before it left."""
    import os
    import shutil
    import subprocess
    import sys

    done, text = walkthrough
    work = tmp_path_factory.mktemp("docs-walkthrough") / "work"
    shutil.copytree(done, work, symlinks=True)
    # the page runs from the repo root: the two repo paths it names
    (work / "scripts").symlink_to(ROOT / "scripts")
    (work / "mspretrain" / "eval").mkdir(parents=True)
    (work / "mspretrain" / "eval" / "data").symlink_to(ROOT / "mspretrain" / "eval" / "data")
    env = dict(os.environ, GLOG_v="3")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    ran = transcript(text)
    steps = [(doc, *step) for doc in ("quickstart.md", "from-pytorch.md") for step in quickstart_steps((DOCS / doc).read_text(encoding="utf-8"))]
    for _doc, kind, body in steps:  # the scripts the pages give (load_qwen.py), written before anything runs
        if kind == "file":
            first, _, rest = body.partition("\n")
            (work / first[2:].strip()).write_text(rest + "\n", encoding="utf-8")
    for doc, kind, body in steps:
        if kind == "file":
            continue
        if kind == "cmd" and (body in ran or _how_run(doc, body) != "walkthrough"):
            continue  # run by walkthrough.sh, or not run here (plans: compared directly; the demo: excluded)
        argv = ["bash", "-euo", "pipefail", "-c", body] if kind == "bash" else shlex.split(body)
        more = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        out = more.stdout + more.stderr
        assert more.returncode == 0 and "Traceback" not in out, f"{doc}: `{body[:200]}` failed:\n{out[-3000:]}"
        if kind == "cmd":
            ran.setdefault(body, []).append(out)
    return ran


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart.md", "from-pytorch.md"])
def test_walkthrough_sessions_print_what_the_docs_show(walkthrough_transcript, name):
    """Every quick-start session (and from-pytorch's round trip), against the real run. The Ctrl-C
    lands at step 10-16 depending on timing: lines that name the stop step are compared only
    when the run stopped where the docs did."""
    ran = walkthrough_transcript
    doc = (DOCS / name).read_text(encoding="utf-8")
    missing = []
    stop_doc = re.search(r"stopped by SIG\w+ after step (\d+)", doc)
    stop_run = re.search(r"stopped by SIG\w+ after step (\d+)", "\n".join(o for outs in ran.values() for o in outs))
    same_stop = bool(stop_doc and stop_run and stop_doc.group(1) == stop_run.group(1))
    seen: dict[str, int] = {}
    for command, expected in console_sessions(doc):
        if _how_run(name, command) != "walkthrough":
            continue
        assert command in ran, f"{name}: `$ {command}` is not in the walkthrough's transcript"
        k = seen[command] = seen.get(command, -1) + 1  # the k-th time the docs run it is the k-th time the run did
        output = ran[command][min(k, len(ran[command]) - 1)]
        if not same_stop and stop_doc:
            stop = int(stop_doc.group(1))
            names_stop = rf"\b(step_{stop:06d}|step {stop}\b|step {stop + 1}\b|steps {stop + 1}-|steps \d+-{stop}\b|SIG)"
            expected = [e for e in expected if not re.search(names_stop, e)
                        and not (command.startswith("mspretrain checkpoints") or "tokens seen" in e or e.startswith("done: step"))]
            if stop_run and k > 0:
                # The Ctrl-C lands late on a fast box (step 13-16 seen): the resumed run's first line
                # is step stop+1 without throughput, and it never prints the steps before it. Lines
                # after that are the same whatever the stop (exact resume), so they are still compared.
                late = int(stop_run.group(1)) + 1
                expected = [e for e in expected if not ((m := re.match(r"step (\d+)/", e)) and int(m.group(1)) <= late)]
        missing += compare_output(expected, output, f"{name}: $ {command}")
    assert not missing, f"lines {name} shows that the run did not print:\n" + "\n".join(missing)


# ----------------------------------------------------------------------------------------------
# The raw msrun lines of the docs and `mspretrain launch` run msrun alike.

def msrun_lines(text: str) -> list[str]:
    """Every msrun invocation in a Markdown text's code blocks (any language: a launch transcript
    in a ```text block counts), continuation lines joined."""
    out, body = [], None
    for line in text.splitlines():
        if not line.startswith("```"):
            if body is not None:
                body.append(line)
            continue
        if body is None:
            body = []
            continue
        for ln in "\n".join(body).replace("\\\n", " ").splitlines():
            ln = " ".join(ln.split()).removeprefix("$ ")
            if ln.startswith("msrun "):
                out.append(ln)
        body = None
    return out


def test_msrun_lines_reads_blocks_and_continuations():
    text = "msrun --a prose\n```bash\nmsrun --x=1 \\\n  --y=2 prog\n# msrun no\n```\n```text\n$ msrun --z=3 p\n```\n"
    assert msrun_lines(text) == ["msrun --x=1 --y=2 prog", "msrun --z=3 p"]


def test_every_documented_msrun_line_carries_launchs_cluster_timeout():
    """A raw msrun line without --cluster_time_out waits on msrun's own default for a missing rank;
    `launch` passes CLUSTER_TIMEOUT_S. Every line in the docs and the README must agree with it."""
    from mspretrain.parallel.distributed import CLUSTER_TIMEOUT_S, msrun_command

    flag = f"--cluster_time_out={CLUSTER_TIMEOUT_S}"
    assert flag in shlex.split(msrun_command(8, ["train"]))  # launch's own line
    texts = {path.name: path.read_text(encoding="utf-8") for path in [*DOC_FILES, ROOT / "README.md"]}
    # the commands' --help examples are documentation too (as a code block: their lines are indented)
    for name in COMMANDS:
        examples = getattr(importlib.import_module(f"mspretrain.commands.{name}"), "EXAMPLES", "")
        texts[f"mspretrain {name} --help"] = "```\n" + examples + "\n```"
    found = {}
    for where, text in texts.items():
        for line in msrun_lines(text):
            found[where] = found.get(where, 0) + 1
            words = line.split()
            assert flag in words, f"{where}: msrun line without {flag}: {line[:100]}"
            assert words.index(flag) < next(i for i, w in enumerate(words) if "mspretrain" in w), line[:100]  # msrun's flag, not the script's
    # operators.md: 8 devices, the 2-worker rehearsal, 2 x 8 devices (two lines), launch's two-node line
    assert found["operators.md"] >= 5 and found["mspretrain train --help"] == 1
