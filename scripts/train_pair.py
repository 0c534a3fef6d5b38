"""Train the project's default model pair: a small Llama target and a distilled draft.

The data is the running interpreter's own standard library (`.py` files, tests excluded, a fixed
~5% held out by a hash of the file name): nothing is downloaded. A byte-level BPE tokenizer, then
the target (a Llama of a few million parameters) on next-token loss, then the draft, ~10x smaller,
distilled: KL divergence from the target's next-token distribution plus a little next-token loss
(`--draft-baseline`: the same draft on the data alone too, to show what distilling buys). It
reports held-out loss and each draft's top-1 / top-8 agreement with the target, and writes both
models (float16) and held-out prompts.

    python -m scripts.train_pair --draft-baseline   # writes models/{target,draft,prompts.json}
    python -m scripts.train_pair --target-from models/target --target-steps 0   # only a new draft

Seeds are fixed; the result depends on the Python version (its standard library is the data)
and, in the last bits, on the machine.
"""

import hashlib
import json
import math
import random
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.common import option, read_config

# ---- config ----


@dataclass
class TrainConfig:
    """Training options: one source of defaults for the command line (`--help` lists them)."""

    out: str = option("models", "where the models, prompts and logs are written")
    vocab_size: int = option(4096, "BPE tokenizer vocabulary size")
    seq_len: int = option(512, "training window, and the models' context length")
    batch_size: int = option(8, "windows per optimizer step")
    target_steps: int = option(1600, "optimizer steps for the target")
    draft_steps: int = option(800, "optimizer steps for the draft")
    draft_hidden: int = option(128, "the draft's width, a multiple of 64 (a head per 64; MLP 3x)")
    draft_layers: int = option(2, "the draft's decoder layers")
    target_lr: float = option(3e-3, "peak learning rate of the target")
    draft_lr: float = option(3e-3, "peak learning rate of the draft")
    distill_weight: float = option(0.9, "w in draft loss = w * KL(target || draft) + (1 - w) * CE")
    eval_batches: int = option(16, "held-out batches for the report")
    seed: int = option(0, "random seed")
    threads: int = option(0, "torch threads (0: torch's default, one per core)")
    draft_baseline: bool = option(False, "also train the draft on data alone, for comparison")
    target_from: str = option("", "start from this target, its tokenizer (--target-steps 0: as is)")
    draft_from: str = option("", "start the distilled draft from this one (in its own shape)")

    def __post_init__(self):
        if self.draft_hidden < 64 or self.draft_hidden % 64:
            raise ValueError(f"--draft-hidden must be a multiple of 64, not {self.draft_hidden}")


TARGET_SHAPE = 256, 6  # the target's width and decoder layers: ~6.1M parameters
EOS = "<|endoftext|>"

# ---- data: the standard library's own source ----


