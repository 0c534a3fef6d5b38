"""`python specexec.py --chat`: a conversation, the models loaded once.

Each user turn (a line of standard input; on a terminal, typed at the `>` prompt) joins the
conversation, which is rendered whole (models.tokenize: the tokenizer's chat template, or the
turns in a row where it has none). `specexec.Chat` feeds the models only what their caches lack,
keeps budget auto's cost model from turn to turn, and the answer streams. EOF or /exit ends it.
"""

import sys

from specexec_tools import models


def talk(chat, tokenizer, chat_template, folder, eos, stream, dim, first=None):
    """Read turns and answer each; `stream(tokenizer)` makes the printer of one answer, `dim`
    dims the figures on a terminal, `first` is a turn given as --prompt. Returns the number of
    turns answered."""
    if tokenizer.chat_template is None or chat_template == "off":
        how = "told to use no" if chat_template == "off" else "no"
        print(dim(f"chat: {folder}: {how} chat template; each turn goes on a new line after "
                  "the text so far"))  # fmt: skip
    messages, answered = [], 0
    for turn in turns(first):
        messages.append({"role": "user", "content": turn})
        input_ids = models.tokenize(tokenizer, messages, chat_template, folder)
        printer = stream(tokenizer)
        tokens, stats = chat.generate(input_ids, eos_token_id=eos, on_tokens=printer)
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        print("\n" + dim(f"specexec: {stats.summary()}"), flush=True)
        answered += 1
    return answered


def turns(first=None):
    """The user's turns: `first`, then lines of standard input until EOF or /exit. On a terminal
    each is typed at a `>` prompt; from a pipe each is echoed after `>`, so the output reads as
    the conversation."""
    if first is not None:
        print(f"> {first}", flush=True)
        yield first
    terminal = sys.stdin is not None and sys.stdin.isatty()
    while True:
        try:
            line = input("> ") if terminal else sys.stdin.readline()
        except EOFError:
            return
        if not terminal and not line:  # the pipe's end
            return
        line = line.rstrip("\n")
        if line.strip() == "/exit":
            return
        if line.strip():
            if not terminal:
                print(f"> {line}", flush=True)
            yield line
