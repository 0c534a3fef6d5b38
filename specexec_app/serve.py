"""`python specexec.py --serve`: OpenAI's HTTP API on this machine, answered by SpecExec.

A chat app, an editor or a script that speaks OpenAI's API points its base URL at
http://127.0.0.1:8000/v1: `POST /v1/chat/completions` (messages, through the target's chat
template as --chat renders them), `POST /v1/completions` (a prompt, as it is), `GET /v1/models`.

    a thread per connection: its request checked -> it waits for the lock (at most `size` wait;
    the next is answered 503) -> Chat.generate, the caches kept from request to request: a
    conversation resent whole feeds only its new tokens -> the reply, or its chunks as they come

One generation at a time, through one `Chat`, so each answer is what a fresh `specexec.generate`
writes on the same request (greedy; sampled, with the same seed). An answer's last part carries
`usage` and `"specexec"`: target passes, tokens per pass, the trees auto chose ("budget x
max_depth": passes; "0x0": a plain pass), prompt tokens reused. A refused request gets OpenAI's
error object and one log line, and the server goes on; a client that leaves a stream stops its
generation at the next step. No request names a file or a model. The standard library serves
it: one user's requests, answered in turn, need no async stack.
"""

import hmac
import json
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from specexec_app import chat
from specexec_tools import SpecExecError, one_line

WORDS = {str: "a string", list: "an array", bool: "a boolean", (str, list): "a string or an array"}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# A request's sampling fields -> the specexec.Options fields they set (Options checks each value)
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed"}
SAMPLING |= {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}


