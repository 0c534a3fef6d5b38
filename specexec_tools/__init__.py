"""What serves specexec.py and offload.py, one module a job:

cli.py          the command line (`python specexec.py`): flags, loading, streaming, summary
models.py       from a model folder to a checked model: find, open once, preflight, load
checkpoint.py   a folder's weight files: safetensors headers, .bin shards, the ssd tier's copy
cost_model.py   budget "auto": the tree size and depth with the most tokens/s
quantize.py     int8 / int4 weights for the offloaded target and the self-draft
plots.py        the notebook's pictures
"""
