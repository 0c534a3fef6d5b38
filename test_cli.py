"""Tests for cli.py, run as a user runs it: `python specexec.py ...` in a process of its own, so
that the exit status, stderr and stray log lines are what a user would see. Most runs are forked
from a process that has imported torch and transformers already (FORK_SERVER, one for the
session), live ones too (read as they write, signalled: ForkedProcess); those whose interpreter
start-up is under test start one of their own.

The promise under test: every bad input is one line `error: ...` on stderr, exit status 2, no
traceback, nothing written; Ctrl-C exits with 130 and a closed pipe quietly.
"""

import atexit
import functools
import json
import math
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch

import specexec
from conftest import CONFIGS, random_model, save_model, tiny_config, tiny_model
from specexec_app import chat, cli
from specexec_tools import OffloadError, cost_model, models

HERE = Path(__file__).resolve().parent
PAIR = HERE / "models"
needs_pair = pytest.mark.skipif(
    not (PAIR / "target" / "config.json").exists(), reason="models/ not trained yet"
)


def clean_env(**changes):
    """os.environ without the user's Hugging Face settings (HF_HUB_OFFLINE and friends), which
    would change what a hub id does, nor the command line's own (SPECEXEC_API_KEY), plus
    `changes`; one thread per run."""
    user = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SPECEXEC_")
    env = {name: value for name, value in os.environ.items() if not name.startswith(user)}
    return {**env, "OMP_NUM_THREADS": "1", **changes}


SCRIPT = HERE / "specexec.py"

# A process that has imported what `python specexec.py` imports (seconds of `import torch` and
# transformers) and forks, for each run, a child that runs specexec.py as __main__ with its own
# argv and file descriptors 0, 1, 2: each run is still a process of its own, whose exit status,
# whatever reaches its stderr (tracebacks, log lines, warnings) and interpreter exit are a user's.
# A run of another copy of the modules (installed alone) imports that copy's, torch still loaded.
# A live run's descriptors are named pipes, its output unbuffered (ForkedProcess). What a run
# is given (FORKED_ENV, a closed stdout, `ulimit -f`, root's file access dropped) its child sets
# up before specexec.py runs, as a fresh interpreter would have it (a test holds the two alike).
# Runs that need a fresh interpreter (an environment read at start-up, a function before exec,
# a stdout that is no file) start one.
FORK_SERVER = r"""
import atexit, codecs, gc, io, os, pickle, resource, runpy, signal, sys, threading

import torch, transformers, safetensors.torch, tokenizers, tqdm  # what every run imports
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import modeling_llama
import specexec, offload
from specexec_app import chat, cli
from specexec_tools import checkpoint, cost_model, models, quantize

gc.freeze()  # the children's collections leave the imported objects (and their pages) alone
# Ctrl-C raises KeyboardInterrupt, as in a Python started with SIGINT at its default (a suite
# started in the background hands its processes SIGINT ignored, which Python would keep)
signal.signal(signal.SIGINT, signal.default_int_handler)


def drop_file_access():
    # root obeying file modes, as test_cli.drop_root_file_access leaves a started run: without
    # CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2); no exec follows, so out of the effective,
    # permitted and inheritable sets themselves (capset), not only the bounding set
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: capabilities 0-31, 32-63
    assert libc.capget(header, sets) == 0, ctypes.get_errno()
    for i in range(3):
        sets[i] &= ~0b110
    assert libc.capset(header, sets) == 0, ctypes.get_errno()
    for capability in (1, 2):  # and from the bounding set, as drop_root_file_access does
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP


def serve(requests, replies, parallel):
    # Batches of runs [(argv, cwd, live, setup, stdin, stdout, stderr paths)] -> exit statuses;
    # in a child this returns its argv, its descriptors in place. live: None, or (a file for the
    # child's pid, what importing wrote) for a run whose paths are pipes (ForkedProcess). setup:
    # {env: changes, file_size: `ulimit -f`, as_user: root's file access dropped}. A path None:
    # that descriptor closed.
    while True:
        try:
            batch = pickle.load(requests)
        except EOFError:
            os._exit(0)
        statuses, running = [None] * len(batch), {}
        for i, run in enumerate(batch):
            while len(running) >= parallel:
                pid, status = os.wait()
                statuses[running.pop(pid)] = os.waitstatus_to_exitcode(status)
            pid = os.fork()
            if pid == 0:
                requests.close(), replies.close()
                argv, cwd, live, setup, *paths = run
                if live:
                    with open(live[0], "w") as pid:
                        pid.write(str(os.getpid()))
                env, file_size = setup.get("env", {}), setup.get("file_size")
                os.environ.update(env)
                if "PYTHONIOENCODING" in env:  # encoding[:errors]: the streams as Python opens
                    # them under it at start-up (stderr's errors stay backslashreplace)
                    encoding, _, errors = env["PYTHONIOENCODING"].partition(":")
                    encoding = codecs.lookup(encoding).name  # its name for it: latin-1 iso8859-1
                    for stream in sys.stdin, sys.stdout:
                        stream.reconfigure(encoding=encoding, errors=errors or "strict")
                    sys.stderr.reconfigure(encoding=encoding, errors="backslashreplace")
                if file_size is not None:  # `ulimit -f`: the process's, not read at start-up
                    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
                if setup.get("as_user"):
                    drop_file_access()
                for fd, name in ((1, "stdout"), (2, "stderr"), (0, "stdin")):  # pipes open so
                    if paths[fd] is None:  # closed (`>&-`): Python started so opens no stream
                        os.close(fd)
                        setattr(sys, name, None), setattr(sys, f"__{name}__", None)
                        continue
                    os.dup2(os.open(paths[fd], os.O_RDONLY if fd == 0 else os.O_WRONLY), fd)
                if live:  # as PYTHONUNBUFFERED=1 starts Python: each write reaches the pipe
                    os.write(2, live[1])
                    for fd, name in ((1, "stdout"), (2, "stderr")):
                        text, raw = getattr(sys, name), io.FileIO(fd, "w", closefd=False)
                        unbuffered = io.TextIOWrapper(raw, text.encoding, text.errors)
                        unbuffered.reconfigure(write_through=True)
                        setattr(sys, name, unbuffered)
                os.chdir(cwd)
                return argv
            running[pid] = i
        while running:
            pid, status = os.wait()
            statuses[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        pickle.dump(statuses, replies)
        replies.flush()


requests, replies = os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb")
pickle.dump("ready", replies)
replies.flush()
here = os.path.dirname(os.path.abspath(specexec.__file__))
sys.argv = serve(requests, replies, int(sys.argv[3]))
sys.path[0] = os.path.dirname(sys.argv[0])  # as `python specexec.py` sets it
if sys.path[0] != here:  # another copy of the modules (installed alone): those are imported
    project = ("specexec", "offload", "specexec_app", "specexec_tools")
    for name in [name for name in sys.modules if name.split(".")[0] in project]:
        del sys.modules[name]
del requests, replies, serve, here
# Then Python's own exit (its status, a traceback, threads joined, atexit, output flushed),
# but for tearing the modules down, which with torch loaded takes a second.
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    status = 0
except SystemExit as exit:
    status = exit.code or 0
    if not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
except BaseException as error:
    sys.excepthook(type(error), error, error.__traceback__)
    status = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
threading._shutdown()
atexit._run_exitfuncs()
for stream in sys.stdout, sys.stderr:
    if stream is None:  # closed at start-up: Python flushes none
        continue
    try:
        stream.flush()
    except Exception as error:
        print(f"Exception ignored in: {stream!r}\n{error!r}", file=sys.stderr)
        status = 120
if status == -signal.SIGINT:  # Python ends so, to tell the shell it was interrupted
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
os._exit(status)
"""