def stdlib_files(held_out_percent=5):
    """The interpreter's standard-library .py files, tests excluded, split train / held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "lib2to3", "turtledemo"}
    skip |= {"encodings", "pydoc_data"}  # generated tables and a help-text dump, not code
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    train, held_out = [], []
    for path in files:
        digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
        (held_out if digest[0] * 100 < held_out_percent * 256 else train).append(path)
    return root, train, held_out


def read_texts(paths):
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def train_tokenizer(texts, size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes: no text is out of vocabulary
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[EOS], initial_alphabet=alphabet)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


def token_stream(tokenizer, texts):
    """All texts as one stream of ids, each file followed by EOS."""
    ids = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)  # (n_tokens,)


def batches(stream, batch_size, seq_len, generator):
    """Endless random windows of seq_len + 1 tokens."""
    while True:
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
        yield torch.stack([stream[s : s + seq_len + 1] for s in starts])  # (batch, seq_len + 1)


# ---- models ----


def make_model(width, layers, tokenizer, cfg):
    """A new Llama, target or draft alike: heads of 64, an MLP 3x as wide, tied embeddings (the
    draft by default: width 128, 2 layers, ~0.95M parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    eos, heads = tokenizer.eos_token_id, width // 64
    shape = dict(hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers)
    shape |= dict(num_attention_heads=heads, num_key_value_heads=heads)
    shape |= dict(max_position_embeddings=cfg.seq_len, tie_word_embeddings=True)
    tokens = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    config = LlamaConfig(vocab_size=len(tokenizer), rope_theta=1e4, **tokens, **shape)
    return LlamaForCausalLM(config)


def lr_at(step, total, peak):
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, stream, steps, lr, cfg, log, name, teacher=None, distill_weight=0.0):
    """AdamW on next-token loss; with a teacher, mix in KL(teacher || model) on soft targets."""
    gen = torch.Generator().manual_seed(cfg.seed + zlib.crc32(name.encode()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    start = time.time()
    for step, batch in zip(range(steps), batches(stream, cfg.batch_size, cfg.seq_len, gen)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        inputs, labels = batch[:, :-1], batch[:, 1:]  # (batch, seq_len) each
        logits = model(inputs).logits  # (batch, seq_len, vocab)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                teacher_logp = F.log_softmax(teacher(inputs).logits, -1)
            logp = F.log_softmax(logits, -1)  # (batch, seq_len, vocab)
            kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="batchmean") / cfg.seq_len
            loss = distill_weight * kl + (1 - distill_weight) * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"{name} step {step:5d}/{steps}  loss {loss.item():.4f}  ce {ce.item():.4f}  "
                f"lr {lr_at(step, steps, lr):.2e}  {time.time() - start:7.1f}s")  # fmt: skip
    log(f"{name} trained in {time.time() - start:.0f}s")
    model.eval()
    return model


@torch.no_grad()
def evaluate(target, drafts, stream, cfg):
    """Held-out loss of each model, and each draft's top-1 / top-8 agreement with the target."""
    gen = torch.Generator().manual_seed(cfg.seed + 12345)
    sums, agree1, agree8, n = dict.fromkeys(["target", *drafts], 0.0), {}, {}, 0
    for _, batch in zip(range(cfg.eval_batches), batches(stream, cfg.batch_size, cfg.seq_len, gen)):
        inputs, labels = batch[:, :-1], batch[:, 1:]
        t_logits = target(inputs).logits  # (batch, seq_len, vocab)
        sums["target"] += F.cross_entropy(t_logits.flatten(0, 1), labels.flatten()).item()
        t_top1 = t_logits.argmax(-1)  # (batch, seq_len)
        for name, draft in drafts.items():
            d_logits = draft(inputs).logits
            sums[name] += F.cross_entropy(d_logits.flatten(0, 1), labels.flatten()).item()
            top8 = d_logits.topk(8, -1).indices  # (batch, seq_len, 8)
            agree1[name] = agree1.get(name, 0) + (top8[..., 0] == t_top1).sum().item()
            agree8[name] = agree8.get(name, 0) + (top8 == t_top1[..., None]).any(-1).sum().item()
        n += labels.numel()
    report = {"held_out_loss": {k: v / cfg.eval_batches for k, v in sums.items()}}
    report["top1_agreement"] = {k: v / n for k, v in agree1.items()}
    report["top8_agreement"] = {k: v / n for k, v in agree8.items()}
    return report


def save(model, tokenizer, folder):
    """Write a model in float16 beside its tokenizer. The model in memory goes back to float32
    holding the stored values: the report measures, and the draft learns from, what was written."""
    model.to(torch.float16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.to(torch.float32)


# ---- held-out prompts ----


def make_prompts(root, held_out, n_prompts=24, chars=600):
    """Code prefixes from held-out files, each ending with a `def ...:` line and no newline: the
    BPE merges a line break with the next line's indentation, so a prompt ending in a bare newline
    would hand the model a token boundary it never saw."""
    rng = random.Random(0)
    prompts = []
    for path in held_out:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
        defs = [i for i in defs if sum(len(x) for x in lines[: i + 1]) >= chars]
        if not defs:
            continue
        i = rng.choice(defs)
        text = "".join(lines[: i + 1])[-chars:]
        text = text[text.index("\n") + 1 :].rstrip("\n")  # whole lines only
        prompts.append({"file": str(path.relative_to(root)), "prompt": text})
    rng.shuffle(prompts)
    return prompts[:n_prompts]


# ---- main ----


def main(argv=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = read_config(TrainConfig, __doc__, argv)
    # a model written by `save`, in float32 to train further (--target-from, --draft-from)
    load_trained = partial(AutoModelForCausalLM.from_pretrained, dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train_log.txt", "a", buffering=1)  # line by line, after earlier runs

    def log(msg):
        print(msg, flush=True)
        print(msg, file=log_file)

    log(f"config: {cfg}\npython {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads")  # fmt: skip
    root, train_paths, held_paths = stdlib_files()
    log(f"stdlib at {root}: {len(train_paths)} training files, {len(held_paths)} held out")
    t0 = time.time()
    if cfg.target_from:  # the trained target and its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(cfg.target_from)
        target, what = load_trained(cfg.target_from).eval(), f"loaded from {cfg.target_from}"
    else:
        tokenizer = train_tokenizer(read_texts(train_paths), cfg.vocab_size)
        target = make_model(*TARGET_SHAPE, tokenizer, cfg)
        what = f"{sum(p.numel() for p in target.parameters()) / 1e6:.2f}M parameters"
    train_stream = token_stream(tokenizer, read_texts(train_paths))
    held_stream = token_stream(tokenizer, read_texts(held_paths))
    log(f"tokenizer: {len(tokenizer)} tokens; {len(train_stream)} training tokens, "
        f"{len(held_stream)} held out ({time.time() - t0:.0f}s)\ntarget: {what}")  # fmt: skip
    if cfg.target_steps:
        train(target, train_stream, cfg.target_steps, cfg.target_lr, cfg, log, "target")
        save(target, tokenizer, out / "target")  # now: a draft can be retried with --target-from
        log(f"wrote {out}/target")
    target.requires_grad_(False)

    torch.manual_seed(cfg.seed + 1)
    if cfg.draft_from:
        draft, what = load_trained(cfg.draft_from), f", loaded from {cfg.draft_from}"
    else:
        draft, what = make_model(cfg.draft_hidden, cfg.draft_layers, tokenizer, cfg), ""
    log(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters{what}")
    steps, lr, weight = cfg.draft_steps, cfg.draft_lr, cfg.distill_weight
    train(draft, train_stream, steps, lr, cfg, log, "draft", teacher=target, distill_weight=weight)
    drafts = {"draft": draft}
    if cfg.draft_baseline:
        torch.manual_seed(cfg.seed + 1)
        baseline = make_model(cfg.draft_hidden, cfg.draft_layers, tokenizer, cfg)
        train(baseline, train_stream, steps, lr, cfg, log, "draft-data-only")
        drafts["draft-data-only"] = baseline

    save(draft, tokenizer, out / "draft")  # first, so the report measures the stored weights
    report = evaluate(target, drafts, held_stream, cfg)
    log("held-out report: " + json.dumps(report, indent=2))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    prompts = make_prompts(root, held_paths)
    (out / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    log(f"wrote {out}/draft, {out}/prompts.json ({len(prompts)} prompts)")


if __name__ == "__main__":
    main()
