"""SpecExec where it pays: a big target streamed from disk, against what a user would run instead.

    python -m scripts.bench_disk                       # grow, measure, plot (~25 min on 2 cores)
    python -m scripts.bench_disk --grow-to big-target  # only write the grown target (a minute)
    python -m scripts.bench_disk --folder big-target   # measure it (grown once, kept)
    python -m scripts.bench_disk --target SmolLM2-135M-Instruct --layers 0 --draft-layers 8 \\
        --budgets 4,16,64,auto --draft-threads 0   # a weak real pair: a model, its first layers
    python -m scripts.bench_disk --device cuda --offload ram   # a GPU, the layers in pinned RAM
    python -m scripts.bench_disk --layers 0 --offload ram --link 0.01 --skip-peers \
        --budgets 64,256,1024,auto --depths 16,32 --tokens 64   # the paper's regime, simulated

The default target (12 MB) is grown into one big enough that reading it from disk dominates a
pass, that still says what the trained target says (`grow_target`); `--layers 0` streams the
target as it is. Rows, each on every prompt before the next prompt, after one warm-up each: plain
decoding streamed by offload.py (ssd, or ram); accelerate's offload of the same checkpoint ("disk",
or "cpu" to a GPU) with plain and with assisted `generate`; SpecExec at each budget. Every row
checked token for token against plain decoding; the offloader's transfers alone, before and after
the rows, give the disk's (or the link's) speed.
docs/results.md says more of the grown target and the peers.
"""

import functools
import itertools
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import offload
import specexec
from scripts import common
from scripts.common import option
from specexec_tools import cost_model, models


@dataclass
class DiskBenchConfig:
    """The run's defaults, written once; the command line reads them (`--help`)."""

    target: str = option(common.TARGET, "the target (grown unless --layers 0)")
    draft: str = option(common.DRAFT, "the draft model folder")
    draft_layers: int = option(0, "N > 0: the draft is the target's own first N layers instead")
    layers: int = option(20, "decoder layers of the grown target (the trained ones first)")
    intermediate: int = option(32768, "its MLP width: about 0.1 GB per layer in float32")
    grow_to: str | None = option(None, "write the grown target here and exit")
    folder: str | None = option(None, "keep the grown target here for reuse; None: a temp folder")
    prompts: int = option(3, "held-out prompts")
    tokens: int = option(48, "new tokens per prompt")
    budgets: str = option("1,4,8,16,32,64,128,256,auto", "SpecExec budgets, comma-separated")
    max_depth: int = option(specexec.Options.max_depth, "draft passes per step, at most")
    depths: str = option("", "comma-separated: each fixed budget at each of these depths instead")
    link: float | None = option(None, "with --offload ram on cpu: a simulated link, GB/s")
    buffers: int = option(2, "the ring's device slots")
    draft_threads: int = option(specexec.Options.draft_threads, "threads of the draft's passes")
    device: str = option("cpu", "where the target computes and the draft lives: cpu, cuda")
    offload: str = option("ssd", "the target's layers read each pass from: ssd, or ram (cuda)")
    skip_peers: bool = option(False, "no accelerate rows")
    lookup: int = option(
        0,
        "N > 0: also SpecExec with lookup (up to N tokens copied) beside the "
        "draft, and lookup alone (no draft), at each budget",
    )
    prompt_kind: str = option(
        "code",
        "code (held out), grounded (code, its continuation in the "
        "input) or chat (instruct turns: a rewrite of the input)",
    )
    plot: str = option(str(common.HERE / "figures" / "bench_disk.png"), "where the PNG goes")


# ---- the grown target: real bytes, the trained target's text ----


