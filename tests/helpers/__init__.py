"""What several test modules share, by subject, one module each: a test module imports from
these (or from tests/conftest.py, the fixtures and the tiny corpus), never from another test
module.

Light to import: MindSpore, torch, transformers and sentencepiece are imported inside the helpers
that need them, so a test of pure Python does not pay for them.

- `cli`: the command line in this process, and what a command may not change;
- `kernels`: independent references of kernels only Ascend has;
- `hf`: HF material made here (no download);
- `datadirs`: data dirs written by hand for the loader;
- `prepare`: `prepare` in a subprocess, killed and rerun, small corpora, the dedup reference;
- `runs`: runs on two ranks (msrun, two nodes) and reading what runs write;
- `killed`: a job killed or stopped mid-run;
- `ray`: a two-node Ray cluster for `prepare --ray`.
"""
