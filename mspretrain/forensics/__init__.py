"""mspretrain.forensics: after a run — audit, diagnose, replay, drop docs, spike, report, recover."""
