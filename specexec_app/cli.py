"""The command line: `python specexec.py` (or `specexec` once installed), top-down as it runs:
flags -> specexec.Options, every flag checked before torch loads (--help and a bad flag answer at
once) -> both folders opened and checked, the prompt tokenized, the pair and prompt checked
(specexec_tools/models.py), before any weight is read -> load -> specexec's loop, streaming ->
the summary. Every bad input is one line `error: ...` on stderr, exit status 2, no traceback,
nothing written (an output that cannot be written too); Ctrl-C exits with 130, a closed pipe
(`| head`) quietly.
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import sys
from collections import Counter
from dataclasses import fields
from pathlib import Path

import specexec
from specexec_tools import OffloadError, SpecExecError, expanded, local_folder, one_line

CLONE = Path(__file__).resolve().parent.parent  # a clone: models/ holds the project's own pair
RESET = "\033[0m"
KINDS = ("int8", "int4")  # specexec_tools/quantize.py's
# A hub id: a name, or an owner and a name. --draft none, int8 or int4 misspelt (int3, INT4,
# None, 4bit) is no hub id's name: refused at once, not looked for on the hub
HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
KIND_LIKE = re.compile(r"(?i)(u?int|fp|nf|q)\d+|\d+-?bits?|none")

# Each generation option's help (its default: specexec.Options)
HELP = dict(
    max_new_tokens="stop after this many new tokens",
    budget='draft tree size: nodes verified per step; "auto": the size and depth with the most '
    "tokens/s, chosen as it runs (specexec_tools/cost_model.py)",
    max_depth="max tree depth = draft passes per step (auto: at most this; twice that where "
    "the target streams its weights, a pass being dear)",
    width="beam width: nodes expanded per draft pass",
    branch="children kept per expanded node",
    lookup="prompt lookup: copy up to N tokens that followed the last tokens where they occurred "
    "before in the text into the tree as candidates of their own, at no draft pass (0 = off); "
    "with --draft none, SpecExec without a draft model (--lookup 0 too: plain decoding)",
    temperature="0 = greedy (exact argmax)",
    top_p="nucleus sampling mass (1 = off)",
    top_k="sample from the k most likely (0 = off)",
    seed="random seed for sampling (default: a fresh one)",
    threads="CPU threads of the target's passes (default: one per core that other programs leave "
    "free, unless OMP_NUM_THREADS says; 0: torch's setting)",
    draft_threads="CPU threads for the draft's passes (default: 1 for a small draft, torch's "
    "setting for one of 50M parameters or more; 0: torch's setting); output is unchanged",
    draft_temperature="the draft's temperature when it ranks the tree (default: 0.3 when "
    "greedy, else the sampling temperature); output is unchanged",
)
NOT_THE_REGIME = (
    "(not SpecExec's regime: with the target {where}, a tree's pass costs more than one token's."
    " It pays where weights stream over a slow link: `python -m scripts.bench_disk --grow-to "
    "big-target`, then `python specexec.py --target big-target --offload ssd --compare`)"
)

NO_PROJECT_DRAFT = (
    "(the project's draft has another tokenizer than {target}: {how}. For a draft model: "
    "--draft int4, the target's own 4-bit copy, or --draft FOLDER, a model of its family)"
)


# ---- flags, checked before torch loads ----


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and two lines; keep the one-line promise
        fail(f"{message} (see --help)")

    def print_help(self, file=None):  # argparse would drop a failed write (a full disk) silently;
        # flushed, a full stdout fails here, inside `handled`, not at exit
        print(self.format_help(), end="", file=file or sys.stdout, flush=True)


def finite(text):
    if not math.isfinite(value := float(text)):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def count_or_auto(text):
    try:
        return text if text == "auto" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor auto") from None


def parse_args(argv=None):
    """The flags, every one checked (`check_flags`); the generation options in `args.opts`."""
    # fmt: off
    parser = Parser(description="SpecExec speculative decoding. With no arguments, runs the "
                    "project's own target/draft pair on a held-out code prompt.")
    add = parser.add_argument_group("model and prompt").add_argument
    add("--target", metavar="PATH_OR_ID", help="a model folder or hub id (default: models/target)")
    add("--draft", metavar="PATH_OR_ID", help="a model folder or hub id (default: models/draft); "
        "int8 / int4: the target's own copy, dequantized and whole on the device (no memory "
        "saved; it pays beside an --offload target); none: no draft model (see --lookup)")
    add("--prompt", help="prompt text (default: a held-out prompt of the pair)")
    add("--prompt-index", type=int, default=16, metavar="N", help="which of models/prompts.json")
    add("--chat-template", choices=("auto", "on", "off"), default="auto",
        help="wrap the prompt in the tokenizer's chat template (auto: when it has one)")
    add = parser.add_argument_group("device").add_argument
    add("--device", metavar="NAME", help="cpu, cuda, cuda:1... (default: cuda if available)")
    add("--dtype", choices=("auto", "float32", "float16", "bfloat16", "float64"), default="auto",
        help="auto: float32 on cpu (half precision runs about 6x slower there; with --offload "
        "ssd a half checkpoint is then read from a float32 copy), else the checkpoint's own")
    add("--offload", choices=("ram", "ssd"), help="stream the target's layers from RAM or disk")
    add("--link", type=finite, metavar="GB/S", help="with --offload ram on the CPU: each "
        "streamed layer crosses a simulated link of this speed, beside compute, as layers cross "
        "PCIe to a GPU (the paper's regime on any machine, e.g. 0.01; not real hardware's speed)")
    add("--offload-dir", type=Path, default=Path("~/.cache/specexec/offload"), metavar="DIR",
        help="where ssd writes a per-layer copy when the checkpoint cannot be read in place "
        "(another --dtype than the checkpoint's); default: %(default)s")
    add("--offload-clean", action="store_true", help="delete that copy after the run")
    add("--quantize", choices=KINDS, help="with --offload: store and move the target's "
        "linear weights in 8 or 4 bits, dequantized on the device (ssd writes a quantized copy "
        "into --offload-dir once)")
    add("--device-memory", type=finite, metavar="GB", help="with --offload: device memory the "
        "target may hold; after its embeddings, head, KV cache (the prompt, the new tokens and "
        "the largest tree: 2048 nodes with budget auto) and ring, as many layers as fit stay "
        "resident and are never streamed")
    add = parser.add_argument_group("generation (defaults: specexec.Options)").add_argument
    for f in fields(specexec.Options):  # one source of defaults for the API and the CLI
        real, auto, text = f.type in (float, float | None), f.type == int | str, HELP[f.name]
        add("--" + f.name.replace("_", "-"), default=f.default,
            type=finite if real else count_or_auto if auto else int,
            metavar="X" if real else "N|auto" if auto else "N",
            help=text + ("" if "default" in text else " (default: %(default)s)"))
    add = parser.add_argument_group("output").add_argument
    add("--chat", action="store_true", help="a conversation: one turn per line of input (a "
        "prompt on a terminal); Ctrl-C stops an answer, /new starts over, EOF or /exit ends it; "
        "the caches are kept from turn to turn")
    add("--compare", action="store_true", help="also time plain decoding (both warmed up first)")
    add("--serve", action="store_true", help="answer OpenAI's API (/v1/chat/completions, "
        "/v1/completions, /v1/models) over HTTP, the caches kept as --chat keeps them")
    add("--host", default="127.0.0.1", help="--serve's address (default: %(default)s)")
    add("--port", type=int, default=8000, help="--serve's port (default: %(default)s; 0: any free)")
    add("--api-key", default=os.environ.get("SPECEXEC_API_KEY"), metavar="KEY", help="the key "
        "--serve asks of each request, needed off this machine (default: $SPECEXEC_API_KEY)")
    add("--verbose", action="store_true", help="show transformers' loading logs")
    # fmt: on
    args = parser.parse_args(argv)
    options = {f.name: getattr(args, f.name) for f in fields(specexec.Options)}
    args.opts = specexec.Options(**options)  # checked as it is made
    check_flags(args)
    return args


def check_flags(args):
    """Flags that only make sense together, values torch or the file system would fail on late,
    and output that cannot take a model's text; then the models and the prompt named."""
    folder = args.offload_dir
    # fmt: off
    for wrong, message in [
        (args.offload_clean and args.offload != "ssd",
         "--offload-clean goes with --offload ssd (only ssd writes a copy)"),
        (args.quantize and not args.offload,
         "--quantize goes with --offload (it quantizes the streamed layers)"),
        (args.link is not None and args.offload != "ram",
         "--link goes with --offload ram (it simulates the link a streamed layer crosses)"),
        (args.link is not None and args.link <= 0, f"--link {args.link}: a speed in GB/s, above 0"),
        (args.device_memory is not None and not args.offload,
         "--device-memory goes with --offload (it keeps streamed layers)"),
        ((args.device_memory or 0) < 0, f"--device-memory {args.device_memory}: a size in GB, "
         "at least 0"),
        (str(folder) in ("", "."), "--offload-dir is empty: name a folder for the copy"),
        (expanded(folder).is_file(), f"--offload-dir {folder} is a file, not a folder"),
        (args.chat and args.compare, "--chat and --compare: compare a one-prompt run instead"),
        (args.serve and (args.chat or args.compare or args.prompt is not None),
         "--serve takes its prompts from requests: not with --chat, --compare or --prompt"),
        (not 0 <= args.port <= 65535, f"--port {args.port}: a port is 0 to 65535"),
        (args.serve and not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"),
         f"--host {args.host} lets other machines in: give --api-key (or SPECEXEC_API_KEY)"),
        (args.chat and sys.stdin is None, "--chat reads turns from standard input: it is closed"),
        (args.compare and args.opts.max_new_tokens == 0,
         "--compare times decoding: give it --max-new-tokens of at least 1"),
    ]:  # fmt: on
        if wrong:
            raise SpecExecError(message)
    try:  # any character a model may write (ascii:replace, say, takes them all)
        "\u00e9\u2014\U0001f600".encode(sys.stdout.encoding, sys.stdout.errors or "strict")
    except (UnicodeEncodeError, LookupError, TypeError):
        raise SpecExecError(
            f"standard output's encoding {sys.stdout.encoding} cannot write all of a model's "
            "text: set PYTHONIOENCODING=utf-8"
        ) from None
    args.self_draft = args.draft in KINDS  # the target's own copy: its tokenizer too
    args.project_draft = args.draft is None  # models/draft: it may not fit --target's tokenizer
    args.target = model_name(args.target, "--target")
    if args.draft != "none" and not args.self_draft:
        args.draft = model_name(args.draft, "--draft")
    if args.prompt is None and not (args.chat or args.serve):
        args.prompt = default_prompt(args.prompt_index)


