"""The config schema, one module per subject of TOML sections: `base` (what every section checks),
`model`, `prepare` (prepare and data), `train` (optim, schedule, train, precision, checkpoint,
parallel), `observe` (eval, device, metrics, spike, cost, profile). `mspretrain/config/schema.py` joins them
into `Config` and reads and writes TOML."""
