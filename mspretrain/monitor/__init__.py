"""mspretrain.monitor: metrics sinks (JSONL + TensorBoard), MFU, loss-spike detection, HTML report."""