def model_name(name, flag):
    """--target or --draft: a folder or hub id, checked before torch loads (a path that holds no
    model, a misspelt kind of --draft); None: the project's own (models/target or models/draft);
    '' is no name, not the default."""
    if name is None:
        if not (CLONE / "models" / "target").is_dir():
            raise SpecExecError(
                f"the default pair lives in a clone's models/, not beside {CLONE}: pass --target "
                "and --draft (a hub id or a folder), or install the clone with `pip install -e .`"
            )
        return str(CLONE / "models" / flag.removeprefix("--"))
    if not name.strip():
        raise SpecExecError(f"{flag} is empty: pass a model folder or a hub id")
    misspelt = flag == "--draft" and KIND_LIKE.fullmatch(name)
    if local_folder(name) is None and (misspelt or not HUB_ID.fullmatch(name)):
        kinds = ", a hub id, none, int8 nor int4" if flag == "--draft" else " nor a hub id"
        raise SpecExecError(f"{flag} {name}: neither a model folder{kinds}")
    return name


def default_prompt(index):
    path = CLONE / "models" / "prompts.json"
    if not path.is_file():  # installed with `pip install .`: models/ stays in the clone
        raise SpecExecError(f"no default prompts at {path}: pass --prompt (or run from a clone)")
    try:
        prompts = json.loads(path.read_text())
        count = len(prompts)
        prompt = prompts[index]["prompt"] if 0 <= index < count else None
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise SpecExecError(f"{path} is damaged ({one_line(error)}); pass --prompt") from None
    if prompt is None:
        raise SpecExecError(f"--prompt-index {index}: models/prompts.json has 0..{count - 1}")
    if not isinstance(prompt, str):
        raise SpecExecError(f"{path} is damaged (prompt {index} is no text); pass --prompt")
    return prompt


