"""Tests for specexec.py, each against an oracle: greedy target decoding, per-path forwards,
exact probabilities, a fresh forward pass.

The exactness tests run tiny random models (conftest.py) in float64, so that no near-tie
between two logits can flip an argmax between a batched tree pass and a one-token pass (in
float16 such a flip is possible, as with any batched decoding; see README).
"""

import copy
import json
import math
import os
import re
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specexec
from conftest import REAL_SHAPES, ancestors, cut_draft, real_model, tiny_model
from specexec import SpecExecError
from specexec_app import cli
from specexec_app.chat import Chat
from specexec_tools import cost_model, models
from specexec_tools.cost_model import CostModel, running_mean
from specexec_tools.models import CACHE, UnsupportedModel

HERE = Path(__file__).resolve().parent
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def fresh_logits(model, tokens):
    """Oracle: last-position logits of a plain forward over `tokens`, no cache, no tree."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]  # (vocab,)


def generate_steps(*args, **kwargs):
    """specexec.generate's (tokens, Stats), and every Step its loop took (as its policy sees)."""
    steps, step = [], specexec.speculative_step

    def recorded(*args):
        steps.append(step(*args))
        return steps[-1]

    with mock.patch.object(specexec, "speculative_step", recorded):
        tokens, stats = specexec.generate(*args, **kwargs)
    return tokens, stats, steps


def looked_up(steps, stats):
    """Tokens emitted from lookup's nodes (a step's path, up to what was kept of it)."""
    kept = zip(steps, stats.emitted)
    return sum(node in step.tree.looked_up for step, n in kept for node in step.path[:n])


# ---- tree attention mask ----


@st.composite
def random_parents(draw, max_nodes=24):
    n = draw(st.integers(1, max_nodes))
    return [draw(st.integers(-1, i - 1)) for i in range(n)]


@settings(max_examples=60, **SETTINGS)
@given(
    parents=random_parents(),
    n_prefix=st.integers(0, 6),
    window=st.sampled_from([None, 1, 3, 8]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
)
def test_tree_mask_equals_the_reference_built_one_token_at_a_time(parents, n_prefix, window, dtype):
    fast = specexec.tree_mask(parents, n_prefix, dtype, "cpu", window)
    plain = specexec.tree_mask_reference(parents, n_prefix, dtype, "cpu", window)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(fast, plain))


@settings(max_examples=60, **SETTINGS)
@given(parents=random_parents(), n_prefix=st.integers(0, 6))
def test_mask_sees_exactly_prefix_ancestors_and_self(parents, n_prefix):
    """The reference mask (and so the fast one, above) against the definition: ancestors."""
    mask, positions = specexec.tree_mask_reference(parents, n_prefix, torch.float32, "cpu")
    n = len(parents)
    assert mask.shape == (1, 1, n, n_prefix + n) and mask.dtype == torch.float32
    for i in range(n):
        visible = set(range(n_prefix)) | {n_prefix + j for j in ancestors(parents, i)}
        assert set(torch.nonzero(mask[0, 0, i] == 0).flatten().tolist()) == visible
        assert (mask[0, 0, i] != 0).sum() == n_prefix + n - len(visible)
        assert positions[0, i] == n_prefix + len(ancestors(parents, i)) - 1
    assert set(mask.unique().tolist()) <= {0.0, torch.finfo(torch.float32).min}


@settings(max_examples=40, **SETTINGS)
@given(
    parents=random_parents(),
    n_prefix=st.integers(0, 6),
    window=st.sampled_from([None, 1, 3, 8]),
    data=st.data(),
)
def test_mask_of_the_new_rows_is_the_last_rows_of_the_whole_mask(parents, n_prefix, window, data):
    """A draft pass feeds a few nodes below a tree already in its cache: their rows alone.

    Oracle: the last `n_new` rows of the mask of every node (checked above, path by path).
    """
    n_new = data.draw(st.integers(1, len(parents)))
    whole, whole_positions = specexec.tree_mask(parents, n_prefix, torch.float32, "cpu", window)
    rows, positions = specexec.tree_mask(parents, n_prefix, torch.float32, "cpu", window, n_new)
    assert torch.equal(rows, whole[:, :, -n_new:])
    assert torch.equal(positions, whole_positions[:, -n_new:])


@settings(max_examples=12, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES),
    prefix=st.lists(st.integers(0, 63), min_size=1, max_size=8),
    parents=random_parents(max_nodes=12),
    data=st.data(),
)
def test_tree_logits_equal_per_path_forwards(family, prefix, parents, data):
    """One tree-masked pass gives every node the logits of running its path on its own."""
    tokens = data.draw(st.lists(st.integers(0, 63), min_size=len(parents), max_size=len(parents)))
    check_tree_logits(tiny_model(family), prefix, tokens, parents)


def check_tree_logits(model, prefix, tokens, parents):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        windows = models.attention_windows(model)
        specexec.tree_forward(model, cache, windows, prefix, specexec.chain(len(prefix)))
        tree_logits = specexec.tree_forward(model, cache, windows, tokens, parents)  # (n, vocab)
    for i in range(len(parents)):
        path = [tokens[j] for j in reversed(ancestors(parents, i))]
        expected = fresh_logits(model, prefix + path)
        torch.testing.assert_close(tree_logits[i], expected, **tolerance(model))


# ---- draft tree ----


@settings(max_examples=25, **SETTINGS)
@given(
    seed=st.integers(0, 3),
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=10),
    budget=st.integers(1, 80),
    max_depth=st.integers(1, 8),
    width=st.integers(1, 16),
    branch=st.integers(1, 8),
    draft_temperature=st.sampled_from([None, 0.5, 1.0]),
)
def test_tree_is_best_budget_nodes_closed_under_ancestors(
    seed, prompt, budget, max_depth, width, branch, draft_temperature
):

    draft = tiny_model("llama", seed, init=0.3)
    opts = specexec.Options(
        budget=budget,
        max_depth=max_depth,
        width=width,
        branch=branch,
        draft_temperature=draft_temperature,
    )
    run = specexec.Run(target=draft, draft=draft, opts=opts, limit=128)
    with torch.no_grad():
        tree = specexec.grow_tree(run, prompt, budget, max_depth, width, branch)
    kept = tree.best()
    dropped = set(range(1, len(tree.tokens))) - set(kept)
    assert len(kept) <= budget
    assert tree.draft_passes <= max_depth
    for node in [0, *tree.expanded]:  # all its children stay, those that could not enter too:
        assert tree.parents.count(node) == branch  # auto counts every child the draft proposed
    for node in kept:
        assert tree.parents[node] == 0 or tree.parents[node] in kept  # closed under ancestors
        assert len(ancestors(tree.parents, node)) - 1 <= max_depth
        for other in dropped:
            assert tree.cum_logprob[node] >= tree.cum_logprob[other]
    # Each node's cum_logprob is its path's draft log-probability (oracle: fresh forwards), at
    # the draft temperature: the given one, or 0.3 when decoding greedily.
    temperature = 0.3 if draft_temperature is None else draft_temperature
    for node in kept[:5]:
        path = [tree.tokens[j] for j in reversed(ancestors(tree.parents, node))]
        logp = 0.0
        for depth in range(1, len(path)):
            logits = fresh_logits(draft, prompt + path[1:depth])
            logp += torch.log_softmax(logits / temperature, -1)[path[depth]].item()
        assert math.isclose(tree.cum_logprob[node], logp, rel_tol=1e-6, abs_tol=1e-6)


def test_tree_grows_best_first_until_budget_is_settled():
    """With room to spare, the search stops early once no candidate can enter the tree."""
    draft = tiny_model("llama", 0, init=0.3)
    opts = specexec.Options(budget=4, max_depth=50, width=4, branch=4)
    run = specexec.Run(target=draft, draft=draft, opts=opts, limit=128)
    with torch.no_grad():
        tree = specexec.grow_tree(run, [1, 2, 3], opts.budget, opts.max_depth, 4, 4)
    assert tree.draft_passes < 50


@pytest.mark.parametrize("budget", [1, 5, 17, 40])
def test_tree_is_the_best_budget_of_the_whole_search_space(budget):
    """With width >= budget, the pruned best-first search keeps exactly the `budget` most
    probable nodes of the full tree (every node's `branch` best children, to `max_depth`),
    enumerated here node by node with fresh forwards: nothing it skipped could have entered."""
    draft, prompt = tiny_model("llama", 1, init=0.3), [5, 6, 7]
    opts = specexec.Options(budget=budget, max_depth=4, width=budget, branch=3)
    with torch.no_grad():
        run = specexec.Run(draft, draft, opts, limit=128)
        tree = specexec.grow_tree(run, prompt, budget, opts.max_depth, opts.width, opts.branch)
    paths = {}  # token path from the root -> cum_logprob, for every node of the full tree
    frontier = [((), 0.0)]
    for _ in range(opts.max_depth):
        grown = []
        for path, logp in frontier:
            logits = fresh_logits(draft, prompt + list(path)).float()  # (vocab,)
            top = torch.log_softmax(
                logits / (opts.draft_temperature or opts.temperature or 0.3), -1
            ).topk(opts.branch)
            grown += [
                (path + (t,), logp + v) for v, t in zip(top.values.tolist(), top.indices.tolist())
            ]
        paths.update(grown)
        frontier = grown
    expected = sorted(paths, key=paths.get, reverse=True)[:budget]

    def path_of(node):
        return tuple(tree.tokens[i] for i in reversed(ancestors(tree.parents, node)[:-1]))

    assert sorted(path_of(node) for node in tree.best()) == sorted(expected)


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
        tokens, stats, steps = generate_steps(
            target, draft, prompt, max_new_tokens=max_new_tokens, **options
        )
    assert tokens == expected
    assert stats.new_tokens == len(tokens) == sum(stats.emitted)
    assert max(len(step.tree.best()) for step in steps) <= budget