class ApiError(Exception):
    """A request refused: its HTTP status, and OpenAI's error object as `body`."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status = status
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.body = {"error": dict(message=message, type=kind, param=param, code=code)}


class Stopped(Exception):
    """Raised from on_tokens to end a generation: a stop string, or Ctrl-C."""


class Server(ThreadingHTTPServer):
    """The HTTP server: a thread per connection (a Handler), one generation at a time (`lock`)
    through one `Chat` (specexec_app/chat.py), at most `size` requests waiting for it (`slots`:
    the next is answered 503). `args`: the command line's (--host, --port, --api-key,
    --chat-template); `log`: a function of one line."""

    def __init__(self, chat_, tokenizer, name, eos, args, size=32, log=None):
        super().__init__((args.host, args.port), Handler)
        self.chat = chat_
        self.tokenizer = tokenizer
        self.name = name
        self.eos = eos
        self.args = args
        self.log = log or print_line
        self.opts = chat_.opts  # a request's sampling fields change a copy of these
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(size + 1)
        self.stopping = False

    def stop(self):
        """Ctrl-C: no new connection; the generation running stops at its next step, and the
        lock kept, no other starts: the models can close."""
        self.stopping = True
        self.server_close()
        self.lock.acquire()


def print_line(line):
    print(line, file=sys.stderr, flush=True)


# ---- a connection: one request (HTTP/1.0), checked, then answered ----


class Handler(BaseHTTPRequestHandler):
    """One connection, one request: checked (`check`), then answered once the generation before
    it is done, whole or as server-sent events (`answer`)."""

    timeout = 60  # seconds a client may leave its request half sent
    streaming = False  # whether a stream's head is written: a refusal comes as an event then
    passes = 0  # target passes so far (`take` counts them)
    text = ""  # the answer's text so far
    sent = 0  # how much of it a stream has sent

    def do_POST(self):  # and GET: the endpoint decides
        try:
            given = self.headers.get("Authorization", "")
            key = f"Bearer {self.server.args.api_key}"
            if self.server.args.api_key and not hmac.compare_digest(given.encode(), key.encode()):
                raise ApiError(401, "a wrong or no API key", code="invalid_api_key")
            if (self.command, self.path) == ("GET", "/v1/models"):
                model = dict(id=self.server.name, object="model", created=0, owned_by="specexec")
                return self.reply(200, {"object": "list", "data": [model]}, "the model")
            if self.command != "POST" or self.path not in ENDPOINTS:
                raise ApiError(404, f"no such endpoint: {self.command} {self.path}")
            self.check(self.read_json())
            if not self.server.slots.acquire(blocking=False):
                raise ApiError(503, "too many requests wait already: try again later")
        except ApiError as error:
            return self.fail(error)
        try:
            with self.server.lock:
                if not self.server.stopping:  # else Ctrl-C came while it waited
                    self.answer()
        except OSError:  # a write failed: the generation, if it ran, stopped there
            self.note(499, "the client left")
        finally:
            self.server.slots.release()

    do_GET = do_POST

    def read_json(self):
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > 8 << 20:
            raise ApiError(413, "a body needs a Content-Length of at most 8 MB")
        try:
            body = json.loads(self.rfile.read(int(length)).decode())
        except (ValueError, RecursionError) as error:  # not UTF-8, or not JSON
            raise ApiError(400, f"the body is not JSON in UTF-8 ({one_line(error)})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def check(self, body):
        """The request's fields, each checked (the others are ignored): the messages, to go
        through the chat template, or the prompt, as it is; the sampling fields, in `opts`; the
        stop strings (each ends the answer, left out of it); whether it streams."""
        self.is_chat = self.path == ENDPOINTS[0]
        self.started = time.time_ns()  # its id, and its second
        if (model := typed(body, "model", str)) != self.server.name:
            raise ApiError(404, f"no model {model!r} here", "model", "model_not_found")
        self.key = "messages" if self.is_chat else "prompt"  # the field the prompt is in
        self.prompt = typed(body, self.key, list if self.is_chat else str)
        if not self.prompt:
            raise ApiError(400, f"{self.key} is empty", self.key)
        for i, m in enumerate(self.prompt if self.is_chat else []):
            fields = [m.get("role"), m.get("content")] if isinstance(m, dict) else [None]
            if not all(isinstance(field, str) for field in fields):
                raise ApiError(400, f"messages[{i}] needs a role and its text", self.key)
        limit = self.server.chat.limit  # the context, in tokens
        self.opts = self.server.opts
        for asked, option in SAMPLING.items():
            given = body.get(asked)
            try:  # Options checks the value's type and range
                self.opts = self.opts if given is None else replace(self.opts, **{option: given})
            except SpecExecError as error:
                raise ApiError(400, f"{asked}: {error}", asked) from None
            if option == "max_new_tokens" and given is not None and not 1 <= given <= limit:
                raise ApiError(400, f"{asked} must be in [1, {limit}]: the context", asked)
        stop = typed(body, "stop", (str, list), [])
        self.stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ApiError(400, "stop must be a string or an array of them", "stop")
        self.stream = typed(body, "stream", bool, False)

    def answer(self):
        """Generate the answer (the lock held), streamed as it comes where the request asks."""
        server = self.server
        stats = None
        template = server.args.chat_template if self.is_chat else "off"
        self.tokens = []  # every token written; `take` adds each pass's
        try:  # a turn that fails (Stopped, OSError) leaves the Chat to start the next afresh
            ids = chat.tokenize(server.tokenizer, self.prompt, template, server.name)
            server.chat.opts = self.opts
            stats = server.chat.generate(ids, eos_token_id=server.eos, on_tokens=self.take)[1]
        except Stopped:  # a stop string: the text ends before it
            pass
        except OSError:  # a write failed: the client left (do_POST says so)
            raise
        except SpecExecError as error:  # the prompt, refused as `generate` refuses it
            return self.fail(ApiError(400, str(error), self.key))
        except Exception as error:  # the model failed (out of memory, say): this request only
            return self.fail(ApiError(500, f"the generation failed ({one_line(error)})"))
        self.send_text(len(self.text))  # what was held back
        new = len(self.tokens)
        usage = dict(prompt_tokens=len(ids), completion_tokens=new, total_tokens=len(ids) + new)
        figures = dict(target_passes=self.passes, tokens_per_pass=round(new / self.passes, 2))
        if stats is not None:  # it ended by itself (not at a stop string): what auto chose too
            trees = Counter(f"{budget}x{max_depth}" for budget, max_depth in stats.budgets)
            figures |= dict(trees=trees, reused_tokens=stats.reused, seed=stats.seed)
        finish = "stop" if stats is None or self.tokens[-1] in server.eos else "length"
        text = "" if self.stream else self.text  # a stream's last chunk: the end alone
        end = self.completion(text, finish, usage=usage, specexec=figures)
        if not self.stream:
            return self.reply(200, end, json.dumps(figures))
        self.write_event(end)
        self.note(200, json.dumps(figures))
        self.wfile.write(b"data: [DONE]\n\n")

    def take(self, tokens):
        """on_tokens: one target pass's tokens. The text is decoded as they come and, where the
        request streams, written in chunks, held back while it ends in part of a character or of
        a stop string. A stop string or Ctrl-C ends the generation (Stopped), and so does a
        failed write (OSError)."""
        self.tokens += tokens
        self.passes += 1
        if self.server.stopping:
            raise Stopped
        self.text = self.server.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if ends := [i for stop in self.stop if (i := self.text.find(stop)) >= 0]:
            self.text = self.text[: min(ends)]  # answer() sends what is left of it
            raise Stopped
        if not self.text.endswith("\ufffd"):  # else wait for the character's next bytes
            held = [k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])]
            self.send_text(len(self.text) - max(held, default=0))

    def send_text(self, end):
        """Stream the text up to `end` not sent yet."""
        if self.stream and end > self.sent:
            self.write_event(self.completion(self.text[self.sent : end]))
            self.sent = end

    def completion(self, text, finish=None, **end):
        """The reply, or a chunk of its stream (a piece of text; "" and `end` at the end)."""
        kind = "text_completion"
        choice = {"text": text}
        if self.is_chat:  # a stream's chunk carries a delta of the message, a reply the message
            kind = "chat.completion.chunk" if self.stream else "chat.completion"
            message = {"content": text} if self.stream else {"role": "assistant", "content": text}
            choice = {"delta" if self.stream else "message": message}
        choice = {"index": 0, **choice, "logprobs": None, "finish_reason": finish}
        head = dict(id=f"cmpl-{self.started}", object=kind, created=self.started // 10**9)
        return {**head, "model": self.server.name, "choices": [choice], **end}

    def write_event(self, body):  # the stream's head before its first event
        if not self.streaming:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.streaming = True
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")

    def reply(self, status, body, what):
        data = json.dumps(body).encode()
        self.note(status, what)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def fail(self, error):
        if self.streaming:  # a stream begun: OpenAI's error object as its last event
            self.note(error.status, str(error))
            return self.write_event(error.body)
        self.reply(error.status, error.body, str(error))

    def send_error(self, code, message=None, explain=None):  # http.server's own refusals
        self.fail(ApiError(405 if code == 501 else code, message or "a bad request"))

    def note(self, status, what):  # the request's one line in the log
        self.server.log(f"serve: {self.command} {self.path} {status}: {what}")

    def log_message(self, format, *args):  # http.server's own lines: `note` writes one instead
        pass


def typed(body, key, kind, default=None):
    """body[key], of JSON type `kind`; missing or null: `default`, refused where there is none."""
    value = default if body.get(key) is None else body[key]
    if value is None or not isinstance(value, kind):
        raise ApiError(400, f"{key} must be {WORDS[kind]}, got {json.dumps(value)[:40]}", key)
    return value


# ---- the command line's --serve ----


def serve(chat_, tokenizer, args, eos):
    """Answer requests until Ctrl-C; `chat_`: a Chat of the loaded pair and the generation
    flags, `args`: the command line's."""
    name = Path(args.target).name  # a folder's name; a hub id's after its owner
    try:
        server = Server(chat_, tokenizer, name, list(eos), args)
    except OSError as error:
        why = f"cannot listen there ({error.strerror or error})"
        raise SpecExecError(f"--host {args.host} --port {args.port}: {why}") from None
    print_line(f"serve: {name!r} at http://{args.host}:{server.server_port}/v1; Ctrl-C stops it")
    try:
        server.serve_forever()
    finally:
        server.stop()
        print_line("serve: stopped")