def read_flags():
    """`python specexec.py`'s first step, before torch loads: the flags, checked; Ctrl-C while
    torch loads (seconds) then exits as it does later (130, quietly)."""
    args = handled(parse_args)
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    return args


# ---- one run ----


def run(args):
    import torch
    from transformers.utils import logging as transformers_logging

    import offload
    from specexec_app import chat, serve
    from specexec_tools import cost_model, models

    opts, device = args.opts, pick_device(args.device)
    if args.link is not None and device.type != "cpu":
        raise SpecExecError(f"--link simulates a link on the CPU, not {device}: add --device cpu")
    if not args.verbose:  # no per-tensor progress bars and load reports
        transformers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()

    # Everything is checked before any weight is read.
    target = models.open_model(args.target)
    draft = target if args.self_draft else None  # None: --draft none (lookup alone, or plain)
    if draft is None and args.draft != "none":
        draft = models.open_model(args.draft)
    tokenizer = chat.load_tokenizer(target.folder, args.chat_template)
    own = draft is None or args.self_draft  # ids must mean the same text in both
    tokenizers = [tokenizer, tokenizer if own else chat.load_tokenizer(draft.folder)]
    if args.project_draft and tokenizers[1].get_vocab() != tokenizer.get_vocab():
        draft, tokenizers[1] = None, tokenizer  # a target of another family: no draft
        how = "prompt lookup alone drafts" if opts.lookup else "it decodes plainly (--lookup 0)"
        print(dim(NO_PROJECT_DRAFT.format(target=args.target, how=how)), flush=True)
    input_ids = None  # a chat without --prompt: its turns come later
    if args.prompt is not None:
        input_ids = chat.tokenize(tokenizer, args.prompt, args.chat_template, target.folder)
    seq, limit, eos = models.preflight(target, draft, input_ids, None, tokenizers)

    dtype = torch.float32 if args.dtype == "auto" and device.type == "cpu" else None
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else dtype  # None: the checkpoint's
    if args.offload_clean:  # a copy it could not remove: refused now, not after the run
        check_removable(target.checkpoint, dtype, args.quantize, args.offload_dir)
    largest = cost_model.CostModel.BUDGETS[-1] if opts.budget == "auto" else opts.budget
    # the KV cache's length; a conversation's (--chat, --serve) is not known
    context = None if args.chat or args.serve else len(seq) + opts.max_new_tokens + largest + 1
    loaded = [None, None]  # (target, draft) once loaded; the draft stays None with --draft none
    try:
        if args.offload:
            memory = None if args.device_memory is None else args.device_memory * 1e9
            loaded[0] = offload.from_pretrained(
                target, mode=args.offload, device=offload.Cpu(args.link) if args.link else device,
                dtype=dtype, quantize=args.quantize,
                offload_dir=args.offload_dir, device_memory=memory, context=context,
            )  # fmt: skip
        else:
            loaded[0] = models.load(target, device, dtype)
        if args.self_draft:
            loaded[1] = offload.self_draft(target, args.draft, device=device, dtype=dtype)
        elif draft is not None:
            loaded[1] = models.load(draft, device, dtype)
        if args.chat:
            chat.talk(chat.Chat(*loaded, opts), tokenizer, target.folder, args, list(eos),
                      Streamer, dim, summary)  # fmt: skip
        elif args.serve:
            serve.serve(chat.Chat(*loaded, opts), tokenizer, args, eos)
        else:
            report(*loaded, tokenizer, seq, limit, eos, args, device)
    finally:
        for model in loaded:  # an offloaded one gives back its files, thread and pinned memory
            getattr(model, "close", lambda: None)()
        # where the ssd tier's converted copy is, or that --offload-clean removed it
        if said := args.offload and loaded[0] and converted_copy(loaded[0], args.offload_clean):
            print(f"offload: {said}", file=sys.stderr)


