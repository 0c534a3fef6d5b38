"""A conversation: `Chat` (the API) and `python specexec.py --chat` (`talk`).

Each user turn joins the conversation, which is rendered whole (`tokenize`: the tokenizer's chat
template, or the turns in a row where it has none). `Chat` feeds the models only what their
caches lack and keeps budget auto's cost model from turn to turn; the answer streams. On the
command line a turn is a line of standard input (on a terminal, typed at the `>` prompt); Ctrl-C
stops an answer (at the prompt, the run: exit 130), /new starts the conversation over, EOF or
/exit ends it.
"""

import contextlib
import re
import signal
import sys
import threading

import specexec
from specexec_tools import SpecExecError, check_call, cost_model, models, one_line


class Chat:
    """`generate` again and again on a growing prompt (a conversation, each turn rendered whole),
    with both caches and the budget policy (auto's cost model) kept from turn to turn.

    A turn reuses what the caches hold as far as it matches the new prompt token for token (a
    chat template may render earlier turns anew), drops the rest, and feeds the models only what
    their caches lack: the answer is exactly `generate`'s on the whole prompt, from empty caches.
    A turn that fails part-way (an exception, Ctrl-C) leaves the caches empty: the next turn is
    a fresh run. With draft None it decodes plainly, as `autoregressive` does."""

    def __init__(self, target, draft, opts=None, **options):
        self.opts = check_call(opts, options, None, specexec.Options)
        # models, and a pair that can run together; the positions a conversation can use
        self.limit = models.preflight(target, draft, None)[1]
        self.target = target
        self.draft = draft
        self.policy = cost_model.make_policy(self.opts, target, draft)
        self.seq = []  # the tokens the caches were last left holding, but the last
        self.caches = None  # (target's, draft's); made by the first turn's Run

    def generate(self, input_ids, *, eos_token_id=None, on_tokens=None):
        """One turn: `input_ids` is the whole conversation so far. Returns (new_tokens, Stats);
        `stats.reused` counts the prompt tokens the target's cache already held."""
        opts = check_call(self.opts, {}, on_tokens, specexec.Options)
        seq, limit, eos = models.preflight(self.target, self.draft, input_ids, eos_token_id)
        # Keep the longest prefix of what the caches hold (self.seq but its last token) that the
        # new prompt shares, leaving the prompt's last token out: the first tree's root.
        held = self.seq[:-1]
        shared = next((i for i, (a, b) in enumerate(zip(held, seq)) if a != b), len(held))
        reused = min(shared, len(seq) - 1) if self.caches else 0
        # until the turn ends well, what the caches hold is open (a Ctrl-C in a crop, say)
        caches = self.caches
        self.seq = []
        self.caches = None
        run = specexec.Run(self.target, self.draft, opts, limit)  # rng seeded anew: a fresh run
        if caches is not None:
            run.target_cache, run.draft_cache = caches
            for cache in caches:
                crop(cache, reused)
        new_tokens, stats = specexec.decode_loop(run, seq, self.policy, eos, on_tokens)
        # The caches may hold tokens past a stop (an EOS inside an accepted path): cut them, so
        # that they hold `seq` but its last token, as after any step.
        for cache in (run.target_cache, run.draft_cache):
            crop(cache, len(seq) - 1)
        self.seq = seq
        self.caches = (run.target_cache, run.draft_cache)
        stats.reused = reused
        return new_tokens, stats


def crop(cache, n):
    """Keep at most the first n entries of every layer's keys and values (None: no cache)."""
    if cache is None or cache.get_seq_length() <= n:
        return
    for layer in cache.layers:
        layer.keys = layer.keys[..., :n, :]
        layer.values = layer.values[..., :n, :]


# ---- the command line's conversation ----


