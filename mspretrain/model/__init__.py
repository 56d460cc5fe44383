"""The model: the decoder with per-family switches in MindSpore (`decoder`), its loss (`loss`), presets and parameter counts
(`presets`), the Hugging Face bridge (`hf`) and MINDIR export (`mindir`).

Nothing is imported here, so `presets` and `hf` stay usable without importing MindSpore.
"""
