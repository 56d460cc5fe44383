"""mspretrain.monitor: metrics sinks (JSONL + TensorBoard), MFU, loss-spike detection, step profiling."""
