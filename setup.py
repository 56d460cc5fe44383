"""Only the optional C extension lives here; everything else is in pyproject.toml.

`mspretrain.data._bpe` is a faster SentencePiece BPE encoder for `prepare` (see its header).
`mspretrain.prepare._minhash` computes near dedup's MinHash signatures (see its header).
`mspretrain.prepare._sample` replays the tokenizer sample's heap in `prepare`'s main process.
All are optional: without a C compiler the install still succeeds and `prepare` uses
SentencePiece's own encoder, numpy's MinHash and a Python heap, with the same output.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("mspretrain.data._bpe", ["mspretrain/data/_bpe.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"]),
                   Extension("mspretrain.prepare._minhash", ["mspretrain/prepare/_minhash.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"]),
                   Extension("mspretrain.prepare._sample", ["mspretrain/prepare/_sample.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"])])