def test_draft_equal_to_target_gains_more_tokens_per_step_with_budget():
    target = tiny_model("llama", 0, init=0.5)
    prompt, no_eos = [3, 1, 4, 1, 5], dict(max_new_tokens=48, eos_token_id=[])  # all 48 tokens
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, **no_eos)
        per_step = []
        for budget in (1, 4, 16, 64):
            tokens, stats = specexec.generate(
                target, target, prompt, budget=budget, max_depth=16, **no_eos
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
        expected, _ = specexec.autoregressive(target, [7, 8, 9], max_new_tokens=30, eos_token_id=[])
        tokens, stats = specexec.generate(
            target, draft, [7, 8, 9], max_new_tokens=30, budget=16, eos_token_id=[]
        )
    assert tokens == expected
    assert stats.tokens_per_step < 1.3


def test_no_pass_computes_logits_that_nobody_reads():
    """A prompt's pass, the target's or the draft's, yields the last position's logits only, a
    verification those of the root and the tree's nodes: the head over a long prompt costs as
    much as a few layers (a 49k-token vocabulary) and its logits hundreds of MB."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1, layers=1)
    rows = {target: [], draft: []}  # the logits' rows of each pass

    def record(model, args, kwargs, out):
        rows[model].append(out.logits.shape[1])  # (1, rows, vocab)

    hooks = [model.register_forward_hook(record, with_kwargs=True) for model in rows]
    try:
        prompt = list(range(1, 41))
        specexec.generate(target, draft, prompt, max_new_tokens=8, budget=4, eos_token_id=[])
        assert rows[draft][0] == 1  # the draft's pass over the prompt
        assert max(rows[target]) <= 1 + 4  # the root and at most 4 nodes (the prompt's pass too)
        rows[target].clear()
        specexec.autoregressive(target, prompt, max_new_tokens=3, eos_token_id=[])
        assert rows[target] == [1, 1, 1]
    finally:
        for hook in hooks:
            hook.remove()


def test_stops_at_eos_and_at_the_context_limit():
    target = tiny_model("llama", 0, init=0.5, context=40)
    prompt, no_eos = list(range(30)), dict(max_new_tokens=100, eos_token_id=[])
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, **no_eos)
        tokens, _ = specexec.generate(target, target, prompt, budget=32, **no_eos)
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


# ---- budget "auto": the cost model ----


@settings(max_examples=10, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES),
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12),
    max_new_tokens=st.integers(1, 40),
)
def test_auto_budget_equals_greedy_target(family, prompt, max_new_tokens):
    """Whatever auto chooses each step (plain decoding included), the output is the target's."""
    target, draft = tiny_model(family, 0, init=0.3), tiny_model(family, 11, init=0.3)
    options = dict(max_new_tokens=max_new_tokens, eos_token_id=[])
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, **options)
        tokens, stats = specexec.generate(target, draft, prompt, budget="auto", **options)
    assert tokens == expected
    assert len(stats.budgets) == stats.steps and isinstance(stats.policy, CostModel)
    allowed = {0, *CostModel.BUDGETS, CostModel.budget}
    assert {budget for budget, _ in stats.budgets} <= allowed


@settings(max_examples=40, **SETTINGS)
@given(parents=random_parents(max_nodes=12), n_prefix=st.integers(0, 5), data=st.data())
def test_keep_path_keeps_the_prefix_and_the_path_in_order(parents, n_prefix, data):
    """Oracle: the entries of the prefix and of the path's nodes, picked one by one."""
    from transformers import DynamicCache

    nodes = list(range(1, len(parents) + 1))  # tree nodes 1..n, as their entries lie
    leaf = data.draw(st.sampled_from(nodes))
    path = [node + 1 for node in reversed(ancestors(parents, leaf - 1))]  # root-side first
    cache, n = DynamicCache(), n_prefix + len(nodes)
    for layer in range(2):
        keys, values = torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)  # (1, heads, n, dim)
        cache.update(keys, values, layer)
    entries = list(range(n_prefix)) + [n_prefix + node - 1 for node in path]
    expected = [(layer.keys[:, :, entries], layer.values[:, :, entries]) for layer in cache.layers]
    specexec.keep_path(cache, nodes, path)
    assert cache.get_seq_length() == n_prefix + len(path)
    for layer, (keys, values) in zip(cache.layers, expected):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@pytest.mark.parametrize(
    "places, moved",
    [
        (None, False),  # a model in memory: no device map
        ({"": "cpu"}, False),
        ({"": 0}, False),
        ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu"}, True),
        ({"model.layers.0": "cpu", "model.layers.1": "disk"}, True),
    ],
)
def test_streams_reads_accelerates_device_map(places, moved):
    """A Hugging Face model streams where accelerate put layers on disk, or in host memory
    beside a GPU (auto's rule for a copy of the target hangs on it)."""
    model = types.SimpleNamespace(**({} if places is None else {"hf_device_map": places}))
    assert cost_model.streams(model) == moved


@pytest.mark.parametrize("streamed, first", [(True, (32, 4)), (False, (8, 2))])
def test_auto_starts_with_a_big_tree_only_where_the_target_streams(streamed, first):
    """Auto's first tree, chosen before anything is measured: as big as a streamed pass carries
    (its weights' transfer costs what one token's pass does); a small one where the weights stay
    put and a tree's pass costs compute. A run's first step is that tree."""
    config = types.SimpleNamespace(hidden_size=8, num_hidden_layers=2, vocab_size=64)
    target = types.SimpleNamespace(streams=streamed, config=config)
    policy = cost_model.make_policy(specexec.Options(max_depth=16), target, target)
    assert isinstance(policy, CostModel) and policy.choose() == first
    if not streamed:  # a model in memory: the tests' tiny pair, through generate, a run long
        target, draft = tiny_model("llama", 0), tiny_model("llama", 1)  # enough to look
        with torch.no_grad():
            _, stats = specexec.generate(target, draft, [5, 6], max_new_tokens=48, budget="auto")
        assert stats.budgets[0] == first


def test_auto_takes_no_first_tree_a_dear_draft_could_not_pay_back():
    """The first tree is a look at the draft too, its passes priced by the weights they read
    (before any is timed): a draft as big as the target, in memory, over 24 tokens, is never
    tried (0.88x plain decoding when it was: docs/results.md); over a longer run it is, and a
    streamed target's first tree is always taken (its passes move the weights)."""
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)  # the same size: share 1
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, [5, 6], max_new_tokens=24, eos_token_id=[])
        tokens, stats = specexec.generate(
            target, draft, [5, 6], max_new_tokens=24, budget="auto", eos_token_id=[]
        )
    assert tokens == expected and stats.budgets == [(0, 0)] * 24 and stats.draft_passes == 0
    assert "a draft pass costs 100% of a target's, too dear for so short a run" in cli.summary(
        stats
    )
    cost = CostModel(max_depth=16, budget=8, first_depth=2, draft_share=1.0)
    assert cost.choose(left=40) == (8, 2)  # 20 looks' worth: 2 draft passes x 20 = 40 steps
    cost = CostModel(max_depth=16, budget=8, first_depth=2, draft_share=1.0)
    assert cost.choose(left=39) == (0, 0)
    streamed = types.SimpleNamespace(streams=True, config=target.config)
    assert cost_model.make_policy(specexec.Options(), streamed, draft).draft_share == 0
    assert cost_model.make_policy(specexec.Options(), target, draft).draft_share == 1


def test_auto_budget_sampling_with_a_seed_equals_the_target_alone():
    target, draft = tiny_model("qwen2", 0, init=0.3), tiny_model("qwen2", 1, init=0.3)
    options = dict(temperature=0.8, top_p=0.9, max_new_tokens=40, eos_token_id=[])
    with torch.no_grad():
        for seed in range(3):
            expected, _ = specexec.autoregressive(target, [5, 6], seed=seed, **options)
            tokens, _ = specexec.generate(
                target, draft, [5, 6], seed=seed, budget="auto", **options
            )
            assert tokens == expected


def chain_tree(n, logprob):
    """A hand-made draft tree: a chain of n nodes, each `logprob` below its parent, all of them
    verified."""
    tree = specexec.DraftTree(
        tokens=list(range(n + 1)),
        parents=[-1, *range(n)],
        cum_logprob=[logprob * depth for depth in range(n + 1)],
        depth=list(range(n + 1)),
        budget=n,
    )
    for node in range(1, n + 1):
        tree.admit(node)
    return tree


def test_cost_model_lines_through_the_sizes_it_ran():
    cost = CostModel(max_depth=16, target_s={5: 2.0})
    assert cost.t_target(1) == cost.t_target(50) == 2.0  # one size: flat
    cost.target_s = {1: 1.0, 11: 2.0, 21: 2.5}
    assert cost.t_target(6) == pytest.approx(1.5)  # between two sizes
    assert cost.t_target(31) == pytest.approx(3.0)  # beyond: the line through the last two
    assert cost.t_target(0) == pytest.approx(0.9)  # below: the line through the first two
    cost.target_s = {1: 1.0, 5: 3.0, 9: 2.0}  # 5 tokens measured in a busy moment
    assert cost.t_target(5) == 2.0 and cost.t_target(3) == pytest.approx(1.5)  # as 9 tokens


def test_a_streamed_pass_between_two_sizes_costs_the_link_until_its_compute_outlasts_it():
    """A streamed target (its compute known at each size: `busy_s`): between two sizes, a pass
    costs the longer of the smaller size's pass and the compute on the line between the two
    sizes' computes. On the line between the passes themselves, the first step's pass over the
    prompt and a 2,048-node tree (3.5 s of compute) made a tree of 1,024 cost 2.46 s against
    2.0 s, and auto never tried it (on the simulated link, 11-29)."""
    cost = CostModel(max_depth=32, target_s={1: 2.0, 513: 2.0, 2193: 3.5})
    cost.busy_s = {1: 0.001, 513: 0.4, 2193: 3.5}
    assert cost.t_target(1025) == pytest.approx(2.0)  # compute there: 1.34 s, under the link's
    assert cost.t_target(2000) == pytest.approx(0.4 + 3.1 * 1487 / 1680)  # the compute's
    assert cost.t_target(257) == pytest.approx(2.0)
    cost.busy_s = {}  # in memory: the line between the passes
    assert cost.t_target(1025) == pytest.approx(2.0 + 1.5 * 512 / 1680)


@pytest.mark.parametrize(
    "target_s, draft_s, chosen",
    [
        # streamed weights: a pass over 33 tokens costs what one token's does, drafting is cheap
        ({1: 1.0, 33: 1.003}, 0.001, (32, 32)),
        # in memory with a dear draft: each draft pass costs more than a target token
        ({1: 0.01, 33: 0.5}, 0.05, (0, 0)),
    ],
)
def test_cost_model_chooses_the_most_tokens_per_second(target_s, draft_s, chosen):
    """E[tokens](b, d) / (d * t_draft + t_target(b + 1) + t_other), with a sure chain of 32
    (every node's draft path probability near 1, nothing observed yet: the prior's rates)."""
    cost = CostModel(max_depth=32, target_s=target_s, draft_s=draft_s, largest=32)
    cost.gains = cost.tree_gains(chain_tree(32, logprob=-0.001), max_depth=32)
    # A chain's b best nodes no deeper than d: b <= d; and a depth beyond b buys nothing: b == d
    assert set(cost.gains) == {(b, b) for b in cost.BUDGETS if b in cost.DEPTHS and b <= 32}
    rates = cost.rates()
    assert max(rates, key=rates.get) == chosen
    gain = 1 + sum(math.exp(-0.001 * depth) for depth in range(1, 17))
    assert rates[(16, 16)] == pytest.approx(gain / (16 * draft_s + cost.t_target(17)))
    assert cost.choose() == chosen


