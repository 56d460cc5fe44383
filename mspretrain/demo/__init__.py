"""mspretrain.demo: what only `mspretrain demo` uses (its corpus download)."""
