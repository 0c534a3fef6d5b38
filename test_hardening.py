"""Issue 48: nothing silently wrong in a conversation, and one line for every bad flag.

Each test is one class of what a hostile user found on the old code (a turn that failed part-way
left its caches behind, a flag that crashed or wrote where it should not, a conversation that
died on a bad line, a message that named the wrong cause), run as that user ran it: the API in
process, the command line in a subprocess. Oracles: a fresh run for what a conversation
answers, and the one-line promise of cli.py for what a refusal prints.
"""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections import namedtuple
from pathlib import Path

import pytest

import offload
import specexec
from conftest import tiny_model
from specexec_app.chat import Chat, tokenize
from specexec_tools import models
from test_cli import (
    HERE,
    PAIR,
    check_errors,
    cli_run,
    cli_run_all,
    edit_json,
    save_tiny,
    start_cli,
)

needs_pair = pytest.mark.skipif(
    not (PAIR / "target" / "config.json").exists(), reason="models/ not trained yet"
)


def chat_run(argv, turns: bytes, **env):
    """`python specexec.py --chat ARGV` with `turns` piped in as bytes (not all of them text),
    forked as test_cli's runs are (with `env` added to its environment);
    returns (exit status, stdout, stderr), decoded."""
    result = cli_run("--chat", *argv, input=turns, env=env or None)
    return result.returncode, result.stdout, result.stderr


def said(stdout):
    """What a chat printed but its figures: the summary lines carry timings."""
    return [line for line in stdout.splitlines() if not line.startswith("specexec:")]


def summaries(stdout):
    return [line for line in stdout.splitlines() if line.startswith("specexec:")]


# ---- 1. a turn that fails part-way leaves nothing behind (the API) ----


class Stop(Exception):
    """What a streaming callback raises part-way through an answer."""


@pytest.mark.parametrize("raised", [Stop, KeyboardInterrupt])
def test_a_turn_that_failed_part_way_leaves_no_caches_that_answer_the_next(raised):
    """A Chat answers a turn; the next turn leaves that conversation (a prompt that differs
    from the third token on) and its callback raises after two calls, part-way through the
    answer; the turn after returns to the first conversation. Its answer must be a fresh run's:
    the old Chat kept the failed turn's keys and values as if they were the first turn's."""
    target, draft = tiny_model("llama", 0, init=0.4), tiny_model("llama", 1, init=0.4)
    options = dict(max_new_tokens=8, budget=4)
    chat, first = Chat(target, draft, **options), [5, 6, 7, 8, 9, 10]
    answer, _ = chat.generate(first, eos_token_id=[])
    calls = []

    def stop_part_way(tokens):
        calls.append(tokens)
        if len(calls) == 2:
            raise raised

    with pytest.raises(raised):
        chat.generate([5, 6, 40, 41, 42, 43, 44], eos_token_id=[], on_tokens=stop_part_way)
    for again in (first + answer + [11, 12], [5, 6, 40, 41, 50]):  # back, then off again
        fresh, _ = specexec.generate(target, draft, again, eos_token_id=[], **options)
        assert chat.generate(again, eos_token_id=[])[0] == fresh, again


# ---- 2. thread counts that crashed torch ----


def test_draft_threads_past_the_cores_are_refused_not_a_segfault(tmp_path):
    """`--draft-threads 1000000` and draft_threads=10**6 made torch segfault mid-run."""
    with pytest.raises(specexec.SpecExecError, match="draft_threads must be at most"):
        specexec.Options(draft_threads=10**6)
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    with pytest.raises(specexec.SpecExecError, match="draft_threads must be at most"):
        specexec.generate(target, draft, [1, 2, 3], max_new_tokens=2, draft_threads=10**6)
    good = save_tiny(tmp_path / "good")
    argv = ["--target", good, "--draft", good, "--prompt", "w1", "--max-new-tokens", "2"]
    check_errors([([*argv, "--draft-threads", "1000000"], "draft_threads must be at most")])


# ---- 3. --chat refused before any weight is read ----