def test_cost_model_grows_trees_once_two_sizes_are_measured_and_searches_deeper():
    cost = CostModel(max_depth=32, target_s={171: 0.03}, draft_s=0.001, largest=8)
    cost.gains = cost.tree_gains(chain_tree(64, logprob=-0.001), max_depth=32)
    assert max(b for b, _ in cost.rates()) == 8  # the prompt's pass alone: all sizes cost alike
    cost.target_s[9] = 0.01
    assert max(b for b, _ in cost.rates()) == 32  # a line: up to GROWTH x the largest run
    # A dear draft (2 more passes cost more than 1 / LOOK_EVERY of the 1.4 s step): one depth
    # deeper every DEEPEN_EVERY tree steps whose best nodes reach the depth limit
    cost = CostModel(max_depth=16, target_s={1: 1.0, 9: 1.0}, draft_s=0.1, largest=8)
    cost.gains, cost.tree_steps = {(8, 4): (3.0, 4)}, 4
    assert cost.choose() == (8, 6)  # the next of DEPTHS
    cost.tree_steps = 5
    assert cost.choose() == (8, 4)
    # A cheap draft (a streamed target's: 1.04 s steps, 0.01 s passes): as deep as 1 /
    # LOOK_EVERY of the step buys, at once (5 passes: 8, not 12), never deeper than b
    cost.draft_s = 0.01
    assert cost.choose() == (8, 8)
    cost.gains = {(16, 4): (3.0, 4)}
    assert cost.choose() == (16, 8)
    cost.gains = {(16, 4): (3.0, 2.5)}  # its best nodes stop short of the limit: no deeper
    assert cost.choose() == (16, 4)
    cost.gains, cost.tree_steps = {(4, 4): (3.0, 4)}, 4  # 4 nodes are never deeper than 4
    assert cost.choose() == (4, 4)
    cost = CostModel(max_depth=5, target_s={1: 1.0, 9: 1.0}, draft_s=0.01, largest=8)
    cost.gains = {(8, 4): (3.0, 4)}
    assert cost.choose() == (8, 5)  # max_depth, though not one of DEPTHS


@settings(max_examples=40, **SETTINGS)
@given(
    parents=random_parents(max_nodes=60),
    max_depth=st.sampled_from([1, 3, 8, 16]),
    data=st.data(),
)
def test_tree_gains_are_a_plain_walk_over_the_best_nodes(parents, max_depth, data):
    """Oracle: for each depth d, walk the nodes no deeper than d best first (DraftTree.rank),
    adding the chance of reaching each (follow_rate of each edge on its path, multiplied one by
    one up from the node); at each b in BUDGETS note the sum and the deepest node."""
    steps = st.sampled_from([0.0, -0.5, -1.0, -0.3, -2.25])  # ties, and bins' edges
    logprobs = data.draw(st.lists(steps, min_size=len(parents), max_size=len(parents)))
    cum, depth = [0.0], [0]
    for parent, logprob in zip(parents, logprobs):  # node i + 1's parent is node parent + 1
        cum.append(cum[parent + 1] + logprob)
        depth.append(depth[parent + 1] + 1)
    tree = specexec.DraftTree(
        list(range(len(cum))), [-1] + [p + 1 for p in parents], cum, depth, budget=len(parents)
    )
    cost = CostModel(max_depth=max_depth)
    cost.seen = data.draw(st.lists(st.integers(0, 9), min_size=48, max_size=48))
    cost.followed = [data.draw(st.integers(0, seen)) for seen in cost.seen]

    def reach(node):
        chance = 1.0
        while node > 0:
            parent = tree.parents[node]
            chance *= cost.follow_rate(cum[node] - cum[parent])
            node = parent
        return chance

    expected = {}
    for d in (d for d in cost.DEPTHS if d <= max_depth):
        gain, deepest, b = 1.0, 0, 0
        for node in sorted(range(1, len(cum)), key=tree.rank):
            if depth[node] <= d:
                b, gain = b + 1, gain + reach(node)
                deepest = max(deepest, depth[node])
                if b in cost.BUDGETS and d <= b:  # b nodes are never deeper than b
                    expected[(b, d)] = (gain, deepest)
    gains = cost.tree_gains(tree, max_depth)
    assert gains.keys() == expected.keys()
    for key, (gain, deepest) in expected.items():
        assert gains[key] == (pytest.approx(gain, rel=1e-12), deepest)


def test_cost_model_looks_at_the_draft_again_after_plain_steps_worth_many_lost_looks():
    """Plain decoding chosen: a tree step comes again once plain steps in a row have taken
    LOOK_EVERY times the most that look can lose (a tree step's seconds less a plain step's:
    it gives the bonus at least), and each look doubles the wait for the next until a tree step
    beats a plain one, so looking is a small share of the time however wrong the draft; and none
    where the plain steps still to come would take less than LOOK_EVERY lost looks. The first
    look comes at once after the first tree, whose draft passes were timed with the prompt."""
    cost = CostModel(max_depth=8, target_s={1: 0.01, 9: 0.5}, draft_s=0.1, largest=8, tree_steps=1)
    cost.gains = {(8, 4): (3.0, 4)}  # a tree step: 4 draft passes + a pass over 9 = 0.9 s
    lost = 0.9 - 0.01  # the most a look can lose
    assert cost.seconds((8, 4), 4) - cost.seconds((0, 0), 0) == pytest.approx(lost)
    left = cost.LOOK_EVERY * lost / 0.01  # plain steps (0.01 s) worth LOOK_EVERY lost looks
    assert cost.choose(left=int(left) - 1) == (0, 0)  # too few still to come: no look
    assert cost.choose() == (8, 4) and cost.looks == 1  # after the first tree: at once
    cost.tree_steps, cost.looks = 2, 0  # the draft's passes timed without the prompt
    assert cost.choose() == (0, 0)  # 3 tokens in 0.9 s; plain decoding 1 in 0.01 s
    cost.plain_s = cost.LOOK_EVERY * lost * 0.99
    assert cost.choose() == (0, 0)
    cost.plain_s = cost.LOOK_EVERY * lost * 1.01
    assert cost.choose() == (8, 4) and cost.looks == 1
    cost.plain_s = 1.01 * cost.LOOK_EVERY * lost  # after that look, plain steps again:
    assert cost.choose() == (0, 0)  # the next look waits twice as long
    cost.plain_s = 2.01 * cost.LOOK_EVERY * lost
    assert cost.choose() == (8, 4) and cost.looks == 2
    cost.plain_s = 4.01 * cost.LOOK_EVERY * lost
    assert cost.choose(left=int(left) - 1) == (0, 0)  # too few still to come: no look
    assert cost.choose(left=int(left) + 1) == (8, 4) and cost.looks == 3
    cost.draft_s, cost.target_s[9] = 0.001, 0.005  # trees would pay: one is chosen,
    assert cost.choose() == (8, 4) and cost.looks == 3  # not a look; no wait starts over yet
    observe(cost, (8, 4), 9, 0.004, 0.005, 4, chain_tree(8, -0.1), [1, 2])  # 3 tokens, 9 ms
    assert cost.looks == 0  # a tree step beat a plain one: the waits start over


def test_cost_model_measures_a_second_size_with_a_plain_step_unless_the_target_streams():
    """One size measured (the prompt's pass): where that pass outlasts STREAMED draft passes the
    target streams its weights and the first tree stays; otherwise a plain step measures a
    pass over one token, as plain decoding would run it (so a dear draft costs one tree)."""
    cost = CostModel(max_depth=16, target_s={200: 1.0}, draft_s=0.001, largest=32, steps=1)
    cost.gains = cost.tree_gains(chain_tree(32, logprob=-0.001), max_depth=16)
    assert cost.choose() == (16, 16)  # the chain's most tokens at equal cost, as deep as it goes
    cost.draft_s = 2.0 / cost.STREAMED  # a draft pass is a 50th of the target's
    assert cost.choose() == (0, 0)
    cost.target_s[1] = 0.1  # the plain step drew the line: choose by the rates again
    assert cost.choose()[0] > 0


def observe(cost, choice, n_fed, draft_s, target_s, passes, tree, path, bonus=99):
    """A step of `choice` that took draft_s + target_s seconds, as speculative_step reports it."""
    tokens = [tree.tokens[node] for node in path] + [bonus]
    tree.draft_passes = passes
    step = specexec.Step(tokens, *choice, n_fed, tree, path, draft_s, target_s)
    step.total_s = draft_s + target_s
    cost.update(step)


def test_cost_model_learns_from_what_the_target_followed():
    cost = CostModel(max_depth=16)
    assert cost.choose() == (cost.budget, cost.first_depth)  # nothing measured: the first step'
    # A chain of 4 whose every edge has draft log-probability -1 (bin 4, in quarter nats). The
    # target walks to nodes 1 and 2, then picks the bonus: at the root, 1 and 2 it saw one child
    # each and picked two of them; node 3's child was never reached, so it says nothing.
    tree = chain_tree(4, logprob=-1.0)
    observe(cost, (8, 8), 100, 0.08, 9.0, 4, tree, path=[1, 2])
    assert cost.target_s == {100: 9.0}  # the first pass reads the prompt: a big pass's cost,
    assert cost.step_s == {}  # but not a step's
    observe(cost, (4, 4), 5, 0.04, 1.0, 4, tree, path=[1, 2])
    assert cost.target_s == {100: 9.0, 5: 1.0}
    assert cost.draft_s == pytest.approx(0.01)  # per pass: the first tree's read the prompt
    assert cost.step_s[(4, 4)] == pytest.approx(1.04, abs=1e-3)
    assert (cost.seen[4], cost.followed[4]) == (6, 4) and sum(cost.seen) == 6
    prior = cost.PRIOR  # children picked at the draft's probability
    assert cost.follow_rate(-1.0) == pytest.approx((4 + prior * math.exp(-1)) / (6 + prior))
    assert cost.follow_rate(-3.0) == pytest.approx(math.exp(-3))  # nothing seen: the prior
    gain, passes = cost.gains[(4, 4)]
    rate = cost.follow_rate(-1.0)  # to reach depth k: k edges in a row
    assert passes == 4 and gain == pytest.approx(1 + sum(rate**k for k in range(1, 5)), rel=0.2)


def test_cost_model_charges_what_steps_took_and_scales_what_it_predicts():
    """A (budget, max_depth) that ran is charged the seconds its steps took; one that did not, its
    parts, scaled by how far the parts fell short of whole steps."""
    cost = CostModel(max_depth=8, target_s={1: 1.0, 65: 3.0}, draft_s=0.1, steps=1, largest=8)
    tree = chain_tree(8, logprob=-0.1)
    cost.gains = cost.tree_gains(tree, max_depth=8)
    observe(cost, (4, 4), 5, 0.8, 2.0, 4, tree, path=[1, 2])  # 2.8 s
    assert cost.seconds((4, 4), 4) == pytest.approx(2.8, abs=1e-3)  # as it ran
    parts = 4 * 0.1 + 2.0  # 4 draft passes as predicted, the target pass as measured
    assert cost.time_scale == pytest.approx(running_mean(1.0, 2.8 / parts), rel=1e-3)
    unrun = cost.seconds((8, 8), 8)
    assert unrun == pytest.approx(cost.time_scale * cost.from_parts(8, 8))
    rates = cost.rates()
    for choice, seconds in (((8, 8), unrun), ((4, 4), cost.seconds((4, 4), 4))):
        assert rates[choice] == pytest.approx(cost.rate_scale * cost.gains[choice][0] / seconds)


