"""The command line of specexec: load a target/draft pair, tokenize, stream, summarise.

`python specexec.py` (or `python cli.py`) with no flags runs the project's own pair on a held-out
code prompt. Everything the user touches is here: options, model loading, chat template,
streaming, the summary line and one-line errors. The algorithm itself is in specexec.py.
"""

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from specexec import (
    Options,
    SpecExecError,
    autoregressive,
    check_prompt,
    context_length,
    generate,
)

HERE = Path(__file__).resolve().parent
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # decoder-only, take a 4D float mask


@dataclass
class CLIOptions:
    """What the command line adds to `Options`."""

    target: str = field(
        default=None,
        metadata={"help": "target model: hub id or folder (default: the project's models/target)"},
    )
    draft: str = field(
        default=None,
        metadata={"help": "draft model: hub id or folder (default: the project's models/draft)"},
    )
    prompt: str = field(
        default=None,
        metadata={"help": "prompt text (default: a held-out code prefix from models/prompts.json)"},
    )
    prompt_index: int = field(
        default=1, metadata={"help": "which of models/prompts.json's held-out prompts to use"}
    )
    device: str = field(default=None, metadata={"help": "cuda or cpu (default: cuda if available)"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "float32, float16, bfloat16 or float64 (auto: float32 on cpu, the "
            "checkpoint's own on cuda)"
        },
    )
    chat_template: str = field(
        default="auto",
        metadata={"help": "use the tokenizer's chat template: auto (when it has one), on, off"},
    )
    compare: bool = field(
        default=False,
        metadata={"help": "also run plain autoregressive decoding and print the speedup"},
    )
    offload: str = field(
        default=None,
        metadata={"help": "stream the target's layers from 'ram' or 'ssd' (default: off)"},
    )
    offload_dir: str = field(
        default=None,
        metadata={
            "help": "where the ssd tier keeps a per-layer copy when the checkpoint's own files "
            "cannot be read in place (default: ~/.cache/specexec/offload)"
        },
    )


CHOICES = {
    "offload": ("ram", "ssd"),
    "chat_template": ("auto", "on", "off"),
    "dtype": ("auto", "float32", "float16", "bfloat16", "float64"),
}


def parse_args(argv=None):
    """The command line, built from the fields of `CLIOptions` and `Options`."""
    import argparse

    parser = argparse.ArgumentParser(
        description="SpecExec speculative decoding. With no arguments, runs the project's own "
        "target/draft pair on a held-out code prompt."
    )
    for title, cls in (("model and prompt", CLIOptions), ("generation", Options)):
        group = parser.add_argument_group(title)
        for f in fields(cls):
            flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
            if f.type is bool:
                group.add_argument(flag, action="store_true", help=text)
                continue
            kind = f.type if f.type in (int, float) else int if f.type == int | None else str
            text += "" if "default" in text else f" (default: {f.default})"
            group.add_argument(
                flag, type=kind, default=f.default, choices=CHOICES.get(f.name), help=text
            )
    args = vars(parser.parse_args(argv))
    cli = CLIOptions(**{f.name: args.pop(f.name) for f in fields(CLIOptions)})
    return cli, args  # args: the generation options


def check_model_path(name):
    """A folder that exists, or something shaped like a hub id; else a clear error."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise SpecExecError(f"{name}: no config.json in this folder")
        return str(path)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") != 1
    if looks_local:
        raise SpecExecError(f"{name}: no such model folder")
    return name


def load_config(name):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        message = str(error).splitlines()[0]
        raise SpecExecError(f"{name}: cannot load its config ({message})") from None
    if config.model_type not in SUPPORTED_FAMILIES:
        raise SpecExecError(
            f"{name}: model family '{config.model_type}' is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return config


def check_same_tokenizer(target_tok, draft_tok):
    """Token ids must name the same strings in both models, or drafting means nothing."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
        raise SpecExecError(
            f"target and draft tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} tokens; "
            f"first difference: {differ[0][0]!r} id {differ[0][1]}); they must share one"
        )


def resolve_dtype(name, device):
    if name == "auto":
        return torch.float32 if device.type == "cpu" else "auto"
    return getattr(torch, name)


def load_model(name, device, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return model.to(device).eval()


def default_prompt(index):
    import json

    prompts = json.loads((HERE / "models" / "prompts.json").read_text())
    return prompts[index % len(prompts)]["prompt"]


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


def main(argv=None):
    import sys

    from offload import OffloadError

    try:
        run(*parse_args(argv))
    except (SpecExecError, OffloadError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def run(cli, options):
    import sys

    from transformers import AutoTokenizer

    opts = Options(**options)  # checks the options before anything is loaded
    try:
        device = torch.device(cli.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise SpecExecError(f"--device {cli.device}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecExecError("--device cuda: no CUDA device is available here; use --device cpu")
    dtype = resolve_dtype(cli.dtype, device)
    target_name = check_model_path(cli.target or str(HERE / "models" / "target"))
    draft_name = check_model_path(cli.draft or str(HERE / "models" / "draft"))
    limit = min(context_length(load_config(target_name)), context_length(load_config(draft_name)))
    tokenizer = AutoTokenizer.from_pretrained(target_name)
    check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(draft_name))

    prompt = cli.prompt if cli.prompt is not None else default_prompt(cli.prompt_index)
    has_template = tokenizer.chat_template is not None
    if cli.chat_template == "on" and not has_template:
        raise SpecExecError(f"{target_name}: its tokenizer has no chat template")
    if cli.chat_template != "off" and has_template:
        messages = [{"role": "user", "content": prompt}]
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        input_ids = input_ids["input_ids"] if isinstance(input_ids, dict) else input_ids
    else:
        input_ids = tokenizer(prompt)["input_ids"]
    check_prompt(input_ids, limit)  # before loading any weights

    if cli.offload:
        import offload

        target = offload.from_pretrained(
            target_name,
            mode=cli.offload,
            device=device,
            dtype=None if dtype == "auto" else dtype,
            offload_dir=cli.offload_dir or Path.home() / ".cache" / "specexec" / "offload",
        )
    else:
        target = load_model(target_name, device, dtype)
    draft = load_model(draft_name, device, dtype)
    # Stop at any EOS the tokenizer or the model's generation config names.
    config_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    eos = {tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])}
    eos.discard(None)
    if options["seed"] is None:  # one seed for both runs, so --compare can match them
        options["seed"] = torch.seed()

    dim, reset = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print(f"{dim}{tokenizer.decode(input_ids)}{reset}", end="", flush=True)
    tokens, stats = generate(
        target, draft, input_ids, eos_token_id=eos, on_tokens=Streamer(tokenizer), **options
    )
    print(
        f"\n\n{dim}specexec: {stats.summary()}; budget {opts.budget}, "
        f"{stats.draft_passes / max(1, stats.steps):.1f} draft passes/step{reset}"
    )
    if cli.offload:
        last = target.stats  # the last target pass
        print(
            f"{dim}offload ({cli.offload}): last target pass moved {last.bytes_moved / 1e9:.3f} GB "
            f"in {last.pass_s:.3f}s ({last.gb_per_s:.2f} GB/s), {last.wait_s:.3f}s waiting for "
            f"weights{reset}"
        )
    if cli.compare:
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


if __name__ == "__main__":
    main()
