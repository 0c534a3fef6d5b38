"""What a user hands to `specexec.generate`, checked: options, prompt, models, stop tokens.

Each check fails in one line that names the input (`SpecExecError`, a ValueError); the CLI
prints it as `error: ...` and exits 2. Kept apart from specexec.py so that the algorithm
reads first there; the CLI calls some of these before any weights load.
"""

import math
import numbers
from dataclasses import fields

import torch


class SpecExecError(ValueError):
    """Bad input, reported to the user in one line."""


def check_options(opts):
    """Each option's type and range, in one line naming it (`Options` calls this when made)."""
    for f in fields(opts):
        value, integer = getattr(opts, f.name), f.type in (int, int | str, int | None)
        if f.name == "budget" and value == "auto":
            continue
        kind = numbers.Integral if integer else numbers.Real  # a bool is no count
        if (value is not None or f.default is not None) and (
            isinstance(value, bool) or not isinstance(value, kind)
        ):
            kind = "an integer" if integer else "a number"
            kind += ' or "auto"' if f.name == "budget" else ""
            raise SpecExecError(f"{f.name} must be {kind}, got {value!r}")
    counts = ("budget", "max_depth", "width", "branch", "draft_threads")
    for name, lowest in (dict.fromkeys(counts, 1) | dict(max_new_tokens=0, top_k=0)).items():
        if getattr(opts, name) not in ("auto", None) and getattr(opts, name) < lowest:
            raise SpecExecError(f"{name} must be at least {lowest}, got {getattr(opts, name)}")
    # A floor: logits / temperature stays finite for any float32 logit (3.4e38 / 1e-4 fits
    # a float64), and below 1e-4 sampling is greedy decoding in all but exact ties anyway.
    if not (opts.temperature == 0 or 1e-4 <= opts.temperature < math.inf):
        raise SpecExecError(f"temperature must be 0 or in [1e-4, inf), got {opts.temperature}")
    if not 0 < opts.top_p <= 1:
        raise SpecExecError(f"top_p must be in (0, 1], got {opts.top_p}")
    if opts.seed is not None and not 0 <= opts.seed < 2**64:
        raise SpecExecError(f"seed must be in [0, 2**64), got {opts.seed}")
    if opts.draft_temperature is not None and not 1e-2 <= opts.draft_temperature < math.inf:
        raise SpecExecError(
            f"draft_temperature must be in [0.01, inf), got {opts.draft_temperature}"
        )


def context_length(config):
    """Positions the model can use."""
    return config.max_position_embeddings


def check_draft_vocab(target_config, draft_config):
    """Every token the draft proposes must be one the target has: its vocabulary is no larger.
    (That ids also mean the same tokens, the CLI checks on the tokenizers' strings.)"""
    if draft_config.vocab_size > target_config.vocab_size:
        raise SpecExecError(
            f"the draft's vocabulary ({draft_config.vocab_size}) is larger than the target's "
            f"({target_config.vocab_size}); they must share a tokenizer"
        )


def check_prompt(seq, limit):
    if not seq:
        raise SpecExecError("the prompt is empty")
    if len(seq) >= limit:
        raise SpecExecError(f"the prompt has {len(seq)} tokens; the context holds {limit}")


def prompt_tokens(input_ids, limit, **models):
    """The prompt as a list of ints, checked against the context and each model's vocabulary.

    input_ids: a list of ints or an integer tensor (n,) or (1, n). models: role=model.
    """
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise SpecExecError(f"input_ids must be a list of token ids ({error})") from None
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise SpecExecError(f"input_ids must be (n,) or (1, n), got shape {tuple(ids.shape)}")
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise SpecExecError(f"input_ids must be integer token ids, got {ids.dtype}")
    seq = ids.reshape(-1).tolist()
    check_prompt(seq, limit)
    for role, model in models.items():
        vocab = model.config.vocab_size
        outside = [token for token in seq if not 0 <= token < vocab]
        if outside:
            raise SpecExecError(
                f"token id {outside[0]} is outside the {role}'s vocabulary ({vocab} tokens)"
            )
    return seq


def stop_tokens(eos_token_id, model, tokenizer=None):
    """Token ids to stop after: those given (an integer, numpy's and tensors' too, or a list of
    them), else every EOS the model's generation config names and, given a tokenizer (the CLI
    does), its own. `eos_token_id=[]` never stops early."""
    if eos_token_id is None:
        config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_token_id = token_ids(config) + token_ids(getattr(tokenizer, "eos_token_id", None))
    ids = token_ids(eos_token_id)
    for token in ids:  # a string is no list of ids, nor True the id 1
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise SpecExecError(f"eos_token_id must be token ids (integers), got {token!r}")
    return {int(token) for token in ids}


def token_ids(ids):
    """None, one id, or a list, tuple, set or tensor of them: a list."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids  # tensors and numpy's
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple, set, frozenset)) else [ids]