def test_cost_model_holds_tree_steps_against_what_they_were_promised():
    """A tree step chosen for its predicted (tokens, seconds) is held against them, one chosen
    before its gains were seen against what its draft's probabilities expected, in the time
    it took; every tree's predicted tokens/s is scaled by the ratio (PRIOR_TOKENS given as
    promised), and plain decoding's is not."""
    cost = CostModel(max_depth=8, target_s={1: 1.0, 65: 3.0}, draft_s=0.1, steps=1, largest=8)
    tree = chain_tree(8, logprob=-0.1)
    assert cost.rate_scale == 1.0
    observe(cost, (8, 8), 9, 0.8, 2.0, 8, tree, path=[1, 2])  # no promise: the first tree
    # Its 8 nodes were expected to give sum(0.905 ** k) tokens beyond the bonus (the draft's
    # own probabilities: nothing was seen before), and it gave 2 and the bonus, in 2.8 s
    expected = 1 + sum(math.exp(-0.1 * k) for k in range(1, 9))
    prior = cost.PRIOR_TOKENS
    assert cost.given == pytest.approx((3, 2.8)) and cost.promised == pytest.approx((expected, 2.8))
    assert cost.rate_scale == pytest.approx((3 + prior) / (expected + prior))
    choice = cost.choose()
    assert choice[0] and cost.promise == pytest.approx(
        (cost.gains[choice][0], cost.seconds(choice, cost.gains[choice][1]))
    )
    promise = cost.promise
    observe(cost, choice, choice[0] + 1, 0.5, 3.0, choice[1], tree, path=[])  # 1 token, 3.5 s
    assert cost.promise is None
    given, promised = (3 + 1, 2.8 + 3.5), (expected + promise[0], 2.8 + promise[1])
    assert cost.rate_scale == pytest.approx(
        (given[0] + prior) / (promised[0] + prior) * promised[1] / given[1]
    )
    rates = cost.rates()
    assert rates[(0, 0)] == pytest.approx(1 / cost.seconds((0, 0), 0))
    for key in rates.keys() - {(0, 0)}:
        gain, passes = cost.gains[key]
        assert rates[key] == pytest.approx(cost.rate_scale * gain / cost.seconds(key, passes))
    plain = specexec.Step([7], 0, 0, 1, None, [], target_s=1.0, total_s=1.0)
    cost.update(plain)
    assert cost.given == pytest.approx(given)  # plain steps promise nothing


def test_cost_model_update_reads_each_edge_a_bounded_number_of_times(monkeypatch):
    """Auto's own time is time plain decoding does not spend: an update walks the tree's edges
    a few times (the reach before the step taught anything, the gains after), never once per
    node for each node."""
    cost, calls = CostModel(max_depth=16), []
    real = cost.follow_rate
    monkeypatch.setattr(cost, "follow_rate", lambda logprob: calls.append(1) or real(logprob))
    tree = chain_tree(64, logprob=-0.1)
    observe(cost, (64, 16), 65, 0.1, 1.0, 16, tree, path=[1, 2])  # no promise: reach is read
    assert 0 < len(calls) <= 2 * 64


def simulate(cost, n_tokens, followed, draft_s, pass_s, prompt=100, ahead_s=0.0):
    """Run `cost` as the loop would, on made-up steps: each tree a sure chain as long as its
    depth, of which the target follows the first `followed` nodes; a target pass over n tokens
    takes pass_s(n) seconds, a draft pass draft_s (the first also reads the prompt). A streamed
    target (`cost.target`) loads the next pass's first layers for `ahead_s` seconds while the
    draft works: its pass is that much of the drafting shorter, as its stats say (offload.py's
    `ahead_s` and `link_idle_s`). Returns the choices and tokens per (made-up) second against
    plain decoding's."""
    choices, tokens, seconds, fed = [], 0, 0.0, prompt
    while tokens < n_tokens:
        budget, max_depth = cost.choose()
        choices.append((budget, max_depth))
        passes = min(budget, max_depth)
        drafting = (passes + (fed > 1) * prompt / 10) * draft_s if budget else 0.0
        hidden = min(drafting, ahead_s)
        target_s = pass_s(fed + budget) - hidden
        if cost.target is not None:
            stats = cost.target.stats
            stats.wait_s = max(0.0, stats.wait_s - hidden)
            stats.ahead_s = hidden
            stats.link_idle_s = drafting - hidden
        if budget:
            tree = chain_tree(passes, logprob=-0.05)
            path = list(range(1, 1 + min(followed, passes)))  # the nodes the target follows
            observe(cost, (budget, max_depth), fed + budget, drafting, target_s, passes, tree, path)
            tokens += len(path) + 1
        else:
            step = specexec.Step([7], 0, 0, fed, None, [], target_s=target_s, total_s=target_s)
            cost.update(step)
            tokens += 1
        seconds += drafting + target_s
        fed = 1
    plain_s = pass_s(prompt) + (tokens - 1) * pass_s(1)
    return choices, plain_s / seconds


@pytest.mark.parametrize("n_tokens", [24, 64, 256])
@pytest.mark.parametrize(
    "draft_s, pass_s",
    [
        (0.05, lambda n: 0.5 + 0.001 * n),  # a streamed target, a draft a tenth of its pass
        (0.002, lambda n: 0.01 + 0.0001 * n),  # in memory, a draft a fifth of a pass
        (0.01, lambda n: 0.01 + 0.0001 * n),  # in memory, a draft that costs what the target does
    ],
)
def test_cost_model_drops_a_draft_whose_trees_give_one_token_and_loses_little(
    n_tokens, draft_s, pass_s
):
    """A sure draft the target never follows (trees give the bonus alone): after the first tree
    and a plain step, a look at once (the first tree's draft passes read the prompt too), then
    auto decodes plainly and looks again rarely; against plain decoding it loses 5% at most, or,
    on runs too short for that, about what the first tree and that look cost."""
    cost = CostModel(max_depth=16)
    choices, speed = simulate(cost, n_tokens, 0, draft_s, pass_s)
    assert choices[:2] == [(32, cost.first_depth), (0, 0)] and 0 < choices[2][0] <= 2
    assert sum(budget > 0 for budget, _ in choices) <= 1 + len(choices) / 4  # looks: rare
    first_tree = (cost.first_depth + 10) * draft_s + pass_s(132) - pass_s(100)
    look = 2 * draft_s + pass_s(3) - pass_s(1)  # a small tree: the cheapest look
    plain_s = pass_s(100) + (n_tokens - 1) * pass_s(1)
    assert speed >= min(0.95, 1 - 1.5 * (first_tree + look) / plain_s)


@pytest.mark.parametrize("followed", [1, 2, 3])
def test_cost_model_keeps_trees_that_pay(followed):
    """A draft the target follows `followed` nodes deep, the target streamed: trees all the way
    (the first tree's target pass says it streams: no plain step), near 1 + followed tokens a
    pass."""
    cost = CostModel(max_depth=16)
    choices, speed = simulate(cost, 128, followed, 0.002, lambda n: 1.0 + 0.001 * n)
    assert all(budget > 0 for budget, _ in choices)
    assert speed > 0.8 * (1 + followed)


@pytest.mark.parametrize("prompt", [100, 300])
def test_cost_model_is_not_put_off_by_a_first_tree_that_read_the_prompt(prompt):
    """In memory, a draft the target follows two nodes deep, whose first tree's passes took many
    times a later one's (the first read the prompt): after the plain step that measures a second
    size, a tree at once, and trees from then on (it decoded plainly for most of the run when the
    look waited as any other: 0.89-1.13x plain decoding)."""
    cost = CostModel(max_depth=16, budget=8, first_depth=2)  # make_policy's, in memory
    choices, speed = simulate(cost, 64, 2, 0.002, lambda n: 0.006 + 0.0001 * n, prompt=prompt)
    assert [budget for budget, _ in choices].count(0) == 1 and speed > 1.3


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
    """The first two sampled tokens follow the target's exact (filtered) joint distribution.
    One layer each: what is sampled, not the depth of the models, is under test (800 runs)."""
    vocab, n = 6, 800
    target = tiny_model("llama", 0, vocab=vocab, layers=1, init=0.15)
    draft = target if same_draft else tiny_model("llama", 1, vocab=vocab, layers=1, init=0.15)
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
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, eos_token_id=[],
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
    target = tiny_model(family, 0, init=0.4)
    draft = tiny_model(family, 1, init=0.4)
    opts = specexec.Options(budget=24, max_depth=5, width=4, branch=3, seed=0)
    run, seq = specexec.Run(target, draft, opts, limit=128), [9, 8, 7, 6]
    with torch.no_grad():
        for _ in range(6):
            seq += specexec.speculative_step(run, seq, opts.budget, opts.max_depth).tokens
            assert run.target_cache.get_seq_length() == len(seq) - 1
            assert run.draft_cache.get_seq_length() <= len(seq) - 1
        for model, cache in ((target, run.target_cache), (draft, run.draft_cache)):
            trunk = seq[cache.get_seq_length() :]
            windows = models.attention_windows(model)
            logits = specexec.tree_forward(model, cache, windows, trunk, specexec.chain(len(trunk)))
            logits = logits[-1]
            torch.testing.assert_close(logits, fresh_logits(model, seq), rtol=1e-9, atol=1e-9)


# ---- bad input ----


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(budget=0), "budget must be at least 1"),
        (dict(max_depth=0), "max_depth must be at least 1"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(max_new_tokens=-1), "max_new_tokens must be at least 0, got -1"),
        (dict(budget="8"), "budget must be an integer or \"auto\", got '8'"),
        (dict(budget=2.5), 'budget must be an integer or "auto", got 2.5'),
        (dict(width=True), "width must be an integer, got True"),
        (dict(top_p="x"), "top_p must be a number, got 'x'"),
        (dict(seed="1"), "seed must be an integer"),
        (dict(temperature=float("nan")), "temperature must be 0 or in"),
        (dict(temperature=float("inf")), "temperature must be 0 or in"),
        (dict(temperature=1e-5), "temperature must be 0 or in"),
        (dict(temperature=-1.0), "temperature must be 0 or in"),
        (dict(seed=2**64), "seed must be in"),
        (dict(seed=-1), "seed must be in"),
        (dict(on_tokens=5), "on_tokens must be a function of a list of tokens, got 5"),
    ],
)
def test_bad_options_raise_clear_errors(options, message):
    """Refused before any pass: the models here fail if they are ever run."""
    target = copy.copy(tiny_model("llama", 0))
    target.forward = None  # no pass may run; the checks read only the config
    for decode in (specexec.generate, specexec.autoregressive):
        models = (target, target) if decode is specexec.generate else (target,)
        with pytest.raises(SpecExecError, match=re.escape(message)):
            decode(*models, [1], **options)


def test_good_edge_options_are_accepted():
    """The bounds themselves are fine, and so is an int where a float is asked."""
    specexec.Options(temperature=1e-4, top_p=1, seed=2**64 - 1, max_new_tokens=0)