class ForkServer:
    """FORK_SERVER, started once and closed as Python exits; `ready` waits for its imports, `run`
    runs a batch of `python specexec.py` runs through it, `send` any batch (one at a time)."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="specexec-runs-"))
        requests, self.requests = os.pipe()
        self.replies, replies = os.pipe()
        startup = open(self.folder / "startup", "wb")  # what importing wrote: every run shows it
        parallel = str(min(4, os.cpu_count() or 1))
        self.process = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER, str(requests), str(replies), parallel],
            pass_fds=(requests, replies), cwd=HERE, env=clean_env(), stdin=subprocess.DEVNULL,
            stdout=startup, stderr=startup, start_new_session=True,
        )  # fmt: skip
        os.close(requests), os.close(replies), startup.close()
        self.requests, self.replies = os.fdopen(self.requests, "wb"), os.fdopen(self.replies, "rb")
        self.count, self.one_batch_at_a_time = 0, threading.Lock()
        self.live = []  # the ForkedProcesses started
        self.startup = None  # what importing wrote, once the server says it is ready
        atexit.register(self.close)

    def ready(self):
        """The server, its imports done."""
        if self.startup is None:
            assert self.receive(timeout=600) == "ready"
            self.startup = (self.folder / "startup").read_bytes()
        return self

    def receive(self, timeout):
        if not select.select([self.replies], [], [], timeout)[0]:
            self.close()
            raise subprocess.TimeoutExpired("python specexec.py (forked)", timeout)
        return pickle.load(self.replies)

    def run(self, cases, timeout):
        """cases: [(argv, options of cli_run: input text or bytes, stdout a file or CLOSED,
        file_size, env, preexec_fn drop_root_file_access)] -> [CompletedProcess], text as
        subprocess.run's (stdout None where it went to a file or was closed)."""
        batch, files = [], []
        for argv, options in cases:
            given, output = options.get("input"), getattr(options.get("stdout"), "name", None)
            closed = options.get("stdout") is CLOSED
            self.count += 1
            stdin, stdout, stderr = (
                self.folder / f"{self.count}.{n}" for n in ("in", "out", "err")
            )
            stdin.write_bytes(given.encode() if isinstance(given, str) else given or b"")
            stdout.touch(), stderr.touch()
            script = options.get("script", SCRIPT)
            argv = [str(script), *map(os.fsdecode, argv)]  # sys.argv, as Python decodes bytes
            paths = (str(stdin), None if closed else output or str(stdout), str(stderr))
            setup = {"env": options.get("env") or {}, "file_size": options.get("file_size")}
            setup["as_user"] = options.get("preexec_fn") is drop_root_file_access
            batch.append((argv, str(script.parent), None, setup, *paths))
            files.append((argv[1:], None if output or closed else stdout, stderr))
        statuses = self.send(batch, timeout * len(cases))
        return [
            subprocess.CompletedProcess(
                argv,
                status,
                None if out is None else as_text(out.read_bytes()),
                as_text(self.startup + err.read_bytes()),
            )
            for (argv, out, err), status in zip(files, statuses)
        ]

    def send(self, batch, timeout):
        """Runs a batch of FORK_SERVER's runs; their exit statuses once all have ended. A live
        run still going holds the server: left by a test that failed part-way, it is killed."""
        for process in self.live:
            process.kill()
        self.live.clear()
        with self.one_batch_at_a_time:
            pickle.dump(batch, self.requests)
            self.requests.flush()
            return self.receive(timeout)

    def close(self):
        self.requests.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # its runs too
            self.process.wait()
        self.replies.close()
        shutil.rmtree(self.folder, ignore_errors=True)  # closed already where a run timed out


class ForkedProcess:
    """A forked run of `python specexec.py ARGV` that runs while the test reads its output as it
    comes, writes to it and signals it: what subprocess.Popen(stdin=PIPE, stdout=PIPE,
    stderr=PIPE) of `python specexec.py` gives under PYTHONUNBUFFERED=1 (pid, pipes in bytes,
    poll, wait, communicate, send_signal)."""

    def __init__(self, server, argv, timeout=300):
        folder = Path(tempfile.mkdtemp(dir=server.folder))
        paths = [folder / name for name in ("in", "out", "err", "pid")]
        for path in paths[:3]:
            os.mkfifo(path)
        # the ends this side reads open first (at once), so that the child's writing ends open
        # at once; its standard input opens last: once this side has it, the child has all three
        self.stdout, self.stderr = (open_reading(path) for path in paths[1:3])
        run = (
            [str(SCRIPT), *argv],
            str(HERE),
            (str(paths[3]), server.startup),
            {},
            *map(str, paths[:3]),
        )
        self.waiting = ThreadPoolExecutor(max_workers=1)  # for its exit status
        self.status = self.waiting.submit(server.send, [run], timeout)
        self.stdin = open_writing(paths[0], self.status)
        self.pid = int(paths[3].read_text())
        self.returncode = None
        server.live.append(self)

    def poll(self):
        if self.status.done():
            self.returncode = self.status.result()[0]
        return self.returncode

    def wait(self, timeout=None):
        self.returncode = self.status.result(timeout)[0]
        self.waiting.shutdown()
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None):
        """Closes its standard input, reads both outputs to their ends; (stdout, stderr)."""
        self.stdin.close()
        with ThreadPoolExecutor(max_workers=1) as pool:
            out = pool.submit(self.stdout.read)
            err = self.stderr.read()
            out = out.result()
        self.wait(timeout)
        self.stdout.close(), self.stderr.close()
        return out, err


def open_reading(fifo):
    """The reading end of a named pipe, opened before any writer has."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def open_writing(fifo, status):
    """The writing end of a named pipe, once its reader (a forked run) has opened it."""
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # no reader yet: ENXIO
        except OSError:
            if status.done():  # the run ended before it opened its standard input
                status.result()  # the server's error, if any
                raise RuntimeError(f"the forked run never opened {fifo}")
            time.sleep(0.002)
            continue
        os.set_blocking(fd, True)
        return os.fdopen(fd, "wb")


def as_text(data):
    """Bytes as subprocess.run(text=True) gives them: universal newlines."""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


CLOSED = "closed"  # stdout=CLOSED: a forked run's standard output closed, as the shell's `>&-`


# What a forked run's environment may change: what is read when used (HOME, by expanduser), and
# PYTHONIOENCODING, read at start-up but set up in the child as Python sets it up. The rest
# (HF_ENDPOINT, HF_HUB_OFFLINE, ... read as huggingface_hub is imported) needs a fresh interpreter.
FORKED_ENV = {"HOME", "PYTHONIOENCODING"}


def forked(options):
    """Whether a run can be forked from a fork server: nothing of a fresh interpreter's asked (an
    environment read at start-up, a function before exec that a whole server cannot run under),
    stdout a file if any."""
    plain = set(options.get("env") or ()) <= FORKED_ENV
    plain &= options.get("preexec_fn") in (None, drop_root_file_access)
    stdout = options.get("stdout")
    to_file = (
        {"stdout"} if stdout is CLOSED or isinstance(getattr(stdout, "name", 0), str) else set()
    )
    given = {"env", "input", "script", "timeout", "preexec_fn", "file_size"} | to_file
    return plain and set(options) <= given


# The session's fork server (test_hardening's, test_docs' and test_serve's runs too), started as
# pytest collects this module, so that its imports (seconds) go on beside the collection of the
# other modules rather than before the first run.
FORKS = ForkServer()


def fork_server():
    """The fork server, ready."""
    return FORKS.ready()


def cli_run(*argv, env=None, timeout=300, script=SCRIPT, **options):
    """`python specexec.py ARGV` in a process of its own; returns the CompletedProcess. The
    timeout only catches a hang; `options` go to subprocess.run (stdout=, preexec_fn=), or to a
    forked run (stdout=CLOSED, file_size=: `ulimit -f` in bytes)."""
    return cli_run_all([(argv, {"env": env, "timeout": timeout, "script": script, **options})])[0]


def cli_run_all(cases):
    """Several CLI runs at once: [(argv, options of cli_run)] -> [CompletedProcess]; those that
    can be, forked from the fork server."""
    fork = [i for i, (_, options) in enumerate(cases) if forked(options)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = [
            None if i in fork else pool.submit(started_run, *argv, **options)
            for i, (argv, options) in enumerate(cases)
        ]
        if fork:
            timeout = max(cases[i][1].get("timeout", 300) for i in fork)
            for i, result in zip(fork, fork_server().run([cases[i] for i in fork], timeout)):
                results[i] = result
        return [r if i in fork else r.result() for i, r in enumerate(results)]


def started_run(*argv, env=None, timeout=300, script=SCRIPT, input=None, **options):
    """`python specexec.py ARGV` in a fresh interpreter: subprocess.run's CompletedProcess, its
    input text or bytes, its output text as the fork server's."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **options}
    result = subprocess.run(
        [sys.executable, str(script), *argv], env=clean_env(**(env or {})), timeout=timeout,
        cwd=script.parent, input=input.encode() if isinstance(input, str) else input, **options,
    )  # fmt: skip
    for name in ("stdout", "stderr"):  # None where it went elsewhere
        if getattr(result, name) is not None:
            setattr(result, name, as_text(getattr(result, name)))
    return result


def check_errors(cases, written=""):
    """cases: [(argv, message) or (argv, message, options of cli_run)]; each must fail in one
    clean line, having written `written` (nothing, or the prompt where it fails as it runs)."""
    results = cli_run_all([(case[0], case[2] if len(case) > 2 else {}) for case in cases])
    wrong = []
    for (argv, message, *_), result in zip(cases, results):
        err = result.stderr.splitlines()
        one_clean_line = len(err) == 1 and err[0].startswith("error: ")
        if result.returncode != 2 or not one_clean_line or message not in err[-1]:
            wrong.append(f"{argv}: exit {result.returncode}, stderr {result.stderr[-600:]!r}")
        elif result.stdout not in (written, None):  # None: stdout went elsewhere
            wrong.append(f"{argv}: wrote {result.stdout[-600:]!r}")
    assert not wrong, "\n".join(wrong)


