"""The config package: the schema (`schema`, one module per subject in `sections/`) and its reference (`doc`)."""