def report(target, draft, tokenizer, seq, limit, eos, args, device):
    """Generate, streaming, through the loop the API's `generate` runs once it has checked what
    it is given (checked above); then the summary, and with --compare plain decoding beside it."""
    import torch
    from tqdm import tqdm

    from specexec_tools.cost_model import FixedBudget, make_policy

    opts = args.opts
    if opts.seed is None:  # one seed for both runs, so --compare can match them
        opts.seed = torch.seed()
    if args.compare:  # both warmed up before either is timed: neither pays the first passes
        warm = specexec.Options(**{**vars(opts), "max_new_tokens": 2})
        specexec.generate(target, draft, seq, eos_token_id=eos, opts=warm)
        specexec.autoregressive(target, seq, eos_token_id=eos, opts=warm)
    # On a terminal the prompt is dim; in a file or pipe a line marks where the output starts.
    end = "" if sys.stdout.isatty() else "\n--- continuation ---\n"
    print(dim(tokenizer.decode(seq)), end=end, flush=True)
    run, policy = specexec.Run(target, draft, opts, limit), make_policy(opts, target, draft)
    tokens, stats = specexec.decode_loop(run, list(seq), policy, eos, Streamer(tokenizer))
    print("\n\n" + dim(f"specexec: {summary(stats)}"))
    explained = why_plain(stats, args.offload)  # or auto's own why, in the summary line
    if explained:
        print(dim(explained))
    if args.offload:
        layers = target.config.num_hidden_layers
        print(dim(f"offload ({args.offload}): {target.stats.summary(layers)}"))
        passes = [f"{count(n, 'token')} {s:.2f}s" for n, (s, _) in target.pass_costs.items()]
        if passes:  # budget auto's: what its first tree was sized for
            print(dim(f"budget auto timed two passes before its first tree: {', '.join(passes)}"))
    if not args.compare:
        return
    # plain decoding can take minutes: on a terminal, a line says how far it is (nothing in a pipe)
    quiet = sys.stderr is None or not sys.stderr.isatty()
    with tqdm(desc="plain decoding", total=opts.max_new_tokens, unit="token", disable=quiet,
              leave=False) as bar:  # fmt: skip
        run, counted = specexec.Run(target, None, opts, limit), lambda new: bar.update(len(new))
        base_tokens, base = specexec.decode_loop(run, list(seq), FixedBudget(0, 0), eos, counted)
    print(dim(f"plain decoding: {summary(base)}"))
    if base.new_tokens and stats.new_tokens:
        speedup = stats.tokens_per_second / base.tokens_per_second
        print(
            f"speedup {speedup:.2f}x: SpecExec against plain decoding of the same target, both "
            f"warmed up ({stats.tokens_per_step:.2f} tokens per target pass)"
        )
        told = explained or getattr(stats.policy, "why", "")  # one cause, said once
        if speedup < 1 and device.type == "cpu" and args.offload != "ssd" and not told:
            where = "in memory" if not args.offload else "in RAM (on a CPU, a memory copy)"
            print(dim(NOT_THE_REGIME.format(where=where)))
    print("identical output" if base_tokens == tokens else "outputs differ")


