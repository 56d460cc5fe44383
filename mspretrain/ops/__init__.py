"""mspretrain.ops: running a job — plan, report, recover, doctor, diagnose, selftest, CPU isolation."""
