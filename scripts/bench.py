"""Benchmark SpecExec in memory against its peers, in one process, on held-out prompts.

    python -m scripts.bench                                  # greedy and sampled; table, plot
    python -m scripts.bench --prompts 2 --tokens 32 --budgets 16,auto   # a quick look
    python -m scripts.bench --threads 1,2 --budgets 4,16,64,auto --temperature 0   # auto's check
    python -m scripts.bench --drafts --prompts 4 --tokens 64 --budgets 16,64,256,1024
                                             # distilled draft vs the target's int8/int4 copies

Rows, each on every prompt before the next prompt, after one warm-up each: plain decoding; Hugging
Face assisted generation with the same pair; a chain as deep, verified by this project's code;
SpecExec at each budget (--drafts: instead of the peers, with the distilled draft and with the
target's own int8 and int4 copies). Rows are checked token for token against plain decoding with
the same seed (HF's sampled rows draw their own); a table per setting (greedy, sampled, each of
--threads). docs/results.md reads them.
"""

from dataclasses import dataclass

import torch

import offload
import specexec
from scripts import common
from scripts.common import option
from specexec_tools import models


@dataclass
class BenchConfig:
    """The run's defaults, written once; the command line reads them (`--help`)."""

    target: str = option(common.TARGET, "target model folder")
    draft: str = option(common.DRAFT, "draft model folder")
    prompts: int = option(6, "held-out prompts per row")
    tokens: int = option(96, "new tokens per prompt")
    budgets: str = option("1,16,64,256,1024,auto", "SpecExec budgets, comma-separated")
    max_depth: int = option(specexec.Options.max_depth, "tree depth; also the chains' length")
    temperature: float = option(0.6, "the sampled rows' (0: greedy rows only)")
    top_p: float = option(0.9, "the sampled rows'")
    seed: int = option(0, "prompt i is sampled with seed + i, by every sampled row")
    threads: str = option("", "torch threads, comma-separated: the table for each ('': as set)")
    draft_threads: int = option(specexec.Options.draft_threads, "threads of the draft's passes")
    dtype: str = option("float32", "the pair's dtype (on cuda if there is one, else cpu)")
    offload: str | None = option(None, 'stream the target\'s layers from "ram" or "ssd"')
    plot: str = option(str(common.HERE / "figures" / "bench.png"), "where the PNG goes")
    drafts: bool = option(False, "instead: the distilled draft vs the target's int8/int4 copies")
    lookup: int = option(
        0,
        "N > 0: instead of the peers, SpecExec with lookup (up to N tokens "
        "copied) beside the draft, and lookup alone (no draft), at each budget",
    )
    prompt_kind: str = option(
        "code", "code (held out) or grounded (their continuation in the input)"
    )


