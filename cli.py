"""The command line of specexec: load a target/draft pair, tokenize, stream, summarise.

`python specexec.py` (or `python cli.py`) with no flags runs the project's own pair on a held-out
code prompt. Everything the user touches is here: options, model loading, chat template,
streaming, the summary line and one-line errors. The algorithm itself is in specexec.py.

Every bad input ends the same way: one line `error: ...` on stderr, exit status 2, no traceback,
and nothing written. Ctrl-C exits with 130, a closed pipe (`| head`) quietly.
"""

import argparse
import math
import os
import sys
from dataclasses import fields
from pathlib import Path

import torch

from specexec import Options, SpecExecError, autoregressive, check_prompt, context_length, generate

HERE = Path(__file__).resolve().parent
DIM, RESET = "\033[2m", "\033[0m"


# ---- options ----


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and two lines; keep the one-line promise
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


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
        help="hub id or folder (default: the project's models/draft)",
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
        help="auto: float32 on cpu, else the checkpoint's own; with --offload ssd always the "
        "checkpoint's own, so its files are read in place",
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
    group = parser.add_argument_group("generation (defaults: specexec.Options)")
    for f in fields(Options):  # one source of defaults and help for the API and the CLI
        text = f.metadata["help"]
        text += "" if "default" in text else " (default: %(default)s)"
        real = f.type in (float, float | None)
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            type=finite if real else int,
            default=f.default,
            metavar="X" if real else "N",
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
        raise SpecExecError(f"--device {name}: {str(error).splitlines()[0]}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu
    if not (hasattr(backend, "is_available") and backend.is_available()):
        raise SpecExecError(f"--device {name}: no {device.type} device here; use --device cpu")
    if (device.index or 0) >= backend.device_count():
        raise SpecExecError(f"--device {name}: only {backend.device_count()} here")
    return device


def find_model(name):
    """A local model folder: the folder given, or a hub id's snapshot (cached or downloaded)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecExecError(f"{name}: no config.json in this folder")
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise SpecExecError(f"{name}: no such model folder")
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]  # config, weights, tokenizer
    try:
        return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
    except (OSError, ValueError):
        pass  # not in the cache
    # The hub client retries a dead network for half a minute; one quick look decides instead.
    offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else unreachable()
    if offline:
        raise SpecExecError(
            f"{name}: no such folder, not in the Hugging Face cache, and {offline}; "
            "pass a local model folder (or download it once online; HF_HUB_OFFLINE=1 then "
            "uses the cache only)"
        )
    try:
        folder = Path(snapshot_download(name, allow_patterns=patterns))
        if not any(folder.glob("*.safetensors")):  # .bin only where a repo has no safetensors
            folder = Path(snapshot_download(name, allow_patterns=[*patterns, "*.bin"]))
    except (OSError, ValueError) as error:
        raise SpecExecError(f"{name}: cannot download it ({one_line(error)})") from None
    return folder


def unreachable():
    """Why the hub cannot be reached, or None."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    if url.scheme in urllib.request.getproxies():
        return None  # the client goes through a proxy; let it try
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as error:
        return f"{url.hostname} cannot be reached ({error.strerror or error})"
    return None


def one_line(error):
    return " ".join(str(error).split())[:300]


def load_config(folder):
    """Its config; a damaged one or an unsupported family is one OffloadError line."""
    from offload_files import load_configs

    return load_configs(folder)[0]


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
    prompts = json.loads(path.read_text())
    if not 0 <= index < len(prompts):
        raise SpecExecError(
            f"--prompt-index {index}: models/prompts.json has 0..{len(prompts) - 1}"
        )
    return prompts[index]["prompt"]


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
    """The model in memory, refusing a checkpoint that does not fill it exactly."""
    from transformers import AutoModelForCausalLM

    from offload_files import Checkpoint

    folder = Path(folder)
    Checkpoint(folder)  # damaged or missing shards: the same clear errors as with --offload
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype or "auto", output_loading_info=True, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError, RuntimeError) as error:
        raise SpecExecError(f"{folder}: cannot load its weights ({one_line(error)})") from None
    # Hugging Face fills anything missing or misshapen with random weights and runs; we refuse.
    # A tied lm_head is not missing: it shares the embedding, and is not reported.
    mismatched = [
        f"{key} {tuple(ckpt)} vs {tuple(want)}" for key, ckpt, want in info["mismatched_keys"]
    ]
    for keys, what in [
        (info["missing_keys"], "lacks {n} weights its config.json asks for"),
        (info["unexpected_keys"], "holds {n} weights its config.json has no place for"),
        (mismatched, "has {n} weights of another shape than its config.json gives"),
    ]:
        if keys:
            first = sorted(keys)[0] + (", ..." if len(keys) > 1 else "")
            raise SpecExecError(f"{folder}: the checkpoint {what.format(n=len(keys))} ({first})")
    if model.dtype == torch.float64 and "grouped_mm" in model.get_experts_implementation().values():
        model.set_experts_implementation("eager")  # a mixture's default kernel lacks float64
    return model.to(device).eval()


