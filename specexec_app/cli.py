"""The command line: `python specexec.py` (or `specexec` once installed), top-down as it runs:
flags -> specexec.Options, every flag checked before torch loads (--help and a bad flag answer at
once) -> both folders opened and checked, the prompt tokenized, the pair and prompt checked
(specexec_tools/models.py), before any weight is read -> load -> specexec.generate, streaming ->
the summary. Every bad input is one line `error: ...` on stderr, exit status 2, no traceback,
nothing written (an output that cannot be written too); Ctrl-C exits with 130, a closed pipe
(`| head`) quietly: `handled` keeps these promises, in one place.
"""

import argparse
import inspect
import json
import math
import os
import re
import shutil
import signal
import sys
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal, get_args, get_origin

import specexec
from specexec_tools import KINDS, OffloadError, SpecExecError, expanded, local_folder, one_line
from specexec_tools.cost_model import CostModel

CLONE = Path(__file__).resolve().parent.parent  # a clone: models/ holds the project's own pair
RESET = "\033[0m"
# A hub id: a name, or an owner and a name. --draft none, int8 or int4 misspelt (int3, INT4,
# None, 4bit) is no hub id's name: refused at once, not looked for on the hub
HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
KIND_LIKE = re.compile(r"(?i)(u?int|fp|nf|q)\d+|\d+-?bits?|none")
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
        raise SpecExecError(f"{message} (see --help)")

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


# How a flag of each type reads its value, and what --help calls that value
READS = {
    bool: dict(action="store_true"),
    int: dict(type=int, metavar="N"),
    float: dict(type=finite, metavar="X"),
    int | str: dict(type=count_or_auto, metavar="N|auto"),  # the budget
}


@dataclass
class Flags:
    """The command line's own flags, beside specexec.Options' (the generation options): a field
    each, of its type, with its default; its comment is its --help (`add_flags`)."""

    target: str | None = None  # a model folder or hub id (default: models/target)
    draft: str | None = None  # a model folder or hub id (default: models/draft); int8 / int4: the
    # target's own copy, dequantized and whole on the device (no memory saved; it pays beside an
    # --offload target); none: no draft model (prompt lookup alone; with --lookup 0, plain decoding)
    prompt: str | None = None  # prompt text (default: a held-out prompt of the pair)
    prompt_index: int = 16  # which of models/prompts.json
    chat_template: Literal["auto", "on", "off"] = "auto"  # wrap the prompt in the tokenizer's chat
    # template (auto: when it has one)
    device: str | None = None  # cpu, cuda, cuda:1... (default: cuda if available)
    dtype: Literal["auto", "float32", "float16", "bfloat16", "float64"] = "auto"  # auto: float32
    # on cpu (half precision runs about 6x slower there; with --offload ssd a half checkpoint is
    # then read from a float32 copy), else the checkpoint's own
    offload: Literal["ram", "ssd"] | None = None  # stream the target's layers from RAM or disk
    # (default: neither, the target whole in memory)
    link: float | None = None  # GB/s; with --offload ram on the CPU: each streamed layer crosses a
    # simulated link of this speed, beside compute, as layers cross PCIe to a GPU (the paper's
    # regime on any machine, e.g. 0.01; not real hardware's speed) (default: none)
    offload_dir: Path = Path("~/.cache/specexec/offload")  # where ssd writes a per-layer copy when
    # the checkpoint cannot be read in place (another --dtype than the checkpoint's)
    offload_clean: bool = False  # delete that copy after the run
    quantize: Literal[KINDS] | None = None  # with --offload: store and move the target's linear
    # weights in 8 or 4 bits, dequantized on the device (ssd writes a quantized copy into
    # --offload-dir once) (default: none)
    device_memory: float | None = None  # GB; with --offload: device memory the target may hold;
    # after its embeddings, head, KV cache (the prompt, the new tokens and the largest tree: the
    # budget, or auto's largest) and ring, as many layers as fit stay resident and are never
    # streamed (default: none, every layer streamed)
    chat: bool = False  # a conversation: one turn per line of input (a prompt on a terminal);
    # Ctrl-C stops an answer, /new starts over, EOF or /exit ends it; the caches are kept from
    # turn to turn
    compare: bool = False  # also time plain decoding (both warmed up first)
    serve: bool = False  # answer OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models)
    # over HTTP, the caches kept as --chat keeps them
    host: str = "127.0.0.1"  # --serve's address
    port: int = 8000  # --serve's port (0: any free)
    api_key: str | None = None  # the key --serve asks of each request, needed off this machine
    # (default: $SPECEXEC_API_KEY)
    verbose: bool = False  # show transformers' loading logs


