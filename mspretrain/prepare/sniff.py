"""Opening an input file and deciding what it is: its compression (by name), binary or text (by
its head), and which encoding, including files that mix UTF-8 and GB18030 lines (a codec of
our own, `MIXED_CODEC`).

The encoding is detected per file from its first 64 KiB: a BOM, else strict UTF-8, else
`charset-normalizer` (GBK/GB2312 are read as GB18030, their superset). Bytes that still do not
decode are dropped and counted (`filecounts`), never fatal. A file that looks binary (known
magic numbers, many control bytes, or no plausible encoding) is skipped with a warning.
Trade-off: detection reads a file's head twice (once to sniff, once to stream); the sample is
small, and it keeps the reader a plain `TextIOWrapper` (decoding in C).
"""
from __future__ import annotations

import codecs
import gzip
import io
import zlib
from pathlib import Path

from mspretrain.prepare.filecounts import FileCounts, counting, counting_into

SAMPLE_BYTES = 1 << 16
_MAGIC = (  # file types people leave next to their text
    (b"\x89PNG", "PNG image"), (b"\xff\xd8\xff", "JPEG image"), (b"GIF8", "GIF image"),
    (b"%PDF", "PDF"), (b"PK\x03\x04", "zip archive"), (b"\x7fELF", "executable"),
    (b"\x1f\x8b", "gzip data without a .gz name"), (b"\x28\xb5\x2f\xfd", "zstd data without a .zst name"),
    (b"BZh", "bzip2 data"), (b"\xfd7zXZ", "xz data"), (b"SQLite format", "SQLite database"),
)
_BOMS = ((codecs.BOM_UTF8, "utf-8-sig", "utf-8-bom"), (codecs.BOM_UTF32_LE, "utf-32", "utf-32"),
         (codecs.BOM_UTF32_BE, "utf-32", "utf-32"), (codecs.BOM_UTF16_LE, "utf-16", "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16", "utf-16"))
_GB_FAMILY = {"gb2312", "gbk", "gb18030", "hz", "cp936", "euc_cn"}
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\f\v\x1b") + b"\x7f"


# --------------------------------------------------------------------------- files mixing UTF-8 and GB18030 lines

MIXED_CODEC = "mspretrain-mixed"
MIXED_LABEL = "utf-8+gb18030"  # its label in the manifest
_MIXED_HOLD = 1 << 20  # a line with no end yet is decoded in pieces beyond this: memory stays bounded


def _decode_line(line: bytes, errors: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        pass
    counts = counting() or FileCounts("")
    try:
        text = line.decode("gb18030")
        counts.mixed_gb18030_lines += 1
        return text
    except UnicodeDecodeError:
        counts.mixed_bad_lines += 1
        return line.decode("utf-8", errors=errors)


class _MixedDecoder(codecs.IncrementalDecoder):
    """Each line as UTF-8, else as GB18030, else UTF-8 with the bad bytes dropped (and counted).
    Files concatenated from a GBK source and a UTF-8 one were called binary: no single
    encoding decodes them, but every line has one."""

    def __init__(self, errors: str = "strict") -> None:
        super().__init__(errors)
        self.buf = b""

    def decode(self, input: bytes, final: bool = False) -> str:  # noqa: A002 (codecs' signature)
        data = self.buf + bytes(input)
        cut = len(data) if final else data.rfind(b"\n") + 1
        if not cut and len(data) > _MIXED_HOLD:
            cut = len(data) - 4  # keep a possibly split multi-byte character for the next call
        self.buf = data[cut:]
        return "".join(_decode_line(line, self.errors) for line in data[:cut].splitlines(keepends=True))

    def reset(self) -> None:
        self.buf = b""

    def getstate(self) -> tuple[bytes, int]:
        return self.buf, 0

    def setstate(self, state: tuple[bytes, int]) -> None:
        self.buf = state[0]


def _mixed_search(name: str) -> codecs.CodecInfo | None:
    if name.replace("_", "-") != MIXED_CODEC:
        return None

    def decode(data: bytes, errors: str = "strict") -> tuple[str, int]:
        return _MixedDecoder(errors).decode(data, final=True), len(data)

    return codecs.CodecInfo(name=MIXED_CODEC, encode=codecs.utf_8_encode, decode=decode,
                            incrementaldecoder=_MixedDecoder)


codecs.register(_mixed_search)


def mixed_lines_fit(sample: bytes, complete: bool) -> bool:
    """Whether a head no single encoding decodes is UTF-8 and GB18030 lines: nearly every whole
    line (90 %) decodes strictly one way or the other, and the GB18030 ones read as Chinese."""
    lines = sample.splitlines()
    if not complete and lines:
        lines = lines[:-1]  # the sample may end inside a line
    gb_text, ok, bad = [], 0, 0
    for line in (ln for ln in lines if ln.strip()):
        try:
            line.decode("utf-8")
            ok += 1
            continue
        except UnicodeDecodeError:
            pass
        try:
            gb_text.append(line.decode("gb18030"))
            ok += 1
        except UnicodeDecodeError:
            bad += 1  # a damaged line: dropped bytes when read, counted
    wide = [ch for t in gb_text for ch in t if ord(ch) > 0x7F]
    cjk = sum(1 for ch in wide if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef")
    return ok > 0 and bad <= 0.1 * (ok + bad) and bool(wide) and cjk >= 0.8 * len(wide)


# --------------------------------------------------------------------------- opening and sniffing

def open_binary(path: Path):
    """(decompressed binary stream, raw file object) for the path's compression suffix."""
    raw = open(path, "rb")
    low = path.name.lower()
    try:
        if low.endswith(".gz"):
            return gzip.GzipFile(fileobj=raw, mode="rb"), raw
        if low.endswith((".zst", ".zstd")):
            import zstandard

            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)), raw
    except Exception:
        raw.close()
        raise
    return raw, raw


