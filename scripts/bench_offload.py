"""Benchmark offload.py: one pass of a random Llama bigger than the RAM it may use, per tier.

    python -m scripts.bench_offload                 # cpu: 1, 16, 128 and 1024 tokens; a few minutes
    python -m scripts.bench_offload --device cuda   # gpu: CUDA-event timers and the copy timeline
    python -m scripts.bench_offload --quality models/target   # held-out loss: float vs int8 vs int4

A random Llama of several GB is written to a temp folder and deleted afterwards (Linux only). On
cpu, each tier (ssd, ram, their int8 / int4 rows, and the in-memory model: the compute baseline)
runs in a fresh process, one pass per token count beside the raw cold read of the same bytes. On
cuda, CUDA events time the passes and the profiler's device timeline shows how the copies ran,
beside the raw pinned (ram) or cold disk (ssd) bandwidth. docs/results.md reads the numbers.
"""

import concurrent.futures
import multiprocessing
import os
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import offload
from scripts import train_pair
from scripts.common import (
    evict_page_cache,
    machine,
    option,
    read_alone,
    read_config,
    write_random_llama,
)
from specexec_tools.models import CACHE


@dataclass
class BenchConfig:
    """The benchmark's defaults, written once; the command line reads them (`--help`)."""

    tokens: str = option("1,16,128,1024", "tokens per pass, comma-separated")
    dtype: str = option("", "the model's dtype; empty: float16 on cuda, float32 on cpu")
    layers: int = option(16, "decoder layers of the random Llama")
    hidden: int = option(2048, "hidden size (heads of 64)")
    device: str = field(  # a field of its own: only these two
        default="cpu",
        metadata={"help": "cuda: CUDA-event timers, copy timeline", "choices": ("cpu", "cuda")},
    )
    intermediate: int = option(5632, "MLP size")
    vocab: int = option(32000, "vocabulary size")
    buffers: int = option(2, "device buffers in the ring")
    quantize: str = option("int8,int4", "quantized rows beside each float one; '': none")
    modes: str = option("ssd,ram", "the tiers measured, comma-separated")
    threads: int = option(max(1, (os.cpu_count() or 2) - 1), "cpu: all cores but the reader's")
    ram_limit_gb: float = option(2.0, "cpu: the ssd process's RLIMIT_DATA, below the model")
    folder: str = option("", "keep the random checkpoint here; empty: a temp folder")
    quality: str = option("", "a model folder: held-out loss float vs int8 vs int4, not timing")
    windows: int = option(10**6, "--quality: at most this many held-out windows of 512 tokens")