def test_numbers_of_other_types_run_as_pythons_own():
    """numpy's integers and a Fraction are numbers as an int or a float are (the option check
    lets them through); torch takes none of them (`torch.Generator.manual_seed` of a
    numpy.uint64 fails deep in a run), so they run as the int or float they equal."""
    from fractions import Fraction

    import numpy as np

    target = tiny_model("llama", 0, init=0.5)
    given = dict(seed=np.uint64(2**64 - 1), temperature=Fraction(1, 2), max_new_tokens=np.int64(6))
    plain = dict(seed=2**64 - 1, temperature=0.5, max_new_tokens=6)
    for decode in (
        lambda **options: specexec.generate(target, target, [5, 6, 7], budget=8, **options),
        lambda **options: specexec.autoregressive(target, [5, 6, 7], **options),
    ):
        assert decode(**given)[0] == decode(**plain)[0]
    opts = specexec.Options(**given)
    assert [type(opts.seed), type(opts.temperature), type(opts.max_new_tokens)] == [int, float, int]


@pytest.mark.parametrize(
    "input_ids, message",
    [
        ([], "the prompt is empty"),
        (list(range(16)), "the context holds 16"),
        (torch.tensor([[1, 2], [3, 4]]), "input_ids must be (n,) or (1, n), got shape (2, 2)"),
        (torch.ones(1, 1, 3, dtype=torch.long), "got shape (1, 1, 3)"),
        (torch.tensor([1.0, 2.0]), "input_ids must be integer token ids, got torch.float32"),
        ([1, 2.5], "integer token ids"),
        (["a", "b"], "input_ids must be a list of token ids"),
        ([1, 64, 2], "token id 64 is outside the target's vocabulary (64 tokens)"),
        ([-1], "token id -1 is outside the target's vocabulary"),
        ([1, 40], "token id 40 is outside the draft's vocabulary (32 tokens)"),
        (torch.ones(1, 3, dtype=torch.long, device="meta"), "input_ids holds no values to read"),
    ],
)
def test_bad_prompts_raise_clear_errors(input_ids, message):
    target = tiny_model("llama", 0, context=16)
    draft = tiny_model("llama", 1, vocab=32, context=16)
    with pytest.raises(SpecExecError, match=re.escape(message)):
        specexec.generate(target, draft, input_ids)
    if "draft" not in message:  # the baseline checks its one model the same way
        with pytest.raises(SpecExecError, match=re.escape(message.replace("target", "model"))):
            specexec.autoregressive(target, input_ids)


def test_a_tensor_prompt_equals_a_list_prompt():
    target = tiny_model("llama", 0, init=0.5)
    expected, _ = specexec.generate(target, target, [5, 6, 7], max_new_tokens=6)
    for ids in (torch.tensor([[5, 6, 7]]), torch.tensor([5, 6, 7], dtype=torch.int32)):
        assert specexec.generate(target, target, ids, max_new_tokens=6)[0] == expected


def test_summary_says_what_a_step_is_and_counts_in_words():
    """One line a user reads: a step is a target pass; one token, one pass, one step; a tree is
    as deep as it went, not as deep as it was allowed (a 4-node tree is never 16 deep)."""
    stats = specexec.Stats(emitted=[1], budgets=[(32, 8)], tree_depths=[8])
    stats.time_total, stats.draft_passes = 0.5, 8
    assert cli.summary(stats).startswith("1 token in 1 target pass (1.00 per pass), 2 tokens/s;")
    threads = f"; threads {torch.get_num_threads()}"  # the target's passes'
    assert cli.summary(stats).endswith(
        "; budget 32, trees up to 8 deep; 8.0 draft passes per target pass" + threads
    )
    stats = specexec.Stats(emitted=[2, 1, 2], budgets=[(4, 16), (0, 0), (4, 16)])
    stats.tree_depths, stats.draft_passes = [3, 0, 2], 6
    assert cli.summary(stats).startswith("5 tokens in 3 target passes (1.67 per pass)")
    assert cli.summary(stats).endswith(
        "; budget 4, trees up to 3 deep; plain decoding (no tree) in 1 step; "
        "2.0 draft passes per target pass" + threads
    )
    plain = specexec.Stats(emitted=[1, 1], budgets=[(0, 0)] * 2, tree_depths=[0, 0])
    assert "budget" not in cli.summary(plain) and "plain decoding" not in cli.summary(plain)


def test_draft_larger_than_target_or_missing_the_targets_pick_is_a_clear_error():
    small = tiny_model("llama", 1, vocab=32, init=0.5)
    target = tiny_model("llama", 0, init=0.5)
    with pytest.raises(SpecExecError, match="draft's vocabulary .64. is larger"):
        specexec.generate(small, target, [1, 2])
    # A smaller draft is allowed until the target picks a token the draft cannot embed. A fixed
    # budget: auto may decode plainly from then on (its choice depends on timings), and a token
    # the draft is never fed cannot trouble it.
    expected, _ = specexec.autoregressive(target, [1, 2], max_new_tokens=30, eos_token_id=[])
    first = next(token for token in expected[:-1] if token >= 32)
    options = dict(max_new_tokens=30, eos_token_id=[], budget=16)
    with pytest.raises(SpecExecError, match=f"the target chose token id {first}, which the draft"):
        specexec.generate(target, small, [1, 2], **options)


def test_eos_defaults_to_the_targets_generation_config():
    """Without eos_token_id both decoders stop at the generation config's EOS; [] = never."""
    from transformers import GenerationConfig

    target = copy.copy(tiny_model("llama", 0, init=0.5))  # its own generation_config
    prompt = [3, 1, 4]
    full, _ = specexec.autoregressive(target, prompt, max_new_tokens=30, eos_token_id=[])
    eos = full[6]
    target.generation_config = GenerationConfig(eos_token_id=[eos, 63])
    for decode in (
        lambda **kw: specexec.generate(target, target, prompt, budget=8, **kw),
        lambda **kw: specexec.autoregressive(target, prompt, **kw),
    ):
        assert decode(max_new_tokens=30)[0] == full[: full.index(eos) + 1]
        assert decode(max_new_tokens=30, eos_token_id=[])[0] == full
    # the CLI's rule: the tokenizer's EOS stops too, beside the generation config's
    tokenizer = types.SimpleNamespace(eos_token_id=5)
    assert models.stop_tokens(None, target, tokenizer) == {eos, 63, 5}


def test_eos_token_id_takes_integer_likes_and_refuses_the_rest():
    """numpy integers and integer tensors are token ids; a string is no list of them (it was
    split into characters), nor is True the id 1."""
    import numpy as np

    target = tiny_model("llama", 0, init=0.5)
    prompt = [3, 1, 4]
    full, _ = specexec.autoregressive(target, prompt, max_new_tokens=30, eos_token_id=[])
    eos = full[6]
    stopped = full[: full.index(eos) + 1]
    for eos_given in (
        eos,
        np.int64(eos),
        torch.tensor(eos),
        torch.tensor([eos, 63]),
        [np.int32(eos)],
    ):
        for decode in (
            lambda: specexec.generate(
                target, target, prompt, budget=8, max_new_tokens=30, eos_token_id=eos_given
            ),
            lambda: specexec.autoregressive(
                target, prompt, max_new_tokens=30, eos_token_id=eos_given
            ),
        ):
            assert decode()[0] == stopped, eos_given
    for bad in ("x", True, float(eos), [eos, "x"], [[eos]], torch.tensor(2.0), np.array([[eos]])):
        with pytest.raises(SpecExecError, match="eos_token_id must be token ids"):
            specexec.generate(target, target, prompt, eos_token_id=bad)


@pytest.mark.parametrize("broken", ["a NaN weight", "an infinite norm", "rms_norm_eps -1.0"])
def test_non_finite_logits_stop_the_run_naming_the_model(broken):
    """NaN logits would pick id 0 at temperature 0 (and an id past the vocabulary when
    sampling) and run on as if nothing were wrong."""
    good = tiny_model("llama", 0, init=0.5)
    bad = copy.deepcopy(good)
    with torch.no_grad():
        if broken == "a NaN weight":
            bad.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
        elif broken == "an infinite norm":
            bad.model.norm.weight[3] = math.inf
        else:  # as config.json would give it: every RMSNorm's epsilon
            for norm in bad.modules():
                if hasattr(norm, "variance_epsilon"):
                    norm.variance_epsilon = -1.0
    for target, draft, role, temperature in [
        (bad, good, "target", 0.0),
        (bad, good, "target", 0.9),
        (good, bad, "draft", 0.0),
    ]:
        with pytest.raises(SpecExecError, match=f"the {role} model computes logits that are not"):
            specexec.generate(target, draft, [1, 2, 3], max_new_tokens=4, temperature=temperature,
                              budget=4)  # fmt: skip
    with pytest.raises(SpecExecError, match="the target model computes logits that are not"):
        specexec.autoregressive(bad, [1, 2, 3], max_new_tokens=4)


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
            tokens, stats = specexec.generate(target, draft, ids, max_new_tokens=48, budget=16)
            assert tokens == expected
            assert stats.tokens_per_step > 1.5, cli.summary(stats)


# ---- the notebook ----


# ---- configs shaped like real checkpoints (conftest.REAL_SHAPES) ----


def hugging_face_greedy(model, prompt, max_new_tokens):
    """Independent oracle: Hugging Face's own greedy `generate` (no EOS stop), new tokens only."""
    ids = torch.tensor([prompt])  # (1, n)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False,
        max_new_tokens=max_new_tokens, eos_token_id=None,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_real_shapes_keep_their_options():
    """The scaled-down configs really carry the options they are named for."""
    for name in REAL_SHAPES:
        model = real_model(name)
        config = model.config
        assert config.num_key_value_heads < config.num_attention_heads, name  # GQA
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == config.tie_word_embeddings, name
    llama3 = real_model("llama3.1")
    assert llama3.model.rotary_emb.rope_type == "llama3"
    plain = 500000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)  # unscaled rope
    scaled = llama3.model.rotary_emb.inv_freq  # (head_dim / 2,)
    # llama3 scaling keeps short wavelengths and divides long ones (here > 32) by the factor
    torch.testing.assert_close(scaled[[0, -1]], plain[[0, -1]] / torch.tensor([1.0, 8.0]))
    assert real_model("qwen2.5").model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    qwen3 = real_model("qwen3").model.layers[0].self_attn
    assert qwen3.q_norm.weight.shape == (16,) and qwen3.q_proj.out_features == 4 * 16 != 32
    # windows: all layers slide (Mistral) or some (Qwen2's layer_types); none caps the context
    assert real_model("mistral-v0.1").config.sliding_window == 24
    assert real_model("qwen2-sliding").config.layer_types == ["full_attention", "sliding_attention"]
    gemma2 = real_model("gemma2")
    assert gemma2.config.layer_types == ["sliding_attention", "full_attention"]
    assert gemma2.model.layers[0].self_attn.attn_logit_softcapping == 50.0
    assert gemma2.model.layers[0].self_attn.scaling == 18**-0.5 != 16**-0.5
    assert float(gemma2.model.embed_tokens.embed_scale) == pytest.approx(32**0.5)
    gemma3 = real_model("gemma3").model
    assert gemma3.config.layer_types == ["sliding_attention", "full_attention"]
    thetas = {
        kind: gemma3.config.rope_parameters[kind]["rope_theta"]
        for kind in ("sliding_attention", "full_attention")
    }
    assert thetas == {"sliding_attention": 10000.0, "full_attention": 1000000.0}
    phi3 = real_model("phi3").model.layers[0]
    assert phi3.self_attn.qkv_proj.out_features == (4 + 2 * 1) * 8  # q, k and v fused
    assert phi3.mlp.gate_up_proj.out_features == 2 * 64
    olmo2 = real_model("olmo2").model.layers[0]
    assert not hasattr(olmo2, "input_layernorm") and olmo2.self_attn.q_norm.weight.shape == (40,)
    granite = real_model("granite").config
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (12.0, 0.22)
    assert (granite.attention_multiplier, granite.logits_scaling) == (0.125, 16.0)
    assert real_model("smollm3").config.no_rope_layers == [1, 0]  # layer 1 has no rotary
    experts = real_model("mixtral").model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 2 * 64, 32) and experts.down_proj.shape == (8, 32, 64)
    moe = real_model("qwen3-moe").model.layers[0].mlp
    assert moe.experts.gate_up_proj.shape == (32, 2 * 16, 32) and moe.gate.top_k == 2
    for name in REAL_SHAPES:
        assert real_model(name).config.max_position_embeddings == 128


