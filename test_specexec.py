"""Tests for specexec.py, each against an oracle: greedy target decoding, per-path forwards,
exact probabilities, a fresh forward pass.

The exactness tests run tiny random models in float64, so that no near-tie between two
logits can flip an argmax between a batched tree pass and a one-token pass (in float16
such a flip is possible, as with any batched decoding; see README).
"""

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specexec
from specexec import SpecExecError

HERE = Path(__file__).resolve().parent
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@functools.lru_cache(maxsize=None)
def tiny_model(family="llama", seed=0, vocab=64, layers=2, init=0.02, context=128):
    """A random float64 causal LM of the given family, small enough to run in milliseconds."""
    import transformers

    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    config = config_class(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=context,
        initializer_range=init,  # larger = peakier next-token distributions
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(torch.float64).eval()


def fresh_logits(model, tokens):
    """Oracle: last-position logits of a plain forward over `tokens`, no cache, no tree."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]  # (vocab,)


# ---- tree attention mask ----


@st.composite
def random_parents(draw, max_nodes=24):
    n = draw(st.integers(1, max_nodes))
    return [draw(st.integers(-1, i - 1)) for i in range(n)]


def ancestors(parents, i):
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain


@settings(max_examples=60, **SETTINGS)
@given(parents=random_parents(), n_cached=st.integers(0, 6))
def test_mask_sees_exactly_prefix_ancestors_and_self(parents, n_cached):
    mask, positions = specexec.tree_mask(parents, n_cached, torch.float32, "cpu")
    n = len(parents)
    assert mask.shape == (1, 1, n, n_cached + n) and mask.dtype == torch.float32
    for i in range(n):
        visible = set(range(n_cached)) | {n_cached + j for j in ancestors(parents, i)}
        assert set(torch.nonzero(mask[0, 0, i] == 0).flatten().tolist()) == visible
        assert (mask[0, 0, i] != 0).sum() == n_cached + n - len(visible)
        assert positions[0, i] == n_cached + len(ancestors(parents, i)) - 1
    assert set(mask.unique().tolist()) <= {0.0, torch.finfo(torch.float32).min}


@settings(max_examples=12, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES),
    prefix=st.lists(st.integers(0, 63), min_size=1, max_size=8),
    parents=random_parents(max_nodes=12),
    data=st.data(),
)
def test_tree_logits_equal_per_path_forwards(family, prefix, parents, data):
    """One tree-masked pass gives every node the logits of running its path on its own."""
    from transformers import DynamicCache

    model = tiny_model(family)
    tokens = data.draw(st.lists(st.integers(0, 63), min_size=len(parents), max_size=len(parents)))
    cache = DynamicCache()
    with torch.no_grad():
        specexec.forward(model, cache, prefix, specexec.chain(len(prefix)))
        tree_logits = specexec.forward(model, cache, tokens, parents)  # (n, vocab)
    for i in range(len(parents)):
        path = [tokens[j] for j in reversed(ancestors(parents, i))]
        expected = fresh_logits(model, prefix + path)
        torch.testing.assert_close(tree_logits[i], expected, rtol=1e-9, atol=1e-9)


# ---- draft tree ----


@settings(max_examples=25, **SETTINGS)
@given(
    seed=st.integers(0, 3),
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=10),
    budget=st.integers(1, 80),
    max_depth=st.integers(1, 8),
    width=st.integers(1, 16),
    branch=st.integers(1, 8),
)
def test_tree_is_best_budget_nodes_closed_under_ancestors(
    seed, prompt, budget, max_depth, width, branch
):
    from transformers import DynamicCache

    draft = tiny_model("llama", seed, init=0.3)
    opts = specexec.Options(budget=budget, max_depth=max_depth, width=width, branch=branch)
    stats = specexec.Stats()
    with torch.no_grad():
        tree = specexec.grow_tree(draft, DynamicCache(), prompt, opts, stats)
    kept = tree.best(budget)
    dropped = set(range(1, len(tree.tokens))) - set(kept)
    assert len(kept) <= budget
    assert stats.draft_passes <= max_depth
    for node in kept:
        assert tree.parents[node] == 0 or tree.parents[node] in kept  # closed under ancestors
        assert len(ancestors(tree.parents, node)) - 1 <= max_depth
        for other in dropped:
            assert tree.cum_logprob[node] >= tree.cum_logprob[other]
    # Each node's cum_logprob is its path's draft log-probability (oracle: fresh forwards).
    for node in kept[:5]:
        path = [tree.tokens[j] for j in reversed(ancestors(tree.parents, node))]
        logp = 0.0
        for depth in range(1, len(path)):
            logits = fresh_logits(draft, prompt + path[1:depth])
            logp += torch.log_softmax(logits, -1)[path[depth]].item()
        assert math.isclose(tree.cum_logprob[node], logp, rel_tol=1e-6, abs_tol=1e-6)


def test_tree_grows_best_first_until_budget_is_settled():
    """With room to spare, the search stops early once no candidate can enter the tree."""
    from transformers import DynamicCache

    draft = tiny_model("llama", 0, init=0.3)
    opts = specexec.Options(budget=4, max_depth=50, width=4, branch=4)
    stats = specexec.Stats()
    with torch.no_grad():
        specexec.grow_tree(draft, DynamicCache(), [1, 2, 3], opts, stats)
    assert stats.draft_passes < 50


# ---- exactness: SpecExec equals the target's own decoding ----


@settings(max_examples=25, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES),
    seeds=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12),
    budget=st.integers(1, 64),
    max_depth=st.integers(1, 8),
    width=st.integers(1, 16),
    branch=st.integers(1, 6),
    max_new_tokens=st.integers(1, 24),
)
def test_greedy_specexec_equals_greedy_target(
    family, seeds, prompt, budget, max_depth, width, branch, max_new_tokens
):
    target = tiny_model(family, seeds[0], init=0.3)
    draft = tiny_model(family, 10 + seeds[1], init=0.3)
    options = dict(budget=budget, max_depth=max_depth, width=width, branch=branch)
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, max_new_tokens=max_new_tokens)
        tokens, stats = specexec.generate(
            target, draft, prompt, max_new_tokens=max_new_tokens, **options
        )
    assert tokens == expected
    assert stats.new_tokens == len(tokens) == sum(stats.accepted)
    assert max(stats.tree_sizes) <= budget


def test_draft_equal_to_target_gains_more_tokens_per_step_with_budget():
    target = tiny_model("llama", 0, init=0.5)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, max_new_tokens=48)
        per_step = []
        for budget in (1, 4, 16, 64):
            tokens, stats = specexec.generate(
                target, target, prompt, max_new_tokens=48, budget=budget, max_depth=16
            )
            assert tokens == expected
            per_step.append(stats.tokens_per_step)
            if budget == 1:  # one child of the root fills the tree: no pass beyond the trunk
                assert stats.draft_passes == stats.steps
    assert per_step == sorted(per_step), per_step
    assert per_step[0] == pytest.approx(2.0, abs=0.1)  # budget 1: the node plus the bonus
    assert per_step[-1] > 4, per_step


def test_unrelated_draft_gains_almost_nothing_but_stays_exact():
    target = tiny_model("llama", 0, vocab=256, init=0.5)
    draft = tiny_model("llama", 1, vocab=256, init=0.5)
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, [7, 8, 9], max_new_tokens=30)
        tokens, stats = specexec.generate(target, draft, [7, 8, 9], max_new_tokens=30, budget=16)
    assert tokens == expected
    assert stats.tokens_per_step < 1.3


def test_stops_at_eos_and_at_the_context_limit():
    target = tiny_model("llama", 0, init=0.5, context=40)
    prompt = list(range(30))
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, max_new_tokens=100)
        tokens, _ = specexec.generate(target, target, prompt, max_new_tokens=100, budget=32)
        assert tokens == expected and len(prompt) + len(tokens) == 40
        eos = expected[4]
        first = expected.index(eos)
        tokens, _ = specexec.generate(
            target, target, prompt, max_new_tokens=100, budget=32, eos_token_id=eos
        )
    assert tokens == expected[: first + 1]


def test_callback_receives_every_token_in_order():
    target = tiny_model("llama", 0, init=0.5)
    received = []
    with torch.no_grad():
        tokens, stats = specexec.generate(
            target, target, [1, 2], max_new_tokens=20, budget=8, on_tokens=received.append
        )
    assert sum(received, []) == tokens and len(received) == stats.steps


# ---- sampling ----


@pytest.mark.parametrize(
    "temperature, top_p, top_k", [(0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 1.0, 5), (1.0, 0.9, 6)]
)
def test_sampling_with_a_seed_equals_the_target_alone(temperature, top_p, top_k):
    """Each emitted token costs one uniform draw, in both decoders, so a seed fixes the output."""
    target = tiny_model("qwen2", 0, init=0.3)
    draft = tiny_model("qwen2", 1, init=0.3)
    options = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=30)
    with torch.no_grad():
        for seed in range(3):
            expected, _ = specexec.autoregressive(target, [5, 6], seed=seed, **options)
            tokens, _ = specexec.generate(target, draft, [5, 6], seed=seed, budget=16, **options)
            assert tokens == expected


def reference_probs(logits, temperature, top_k, top_p):
    """Oracle written plainly: temperature, then keep the top-k, then the nucleus."""
    scaled = [x / temperature for x in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k else order
    total = sum(math.exp(scaled[i]) for i in keep)
    probs = {i: math.exp(scaled[i]) / total for i in keep}
    if top_p < 1:
        mass, nucleus = 0.0, []
        for i in keep:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        probs = {i: probs[i] / mass for i in nucleus}
    return probs


def chi_square_p_value(observed, expected):
    """Upper tail of chi-square (Wilson-Hilferty approximation), pooling tiny expected bins."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0.0, 0.0
    for o, e in zip(observed, expected):
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, dof = stat + (o - e) ** 2 / e, dof + 1
    if pooled_exp > 0:
        stat, dof = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, dof + 1
    assert dof >= 3, "too few bins for a meaningful test"
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(
    "temperature, top_p, top_k, same_draft",
    [(1.0, 1.0, 0, True), (0.8, 0.85, 0, False), (1.5, 1.0, 4, True)],
)
def test_sampled_frequencies_match_the_target_distribution(temperature, top_p, top_k, same_draft):
    """The first two sampled tokens follow the target's exact (filtered) joint distribution."""
    vocab, n = 6, 800
    target = tiny_model("llama", 0, vocab=vocab, init=0.2)
    draft = target if same_draft else tiny_model("llama", 1, vocab=vocab, init=0.2)
    prompt = [1, 2]
    joint = {}
    with torch.no_grad():
        first = reference_probs(fresh_logits(target, prompt), temperature, top_k, top_p)
        for a, p_a in first.items():
            second = reference_probs(fresh_logits(target, prompt + [a]), temperature, top_k, top_p)
            for b, p_b in second.items():
                joint[(a, b)] = p_a * p_b
        counts = {pair: 0 for pair in joint}
        for seed in range(n):
            tokens, _ = specexec.generate(
                target, draft, prompt, max_new_tokens=2, budget=8, max_depth=2,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            )  # fmt: skip
            assert tuple(tokens) in counts  # never a token the filters removed
            counts[tuple(tokens)] += 1
    assert len(joint) >= 6  # the filters leave several outcomes to tell apart
    pairs = sorted(joint)
    p_value = chi_square_p_value([counts[k] for k in pairs], [n * joint[k] for k in pairs])
    assert p_value > 1e-3, p_value


# ---- caches ----


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_caches_equal_a_fresh_forward(family):
    """After several steps both caches hold exactly seq[:-1]'s prefix: next logits match."""
    from transformers import DynamicCache

    target = tiny_model(family, 0, init=0.4)
    draft = tiny_model(family, 1, init=0.4)
    opts = specexec.Options(budget=24, max_depth=5, width=4, branch=3)
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    seq, stats, rng = [9, 8, 7, 6], specexec.Stats(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(6):
            seq += specexec.speculative_step(
                target, draft, target_cache, draft_cache, seq, opts, rng, stats, room=100
            )
            assert target_cache.get_seq_length() == len(seq) - 1
            assert draft_cache.get_seq_length() <= len(seq) - 1
        for model, cache in ((target, target_cache), (draft, draft_cache)):
            trunk = seq[cache.get_seq_length() :]
            logits = specexec.forward(model, cache, trunk, specexec.chain(len(trunk)))[-1]
            torch.testing.assert_close(logits, fresh_logits(model, seq), rtol=1e-9, atol=1e-9)


# ---- bad input ----


def test_bad_options_and_prompts_raise_clear_errors():
    target = tiny_model("llama", 0, context=16)
    for options, message in [
        (dict(budget=0), "budget must be at least 1"),
        (dict(max_depth=0), "max_depth must be at least 1"),
        (dict(top_p=0.0), "top_p"),
    ]:
        with pytest.raises(SpecExecError, match=message):
            specexec.generate(target, target, [1], **options)
    with pytest.raises(SpecExecError, match="empty"):
        specexec.generate(target, target, [])
    with pytest.raises(SpecExecError, match="the context holds 16"):
        specexec.generate(target, target, list(range(16)))


# ---- the project's own trained pair ----

PAIR = HERE / "models"
needs_pair = pytest.mark.skipif(
    not (PAIR / "target" / "config.json").exists(), reason="models/ not trained yet"
)


@needs_pair
def test_trained_pair_is_exact_and_speculates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float64).eval()
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", dtype=torch.float64).eval()
    prompts = json.loads((PAIR / "prompts.json").read_text())[:3]
    with torch.no_grad():
        for item in prompts:
            ids = tokenizer(item["prompt"])["input_ids"]
            expected, _ = specexec.autoregressive(target, ids, max_new_tokens=48)
            tokens, stats = specexec.generate(target, draft, ids, max_new_tokens=48, budget=64)
            assert tokens == expected
            assert stats.tokens_per_step > 1.5, stats.summary()


# ---- the notebook ----


@needs_pair
def test_notebook_runs_top_to_bottom():
    """notebook.ipynb runs on the project's pair from the repo root; its own asserts check it."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(HERE / "notebook.ipynb", as_version=4)  # executed here, not saved
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
    )
    client.execute()  # raises CellExecutionError at the first cell that fails
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code), "a code cell did not run"
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, errors
