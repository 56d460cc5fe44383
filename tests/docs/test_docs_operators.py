"""docs/operators.md §14 (quality filtering and decontamination), followed literally: its command
block run in order, on small inputs of the names it uses (a `baike.jsonl` of good text, a
`textbooks/` dir, a `web_sample.jsonl` of bad text, a `web/` corpus holding both, C-Eval / CMMLU
style `ceval/val` and `cmmlu/test`), does what the page says: two model files, a data dir whose
manifest names what each filter dropped and whose `quality.scores` holds a record per document,
and an inspect that shows each filter. In-process and without MindSpore: ~10 s."""
from __future__ import annotations

import json
import random
import re
import shlex
from pathlib import Path

from tests.helpers.cli import cli

GOOD = ("春风明月江南山水花落日夜秋云天地人心来去长空白雪青松流年故乡归路远清香红叶梦中千里万家门前桥边"
        "柳色鸟声寒烟孤舟独坐高楼望断相思无限时光何处见君知我不同一生西东北上下古今朝暮雨晴暖冬夏新旧老少")
BAD = "点击这里免费下载最新版本立即注册会员优惠活动链接广告联系客服"
DOCS = Path(__file__).resolve().parents[2] / "docs"
QUESTION = "下列哪一个城市是中华人民共和国的首都所在地请选择正确答案"


def _inputs(root: Path) -> None:
    rng = random.Random(0)
    text = lambda n, chars: "".join(rng.choice(chars) for _ in range(n))  # noqa: E731
    jsonl = lambda path, docs: path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs),  # noqa: E731
                                               encoding="utf-8")
    jsonl(root / "baike.jsonl", ["百科：" + text(200, GOOD) + "。" for _ in range(300)])
    (root / "textbooks").mkdir()
    (root / "textbooks" / "ch1.txt").write_text("\n\n".join("课文：" + text(150, GOOD) + "。" for _ in range(100)) + "\n",
                                                 encoding="utf-8")
    jsonl(root / "web_sample.jsonl", [text(120, BAD) for _ in range(300)])
    (root / "web").mkdir()
    # good and bad documents, and one that copies an eval question (decontamination drops it)
    jsonl(root / "web" / "part0.jsonl", [text(200, GOOD) if i % 2 else text(150, BAD) for i in range(600)]
          + [text(40, GOOD) + QUESTION + text(40, GOOD)])
    (root / "ceval" / "val").mkdir(parents=True)
    (root / "ceval" / "val" / "geo_val.csv").write_text(f"id,question,A,B,C,D,answer\n0,{QUESTION},北京,上海,广州,深圳,A\n",
                                                         encoding="utf-8")
    (root / "cmmlu" / "test").mkdir(parents=True)
    (root / "cmmlu" / "test" / "season.csv").write_text(",Question,A,B,C,D,Answer\n0,一年有几个季节分别叫什么名字请回答,四,三,五,六,A\n",
                                                         encoding="utf-8")


def _section_14_commands() -> list[str]:
    text = (DOCS / "operators.md").read_text(encoding="utf-8")
    section = text.split("## 14. ", 1)[1].split("\n## ", 1)[0]
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "mspretrain quality train" in b]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith("mspretrain ")]


def test_operators_section_14_runs_as_written(tmp_path, monkeypatch, capsys):
    commands = _section_14_commands()
    assert [c.split()[1:3] for c in commands] == [["quality", "train"], ["quality", "lm"], ["prepare", "web/"],
                                                  ["prepare", "--inspect"]]
    _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    outs = []
    for command in commands:
        rc, out, err = cli(capsys, *shlex.split(command)[1:])
        assert rc == 0, f"operators.md §14: `{command}` exited {rc}:\n{err}"
        outs.append(out)
    assert Path("models/quality.npz").is_file() and Path("models/quality.npz.sha256").is_file()
    assert Path("models/lm.npz").is_file() and Path("models/lm.npz.sha256").is_file()
    manifest = json.loads(Path("data/web/manifest.json").read_text(encoding="utf-8"))
    # "The manifest's `dropped` counts each filter's drops ...; its `quality` entry names every model"
    assert manifest["dropped"].get("contaminated") == 1, manifest["dropped"]
    assert manifest["dropped"].get("quality", 0) + manifest["dropped"].get("perplexity", 0) >= 250, manifest["dropped"]
    assert {"classifier", "perplexity", "language", "decontam"} <= set(manifest["quality"])
    assert Path("data/web/quality.scores").stat().st_size > 0  # a record per scored document
    inspect = outs[-1]
    assert "601 documents scored (quality.scores)" in inspect and "contaminated 1" in inspect
    for name in ("P(Chinese)", "perplexity", "classifier"):
        assert name in inspect, name
