"""mspretrain.checkpoint: checkpoints on disk (store, saver, shards, lock, diskspeed), the one road from a
checkpoint to a model (model), HF model folders with their tokenizer (hf_folder), initial weights (init_source)."""