def why_plain(stats, offload=None):
    """Where budget auto decoded mostly plainly, the cause it acted on, from what it measured: its
    best tree costs more than its tokens are worth, through the draft's passes (a dear draft) or
    the target's pass over the tree (compute, which a tree multiplies); or its trees measured
    slower only until late in the run. A short run's cause is auto's own `why`."""
    policy, plain = stats.policy, sum(1 for budget, _ in stats.budgets if not budget)
    if not getattr(policy, "gains", None) or 2 * plain < stats.steps:
        return None
    # A tree's gains were seen, so (1, 1) is among the trees rated: every tree has a node at depth 1
    rates = policy.rates()
    best = max((choice for choice in rates if choice[0]), key=rates.get)
    (budget, depth), (tokens, passes) = best, policy.gains[best]
    tree, plainly = apart(rates[best], rates[(0, 0)])
    said = (
        f"(auto decoded plainly in {plain} of {stats.steps} steps; its best tree, "
        f"{count(budget, 'node')} {depth} deep, gives {tokens:.2f} tokens a target pass, {tree} "
        f"tokens/s against {plainly} plainly"
    )
    if rates[best] > rates[(0, 0)]:  # trees paid by the end: no cause against them
        return f"{said}: until late in the run, its trees measured slower)"
    one, draft_s, tree_s = policy.t_target(1), passes * policy.draft_s, policy.t_target(budget + 1)
    if draft_s > tree_s - one:  # the draft's passes cost more than the tree adds to the pass
        draft, target = apart(draft_s, one)
        return (
            f"{said}. The cause: its draft, whose passes cost {draft} s a tree beside {target} s "
            "for the target's pass (a smaller draft, or --draft none, may pay))"
        )
    over_tree, over_one = apart(tree_s, one)
    where = "" if offload == "ssd" else " (see the README's streamed run, --offload ssd)"
    return (
        f"{said}. The cause: the target's pass, {over_tree} s over the tree against {over_one} s "
        f"over one token: a pass here computes, which a tree multiplies. Trees pay where a pass "
        f"moves the weights{where})"
    )