def talk(chat, tokenizer, folder, args, eos, stream, dim, summary):
    """Read turns and answer each (`args`: the CLI's; --prompt is the first turn, `folder` the
    target's); `stream(tokenizer)` prints one answer as it comes, `dim` dims the figures on a
    terminal, `summary` words a run."""
    if tokenizer.chat_template is None or args.chat_template == "off":
        how = "told to use no" if args.chat_template == "off" else "no"
        rows = "each turn goes on a new line after the text so far"
        print(dim(f"chat: {folder}: {how} chat template; {rows}"))
    messages = []
    for turn in turns(args.prompt):
        if turn == "/new":
            messages = []
            print(dim("chat: a new conversation"), flush=True)
            continue
        messages.append({"role": "user", "content": turn})
        try:
            input_ids = tokenize(tokenizer, messages, args.chat_template, folder)
            # the whole conversation's tokens, not only this turn's
            if len(input_ids) >= chat.limit:
                raise SpecExecError(
                    f"with this turn the conversation is {len(input_ids)} tokens; the context "
                    f"holds {chat.limit}: send a shorter turn, or /new to start over"
                )
            tokens, stats = chat.generate(input_ids, eos_token_id=eos, on_tokens=stream(tokenizer))
            answer = tokenizer.decode(tokens, skip_special_tokens=True)
            print("\n" + dim(f"specexec: {summary(stats)}"), flush=True)
            messages.append({"role": "assistant", "content": answer})
        except SpecExecError as error:  # this turn, refused; the conversation goes on
            messages.pop()
            print(f"error: {error}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # Ctrl-C stops this answer: as if the turn was never sent
            messages.pop()
            print("\n" + dim("chat: answer stopped; the turn is dropped"), flush=True)


def turns(first=None):
    """The user's turns: `first`, then lines of standard input until EOF or /exit (Ctrl-C there
    ends the run as it does outside a chat: exit 130). On a terminal each is typed at a `>`
    prompt; from a pipe each is echoed after `>` (a long one cut), so the output reads as the
    conversation. Windows line ends read as "\\n"."""
    if first is not None:
        print(f"> {first}", flush=True)
        yield first
    terminal = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8: refused turn by turn
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input("> ") if terminal else sys.stdin.readline()
            if line.strip() == "/exit" or not (terminal or line):  # /exit, or the pipe's end
                return
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if not terminal:  # a long turn cut; bytes that are not text as escapes, not sent
                raw = line[:200].encode(errors="surrogateescape")
                shown = raw.decode(errors="backslashreplace")
                shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in shown)
                print(f"> {shown}{'...' * (len(line) > 200)}", flush=True)
        except EOFError:
            return
        yield line.strip() if line.strip() == "/new" else line


def load_tokenizer(folder, chat_template="auto"):
    """The folder's tokenizer; refused where it has none, or no template that --chat-template on
    asks for."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any((folder / name).is_file() for name in files):
        raise SpecExecError(f"{folder}: no tokenizer in this folder (no tokenizer.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # a damaged file fails deep in tokenizers, with any exception
        raise SpecExecError(f"{folder}: cannot load its tokenizer ({one_line(error)})") from None
    if chat_template == "on" and tokenizer.chat_template is None:
        raise SpecExecError(f"{folder}: its tokenizer has no chat template")
    return tokenizer


def tokenize(tokenizer, prompt, chat_template, folder):
    """The ids of a prompt (text) or a conversation (a list of {"role", "content"} messages), in
    the tokenizer's chat template where it has one (chat_template "auto"), or as it is told
    ("on", "off"). Without a template a conversation is its texts in a row, each user turn on a
    new line: a base model continues the text."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    where = "--prompt" if isinstance(prompt, str) else "the turn"
    for message in messages:
        try:  # bytes that are not UTF-8 reach sys.argv as lone surrogates: no tokenizer takes them
            message["content"].encode()
        except UnicodeEncodeError as error:
            byte = ord(message["content"][error.start]) - 0xDC00  # Python's undecodable byte
            raise SpecExecError(
                f"{where} is not UTF-8 text (byte {byte:#04x} at character {error.start})"
            ) from None
        # a chat turn of binary junk that happens to decode: control characters but white space
        # (a --prompt is the user's own, as given; an answer is the model's text, whatever it is)
        junk = re.search(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]", message["content"])
        if junk and message["role"] == "user" and not isinstance(prompt, str):
            raise SpecExecError(
                f"{where} is not text (control character {ord(junk[0]):#04x} at character "
                f"{junk.start()})"
            )
    # No template: the texts in a row ("on" without one is refused where the tokenizer loads)
    if chat_template == "off" or tokenizer.chat_template is None:
        text = ""
        for i, message in enumerate(messages):  # each user turn but a first on a new line
            text += ("\n" if message["role"] == "user" and i else "") + message["content"]
        return tokenizer(text)["input_ids"]
    try:
        text = render(tokenizer, messages)
    except Exception as error:  # a template is a program (Jinja) and can fail in any way
        raise SpecExecError(f"{folder}: its chat template fails ({one_line(error)})") from None
    if len(text) > RENDER_CHARS:
        raise SpecExecError(f"{folder}: its chat template renders {len(text):,} characters")
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # as apply_chat_template does


# A chat template's rendering, bounded (transformers bounds neither): the seconds it may take, and
# the characters it may give (a template that renders that much is broken, not a conversation)
RENDER_S = 5.0
RENDER_CHARS = 2**24


def render(tokenizer, messages) -> str:
    """The chat template's text for `messages`, within RENDER_S seconds (a template is a program,
    and may loop for ever)."""
    with time_bound(RENDER_S):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@contextlib.contextmanager
def time_bound(seconds):
    """A timer's signal stops the block after `seconds`: on the main thread, where the command
    line runs and Python handles signals (a --serve request's thread runs it unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, stop_rendering)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def stop_rendering(signum, frame):
    raise TimeoutError(f"it did not finish rendering in {RENDER_S:g} s")
