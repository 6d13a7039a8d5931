"""Benchmarks: jlora against the PyTorch baselines (run as `python -m bench.<name>`)."""
