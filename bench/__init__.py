"""qspec microbenchmarks: `python -m bench.membw`, `python -m bench.kernels` (see bench/common.py)."""