@pytest.mark.parametrize("name", REAL_SHAPES)
@settings(max_examples=3, **SETTINGS)
@given(
    prefix=st.lists(st.integers(0, 96), min_size=1, max_size=32),  # up to past the windows
    parents=random_parents(max_nodes=12),
    data=st.data(),
)
def test_real_shapes_tree_logits_equal_per_path_forwards(name, prefix, parents, data):
    """test_tree_logits_equal_per_path_forwards on each real shape: every layer type's mask."""
    tokens = data.draw(st.lists(st.integers(0, 96), min_size=len(parents), max_size=len(parents)))
    check_tree_logits(real_model(name), prefix, tokens, parents)


@pytest.mark.parametrize("name", REAL_SHAPES)
@settings(max_examples=3, **SETTINGS)
@given(
    prompt=st.lists(st.integers(0, 96), min_size=1, max_size=12),
    budget=st.integers(1, 48),
    max_depth=st.integers(1, 8),
    width=st.integers(1, 8),
    cut=st.booleans(),
    max_new_tokens=st.integers(1, 20),
)
def test_real_shapes_greedy_equals_target_and_hugging_face(
    name, prompt, budget, max_depth, width, cut, max_new_tokens
):
    target = real_model(name)
    draft = cut_draft(name) if cut else target  # the target as its own draft: long paths
    with torch.no_grad():
        expected, _ = specexec.autoregressive(
            target, prompt, max_new_tokens=max_new_tokens, eos_token_id=[]
        )
        tokens, _ = specexec.generate(
            target, draft, prompt, max_new_tokens=max_new_tokens, eos_token_id=[],
            budget=budget, max_depth=max_depth, width=width,
        )  # fmt: skip
    assert tokens == expected
    assert len(tokens) == max_new_tokens  # prompt + output may pass a sliding window (24)
    assert hugging_face_greedy(target, prompt, max_new_tokens)[: len(tokens)] == tokens


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize(
    "name, attention",
    [
        (name, attention)
        for name in ("mistral-v0.1", "qwen2-sliding")
        for attention in ("sdpa", "eager")
    ]
    + [("gemma2", "eager"), ("gemma3", "sdpa")],  # Gemma 2's soft-capping runs in eager only
)
def test_sliding_window_runs_past_the_window_exactly(name, cut, attention):
    """Past its window a sliding layer sees only the last `window` positions; so do the trees.

    tree_forward hands such layers a second tree mask that also blocks keys `window` or more
    positions back (a dict by layer type for Qwen2 and Gemma, one mask for Mistral, where all
    slide). Oracles: greedy decoding, and Hugging Face's generate, whose config-built cache
    keeps only the window and whose masks are its own.
    """
    target = copy.deepcopy(real_model(name))
    target.set_attn_implementation(attention)
    draft = cut_draft(name) if cut else target  # the target as its own draft: long paths
    prompt = list(range(10, 20))
    with torch.no_grad():
        options = dict(max_new_tokens=50, eos_token_id=[])
        tokens, stats = specexec.generate(target, draft, prompt, budget=32, **options)
        expected, _ = specexec.autoregressive(target, prompt, **options)
    assert len(prompt) + len(tokens) == 60 > 2 * target.config.sliding_window
    assert tokens == expected == hugging_face_greedy(target, prompt, 50)
    assert stats.tokens_per_step > (1.5 if cut else 4)


@pytest.mark.parametrize("window", [8, 0])
def test_a_window_the_attention_does_not_apply_changes_nothing(window):
    """A Llama config may carry `sliding_window` (checkpoints do; 0 too), which transformers'
    Llama keeps but never applies. The window comes from what the layers do, so decoding is
    the model's own over the whole prefix. Oracles: greedy decoding by fresh forwards, and
    transformers' generate on a plain cache. (Left to build its cache from the config, generate
    trims the cache to the field's window as if Llama slid: then it matches neither.)
    """
    from transformers import DynamicCache

    target = copy.deepcopy(real_model("llama3.1"))
    target.config.sliding_window = window
    assert models.attention_windows(target) == {None: None}
    seq, prompt = list(range(10, 20)), list(range(10, 20))
    with torch.no_grad():
        while len(seq) < 40:  # past the window, five times over
            seq.append(int(fresh_logits(target, seq).argmax()))
        tokens, _ = specexec.generate(
            target, target, prompt, max_new_tokens=30, eos_token_id=[], budget=16
        )
        ids = torch.tensor([prompt])  # (1, 10)
        theirs = target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30,
            eos_token_id=None, **{CACHE: DynamicCache()},
        )[0, 10:].tolist()  # fmt: skip
    assert tokens == seq[10:] == theirs


def test_a_window_that_lets_a_token_see_nothing_is_refused():
    """Mistral does slide by `sliding_window`; a window of 0 would mask every key."""
    target = copy.deepcopy(real_model("mistral-v0.1"))
    target.config.sliding_window = 0
    with pytest.raises(UnsupportedModel, match="mistral: a sliding window of 0 lets a token see"):
        specexec.generate(target, target, [1, 2, 3])


@pytest.mark.parametrize(
    "family, message",
    [
        ("qwen3_next", "layer 0 keeps a LinearAttentionLayer, not only keys and values"),
        ("falcon_h1", "layer 0 keeps a LinearAttentionAndFullAttentionLayer"),  # both in a layer
        ("doge", "its attention ignores a 4D mask"),  # it builds masks of its own
        ("rwkv", "layer 0 does not attend through transformers' attention functions"),
    ],
)
def test_what_a_tree_pass_cannot_run_is_refused_in_one_line(family, message):
    """Decided by checks of the model itself (what its cache keeps, what its attention gets),
    not by a list: recurrent and hybrid layers, and attention that ignores the tree mask."""
    import transformers

    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    config = transformers.AutoConfig.for_model(family, **sizes)
    target = types.SimpleNamespace(config=config)  # listened to on the meta device: no weights
    with pytest.raises(UnsupportedModel, match=f"^{family} is not supported: {re.escape(message)}"):
        models.attention_windows(target)


def test_tree_mask_window_blocks_keys_too_far_back():
    """Oracle: a key is visible iff the tree mask shows it and it is < `window` positions back."""
    parents, n_prefix, window = [-1, 0, 0, 1, 3, -1], 5, 3
    full, positions = specexec.tree_mask(parents, n_prefix, torch.float64, "cpu")
    sliding, _ = specexec.tree_mask(parents, n_prefix, torch.float64, "cpu", window)
    key_positions = list(range(n_prefix)) + positions[0].tolist()
    for i, query in enumerate(positions[0].tolist()):
        for j, key in enumerate(key_positions):
            visible = full[0, 0, i, j] == 0 and query - key < window
            assert (sliding[0, 0, i, j] == 0) == visible, (i, j)
    assert positions[0].tolist() == [5, 6, 6, 7, 8, 5]


def test_passes_on_a_gpu_may_use_every_attention_kernel_but_cudnns():
    """cuDNN's attention plans a graph for each new shape, and every pass's shape is new (on an
    H100 a float16 draft's passes took 60 ms, 3 ms where the shape had been planned before); the
    others stay allowed, the memory-efficient one among them (it takes a float mask).
    test_offload runs a pass on CUDA."""
    from torch.nn.attention import SDPBackend

    kernels = set(models.ATTENTION_KERNELS)
    assert SDPBackend.CUDNN_ATTENTION not in kernels and SDPBackend.ERROR not in kernels
    assert {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION} <= kernels


def test_sliding_layers_of_a_config_built_cache_drop_old_entries():
    """Why SpecExec builds its caches as `DynamicCache()`, without the model's config.

    Given the config, transformers 5 makes sliding-window layers that keep only the last
    window - 1 entries; a step's `keep_positions` gathers entries by their position in the
    sequence, which such a layer no longer holds once a tree has pushed it past the window.
    """
    from transformers import DynamicCache

    target = real_model("mistral-v0.1")
    ids = torch.arange(30)[None]  # (1, 30): longer than the window of 24
    with torch.no_grad():
        trimmed, plain = DynamicCache(config=target.config), DynamicCache()
        target(ids, **{CACHE: trimmed})
        target(ids, **{CACHE: plain})
    assert trimmed.layers[0].keys.shape[-2] == 23 and trimmed.get_seq_length() == 30
    assert plain.layers[0].keys.shape[-2] == 30


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_real_shapes_kept_caches_equal_a_fresh_forward(name):
    """After several steps each cache, run on by Hugging Face itself, gives a fresh forward."""
    target, draft = real_model(name), cut_draft(name)
    limit = target.config.max_position_embeddings
    opts = specexec.Options(budget=24, max_depth=5, width=4, branch=3, seed=0)
    run, seq = specexec.Run(target, draft, opts, limit), [9, 8, 7, 6]
    with torch.no_grad():
        for _ in range(8):  # past the windows
            if len(seq) + opts.max_depth + 1 > limit:
                break
            seq += specexec.speculative_step(run, seq, opts.budget, opts.max_depth).tokens
            assert run.target_cache.get_seq_length() == len(seq) - 1
        for model, cache in ((target, run.target_cache), (draft, run.draft_cache)):
            trunk = torch.tensor([seq[cache.get_seq_length() :]])  # (1, n_trunk)
            logits = model(trunk, **{CACHE: cache}).logits[0, -1]  # (vocab,)
            torch.testing.assert_close(logits, fresh_logits(model, seq), **tolerance(model))


