"""The scripts that train the default pair (`train_pair.py`) and measure SpecExec (`bench.py`,
`bench_disk.py`, `bench_offload.py`), sharing one harness (`common.py`). Run from the repository
root as `python -m scripts.NAME`, so that the library modules import from there."""