def helps(config):
    """Each field of the dataclass `config` -> its help: its comment, with the comment lines
    below it (specexec.Options' and Flags' one source)."""
    found = re.findall(r"^    (\w+): .*?  # (.*(?:\n    # .*)*)", inspect.getsource(config), re.M)
    return {name: text.replace("\n    # ", " ") for name, text in found}


def add_flags(group, config):
    """A flag for each field of the dataclass `config`: --its-name, read as its type reads (`X |
    None` as X; READS), with its default and help."""
    texts = helps(config)
    for f in fields(config):
        kind = get_args(f.type)[0] if type(None) in get_args(f.type) else f.type
        text = texts[f.name]
        if "default" not in text and kind is not bool:
            text += " (default: %(default)s)"
        reads = READS.get(kind, dict(type=kind))  # str, Path: read as themselves
        if get_origin(kind) is Literal:
            reads = dict(choices=get_args(kind))
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(flag, default=f.default, help=text, **reads)


def parse_args(argv=None):
    """The flags, every one checked (`check_flags`); the generation options in `args.opts`."""
    parser = Parser(
        description="SpecExec speculative decoding. With no arguments, runs the project's own "
        "target/draft pair on a held-out code prompt."
    )
    add_flags(parser.add_argument_group("model, device and output"), Flags)
    add_flags(parser.add_argument_group("generation (specexec.Options)"), specexec.Options)
    parser.set_defaults(api_key=os.environ.get("SPECEXEC_API_KEY"))  # now, not at import
    args = parser.parse_args(argv)
    options = {f.name: getattr(args, f.name) for f in fields(specexec.Options)}
    args.opts = specexec.Options(**options)  # checked as it is made
    check_flags(args)
    return args


def check_flags(args):
    """Flags that only make sense together, values torch or the file system would fail on late,
    and output that cannot take a model's text; then the models and the prompt named."""
    if args.offload_clean and args.offload != "ssd":
        raise SpecExecError("--offload-clean goes with --offload ssd (only ssd writes a copy)")
    if args.quantize and not args.offload:
        raise SpecExecError("--quantize goes with --offload (it quantizes the streamed layers)")
    if args.link is not None and args.offload != "ram":
        raise SpecExecError(
            "--link goes with --offload ram (it simulates the link a streamed layer crosses)"
        )
    if args.link is not None and args.link <= 0:
        raise SpecExecError(f"--link {args.link}: a speed in GB/s, above 0")
    if args.device_memory is not None and not args.offload:
        raise SpecExecError("--device-memory goes with --offload (it keeps streamed layers)")
    if args.device_memory is not None and args.device_memory < 0:
        raise SpecExecError(f"--device-memory {args.device_memory}: a size in GB, at least 0")
    if str(args.offload_dir) in ("", "."):
        raise SpecExecError("--offload-dir is empty: name a folder for the copy")
    if expanded(args.offload_dir).is_file():
        raise SpecExecError(f"--offload-dir {args.offload_dir} is a file, not a folder")
    if args.chat and args.compare:
        raise SpecExecError("--chat and --compare: compare a one-prompt run instead")
    if args.serve and (args.chat or args.compare or args.prompt is not None):
        raise SpecExecError(
            "--serve takes its prompts from requests: not with --chat, --compare or --prompt"
        )
    if not 0 <= args.port <= 65535:
        raise SpecExecError(f"--port {args.port}: a port is 0 to 65535")
    if args.serve and not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        raise SpecExecError(
            f"--host {args.host} lets other machines in: give --api-key (or SPECEXEC_API_KEY)"
        )
    if args.chat and sys.stdin is None:
        raise SpecExecError("--chat reads turns from standard input: it is closed")
    if args.compare and args.opts.max_new_tokens == 0:
        raise SpecExecError("--compare times decoding: give it --max-new-tokens of at least 1")
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


# ---- one run ----