def rows_at(cfg, setting, target, hf_target, drafts, prompt_ids, eos, sampled):
    """Every method at one setting: plain decoding first, then the peers and SpecExec."""
    ours = dict(max_new_tokens=cfg.tokens, eos_token_id=eos, draft_threads=cfg.draft_threads)
    ours |= dict(threads=0)  # torch's threads as --threads set them, for ours as for HF's
    ours |= dict(temperature=cfg.temperature, top_p=cfg.top_p) if sampled else {}

    def plain(i, ids):
        options = {k: v for k, v in ours.items() if k != "draft_threads"}
        return specexec.autoregressive(target, ids, seed=cfg.seed + i, **options)

    def speculative(draft, budget, **shape):
        def run(i, ids):
            options = dict(budget=budget, max_depth=cfg.max_depth, seed=cfg.seed + i, lookup=0)
            options |= shape  # "SpecExec" rows: the draft alone; --lookup adds lookup's rows
            draft_or_none = None if options.pop("alone", False) else draft
            return specexec.generate(target, draft_or_none, ids, **ours, **options)

        return run

    def assisted(i, ids):
        torch.manual_seed(cfg.seed + i)  # HF samples from torch's global generator
        sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=None)
        # HF's assisted generation as it ships, with chains as long as ours
        out = hf_target.generate(
            torch.tensor([ids], device=target.device), assistant_model=drafts["distilled"],
            num_assistant_tokens=cfg.max_depth, num_assistant_tokens_schedule="constant",
            max_new_tokens=cfg.tokens, eos_token_id=eos, pad_token_id=eos, do_sample=sampled,
            **(sampling if sampled else {}),
        )  # fmt: skip
        return out[0, len(ids) :].tolist(), None  # (1, len(ids) + new)

    methods = [(common.Row(setting, "plain decoding"), plain)]
    if not cfg.drafts and not cfg.lookup:
        chain = speculative(drafts["distilled"], cfg.max_depth, width=1, branch=1)
        exact = "n/a: HF's own draws" if sampled else ""
        methods += [(common.Row(setting, "HF assisted generation", exact=exact), assisted)]
        methods += [(common.Row(setting, f"chain of {cfg.max_depth}, ours"), chain)]
    for name, draft in drafts.items():
        method = f"SpecExec, {name} draft" if cfg.drafts else "SpecExec"
        for budget in common.budgets(cfg.budgets):
            methods.append((common.Row(setting, method, budget), speculative(draft, budget)))
        for how, shape in [("SpecExec + lookup", {}), ("lookup alone", dict(alone=True))]:
            for budget in common.budgets(cfg.budgets) if cfg.lookup else ():
                decode = speculative(draft, budget, lookup=cfg.lookup, **shape)
                methods.append((common.Row(setting, how, budget), decode))
    for _, decode in methods:  # warm-up: lazy initialisation, the allocator, caches
        decode(0, prompt_ids[0][:16])
    meters = [target.meter] + [draft.meter for draft in drafts.values()]
    return common.measure_interleaved(methods, prompt_ids, meters, setting)


def main(argv=None):
    from transformers.utils import logging

    cfg = common.read_config(BenchConfig, __doc__, argv)
    logging.set_verbosity_error()  # HF's notes on generation arguments, once per call
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loading = dict(device=device, dtype=getattr(torch, cfg.dtype))
    if cfg.offload:  # the ssd tier reads a per-layer copy in `dtype`, kept as the CLI keeps it
        streamed = dict(mode=cfg.offload, offload_dir=common.COPIES)
        target = offload.from_pretrained(cfg.target, **streamed, **loading)
    else:
        target = models.load(cfg.target, **loading)
    drafts = {"distilled": models.load(cfg.draft, **loading)}
    for kind in ("int8", "int4") if cfg.drafts else ():
        drafts[f"target's {kind} copy"] = offload.self_draft(cfg.target, kind, **loading)
    for model in (target, *drafts.values()):
        model.meter = common.Meter(model)
    # HF's generate lives on the Hugging Face model; an offloaded target wraps one, whose
    # forward must then be the offloaded (and metered) one.
    hf_target = getattr(target, "hf", target)
    hf_target.forward = target.forward
    prompt_ids, eos = common.held_out_prompts(cfg.target, cfg.prompts, cfg.prompt_kind)
    where = f"offloaded: {cfg.offload}" if cfg.offload else "in memory"
    print(f"machine: {common.machine()}")
    print(f"target {cfg.target} ({where}), draft {cfg.draft}, {cfg.dtype} on {device}; "
          f"{len(prompt_ids)} held-out prompts x {cfg.tokens} new tokens; sampled: temperature "
          f"{cfg.temperature}, top-p {cfg.top_p}, prompt i seeded {cfg.seed} + i\n")  # fmt: skip
    rows = []
    for threads in [int(n) for n in cfg.threads.split(",") if n] or [None]:
        if threads:
            torch.set_num_threads(threads)
        on = f", {threads} thread" + "s" * (threads > 1) if threads else ""
        for sampled in (False, True)[: 1 + (cfg.temperature > 0)]:
            setting = ("sampled" if sampled else "greedy") + on
            args = target, hf_target, drafts, prompt_ids, eos, sampled
            rows += rows_at(cfg, setting, *args)
    common.print_table(rows)
    title = f"SpecExec against plain decoding and its peers: the default pair ({where}),\n"
    title += f"{len(prompt_ids)} prompts x {cfg.tokens} tokens; lines: the rows without a budget"
    common.plot_budgets(rows, cfg.plot, title, values=("tokens_per_pass", "rate"))
    for draft in list(drafts.values())[1:]:  # the target's int8/int4 copies
        draft.close()


if __name__ == "__main__":
    main()