def save_tiny(path, vocab_words=None, vocab=64, **sizes):
    """A tiny random llama (conftest.tiny_model, float32; of other `sizes`, conftest.tiny_config)
    and a word-level tokenizer whose vocabulary is `vocab_words`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = vocab_words or [f"w{i}" for i in range(64)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0])
    fast.save_pretrained(path)
    if sizes:
        layers = sizes.pop("layers", 2)
        config = tiny_config("llama", vocab, layers, tie_word_embeddings=False, **sizes)
        random_model(config).save_pretrained(path)
    else:
        tiny_model(vocab=vocab, dtype=torch.float32).save_pretrained(path)
    return str(path)


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(folder, edit):
    """edit(tensors) changes a model's tensors (a dict) in place; saved back into its folder."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_forked_run_is_set_up_as_a_fresh_interpreter(tmp_path):
    """What a forked run is given (FORKED_ENV, a closed stdout, a file size limit, root's file
    access dropped) as it sees it: its standard streams (encoding, errors, or None), its home
    folder, limit and access to a file of mode 000 are those of a fresh interpreter started so
    (the oracle: `>&-` closes its stdout before exec)."""
    import resource

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, resource, sys\n"
        "for stream in sys.stdin, sys.stdout, sys.stderr, sys.__stdout__:\n"
        "    print(stream and (stream.encoding, stream.errors), file=sys.stderr)\n"
        "print(os.path.expanduser('~/copies'), file=sys.stderr)\n"
        "print(resource.getrlimit(resource.RLIMIT_FSIZE), file=sys.stderr)\n"
        "try:\n"
        "    open('locked').close()\n"
        "    print('locked: read', file=sys.stderr)\n"
        "except PermissionError:\n"
        "    print('locked: permission denied', file=sys.stderr)\n"
    )
    (tmp_path / "locked").touch(mode=0)
    cases = [{}, {"env": {"HOME": str(tmp_path)}}, {"env": {"PYTHONIOENCODING": "ascii"}}]
    cases += [
        {"env": {"PYTHONIOENCODING": "utf-8"}},
        {"env": {"PYTHONIOENCODING": "latin-1:replace"}},
    ]
    cases += [{"stdout": CLOSED}, {"file_size": 4096}]  # room for what it prints (stderr a file)
    if os.geteuid() == 0:
        cases.append({"preexec_fn": drop_root_file_access})
    assert all(forked(options) for options in cases)
    forks = cli_run_all([([], {**options, "script": probe}) for options in cases])
    for options, fork in zip(cases, forks):
        started = dict(options)  # as subprocess.run asks for them
        if started.pop("stdout", None) is CLOSED:
            started |= {"stdout": subprocess.DEVNULL, "preexec_fn": functools.partial(os.close, 1)}
        if size := started.pop("file_size", None):
            limit = (resource.RLIMIT_FSIZE, (size, size))
            started["preexec_fn"] = functools.partial(resource.setrlimit, *limit)
        fresh = started_run(script=probe, input="", **started)  # stdin a pipe, as the fork's a file
        assert fork.returncode == fresh.returncode == 0, (options, fork.stderr, fresh.stderr)
        assert fork.stderr == fresh.stderr, options


# ---- bad options and prompts ----


def rejected_by_options(**options):
    """Whether specexec.Options refuses these (some checks arrive with the core's branch)."""
    try:
        specexec.Options(**options)
    except specexec.SpecExecError:
        return True
    return False


def test_help_lists_every_generation_option_with_its_default(capsys):
    """`--help` is built from specexec.Options: each field is there with its default, and the
    budget says it takes "auto"."""
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--help"])
    assert exit_.value.code == 0
    entries = [" ".join(entry.split()) for entry in re.split(r"\n(?=  -)", capsys.readouterr().out)]
    for f in fields(specexec.Options):
        flag = "--" + f.name.replace("_", "-")
        entry = next(entry for entry in entries if entry.startswith(flag + " "))
        metavar = (
            "N|auto" if f.name == "budget" else "X" if f.type in (float, float | None) else "N"
        )
        assert entry.startswith(f"{flag} {metavar} "), entry
        assert "(default: " in entry, entry
        if "default" not in cli.helps(specexec.Options)[f.name]:  # else the help says it in words
            assert entry.endswith(f"(default: {f.default})"), entry
    # what --help offers, the parser takes: --draft-threads 0 is torch's own setting
    assert "0: torch's setting" in next(e for e in entries if e.startswith("--draft-threads"))
    assert cli.parse_args(["--draft-threads", "0"]).draft_threads == 0


def test_bad_options_fail_in_one_line(tmp_path):
    good = save_tiny(tmp_path / "good")
    other = save_tiny(tmp_path / "other", vocab_words=[f"v{i}" for i in range(64)])
    mamba, no_window = tmp_path / "mamba", tmp_path / "no_window"  # refused by a check
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 2}))
    shutil.copy(Path(good) / "model.safetensors", mamba)  # read first: a layer count to check
    shutil.copytree(good, no_window)
    edit_json(no_window / "config.json", model_type="mistral", sliding_window=0)
    wider = save_tiny(tmp_path / "wider", vocab=80)  # the same 64 words over 80 embedding rows
    pair = ["--target", good, "--draft", good, "--prompt", "w1 w2"]
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cases = [
        (["--target", str(tmp_path / "missing"), "--draft", good], "no such model folder"),
        (["--target", good, "--draft", other], "tokenizers differ"),
        (
            ["--target", good, "--draft", other],
            "--draft int4 (the target's own 4-bit copy) or --draft none (prompt lookup alone)",
        ),  # the ways on, named
        (["--target", str(mamba), "--draft", good], "mamba is not supported: layer 0 keeps a"),
        (["--target", str(no_window), "--draft", good], "a sliding window of 0 lets a token see"),
        ([*pair, "--budget", "0"], "budget must be at least 1"),
        ([*pair, "--max-depth", "0"], "max_depth must be at least 1"),
        ([*pair, "--budget", "many"], "argument --budget: 'many' is neither an integer nor auto"),
        ([*pair, "--no-such-flag"], "unrecognized arguments"),
        ([*pair, "--prompt", ""], "the prompt is empty"),
        ([*pair, "--prompt", "w1 " * 200], "the context holds 128"),
        ([*pair, "--chat-template", "on"], "has no chat template"),
        ([*pair, "--temperature", "nan"], "nan is not a finite number"),
        ([*pair, "--temperature", "inf"], "inf is not a finite number"),
        ([*pair, "--threads", "-1"], "threads must be at least 0, got -1"),
        ([*pair, "--offload-clean"], "--offload-clean goes with --offload ssd"),
        ([*pair, "--quantize", "int8"], "--quantize goes with --offload"),
        ([*pair, "--offload", "ram", "--quantize", "int3"], "invalid choice: 'int3'"),
        ([*pair, "--device-memory", "1"], "--device-memory goes with --offload"),
        ([*pair, "--link", "0.01"], "--link goes with --offload ram"),
        ([*pair, "--offload", "ram", "--link", "0"], "--link 0.0: a speed in GB/s, above 0"),
        ([*pair, "--offload", "ram", "--device-memory", "1e-6"], "leaving too little for 2"),
        ([*pair, "--device-memory", "nan"], "nan is not a finite number"),
        (["--target", good, "--draft", "int4", "--prompt", "w1"], "int4 quantizes groups of 64"),
        (["--target", "nobody/no-such-model"], "HF_HUB_OFFLINE is set", {"env": offline}),
        (["--target", "", "--draft", good], "--target is empty"),  # not the default pair
        ([*pair, "--draft", ""], "--draft is empty"),
        ([*pair, "--prompt", b"w1 \xff"], "--prompt is not UTF-8 text (byte 0xff at character 3)"),
        ([*pair, "--max-new-tokens", "0", "--compare"], "--compare times decoding"),
        ([*pair, "--threads", "100000"], "threads must be at most"),
        (pair, "encoding ascii cannot write all", {"env": {"PYTHONIOENCODING": "ascii"}}),
        (["--target", good, "--draft", wider, "--prompt", "w1"], "draft's vocabulary (80) is"),
    ]
    if (PAIR / "prompts.json").exists():
        count = len(json.loads((PAIR / "prompts.json").read_text()))
        cases += [(["--prompt-index", str(i)], f"has 0..{count - 1}") for i in (count, -1)]
    for device in ("tpu9", "cuda", "mps", "xpu", "hip", "meta"):
        if device == "cuda" and torch.cuda.is_available():
            continue
        cases.append(([*pair, "--device", device], f"--device {device}: "))
    # checks that live in specexec.Options: the CLI only has to show them in one line
    for flag, value in [("seed", 2**64), ("temperature", 1e-320)]:
        if rejected_by_options(**{flag: value}):
            cases.append(([*pair, f"--{flag}", str(value)], "error"))
    check_errors(cases)


