"""mspretrain: predictable, reproducible pretraining of Llama-style Chinese models on MindSpore."""
from __future__ import annotations

import os

__version__ = "0.1.0"

# MindSpore's native logger is loud at INFO/WARNING; quiet it before anything imports mindspore,
# unless the user chose a level themselves (`--verbose` on the CLI sets GLOG_v=1).
os.environ.setdefault("GLOG_v", "3")
os.environ.setdefault("GLOG_logtostderr", "1")