def test_chat_with_standard_input_closed_is_refused_at_the_flags(tmp_path):
    """`--chat <&-` loaded both models, then died in a traceback at the first read. Refused at
    the flags: before the models are even looked for (a missing folder is not reached)."""
    missing = str(tmp_path / "no-such-model")
    close_stdin = lambda: os.close(0)  # noqa: E731  (as the shell's <&- does)
    case = (["--target", missing, "--draft", missing, "--chat"],
            "--chat reads turns from standard input: it is closed",
            {"stdin": subprocess.DEVNULL, "preexec_fn": close_stdin})  # fmt: skip
    check_errors([case])


def test_chat_template_on_without_a_template_is_refused_before_any_conversion(tmp_path):
    """`--chat --chat-template on` with a tokenizer that has no template was refused at the
    first turn, after --offload ssd had converted the target; now before any weight."""
    good, copies = save_tiny(tmp_path / "good"), tmp_path / "copies"
    argv = ["--target", good, "--draft", good, "--chat", "--chat-template", "on", "--offload",
            "ssd", "--dtype", "float64", "--offload-dir", str(copies)]  # fmt: skip
    check_errors([(argv, "its tokenizer has no chat template", {"input": "w1 w2\n"})])
    assert not copies.exists() or not any(copies.iterdir()), list(copies.rglob("*"))