def bench(opts: BenchConfig) -> str:
    """Time one pass per token count for each tier, each in a fresh process; return the report."""
    tokens = [int(n) for n in opts.tokens.split(",")]
    folder = Path(opts.folder or tempfile.mkdtemp(prefix="offload-bench-"))
    try:
        shape = dict(hidden_size=opts.hidden, intermediate_size=opts.intermediate)
        shape |= dict(num_attention_heads=opts.hidden // 64, vocab_size=opts.vocab)
        shape |= dict(num_key_value_heads=max(1, opts.hidden // 512), max_position_embeddings=4096)
        write_random_llama(folder, model_dtype(opts), num_hidden_layers=opts.layers, **shape)
        if opts.device == "cuda":
            return bench_cuda(folder, tokens, opts, model_dtype(opts))
        runs = {t: in_fresh_process(measure, folder, t, tokens, opts) for t in tiers(opts)}
    finally:
        if not opts.folder:
            shutil.rmtree(folder)
    return report(opts, tokens, runs)


def model_dtype(opts: BenchConfig) -> torch.dtype:
    return getattr(torch, opts.dtype or ("float16" if opts.device == "cuda" else "float32"))


def tiers(opts: BenchConfig) -> list[str]:
    """ssd and ram, each with its quantized rows ("ssd int8"); resident: the in-memory model."""
    kinds = ["", *(kind for kind in opts.quantize.split(",") if kind)]
    modes = opts.modes.split(",")
    return [f"{mode} {kind}".strip() for mode in modes for kind in kinds] + ["resident"]


def in_fresh_process(function, *args):
    """Run in a new interpreter, so a tier's peak memory is its own."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def measure(folder: Path, tier: str, tokens: list[int], opts: BenchConfig) -> dict:
    """In this (fresh) process: one cold pass per token count; seconds, bytes and peak memory."""
    torch.set_num_threads(opts.threads)
    result = {"baseline_rss": proc_status("VmRSS"), "passes": {}}
    mode, _, kind = tier.partition(" ")
    if mode == "ssd":  # the offloader gets less memory than the model needs
        limit = int(opts.ram_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    if tier == "resident":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=model_dtype(opts)).eval()
    else:  # ssd + quantize reads a quantized copy, converted once into folder/offload
        options = dict(buffers=opts.buffers, quantize=kind or None, offload_dir=folder / "offload")
        model = offload.from_pretrained(folder, mode=mode, device="cpu", **options)
        folder = model.converted_folder or folder  # where its reads come from
    one_pass(model, 1)  # warm-up: thread start, allocator, lazy initialisation
    for n in tokens:
        row = result["passes"][n] = {"read_s": None, "moved": 0}
        if tier != "resident":
            before, _ = read_alone(model, evict=folder)  # it drained the ring: a cold pass next
            evict_page_cache(folder)
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
        row["pass_s"] = one_pass(model, n)
        row["peak"] = proc_status("VmHWM")
        if tier != "resident":
            row["moved"] = model.stats.bytes_moved
            # a shared disk's speed drifts within seconds: average the baseline around the pass
            row["read_s"] = (before + read_alone(model, evict=folder)[0]) / 2
    return result


def one_pass(model, n_tokens: int, device: str = "cpu") -> float:
    input_ids = torch.randint(model.config.vocab_size, (1, n_tokens), device=device)  # (1, n)
    cache = DynamicCache(config=model.config)
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids, **{CACHE: cache}, use_cache=True)
    return time.perf_counter() - started


def proc_status(key: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (Linux)."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(key + ":")).split()[1]) * 1024


def report(opts: BenchConfig, tokens: list[int], runs: dict) -> str:
    """The legend, then a markdown table: a row per token count and tier."""
    layer_gb = runs["ssd"]["passes"][tokens[0]]["moved"] / opts.layers / 1e9
    dtype = model_dtype(opts)
    resident_gb = 2 * opts.vocab * opts.hidden * dtype.itemsize / 1e9  # embeddings and LM head
    kv_gb = 2 * opts.layers * max(1, opts.hidden // 512) * 64 * max(tokens) * dtype.itemsize / 1e9
    lines = [
        f"machine: {machine()} at the end; {opts.threads} compute thread(s) in each tier",
        f"model: random Llama, {str(dtype).removeprefix('torch.')}, {opts.layers} layers x "
        f"{layer_gb:.3f} GB + resident parts {resident_gb:.2f} GB = "
        f"{opts.layers * layer_gb + resident_gb:.2f} GB; buffers={opts.buffers}; one pass per "
        "row, each tier in a fresh process",
        "read = the tier's transfers alone (ssd: cold O_DIRECT reads; ram: memcpy into a slot), "
        "mean of just before and just after the pass; compute = the in-memory model's pass",
        f"ssd ran under RLIMIT_DATA = {opts.ram_limit_gb} GB; its RSS budget: resident "
        f"{resident_gb:.2f} + {opts.buffers} x layer {layer_gb:.3f} + KV {kv_gb:.3f} GB + "
        f"{runs['ssd']['baseline_rss'] / 1e9:.2f} GB for Python, torch, transformers",
        "int8 / int4 rows: the linear weights stored and moved quantized, dequantized as they "
        "land; moved x, pass x: against the same tier's float row",
        "",
        "| tokens | tier | pass s | read s | compute s | overlap (pass / max) | I/O eff (read / "
        "pass) | moved GB | GB/s | peak RSS GB | moved x | pass x |",
        "|---:|---|" + "---:|" * 10,
    ]
    for n in tokens:
        compute = runs["resident"]["passes"][n]["pass_s"]
        for tier, run in runs.items():
            row = run["passes"][n]
            seconds, read, moved = row["pass_s"], row["read_s"], row["moved"]
            moving = [None] * 4  # overlap, I/O eff, moved GB, GB/s: resident moves nothing
            if read is not None:
                moving = [seconds / max(read, compute), read / seconds]
                moving += [moved / 1e9, moved / seconds / 1e9]
            against = [None, None]  # moved x, pass x
            if " " in tier:  # quantized: against the same tier's float row
                float_row = runs[tier.split()[0]]["passes"][n]
                against = [moved / float_row["moved"], seconds / float_row["pass_s"]]
            cells = [seconds, read, compute, *moving, row["peak"] / 1e9, *against]
            cells = [f"{c:.2f}" if c is not None else "-" for c in cells]
            lines.append(f"| {n} | {tier} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- quality: what int8 / int4 weights cost a real target ----


def quality(target: str, windows: int, seq_len: int = 512, batch: int = 8) -> str:
    """Held-out loss (nats/token) of `target` in float32, its weights as they are, int8 and int4,
    and top-1 agreement with the full model, on train_pair.py's held-out files as one token stream
    (EOS between files) cut into consecutive windows of seq_len tokens."""
    root, _, held_out = train_pair.stdlib_files()
    tokenizer = AutoTokenizer.from_pretrained(target)
    stream = train_pair.token_stream(tokenizer, train_pair.read_texts(held_out))  # (n_tokens,)
    n = min(windows, (len(stream) - 1) // seq_len)
    inputs = stream[: n * seq_len].view(n, seq_len)  # (n, seq_len)
    labels = stream[1 : n * seq_len + 1].view(n, seq_len)  # (n, seq_len): the next tokens
    lines = [
        f"{target}, float32 compute; held out: {len(held_out)} files of {root}, {n} windows "
        + f"of {seq_len} tokens = {n * seq_len} predictions; {machine()}",
        f"{'weights':<10}{'loss nats/token':>16}{'top-1 agreement with full':>27}",
    ]
    full_top1 = None
    for kind in (None, "int8", "int4"):
        options = {"mode": "ram", "device": "cpu", "dtype": torch.float32, "quantize": kind}
        loss, top1 = 0.0, []
        with offload.from_pretrained(target, **options) as model:
            for i in tqdm(range(0, n, batch), desc=f"quality: {kind or 'full'}"):
                logits = model(inputs[i : i + batch], use_cache=False).logits  # (b, seq, vocab)
                targets = labels[i : i + batch].flatten()
                loss += F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum").item()
                top1.append(logits.argmax(-1))  # (b, seq_len)
        top1 = torch.cat(top1)  # (n, seq_len)
        full_top1 = top1 if full_top1 is None else full_top1
        agreement = (top1 == full_top1).float().mean().item()
        lines.append(f"{kind or 'full':<10}{loss / labels.numel():16.4f}{agreement:27.4f}")
    return "\n".join(lines)


# ---- cuda: CUDA-event timers and the device timeline ----


def bench_cuda(folder: Path, tokens: list[int], opts: BenchConfig, dtype: torch.dtype) -> str:
    """Per tier and token count: pass seconds by CUDA events, the copy timeline, GB/s vs raw."""
    lines = [
        f"machine: {machine()}; random Llama, {opts.layers} layers, {dtype}, {opts.buffers} slots",
        "busy = copy engine busy / pass; gap = idle time between copies (mean, max); overlap = "
        "copy time beside a kernel / copy time; raw = pinned copies (ram), cold reads (ssd) alone;"
        " compute = the in-memory float model's pass; pinned = host memory pinned, GB",
        "| tier | tokens | pass ms | compute ms | busy | gap ms, mean | gap ms, max | overlap "
        "| GB/s | raw GB/s | / raw | pinned |\n|---|" + "---:|" * 11,
    ]
    resident = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    for n in tokens:  # each shape once untimed: kernel choice and lazy loading stay out
        one_pass(resident, n, "cuda")
    compute = {n: cuda_seconds(partial(one_pass, resident, n, "cuda")) for n in tokens}
    del resident
    torch.cuda.empty_cache()
    for tier in sorted(tiers(opts)[:-1], key=lambda tier: tier[:3] != "ram"):  # ram first
        mode, _, kind = tier.partition(" ")
        options = dict(mode=mode, device="cuda", dtype=dtype, buffers=opts.buffers)
        options |= dict(quantize=kind or None, offload_dir=folder / "offload")
        with offload.from_pretrained(folder, **options) as model:
            read_from = model.converted_folder or folder  # ssd int8/int4: a converted copy
            for n in tokens:
                one_pass(model, n, "cuda")  # this shape's kernels chosen and loaded, untimed
                raw = raw_gb_per_s(model, read_from, mode)  # measured beside each pass
                if mode == "ssd":
                    model.ring.drain()
                    evict_page_cache(read_from)
                repeats = 1 if mode == "ssd" else 5  # ram: the median of 5 passes
                seconds = statistics.median(
                    cuda_seconds(partial(one_pass, model, n, "cuda")) for _ in range(repeats)
                )
                gb_per_s = model.stats.bytes_moved / seconds / 1e9
                t = copy_timeline(partial(one_pass, model, n, "cuda"))
                cells = [seconds * 1e3, compute[n] * 1e3, t["busy"], t["gap_mean_ms"]]
                cells += [t["gap_max_ms"], t["overlap"], gb_per_s, raw, gb_per_s / raw]
                cells.append(model.pinned_bytes / 1e9)
                lines.append(f"| {tier} | {n} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def cuda_seconds(run) -> float:
    """Device seconds of `run()`, between two CUDA events, synchronised before and after."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def raw_gb_per_s(model, folder: Path, tier: str) -> float:
    """The bandwidth the tier could reach alone: pinned copies (ram), cold reads (ssd)."""
    ring = model.ring
    ring.drain()
    if tier == "ram":
        storage = getattr(ring.storage, "storage", ring.storage)  # int8/int4: the bytes moved
        host, slot = storage.buffers[0], ring.slots[0]  # registered arena -> device
        seconds = cuda_seconds(
            lambda: [slot[: host.numel()].copy_(host, non_blocking=True) for _ in range(10)]
        )
        return 10 * host.numel() / seconds / 1e9
    seconds, nbytes = read_alone(model, evict=folder)  # cold reads as the tier issues them
    return nbytes / seconds / 1e9


def copy_timeline(run) -> dict[str, float]:
    """Run once under the profiler; from the device timeline, how the host-to-device copies ran:
    busy fraction of the span, gaps between them, their share beside kernels, pageable ones."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    copies, kernels, pageable = [], [], 0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:  # on the device's timeline, in microseconds
            is_copy = "memcpy htod" in event.name.lower()  # "Memcpy HtoD (Pinned -> Device)"
            (copies if is_copy else kernels).append((event.time_range.start, event.time_range.end))
            pageable += is_copy and "pageable" in event.name.lower()
    if not copies:
        raise RuntimeError("the profile shows no host-to-device copies: check copy_timeline")
    copies, kernels = merged(copies), merged(kernels)
    span = max(end for _, end in copies + kernels) - min(start for start, _ in copies + kernels)
    busy = sum(end - start for start, end in copies)
    gaps = [b[0] - a[1] for a, b in zip(copies, copies[1:])] or [0]
    beside = sum(max(0, min(c[1], k[1]) - max(c[0], k[0])) for c in copies for k in kernels)
    return {
        "busy": busy / span,
        "gap_mean_ms": sum(gaps) / len(gaps) / 1e3,  # profiler times are microseconds
        "gap_max_ms": max(gaps) / 1e3,
        "overlap": beside / busy,  # copy time beside a kernel
        "pageable": pageable,  # copies from unpinned memory: staged by the driver, slower
    }


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, overlapping intervals joined: their union."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def main(argv: list[str] | None = None) -> None:
    opts = read_config(BenchConfig, __doc__, argv)
    print(quality(opts.quality, opts.windows) if opts.quality else bench(opts))


if __name__ == "__main__":
    main()