def run(args):
    import torch
    from transformers.utils import logging as transformers_logging

    import offload
    from specexec_app import chat, serve
    from specexec_tools import models

    opts = args.opts
    try:
        device = models.as_device(args.device)
    except OffloadError as error:
        raise SpecExecError(f"--device {args.device}: {error}") from None
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
    draft_tokenizer = tokenizer  # ids must mean the same text in both
    if draft is not None and not args.self_draft:  # a draft of its own: its tokenizer checked
        draft_tokenizer = chat.load_tokenizer(draft.folder)
    if args.project_draft and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        draft = None  # a target of another family: no draft
        draft_tokenizer = tokenizer
        how = "prompt lookup alone drafts" if opts.lookup else "it decodes plainly (--lookup 0)"
        print(dim(NO_PROJECT_DRAFT.format(target=args.target, how=how)), flush=True)
    input_ids = None  # a chat without --prompt: its turns come later
    if args.prompt is not None:
        input_ids = chat.tokenize(tokenizer, args.prompt, args.chat_template, target.folder)
    seq, _, eos = models.preflight(target, draft, input_ids, None, (tokenizer, draft_tokenizer))

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)  # None: the checkpoint's
    if args.dtype == "auto" and device.type == "cpu":  # half precision is slow there
        dtype = torch.float32
    if args.offload_clean:  # a copy it could not remove: refused now, not after the run
        check_removable(target.checkpoint, dtype, args.quantize, args.offload_dir)
    largest = CostModel.BUDGETS[-1] if opts.budget == "auto" else opts.budget
    # the KV cache's length; a conversation's (--chat, --serve) is not known
    context = None if args.chat or args.serve else len(seq) + opts.max_new_tokens + largest + 1
    with ExitStack() as closing:  # an offloaded model gives back its files, thread and memory
        if args.offload:
            memory = None if args.device_memory is None else args.device_memory * 1e9
            target_model = offload.from_pretrained(
                target,
                mode=args.offload,
                device=offload.Cpu(args.link) if args.link else device,
                dtype=dtype,
                quantize=args.quantize,
                offload_dir=args.offload_dir,
                device_memory=memory,
                context=context,
            )
            closing.callback(tell_converted_copy, target_model, args.offload_clean)  # once closed
            closing.enter_context(target_model)
        else:
            target_model = models.load(target, device, dtype)
        draft_model = None  # with --draft none
        if args.self_draft:
            draft_model = offload.self_draft(target, args.draft, device=device, dtype=dtype)
            closing.enter_context(draft_model)
        elif draft is not None:
            draft_model = models.load(draft, device, dtype)
        if args.chat:
            session = chat.Chat(target_model, draft_model, opts)  # caches kept from turn to turn
            chat.talk(session, tokenizer, target.folder, args, list(eos), Streamer, dim, summary)
        elif args.serve:
            serve.serve(chat.Chat(target_model, draft_model, opts), tokenizer, args, eos)
        else:
            report(target_model, draft_model, tokenizer, seq, eos, args, device)