def pick_device(name):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise SpecExecError(f"--device {name}: {one_line(error)}") from None
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu
        if not (hasattr(backend, "is_available") and backend.is_available()):
            raise SpecExecError(f"--device {name}: no {device.type} device here; use --device cpu")
        if (device.index or 0) >= backend.device_count():
            raise SpecExecError(f"--device {name}: only {backend.device_count()} here")
    return device


def check_removable(ckpt, dtype, kind, offload_dir):
    """--offload-clean, checked before the run rather than after it: the copy this run writes or
    reuses in `offload_dir` (--offload-dir, never None) can be removed again (its folder, and the
    one holding it, are writable; a read-only offload_dir can hold a finished copy, reused
    without a write). dtype None: the checkpoint's own."""
    from specexec_tools.checkpoint import copy_folder

    folder = copy_folder(ckpt, dtype or ckpt.dtype, kind, offload_dir)
    if folder is None:
        return  # the checkpoint's own files are read: no copy to remove
    for where in (folder, folder.parent):
        if where.exists() and not os.access(where, os.W_OK | os.X_OK):
            raise OffloadError(
                f"--offload-clean: the converted copy {folder} could not be removed after the "
                f"run ({where} is read-only); drop --offload-clean or pass another --offload-dir"
            )


def converted_copy(model, remove):
    """What became of the ssd tier's converted copy of the checkpoint, in a line for the user
    (None: the checkpoint was read in place); with remove, the copy is deleted."""
    folder = model.converted_folder
    if folder is None or not folder.exists():
        return None
    if not remove:
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
        stays = f"a converted copy ({size:.2f} GB) stays in {folder} for the next run"
        return stays + "; --offload-clean removes it"
    try:
        shutil.rmtree(folder)
    except OSError as error:
        why = f"{error.strerror or error}: {error.filename}"
        raise OffloadError(f"cannot remove the converted copy {folder} ({why})") from None
    return f"removed the converted copy {folder}"


# ---- output ----


