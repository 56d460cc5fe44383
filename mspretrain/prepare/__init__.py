"""mspretrain.prepare: raw text in, a data dir out (`prepare.prepare`), as a chain of stages (`pipeline.py`)."""