def test_paths_and_draft_kinds_are_refused_before_torch_loads(tmp_path):
    """A missing folder, a file given as a folder, a folder that cannot be read, a folder with no
    model, a name no hub id has, and a --draft that is none of its kinds misspelt (int3, None):
    each refused in one line by the flags' check, in a fresh interpreter whose `import torch`
    would fail (a torch of our own first on the path): answered at once, not after seconds of
    loading torch (the old code: 9-22 s)."""
    fake = tmp_path / "no_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise SystemExit('torch was imported')")
    good, a_file = save_tiny(tmp_path / "good"), tmp_path / "notes.txt"
    a_file.write_text("not a model")
    unreadable, empty = tmp_path / "unreadable", tmp_path / "empty"
    shutil.copytree(good, unreadable)
    empty.mkdir()
    fresh = {"env": {"PYTHONPATH": str(fake.parent)}}  # an interpreter without torch
    cases = [
        (["--target", str(tmp_path / "missing")], "missing: no such model folder", fresh),
        (["--target", str(a_file)], f"{a_file}: a file, not a model folder", fresh),
        (["--target", str(empty)], f"{empty}: no config.json in this folder", fresh),
        (["--target", "my model"], "--target my model: neither a model folder nor a hub", fresh),
        (["--target", good, "--draft", str(a_file)], "a file, not a model folder", fresh),
    ]
    for kind in ("int3", "INT4", "None", "4bit"):
        message = f"--draft {kind}: neither a model folder, a hub id, none, int8 nor int4"
        cases.append((["--target", good, "--draft", kind], message, fresh))
    as_user = drop_root_file_access if os.geteuid() == 0 else None
    unreadable.chmod(0)
    try:
        probe = [sys.executable, "-c", f"import os; os.listdir({str(unreadable)!r})"]
        if subprocess.run(probe, preexec_fn=as_user, capture_output=True).returncode:
            message = f"{unreadable}: cannot read this folder (permission denied)"
            cases.append((["--target", str(unreadable)], message, {**fresh, "preexec_fn": as_user}))
        check_errors(cases)
    finally:
        unreadable.chmod(0o755)
    # the same names through the API's loaders: the same words (one check of a folder)
    for name, message in [(str(a_file), "a file, not a model folder"), ("my/own/model", "no such")]:
        with pytest.raises(OffloadError, match=message):
            models.open_model(name)


def test_hub_id_offline_fails_fast(tmp_path):
    """A dead network costs one quick look, not the hub client's half minute of retries (which
    it announces), and one line; the timeout only catches a hang, so a slow machine does not
    fail this."""
    no_hub = {"env": {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path)}}
    hub_ids = ("nobody/no-such-model", "gpt2")  # an id without an organisation is one too
    for result in cli_run_all(
        [(["--target", hub_id], {**no_hub, "timeout": 600}) for hub_id in hub_ids]
    ):
        err = result.stderr.splitlines()
        assert result.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), err
        assert "127.0.0.1 cannot be reached" in err[0] and result.stdout == ""
        assert "local model folder" in result.stderr and "Retrying" not in result.stderr


# ---- damaged model folders ----


