"""mspretrain.step: the compiled optimizer step and its ZeRO, tensor-parallel, loss-scale and state-codec parts."""
