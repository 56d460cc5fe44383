"""The config package: the schema (`schema`, joining one module per subject in `sections`) and its reference (`doc`)."""
