"""The command line: `python specexec.py` (or `specexec` once installed), top-down as it runs:
flags -> specexec.Options -> both folders opened and checked, the prompt tokenized and checked
(models.py), before any weight is read -> load -> specexec.generate, streaming -> the summary.
Every bad input is one line `error: ...` on stderr, exit status 2, no traceback, nothing written
(an output that cannot be written too); Ctrl-C exits with 130, a closed pipe (`| head`) quietly.
"""

import argparse
import math
import os
import shutil
import sys
from dataclasses import fields, replace
from pathlib import Path

try:  # torch takes seconds to import: Ctrl-C meanwhile exits as it does later, quietly
    import torch
    from tqdm import tqdm
    from transformers.utils import logging as transformers_logging

    import offload
    import specexec
    from specexec_tools import chat, models, quantize
    from specexec_tools.checkpoint import OffloadError, check_removable
    from specexec_tools.models import SpecExecError
except KeyboardInterrupt:
    sys.exit(130)

RESET = "\033[0m"


def dim(text):
    """Text a terminal shows dim (a run's figures, beside the model's words); as it is in a pipe."""
    return f"\033[2m{text}{RESET}" if sys.stdout.isatty() else text


# ---- flags: generation options from specexec.Options, the rest here ----


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and two lines; keep the one-line promise
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    def print_help(self, file=None):  # argparse would drop a failed write (a full disk) silently
        print(self.format_help(), end="", file=file or sys.stdout)

    def exit(self, status=0, message=None):  # after --help: a full stdout fails here, not at exit
        if sys.stdout is not None:
            sys.stdout.flush()
        super().exit(status, message)


def finite(text):
    if not math.isfinite(value := float(text)):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def positive(text):
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def count_or_auto(text):
    try:
        return text if text == "auto" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor auto") from None


def parse_args(argv=None):
    # fmt: off
    parser = Parser(description="SpecExec speculative decoding. With no arguments, runs the "
                    "project's own target/draft pair on a held-out code prompt.")
    add = parser.add_argument_group("model and prompt").add_argument
    add("--target", metavar="PATH_OR_ID", help="hub id or folder (default: models/target)")
    add("--draft", metavar="PATH_OR_ID", help="hub id or folder (default: models/draft); or "
        "int8 / int4: the target's own copy, dequantized and whole on the device (no memory "
        "saved); it pays beside an --offload target (in memory, budget auto decodes plainly)")
    add("--prompt", help="prompt text (default: a held-out prompt of the pair)")
    add("--prompt-index", type=int, default=16, metavar="N", help="which of models/prompts.json")
    add("--chat-template", choices=("auto", "on", "off"), default="auto",
        help="wrap the prompt in the tokenizer's chat template (auto: when it has one)")
    add = parser.add_argument_group("device").add_argument
    add("--device", metavar="NAME", help="cpu, cuda, cuda:1... (default: cuda if available)")
    add("--dtype", choices=("auto", "float32", "float16", "bfloat16", "float64"), default="auto",
        help="auto: float32 on cpu (half precision runs about 6x slower there; with --offload "
        "ssd a half checkpoint is then read from a float32 copy), else the checkpoint's own")
    add("--threads", type=positive, metavar="N", help="CPU threads (default: torch's)")
    add("--offload", choices=("ram", "ssd"), help="stream the target's layers from RAM or disk")
    add("--offload-dir", type=Path, default=Path("~/.cache/specexec/offload"), metavar="DIR",
        help="where ssd writes a per-layer copy when the checkpoint cannot be read in place "
        "(another --dtype than the checkpoint's); default: %(default)s")
    add("--offload-clean", action="store_true", help="delete that copy after the run")
    add("--quantize", choices=quantize.KINDS, help="with --offload: store and move the target's "
        "linear weights in 8 or 4 bits, dequantized on the device (ssd writes a quantized copy "
        "into --offload-dir once)")
    add("--device-memory", type=finite, metavar="GB", help="with --offload: device memory the "
        "target may hold; after its embeddings, head, KV cache (the prompt, the new tokens and "
        "the largest tree: 1024 nodes with budget auto) and ring, as many layers as fit stay "
        "resident and are never streamed")
    add = parser.add_argument_group("generation (defaults: specexec.Options)").add_argument
    for f in fields(specexec.Options):  # one source of defaults and help for the API and the CLI
        real, auto, text = f.type in (float, float | None), f.type == int | str, f.metadata["help"]
        add("--" + f.name.replace("_", "-"), default=f.default,
            type=finite if real else count_or_auto if auto else int,
            metavar="X" if real else "N|auto" if auto else "N",
            help=text + ("" if "default" in text else " (default: %(default)s)"))
    add = parser.add_argument_group("output").add_argument
    add("--chat", action="store_true", help="a conversation: one turn per line of input (a "
        "prompt on a terminal; EOF or /exit ends it); the caches are kept from turn to turn")
    add("--compare", action="store_true", help="also time plain decoding (both warmed up first)")
    add("--verbose", action="store_true", help="show transformers' loading logs")
    # fmt: on
    return parser.parse_args(argv)


