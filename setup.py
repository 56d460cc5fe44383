"""Only the optional C extension lives here; everything else is in pyproject.toml.

`mspretrain.data._bpe` is a faster SentencePiece BPE encoder for `prepare` (see its header).
`mspretrain.data._minhash` computes near dedup's MinHash signatures (see its header).
`mspretrain.data._sample` replays the tokenizer sample's heap in `prepare`'s main process.
All are optional: without a C compiler the install still succeeds and `prepare` uses
SentencePiece's own encoder, numpy's MinHash and a Python heap, with the same output.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("mspretrain.data._bpe", ["mspretrain/data/_bpe.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"]),
                   Extension("mspretrain.data._minhash", ["mspretrain/data/_minhash.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"]),
                   Extension("mspretrain.data._sample", ["mspretrain/data/_sample.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"])])
