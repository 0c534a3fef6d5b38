"""Benchmark offload.py: one pass of a random Llama bigger than the RAM it may use, per tier.

    python bench_offload.py                 # 1, 16, 128 and 1024 tokens; a few minutes, Linux only

A random Llama of several GB is written to a temp folder and deleted afterwards. For each token
count it times one pass of each tier (ssd, ram, and the plain in-memory model as the compute
baseline), each in a fresh process, beside the raw cold read of the same bytes, all in the same
run, and prints overlap efficiency, I/O efficiency, bytes moved and peak RSS.
"""

import concurrent.futures
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, DynamicCache

import offload
from bench import cpu_name


@dataclass
class BenchOptions:
    """The benchmark's defaults, written once; the command line is generated from these fields."""

    tokens: str = field(default="1,16,128,1024", metadata={"help": "tokens per pass, comma list"})
    layers: int = field(default=16, metadata={"help": "decoder layers of the random Llama"})
    hidden: int = field(default=2048, metadata={"help": "hidden size (heads of 64)"})
    intermediate: int = field(default=5632, metadata={"help": "MLP size"})
    vocab: int = field(default=32000, metadata={"help": "vocabulary size"})
    buffers: int = field(default=2, metadata={"help": "device buffers in the ring"})
    threads: int = field(
        default=max(1, (os.cpu_count() or 2) - 1),
        metadata={"help": "torch compute threads: all cores but one, which is left to the reader"},
    )
    ram_limit_gb: float = field(
        default=2.0, metadata={"help": "RLIMIT_DATA for the ssd process, below the model's size"}
    )
    folder: str = field(
        default="", metadata={"help": "keep the random checkpoint here; empty: a temp folder"}
    )


def bench(opts: BenchOptions) -> str:
    """Time one pass per token count for each tier, each in a fresh process; return the report."""
    import shutil
    import tempfile

    tokens = [int(n) for n in opts.tokens.split(",")]
    folder = Path(opts.folder or tempfile.mkdtemp(prefix="offload-bench-"))
    try:
        write_random_llama(folder, opts)
        runs = {tier: in_fresh_process(measure, folder, tier, tokens, opts) for tier in TIERS}
    finally:
        if not opts.folder:
            shutil.rmtree(folder)
    return report(opts, tokens, runs)


TIERS = ("ssd", "ram", "resident")  # resident: the plain in-memory model, the compute baseline


def write_random_llama(folder: Path, opts: BenchOptions) -> None:
    """A random Llama as safetensors, one shard per layer, written without holding it in RAM."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=opts.vocab,
        hidden_size=opts.hidden,
        intermediate_size=opts.intermediate,
        num_hidden_layers=opts.layers,
        num_attention_heads=opts.hidden // 64,
        num_key_value_heads=max(1, opts.hidden // 512),
        max_position_embeddings=4096,
    )
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {
            n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()
        }
    shards = [[n for n in shapes if not n.startswith("model.layers.")]]
    shards += [
        [n for n in shapes if n.startswith(f"model.layers.{i}.")] for i in range(opts.layers)
    ]
    weight_map, generator = {}, torch.Generator().manual_seed(0)
    for k, names in enumerate(tqdm(shards, desc="bench: writing a random checkpoint")):
        tensors = {n: torch.randn(shapes[n], generator=generator) * 0.02 for n in names}
        tensors.update({n: torch.ones(shapes[n]) for n in names if n.endswith("norm.weight")})
        save_file(tensors, folder / f"model-{k:05d}.safetensors")
        weight_map.update(dict.fromkeys(names, f"model-{k:05d}.safetensors"))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    os.sync()  # dirty pages cannot be evicted: write them back before any cold read


def evict_page_cache(folder: Path) -> None:
    """Drop the folder's files from the page cache, so the next read comes from the disk."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def in_fresh_process(function, *args):
    """Run in a new interpreter, so a tier's peak memory is its own."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def measure(folder: Path, tier: str, tokens: list[int], opts: BenchOptions) -> dict:
    """In this (fresh) process: one cold pass per token count; seconds, bytes and peak memory."""
    import resource

    torch.set_num_threads(opts.threads)
    result = {"baseline_rss": proc_status("VmRSS"), "passes": {}}
    if tier == "ssd":  # the offloader gets less memory than the model needs
        limit = int(opts.ram_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    if tier == "resident":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        model = offload.from_pretrained(folder, mode=tier, device="cpu", buffers=opts.buffers)
    one_pass(model, 1)  # warm-up: thread start, allocator, lazy initialisation

    def read_alone() -> float:
        """The raw read: this tier's own transfers, cold, one layer after another, no compute."""
        model.ring.drain()
        evict_page_cache(folder)
        started = time.perf_counter()
        for layer in range(len(model.layers)):
            model.ring._load(layer, slot=0)
        return time.perf_counter() - started

    for n in tokens:
        row = result["passes"][n] = {"read_s": None, "moved": 0}
        if tier != "resident":
            before = read_alone()  # it drained the ring: the pass starts cold
            evict_page_cache(folder)
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
        row["pass_s"] = one_pass(model, n)
        row["peak"] = proc_status("VmHWM")
        if tier != "resident":
            row["moved"] = model.stats.bytes_moved
            # a shared disk's speed drifts within seconds: average the baseline around the pass
            row["read_s"] = (before + read_alone()) / 2
    return result