# ---- one run ----


def run(args):
    opts = specexec.Options(**{f.name: getattr(args, f.name) for f in fields(specexec.Options)})
    device = models.pick_device(args.device)
    check_flags(args, opts)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.verbose:  # no per-tensor progress bars and load reports
        transformers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()

    # Everything is checked before any weight is read.
    self_draft = args.draft in quantize.KINDS  # the target's own copy: its tokenizer too
    target = models.model_name(args.target, "--target")
    draft = self_draft or models.model_name(args.draft, "--draft")
    prompt = args.prompt  # a chat's first turn, if given
    if prompt is None and not args.chat:
        prompt = models.default_prompt(args.prompt_index)
    target = models.open_model(target)
    draft = target if self_draft else models.open_model(draft)
    tokenizers = [models.load_tokenizer(target.folder)]
    tokenizers.append(tokenizers[0] if self_draft else models.load_tokenizer(draft.folder))
    input_ids = None  # a chat without --prompt: its turns come later
    if prompt is not None:
        input_ids = models.tokenize(tokenizers[0], prompt, args.chat_template, target.folder)
    seq, _, eos = models.preflight(target, draft, input_ids, None, tokenizers)

    dtype = torch.float32 if args.dtype == "auto" and device.type == "cpu" else None
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else dtype  # None: the checkpoint's
    if args.offload_clean:  # a copy it could not remove: refused now, not after the run
        check_removable(target.checkpoint, dtype, args.quantize, args.offload_dir)
    largest = 1024 if opts.budget == "auto" else opts.budget  # cost_model.CostModel.BUDGETS[-1]
    context = None if args.chat else len(seq) + opts.max_new_tokens + largest + 1  # the KV cache
    loaded = []
    try:
        for role, opened in ("target", target), ("draft", draft):
            loaded.append(load(opened, role, args, device, dtype, context))
        if args.chat:
            chat.talk(specexec.Chat(*loaded, opts), tokenizers[0], args.chat_template,
                      target.folder, list(eos), Streamer, dim, first=prompt)  # fmt: skip
        else:
            report(*loaded, tokenizers[0], seq, list(eos), args, opts, device)
    finally:
        for model in loaded:  # an offloaded one gives back its files, thread and pinned memory
            getattr(model, "close", lambda: None)()
        if loaded and args.offload:
            tell_converted_copy(loaded[0].converted_folder, args.offload_clean)


def tell_converted_copy(folder, remove):
    """Where the ssd tier's converted copy stays, or that --offload-clean removed it."""
    if folder is None or not folder.exists():  # the checkpoint was read in place
        return
    if not remove:
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
        return print(f"offload: a converted copy ({size:.2f} GB) stays in {folder} for the next"
                     " run; --offload-clean removes it", file=sys.stderr)  # fmt: skip
    try:
        shutil.rmtree(folder)
    except OSError as error:
        why = f"{error.strerror or error}: {error.filename}"
        raise OffloadError(f"cannot remove the converted copy {folder} ({why})") from None
    print(f"offload: removed the converted copy {folder}", file=sys.stderr)


def load(opened, role, args, device, dtype, context):
    """The one load of a checked folder: in memory, the target offloaded (--offload), or the
    draft as the target's own int8 / int4 copy, every layer resident (--draft int8|int4)."""
    if role == "draft" and args.draft in quantize.KINDS:
        return offload.self_draft(opened, args.draft, device=device, dtype=dtype)
    if role == "target" and args.offload:
        memory = None if args.device_memory is None else args.device_memory * 1e9
        return offload.from_pretrained(
            opened, mode=args.offload, device=device, dtype=dtype, quantize=args.quantize,
            offload_dir=args.offload_dir.expanduser(), device_memory=memory, context=context,
        )  # fmt: skip
    return models.load(opened, device, dtype)


