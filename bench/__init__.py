"""zinf's benchmarks: `python -m bench NAME` (see bench/__main__.py for the list).

Results (JSON and pictures) go to bench/results/.
"""
