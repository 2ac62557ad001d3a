"""Developer scripts; `python -m scripts.cluster` is the multi-host test bed."""
