"""The scripts that train the default pair and measure SpecExec, run from the repository root:

    python -m scripts.bench_disk     # a big target streamed from disk, against accelerate's offload
    python -m scripts.bench          # in memory, against its peers, greedy and sampled
    python -m scripts.bench_offload  # one offloaded pass per tier and token count
    python -m scripts.train_pair     # train models/ again

They import the library modules (specexec, offload, specexec_tools) from the root, which `-m`
puts first, and share one harness, `common.py`.
"""