def report(target, draft, tokenizer, seq, eos, args, opts, device):
    """Generate, streaming; then the summary, and with --compare plain decoding beside it."""
    if opts.seed is None:  # one seed for both runs, so --compare can match them
        opts = replace(opts, seed=torch.seed())
    if args.compare:  # both warmed up before either is timed: neither pays the first passes
        warm = replace(opts, max_new_tokens=2)
        specexec.generate(target, draft, seq, eos_token_id=eos, opts=warm)
        specexec.autoregressive(target, seq, eos_token_id=eos, opts=warm)
    # On a terminal the prompt is dim; in a file or pipe a line marks where the output starts.
    tty = sys.stdout.isatty()
    print(dim(tokenizer.decode(seq)), end="" if tty else "\n--- continuation ---\n", flush=True)
    tokens, stats = specexec.generate(target, draft, seq, eos_token_id=eos, opts=opts,
                                      on_tokens=Streamer(tokenizer))  # fmt: skip
    print("\n\n" + dim(f"specexec: {stats.summary()}"))
    if args.offload:
        layers = target.config.num_hidden_layers
        print(dim(f"offload ({args.offload}): {target.stats.summary(layers)}"))
    if not args.compare:
        return
    # plain decoding can take minutes: on a terminal, a line says how far it is (nothing in a pipe)
    quiet = sys.stderr is None or not sys.stderr.isatty()
    with tqdm(desc="plain decoding", total=opts.max_new_tokens, unit="token", disable=quiet,
              leave=False) as bar:  # fmt: skip
        base_tokens, base = specexec.autoregressive(
            target, seq, eos_token_id=eos, on_tokens=lambda new: bar.update(len(new)), opts=opts
        )
    print(dim(f"plain decoding: {base.summary()}"))
    if base.new_tokens and stats.new_tokens:
        speedup = stats.tokens_per_second / base.tokens_per_second
        print(f"speedup {speedup:.2f}x: SpecExec against plain decoding of the same target, both "
              f"warmed up ({stats.tokens_per_step:.2f} tokens per target pass)")  # fmt: skip
        if speedup < 1 and device.type == "cpu" and args.offload != "ssd":
            where = "in memory" if not args.offload else "in RAM (on a CPU, a memory copy)"
            print(dim(f"(not SpecExec's regime: with the target {where}, a tree's pass costs more "
                      "than one token's. It pays where weights stream over a slow link: `python -m "
                      "scripts.bench_disk --grow-to big-target`, then `python specexec.py --target "
                      "big-target --offload ssd --compare`)"))  # fmt: skip
    print("identical output" if base_tokens == tokens else "outputs differ")


# ---- inputs: flags, folders, the default prompt ----


def check_flags(args, opts):
    """Flags that only make sense together, and output that cannot take a model's text."""
    # fmt: off
    for wrong, message in [
        (args.offload_clean and args.offload != "ssd",
         "--offload-clean goes with --offload ssd (only ssd writes a copy)"),
        (args.quantize and not args.offload,
         "--quantize goes with --offload (it quantizes the streamed layers)"),
        (args.device_memory is not None and not args.offload,
         "--device-memory goes with --offload (it keeps streamed layers)"),
        (args.chat and args.compare, "--chat and --compare: compare a one-prompt run instead"),
        (args.compare and opts.max_new_tokens == 0,
         "--compare times decoding: give it --max-new-tokens of at least 1"),
        ((args.threads or 0) > (cores := os.cpu_count() or 1),
         f"--threads {args.threads}: this machine has {cores} cores"),
    ]:  # fmt: on
        if wrong:
            raise SpecExecError(message)
    try:  # any character a model may write (ascii:replace, say, takes them all)
        "\u00e9\u2014\U0001f600".encode(sys.stdout.encoding, sys.stdout.errors or "strict")
    except (UnicodeEncodeError, LookupError, TypeError):
        raise SpecExecError(f"standard output's encoding {sys.stdout.encoding} cannot write all "
                            "of a model's text: set PYTHONIOENCODING=utf-8") from None  # fmt: skip


# ---- output ----


class Streamer:
    """Prints text as tokens arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def __call__(self, tokens):
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # else an incomplete character, held back
            print(text[self.printed :], end="", flush=True)
            self.printed = len(text)


# ---- entry point ----


def main(argv=None):
    try:
        if sys.stdout is None:  # started with `>&-`
            raise SpecExecError("standard output is closed: send it to a file or /dev/null")
        run(parse_args(argv))
        sys.stdout.flush()  # a full disk or closed pipe fails here, inside the handlers
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
        where = error.filename or "cannot write the output"
        fail(f"{where} ({error.strerror or error})")


def fail(message):
    try:
        print(f"error: {message}", file=sys.stderr, flush=True)
    except (OSError, AttributeError):  # stderr full or closed: the status still says bad input
        os._exit(2)
    sys.exit(2)


def drop_stdout():
    """Send what stdout still holds to /dev/null, so that exiting does not fail on it again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
