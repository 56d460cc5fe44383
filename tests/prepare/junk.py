"""Planted junk for the quality filters' tests and benchmarks/quality_bench.py: four kinds of the
documents a web crawl holds and a pretraining corpus should not, each drawn from a seed.

- "translated": machine-translated-looking Chinese, function words and calques strung together;
- "boilerplate": site chrome (copyright, navigation, login, disclaimers) with numbers;
- "spam": keyword stuffing, a few product words repeated in varying order;
- "foreign": other languages (English, Japanese, Korean, Russian), which the language filter takes;
- "salad": the hard case, poems' form and the poems' own characters drawn uniformly, without the
  successor structure real poems have (generated text that only looks like the good documents).

The good documents are the poems of `tests.conftest.make_poems`. Its seed also draws the poems'
successor structure (each seed is a "language" of its own), so a classifier is trained held-in:
on other poems of the seed the corpus is drawn from (interleaved with the corpus's, so that their
numbers "第N首" are drawn alike).
"""
from __future__ import annotations

import numpy as np

from tests.conftest import CHARS, make_poems

_POEM_CHARS = list(dict.fromkeys(CHARS))

KINDS = ("translated", "boilerplate", "spam", "foreign", "salad")

_TRANSLATED = ("的", "了", "是", "在", "被", "对于", "关于", "进行", "一个", "我们", "这个", "非常", "重要", "通过", "以及",
               "使得", "它是", "作为", "所", "对", "于", "的时候", "能够", "正在", "被认为", "基于", "方面", "实现", "提供",
               "用户", "的的", "那个", "一种", "可以被", "具有", "相关的")
_BOILER = ("版权所有", "保留所有权利", "联系我们", "首页", "登录", "注册", "网站地图", "免责声明", "隐私政策", "关于本站",
           "客服热线", "备案号", "返回顶部", "上一篇", "下一篇", "点击查看", "更多", "友情链接", "加入收藏", "设为首页",
           "京ICP备", "公网安备", "技术支持", "本站")
_SPAM = ("减肥", "瘦身", "快速减肥", "减肥药", "免费", "优惠", "代购", "正品", "包邮", "特价", "秒杀", "加微信", "官网",
         "最新", "推荐", "排行榜", "批发", "厂家直销")
_FOREIGN = (
    "the of and to in is was for on that with as by at from this have are not but be or which one you had all were "
    "there their would been has more when will who also into other some time only could new these two may first",
    "これ は の に を が と で た し て ます です ない から まで よう こと もの ため 日本 東京 会社 今日 明日 時間 学校 先生 本当",
    "이 그 저 는 을 를 에 의 과 와 하다 있다 없다 되다 사람 시간 오늘 내일 학교 선생님 정말 한국 서울 회사 우리",
    "и в не на я что он с как это по но они к у же вы за бы то все она так его был было мы от меня ещё нет о из ему",
)


def junk(kind: str, n: int, seed: int) -> list[str]:
    """`n` documents of one kind, ~60-200 characters each, from `seed`."""
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    out = []
    for i in range(n):
        if kind == "translated":
            words = [_TRANSLATED[j] for j in rng.integers(len(_TRANSLATED), size=int(rng.integers(30, 70)))]
            text = "".join(w + ("，" if rng.random() < 0.1 else "") for w in words) + "。"
        elif kind == "boilerplate":
            words = [_BOILER[j] for j in rng.integers(len(_BOILER), size=int(rng.integers(12, 30)))]
            text = " | ".join(w + (str(int(rng.integers(1000, 99999))) if rng.random() < 0.3 else "") for w in words)
        elif kind == "spam":
            words = [_SPAM[j] for j in rng.integers(len(_SPAM), size=int(rng.integers(25, 60)))]
            text = "".join(w + ("！" if rng.random() < 0.2 else "") for w in words)
        elif kind == "salad":
            width = 5 if i % 2 else 7
            rows = ["".join(_POEM_CHARS[j] for j in rng.integers(len(_POEM_CHARS), size=width)) for _ in range(4)]
            # numbered like the poems (make_poems numbers them 0, 1, ...): the number must not give it away
            text = f"第{int(rng.integers(0, 100_000))}首，" + "，".join(rows[:2]) + "。，" + "，".join(rows[2:]) + "。"
        else:
            vocab = _FOREIGN[i % len(_FOREIGN)].split()
            words = [vocab[j] for j in rng.integers(len(vocab), size=int(rng.integers(20, 50)))]
            text = " ".join(words) + "."
        out.append(text)
    return out


def mixed(poems: list[str], per_kind: int, seed: int) -> tuple[list[str], np.ndarray]:
    """The poems with `per_kind` documents of every kind interleaved at positions drawn from
    `seed`; (documents, is_junk per document)."""
    docs = list(poems) + [d for k in KINDS for d in junk(k, per_kind, seed)]
    bad = np.r_[np.zeros(len(poems), dtype=bool), np.ones(len(docs) - len(poems), dtype=bool)]
    order = np.random.default_rng(seed).permutation(len(docs))
    return [docs[i] for i in order], bad[order]


def held_in(n: int, seed: int, every: int = 10) -> tuple[list[str], list[str]]:
    """(n poems for a corpus, n // every other poems of the same seed for training), one line
    each; the training poems are every `every + 1`-th of one draw, so both have alike numbers."""
    poems = [p.replace("\n", "，") for p in make_poems(n + n // every, seed=seed)]
    train = set(range(every, len(poems), every + 1)[: n // every])
    return [p for i, p in enumerate(poems) if i not in train][:n], [poems[i] for i in sorted(train)]
