"""Benchmark SpecExec against autoregressive decoding, in the same run, on held-out prompts.

    python bench.py                                  # the project's pair, budgets 1..1024
    python bench.py --budgets 64,256 --prompts 4 --offload ssd

For each budget: tokens per target pass (the number that carries over to an offloaded big
model), wall-clock tokens/s of SpecExec and of plain decoding, and their ratio. Greedy
decoding, so each SpecExec output is also checked token for token against the baseline.
"""

import argparse
import json
import platform
import time

import torch

import cli
import specexec


def cpu_name():
    """The processor's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine():
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu_name()}, {torch.get_num_threads()} threads, {gpu}; torch {torch.__version__}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(cli.HERE / "models" / "target"))
    parser.add_argument("--draft", default=str(cli.HERE / "models" / "draft"))
    parser.add_argument("--prompt-file", default=str(cli.HERE / "models" / "prompts.json"))
    parser.add_argument("--budgets", default="1,16,64,256,1024", help="comma-separated")
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts to average over")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-depth", type=int, default=specexec.Options.max_depth)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--offload", choices=["ram", "ssd"], default=None)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.offload:
        import offload

        target = offload.from_pretrained(args.target, mode=args.offload, device=device, dtype=dtype)
    else:
        target = cli.load_model(args.target, device, dtype)
    draft = cli.load_model(args.draft, device, dtype)
    prompts = json.loads(open(args.prompt_file).read())[: args.prompts]
    prompt_ids = [tokenizer(p["prompt"])["input_ids"] for p in prompts]
    eos = tokenizer.eos_token_id
    print(f"machine: {machine()}")
    print(
        f"target {args.target} ({'offloaded: ' + args.offload if args.offload else 'in memory'})"
        f", draft {args.draft}, {args.dtype} on {device}"
    )
    print(f"{len(prompts)} held-out prompts, {args.max_new_tokens} new tokens each, greedy\n")

    torch.manual_seed(0)
    with torch.no_grad():
        specexec.generate(target, draft, prompt_ids[0], max_new_tokens=8)  # warm-up
        start = time.perf_counter()
        baseline = [
            specexec.autoregressive(target, ids, max_new_tokens=args.max_new_tokens,
                                    eos_token_id=eos)
            for ids in prompt_ids
        ]  # fmt: skip
        base_time = time.perf_counter() - start
        base_tokens = sum(s.new_tokens for _, s in baseline)
        base_rate = base_tokens / base_time
        print(
            f"{'budget':>7} {'tokens/step':>12} {'draft passes/step':>18} "
            f"{'tokens/s':>9} {'baseline tokens/s':>18} {'speedup':>8}  exact"
        )
        for budget in [int(b) for b in args.budgets.split(",")]:
            start = time.perf_counter()
            runs = [
                specexec.generate(target, draft, ids, max_new_tokens=args.max_new_tokens,
                                  budget=budget, max_depth=args.max_depth, eos_token_id=eos)
                for ids in prompt_ids
            ]  # fmt: skip
            elapsed = time.perf_counter() - start
            steps = sum(s.steps for _, s in runs)
            tokens = sum(s.new_tokens for _, s in runs)
            passes = sum(s.draft_passes for _, s in runs)
            exact = all(t == b for (t, _), (b, _) in zip(runs, baseline))
            print(
                f"{budget:>7} {tokens / steps:>12.2f} {passes / steps:>18.1f} "
                f"{tokens / elapsed:>9.1f} {base_rate:>18.1f} "
                f"{tokens / elapsed / base_rate:>7.2f}x  {'yes' if exact else 'NO'}"
            )


if __name__ == "__main__":
    main()