def one_pass(model, n_tokens: int) -> float:
    input_ids = torch.randint(model.config.vocab_size, (1, n_tokens))  # (1, n_tokens)
    cache = DynamicCache(config=model.config)
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids, past_key_values=cache, use_cache=True)
    return time.perf_counter() - started


def proc_status(key: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def report(opts: BenchOptions, tokens: list[int], runs: dict) -> str:
    layer_gb = runs["ssd"]["passes"][tokens[0]]["moved"] / opts.layers / 1e9
    resident_gb = 2 * opts.vocab * opts.hidden * 4 / 1e9  # embeddings and LM head, fp32
    kv_gb = 2 * opts.layers * max(1, opts.hidden // 512) * 64 * max(tokens) * 4 / 1e9
    lines = [
        f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        + f"{opts.threads} compute thread(s); load average {os.getloadavg()[0]:.1f} at the end",
        f"model: random Llama, fp32, {opts.layers} layers x {layer_gb:.3f} GB + resident parts "
        + f"{resident_gb:.2f} GB = {opts.layers * layer_gb + resident_gb:.2f} GB; "
        + f"buffers={opts.buffers}; one pass per row, each tier in a fresh process",
        "read = the tier's transfers alone (ssd: cold O_DIRECT reads; ram: memcpy into a slot), "
        + "mean of just before and just after the pass; compute = the in-memory model's pass",
        "overlap = pass / max(read, compute), goal <= 1.15; I/O eff = read / pass, goal >= 0.85 "
        + "for ssd at 1 token",
        f"ssd ran under RLIMIT_DATA = {opts.ram_limit_gb} GB; its RSS budget: resident "
        + f"{resident_gb:.2f} + {opts.buffers} x layer {layer_gb:.3f} + KV {kv_gb:.3f} GB "
        + f"+ {runs['ssd']['baseline_rss'] / 1e9:.2f} GB for Python, torch, transformers",
    ]
    for n in tokens:
        lines += ["", f"tokens = {n}"]
        lines.append(
            f"{'tier':<9}{'pass s':>8}{'read s':>8}{'compute s':>10}{'overlap':>9}{'I/O eff':>9}"
            + f"{'moved GB':>10}{'GB/s':>7}{'peak RSS GB':>13}"
        )
        compute = runs["resident"]["passes"][n]["pass_s"]
        for tier in TIERS:
            row = runs[tier]["passes"][n]
            read, seconds = row["read_s"], row["pass_s"]
            cells = [f"{tier:<9}{seconds:8.2f}"]
            if read is None:  # the in-memory model moves nothing
                cells.append(f"{'-':>8}{compute:10.2f}{'-':>9}{'-':>9}{'-':>10}{'-':>7}")
            else:
                cells.append(f"{read:8.2f}{compute:10.2f}{seconds / max(read, compute):9.2f}")
                cells.append(f"{read / seconds:9.2f}{row['moved'] / 1e9:10.2f}")
                cells.append(f"{row['moved'] / seconds / 1e9:7.2f}")
            cells.append(f"{row['peak'] / 1e9:13.2f}")
            lines.append("".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Time offload.py on a random Llama that is written to a temp folder "
        "(several GB) and deleted afterwards; Linux only.",
    )
    for option in dataclasses.fields(BenchOptions):
        flag = "--" + option.name.replace("_", "-")
        parser.add_argument(flag, type=option.type, default=option.default, **option.metadata)
    args = parser.parse_args(argv)
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchOptions)}
    print(bench(BenchOptions(**options)))


if __name__ == "__main__":
    main()