def read_head(path: Path) -> tuple[bytes, bool]:
    """The first SAMPLE_BYTES decompressed bytes, and whether that is the whole file."""
    stream, raw = open_binary(path)
    chunks: list[bytes] = []
    got = 0
    try:  # read1 by read1: a stream damaged within the sample still shows the bytes before it
        while got <= SAMPLE_BYTES:
            d = stream.read1(SAMPLE_BYTES + 1 - got)
            if not d:
                break
            chunks.append(d)
            got += len(d)
    except read_errors():
        if not chunks:
            raise
        # the reader meets the damage again, keeps the whole lines before it and warns
    finally:
        stream.close()
        raw.close()
    head = b"".join(chunks)
    return head[:SAMPLE_BYTES], len(head) <= SAMPLE_BYTES


def binary_reason(sample: bytes) -> str | None:
    """Why a file's head looks binary rather than text, or None."""
    for magic, what in _MAGIC:
        if sample.startswith(magic):
            return what
    if sample and not sample.startswith(tuple(b for b, _, _ in _BOMS)):
        ctrl = len(sample) - len(sample.translate(None, _CONTROL_BYTES))
        if ctrl > 0.1 * len(sample):
            return f"{100 * ctrl // len(sample)}% control bytes"
    return None


def detect_encoding(sample: bytes, complete: bool) -> tuple[str, str] | None:
    """(Python codec, label for the manifest), or None when no encoding is plausible."""
    for bom, codec, label in _BOMS:
        if sample.startswith(bom):
            return codec, label
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=complete)
        return "utf-8", "utf-8"
    except UnicodeDecodeError as exc:
        # A few stray bytes in an otherwise UTF-8 file: read it as UTF-8 and drop them.
        bad = _undecodable(sample, "utf-8")
        if bad <= max(4, len(sample) // 1000) and exc.start > 0:
            return "utf-8", "utf-8"
    from charset_normalizer import from_bytes

    best = from_bytes(sample).best()
    if best is None:
        # charset-normalizer gives up on short GB18030 text with four-byte sequences; for a
        # Chinese toolkit, strict GB18030 that decodes to mostly CJK is a safe second opinion.
        try:
            text = codecs.getincrementaldecoder("gb18030")().decode(sample, final=complete)
        except UnicodeDecodeError:
            return None
        wide = [ch for ch in text if ord(ch) > 0x7F]
        cjk = sum(1 for ch in wide if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef" or ch >= "\U00020000")
        return ("gb18030", "gb18030") if wide and cjk >= 0.8 * len(wide) else None
    name = codecs.lookup(best.encoding).name.replace("-", "_")
    if name in _GB_FAMILY or name.startswith("gb"):
        # GB18030 decodes all of GBK/GB2312; the label says what the head actually needed.
        return "gb18030", "gbk" if _undecodable(sample, "gbk", complete) == 0 else "gb18030"
    return best.encoding, name


def _undecodable(sample: bytes, codec: str, complete: bool = False) -> int:
    with counting_into(FileCounts("")) as counts:
        codecs.getincrementaldecoder(codec)(errors="mspretrain.drop").decode(sample, final=complete)
    return counts.bytes_dropped


def newline_bytes_safe(codec: str) -> bool:
    """Whether the bytes \n and \r in this encoding are only ever line breaks, so lines can be
    found in the undecoded bytes (UTF-8, GB18030 and other ASCII-compatible codecs; not UTF-16/32)."""
    if codec == MIXED_CODEC:
        return True  # UTF-8 and GB18030 lines
    try:
        enc = codecs.getincrementalencoder(codec)()
        enc.encode("a")  # past a BOM the encoder may write first
        return enc.encode("\r\n") == b"\r\n"
    except (LookupError, UnicodeError, TypeError):
        return False


def read_errors() -> tuple[type[BaseException], ...]:
    """What a damaged file raises while being read (a bug elsewhere must still surface)."""
    import zstandard

    return OSError, EOFError, zlib.error, zstandard.ZstdError

