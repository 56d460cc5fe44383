"""mspretrain.preflight: before a run — plan, costs and layouts, fits, doctor, selftest and its workers, CPU isolation."""