def tolerance(model):
    """Float64 to rounding, but where attention is eager (Gemma 2's only one, for its soft-capping):
    transformers' eager attention takes its softmax in float32, whose rounding depends on the
    length of the row (a tree pass's row is longer), ~1e-7 of the logits."""
    eager = model.config._attn_implementation == "eager"
    return dict(rtol=1e-5, atol=1e-5) if eager else dict(rtol=1e-9, atol=1e-9)


# ---- a conversation: the caches kept from turn to turn (specexec_app.chat.Chat) ----


def held_then_shared(before, after):
    """What a turn can reuse: the tokens the caches hold (all of `before` but its last) that
    the new prompt `after` starts with, leaving the prompt's last token to feed."""
    shared = 0
    while shared < min(len(before) - 1, len(after)) and before[shared] == after[shared]:
        shared += 1
    return min(shared, len(after) - 1)


def talk(target, draft, turns, **options):
    """Each turn's answer from one Chat and from a fresh `generate` of the whole conversation
    (the oracle), with the reuse Chat reports and the one the token lists say. A turn is
    (tokens to append, whether to re-render the first token of the conversation)."""
    chat, conversation, results, before = Chat(target, draft, **options), [], [], []
    for user, rerender in turns:
        conversation = conversation + user
        if rerender:  # a template that renders an earlier turn anew
            conversation = [(conversation[0] + 1) % 64, *conversation[1:]]
        answer, stats = chat.generate(conversation, eos_token_id=[])
        fresh, _ = specexec.generate(target, draft, conversation, eos_token_id=[], **options)
        results.append((answer, fresh, stats.reused, held_then_shared(before, conversation)))
        before = conversation + answer
        conversation = conversation + answer
    return results


TURNS = [([5, 6, 7], False), ([8, 9], False), ([10], False), ([11, 12], True), ([13], False)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampled", [False, True])
def test_each_chat_turn_equals_a_fresh_run_of_the_whole_conversation(family, sampled):
    """In float64 (no near-ties): greedy, each answer is the fresh greedy one; sampled with a
    seed, the fresh seeded sample. A re-rendered earlier turn drops what no longer matches."""
    target, draft = tiny_model(family, 0, init=0.4), tiny_model(family, 1, init=0.4)
    sampling = dict(temperature=0.8, seed=7) if sampled else {}
    results = talk(target, draft, TURNS, max_new_tokens=9, budget="auto", **sampling)
    for turn, (answer, fresh, reused, expected) in enumerate(results):
        assert answer == fresh, turn
        assert reused == expected, (turn, reused, expected)
    assert [r[2] for r in results][:2] == [0, 3 + 9 - 1]  # the first turn: nothing to reuse
    assert results[3][2] == 0  # its first token changed: nothing matches


@pytest.mark.parametrize("mode", ["ram", "ssd"])
def test_chat_with_an_offloaded_target_equals_fresh_runs(tmp_path, mode):
    import offload
    from conftest import save_model, tiny_config

    config = tiny_config("llama", vocab=64, layers=3, max_position_embeddings=128)
    save_model(tmp_path / "target", config, seed=0)
    draft = tiny_model("llama", 1, init=0.4, dtype=torch.float32)
    with offload.from_pretrained(tmp_path / "target", mode=mode, device="cpu") as target:
        for turn, (answer, fresh, reused, expected) in enumerate(
            talk(target, draft, TURNS[:3], max_new_tokens=8, budget=8)
        ):
            assert answer == fresh and reused == expected, turn


def test_a_chat_without_a_draft_decodes_plainly_as_autoregressive():
    target = tiny_model("llama", 0, init=0.4)
    chat, conversation = Chat(target, None, max_new_tokens=6), [3, 4]
    for user in ([5], [6, 7]):
        conversation = conversation + user
        answer, stats = chat.generate(conversation, eos_token_id=[])
        assert answer == specexec.autoregressive(target, conversation, max_new_tokens=6)[0]
        assert stats.draft_passes == 0
        conversation = conversation + answer
    assert stats.reused == len(conversation) - len(answer) - 2 - 1  # what the turn before left


def test_draft_threads_one_for_a_small_draft_torchs_setting_for_a_big_one():
    """The default: one thread for a draft whose passes are small matmuls, torch's own setting
    (0) for a draft of 50M parameters or more (a real model, the target's int4 copy), read off
    its config; a number given is taken as it is."""
    small = types.SimpleNamespace(config=tiny_model("llama", 1).config)
    big = types.SimpleNamespace(
        config=types.SimpleNamespace(hidden_size=576, num_hidden_layers=30, vocab_size=49152)
    )  # SmolLM2-135M's shape
    for draft, threads in ((small, 1), (big, 0)):
        assert models.draft_threads(specexec.Options(), draft) == threads
        assert models.draft_threads(specexec.Options(draft_threads=2), draft) == 2


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: one count of threads only")
def test_generate_runs_on_the_threads_the_command_line_would_choose(monkeypatch):
    """generate and autoregressive take one thread per core that other programs leave free, as
    the command line does (torch's own count, one per core, ran the README's script 5x slower
    than the CLI on a busy machine), unless the caller chose: torch.set_num_threads, an
    environment variable, or the `threads` option (0: torch's count as it is). Oracle: the
    command line's rule, cores less the load average, with the load and torch's count set here."""
    cores = os.cpu_count()
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(models, "TORCH_THREADS", cores)  # torch's own count: one per core
    before = torch.get_num_threads()

    def threads_after(run, load, set_to=cores, **options):
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        torch.set_num_threads(set_to)
        run(**options)
        return torch.get_num_threads()

    api = [
        lambda **o: specexec.generate(target, draft, [1, 2, 3], max_new_tokens=2, **o),
        lambda **o: specexec.autoregressive(target, [1, 2, 3], max_new_tokens=2, **o),
    ]
    try:
        for run in api:
            assert threads_after(run, load=cores - 1) == 1  # one core free: one thread
            assert threads_after(run, load=0.0, set_to=1) == 1  # torch.set_num_threads(1): kept
            assert threads_after(run, load=0.0, threads=1) == 1  # the option
            assert threads_after(run, load=cores - 1, threads=0) == cores  # torch's, as it is
        monkeypatch.setenv("OMP_NUM_THREADS", str(cores))
        assert threads_after(api[0], load=cores - 1) == cores  # the environment's choice
    finally:
        torch.set_num_threads(before)


# ---- prompt lookup: candidates that cost no draft pass ----


def lookup_oracle(seq, longest, most=4):
    """lookup_chains spelled out: for n = 3, 2, 1, every earlier start of the last n tokens, the
    latest first; the first n with any gives up to `most` of them, each followed for `longest`.
    If none, the same for `seq` but its last token, each chain starting a token later."""

    def after(context, skip):
        for n in (3, 2, 1):
            if len(context) <= n:
                continue
            starts = [i for i in range(len(context) - n) if context[i : i + n] == context[-n:]]
            if starts:
                return [seq[i + n + skip : i + n + skip + longest] for i in reversed(starts)][:most]
        return []

    return after(seq, 0) or after(seq[:-1], 1)


@settings(max_examples=60, **SETTINGS)
@given(seq=st.lists(st.integers(0, 5), min_size=1, max_size=30), longest=st.integers(1, 6))
def test_lookup_chains_are_what_followed_the_latest_occurrences(seq, longest):
    """Against the oracle: as found, or with the last token taken as a replacement."""
    assert specexec.lookup_chains(seq, longest) == lookup_oracle(seq, longest)


def repetitive(draw_list, repeats):
    """A prompt that repeats itself, so that lookup finds something to copy."""
    return (draw_list * repeats)[:40]


# 12 examples: greedy exactness with lookup on at its default (32) beside a draft is held by
# test_greedy_specexec_equals_greedy_target's 25 too; these add prompts that repeat, small
# lookups and lookup alone
@settings(max_examples=12, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES),
    seed=st.integers(0, 3),
    piece=st.lists(st.integers(0, 63), min_size=1, max_size=6),
    repeats=st.integers(1, 4),
    budget=st.integers(1, 48),
    lookup=st.integers(1, 12),
    with_draft=st.booleans(),
    max_new_tokens=st.integers(1, 40),
)
def test_greedy_with_lookup_equals_greedy_target(
    family, seed, piece, repeats, budget, lookup, with_draft, max_new_tokens
):
    """Lookup's branches beside the draft's, or alone (no draft model): the target's own greedy
    text, whatever they propose (float64 models: no near-tie can flip an argmax)."""
    target = tiny_model(family, seed, init=0.3)
    draft = tiny_model(family, 10 + seed, init=0.3) if with_draft else None
    prompt = repetitive(piece, repeats)
    options = dict(budget=budget, max_depth=4, width=8, branch=3, lookup=lookup)
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, max_new_tokens=max_new_tokens)
        tokens, stats, steps = generate_steps(target, draft, prompt,
                                              max_new_tokens=max_new_tokens, **options)  # fmt: skip
    assert tokens == expected
    assert max(len(step.tree.best()) for step in steps) <= budget
    assert stats.new_tokens == sum(stats.emitted)
    assert 0 <= looked_up(steps, stats) <= stats.new_tokens - stats.steps + 1  # a bonus is no node


@pytest.mark.parametrize("with_draft", [False, True])
def test_sampling_with_lookup_and_a_seed_equals_the_target_alone(with_draft):
    target = tiny_model("llama", 0, init=0.3)
    draft = tiny_model("llama", 1, init=0.3) if with_draft else None
    options = dict(temperature=0.9, top_p=0.95, max_new_tokens=40)
    prompt = [5, 6, 7, 8] * 5
    with torch.no_grad():
        for seed in range(3):
            expected, _ = specexec.autoregressive(target, prompt, seed=seed, **options)
            tokens, _ = specexec.generate(
                target, draft, prompt, seed=seed, budget=16, lookup=8, **options
            )
            assert tokens == expected


