"""The command line of specexec: load a target/draft pair, tokenize, stream, summarise.

`python specexec.py` (or `python cli.py`) with no flags runs the project's own pair on a held-out
code prompt. Everything the user touches is here: options, model loading, chat template,
streaming, the summary line and one-line errors. The algorithm itself is in specexec.py.

Every bad input ends the same way: one line `error: ...` on stderr, exit status 2, no traceback,
and nothing written; so does an output that cannot be written (a full disk, a closed stdout).
Ctrl-C exits with 130, a closed pipe (`| head`) quietly.
"""

import argparse
import math
import os
import sys
from dataclasses import fields
from pathlib import Path

try:  # torch takes seconds to import: Ctrl-C meanwhile exits as it does later, quietly
    import torch

    import quantize
    from checks import SpecExecError, check_draft_vocab, check_prompt, context_length, stop_tokens
    from cost_model import CostModel
    from offload_files import OffloadError, find_folder, one_line, open_checkpoint
    from specexec import Options, autoregressive, generate
except KeyboardInterrupt:
    sys.exit(130)

HERE = Path(__file__).resolve().parent
DIM, RESET = "\033[2m", "\033[0m"


# ---- options ----


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
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def count_or_auto(text):
    try:
        return text if text == "auto" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor auto") from None


def parse_args(argv=None):
    parser = Parser(
        description="SpecExec speculative decoding. With no arguments, runs the project's own "
        "target/draft pair on a held-out code prompt."
    )
    group = parser.add_argument_group("model and prompt")
    group.add_argument(
        "--target",
        metavar="PATH_OR_ID",
        help="hub id or folder (default: the project's models/target)",
    )
    group.add_argument(
        "--draft",
        metavar="PATH_OR_ID",
        help="hub id or folder (default: the project's models/draft); or int8 / int4: the "
        "target's own quantized copy, every layer kept on the device (cli.self_draft; it "
        "holds the dequantized weights, so it saves no memory, on a CPU or a GPU)",
    )
    group.add_argument("--prompt", help="prompt text (default: a held-out prompt of the pair)")
    group.add_argument(
        "--prompt-index",
        type=int,
        default=16,
        metavar="N",
        help="which of models/prompts.json (default: 16)",
    )
    group.add_argument(
        "--chat-template",
        choices=("auto", "on", "off"),
        default="auto",
        help="wrap the prompt in the tokenizer's chat template (auto: when it has one)",
    )
    group = parser.add_argument_group("device")
    group.add_argument(
        "--device", metavar="NAME", help="cpu, cuda, cuda:1, mps... (default: cuda if available)"
    )
    group.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16", "float64"),
        default="auto",
        help="auto: float32 on cpu (half precision runs about 6x slower there; with --offload "
        "ssd a half checkpoint is then read from a float32 copy), else the checkpoint's own",
    )
    group.add_argument(
        "--threads", type=positive, metavar="N", help="CPU threads (default: torch's choice)"
    )
    group.add_argument(
        "--offload", choices=("ram", "ssd"), help="stream the target's layers from RAM or disk"
    )
    group.add_argument(
        "--offload-dir",
        type=Path,
        default=Path("~/.cache/specexec/offload"),
        metavar="DIR",
        help="where ssd writes a per-layer copy when the checkpoint cannot be read in place "
        "(another --dtype than the checkpoint's); default: %(default)s",
    )
    group.add_argument(
        "--offload-clean", action="store_true", help="delete that copy after the run"
    )
    group.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        help="with --offload: store and move the target's linear weights in 8 or 4 bits, "
        "dequantized on the device (ssd writes a quantized copy into --offload-dir once)",
    )
    group.add_argument(
        "--device-memory",
        type=finite,
        metavar="GB",
        help="with --offload: device memory the target may hold; after its embeddings, head, KV "
        "cache (the prompt, the new tokens and the largest tree: 1024 nodes with budget auto) and "
        "ring, as many layers as fit stay resident and are never streamed",
    )
    group = parser.add_argument_group("generation (defaults: specexec.Options)")
    for f in fields(Options):  # one source of defaults and help for the API and the CLI
        text = f.metadata["help"]
        text += "" if "default" in text else " (default: %(default)s)"
        real = f.type in (float, float | None)
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            type=finite if real else count_or_auto if f.type == int | str else int,
            default=f.default,
            metavar="X" if real else "N|auto" if f.type == int | str else "N",
            help=text,
        )
    group = parser.add_argument_group("output")
    group.add_argument("--compare", action="store_true", help="also time plain decoding")
    group.add_argument("--verbose", action="store_true", help="show transformers' loading logs")
    return parser.parse_args(argv)


