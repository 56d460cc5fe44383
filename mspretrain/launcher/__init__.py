"""mspretrain.launcher: supervising an msrun job — the watchdog over the ranks and the process tree."""
