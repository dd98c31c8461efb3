"""What the benchmarks under tools/ share: one result schema and its command line (``result``), the
processes they start and the CPU and memory those use (``procs``), and llama.cpp's own programs as the
baseline (``llama``).

A benchmark is run as a script from the checkout (``.venv/bin/python tools/bench_x.py``), which puts
tools/ first on ``sys.path``: this package and tools/localmesh.py import as they are, with no path edits.
The tests see tools/ the same way (pyproject's pytest ``pythonpath``); nothing here imports from tests/.
"""