# ---- finding the models ----


def pick_device(name):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise SpecExecError(f"--device {name}: {one_line(error)}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu
    if not (hasattr(backend, "is_available") and backend.is_available()):
        raise SpecExecError(f"--device {name}: no {device.type} device here; use --device cpu")
    if (device.index or 0) >= backend.device_count():
        raise SpecExecError(f"--device {name}: only {backend.device_count()} here")
    return device


def find_model(name, flag):
    """The model folder of --target or --draft (offload_files.find_folder); None: the project's
    own (models/target or models/draft); '' is no name, not the default."""
    if name is None:
        name = str(HERE / "models" / flag.removeprefix("--"))
    if not name.strip():
        raise SpecExecError(f"{flag} is empty: pass a model folder or a hub id")
    return find_folder(name)


def load_config(folder):
    """Its config; a damaged one or an unsupported family is one OffloadError line."""
    from offload_files import load_configs

    return load_configs(folder)[0]


def check_stdout():
    """Refuse an output that cannot take what a model writes, before anything runs."""
    try:  # any character a model may write (ascii:replace, say, takes them all)
        "\u00e9\u2014\U0001f600".encode(sys.stdout.encoding, sys.stdout.errors or "strict")
    except (UnicodeEncodeError, LookupError, TypeError):
        raise SpecExecError(
            f"standard output's encoding {sys.stdout.encoding} cannot write all of a model's "
            "text: set PYTHONIOENCODING=utf-8"
        ) from None


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # a damaged file fails deep in tokenizers, with any exception
        raise SpecExecError(f"{folder}: cannot load its tokenizer ({one_line(error)})") from None


def check_same_tokenizer(target_tok, draft_tok):
    """Token ids must name the same strings in both models, or drafting means nothing."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
        raise SpecExecError(
            f"target and draft tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} tokens; "
            f"first difference: {differ[0][0]!r} id {differ[0][1]}); they must share one"
        )


def check_vocab(tokenizer, config, folder):
    """Every id the tokenizer gives must have a row in the model's embedding."""
    if len(tokenizer) > config.vocab_size:
        raise SpecExecError(
            f"{folder}: the tokenizer gives ids up to {len(tokenizer) - 1}, but the model's "
            f"vocabulary holds {config.vocab_size}"
        )


def default_prompt(index):
    import json

    path = HERE / "models" / "prompts.json"
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


def check_text(prompt):
    """Bytes that are not UTF-8 reach sys.argv as lone surrogates, which no tokenizer takes."""
    try:
        prompt.encode()
    except UnicodeEncodeError as error:
        byte = ord(prompt[error.start]) - 0xDC00  # how Python keeps an undecodable byte
        raise SpecExecError(
            f"--prompt is not UTF-8 text (byte {byte:#04x} at character {error.start})"
        ) from None


def tokenize(tokenizer, prompt, chat_template, folder):
    has_template = tokenizer.chat_template is not None
    if chat_template == "on" and not has_template:
        raise SpecExecError(f"{folder}: its tokenizer has no chat template")
    if chat_template == "off" or not has_template:
        return tokenizer(prompt)["input_ids"]
    messages = [{"role": "user", "content": prompt}]
    try:  # transformers 5 returns a BatchEncoding, which is no dict: ask for it by name
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except Exception as error:  # a template is a program (Jinja) and can fail in any way
        raise SpecExecError(f"{folder}: its chat template fails ({one_line(error)})") from None
    return list(encoded["input_ids"])


# ---- loading the weights ----


def load_model(folder, device, dtype):
    """The model in memory, read and checked as the offloaded target is (offload_files): the
    same folder is refused by both or by neither. dtype None: the checkpoint's own."""
    import offload_files as files

    folder = Path(folder)
    config, generation = files.load_configs(folder)
    ckpt, model = files.open_checkpoint(folder, config)  # refuses what does not fill it exactly
    files.load_weights(ckpt, model, device, dtype or ckpt.dtype, generation)
    return model


def load_offloaded(folder, args, device, dtype, context):
    import offload

    return offload.from_pretrained(
        folder,
        mode=args.offload,
        device=device,
        dtype=dtype,
        offload_dir=args.offload_dir.expanduser(),
        quantize=args.quantize,
        device_memory=None if args.device_memory is None else args.device_memory * 1e9,
        context=context,  # tokens the target's KV cache holds at most
    )


def self_draft(target, kind, **options):
    """The target's own int8 or int4 copy as SpecExec's draft (SubSpec, 2025): the same
    tokenizer by construction and no second checkpoint. An offload.OffloadedCausalLM with every
    layer resident (nothing streams); `target` a folder or hub id, `options` as
    offload.from_pretrained's (device, dtype, context).

    Each layer's buffer holds its weights dequantized into `dtype` beside the quantized bytes,
    and the matmuls run on those (no int8 / int4 kernels here): it computes exactly the quantized
    model, but holds more than the full model's bytes on the device, not a quarter of them.
    """
    import offload

    if kind not in quantize.KINDS:
        raise OffloadError(f"a self-draft is 'int8' or 'int4', not {kind!r}")
    return offload.from_pretrained(
        target, mode="ram", quantize=kind, device_memory=math.inf, **options
    )


# ---- output ----


class Streamer:
    """Prints text as tokens arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def __call__(self, tokens):
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        print(text[self.printed :], end="", flush=True)
        self.printed = len(text)


def run(args):
    opts = Options(**{f.name: getattr(args, f.name) for f in fields(Options)})  # checks them
    device = pick_device(args.device)
    check_stdout()
    if args.offload_clean and args.offload != "ssd":
        raise SpecExecError("--offload-clean goes with --offload ssd (only ssd writes a copy)")
    if args.quantize and not args.offload:
        raise SpecExecError("--quantize goes with --offload (it quantizes the streamed layers)")
    if args.device_memory is not None and not args.offload:
        raise SpecExecError("--device-memory goes with --offload (it keeps streamed layers)")
    if args.compare and opts.max_new_tokens == 0:
        raise SpecExecError("--compare times decoding: give it --max-new-tokens of at least 1")
    if args.threads:
        cores = os.cpu_count() or 1
        if args.threads > cores:  # more threads than cores only wait for each other
            raise SpecExecError(f"--threads {args.threads}: this machine has {cores} cores")
        torch.set_num_threads(args.threads)
    if not args.verbose:  # no per-tensor progress bars and load reports
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()

    # Everything is checked before any weight is read.
    if None in (args.target, args.draft) and not (HERE / "models" / "target").is_dir():
        raise SpecExecError(
            f"the default pair lives in a clone's models/, not beside {HERE}: pass --target and "
            "--draft (a hub id or a folder), or install the clone with `pip install -e .`"
        )
    prompt = args.prompt if args.prompt is not None else default_prompt(args.prompt_index)
    check_text(prompt)
    target_dir = find_model(args.target, "--target")
    # --draft int8 / int4: the target's own quantized copy, with its tokenizer by construction
    own_copy = args.draft in quantize.KINDS
    draft_dir = target_dir if own_copy else find_model(args.draft, "--draft")
    target_config, draft_config = load_config(target_dir), load_config(draft_dir)
    tokenizer = load_tokenizer(target_dir)
    check_same_tokenizer(tokenizer, load_tokenizer(draft_dir))
    check_vocab(tokenizer, target_config, target_dir)
    check_vocab(tokenizer, draft_config, draft_dir)
    check_draft_vocab(target_config, draft_config)
    for folder, config in [(target_dir, target_config), (draft_dir, draft_config)]:
        open_checkpoint(folder, config)  # every weight there with its shape, read from headers
    input_ids = tokenize(tokenizer, prompt, args.chat_template, target_dir)
    check_prompt(input_ids, min(context_length(target_config), context_length(draft_config)))

    if args.offload:
        largest = opts.budget if opts.budget != "auto" else CostModel.BUDGETS[-1]
        context = len(input_ids) + opts.max_new_tokens + largest + 1  # prefix and tree
        target = load_offloaded(target_dir, args, device, pick_dtype(args, device), context)
    else:
        target = load_model(target_dir, device, pick_dtype(args, device))
    draft = None
    try:
        if own_copy:
            draft = self_draft(draft_dir, args.draft, device=device, dtype=pick_dtype(args, device))
        else:
            draft = load_model(draft_dir, device, pick_dtype(args, device))
        generate_and_report(target, draft, tokenizer, input_ids, args, opts, device)
    finally:
        if own_copy and draft is not None:
            draft.close()
        if args.offload:
            target.close()
            clean_offload(target, args.offload_clean)


def pick_dtype(args, device):
    """auto: float32 on cpu, where half precision runs about 6x slower (with --offload ssd a
    half checkpoint is then read from a float32 copy, made once), else the checkpoint's own."""
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    return torch.float32 if device.type == "cpu" else None


def generate_and_report(target, draft, tokenizer, input_ids, args, opts, device):
    eos = stop_tokens(None, target, tokenizer)  # any EOS the model's config or tokenizer names
    options = {f.name: getattr(opts, f.name) for f in fields(Options)}
    if options["seed"] is None:  # one seed for both runs, so --compare can match them
        options["seed"] = torch.seed()

    tty = sys.stdout.isatty()
    dim, reset = (DIM, RESET) if tty else ("", "")
    # On a terminal the prompt is dim; in a file or pipe a line marks where the output starts.
    print(
        f"{dim}{tokenizer.decode(input_ids)}{reset}", end="" if tty else "\n--- continuation ---\n"
    )
    sys.stdout.flush()
    tokens, stats = generate(
        target, draft, input_ids, eos_token_id=eos, on_tokens=Streamer(tokenizer), **options
    )
    seed = f"; seed {options['seed']}" if opts.temperature > 0 else ""
    print(
        f"\n\n{dim}specexec: {stats.summary()}; "
        f"{stats.draft_passes / max(1, stats.steps):.1f} draft passes per target pass; "
        f"threads {torch.get_num_threads()}{seed}{reset}"
    )
    if args.offload:
        last = target.stats  # the last target pass
        rate = f" ({last.gb_per_s:.2f} GB/s)" if last.bytes_moved > 1e8 else ""
        print(
            f"{dim}offload ({args.offload}): {last.resident_layers} of "
            f"{target.config.num_hidden_layers} layers resident; the last target pass moved "
            f"{last.bytes_moved / 1e6:,.1f} MB in {last.pass_s:.3f}s{rate}, {last.wait_s:.3f}s of "
            f"it waiting for weights{reset}"
        )
    if args.compare:
        base_tokens, base = autoregressive(target, input_ids, eos_token_id=eos, **options)
        same = "identical output" if base_tokens == tokens else "outputs differ"
        print(f"{dim}plain decoding: {base.summary()}{reset}")
        speedup = None
        if base.new_tokens and stats.new_tokens:
            speedup = stats.tokens_per_second / base.tokens_per_second
            print(f"speedup {speedup:.2f}x ({stats.tokens_per_step:.2f} tokens per target pass)")
        print(same)
        if speedup is not None and speedup < 1 and device.type == "cpu" and args.offload != "ssd":
            where = "in memory" if not args.offload else "in RAM (--offload ram on a CPU is a "
            where += "" if not args.offload else "memory copy, not a link to another device)"
            print(
                f"{dim}(not SpecExec's regime: with the target {where}, a pass over a tree costs "
                f"more than a one-token pass. It pays where the weights stream over a slow link: "
                f"`python -m scripts.bench_disk --grow-to big-target`, then `python specexec.py "
                f"--target big-target --offload ssd --compare`){reset}"
            )
    sys.stdout.flush()  # a closed pipe fails here, inside main's handlers, not at exit


def clean_offload(target, remove):
    """Say where a converted copy of the checkpoint is, or remove it."""
    folder = getattr(target, "converted_folder", None)  # None: read the checkpoint in place
    if folder is None or not folder.exists():
        return
    if remove:
        import shutil

        shutil.rmtree(folder)
        print(f"offload: removed the converted copy {folder}", file=sys.stderr)
        return
    size = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
    print(
        f"offload: a converted copy ({size:.2f} GB) stays in {folder} for the next run; "
        "--offload-clean removes it",
        file=sys.stderr,
    )


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
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def drop_stdout():
    """Send what stdout still holds to /dev/null, so that exiting does not fail on it again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    main()
