"""Cleaning rules (each with a positive and a negative example, each switchable and counted),
repetition filters against a plain reference, and exact / near dedup."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from mspretrain.config.schema import PrepareConfig
from mspretrain.prepare import clean, dedup
from mspretrain.prepare.clean import Cleaner

ALL_OFF = PrepareConfig(strip_html=False, remove_urls=False, remove_emails=False, drop_control=False,
                        normalize_whitespace=False, nfkc=False, t2s=False, char_whitelist=False, min_chars=0,
                        max_dup_line_fraction=1.0, max_top_ngram_fraction=1.0)
PLAIN = "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。"

# rule -> (text the rule changes, what it becomes, text it must leave alone)
MODIFY_CASES = {
    "drop_control": ("春\x00眠\x07不觉\x1b晓\u200b", "春眠不觉晓", "春眠\t不觉\n晓"),
    "strip_html": ("<p>春眠<b>不觉</b>晓</p>&amp;&lt;夜来&gt;<!-- x --><script>var a=1;</script>",
                   "\n春眠不觉晓\n&<夜来>", "若 a < b 且 c > d，则 AT&T 不变"),
    "remove_urls": ("详见https://example.com/a?b=1。或www.abc.cn/x，谢谢", "详见。或，谢谢", "版本1.2.3，比例3:2，路径a/b"),
    "remove_emails": ("联系 zhang.san+cn@mail.example.com 即可", "联系  即可", "请 @张三 回复，价格 5@10元"),
    "nfkc": ("ＡＢＣ１２３ｘｙ，全角！（测试）…㈠", "ABC123xy，全角！（测试）…(一)", PLAIN),
    "t2s": ("春眠不覺曉，處處聞啼鳥。", "春眠不觉晓，处处闻啼鸟。", PLAIN),
    "char_whitelist": ("春眠😀不觉Привет晓ʕ•ᴥ•ʔ", "春眠不觉晓••", "春眠 abc 123，“不觉”——晓…《书》"),
    "normalize_whitespace": ("  春眠\u3000\u3000不觉  晓 \r\n\n\n\n夜来\t风雨 ", "春眠 不觉 晓\n\n夜来 风雨", "春眠 不觉\n晓\n\n夜来"),
}


@pytest.mark.parametrize("rule", list(MODIFY_CASES))
def test_modifying_rule_positive_and_negative(rule):
    dirty, want, untouched = MODIFY_CASES[rule]
    c = Cleaner(replace(ALL_OFF, **{rule: True}))
    assert c(dirty) == want
    assert c(untouched) == untouched
    assert c.changed == Counter({rule: 1})  # counted once, for the one document it changed
    off = Cleaner(ALL_OFF)
    assert off(dirty) == dirty and not off.changed  # switched off: no effect


def test_default_rules_together():
    c = Cleaner(PrepareConfig())
    doc = "<div>今天 ２０２４ 年，访问 http://a.cn/x 或写信 a@b.cn。</div>\x00\n\n\n\n明天　见"
    assert c(doc) == "今天 2024 年，访问 或写信 。\n\n明天 见"
    assert set(c.changed) == {"drop_control", "strip_html", "remove_urls", "remove_emails", "nfkc", "normalize_whitespace"}


def test_nfkc_keeps_chinese_punctuation_but_normalises_the_rest():
    assert clean.nfkc("，。！？：；（）【】「」…～") == "，。！？：；（）【】「」…～"
    assert clean.nfkc("ｅ\u0301ﬁ①²") == "éfi12"
    # The placeholders used to protect punctuation are themselves left intact.
    assert clean.nfkc("\U0010f000ＡＢ，") == "\U0010f000AB，"


def test_filters_positive_and_negative():
    cfg = replace(PrepareConfig(), min_chars=10)
    c = Cleaner(cfg)
    assert c("太短了") is None and c.dropped == Counter({"min_chars": 1})
    assert c(PLAIN) == PLAIN
    assert c("   \n\t ") is None and c.dropped["empty"] == 1

    c = Cleaner(PrepareConfig())
    boiler = "\n".join(["点击这里订阅", "版权所有", "点击这里订阅", "点击这里订阅", "版权所有", PLAIN])
    assert clean.dup_line_fraction(boiler) == pytest.approx(3 / 6)
    assert c(boiler) is None and c.dropped == Counter({"max_dup_line_fraction": 1})
    poem = "静夜思\n床前明月光，疑是地上霜。\n举头望明月，低头思故乡。"
    assert c(poem) == poem  # distinct lines

    spam = "哈哈" * 40 + "好笑"
    assert clean.top_ngram_fraction(spam) > 0.9
    assert c(spam) is None and c.dropped["max_top_ngram_fraction"] == 1
    long_text = PLAIN * 1 + "床前明月光，疑是地上霜。举头望明月，低头思故乡。白日依山尽，黄河入海流。欲穷千里目，更上一层楼。"
    assert clean.top_ngram_fraction(long_text) < 0.2 and c(long_text) == long_text
    # Short documents are not judged by n-gram statistics (a quatrain with one repeated word).
    assert c("江南可采莲，莲叶何田田。鱼戏莲叶间。") is not None

    off = Cleaner(replace(PrepareConfig(), max_dup_line_fraction=1.0, max_top_ngram_fraction=1.0))
    assert off(boiler) == boiler and off(spam) == spam


def _reference_top_ngram(text: str, n: int = 2) -> float:
    words = re.sub(r"[\W_]+", "", text)  # Python's \w: letters, digits, CJK (the BMP rules agree here)
    if len(text) < clean.NGRAM_MIN_CHARS or len(words) < clean.NGRAM_MIN_CHARS:
        return 0.0
    grams = Counter(words[i: i + n] for i in range(len(words) - n + 1))
    return min(1.0, n * grams.most_common(1)[0][1] / len(words))


def test_batch_ngram_equals_reference():
    rng = np.random.default_rng(0)
    alphabet = list("春风明月江南山水花落日夜，。！abc 123\n")
    texts = ["".join(rng.choice(alphabet, size=int(n))) for n in rng.integers(0, 200, size=300)]
    texts += ["哈哈" * 40, "", "ab" * 30 + "中文" * 5, PLAIN * 3]
    batch = clean.top_ngram_fractions(texts)
    ref = np.array([_reference_top_ngram(t) for t in texts])
    single = np.array([clean.top_ngram_fraction(t) for t in texts])
    np.testing.assert_allclose(batch, ref)
    np.testing.assert_allclose(single, ref)
    assert (ref > 0.2).any() and (ref[ref > 0] < 0.2).any()  # both sides of the threshold occur


FRAGMENTS = ["春眠不觉晓", "，", "。", " ", "  ", "\n", "\n\n\n", "\t", "\u3000", "\xa0", "\r\n", "\u2028",
             "<b>", "</p>", "&amp;", "&lt;", "a@b.cn", "@张三", "http://x.cn/a", "WWW.a.cn", "//", "ｗｗｗ.",
             "ＡＢ１２", "㈠", "e\u0301", "\x00", "\u200b", "\ufeff", "處處聞啼鳥", "😀", "𠮷", "abc", "1.2.3", "哈哈"]


@pytest.mark.parametrize("cfg", [PrepareConfig(), replace(PrepareConfig(), t2s=True, char_whitelist=True, min_chars=0),
                                 replace(ALL_OFF, normalize_whitespace=True, nfkc=True)])
def test_clean_many_equals_one_by_one(cfg):
    # clean_many skips rules by a code-point classification; it must never change the result.
    rng = np.random.default_rng(1)
    docs = ["".join(rng.choice(FRAGMENTS, size=int(k))) for k in rng.integers(0, 40, size=600)]
    docs += ["哈哈" * 40, PLAIN, "", " ", "短", "<b>粗体</b>" + PLAIN, "重复\n重复\n重复\n" + PLAIN]
    a, b = Cleaner(cfg), Cleaner(cfg)
    assert a.clean_many(docs) == [b(d) for d in docs]
    assert a.changed == b.changed and a.dropped == b.dropped
    assert sum(a.changed.values()) > 100


def test_rules_record_settings():
    r = Cleaner(replace(PrepareConfig(), t2s=True, near_dedup=True)).rules()
    assert r["t2s"] is True and r["near_dedup"] is True and r["near_dedup_threshold"] == 0.8
    assert r["exact_dedup"] is True and r["min_chars"] == 8


# --------------------------------------------------------------------------- dedup

def test_exact_dedup_after_cleaning():
    c = Cleaner(PrepareConfig())
    copies = [PLAIN, "\u3000\u3000" + PLAIN + " \n", "<p>" + PLAIN + "</p>", PLAIN.replace("。", "。\x00")]
    keys = [dedup.dedup_key(c(t)) for t in copies + ["别的文字，别的文字"]]
    d = dedup.ExactDedup()
    assert [d.seen(k) for k in keys] == [False, True, True, True, False]
    assert dedup.dedup_key(PLAIN) != dedup.dedup_key(PLAIN + "。")


def test_uniforms_depend_on_document_and_seed_only():
    k = dedup.dedup_key(PLAIN)
    assert dedup.uniforms(k, 1) == dedup.uniforms(k, 1)
    assert dedup.uniforms(k, 1) != dedup.uniforms(k, 2)
    u = np.array([dedup.uniforms(dedup.dedup_key(str(i)), 7) for i in range(4000)])
    assert 0 <= u.min() and u.max() < 1
    assert abs(u[:, 0].mean() - 0.5) < 0.03 and abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.05


def test_minhash_equals_datasketch():
    from datasketch import MinHash

    texts = [PLAIN, "短", "", "四个字啊", "五个字啊啊", PLAIN * 30, "春眠 不觉\n晓"]
    sigs = dedup.signatures(texts, seed=5)
    assert sigs.shape == (len(texts), dedup.NUM_PERM)
    for t, s in zip(texts, sigs):
        m = MinHash(num_perm=dedup.NUM_PERM, seed=5, hashfunc=dedup.shingle_hash)
        m.update_batch(dedup.shingles(t))
        np.testing.assert_array_equal(m.hashvalues, s)


def test_near_dedup_catches_edits_not_different_text():
    base = ("床前明月光，疑是地上霜。举头望明月，低头思故乡。李白的静夜思是一首非常有名的诗歌，"
            "几乎每个中国人都会背诵，它写的是游子在秋夜里对家乡的思念。月光照在床前的地上，"
            "好像铺了一层白霜；诗人抬起头来望着天上的明月，又低下头来想念远方的故乡。")
    edited = base.replace("有名", "著名")
    other = ("今天下午我们在公园里散步，看到很多人在放风筝，天空中飘着五颜六色的风筝，孩子们笑得很开心。"
             "傍晚的时候起风了，我们沿着湖边走回家，路上买了两个烤红薯，一边走一边吃。")
    jaccard = len(set(dedup.shingles(base)) & set(dedup.shingles(edited))) / len(set(dedup.shingles(base)) | set(dedup.shingles(edited)))
    assert jaccard > 0.85
    near = dedup.NearDedup(threshold=0.8, seed=1)
    seen = [near.seen(s) for s in dedup.signatures([base, edited, other, other[:-3] + "真好。"], seed=1)]
    assert seen == [False, True, False, True]
    exact = dedup.ExactDedup()
    assert [exact.seen(dedup.dedup_key(t)) for t in (base, edited)] == [False, False]  # exact misses it


# --------------------------------------------------------------------------- fast paths vs their references

def _table_chars(bit: int, limit: int = 0x10000) -> list[str]:
    return [chr(c) for c in np.flatnonzero(clean.char_table()[:limit] & bit).tolist()]


def test_nfkc_regex_runs_equal_the_table_path():
    # nfkc finds runs with a BMP regex; _nfkc_by_table (the previous implementation) with the
    # code-point table. A character class that missed or added a character would show here.
    rng = np.random.default_rng(3)
    marked = _table_chars(clean.NFKC)
    astral_marked = [c for c in _table_chars(clean.NFKC, 0x110000) if ord(c) > 0xFFFF]  # math letters, ...
    pools = [marked, list("春眠不觉晓，。！？（）…　 abcAB12\n"), clean._PROTECT_CHARS,
             ["\u0301", "\u0308", "\u1100", "\u1161", "\u11a8", "e", "ｅ", "ﬁ", "①", "㈠", "\u3000"],
             ["𠮷", "😀", "\U0002a6d6", "\U0001f600"] + astral_marked[::25]]
    texts = []
    for _ in range(3000):
        k = int(rng.integers(1, 12))
        texts.append("".join(str(rng.choice(pools[int(rng.integers(0, len(pools)))])) for _ in range(k)))
    texts += [c for c in marked[::7]]  # every 7th marked character alone, and after a CJK one
    texts += ["春" + c for c in marked[3::7]]
    for t in texts:
        assert clean.nfkc(t) == clean._nfkc_by_table(t), repr(t)
    assert any(ord(ch) > 0xFFFF for t in texts for ch in t)
    # Beyond the BMP: the table path for marked characters, the regex for unmarked ones.
    for t in ["𝐀𝐁１２春", "𠮷ＡＢ，", "😀ﬁ"]:
        assert clean.nfkc(t) == clean._nfkc_by_table(t)
    assert clean.nfkc("𝐀𝐁１２春") == "AB12春"


def test_nfkc_equals_unicodedata_with_the_documented_exemptions():
    # An independent reference: unicodedata.normalize("NFKC") on everything except the documented
    # exemptions, which are defined here from Unicode categories, not from clean's own lists:
    # full-width ASCII punctuation and symbols (U+FF01-FF5E, categories P* and S*) and the ellipsis.
    import unicodedata

    exempt = frozenset(chr(c) for c in range(0xFF01, 0xFF5F) if unicodedata.category(chr(c))[0] in "PS") | {"\u2026"}
    assert {"，", "！", "？", "：", "；", "（", "）", "～", "…"} <= exempt and not {"Ａ", "１"} & exempt

    def reference(text: str) -> str:
        out, seg = [], []
        for ch in text:
            if ch in exempt:
                out += [unicodedata.normalize("NFKC", "".join(seg)), ch]
                seg = []
            else:
                seg.append(ch)
        return "".join(out) + unicodedata.normalize("NFKC", "".join(seg))

    rng = np.random.default_rng(5)
    pools = [[chr(c) for c in range(0x30000) if unicodedata.decomposition(chr(c)) and not 0xD800 <= c < 0xE000],  # compatibility forms
             [chr(c) for c in range(0x10000) if unicodedata.category(chr(c))[0] == "M"],  # combining marks
             [chr(c) for c in range(0x1100, 0x1200)],  # Hangul jamo (compose with each other)
             list("春眠不觉晓处处闻啼鸟abcAB12 \n\u3000") + ["𠮷", "😀"], sorted(exempt)]
    for _ in range(5000):
        text = "".join((lambda p: p[int(rng.integers(0, len(p)))])(pools[int(rng.integers(0, len(pools)))])
                       for _ in range(int(rng.integers(1, 10))))
        assert clean.nfkc(text) == reference(text), repr(text)


def _reference_normalize_whitespace(text: str) -> str:
    text = "\n".join(" ".join(line.split()) for line in text.splitlines())
    text = re.sub("\n{3,}", "\n\n", text)
    return text.strip()


def test_normalize_whitespace_one_line_shortcut_equals_the_general_path():
    rng = np.random.default_rng(4)
    pieces = ["春眠", "ab", " ", "  ", "\t", "\u3000", "\xa0", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d",
              "\x1e", "\x1f", "\x85", "\u2028", "\u2029", "\u2009"]
    texts = ["".join(rng.choice(pieces, size=int(k))) for k in rng.integers(0, 12, size=4000)]
    for t in texts:
        assert clean.normalize_whitespace(t) == _reference_normalize_whitespace(t), repr(t)


def test_ngram_bound_is_an_upper_bound_and_the_filter_is_exact():
    # The bucket bound lets clean_many skip the exact n-gram sort; it must never be below the
    # exact fraction, or a document over the threshold would be kept.
    rng = np.random.default_rng(5)
    alphabets = [list("春风明月江南山水花落日夜，。！abc 123\n"), list("哈啊"), list("春风，")]
    texts = []
    for n in rng.integers(0, 300, size=600):
        a = alphabets[int(rng.integers(0, 3))]
        texts.append("".join(rng.choice(a, size=int(n))))
    texts += ["哈哈" * 40, "", "ab" * 30 + "中文" * 5, PLAIN * 3, "x" * 49, "x" * 50, "春，" * 60]
    for n in (1, 2):
        exact = clean.top_ngram_fractions(texts, n)
        bound = clean.top_ngram_bounds(texts, n)
        assert (bound >= exact - 1e-12).all()
        for threshold in (0.05, 0.2, 0.5, 0.9):
            np.testing.assert_array_equal(clean.top_ngram_exceeds(texts, threshold, n), exact > threshold)
    assert clean.top_ngram_bounds([], 2).size == 0


def test_exact_dedup_fresh_equals_seen_in_order():
    keys = [dedup.dedup_key(t) for t in ["a", "b", "a", "c", "b", "b", "d"]]
    one, many = dedup.ExactDedup(), dedup.ExactDedup()
    assert many.fresh(b"".join(keys[:3])) + many.fresh(b"".join(keys[3:])) == [not one.seen(k) for k in keys]
    assert dedup.dedup_keys(["a", "春"]) == dedup.dedup_key("a") + dedup.dedup_key("春")


def test_url_and_email_prechecks_never_skip_a_match():
    # remove_urls / remove_emails skip the regex when "://", "www." (any case) or "@" is absent.
    rng = np.random.default_rng(6)
    pieces = ["http", "https", "ftp", "://", ":/", "/", "www", "WwW", "wWw.", ".", "example", "com", "a", "@",
              "b.cn", "春眠", " ", "，", "x1", "-", "_", "%", "+"]
    texts = ["".join(rng.choice(pieces, size=int(k))) for k in rng.integers(0, 14, size=5000)]
    hits = 0
    for t in texts:
        assert clean.remove_urls(t) == clean._URL.sub("", t), t
        assert clean.remove_emails(t) == clean._EMAIL.sub("", t), t
        hits += clean._URL.search(t) is not None
    assert hits > 100


def test_char_table_disk_cache_is_exact_and_checked(tmp_path, monkeypatch):
    # char_table is kept on disk between runs; what comes back must be what was built, and a
    # damaged file must be rebuilt rather than trusted.
    monkeypatch.setenv("MSPRETRAIN_CACHE", str(tmp_path))
    fresh = clean.build_char_table()
    calls = []

    def builder() -> np.ndarray:
        calls.append(1)
        return fresh.copy()

    first = clean._cached_table(builder)
    second = clean._cached_table(builder)
    assert len(calls) == 1  # the second came from the file
    np.testing.assert_array_equal(first, fresh)
    np.testing.assert_array_equal(second, fresh)
    (cached,) = tmp_path.glob("char_table-*.bin")
    damaged = bytearray(cached.read_bytes())
    damaged[0x4E00] ^= 0xFF
    cached.write_bytes(bytes(damaged))
    np.testing.assert_array_equal(clean._cached_table(builder), fresh)
    assert len(calls) == 2
    np.testing.assert_array_equal(clean.char_table(), fresh)  # the table prepare uses, however it was obtained
