"""The scripts that train the default pair and measure SpecExec, run from the repository root:

    python -m scripts.bench_disk     # SpecExec where it pays: a big target streamed from disk
    python -m scripts.bench          # in memory, against its peers, greedy and sampled
    python -m scripts.bench_offload  # one offloaded pass per tier and token count
    python -m scripts.bench_experts  # what a mixture of experts moves, and what a tree routes
    python -m scripts.train_pair     # train models/ again

They import the library modules (specexec, offload, cli) from the root, which `-m` puts first,
and what they share from `common.py`: the machine's name, a command line read from a config.
(bench_offload's --quality reads train_pair's held-out split through train_pair itself.)
"""