# ---- 4. the conversation on the command line ----


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny saved model with a word-level tokenizer (w0..w63) and no chat template."""
    return save_tiny(tmp_path_factory.mktemp("hardening") / "good")


def test_bad_turns_are_refused_in_one_line_each_and_the_conversation_goes_on(good):
    """Bytes that are not UTF-8, binary junk, a 100 kB line and a turn the context cannot hold:
    each refused in one `error:` line on stderr, echoed cut and escaped, and the conversation
    goes on as if they were never sent (oracle: the same chat without them). The old chat ended
    at the first (exit 2); echoing it whole to a strict UTF-8 stdout was a traceback."""
    pair = ["--target", good, "--draft", good, "--max-new-tokens", "4"]
    junk = [b"w1 \xff\xfe w2", b"\x00\x01\x02 binary \x7f", b"w3 \x1b[2J w4", b"w1 " * 35_000,
            b"w2 " * 126]  # fmt: skip
    turns = b"w1 w2\n" + b"\n".join(junk) + b"\nw3 w4\n"
    code, out, err = chat_run(pair, turns, PYTHONIOENCODING="utf-8")  # errors: strict
    plain_code, plain, _ = chat_run(pair, b"w1 w2\nw3 w4\n")
    assert code == plain_code == 0, err[-2000:]
    errors = err.splitlines()
    assert len(errors) == len(junk) and all(len(e) < 300 for e in errors), err[-2000:]
    overflow = "the context holds 128: send a shorter turn, or /new to start over"
    for error, wanted in zip(
        errors,
        [
            "error: the turn is not UTF-8 text (byte 0xff at character 3)",
            "error: the turn is not text (control character 0x00 at character 0)",
            "error: the turn is not text (control character 0x1b at character 3)",
            f"error: with this turn the conversation is N tokens; {overflow}",  # a long turn
            f"error: with this turn the conversation is N tokens; {overflow}",  # 126 words, after
        ],
    ):  # fmt: skip  (the conversation so far: a turn says nothing of its own length)
        assert re.sub(r"is \d+ tokens", "is N tokens", error) == wanted
    lines = [line for line in out.splitlines() if not line.startswith("specexec: ")]  # summaries
    assert all(len(line) < 220 for line in lines), "a long turn echoed whole"
    echoes = [line for line in said(out) if line.startswith("> ")]
    assert "> w1 \\xff\\xfe w2" in echoes and "> w3 \\x1b[2J w4" in echoes, echoes
    assert [line for line in said(out) if line not in echoes] == [
        line for line in said(plain) if not line.startswith("> ")
    ]
    assert len(summaries(out)) == 2, out


def test_an_answer_cut_by_the_context_says_so_in_a_chat_and_in_a_run(good):
    """A prompt of 120 tokens in a context of 128, and 20 new tokens asked for: the answer
    stops at the end of the context, and the summary says why, rather than look finished."""
    pair = ["--target", good, "--draft", good, "--max-new-tokens", "20"]
    chat, one, short = cli_run_all(
        [
            (["--chat", *pair], {"input": b"w1 " * 120 + b"\n"}),
            ([*pair, "--prompt", "w1 " * 120], {}),
            ([*pair, "--prompt", "w1 w2"], {}),  # stopped by --max-new-tokens: nothing said
        ]
    )
    assert chat.returncode == 0 and summaries(chat.stdout), chat.stderr[-2000:]
    assert summaries(chat.stdout)[0].endswith("; stopped at the end of the context"), chat.stdout
    assert one.returncode == 0, one.stderr[-2000:]
    assert summaries(one.stdout)[0].endswith("; stopped at the end of the context"), one.stdout
    assert "end of the context" not in short.stdout and short.returncode == 0


@needs_pair
def test_windows_line_ends_give_the_answers_of_unix_ones():
    """A turns file saved with CRLF line ends: each "\\r" was part of the turn, so the model
    answered other text (the project's tokenizer has a token for it). Read as "\\n" now."""
    argv = ["--target", str(PAIR / "target"), "--draft", str(PAIR / "draft")]
    turns = b"def add(a, b):\nreturn a\n/exit\nnever sent\n"
    argv += ["--max-new-tokens", "6"]
    unix, windows = cli_run_all(
        [(["--chat", *argv], {"input": lines}) for lines in (turns, turns.replace(b"\n", b"\r\n"))]
    )
    assert unix.returncode == windows.returncode == 0, windows.stderr[-2000:]
    assert said(windows.stdout) == said(unix.stdout) and len(summaries(windows.stdout)) == 2


class Live:
    """`python specexec.py --chat ...` as a background process: turns written one at a time,
    its output read as it comes, signals sent between."""

    def __init__(self, *argv):
        self.process = start_cli("--chat", *argv)  # forked, as test_cli's live runs
        self.out = b""

    def send(self, line: bytes):
        self.process.stdin.write(line + b"\n")
        self.process.stdin.flush()

    def wait_for(self, done, timeout=240):
        """Read stdout until done(all of it so far) holds; returns what was read."""
        deadline = time.monotonic() + timeout
        while not done(self.out):
            assert time.monotonic() < deadline and self.process.poll() is None, self.out
            if select.select([self.process.stdout], [], [], 0.05)[0]:
                self.out += os.read(self.process.stdout.fileno(), 65536)
        return self.out

    def finish(self):
        """Close standard input (EOF) and read what is left; (exit status, stdout, stderr)."""
        out, err = self.process.communicate(timeout=240)
        return self.process.returncode, (self.out + out).decode(), err.decode()


def test_ctrl_c_during_an_answer_stops_it_and_the_next_turn_is_a_fresh_run(good):
    """Ctrl-C once the first answer is streaming: that answer stops, the turn is dropped, and
    the conversation goes on; the next turn answers as a chat that never had the first (the
    old chat exited 130 at the first Ctrl-C). Plain decoding of 100 tokens: slow enough to be
    caught streaming."""
    argv = ["--target", good, "--draft", "none", "--max-new-tokens", "100", "--threads", "1"]
    chat = Live(*argv)
    chat.send(b"w1 w2")
    chat.wait_for(lambda out: b"> w1 w2\n" in out and out.split(b"> w1 w2\n")[1].count(b" ") > 1)
    chat.process.send_signal(signal.SIGINT)
    chat.wait_for(lambda out: b"answer stopped" in out)
    chat.send(b"w3 w4")
    code, out, err = chat.finish()  # EOF: the chat ends after this turn
    assert code == 0 and err == "", err[-2000:]
    assert "chat: answer stopped; the turn is dropped" in out and len(summaries(out)) == 1, out
    fresh_code, fresh, _ = chat_run(argv, b"w3 w4\n")
    answer = lambda text: said(text)[-1]  # noqa: E731  (the last thing said: the answer)
    assert fresh_code == 0 and answer(out) == answer(fresh), (out, fresh)


def test_ctrl_c_at_the_prompt_ends_the_run_with_130(good):
    """Ctrl-C while the chat waits for a line ends the run, quietly, as Ctrl-C does anywhere
    outside an answer: exit 130, the command line's word for it (the old chat exited 0, as if
    the input had ended), standard input still open."""
    chat = Live("--target", good, "--draft", good, "--max-new-tokens", "3")
    chat.send(b"w1 w2")
    chat.wait_for(lambda out: b"specexec:" in out)  # answered; now it waits for a line
    time.sleep(0.5)
    chat.process.send_signal(signal.SIGINT)
    chat.process.wait(timeout=60)  # ended by Ctrl-C, its standard input still open
    code, out, err = chat.finish()
    assert code == 130 and err == "" and len(summaries(out)) == 1, (code, err[-2000:])


# ---- 5. flags and the ssd tier's copy ----


def test_offload_dir_and_device_memory_that_cannot_work_are_refused_in_words(tmp_path):
    """--offload-dir '' wrote the copy into the working directory; --offload-dir naming a file
    said "File exists"; --device-memory -1 was reported in bytes (-1000000000.0)."""
    good, a_file = save_tiny(tmp_path / "good"), tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    ssd = ["--target", good, "--draft", good, "--prompt", "w1", "--offload", "ssd", "--dtype",
           "float64", "--max-new-tokens", "2"]  # fmt: skip
    check_errors([
        ([*ssd, "--offload-dir", ""], "--offload-dir is empty: name a folder for the copy"),
        ([*ssd, "--offload-dir", str(a_file)], f"--offload-dir {a_file} is a file, not a folder"),
        ([*ssd, "--device-memory", "-1"], "--device-memory -1.0: a size in GB, at least 0"),
    ])  # fmt: skip
    assert not list(HERE.glob("good-*-float64")), "a copy written into the working directory"
    for bad, message in [(123, "offload_dir must be a path"), ("", "offload_dir must be a path"),
                         (a_file, "is a file, not a folder")]:  # fmt: skip
        with pytest.raises(offload.OffloadError, match=message):
            offload.from_pretrained(good, mode="ssd", dtype="float64", offload_dir=bad)


Usage = namedtuple("Usage", "total used free")


def test_a_copy_larger_than_the_free_space_is_refused_before_its_first_byte(tmp_path, monkeypatch):
    """A disk with less room than the converted copy: refused in one line naming both sizes,
    before anything is written (the old code wrote until the disk was full, then failed)."""
    good, copies = save_tiny(tmp_path / "good"), tmp_path / "copies"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(offload.OffloadError, match=r"needs [0-9.e-]+ GB, but .* has 1e-06 GB"):
        offload.from_pretrained(good, mode="ssd", dtype="float64", offload_dir=copies)
    assert not [path for path in copies.rglob("*")], "written before it was refused"
    # the command line: one line, and no "writing a copy" before it
    small_disk = tmp_path / "small_disk.py"  # `python specexec.py` on a disk 1000 bytes free
    small_disk.write_text(
        "import runpy, shutil, sys\n"
        "from collections import namedtuple\n\n"
        "shutil.disk_usage = lambda path: namedtuple('U', 'total used free')(1, 1, 1000)\n"
        f"sys.path[0] = {str(HERE)!r}  # as `python specexec.py` sets it\n"
        f"runpy.run_path({str(HERE / 'specexec.py')!r}, run_name='__main__')\n"
    )
    argv = ["--target", good, "--draft", good, "--prompt", "w1", "--offload", "ssd", "--dtype",
            "float64", "--offload-dir", str(copies)]  # fmt: skip
    result = cli_run(*argv, script=small_disk)  # forked, as test_cli's runs
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.startswith("error: the converted copy needs"), result.stderr
    assert result.stderr.count("\n") == 1 and not list(copies.rglob("*.safetensors*"))


# ---- 6. the API's inputs, checked where they are used ----


def test_options_changed_after_they_were_made_are_checked_again_when_used():
    """An Options whose temperature was set to NaN after it was made reached sampling unchecked
    (the old code sampled token ids outside the vocabulary)."""
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    opts = specexec.Options(max_new_tokens=3, temperature=0.5)
    opts.temperature = float("nan")
    for run in (
        lambda: specexec.generate(target, draft, [1, 2, 3], opts=opts),
        lambda: specexec.autoregressive(target, [1, 2, 3], opts=opts),
        lambda: Chat(target, draft, opts),
    ):
        with pytest.raises(specexec.SpecExecError, match="temperature must be"):
            run()


def test_a_chat_of_no_model_is_refused_when_it_is_made():
    """Chat(None, draft) was accepted, and failed at its first turn."""
    draft = tiny_model("llama", 1)
    for target, draft, role in [(None, draft, "target"), (draft, "models/draft", "draft")]:
        with pytest.raises(specexec.SpecExecError, match=f"the {role} must be a causal LM"):
            Chat(target, draft)


def test_a_folder_name_given_as_the_target_is_refused_in_one_line():
    """specexec.generate("some/folder", ...) was an AttributeError traceback."""
    with pytest.raises(specexec.SpecExecError, match="the target must be a causal LM") as error:
        specexec.generate("some/folder", tiny_model("llama", 1), [1, 2, 3], max_new_tokens=2)
    assert "\n" not in str(error.value) and "got str" in str(error.value)


# ---- 7. messages that name the cause ----


def test_messages_name_the_cause_in_one_line(tmp_path):
    """A folder without tokenizer.json was "cannot load its tokenizer (... install
    sentencepiece ...)", cut; a config with intermediate_size 0 printed two lines of a torch
    warning before its error; a text file given as a model was "no such model folder"."""
    good = Path(save_tiny(tmp_path / "good"))
    no_tokenizer, zero = shutil.copytree(good, tmp_path / "no_tokenizer"), tmp_path / "zero"
    (no_tokenizer / "tokenizer.json").unlink()
    edit_json(shutil.copytree(good, zero) / "config.json", intermediate_size=0)
    text = tmp_path / "some.txt"
    text.write_text("not a model")
    pair = ["--draft", str(good), "--prompt", "w1"]
    check_errors([  # check_errors: exactly one line on stderr, `error: ...`, exit 2
        (["--target", str(no_tokenizer), *pair], "no tokenizer in this folder (no tokenizer.json)"),
        (["--target", str(zero), *pair], "weights of another shape than its config.json gives"),
        (["--target", str(text), *pair], f"{text}: a file, not a model folder"),
        (["--target", str(good / "config.json"), *pair], "a file, not a model folder"),
    ])  # fmt: skip
    assert json.loads((zero / "config.json").read_text())["intermediate_size"] == 0


# ---- 8. issue 64: a checkpoint's headers as safetensors checks them, and ten broken folders ----


DOWN = "model.layers.1.mlp.down_proj.weight"  # the tensor whose header entry is broken


def break_header(folder, what):
    """Rewrite model.safetensors' header with DOWN's entry broken as `what` says; the tensors'
    bytes as they were."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    start, end = header[DOWN]["data_offsets"]
    if what == "a range shorter than its tensor":  # the next tensor's bytes read as its own
        header[DOWN]["data_offsets"] = [start, start + 8]
    elif what == "a reversed range":
        header[DOWN]["data_offsets"] = [end, start]
    elif what == "a negative offset":
        header[DOWN]["data_offsets"] = [-8, end]
    elif what == "another dtype's size":
        header[DOWN]["dtype"] = "F16"
    elif what == "two tensors on one range":
        header["model.layers.1.mlp.up_proj.weight"]["data_offsets"] = [start, end]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])


def broken_folders(root):
    """{what is wrong: (folder, what its one line says)}: copies of one good tiny model, each
    with one thing broken as the issue found it, each of which ended in a traceback, a hang or a
    run that went on with other weights."""
    from safetensors.torch import load_file

    good = Path(save_tiny(root / "good"))
    folders = {}

    def broken(what, message):
        folder = Path(shutil.copytree(good, root / what.replace(" ", "_")))
        folders[what] = (folder, message)
        return folder

    for what in [
        "a range shorter than its tensor",
        "a reversed range",
        "a negative offset",
        "another dtype's size",
        "two tensors on one range",
    ]:
        break_header(broken(what, "corrupt safetensors shard"), what)
    for what, name in [
        ("an index naming an integer", 5),
        ("an index naming null", None),
        ("an index naming a file out of the folder", "../../../../etc/passwd"),
        ("an index naming another folder's file", "../good/model.safetensors"),
    ]:
        folder = broken(what, f"{name!r} is no file name")
        weight_map = {name: "model.safetensors" for name in load_file(good / "model.safetensors")}
        weight_map["lm_head.weight"] = name
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    folder = broken("a text file named pytorch_model.bin", "corrupt checkpoint shard")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_text("not a checkpoint\n" * 50)
    length = (100_000).to_bytes(8, "little")
    weights = broken("a header of nested lists", "header is not one") / "model.safetensors"
    weights.write_bytes(length + b"[" * 100_000)
    config = broken("bert's model type on a llama checkpoint", "the checkpoint") / "config.json"
    edit_json(config, model_type="bert", tie_word_embeddings=True)
    for layers in (10**4, 10**9):
        message = f"num_hidden_layers {layers}, but the checkpoint holds 2 decoder layers"
        edit_json(broken(f"{layers} layers", message) / "config.json", num_hidden_layers=layers)
    nan = broken("a NaN epsilon", "config.json gives rms_norm_eps nan, not a finite number")
    text = (nan / "config.json").read_text()
    (nan / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'))
    theta = broken("a negative rope_theta", "the model computes its model.rotary_emb.inv_freq")
    edit_json(theta / "config.json", rope_parameters={"rope_type": "default", "rope_theta": -1e4})
    # every pass NaN (the root of a variance below it), found by the logits only after an ssd
    # conversion had written its copy (issue 64)
    eps = broken("a negative epsilon", "config.json gives rms_norm_eps -1.0, not an epsilon >= 0")
    edit_json(eps / "config.json", rms_norm_eps=-1.0)
    return good, folders


SAID = [  # broken folders run as a user runs them too
    "a reversed range",
    "an index naming null",
    "a text file named pytorch_model.bin",
    "a header of nested lists",
    "bert's model type on a llama checkpoint",
    "1000000000 layers",
    "a NaN epsilon",
]


def test_broken_folders_are_refused_in_one_line_within_seconds(tmp_path):
    """Each folder in memory and offloaded (ssd converting into a copy: refused before the copy's
    first byte) is one OffloadError line within seconds, the layers in the billions
    too (the old code built them: killed after minutes); the command line says it in one
    `error:` line, exit 2. Oracle: the safetensors library refuses each header here too."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    good, folders = broken_folders(tmp_path)
    copies = tmp_path / "copies"
    for what, (folder, message) in folders.items():
        if "range" in what or "dtype" in what or "offset" in what:
            with pytest.raises(SafetensorError):
                load_file(folder / "model.safetensors")
        for load in (
            lambda: models.load(folder, "cpu"),
            lambda: offload.from_pretrained(
                folder, mode="ssd", dtype="float64", offload_dir=copies
            ),
        ):
            started = time.monotonic()
            with pytest.raises(offload.OffloadError, match=re.escape(message)) as caught:
                load()
            assert "\n" not in str(caught.value) and time.monotonic() - started < 10, what
        assert not copies.exists(), what
    # a home folder of no one: one line, not a RuntimeError traceback
    with pytest.raises(offload.OffloadError, match="~nosuchuser64/x: no home folder for"):
        offload.from_pretrained(good, mode="ssd", dtype="float64", offload_dir="~nosuchuser64/x")
    # as a user runs them: a few of the folders, a home folder of no one, a conversion refused
    pair = ["--draft", str(good), "--prompt", "w1", "--max-new-tokens", "2"]
    ssd = ["--offload", "ssd", "--dtype", "float64", "--offload-dir"]
    cases = [(["--target", str(folders[what][0]), *pair], folders[what][1]) for what in SAID]
    nobody = "no home folder for ~nosuchuser64"
    cases += [
        (["--target", "~nosuchuser64/model", *pair], nobody),
        (["--target", str(good), *pair, *ssd, "~nosuchuser64/x"], nobody),
    ]
    for what in ("a negative rope_theta", "a negative epsilon"):  # conversions refused
        folder, message = folders[what]
        cases.append((["--target", str(folder), *pair, *ssd, str(copies)], message))
    check_errors(cases)
    assert not copies.exists()


# ---- 9. issue 64: Ctrl-C in a conversation, its context, its chat template ----


class CutOnce(list):
    """A cache's list of layers whose first walk stops after its first layer, as Ctrl-C would
    stop it there; later walks see them all."""

    cut = False

    def __iter__(self):
        if self.cut:
            return super().__iter__()
        self.cut = True
        return self.first_then_interrupt()

    def first_then_interrupt(self):
        yield self[0]
        raise KeyboardInterrupt


def test_ctrl_c_while_a_turn_crops_the_caches_leaves_the_next_turn_a_fresh_run():
    """A turn that shares a prefix with the last crops both caches to it; Ctrl-C after the
    target cache's first layer was cropped (the others not) left the Chat holding those caches
    as whole, and the next turn raised (or ran on keys of two lengths). Oracle: a fresh run."""
    target, draft = tiny_model("llama", 0, init=0.4), tiny_model("llama", 1, init=0.4)
    options = dict(max_new_tokens=6, budget=4)
    chat, first = Chat(target, draft, **options), [5, 6, 7, 8, 9, 10]
    answer, _ = chat.generate(first, eos_token_id=[])
    chat.caches[0].layers = CutOnce(chat.caches[0].layers)
    with pytest.raises(KeyboardInterrupt):
        chat.generate([5, 6, 7, 40, 41], eos_token_id=[])  # kept: 3 tokens, the crop cut
    again = first + answer + [11, 12]
    fresh, _ = specexec.generate(target, draft, again, eos_token_id=[], **options)
    assert chat.generate(again, eos_token_id=[])[0] == fresh


def test_a_chat_template_that_runs_on_or_renders_too_much_is_refused_in_one_line(good, monkeypatch):
    """A template is a program: one that loops for ever hung the chat (as transformers hangs),
    one that renders without bound filled memory. Each now one line (the bounds made small
    here, to be quick); a template that renders well leaves no timer behind."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(good)
    messages = [{"role": "user", "content": "w1 w2"}]
    monkeypatch.setattr("specexec_app.chat.RENDER_S", 0.5)
    monkeypatch.setattr("specexec_app.chat.RENDER_CHARS", 10_000)
    for template, message in [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "its chat template fails (it did not finish rendering in 0.5 s)",
        ),
        (
            "{% for i in range(5000) %}w1 {% endfor %}",
            "its chat template renders 15,000 characters",
        ),
    ]:
        tokenizer.chat_template = template
        started = time.monotonic()
        with pytest.raises(specexec.SpecExecError, match=re.escape(message)) as caught:
            tokenize(tokenizer, messages, "auto", good)
        assert "\n" not in str(caught.value) and time.monotonic() - started < 5
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert tokenize(tokenizer, messages, "auto", good) == [1, 2]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def answers_to(turns, stdout):
    """What a chat answered each of `turns` (bytes): the line after its echo."""
    return [stdout.split(f"> {turn.decode()}\n")[1].split("\n")[0] for turn in turns]


def test_ctrl_c_during_offloaded_answers_leaves_each_next_turn_a_fresh_runs(tmp_path):
    """`--chat --offload ram`: Ctrl-C at several moments of an answer (a word in, a few, many),
    each followed by a turn answered whole. The old ring, Ctrl-C'd between a load handed to its
    reader and its queue, let the next pass load a layer over the one about to run: the next
    answer other text, exit 0 (4 of 300 through real SIGINTs). Oracle: a fresh chat of the turns
    answered whole, which must answer each alike. (A context of 1024: room for three answers.)"""
    model = save_tiny(tmp_path / "model", max_position_embeddings=1024)
    argv = ["--target", model, "--draft", "none", "--max-new-tokens", "100", "--threads", "1"]
    argv += ["--offload", "ram"]
    live, kept = Live(*argv), []
    for i, words in enumerate((1, 5, 20)):  # Ctrl-C once this many words of the answer came
        stopped, whole = f"w{i} w{i + 10}".encode(), f"w{i + 20} w{i + 30}".encode()
        live.send(stopped)
        echo = b"> " + stopped + b"\n"
        live.wait_for(lambda out: echo in out and out.split(echo)[1].count(b" ") > words)
        live.process.send_signal(signal.SIGINT)
        live.wait_for(lambda out: out.count(b"answer stopped") == i + 1)
        live.send(whole)
        live.wait_for(lambda out: len(summaries(out.decode())) == i + 1)
        kept.append(whole)
    code, out, err = live.finish()
    said_on_stderr = err.splitlines()[-1:]  # but loading the layers' progress
    assert code == 0 and "loading layers in RAM" in said_on_stderr[0], (code, err[-2000:])
    assert out.count("answer stopped") == 3, out
    fresh = cli_run(*argv, "--chat", input=b"\n".join(kept).decode() + "\n")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert answers_to(kept, out) == answers_to(kept, fresh.stdout), (out, fresh.stdout)
