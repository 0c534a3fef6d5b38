"""A mixture of experts offloaded: the bytes a pass moves, and how many experts a tree touches.

    python -m scripts.bench_experts            # about a minute on a CPU; no weights are downloaded

offload.py streams each decoder layer whole, every expert with it. Whether streaming only the
experts a pass routes to would pay depends on how many a tree pass touches:

1. Bytes per pass, from the layouts offload.py would move for Mixtral-8x7B and Qwen3-30B-A3B
   as published (built on the meta device: shapes only), in bfloat16, int8 and int4.
2. Distinct experts per layer that the tokens of one pass route to, for passes of 1, 16 and 256
   tokens (a plain decoding step, and SpecExec trees: the root and the best `n - 1` nodes that
   `specexec.grow_tree` finds), on random models with the published expert counts and top-k
   (sizes scaled down), beside independent uniform routing: E (1 - (1 - k / E) ** n), and the
   share of a layer's bytes that streaming only those experts would move. The weights are
   random: the counts show what a tree's shape does (its tokens share prefixes, so they route
   alike), not what a trained router does.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import offload
import specexec
from specexec_tools import quantize

PUBLISHED = {  # config.json of each checkpoint, the fields that set a layer's bytes
    "Mixtral-8x7B": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    ),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8,
    ),
}  # fmt: skip
PASS_TOKENS = (1, 16, 256)


def layer_bytes(options: dict, kind: str | None) -> tuple[int, int]:
    """(all of a decoder layer, its experts alone): the bytes offload.py moves per layer."""
    options = dict(options)
    config = AutoConfig.for_model(options.pop("model_type"), **options)
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    stored = quantize.stored_layer(shapes, torch.bfloat16, kind)
    experts = {name: t for name, t in stored.items() if ".experts." in name}
    return offload.pack(stored).nbytes, offload.pack(experts).nbytes


def experts_touched(options: dict, n_tokens: int, prompts: int = 4) -> float:
    """Mean over layers and prompts of the distinct experts one pass of `n_tokens` routes to."""
    options = dict(options, hidden_size=64, intermediate_size=32, moe_intermediate_size=32)
    options |= dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    options |= dict(vocab_size=512, max_position_embeddings=512)
    config = AutoConfig.for_model(options.pop("model_type"), **options)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    routed = []  # per layer and prompt: the set of experts the pass chose
    counts = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: routed.append(out[2]))
             for layer in model.model.layers]  # fmt: skip
    for seed in range(prompts):
        prompt = torch.randint(512, (32,), generator=torch.Generator().manual_seed(seed)).tolist()
        target_cache = DynamicCache()
        opts = specexec.Options(budget=max(1, n_tokens - 1), max_depth=16, width=32, branch=8)
        with torch.no_grad():
            specexec.tree_forward(model, target_cache, prompt[:-1], specexec.chain(31))
            tree = specexec.grow_tree(specexec.Run(None, model, opts, limit=512), prompt)
            routed.clear()  # the draft passes above ran the same model: count the verification
            kept = tree.best()[: n_tokens - 1]
            specexec.verify(model, target_cache, prompt, tree, kept)  # root + kept tokens
        assert all(len(indices) == n_tokens for indices in routed)
        counts += [len(set(indices.flatten().tolist())) for indices in routed]
    for hook in hooks:
        hook.remove()
    return sum(counts) / len(counts)


def main() -> None:
    print("bytes one offloaded pass moves (every expert streamed with its layer):")
    for name, options in PUBLISHED.items():
        layers = options["num_hidden_layers"]
        for kind in (None, "int8", "int4"):
            total, experts = layer_bytes(options, kind)
            print(
                f"  {name:14} {kind or 'bfloat16':8} {total * layers / 1e9:6.2f} GB per pass, "
                f"experts {experts / total:.0%} of it ({total / 1e6:.0f} MB a layer)"
            )
    print("distinct experts per layer that one pass routes to (random weights):")
    for name, options in PUBLISHED.items():
        n_experts = options.get("num_local_experts") or options["num_experts"]
        top_k = options["num_experts_per_tok"]
        total, experts = layer_bytes(options, None)
        for n in PASS_TOKENS:
            uniform = n_experts * (1 - (1 - top_k / n_experts) ** n)
            touched = experts_touched(options, n)
            selective = (total - experts + experts * touched / n_experts) / total
            print(
                f"  {name:14} {n:4} tokens: {touched:6.1f} of {n_experts} "
                f"({touched / n_experts:4.0%}; uniform routing {uniform:6.1f}); streaming only "
                f"those would move {selective:.0%} of the bytes"
            )


if __name__ == "__main__":
    main()
