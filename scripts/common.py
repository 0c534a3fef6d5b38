"""The benchmarks' one harness: the machine named in one line, a command line read from a config
dataclass, a meter on each model's passes, the row every method adds up to, the interleaved
measurement, the table, the plot, the random checkpoint writer and the offloader's raw read."""

import argparse
import functools
import json
import os
import platform
import sys
import time
import typing
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from specexec_tools.models import CACHE

HERE = Path(__file__).resolve().parents[1]  # the repository root
TARGET, DRAFT = str(HERE / "models" / "target"), str(HERE / "models" / "draft")  # the default pair
COPIES = Path.home() / ".cache/specexec/offload"  # converted copies, where the CLI keeps them


# ---- the machine and the command line ----


def machine():
    """The processor, its cores, torch's threads, the GPU, torch's version and the load now."""
    try:  # the processor's model name (Linux), else what `platform` knows
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {gpu}; "
        f"torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}"
    )


def option(default, help):
    """A config field and its help text (the script's `--help` shows it)."""
    return field(default=default, metadata={"help": help})


def read_config(config, doc, argv=None):
    """The config the command line asks for: a flag per field of the dataclass `config` (each made
    by option(default, help), as specexec.Options' are), of its type (of `X | None`, X); a bool is
    a switch; metadata "choices" lists the values. The config's ValueError is a usage error."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for f in fields(config):
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type is bool:
            parser.add_argument(flag, action="store_true", help=text)
            continue
        kind = next(t for t in typing.get_args(f.type) or [f.type] if t is not type(None))
        choices = f.metadata.get("choices")
        parser.add_argument(flag, type=kind, default=f.default, choices=choices, help=text)
    try:
        return config(**vars(parser.parse_args(argv)))
    except ValueError as error:
        parser.error(str(error))


def budgets(text):
    """ "1,16,auto" -> [1, 16, "auto"]."""
    return [b if b == "auto" else int(b) for b in text.split(",")]


def held_out_prompts(folder, n, kind="code"):
    """n prompts as token ids, by the tokenizer of the model in `folder`, and its EOS. kind "code":
    the first n held-out prompts of train_pair.py; "grounded": each of those followed by its own
    first half again, so that the continuation is in the input (a copy being edited); "chat":
    instruct turns whose answer rewrites their input (CHAT_PROMPTS), in the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if kind == "chat":
        turns = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS[:n]]
        render = dict(add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = [tokenizer.apply_chat_template(turn, **render)["input_ids"] for turn in turns]
        return [list(i) for i in ids], tokenizer.eos_token_id
    prompts = [p["prompt"] for p in json.loads((HERE / "models" / "prompts.json").read_text())[:n]]
    if kind == "grounded":
        prompts = [p + "\n\n" + p[: len(p) // 2] for p in prompts]
    return [tokenizer(p)["input_ids"] for p in prompts], tokenizer.eos_token_id


# Input-grounded instruct turns: the answer repeats much of the question
CHAT_PROMPTS = [
    "Rewrite in the past tense: I walk to the station every morning. The train is always late, "
    "so I read a book while I wait. When it arrives, I find a seat by the window.",
    "Fix the spelling: Ther are many diferent kinds of birds in the park. Some of them sing "
    "beautifuly in the morning, and others only come out at nite.",
    "Add type hints to this function:\ndef scale(values, factor):\n    result = []\n    for value"
    " in values:\n        result.append(value * factor)\n    return result",
    "Number each item of this list: apples, bread, milk, eggs, butter, cheese, rice, tea.",
    "Make this sentence formal: hey, can u send me the report by tomorrow? thanks a lot!",
    "Repeat the following sentence three times: The quick brown fox jumps over the lazy dog.",
]


# ---- measuring: a meter per model, a row per method, prompt by prompt ----


class Meter:
    """Counts the forward passes of `models` and the seconds spent in them, by wrapping each
    one's forward: every caller goes through it (ours, Hugging Face's `generate`, offload.py)."""

    def __init__(self, *models):
        self.passes, self.seconds = 0, 0.0
        self.idle_s = 0.0  # an offloaded model's: seconds its link sat idle before its passes
        for model in models:
            model.forward = self.metered(model.forward, torch.device(model.device))
            if hasattr(model, "stats"):  # offload.py's
                model.forward = self.idling(model.forward, model)

    def idling(self, forward, model):
        @functools.wraps(forward)
        def idling(*args, **kwargs):
            cache = kwargs.get(CACHE)  # a run's first pass: idle since another run
            later = cache is not None and cache.get_seq_length() > 0
            out = forward(*args, **kwargs)
            self.idle_s += model.stats.link_idle_s if later else 0.0
            return out

        return idling

    def metered(self, forward, device):
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

        @functools.wraps(forward)  # keeps the signature, which HF's generate inspects
        def metered(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            sync()
            self.seconds += time.perf_counter() - start
            self.passes += 1
            return out

        return metered


@dataclass
class Row:
    """One method at one setting, summed over the prompts."""

    setting: str  # "greedy", "sampled", "1 thread", ...
    method: str
    budget: int | str | None = None  # SpecExec's ("auto" too); None for the others
    outputs: list = field(default_factory=list)  # new tokens per prompt
    tokens: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    seconds: float = 0.0
    draft_s: float = 0.0  # inside the draft's forward
    target_s: float = 0.0  # inside the target's forward
    link_idle_s: float = 0.0  # an offloaded target's link, idle before its passes
    exact: str = ""
    chosen: list = field(default_factory=list)  # budget auto: each step's (budget, max_depth)

    tokens_per_pass = property(lambda r: r.tokens / max(1, r.target_passes))
    rate = property(lambda r: r.tokens / r.seconds)
    label = property(lambda r: f"{r.method}, budget {r.budget}" if r.budget else r.method)
    # seconds drafting, in target passes, and the rest
    split = property(lambda r: (r.draft_s, r.target_s, r.seconds - r.draft_s - r.target_s))

    def choices(self):
        """Budget auto: the (budget, max_depth) it chose most, and how often."""
        (budget, max_depth), n = Counter(self.chosen).most_common(1)[0]
        what = f"budget {budget}, max_depth {max_depth}" if budget else "plain steps"
        return f"{what} in {n} of {len(self.chosen)} steps"


def measure_interleaved(methods, prompt_ids, meters, progress):
    """Each (row, decode) on every prompt, prompt by prompt, each one row further on: a busy
    moment, a shared disk's drift, running first or last hit every row alike. decode(i, ids) ->
    (new tokens, Stats or None); meters: the target's, then the drafts'; progress on stderr."""
    for i, ids in enumerate(prompt_ids):
        started, turn = time.perf_counter(), i % len(methods)
        for row, decode in methods[turn:] + methods[:turn]:
            before = [(m.passes, m.seconds) for m in meters]
            idle = meters[0].idle_s
            start = time.perf_counter()
            tokens, stats = decode(i, ids)
            row.seconds += time.perf_counter() - start
            row.outputs.append(tokens)
            row.tokens += len(tokens)
            (passes, seconds), *drafting = [
                (m.passes - p, m.seconds - s) for m, (p, s) in zip(meters, before)
            ]
            row.target_passes, row.target_s = row.target_passes + passes, row.target_s + seconds
            row.draft_passes += sum(p for p, _ in drafting)
            row.draft_s += sum(s for _, s in drafting)
            row.chosen += stats.budgets if stats is not None else []
            row.link_idle_s += meters[0].idle_s - idle
        print(f"bench [{progress}]: prompt {i + 1} of {len(prompt_ids)}, every row: "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    reference = methods[0][0]
    reference.exact = "reference"
    for row, _ in methods[1:]:  # token for token against the first row: plain decoding
        row.exact = row.exact or ("yes" if row.outputs == reference.outputs else "NO")
    return [row for row, _ in methods]


# ---- reporting: the table, auto's line, the plot ----


def print_table(rows):
    """A markdown table, speedups against each setting's first row (plain decoding); then, per
    setting, budget auto against plain decoding and the best fixed budget."""
    print("| setting | method | tokens/target pass | tokens/s | speedup | time split draft / "
          "target / other | exact |\n|---|---|---:|---:|---:|---|---|")  # fmt: skip
    base = {}
    for row in rows:
        base.setdefault(row.setting, row.rate)
        split = " / ".join(f"{100 * s / row.seconds:.0f}%" for s in row.split)
        print(f"| {row.setting} | {row.label} | {row.tokens_per_pass:.2f} | {row.rate:.2f} "
              f"| {row.rate / base[row.setting]:.2f}x | {split} | {row.exact} |")  # fmt: skip
    for setting in base:
        mine = [row for row in rows if row.setting == setting]
        fixed = [row for row in mine if isinstance(row.budget, int)]
        for auto in (row for row in mine if row.budget == "auto"):
            line = f"{setting}, {auto.label}: {auto.rate / mine[0].rate:.2f}x plain decoding"
            if fixed:
                best = max(fixed, key=lambda row: row.rate)
                line += f", {auto.rate / best.rate:.0%} of the best fixed budget ({best.budget})"
            print(f"{line}; chose {auto.choices()}")


def plot_budgets(rows, path, title, values=("rate",)):
    """Per setting, each value against SpecExec's fixed budgets; the other rows (plain decoding,
    the peers, budget auto) as horizontal lines. One panel per value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"rate": "tokens/s, wall clock", "tokens_per_pass": "tokens per target pass"}
    curves = dict.fromkeys((r.setting, r.method) for r in rows if isinstance(r.budget, int))
    flat = [r for r in rows if not isinstance(r.budget, int)]  # no budget, or auto's
    colours = list(dict.fromkeys([m for _, m in curves] + [r.label for r in flat]))
    settings = list(dict.fromkeys(r.setting for r in rows))

    def style(setting, name):  # a colour per method, a line style per setting
        dashes = ("-", "--", ":", "-.")[settings.index(setting) % 4]
        return dict(color=f"C{colours.index(name) % 10}", ls=dashes, label=f"{name}, {setting}")

    budgets = sorted({r.budget for r in rows if isinstance(r.budget, int)}) or [1]
    fig, axes = plt.subplots(1, len(values), figsize=(2 + 6 * len(values), 5), squeeze=False)
    for ax, value in zip(axes[0], values):
        for setting, method in curves:
            spec = [r for r in rows if (r.setting, r.method) == (setting, method)]
            spec = [r for r in spec if isinstance(r.budget, int)]
            x = [r.budget for r in spec]
            ax.plot(x, [getattr(r, value) for r in spec], marker="o", **style(setting, method))
        for row in flat:
            ax.axhline(getattr(row, value), **style(row.setting, row.label))
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("budget: draft tree nodes the target verifies per pass")
        ax.set_title(names[value])
        ax.grid(alpha=0.3)
    handles, labels = axes[0][-1].get_legend_handles_labels()  # one legend, below the panels
    below = 0.2 + 0.2 * -(-len(labels) // 2)  # inches for the legend's rows, two columns
    fig.set_figheight(5 + below)
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, below / (5 + below), 1, 1))
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path}")


# ---- checkpoints on disk, and the offloader's reads of them ----


def save_shards(folder, shards):
    """Write (file name, tensors) pairs as safetensors files, a pair at a time, and the index
    that maps each tensor to its file; synced: dirty pages cannot be evicted, so once written
    back, later reads come from the disk."""
    from safetensors.torch import save_file

    weight_map = {}
    for name, tensors in shards:
        save_file({n: t.contiguous() for n, t in tensors.items()}, Path(folder) / name)
        weight_map |= dict.fromkeys(tensors, name)
    index = {"metadata": {}, "weight_map": weight_map}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    os.sync()


def write_random_llama(folder, dtype, **shape):
    """A random Llama (LlamaConfig fields in `shape`) as safetensors, one file per layer and one
    for the rest, each made as it is written, so never held in RAM whole."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape)
    config.save_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        shapes = {name: p.shape for name, p in model.named_parameters()}
    groups = [[n for n in shapes if not n.startswith("model.layers.")]]
    groups += [[n for n in shapes if n.startswith(f"model.layers.{i}.")]
               for i in range(config.num_hidden_layers)]  # fmt: skip
    generator = torch.Generator().manual_seed(0)

    def random(names):
        tensors = {n: torch.randn(shapes[n], generator=generator) * 0.02 for n in names}
        tensors |= {n: torch.ones(shapes[n]) for n in names if n.endswith("norm.weight")}
        return {n: t.to(dtype) for n, t in tensors.items()}

    save_shards(folder, ((f"model-{k:05d}.safetensors", random(g)) for k, g in enumerate(groups)))


def evict_page_cache(folder):
    """Drop the folder's files from the page cache, so that the next read comes from the disk."""
    for path in filter(Path.is_file, Path(folder).iterdir()):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_alone(model, evict=None):
    """Seconds and bytes of an offloaded model's own transfers with nothing computing, one
    streamed layer after another into a slot of its ring, as its reader thread issues them in a
    pass: ssd, O_DIRECT preads; ram, a copy; quantized, and the dequantizing. `evict`: a folder
    to drop from the page cache first, where the reads come from."""
    ring = model.ring
    ring.drain()  # no prefetch in flight: the disk is ours alone, the slot free
    if evict is not None:
        evict_page_cache(evict)
    start = time.perf_counter()
    for layer in ring.order:
        ring.storage.load(layer, ring.slots[0], ring.ops)
    ring.ops.host_wait(ring.ops.record("copy"))
    return time.perf_counter() - start, len(ring.order) * ring.sizes.slot
