"""What specexec.py and offload.py stand on, one module a job (none imports them, nor anything
of specexec_app/, the floor above):

models.py       from a model folder to a checked model: open once, check the pair and prompt, load
checkpoint.py   a folder's weight files: safetensors headers, .bin shards, every weight checked,
                the ssd tier's copy
quantize.py     int8 / int4 weights for the offloaded target and the self-draft
cost_model.py   the budget policies: a fixed budget, and budget "auto" (the cost model)

Every refusal is one line naming the input; the command line prints it as `error: ...`, exit 2.
This file holds the errors and the checks specexec.py calls (its options, generate's arguments,
the logits' finiteness) and the local half of finding a model folder, and imports neither torch
nor transformers at load: the command line checks its flags and paths before torch loads.
"""

import math
import numbers
import os
from dataclasses import fields
from pathlib import Path

# quantize.py's kinds, held here: the command line reads them before torch loads
KINDS = ("int8", "int4")


class SpecExecError(ValueError):
    """Bad input to a run, reported to the user in one line."""


class UnsupportedModel(SpecExecError):
    """A model whose layers a tree pass cannot run, reported to the user in one line."""


class OffloadError(ValueError):
    """Bad input to the offloader or a bad model folder: one line that says what and where."""


def expanded(path) -> Path:
    """`path` with a leading ~ or ~user read as that home folder; one line where there is none."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~user of no such user, or ~ without a HOME
        raise OffloadError(f"{path}: no home folder for {Path(path).parts[0]}") from None


def one_line(err):
    """An exception's message on one line, for an error of ours to quote: all of it (transformers
    puts the reason on a second line), cut at 300 characters; its type where it has none."""
    return " ".join(str(err).split())[:300] or type(err).__name__


def local_folder(name):
    """A model's name as a local folder, checked: the folder; None where the name can only be a
    hub id (models.find_folder looks there). What is neither is one line naming it."""
    path = expanded(name)
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            raise OffloadError(f"{name}: cannot read this folder (permission denied)")
        if not (path / "config.json").is_file():
            raise OffloadError(f"{name}: no config.json in this folder")
        return path
    if path.exists():  # a file: a config.json or a text file, say
        raise OffloadError(f"{name}: a file, not a model folder")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise OffloadError(f"{name}: no such model folder")
    return None


def check_options(opts):
    """Each of a specexec.Options' values, its type and range, in one line naming it; returns
    `opts`, each number as Python's own int or float (numpy's and Fraction fail deep in torch)."""
    for f in fields(opts):
        value = getattr(opts, f.name)
        integer = f.type in (int, int | str, int | None)
        if (f.name == "budget" and value == "auto") or (value is None and f.default is None):
            continue
        kind = numbers.Integral if integer else numbers.Real  # a bool is no count
        if isinstance(value, bool) or not isinstance(value, kind):
            kind = ("an integer" if integer else "a number") + ' or "auto"' * (f.name == "budget")
            raise SpecExecError(f"{f.name} must be {kind}, got {value!r}")
        setattr(opts, f.name, int(value) if integer else float(value))
    lowest = dict(budget=1, max_depth=1, width=1, branch=1, max_new_tokens=0, top_k=0)
    for name, least in (lowest | dict(lookup=0, threads=0, draft_threads=0)).items():
        if getattr(opts, name) not in ("auto", None) and getattr(opts, name) < least:
            raise SpecExecError(f"{name} must be at least {least}, got {getattr(opts, name)}")
    cores = os.cpu_count() or 1  # more draft threads than cores: torch would crash
    for name, ok, bounds in [
        # A floor: logits / temperature stays finite for any float32 logit (3.4e38 / 1e-4 fits
        # a float64), and below 1e-4 sampling is greedy decoding in all but exact ties anyway.
        ("temperature", lambda t: t == 0 or 1e-4 <= t < math.inf, "0 or in [1e-4, inf)"),
        ("top_p", lambda p: 0 < p <= 1, "in (0, 1]"),
        ("seed", lambda s: s is None or 0 <= s < 2**64, "in [0, 2**64)"),
        ("draft_temperature", lambda t: t is None or 1e-2 <= t < math.inf, "in [0.01, inf)"),
        ("threads", lambda n: (n or 0) <= cores, f"at most {cores} (the cores here)"),
        ("draft_threads", lambda n: (n or 0) <= cores, f"at most {cores} (the cores here)"),
    ]:
        if not ok(value := getattr(opts, name)):
            raise SpecExecError(f"{name} must be {bounds}, got {value}")
    return opts


def check_call(opts, options, on_tokens, Options):
    """generate's and autoregressive's `opts` or keyword `options` (not both) as an `Options`,
    checked; `on_tokens` a function."""
    if opts is not None and options:
        raise SpecExecError(f"pass opts= or options ({', '.join(options)}), not both")
    if opts is not None and not isinstance(opts, Options):
        raise SpecExecError(f"opts must be a specexec.Options, got {type(opts).__name__}")
    if on_tokens is not None and not callable(on_tokens):
        raise SpecExecError(f"on_tokens must be a function of a list of tokens, got {on_tokens!r}")
    return check_options(opts if opts is not None else Options(**options))


def check_finite(logits, role):
    """NaN or inf logits (broken weights or config) would pick garbage and run on: one float32
    sum finds them (20x cheaper than isfinite().all()), and half precision cannot overflow it."""
    import torch  # here, not above: the flags are checked before torch loads

    if not math.isfinite(logits.sum(dtype=torch.float32)):
        raise SpecExecError(
            f"the {role} model computes logits that are not finite (NaN or inf): "
            "its weights or its config.json (e.g. rms_norm_eps) are broken"
        )