@needs_pair
def test_lookup_alone_copies_text_that_repeats():
    """With no draft model: where the trained target repeats itself (a list, a comment line it
    writes again), lookup's branches verify whole stretches in one target pass; exact, at a
    fixed budget and with auto (whose choices follow timings: only its text is asserted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float64).eval()
    ids = tokenizer("items = [\n    'alpha',\n    'beta',\n    'gamma',\n")["input_ids"]
    options = dict(max_new_tokens=48, eos_token_id=[], lookup=8)
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, ids, max_new_tokens=48, eos_token_id=[])
        tokens, stats, steps = generate_steps(target, None, ids, budget=16, **options)
        auto, _ = specexec.generate(target, None, ids, **options)
    assert tokens == expected == auto
    assert stats.tokens_per_step > 3 and looked_up(steps, stats) > 24 and stats.draft_passes == 0


@pytest.mark.parametrize("chains", ["wrong", "long"])
def test_adversarial_lookup_changes_nothing(chains, monkeypatch):
    """Every candidate wrong (tokens the target never picks next), or chains far past the
    context's end: the text is still the target's, and no node lies beyond the context."""
    target = tiny_model("qwen2", 0, init=0.3, context=64)
    prompt = [7, 8, 9] * 18  # 54 of 64 positions
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, prompt, max_new_tokens=30)

    def proposals(seq, longest, most=4):
        if chains == "long":
            return [list(range(60))] * 2
        next_token = int(fresh_logits(target, seq).argmax())
        return [[(next_token + k) % 64 for _ in range(longest)] for k in (1, 2, 3)]

    monkeypatch.setattr(specexec, "lookup_chains", proposals)
    with torch.no_grad():
        tokens, stats, steps = generate_steps(
            target, None, prompt, max_new_tokens=30, budget=64, lookup=60
        )
    assert tokens == expected and len(tokens) == 64 - len(prompt)  # up to the context's end
    if chains == "wrong":
        assert looked_up(steps, stats) == 0 and stats.tokens_per_step == 1


def test_lookup_on_a_one_token_prompt_and_no_repeat_is_plain_decoding():
    target = tiny_model("llama", 0)
    with torch.no_grad():
        expected, _ = specexec.autoregressive(target, [9], max_new_tokens=1)
        tokens, _, steps = generate_steps(target, None, [9], max_new_tokens=1, budget=4, lookup=4)
    assert tokens == expected and [len(step.tree.best()) for step in steps] == [0]


@settings(max_examples=30, **SETTINGS)
@given(
    seq=st.lists(st.integers(0, 4), min_size=2, max_size=24),
    budget=st.integers(1, 12),
    logprob=st.floats(-3.0, -0.05),
    data=st.data(),
)
def test_lookup_branches_keep_the_tree_the_best_budget_closed_under_ancestors(
    seq, budget, logprob, data
):
    """Lookup's nodes join a draft tree (random draft nodes first): the verified nodes stay at
    most `budget`, closed under ancestors, each no better than its parent, a (parent, token)
    once; a lookup node that did not make it has no verified descendant; what it returns as
    proposed is what the chains spell below `start` (the root, or a verified node: where the
    step goes on looking up; a brute-force oracle), the draft's nodes among them."""
    tree = specexec.DraftTree(tokens=[seq[-1]], parents=[-1], cum_logprob=[0.0], depth=[0],
                              budget=budget)  # fmt: skip
    for _ in range(data.draw(st.integers(0, 10))):  # some draft nodes, as add_children adds
        parent = data.draw(st.integers(0, len(tree.tokens) - 1))
        token = data.draw(st.integers(0, 4))
        if (parent, token) not in tree.children:
            child = tree.add_child(parent, token, data.draw(st.floats(-3.0, -0.01)))
            tree.admit(child)
    before = tree.best()
    if any(tree.parents[n] not in {0, *before} for n in before):
        return  # random draft nodes need not form a tree; lookup's promise is about a tree
    start = data.draw(st.sampled_from([0, *(n for n in before if tree.depth[n] <= 5)]))
    chains = specexec.lookup_chains(seq, 6)
    proposed = tree.add_lookup(chains, logprob, room=5, start=start)
    best = tree.best()
    assert len(best) <= budget

    def spelled(node):  # the tokens from start's child down to node; None: not below start
        if node in (start, 0):
            return () if node == start else None
        above = spelled(tree.parents[node])
        return None if above is None else above + (tree.tokens[node],)

    room = 5 - tree.depth[start]
    prefixes = {tuple(chain[:k]) for chain in chains for k in range(1, min(len(chain), room) + 1)}
    # What the step counts as lookup's: every verified node a chain spells, the draft's too
    assert {n for n in best if spelled(n) in prefixes} <= proposed
    assert all(spelled(n) in prefixes for n in proposed)
    assert all(tree.parents[n] in {0, *best} for n in best)
    assert all(tree.cum_logprob[n] <= tree.cum_logprob[tree.parents[n]] for n in best)
    pairs = [(tree.parents[n], tree.tokens[n]) for n in range(1, len(tree.tokens))]
    assert len(pairs) == len(set(pairs))
    assert all(tree.depth[n] <= 5 for n in tree.looked_up)


def test_a_chat_with_lookup_alone_answers_as_a_fresh_run():
    target = tiny_model("llama", 2, init=0.5)
    chat, conversation = Chat(target, None, max_new_tokens=12, lookup=6, budget=8), [3, 1, 4]
    with torch.no_grad():
        for turn in ([1, 5], [9, 2, 6]):
            conversation = conversation + turn
            answer, _ = chat.generate(conversation, eos_token_id=[])
            assert answer == specexec.autoregressive(target, conversation, max_new_tokens=12)[0]
            conversation = conversation + answer


# ---- budget auto in the paper's regime: a streamed target whose pass is the link's ----


class Streamed(types.SimpleNamespace):
    """A stand-in for an offloaded target that, like a model, a weak reference can name."""

    __hash__ = object.__hash__


def timed_passes(link_s, compute_s):
    """A streamed target's passes as timed (offload.py's `pass_costs`): over n tokens, the
    link's `link_s` or the compute's `compute_s * n`, whichever is longer, and that compute."""
    return {n: (max(link_s, compute_s * n), compute_s * n) for n in (128, 1)}


@pytest.mark.parametrize(
    "link_s, compute_s, first, after_a_long_prompt",
    [
        # a 2,049-token pass still costs the link's: the biggest tree (after 1,000 tokens too)
        (2.0, 0.0005, (2048, 32), (2048, 32)),
        # past 1,024 tokens the compute outlasts the link: stop there (after 1,000: at 256)
        (2.0, 0.0015, (1024, 32), (256, 32)),
        # compute-bound past 50 tokens (a CPU, a fast disk): a small tree (a prompt's compute
        # dwarfs a tree's: a bigger one)
        (1.0, 0.02, (32, 32), (256, 32)),
    ],
)
def test_auto_sizes_its_first_tree_for_two_passes_it_timed(
    link_s, compute_s, first, after_a_long_prompt
):
    """Where the target streams, auto has it time two passes (once per model) and sizes its first
    tree for them, searched twice the fixed budgets' depth (a draft pass is cheap beside such a
    pass): the paper's regime gets its big deep tree from the first prompt's first step."""
    stats = types.SimpleNamespace(wait_s=0.0)
    config = types.SimpleNamespace(hidden_size=8, num_hidden_layers=2, vocab_size=64)
    target = Streamed(streams=True, config=config, stats=stats, pass_costs={}, timed=0)

    def time_passes():  # as offload.py's: two passes timed, once per model
        target.timed += 1
        target.pass_costs.update(timed_passes(link_s, compute_s))

    target.time_passes = time_passes
    policy = cost_model.make_policy(specexec.Options(max_depth=16), target, target)
    assert target.timed == 1 and policy.max_depth == 32 and policy.choose() == first
    # past the largest size timed, a pass costs the longer of the link's and its compute
    assert policy.t_target(4097) == pytest.approx(max(link_s, compute_s * 128, compute_s * 4097))
    # the first pass reads the prompt before the tree: a long one leaves room for a smaller tree
    assert policy.first_tree(trunk=1000) == after_a_long_prompt
    # and what auto learns stays with the pair: the next generate's policy is the same one
    assert cost_model.make_policy(specexec.Options(max_depth=16), target, target) is policy
    assert target.timed == 1


def test_auto_charges_no_drafting_that_the_links_loads_ahead_hide():
    """A streamed target's link loads the next pass's first layers while the draft works
    (offload.py's `stats.ahead_s`, and `stats.link_idle_s` where they landed before the pass):
    auto charges a pass its full cost (what it took, and what loaded ahead of it) and a step
    only the drafting that outlasts those loads. Charged in full, a search 16 deep looked 16
    draft passes cheaper than one 32 deep, where both cost the link's pass."""
    stats = types.SimpleNamespace(wait_s=0.0)
    cost = CostModel(max_depth=32, target=types.SimpleNamespace(stats=stats))
    cost.target_s = {1: 2.0, 128: 2.0}  # the link's: 2 s a pass, whatever its size
    cost.busy_s = {1: 0.001, 128: 0.1}
    tree = chain_tree(32, logprob=-0.05)
    # The first tree read the prompt: its drafting (1 s) outlasted the loads ahead (0.5 s)
    stats.ahead_s, stats.link_idle_s = 0.5, 0.5
    observe(cost, (1024, 32), 1100, 1.0, 2.0 - 0.5, 32, tree, path=[1, 2])
    assert cost.ahead_s == 0.5 and cost.target_s[1100] == 2.0
    # Then 32 draft passes of 10 ms each, hidden: the link never idles
    stats.ahead_s, stats.link_idle_s = 0.32, 0.0
    observe(cost, (1024, 32), 1025, 0.32, 2.0 - 0.32, 32, tree, path=[1, 2])
    assert cost.ahead_s == 0.5  # it loads ahead at least as long as it was seen to
    assert cost.target_s[1025] == pytest.approx(2.0) and cost.draft_s == pytest.approx(0.01)
    assert cost.from_parts(1024, 16) == pytest.approx(2.0)
    assert cost.from_parts(1024, 32) == pytest.approx(2.0)  # 0.32 s of drafting: hidden
    cost.draft_s = 0.03  # 0.96 s of drafting: 0.46 s outlast the loads
    assert cost.from_parts(1024, 32) == pytest.approx(2.0 + 0.96 - 0.5)


@pytest.mark.parametrize(
    "ahead_s, draft_s, followed",
    [
        (0.0, 0.01, 20),  # drafting adds to every step
        (0.5, 0.015, 30),  # the link loads two of eight layers ahead: 32 draft passes fit in it
    ],
)
def test_auto_in_the_papers_regime_stays_deep_and_near_the_best_tree(ahead_s, draft_s, followed):
    """Simulated steps of a link-bound target (2 s a pass up to 2,048 tokens) and a cheap draft
    the target follows `followed` deep: auto starts with the big deep tree and keeps trees that
    deep, so that its tokens per second reach 0.9 of always running the best tree. Where the
    link loads the next pass ahead while the draft works, the drafting it hides costs nothing:
    auto kept trees 24 deep when it charged every draft pass (on the 11-29 simulated link, 90%
    of the best tree's speed) and now keeps them 32 deep."""
    link_s, compute_s = 2.0, 0.0005
    stats = types.SimpleNamespace(wait_s=0.0)

    def pass_s(n):  # the seconds of a pass over n tokens; its wait for weights, as offload.py's
        stats.wait_s = max(0.0, link_s - compute_s * n)
        return max(link_s, compute_s * n)

    cost = CostModel(
        max_depth=32, budget=32, first_depth=4, target=types.SimpleNamespace(stats=stats)
    )
    costs = timed_passes(link_s, compute_s)
    cost.target_s = {n: seconds for n, (seconds, _) in costs.items()}
    cost.busy_s = {n: busy for n, (_, busy) in costs.items()}
    choices, speed = simulate(cost, 256, followed, draft_s, pass_s, ahead_s=ahead_s)
    assert choices[0] == (2048, 32) and all(depth >= 24 for _, depth in choices)
    if ahead_s:
        assert all(depth == 32 for _, depth in choices[4:]), choices
    best_s = pass_s(2049) + max(0.0, 32 * draft_s - ahead_s)  # every step the best tree
    best = (followed + 1) * pass_s(1) / best_s
    assert speed >= 0.9 * best