def damaged_folders(root):
    """{what is wrong: folder}, each a copy of one good tiny model with one thing broken."""
    good = Path(save_tiny(root / "good"))
    folders = {}

    def copy(name):
        folders[name] = shutil.copytree(good, root / name.replace(" ", "_"))
        return folders[name]

    weights = copy("truncated safetensors") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (copy("empty safetensors") / "model.safetensors").write_bytes(b"")
    (copy("no weights file") / "model.safetensors").unlink()
    folder = copy("index naming a missing shard")
    (folder / "model.safetensors").rename(folder / "part-1.safetensors")
    weight_map = {"model.embed_tokens.weight": "part-1.safetensors", "lm_head.weight": "part-2"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    folder = copy("corrupt bin")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle" * 100)
    edit_json(copy("wrong shapes") / "config.json", intermediate_size=72)
    edit_json(copy("more layers than the checkpoint") / "config.json", num_hidden_layers=3)
    edit_json(copy("fewer layers than the checkpoint") / "config.json", num_hidden_layers=1)
    edit_tensors(copy("junk tensor"), lambda tensors: tensors.update(junk=torch.zeros(3)))
    edit_json(copy("tied head conflict") / "config.json", tie_word_embeddings=True)  # own head
    (copy("no tokenizer files") / "tokenizer.json").unlink()
    (copy("broken tokenizer") / "tokenizer.json").write_text('{"version": ')
    (copy("tokenizer not json") / "tokenizer.json").write_text('{"model": 7}')
    save_tiny(root / "small vocab", vocab=32)  # a 64-word tokenizer over 32 embedding rows
    folders["small vocab"] = root / "small vocab"
    return good, folders


MESSAGES = {
    "truncated safetensors": "truncated",
    "empty safetensors": "truncated",
    "no weights file": "no model.safetensors or pytorch_model.bin",
    "index naming a missing shard": "missing checkpoint shard",
    "corrupt bin": "corrupt checkpoint shard",
    "wrong shapes": "weights of another shape",
    "more layers than the checkpoint": "num_hidden_layers 3, but the checkpoint holds 2 decoder",
    "fewer layers than the checkpoint": "holds 9 weights its config.json has no place for",
    "junk tensor": "holds 1 weights its config.json has no place for (junk)",
    "tied head conflict": "ties lm_head to the embedding (tie_word_embeddings), but the",
    "no tokenizer files": "no tokenizer in this folder (no tokenizer.json)",
    "broken tokenizer": "cannot load its tokenizer",
    "tokenizer not json": "cannot load its tokenizer",
    "small vocab": "the tokenizer gives ids up to 63, but the model's vocabulary holds 32",
}


def test_damaged_model_folders_fail_in_one_line_and_write_nothing(tmp_path):
    good, folders = damaged_folders(tmp_path)
    assert set(folders) == set(MESSAGES)
    offload_dir = tmp_path / "offload"
    prompt = ["--prompt", "w1 w2", "--max-new-tokens", "4"]
    ssd = ["--offload", "ssd", "--dtype", "float64", "--offload-dir", str(offload_dir)]
    # As the draft in memory; as the target in memory, and offloaded where the offloaded load
    # once let a folder through (a layer too many, a junk tensor, a head of its own that the
    # config ties) or reads it first (shards). The next test holds every folder to every tier.
    tiers = {"fewer layers than the checkpoint": [["--offload", "ram"], ssd]}
    tiers |= {"junk tensor": [["--offload", "ram"], ssd], "tied head conflict": [ssd]}
    for what in ("truncated safetensors", "corrupt bin", "index naming a missing shard"):
        tiers[what] = [ssd]
    cases = []
    for what, folder in folders.items():
        for tier in [[], *tiers.get(what, [])]:
            cases.append(
                (["--target", str(folder), "--draft", good, *prompt, *tier], MESSAGES[what])
            )
        cases.append((["--target", good, "--draft", str(folder), *prompt], MESSAGES[what]))
    check_errors(cases)
    assert not offload_dir.exists()  # refused before any conversion began


def test_both_tiers_refuse_the_same_folders_in_the_same_words(tmp_path):
    """One check of a folder's weights for every tier: models.load (in memory) and
    offload.from_pretrained (ram, ssd) refuse a folder with the same line, or all load it."""
    import offload

    _, folders = damaged_folders(tmp_path)
    ssd = {"mode": "ssd", "dtype": "float64", "offload_dir": tmp_path / "offload"}
    loads = [
        lambda folder: models.load(folder, "cpu", torch.float64),
        lambda folder: offload.from_pretrained(folder, mode="ram", device="cpu").close(),
        lambda folder: offload.from_pretrained(folder, device="cpu", **ssd).close(),
    ]
    refused = set()
    for what, folder in folders.items():
        said = []
        for load in loads:
            try:
                load(folder)
                said.append(None)
            except (specexec.SpecExecError, OffloadError) as error:
                said.append(str(error))
        assert said[0] == said[1] == said[2], (what, said)
        refused |= {what} if said[0] else set()
    assert refused == set(MESSAGES) - {
        "no tokenizer files",
        "broken tokenizer",
        "tokenizer not json",
        "small vocab",
    }


def test_sound_but_unusual_checkpoints_load_alike_in_memory_and_offloaded(tmp_path):
    """Oracle: Hugging Face's own loading. A sharded index without "metadata" (which
    transformers cannot read), a tied head stored beside the embedding it equals, and a legacy
    pytorch_model.bin (torch.save's format before torch 1.6: no zip, so no mmap) load in
    memory and offloaded, with the logits transformers gives."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import offload

    good = Path(save_tiny(tmp_path / "good"))
    sharded = Path(shutil.copytree(good, tmp_path / "sharded"))  # two shards, an index
    tensors, weight_map = load_file(sharded / "model.safetensors"), {}
    for i, names in enumerate([sorted(tensors)[::2], sorted(tensors)[1::2]]):
        save_file({name: tensors[name] for name in names}, sharded / f"part-{i}.safetensors")
        weight_map |= {name: f"part-{i}.safetensors" for name in names}
    (sharded / "model.safetensors").unlink()
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tied = Path(shutil.copytree(good, tmp_path / "tied"))
    edit_json(tied / "config.json", tie_word_embeddings=True)
    edit_tensors(tied, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 0}))
    legacy = Path(shutil.copytree(good, tmp_path / "legacy"))
    (legacy / "model.safetensors").unlink()
    state = load_file(good / "model.safetensors")
    torch.save(state, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    ssd = dict(mode="ssd", device="cpu", offload_dir=tmp_path / "copies")
    for folder, oracle in [(good, good), (sharded, good), (tied, tied), (legacy, good)]:
        expected = AutoModelForCausalLM.from_pretrained(oracle).eval()(ids).logits
        with torch.no_grad():
            in_memory = models.load(folder, "cpu", None)(ids).logits
            with offload.from_pretrained(folder, mode="ram", device="cpu") as model:
                offloaded = model(ids).logits
            if folder == legacy:  # a .bin is streamed from a converted copy
                with offload.from_pretrained(folder, **ssd) as model:
                    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(in_memory, expected, rtol=0, atol=0)
        torch.testing.assert_close(offloaded, expected, rtol=1e-5, atol=1e-5)


BAD_CONFIGS = {  # what: (config.json changes, message)
    "heads that do not divide the hidden size": (
        {"hidden_size": 30, "head_dim": None},
        "not a multiple of the number of attention heads",
    ),
    "a number as a string": ({"hidden_size": "32"}, "expected int, got str"),
    "an integer rms_norm_eps": ({"rms_norm_eps": -1}, "expected float, got int"),
    "an unknown rope type": (
        {"rope_parameters": {"rope_type": "wobbly", "rope_theta": 1e4}},
        "cannot build its model ('wobbly')",
    ),
    "an unknown activation": ({"hidden_act": "wiggle"}, "cannot build its model ('wiggle')"),
    "dtype float128": ({"dtype": "float128"}, "no attribute 'float128'"),
    "no layers": ({"num_hidden_layers": 0}, "num_hidden_layers 0, not a count >= 1"),
    "-1 layers": ({"num_hidden_layers": -1}, "num_hidden_layers -1, not a count >= 1"),
}


def test_config_values_transformers_refuses_fail_in_one_line(tmp_path):
    """Every one through both loaders; three also as a user runs them (one line, exit 2)."""
    import offload

    good = save_tiny(tmp_path / "good")
    cases = []
    for what, (changes, message) in BAD_CONFIGS.items():
        folder = shutil.copytree(good, tmp_path / what.replace(" ", "_"))
        edit_json(folder / "config.json", **changes)
        for load in (models.load, offload.from_pretrained):
            with pytest.raises(OffloadError, match=re.escape(message)) as caught:
                load(folder, device="cpu", dtype=None)
            assert "\n" not in str(caught.value)
        if what in ("a number as a string", "an unknown activation", "no layers"):
            tier = ["--offload", "ram"] if "layers" in what else []  # an empty model to stream
            cases.append(
                (["--target", str(folder), "--draft", good, "--prompt", "w1", *tier], message)
            )
    check_errors(cases)


BROKEN_FAMILY_CONFIGS = {  # what: (family in conftest.CONFIGS, config.json changes, message)
    "more experts per token than experts": (
        "mixtral",
        {"num_experts_per_tok": 5},
        "config.json is broken: num_experts_per_tok is 5, more than its num_local_experts (4)",
    ),
    "no experts": (
        "mixtral",
        {"num_local_experts": 0},
        "config.json is broken: num_local_experts is 0: a mixture of no experts",
    ),
    "sliding layers without a window": (
        "gemma3",
        {"sliding_window": None},
        "config.json is broken: sliding_window is null, yet layer_types has sliding_attention",
    ),
}


def test_broken_configs_of_supported_families_say_the_config_is_broken(tmp_path, capfd):
    """A family a tree runs, with a config no pass can run: the config is named, with its field,
    not the family as unsupported; in memory, offloaded and as a user runs it. A config
    relabelled as a recurrent family is refused with nothing of transformers' own said first."""
    import offload

    good = save_tiny(tmp_path / "good")
    cases = []
    for what, (family, changes, message) in BROKEN_FAMILY_CONFIGS.items():
        folder = tmp_path / what.replace(" ", "_")
        save_model(folder, CONFIGS[family]())
        edit_json(folder / "config.json", **changes)
        for load in (models.load, offload.from_pretrained):
            with pytest.raises(OffloadError, match=re.escape(f"{folder}: {message}")):
                load(folder, device="cpu", dtype=None)
        cases.append((["--target", str(folder), "--draft", good, "--prompt", "w1"], message))
    capfd.readouterr()
    for family in ("mamba", "jamba"):
        relabelled = shutil.copytree(good, tmp_path / family)
        edit_json(relabelled / "config.json", model_type=family)
        message = f"{family} is not supported: layer 0 keeps a LinearAttentionLayer"
        for load in (models.load, offload.from_pretrained):
            with pytest.raises(OffloadError, match=message):
                load(relabelled, device="cpu", dtype=None)
        assert capfd.readouterr().err == ""  # transformers' logging, at its default level
        cases.append((["--target", str(relabelled), "--draft", good, "--prompt", "w1"], message))
    check_errors(cases)


def overflowing_head(tensors):
    """Final norm and head weights of 1e30: each product in the head's matmul overflows float32
    (a negative rms_norm_eps did this once; it is refused as config.json is read now)."""
    tensors["model.norm.weight"].fill_(1e30)
    tensors["lm_head.weight"].fill_(1e30)


def test_non_finite_logits_stop_the_run_naming_the_model(tmp_path):
    """NaN weights, an infinite norm, a head that overflows: NaN logits would pick id 0 (an EOS)
    and end the run as if it were done. A weight read whole (in memory, into RAM, into a copy,
    into the target's own quantized copy as draft) is refused as it is read, naming it and the
    folder; one the ssd tier streams from the checkpoint is found by the logits it gives, and
    one line names the model that computes them."""
    good = Path(save_tiny(tmp_path / "good"))
    nan, inf, big = (shutil.copytree(good, tmp_path / name) for name in ("nan", "inf", "big"))
    edit_tensors(nan, lambda t: t["model.layers.1.mlp.down_proj.weight"][0].fill_(float("nan")))
    edit_tensors(inf, lambda t: t["model.norm.weight"][3].fill_(float("inf")))
    edit_tensors(big, overflowing_head)  # finite weights read whole, the logits not
    wide = save_tiny(tmp_path / "wide", hidden_size=64, intermediate_size=128)  # int4's groups
    wide_nan = shutil.copytree(wide, tmp_path / "wide_nan")
    edit_tensors(wide_nan, lambda t: t["model.layers.1.mlp.up_proj.weight"][5].fill_(math.nan))
    run = ["--prompt", "w1 w2", "--max-new-tokens", "4"]
    copies = ["--offload-dir", str(tmp_path / "copies")]
    target = "the target model computes logits that are not finite (NaN or inf)"
    weights = "the checkpoint's model.layers.1.mlp.down_proj.weight holds NaN or inf"
    check_errors(
        [
            (["--target", str(nan), "--draft", str(good), *run, "--offload", "ssd"], target),
            (
                ["--target", str(good), "--draft", str(big), *run, "--budget", "4"],
                "the draft model computes",
            ),  # a fixed budget: auto would not try so dear a draft
        ],
        written="w1 w2\n--- continuation ---\n",  # the prompt, then the error
    )
    up = "checkpoint's model.layers.1.mlp.up_proj.weight holds NaN or inf: its weights are broken"
    read_whole = [
        (["--target", str(nan), "--draft", str(good), *run], f"{nan}: {weights}"),
        (["--target", str(good), "--draft", str(nan), *run], f"{nan}: {weights}"),
        (["--target", str(nan), "--draft", str(good), *run, "--offload", "ram"], weights),
        (
            [*["--target", str(nan), "--draft", str(good), *run], "--offload", "ssd"]
            + ["--dtype", "float64", *copies],
            weights,
        ),
        (
            ["--target", str(inf), "--draft", str(good), *run, "--offload", "ssd"],
            "the checkpoint's model.norm.weight holds NaN or inf",
        ),
        # the target's own copy as draft: the target's weights are to blame, not "the draft"
        # (ssd streams the target from its checkpoint: only the draft reads the weight)
        (["--target", str(wide_nan), "--draft", "int4", *run], f"{wide_nan}: the {up}"),
        (["--target", str(wide_nan), "--draft", "int4", *run, "--offload", "ssd"], up),
    ]
    # Found as the weights are read: after the progress of that read (on stderr), the error
    for (argv, message), result in zip(read_whole, cli_run_all([(c[0], {}) for c in read_whole])):
        said = result.stderr.splitlines()[-1:]
        assert result.returncode == 2 and result.stdout == "", (argv, result.stderr[-2000:])
        assert said[0].startswith("error: ") and message in said[0], (argv, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "copies").exists() or not any((tmp_path / "copies").iterdir())


def drop_root_file_access():
    """In the child, before exec: root without CAP_DAC_OVERRIDE/READ_SEARCH obeys file modes (a
    forked run's child drops them as FORK_SERVER's drop_file_access)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # PR_CAPBSET_DROP = 24
        libc.prctl(24, capability, 0, 0, 0)


def test_unreadable_weights_and_folders_fail_in_one_line(tmp_path):
    """A hub cache file of mode 600 that belongs to another user, say."""
    good = Path(save_tiny(tmp_path / "good"))
    weights, folder = (shutil.copytree(good, tmp_path / name) for name in ("weights", "folder"))
    as_user = drop_root_file_access if os.geteuid() == 0 else None
    (weights / "model.safetensors").chmod(0)
    folder.chmod(0)
    try:
        probe = [sys.executable, "-c", f"open({str(weights / 'model.safetensors')!r})"]
        if subprocess.run(probe, preexec_fn=as_user, capture_output=True).returncode == 0:
            pytest.skip("this user reads files of mode 000")
        run, user = ["--draft", str(good), "--prompt", "w1"], {"preexec_fn": as_user}
        unreadable = f"cannot read {weights}/model.safetensors: Permission denied"
        check_errors(
            [
                (["--target", str(weights), *run], unreadable, user),
                (["--target", str(weights), *run, "--offload", "ram"], unreadable, user),
                (["--target", str(folder), *run], f"{folder}: cannot read this folder", user),
            ]
        )
    finally:
        folder.chmod(0o755)


# ---- the ssd tier's converted copy ----


def test_a_checkpoint_replaced_in_place_is_converted_again(tmp_path):
    """Other weights of the same size, their modification time restored (`touch -r`; `cp -p`,
    `rsync -a` and `tar x` restore it too): the copy of the old weights is not reused. Oracle:
    the new weights in memory."""
    import offload

    folder = Path(save_tiny(tmp_path / "model"))
    ssd = dict(mode="ssd", device="cpu", dtype=torch.float64, offload_dir=tmp_path / "copies")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), offload.from_pretrained(folder, **ssd) as model:
        old = model(ids).logits
    weights = folder / "model.safetensors"
    before = weights.stat()
    edit_tensors(folder, lambda t: t["model.layers.0.mlp.up_proj.weight"].mul_(-1))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size
    assert weights.stat().st_mtime_ns == before.st_mtime_ns
    with torch.no_grad(), offload.from_pretrained(folder, **ssd) as model:
        new = model(ids).logits
        expected = models.load(folder, "cpu", torch.float64)(ids).logits
    torch.testing.assert_close(new, expected, rtol=0, atol=0)
    assert not torch.equal(new, old)


def test_a_converted_copy_that_cannot_be_read_is_named_as_unread(tmp_path):
    """Not "cannot write offload folder": reading one of its files failed."""
    import offload

    good = save_tiny(tmp_path / "good")
    copies = tmp_path / "copies"
    offload.from_pretrained(good, mode="ssd", dtype="float64", offload_dir=copies).close()
    layer = next(copies.glob("*/layer_001.safetensors"))
    as_user = drop_root_file_access if os.geteuid() == 0 else None
    layer.chmod(0)
    probe = [sys.executable, "-c", f"open({str(layer)!r})"]
    if subprocess.run(probe, preexec_fn=as_user, capture_output=True).returncode == 0:
        pytest.skip("this user reads files of mode 000")
    ssd = ["--offload", "ssd", "--dtype", "float64", "--offload-dir", str(copies)]
    message = f"cannot read the converted copy's {layer} (Permission denied); delete {layer.parent}"
    check_errors(
        [
            (
                ["--target", good, "--draft", good, "--prompt", "w1", *ssd],
                message,
                {"preexec_fn": as_user},
            )
        ]
    )


def test_offload_clean_that_could_not_remove_the_copy_is_refused_before_the_run(tmp_path):
    """A finished copy in a read-only --offload-dir is reused without a write, and could not be
    removed after the run: refused before any weight is read, nothing written."""
    import offload

    good = save_tiny(tmp_path / "good")
    copies = tmp_path / "copies"
    offload.from_pretrained(good, mode="ssd", dtype="float64", offload_dir=copies).close()
    as_user = drop_root_file_access if os.geteuid() == 0 else None
    copies.chmod(0o555)
    try:
        probe = [sys.executable, "-c", f"open({str(copies / 'x')!r}, 'w')"]
        if subprocess.run(probe, preexec_fn=as_user, capture_output=True).returncode == 0:
            pytest.skip("this user writes into folders of mode 555")
        ssd = ["--offload", "ssd", "--dtype", "float64", "--offload-dir", str(copies)]
        run = ["--target", good, "--draft", good, "--prompt", "w1", *ssd]
        message = f"--offload-clean: the converted copy {next(copies.iterdir())} could not be"
        check_errors([([*run, "--offload-clean"], message, {"preexec_fn": as_user})])
        kept = cli_run(*run, "--max-new-tokens", "2", preexec_fn=as_user)  # without: it runs
        assert kept.returncode == 0, kept.stderr[-2000:]
    finally:
        copies.chmod(0o755)


def test_sigterm_while_converting_removes_the_half_written_copy(tmp_path):
    """As Ctrl-C does; the process still ends by SIGTERM."""
    wide = save_tiny(tmp_path / "wide", layers=24, hidden_size=256, intermediate_size=512)
    copies = tmp_path / "copies"
    process = start_cli(
        "--target", wide, "--draft", wide, "--prompt", "w1", "--offload", "ssd",
        "--dtype", "float64", "--offload-dir", str(copies),
    )  # fmt: skip
    while not list(copies.glob("*/layer_*")) and process.poll() is None:
        time.sleep(0.002)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == -signal.SIGTERM, err[-2000:]
    assert list(copies.iterdir()) == [], err[-2000:]


def test_sigterm_during_a_pass_leaves_the_copy_whole(tmp_path, capsys):
    """SIGTERM while a run streams its finished copy (generating, mid-pass most likely): the
    process ends by SIGTERM, the copy's files as they were, and the next run reuses it."""
    import offload

    model = save_tiny(tmp_path / "model", max_position_embeddings=4096)
    copies = tmp_path / "copies"
    ssd = dict(mode="ssd", dtype="float64", offload_dir=copies)
    offload.from_pretrained(model, **ssd).close()
    written = {path: path.read_bytes() for path in copies.rglob("*") if path.is_file()}
    process = start_cli(
        "--target", model, "--draft", "none", "--prompt", "w1", "--max-new-tokens", "4000",
        "--offload", "ssd", "--dtype", "float64", "--offload-dir", str(copies),
    )  # fmt: skip
    seen = b""
    while seen.count(b" ") < 20 and (chunk := process.stdout.read1(4096)):  # well under way
        seen += chunk
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == -signal.SIGTERM, err[-2000:]
    capsys.readouterr()
    assert {path: path.read_bytes() for path in copies.rglob("*") if path.is_file()} == written
    offload.from_pretrained(model, **ssd).close()
    assert "writing" not in capsys.readouterr().err  # reused as it is: whole


def test_bad_input_with_stderr_on_a_full_device_still_exits_2(tmp_path):
    """The error line cannot be written; the status still says bad input."""
    good = save_tiny(tmp_path / "good")
    with open("/dev/full", "w") as full:
        result = cli_run("--target", good, "--draft", good, "--budget", "0", stderr=full)
    assert result.returncode == 2


# ---- an output that cannot be written, Ctrl-C, damaged default prompts ----


def test_output_that_cannot_be_written_fails_in_one_line(tmp_path):
    """stdout on a full disk (/dev/full), over `ulimit -f`, or closed (`>&-`); forked runs, whose
    limit and closed stdout test_a_forked_run_is_set_up_as_a_fresh_interpreter holds."""
    good = save_tiny(tmp_path / "good")
    run = ["--target", good, "--draft", good, "--prompt", "w1 w2", "--max-new-tokens", "60"]
    with open("/dev/full", "w") as full, open(tmp_path / "small.txt", "w") as small:
        check_errors(
            [
                (["--help"], "cannot write the output (No space left on device)", {"stdout": full}),
                (run, "cannot write the output (No space left on device)", {"stdout": full}),
                (
                    run,
                    "cannot write the output (File too large)",
                    {"stdout": small, "file_size": 64},
                ),
                (run, "output is closed", {"stdout": CLOSED}),
            ]
        )


def test_ctrl_c_while_importing_exits_130_quietly(tmp_path):
    """The first seconds go to `import torch`; Ctrl-C there is no traceback either."""
    good = save_tiny(tmp_path / "good")
    reset_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    process = subprocess.Popen(  # a fresh interpreter: its start-up is what this tests
        [sys.executable, str(SCRIPT), "--target", good, "--draft", good, "--prompt", "w1"],
        env=clean_env(),
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=reset_sigint,
    )
    maps = Path(f"/proc/{process.pid}/maps")
    while process.poll() is None and "libtorch" not in maps.read_text():  # torch is loading
        time.sleep(0.002)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130 and err == b"" and out == b"", err


def copy_modules(folder):
    """The modules alone, as `pip install .` puts them, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    import tomllib

    modules = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]
    for module in modules["py-modules"]:
        shutil.copy(HERE / f"{module}.py", folder / f"{module}.py")
    for package in modules["packages"]:
        shutil.copytree(
            HERE / package, folder / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return folder / "specexec.py"


def test_damaged_default_prompts_fail_in_one_line(tmp_path):
    good = save_tiny(tmp_path / "good")
    cases = {
        "not json": '[{"prompt": "x"}, {"prom',
        "no prompt": '[{"text": "x"}]',
        "a prompt that is no text": '[{"prompt": 7}]',
        "no list": '{"prompt": "x"}',
    }
    runs = []
    for what, text in cases.items():
        script = copy_modules(tmp_path / what.replace(" ", "_"))
        (script.parent / "models").mkdir()
        (script.parent / "models" / "prompts.json").write_text(text)
        argv = ["--target", good, "--draft", good, "--prompt-index", "0"]
        runs.append((argv, "prompts.json is damaged (", {"script": script}))
    check_errors(runs)


# ---- chat templates ----

TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """The project's pair as an instruct pair: a chat template and two new special tokens, with
    embeddings grown to hold them (as fine-tuning would); also the same tokenizer beside the
    original weights, whose vocabulary is now too small for it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (PAIR / "target" / "config.json").exists():
        pytest.skip("models/ not trained yet")
    root = tmp_path_factory.mktemp("chat")
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = TEMPLATE
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(PAIR / name)
        model.resize_token_embeddings(len(tokenizer))
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        unresized = root / f"{name}-unresized"
        unresized.mkdir()
        for file in (PAIR / name).iterdir():
            (unresized / file.name).symlink_to(file)
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (root / name / file).exists():
                (unresized / file).unlink(missing_ok=True)
                shutil.copy(root / name / file, unresized / file)
    return root, tokenizer


def test_chat_template_tokens_are_the_rendered_text(chat_pair):
    """Oracle: render the template to text, then tokenize the text."""
    _, tokenizer = chat_pair
    messages = [{"role": "user", "content": "def add(a, b):"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    for mode in ("auto", "on"):
        ids = chat.tokenize(tokenizer, "def add(a, b):", mode, "chat")
        assert ids == expected and all(isinstance(i, int) for i in ids)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|user|>") == len(tokenizer) - 2
    plain = chat.tokenize(tokenizer, "def add(a, b):", "off", "chat")
    assert plain == tokenizer("def add(a, b):")["input_ids"]


def test_cli_runs_through_a_chat_template(chat_pair):
    root, _ = chat_pair
    pair = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    common = [*pair, "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--compare"]
    runs = [
        [*common, "--chat-template", "auto"],
        [*common, "--chat-template", "on"],
        [*common, "--chat-template", "on", "--offload", "ram"],
        [*common, "--chat-template", "off"],
    ]
    results = cli_run_all([(argv, {}) for argv in runs])
    for argv, result in zip(runs, results):
        assert result.returncode == 0, (argv, result.stderr[-2000:])
        prompt = result.stdout.split("--- continuation ---")[0]
        assert ("<|user|>def add(a, b):\n<|assistant|>" in prompt) == ("off" not in argv), prompt
        assert "identical output" in result.stdout and "Traceback" not in result.stderr
    unresized = ["--target", str(root / "target-unresized"), "--draft", str(root / "draft")]
    check_errors([([*unresized, "--prompt", "x"], "but the model's vocabulary holds 4096")])


# ---- the project's own pair, run as a user runs it ----


@needs_pair
def test_cli_runs_with_no_flags_and_compares():
    result = cli_run("--max-new-tokens", "24", "--compare", "--threads", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    prompt, continuation = result.stdout.split("\n--- continuation ---\n")  # piped: a separator
    assert "per pass" in continuation and "tokens/s" in continuation
    assert "identical output" in continuation and "threads 1" in continuation
    assert "seed" not in continuation  # greedy: no seed to report
    assert "Loading weights" not in result.stderr and "\x1b[" not in result.stdout


@needs_pair
def test_sampling_prints_the_seed_that_reproduces_it():
    first = cli_run("--max-new-tokens", "16", "--temperature", "0.9")
    assert first.returncode == 0, first.stderr[-2000:]
    seed = first.stdout.rsplit("seed ", 1)[1].split()[0]
    again = cli_run("--max-new-tokens", "16", "--temperature", "0.9", "--seed", seed)
    assert again.stdout.split("\n\nspecexec:")[0] == first.stdout.split("\n\nspecexec:")[0]


def start_cli(*argv):
    """`python specexec.py ARGV` as a live process that Ctrl-C (SIGINT) interrupts, forked (its
    pipes and signals a process's own; its interpreter's start-up is not what these test)."""
    return ForkedProcess(fork_server(), argv)


@needs_pair
def test_output_into_head_exits_quietly():
    process = start_cli("--max-new-tokens", "200")
    assert len(process.stdout.read(50)) == 50
    process.stdout.close()  # the reader leaves, as `| head -c 50` does
    process.wait(timeout=300)
    err = process.stderr.read().decode()
    assert process.returncode in (0, 1) and err == "", err


@needs_pair
def test_ctrl_c_while_streaming_exits_130_quietly():
    process = start_cli("--max-new-tokens", "400")
    seen = b""
    while b"--- continuation ---" not in seen and (chunk := process.stdout.read1(4096)):
        seen += chunk
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130 and b"Traceback" not in err, err


@needs_pair
def test_ctrl_c_while_converting_leaves_no_finished_looking_folder(tmp_path):
    """Interrupted while the ssd tier writes its copy: exit 130, and the folder is never taken
    for a finished one (no manifest unless every layer is there)."""
    process = start_cli(
        "--offload", "ssd", "--dtype", "float64", "--offload-dir", str(tmp_path), "--prompt", "x"
    )
    while not any(tmp_path.rglob("*.safetensors*")) and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert process.returncode in (0, 130) and b"Traceback" not in err, err
    for manifest in tmp_path.rglob("manifest.json"):
        layers = json.loads(manifest.read_text())["layers"]
        assert len(list(manifest.parent.glob("layer_*.safetensors"))) == layers


@needs_pair
def test_offload_dir_expands_home(tmp_path):
    argv = ["--offload", "ssd", "--dtype", "float64", "--offload-dir", "~/copies"]
    result = cli_run(*argv, "--max-new-tokens", "4", env={"HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert list((tmp_path / "copies").glob("*/manifest.json"))
    assert not (HERE / "~").exists()


@needs_pair
def test_offload_clean_removes_the_copy_and_in_place_reads_write_none(tmp_path):
    ssd = ["--offload", "ssd", "--offload-dir", str(tmp_path), "--max-new-tokens", "4"]
    kept = cli_run(*ssd, "--dtype", "float64")
    assert kept.returncode == 0 and "--offload-clean removes it" in kept.stderr, kept.stderr
    cleaned = cli_run(*ssd, "--dtype", "float64", "--offload-clean")
    assert cleaned.returncode == 0 and "removed the converted copy" in cleaned.stderr
    assert not list(tmp_path.iterdir())
    in_place = cli_run(*ssd, "--dtype", "float16")  # the checkpoint's own dtype: read in place
    assert in_place.returncode == 0 and not list(tmp_path.iterdir()), in_place.stderr


@needs_pair
def test_quantized_offloaded_target_decodes_as_itself(tmp_path):
    """--quantize int4 streams 4-bit weights; SpecExec equals plain decoding of that same target."""
    quantized = [
        "--offload", "ssd", "--quantize", "int4", "--offload-dir", str(tmp_path),
        "--max-new-tokens", "16", "--compare", "--offload-clean",
    ]  # fmt: skip
    result = cli_run(*quantized)
    assert result.returncode == 0, result.stderr
    assert "identical output" in result.stdout and "int4" in result.stderr
    assert not list(tmp_path.iterdir())  # the quantized copy is gone again


@needs_pair
def test_self_draft_and_resident_layers_decode_as_the_target():
    """--draft int4: the target's own 4-bit copy drafts, and the output is the target's own;
    --device-memory keeps some of the offloaded target's layers and the summary says how many."""
    runs = cli_run_all(
        [
            (["--draft", "int4", "--max-new-tokens", "16", "--compare"], {}),
            # 256: the KV cache for trees of 256 (auto keeps room for 1024)
            ("--offload ram --device-memory 0.02 --max-new-tokens 8 --budget 256".split(), {}),
        ]
    )
    for result in runs:
        assert result.returncode == 0, result.stderr[-2000:]
    assert "identical output" in runs[0].stdout
    assert "auto decoded plainly: its int4 draft is the target's size" in runs[0].stdout
    assert "not SpecExec's regime" not in runs[0].stdout  # the cause is said once: the draft
    # 20 MB: the float32 head and KV cache (~11 MB) and three 3.4 MB slots: one layer stays
    assert "offload (ram): 1 of 6 layers resident; the last target pass moved 17.1 MB" in (
        runs[1].stdout
    )


@needs_pair
def test_a_target_of_another_tokenizer_runs_on_lookup_alone_without_a_draft(tmp_path):
    """--target of another tokenizer and no --draft: the project's draft cannot serve it, so the
    run goes on with prompt lookup alone, one line saying so and how to add a draft (the old run
    stopped at the tokenizers). Oracle: the same run with --draft none. Named as --draft, the
    project's draft is refused in words that name the ways on."""
    other = save_tiny(tmp_path / "other", vocab_words=[f"v{i}" for i in range(64)])
    run = ["--target", other, "--prompt", "v1 v2 v3 v1 v2", "--max-new-tokens", "8"]
    runs = cli_run_all([(run, {}), ([*run, "--draft", "none"], {}), ([*run, "--lookup", "0"], {})])
    alone, _, plain = runs
    for result in runs:
        assert result.returncode == 0, result.stderr[-2000:]
    said = alone.stdout.splitlines()[0]
    assert said.startswith(f"(the project's draft has another tokenizer than {other}: prompt ")
    assert "lookup alone drafts" in said and "--draft int4" in said and "--draft FOLDER" in said
    assert plain.stdout.splitlines()[0].endswith(
        "it decodes plainly (--lookup 0). For a draft model: --draft int4, the target's own "
        "4-bit copy, or --draft FOLDER, a model of its family)"
    )
    texts = [r.stdout.split("--- continuation ---")[1].split("specexec:")[0] for r in runs]
    assert texts[0] == texts[1] == texts[2]
    passes = re.findall(r"([\d.]+) draft passes per target pass", alone.stdout)
    assert passes in ([], ["0.0"]), alone.stdout  # no draft model ran
    message = "--draft int4 (the target's own 4-bit copy) or --draft none (prompt lookup alone)"
    check_errors([([*run, "--draft", str(PAIR / "draft")], message)])


@dataclass
class Measured:
    """What cli.why_plain reads of auto's cost model: the rates it predicts, the gains of the
    trees it saw, a draft pass's seconds, and a target pass's over n tokens (first + per * n)."""

    predicted: dict  # (budget, depth) -> tokens/s
    gains: dict  # (budget, depth) -> (tokens a step, draft passes)
    draft_s: float
    first: float
    per: float

    def rates(self):
        return self.predicted

    def t_target(self, n):
        return self.first + self.per * n


def auto_note(policy, plain=30, steps=40, offload=None):
    """why_plain of a run of `steps` target passes, `plain` of them without a tree."""
    budgets = [(0, 0)] * plain + [(8, 2)] * (steps - plain)
    return cli.why_plain(
        types.SimpleNamespace(policy=policy, budgets=budgets, steps=steps), offload
    )


def test_auto_notes_name_the_one_cause_auto_acted_on():
    """Where auto decoded mostly plainly, its note names one cause, the larger of what its best
    tree costs beside a plain step (oracle: those costs, set here): the draft's passes (the int4
    self-draft beside a streamed target once read "see --offload ssd" on a run already streamed),
    or the target's pass over the tree (compute); a tree rated faster by the end is no cause
    against trees (it once read "146 tokens/s against 64" beside "trees do not pay"); two
    different figures never print alike (once "1 tokens/s against 1")."""
    # the target's own int4 copy beside a target streamed from disk: 4 draft passes cost 1.2 s
    dear = Measured({(0, 0): 1.21, (32, 4): 0.94}, {(32, 4): (2.9, 4.0)}, 0.3, 0.8, 1e-5)
    # in memory: the pass over a tree of 8 costs 0.016 s more, 2 draft passes 0.001 s
    compute = Measured({(0, 0): 64.0, (8, 2): 40.2}, {(8, 2): (1.9, 2.0)}, 5e-4, 0.015, 0.002)
    late = Measured({(0, 0): 64.0, (8, 2): 146.0}, {(8, 2): (3.9, 2.0)}, 5e-4, 0.015, 0.002)
    close = Measured({(0, 0): 1.0004, (8, 2): 1.0001}, {(8, 2): (1.9, 2.0)}, 0.1, 0.8, 1e-5)
    notes = {
        "dear": auto_note(dear, offload="ssd"),
        "compute": auto_note(compute),
        "compute, streamed": auto_note(compute, offload="ssd"),
        "late": auto_note(late),
        "close": auto_note(close),
    }
    for what, note in notes.items():
        tree, plain = re.search(r"([\d.]+) tokens/s against ([\d.]+)", note).groups()
        assert tree != plain and "\n" not in note and note.count("cause") <= 1, (what, note)
        assert ("The cause:" in note) == (float(tree) < float(plain)), (what, note)
    assert "The cause: its draft" in notes["dear"] and "--offload ssd" not in notes["dear"]
    assert "The cause: its draft" in notes["close"]
    assert (
        "The cause: the target's pass" in notes["compute"] and "--offload ssd" in notes["compute"]
    )
    assert "--offload ssd" not in notes["compute, streamed"]
    assert (
        "146 tokens/s against 64 plainly: until late in the run, its trees measured slower"
        in (notes["late"])
    )
    assert auto_note(compute, plain=19) is None  # mostly trees: nothing to explain
    assert auto_note(cost_model.FixedBudget(0, 0, why="a cause of its own")) is None


def test_a_run_that_decoded_plainly_says_why_once(tmp_path):
    """A draft that never guesses the target (another random model), and no lookup (the random
    target falls into loops that lookup would guess, and whether its trees then pay is timing's
    call: on a busy machine auto ran them at 0.57x): auto decodes plainly, and one note says
    why: the one cause it acted on (of two tiny models, the draft's passes or the target's pass
    over the tree, whichever cost more in this run: timing decides), the tree's figure below
    plain decoding's; or, where its trees were rated faster only at the end, that they measured
    slower until then, and no cause. --compare's regime note, a second cause, stays unsaid (it
    said that the pass in memory was to blame, beside the draft)."""
    target, draft = save_tiny(tmp_path / "target"), save_tiny(tmp_path / "draft", layers=1)
    run = ["--target", target, "--draft", draft, "--prompt", "w1 w2 w3", "--max-new-tokens", "60"]
    run += ["--lookup", "0"]
    result = cli_run(*run, "--compare")
    assert result.returncode == 0 and "identical output" in result.stdout, result.stderr[-2000:]
    notes = [line for line in result.stdout.splitlines() if line.startswith("(")]
    assert len(notes) == 1 and notes[0].startswith("(auto decoded plainly in "), result.stdout
    figures = re.search(r"([\d.e+]+) tokens/s against ([\d.e+]+) plainly", notes[0]).groups()
    tree, plain = map(float, figures)
    if "until late in the run, its trees measured slower" in notes[0]:  # lookup's trees, rated
        assert "The cause" not in notes[0] and tree > plain, notes[0]  # faster only at the end
    else:
        assert notes[0].count("The cause: ") == 1 and tree < plain, notes[0]
        assert "The cause: its draft, whose passes cost" in notes[0] or (
            "The cause: the target's pass, " in notes[0]
        ), notes[0]


def test_installed_without_the_clone_says_where_the_default_pair_is(tmp_path):
    """`pip install .` puts the modules in site-packages; models/ stays in the clone."""
    script = copy_modules(tmp_path)
    pair = ["--target", str(PAIR / "target"), "--draft", str(PAIR / "draft")]
    no_pair, no_prompt = cli_run_all([([], {"script": script}), (pair, {"script": script})])
    assert no_pair.returncode == 2 and no_pair.stderr.count("\n") == 1
    assert "the default pair lives in a clone's models/" in no_pair.stderr
    assert no_prompt.returncode == 2 and "pass --prompt" in no_prompt.stderr


# ---- --chat: a conversation, the caches kept from turn to turn ----


def test_chat_answers_each_turn_from_the_conversation_and_reuses_the_caches(chat_pair):
    """Two piped turns through a chat template: each answer is the conversation's fresh greedy
    continuation (the API's oracle is test_specexec's); the second reuses the first's caches,
    in memory and offloaded. A one-turn chat answers what --prompt answers."""
    root, _ = chat_pair
    pair = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    turns = "def add(a, b):\nand now mul\n"
    chats = [[*pair, "--chat", "--max-new-tokens", "8"], [*pair, "--chat", "--offload", "ssd",
             "--offload-dir", str(root / "copies"), "--max-new-tokens", "8"]]  # fmt: skip
    one_turn = [*pair, "--chat", "--max-new-tokens", "8"]
    prompt = [*pair, "--prompt", "def add(a, b):", "--max-new-tokens", "8"]
    results = cli_run_all([(argv, {"input": turns}) for argv in chats])
    results += cli_run_all([(one_turn, {"input": "def add(a, b):\n"}), (prompt, {})])
    for result in results:
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for result in results[:2]:
        summaries = [line for line in result.stdout.splitlines() if line.startswith("specexec:")]
        assert len(summaries) == 2, result.stdout
        assert "reused from the caches" not in summaries[0] and "reused from" in summaries[1]
        assert "> def add(a, b):" in result.stdout and "> and now mul" in result.stdout
    said = [[line for line in result.stdout.splitlines() if not line.startswith("specexec:")]
            for result in results[:2]]  # fmt: skip
    assert said[0] == said[1]  # the offloaded target answers as the one in memory
    answer = results[2].stdout.split("> def add(a, b):\n")[1].split("\nspecexec:")[0]
    assert answer == results[3].stdout.split("--- continuation ---\n")[1].split("\n\nspecexec:")[0]


def test_chat_without_a_template_says_how_turns_are_joined(tmp_path):
    good = save_tiny(tmp_path / "good")
    result = cli_run("--target", good, "--draft", good, "--chat", "--max-new-tokens", "3",
                     input="w1 w2\n/exit\nw3\n")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no chat template; each turn goes on a new line" in result.stdout
    assert result.stdout.count("specexec:") == 1  # /exit ends it before w3
    check_errors([(["--target", good, "--draft", good, "--chat", "--compare"], "--chat and")])