def load_offloaded(folder, args, device, dtype):
    import offload

    return offload.from_pretrained(
        folder,
        mode=args.offload,
        device=device,
        dtype=dtype,
        offload_dir=args.offload_dir.expanduser(),
        quantize=args.quantize,
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
    if args.offload_clean and args.offload != "ssd":
        raise SpecExecError("--offload-clean goes with --offload ssd (only ssd writes a copy)")
    if args.quantize and not args.offload:
        raise SpecExecError("--quantize goes with --offload (it quantizes the streamed layers)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.verbose:  # no per-tensor progress bars and load reports
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()

    # Everything is checked before any weight is read.
    if not (args.target and args.draft) and not (HERE / "models" / "target").is_dir():
        raise SpecExecError(
            f"the default pair lives in a clone's models/, not beside {HERE}: pass --target and "
            "--draft (a hub id or a folder), or install the clone with `pip install -e .`"
        )
    prompt = args.prompt if args.prompt is not None else default_prompt(args.prompt_index)
    target_dir = find_model(args.target or str(HERE / "models" / "target"))
    draft_dir = find_model(args.draft or str(HERE / "models" / "draft"))
    target_config, draft_config = load_config(target_dir), load_config(draft_dir)
    tokenizer = load_tokenizer(target_dir)
    check_same_tokenizer(tokenizer, load_tokenizer(draft_dir))
    check_vocab(tokenizer, target_config, target_dir)
    check_vocab(tokenizer, draft_config, draft_dir)
    input_ids = tokenize(tokenizer, prompt, args.chat_template, target_dir)
    check_prompt(input_ids, min(context_length(target_config), context_length(draft_config)))

    if args.offload:
        target = load_offloaded(target_dir, args, device, pick_dtype(args, device, args.offload))
    else:
        target = load_model(target_dir, device, pick_dtype(args, device))
    try:
        draft = load_model(draft_dir, device, pick_dtype(args, device))
        generate_and_report(target, draft, tokenizer, input_ids, args, opts)
    finally:
        if args.offload:
            target.close()
            clean_offload(target, args.offload_clean)


def pick_dtype(args, device, offload=None):
    """auto: float32 on cpu (half runs about 6x slower there), else the checkpoint's own (None).
    With --offload ssd, the checkpoint's own everywhere: its files are read in place, not copied."""
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    in_place = offload == "ssd" and not args.quantize  # a quantized ssd target is a copy anyway
    return torch.float32 if device.type == "cpu" and not in_place else None


def generate_and_report(target, draft, tokenizer, input_ids, args, opts):
    # Stop at any EOS the tokenizer or the model's generation config names.
    config_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    eos = {tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])}
    eos.discard(None)
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
    seed = f", seed {options['seed']}" if opts.temperature > 0 else ""
    print(
        f"\n\n{dim}specexec: {stats.summary()}; budget {opts.budget}, "
        f"{stats.draft_passes / max(1, stats.steps):.1f} draft passes/step; "
        f"threads {torch.get_num_threads()}{seed}{reset}"
    )
    if args.offload:
        last = target.stats  # the last target pass
        print(
            f"{dim}offload ({args.offload}): last target pass moved {last.bytes_moved / 1e9:.3f} "
            f"GB in {last.pass_s:.3f}s ({last.gb_per_s:.2f} GB/s), {last.wait_s:.3f}s waiting "
            f"for weights{reset}"
        )
    if args.compare:
        base_tokens, base = autoregressive(target, input_ids, eos_token_id=eos, **options)
        same = "identical output" if base_tokens == tokens else "outputs differ"
        print(f"{dim}autoregressive: {base.summary()}{reset}")
        speedup = stats.tokens_per_second / base.tokens_per_second
        print(f"speedup {speedup:.2f}x ({stats.tokens_per_step:.2f} tokens/step); {same}")
        if speedup < 1:
            print(
                f"{dim}(on this device a pass over a whole tree costs more than a one-token pass; "
                f"SpecExec pays where the target's weights stream from RAM or disk){reset}"
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
    from offload import OffloadError

    args = parse_args(argv)
    try:
        run(args)
    except (SpecExecError, OffloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: leave the terminal as we found it
        if sys.stdout.isatty():
            print(RESET)
        sys.exit(130)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        sys.exit(1)


if __name__ == "__main__":
    main()