def summary(stats):
    """One line of what a run did (a specexec.Stats): what was made, per target pass and per
    second, where the time went, the trees it verified, and what reproduces it."""
    import torch  # loaded by the run

    line = (
        f"{count(stats.new_tokens, 'token')} in {count(stats.steps, 'target pass')} "
        f"({stats.tokens_per_step:.2f} per pass), {stats.tokens_per_second:.3g} tokens/s; "
        f"draft {stats.time_draft:.2f}s, target {stats.time_target:.2f}s, "
        f"other {stats.time_total - stats.time_draft - stats.time_target:.2f}s"
    )
    trees = [budget for budget, _ in stats.budgets if budget]
    if trees:  # SpecExec, not the baseline
        budget, n = Counter(trees).most_common(1)[0]
        deepest = max(d for (b, _), d in zip(stats.budgets, stats.tree_depths) if b == budget)
        some = f" in {n} of {len(stats.budgets)} steps" if len(set(trees)) > 1 else ""
        line += f"; budget {budget}{some}, trees up to {deepest} deep"
        if len(trees) < len(stats.budgets):
            line += f"; plain decoding (no tree) in {count(stats.steps - len(trees), 'step')}"
        line += f"; {stats.draft_passes / stats.steps:.1f} draft passes per target pass"
    line += f"; {stats.policy.why}" if getattr(stats.policy, "why", "") else ""
    line += f"; threads {torch.get_num_threads()}"  # the target's passes'
    line += f"; seed {stats.seed}" if stats.seed is not None else ""
    reused = getattr(stats, "reused", 0)  # a chat's turn
    line += f"; {count(reused, 'token')} reused from the caches" if reused else ""
    return line + ("; stopped at the end of the context" if stats.context_full else "")


def count(n, one):
    """'1 token', '2 tokens', '3 target passes'."""
    return f"{n} {one if n == 1 else one + ('es' if one.endswith('s') else 's')}"


def apart(*values):
    """The values to 3 significant digits, or as many more as tell different ones apart."""
    digits = 3
    while len({f"{v:.{digits}g}" for v in values}) < len(set(values)) and digits < 17:
        digits += 1
    return [f"{v:.{digits}g}" for v in values]


def dim(text):
    """Text a terminal shows dim (a run's figures, beside the model's words); as it is in a pipe."""
    return f"\033[2m{text}{RESET}" if sys.stdout.isatty() else text


class Streamer:
    """Prints text as tokens arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def __call__(self, tokens):
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # else wait for the character's next bytes
            print(text[self.printed :], end="", flush=True)
            self.printed = len(text)


# ---- entry point ----


def main(args=None):
    """The command line: `args` parsed already (`python specexec.py` read them before torch
    loaded), or a list of strings, or None for sys.argv (the `specexec` command)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # read_flags' quick exit, undone
    handled(lambda: run(args if isinstance(args, argparse.Namespace) else parse_args(args)))


def handled(work):
    """`work()` under the command line's promise: a bad input is one `error:` line, exit 2."""
    try:
        if sys.stdout is None:  # started with `>&-`
            raise SpecExecError("standard output is closed: send it to a file or /dev/null")
        result = work()
        sys.stdout.flush()  # a full disk or closed pipe fails here, inside the handlers
        return result
    except (SpecExecError, OffloadError) as error:
        fail(str(error))
    except KeyboardInterrupt:  # Ctrl-C: leave the terminal as we found it
        if sys.stdout is not None and sys.stdout.isatty():
            print(RESET)
        sys.exit(130)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly
        drop_stdout()
        sys.exit(1)
    except OSError as error:  # mostly stdout that cannot be written (/dev/full, ulimit -f); the
        drop_stdout()  # inputs' file errors are SpecExecErrors, caught where they are read
        fail(f"{error.filename or 'cannot write the output'} ({error.strerror or error})")


def fail(message):
    try:
        print(f"error: {message}", file=sys.stderr, flush=True)
    except (OSError, AttributeError):  # stderr full or closed: the status still says bad input
        os._exit(2)
    sys.exit(2)


def drop_stdout():
    """Send what stdout still holds to /dev/null, so that exiting does not fail on it again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