def grow_target(source, dest, n_layers, intermediate, seed=0):
    """Write `source` (a Llama-family folder) grown to n_layers x intermediate, float32, one
    safetensors file per layer. Each trained layer's MLP gets units with random input weights and
    zero output weights; new layers, random but for zero output projections (o_proj, down_proj),
    follow: all computed in full, adding exactly zero. Every byte is real, the text the same."""
    source, dest = Path(source), Path(dest)
    config = AutoConfig.from_pretrained(source)
    old_layers, old_width = config.num_hidden_layers, config.intermediate_size
    if n_layers < old_layers or intermediate < old_width:
        raise ValueError(f"the grown target must be at least {old_layers} x {old_width}")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, dest / name)
    config.num_hidden_layers, config.intermediate_size = n_layers, intermediate
    config.dtype = "float32"
    config.save_pretrained(dest)

    trained = {}
    for path in source.glob("*.safetensors"):
        trained |= {n: t.float() for n, t in load_file(path).items()}
    generator = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size

    drawn = {}

    def random(*shape):  # drawn once per shape, then copied: a 30 GB target grows in a minute
        if shape not in drawn:
            drawn[shape] = torch.randn(*shape, generator=generator) * 0.02
        return drawn[shape].clone()

    def grown(i):  # layer i: the trained one, or a new one shaped as layer 0
        prefix = f"model.layers.{i if i < old_layers else 0}."
        tensors = {n[len(prefix) :]: t for n, t in trained.items() if n.startswith(prefix)}
        extra = intermediate - old_width  # MLP units added
        if i >= old_layers:  # a new layer: random, computes in full, its outputs times zero
            tensors = {n: random(*t.shape) for n, t in tensors.items()}
            tensors |= {n: torch.ones(hidden) for n in tensors if n.endswith("norm.weight")}
            tensors["self_attn.o_proj.weight"] *= 0
            extra = intermediate
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):  # (intermediate, hidden)
            kept = tensors[name][: intermediate - extra]
            tensors[name] = torch.cat([kept, random(extra, hidden)])
        down = tensors["mlp.down_proj.weight"][:, : intermediate - extra]  # the added units: zeros
        tensors["mlp.down_proj.weight"] = torch.cat([down, torch.zeros(hidden, extra)], dim=1)
        return {f"model.layers.{i}.{n}": t for n, t in tensors.items()}

    outer = {n: t for n, t in trained.items() if "layers." not in n}
    layers = ((f"model-layer-{i:03d}.safetensors", grown(i)) for i in range(n_layers))
    common.save_shards(dest, itertools.chain([("model-outer.safetensors", outer)], layers))
    return dest


# ---- the peers: accelerate's disk offload of the same checkpoint ----


def accelerate_target(folder, dtype, device, tier):
    """The checkpoint in `folder` as accelerate streams it to `device`: every decoder layer on
    "disk" (ssd: read from the safetensors files in place at each forward, float32 files needing
    no copy, dropped from the page cache before every pass) or in "cpu" memory (ram: copied to
    the GPU at each forward), the rest on the device."""
    n_layers = AutoConfig.from_pretrained(folder).num_hidden_layers
    where = "disk" if tier == "ssd" else "cpu"  # the layers
    on = "cpu" if device.type == "cpu" else device.index or 0  # the rest; a GPU by its index
    device_map = dict.fromkeys(["model.embed_tokens", "model.norm", "model.rotary_emb"], on)
    device_map |= {"lm_head": on} | {f"model.layers.{i}": where for i in range(n_layers)}
    copies = Path.home() / ".cache" / "specexec" / "accelerate"  # only for non-float32 files
    placed = dict(device_map=device_map, offload_folder=copies, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, **placed).eval()
    os.sync()

    def cold(module, args):
        for where in filter(Path.exists, (folder, copies)):  # no copies of float32 files
            common.evict_page_cache(where)

    if tier == "ssd":
        model.register_forward_pre_hook(cold)
    return model


# ---- run, report, plot ----


