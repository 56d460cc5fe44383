"""mspretrain.ops: running a job — plan, doctor, diagnose, CPU isolation, profiler."""