def report(target, draft, tokenizer, seq, eos, args, device):
    """specexec.generate, streaming; then the summary, and with --compare plain decoding
    (specexec.autoregressive) beside it."""
    import torch
    from tqdm import tqdm

    opts = args.opts
    if opts.seed is None:  # one seed for both runs, so --compare can match them
        opts.seed = torch.seed()
    if args.compare:  # both warmed up before either is timed: neither pays the first passes
        warm = replace(opts, max_new_tokens=2)
        specexec.generate(target, draft, seq, eos_token_id=eos, opts=warm)
        specexec.autoregressive(target, seq, eos_token_id=eos, opts=warm)
    # On a terminal the prompt is dim; in a file or pipe a line marks where the output starts.
    end = "" if sys.stdout.isatty() else "\n--- continuation ---\n"
    print(dim(tokenizer.decode(seq)), end=end, flush=True)
    tokens, stats = specexec.generate(
        target, draft, seq, eos_token_id=eos, on_tokens=Streamer(tokenizer), opts=opts
    )
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
    with tqdm(
        desc="plain decoding", total=opts.max_new_tokens, unit="token", disable=quiet, leave=False
    ) as bar:
        base_tokens, base = specexec.autoregressive(
            target, seq, eos_token_id=eos, on_tokens=lambda new: bar.update(len(new)), opts=opts
        )
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
    policy = stats.policy
    plain = sum(1 for budget, _ in stats.budgets if not budget)
    if not getattr(policy, "gains", None) or 2 * plain < stats.steps:
        return None
    # A tree's gains were seen, so (1, 1) is among the trees rated: every tree has a node at depth 1
    rates = policy.rates()
    best = max((choice for choice in rates if choice[0]), key=rates.get)  # (budget, max_depth)
    budget, max_depth = best
    tokens, passes = policy.gains[best]
    tree, plainly = apart(rates[best], rates[(0, 0)])
    grown = count(max_depth, "draft pass")  # more tokens than that gives: lookup's branches too
    grown += " and prompt lookup" if tokens > max_depth + 1 else ""
    said = (
        f"(auto decoded plainly in {plain} of {stats.steps} steps; its best tree, "
        f"{count(budget, 'node')} from {grown}, gives {tokens:.2f} tokens a target pass, "
        f"{tree} tokens/s against {plainly} plainly"
    )
    if rates[best] > rates[(0, 0)]:  # trees paid by the end: no cause against them
        return f"{said}: until late in the run, its trees measured slower)"
    one = policy.t_target(1)
    tree_s = policy.t_target(budget + 1)
    draft_s = passes * policy.draft_s
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


def tell_converted_copy(model, remove):
    """Where the ssd tier's converted copy of the checkpoint stays, or with `remove`, that it is
    deleted, on stderr (nothing where the checkpoint was read in place)."""
    folder = model.converted_folder
    if folder is None or not folder.exists():
        return
    if not remove:
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
        stays = f"a converted copy ({size:.2f} GB) stays in {folder} for the next run"
        print(f"offload: {stays}; --offload-clean removes it", file=sys.stderr)
        return
    try:
        shutil.rmtree(folder)
    except OSError as error:
        why = f"{error.strerror or error}: {error.filename}"
        raise OffloadError(f"cannot remove the converted copy {folder} ({why})") from None
    print(f"offload: removed the converted copy {folder}", file=sys.stderr)


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
        self.tokenizer = tokenizer
        self.ids = []
        self.printed = 0

    def __call__(self, tokens):
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # else wait for the character's next bytes
            print(text[self.printed :], end="", flush=True)
            self.printed = len(text)


# ---- entry point and exit statuses ----


def read_flags():
    """`python specexec.py`'s first step, before torch loads: the flags, checked; Ctrl-C while
    torch loads (seconds) then exits as it does later (130, quietly)."""
    args = handled(parse_args)
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    return args


def main(args=None):
    """The command line: `args` parsed already (`python specexec.py` read them before torch
    loaded), or a list of strings, or None for sys.argv (the `specexec` command)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # read_flags' quick exit, undone
    handled(lambda: run(args if isinstance(args, argparse.Namespace) else parse_args(args)))


def handled(work):
    """`work()` under the command line's promise, every exit status in one place: a bad input
    (or an output that cannot be written) is one `error:` line, exit 2; Ctrl-C 130; a reader
    that left (`| head`) 1, quietly."""
    try:
        if sys.stdout is None:  # started with `>&-`
            raise SpecExecError("standard output is closed: send it to a file or /dev/null")
        result = work()
        sys.stdout.flush()  # a full disk or closed pipe fails here, inside the handlers
        return result
    except (SpecExecError, OffloadError) as error:
        message = str(error)
    except KeyboardInterrupt:  # Ctrl-C: leave the terminal as we found it
        if sys.stdout is not None and sys.stdout.isatty():
            print(RESET)
        sys.exit(130)
    except OSError as error:  # mostly stdout that cannot be written (/dev/full, ulimit -f); the
        # inputs' file errors are SpecExecErrors, caught where they are read. What stdout still
        # holds goes to /dev/null, so that exiting does not fail on it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if isinstance(error, BrokenPipeError):  # the reader left: stop quietly
            sys.exit(1)
        message = f"{error.filename or 'cannot write the output'} ({error.strerror or error})"
    try:
        print(f"error: {message}", file=sys.stderr, flush=True)
    except (OSError, AttributeError):  # stderr full or closed: the status still says bad input
        os._exit(2)
    sys.exit(2)