def run(cfg, folder):
    from transformers.utils import logging

    logging.set_verbosity_error()  # HF's notes on generation arguments, once per call
    started = time.strftime("%Y-%m-%d %H:%M")
    print(f"machine: {common.machine()}; {started}")
    config = folder / "config.json"
    grown = config.exists() and json.loads(config.read_text())["num_hidden_layers"] == cfg.layers
    if cfg.layers and not grown:
        grow_target(cfg.target, folder, cfg.layers, cfg.intermediate)
        print(f"grew {cfg.target} into {folder}")
    device, float32 = torch.device(cfg.device), torch.float32
    ops = offload.Cpu(cfg.link) if cfg.link else device
    streamed = dict(mode=cfg.offload, device=ops, dtype=float32, offload_dir=common.COPIES)
    streamed |= dict(buffers=cfg.buffers)
    target = offload.from_pretrained(folder, **streamed)
    read_before, nbytes = common.read_alone(target)
    if cfg.draft_layers:  # a truncated copy of the target, in memory
        first = dict(num_hidden_layers=cfg.draft_layers, dtype=float32)
        draft = AutoModelForCausalLM.from_pretrained(folder, **first).to(device).eval()
        what = f"the target's first {cfg.draft_layers} layers"
    else:
        draft, what = models.load(cfg.draft, device, float32), cfg.draft
    # the peer streams what the target streams (ram on a CPU: nothing to stream, no peer)
    streams = not cfg.skip_peers and (cfg.offload == "ssd" or device.type != "cpu")
    peer = accelerate_target(folder, float32, device, cfg.offload) if streams else None
    # the peer's passes count as the target's
    meters = [common.Meter(target, *[peer] * bool(peer)), common.Meter(draft)]
    prompt_ids, eos = common.held_out_prompts(folder, cfg.prompts, cfg.prompt_kind)
    print(
        f"{len(prompt_ids)} {cfg.prompt_kind} prompts x {cfg.tokens} new tokens, greedy; "
        f"target {folder} streamed from {cfg.offload}, draft {what}; float32 on {device}; "
        f"trees at most {cfg.max_depth} deep\n"
    )

    def plain(i, ids, n=cfg.tokens):  # threads 0: torch's, as for accelerate's peers
        return specexec.autoregressive(target, ids, max_new_tokens=n, eos_token_id=eos, threads=0)

    def speculative(budget, lookup=0, with_draft=True, depth=cfg.max_depth):
        def decode(i, ids, n=cfg.tokens):
            cost_model.LEARNED.clear()  # auto starts each prompt as a fresh process would
            return specexec.generate(target, draft if with_draft else None, ids, max_new_tokens=n,
                                     budget=budget, max_depth=depth, lookup=lookup,
                                     eos_token_id=eos, draft_threads=cfg.draft_threads,
                                     threads=0)  # fmt: skip

        return decode

    def accelerate(assistant):
        def decode(i, ids, n=cfg.tokens):
            options = dict(max_new_tokens=n, eos_token_id=eos, pad_token_id=eos, do_sample=False)
            ids = torch.tensor([ids], device=device)  # (1, len(ids))
            out = peer.generate(ids, assistant_model=assistant, **options)
            return out[0, ids.shape[1] :].tolist(), None  # (1, len(ids) + new)

        return decode

    row = functools.partial(common.Row, "streamed")
    methods = [(row("plain decoding"), plain)]
    peers = [] if peer is None else [("plain", None), ("assisted", draft)]
    name = "accelerate disk offload" if cfg.offload == "ssd" else "accelerate cpu offload"
    methods += [(row(f"{name}, {how}"), accelerate(a)) for how, a in peers]
    depths = [int(d) for d in cfg.depths.split(",")] if cfg.depths else [cfg.max_depth]
    for b in common.budgets(cfg.budgets):
        for d in depths if b != "auto" else [cfg.max_depth]:
            name = f"SpecExec, depth {d}" if cfg.depths and b != "auto" else "SpecExec"
            methods.append((row(name, b), speculative(b, depth=d)))
    if cfg.lookup:
        for method, with_draft in (("SpecExec + lookup", True), ("lookup alone", False)):
            methods += [(row(method, b), speculative(b, cfg.lookup, with_draft))
                        for b in common.budgets(cfg.budgets)]  # fmt: skip
    with target, torch.no_grad():
        for _, decode in methods:  # warm-up: threads, allocator, lazy initialisation
            decode(0, prompt_ids[0][:32], 2)
        rows = common.measure_interleaved(methods, prompt_ids, meters, "bench_disk")
        read_after, _ = common.read_alone(target)  # a shared disk's speed drifts
    read_s = (read_before + read_after) / 2
    common.print_table(rows)
    for r in rows:  # the link's idle time between passes, against the drafting it could hide
        if r.draft_s and cfg.offload == "ram":
            print(
                f"{r.label}: the link idle {r.link_idle_s:.2f} s of {r.draft_s:.2f} s drafting "
                f"({1 - r.link_idle_s / r.draft_s:.0%} of the drafting behind loads)"
            )
    how = "O_DIRECT reads" if cfg.offload == "ssd" else "copies from pinned RAM"
    print(f"\n{cfg.offload}, the offloader's transfers of the {nbytes / 1e9:.2f} GB of layers "
          f"with nothing computing ({how}): {read_before:.2f} s before the rows, {read_after:.2f}"
          f" s after: {nbytes / 1e9 / read_s:.2f} GB/s on average; load average at the end: "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    on = f"{os.cpu_count()}-core CPU" if device.type == "cpu" else torch.cuda.get_device_name()
    versus = ", against accelerate's offload" if peer else ""
    across = f" across a simulated {cfg.link} GB/s link" if cfg.link else ""
    title = (f"A {nbytes / 1e6:,.0f} MB target streamed from {cfg.offload}{across} each pass, "
             f"greedy{versus}\n({folder.name}, float32; draft {Path(what).name}; "
             f"{on}, {started[:10]}); lines: the rows without a fixed budget")  # fmt: skip
    common.plot_budgets(rows, cfg.plot, title)


def main(argv=None):
    cfg = common.read_config(DiskBenchConfig, __doc__, argv)
    if cfg.grow_to:
        grow_target(cfg.target, cfg.grow_to, cfg.layers, cfg.intermediate)
        print(f"{cfg.grow_to}: the default target grown to {cfg.layers} layers x "
              f"{cfg.intermediate} MLP units, float32")  # fmt: skip
        return
    if not cfg.layers:  # the target as it is
        return run(cfg, Path(cfg.target))
    folder = Path(cfg.folder or tempfile.mkdtemp(prefix="specexec-grown-"))
    try:
        run(cfg, folder)
    finally:
        if cfg.folder is None:
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
