"""`python specexec.py --serve`: OpenAI's HTTP API on this machine, answered by SpecExec.

A chat app, an editor or a script that speaks OpenAI's API points its base URL at
http://127.0.0.1:8000/v1: `POST /v1/chat/completions` (messages, through the target's chat
template as --chat renders them), `POST /v1/completions` (a prompt, as it is), `GET /v1/models`.

    connection threads (a Handler each)          the worker (one thread, one Chat)
    read and check a request -> a Job  --queue-->  tokenize, Chat.generate: the caches kept,
    write what comes back: whole, or   <-events--  so a conversation resent whole feeds only
    streamed as server-sent events                  its new tokens; Answer decodes as it goes

The queue is bounded (a full one answers 503) and the worker takes one job at a time, so each
answer is what a fresh `specexec.generate` writes on the same request (greedy; sampled, with the
same seed). An answer's last part carries `usage` and `"specexec"`: target passes, tokens per
pass, the trees auto chose ("budget x depth": passes; "0x0": a plain pass), prompt tokens reused.
A refused request gets OpenAI's error object and one log line, and the server goes on; a stream
whose client left stops its generation at the next step. No request names a file or a model.
The standard library serves it: one user's requests, answered in turn, need no async stack.
"""

import hmac
import json
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from specexec_app import chat
from specexec_tools import SpecExecError, models, one_line

QUEUE = 32  # requests that wait for the worker; one more is answered 503
MAX_BODY = 8 << 20  # bytes of a request's body
ROLES = ("system", "developer", "user", "assistant")
WORDS = {str: "a string", list: "an array", bool: "a boolean", (str, list): "a string or an array"}
# A request's sampling fields -> the specexec.Options fields they set (Options checks each value)
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed"}
SAMPLING |= {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}


class ApiError(Exception):
    """A request refused: its HTTP status, and OpenAI's error object as `body`."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.status, self.body = status, {"error": dict(message=message, type=kind)}
        self.body["error"] |= dict(param=param, code=code)


class Stopped(Exception):
    """Raised from on_tokens to end a generation: a stop string, its client gone, or Ctrl-C."""


# ---- a request, checked ----


@dataclass
class Job:
    """One request, checked: what to answer, and how."""

    is_chat: bool  # /v1/chat/completions: messages through the chat template; else a prompt
    prompt: object  # the messages, or the prompt's text
    model: str
    opts: object  # a specexec.Options: the command line's, with the request's sampling fields
    stop: list  # strings that end the answer where it writes one (left out of its text)
    stream: bool

    def __post_init__(self):
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def reply(self, text, finish=None, **end):
        """The reply, or a chunk of its stream (a piece of text; "" and `end` at the end)."""
        if not self.is_chat:
            choice, kind = {"text": text}, "text_completion"
        elif not self.stream:
            choice, kind = {"message": {"role": "assistant", "content": text}}, "chat.completion"
        else:
            delta = {"role": "assistant", "content": text} if text else {}
            choice, kind = {"delta": delta}, "chat.completion.chunk"
        choice = {"index": 0, **choice, "logprobs": None, "finish_reason": finish}
        head = dict(id=self.id, object=kind, created=self.created, model=self.model)
        return {**head, "choices": [choice], **end}


def check(body, is_chat, name, opts, limit):
    """A request's JSON -> a Job: each field it reads checked (the others are ignored)."""
    if (model := typed(body, "model", str)) != name:
        raise ApiError(404, f"no model {model!r} here: {name!r}", "model", "model_not_found")
    key = "messages" if is_chat else "prompt"
    if not (prompt := typed(body, key, list if is_chat else str)):
        raise ApiError(400, f"{key} is empty", key)
    for i, m in enumerate(prompt if is_chat else []):
        if not (isinstance(m, dict) and m.get("role") in ROLES and type(m.get("content")) is str):
            raise ApiError(400, f"messages[{i}]: a role ({', '.join(ROLES)}) and text", key)
    for asked, option in SAMPLING.items():
        try:  # Options checks the value's type and range
            opts = opts if body.get(asked) is None else replace(opts, **{option: body[asked]})
        except SpecExecError as error:
            raise ApiError(400, f"{asked}: {error}", asked) from None
        if option == "max_new_tokens" and not 1 <= opts.max_new_tokens <= limit:
            raise ApiError(400, f"{asked} must be in [1, {limit}] (the context)", asked)
    stop = typed(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or an array of at most 4", "stop")
    return Job(is_chat, prompt, model, opts, stop, typed(body, "stream", bool, False))


def typed(body, key, kind, default=None):
    """body[key], of JSON type `kind`; missing or null: `default`, refused where there is none."""
    value = default if body.get(key) is None else body[key]
    if value is None or not isinstance(value, kind):
        got = "nothing" if value is None else json.dumps(value)[:40]
        raise ApiError(400, f"{key} must be {WORDS[kind]}, got {got}", key)
    return value


# ---- the server: a thread per connection, one generation at a time ----


class Server(ThreadingHTTPServer):
    """The HTTP server: a thread per connection (a Handler), one generation at a time (`lock`)
    through one `Chat` (specexec_app/chat.py), at most `size` requests waiting for it (`slots`:
    the next is answered 503). `args`: the command line's --host, --port, --api-key and
    --chat-template."""

    def __init__(self, chat_, tokenizer, name, eos, args, size=QUEUE, log=None):
        super().__init__((args.host, args.port), Handler)
        self.chat, self.tokenizer, self.name, self.eos = chat_, tokenizer, name, eos
        self.template, self.api_key, self.log = args.chat_template, args.api_key, log or print_line
        self.opts, self.limit = chat_.opts, models.preflight(chat_.target, chat_.draft, None)[1]
        self.lock, self.slots, self.size = threading.Lock(), threading.Semaphore(size + 1), size
        self.stopping = False

    def stop(self):
        """Ctrl-C: no new connection; the generation running stops at its next step and the
        waiting ones are refused (503), before the models close."""
        self.stopping = True
        self.server_close()
        with self.lock:  # the running one has stopped
            pass


def print_line(line):
    print(line, file=sys.stderr, flush=True)


class Handler(BaseHTTPRequestHandler):
    """One connection: its request checked, then answered (whole, or as server-sent events) once
    the generation before it is done."""

    timeout = 60  # seconds a client may leave its request half sent
    streaming = False  # whether a stream's head is written: a refusal comes as an event then

    def do_POST(self):  # and GET: the endpoint decides
        server, endpoint = self.server, (self.command, self.path)
        try:
            given, key = self.headers.get("Authorization", ""), f"Bearer {server.api_key}"
            if server.api_key and not hmac.compare_digest(given.encode(), key.encode()):
                raise ApiError(401, "a wrong or no API key", code="invalid_api_key")
            if endpoint == ("GET", "/v1/models"):
                model = dict(id=server.name, object="model", created=0, owned_by="specexec")
                return self.reply(200, {"object": "list", "data": [model]}, "the model")
            if endpoint not in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
                raise ApiError(404, f"no such endpoint: {self.command} {self.path}")
            is_chat = self.path == "/v1/chat/completions"
            job = check(self.read_json(), is_chat, server.name, server.opts, server.limit)
            if not server.slots.acquire(blocking=False):
                raise ApiError(503, f"{server.size} requests wait already: try again later")
        except ApiError as error:
            return self.fail(error)
        try:
            with server.lock:
                self.answer(job)
        except OSError:  # a write failed
            self.note(499, "the client left")
        finally:
            server.slots.release()

    do_GET = do_POST

    def read_json(self):
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > MAX_BODY:
            raise ApiError(413, f"a body needs a Content-Length of at most {MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(int(length)).decode())
        except (ValueError, RecursionError) as error:  # not UTF-8, or not JSON
            raise ApiError(400, f"the body is not JSON in UTF-8 ({one_line(error)})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def answer(self, job):
        """Generate the job's answer (the lock held), streamed as it comes where it asks."""
        server, answer, stats = self.server, Answer(self, job), None
        template, key = (server.template, "messages") if job.is_chat else ("off", "prompt")
        try:
            if server.stopping:
                raise ApiError(503, "the server is stopping")
            ids = chat.tokenize(server.tokenizer, job.prompt, template, server.name)
            server.chat.opts = job.opts
            tokens, stats = server.chat.generate(ids, eos_token_id=server.eos, on_tokens=answer)
        except Stopped:  # a turn that fails: the Chat starts the next one afresh
            tokens = answer.tokens
        except ApiError as error:
            return self.fail(error)
        except SpecExecError as error:  # the prompt, refused as `generate` refuses it
            return self.fail(ApiError(400, str(error), key))
        except Exception as error:  # the model failed (out of memory, say): this request only
            return self.fail(ApiError(500, f"the generation failed ({one_line(error)})"))
        if answer.gone:
            return self.note(499, "the client left; its generation stopped")
        answer.send(len(answer.text))  # what was held back
        usage = dict(prompt_tokens=len(ids), completion_tokens=len(tokens))
        usage["total_tokens"] = len(ids) + len(tokens)
        figures = dict(target_passes=answer.passes, tokens_per_pass=answer.per_pass())
        if stats is not None:  # it ended by itself (not at a stop string): what auto chose too
            trees = Counter(f"{budget}x{depth}" for budget, depth in stats.budgets)
            figures |= dict(trees=trees, reused_tokens=stats.reused, seed=stats.seed)
        finish = "stop" if stats is None or tokens[-1] in server.eos else "length"
        end = job.reply("" if job.stream else answer.text, finish, usage=usage, specexec=figures)
        if not job.stream:
            return self.reply(200, end, json.dumps(figures))
        self.write_event(end)
        self.note(200, json.dumps(figures))
        self.wfile.write(b"data: [DONE]\n\n")

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


class Answer:
    """A generation's on_tokens: its text decoded as the tokens come and, where it streams,
    written in chunks, held back while it ends in part of a character or of a stop string. At a
    stop string, once the client is gone (a write failed) or at Ctrl-C it ends the generation."""

    def __init__(self, handler, job):
        self.handler, self.job, self.tokenizer = handler, job, handler.server.tokenizer
        self.tokens, self.passes, self.text, self.sent, self.gone = [], 0, "", 0, False

    def __call__(self, tokens):  # one target pass's tokens
        if self.handler.server.stopping:
            raise Stopped
        self.tokens += tokens
        self.passes += 1
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if ends := [i for stop in self.job.stop if (i := self.text.find(stop)) >= 0]:
            self.text = self.text[: min(ends)]
            self.send(len(self.text))
            raise Stopped
        if not self.text.endswith("\ufffd"):  # else wait for the character's next bytes
            stops = self.job.stop
            held = [k for s in stops for k in range(1, len(s)) if self.text.endswith(s[:k])]
            self.send(len(self.text) - max(held, default=0))

    def send(self, end):
        """Stream the text up to `end` not sent yet."""
        if self.job.stream and end > self.sent:
            try:
                self.handler.write_event(self.job.reply(self.text[self.sent : end]))
            except OSError:
                self.gone = True
                raise Stopped from None
            self.sent = end

    def per_pass(self):
        return round(len(self.tokens) / self.passes, 2)


# ---- the command line's --serve ----


def serve(chat_, tokenizer, args, eos):
    """Answer requests until Ctrl-C; `chat_`: a Chat of the loaded pair and the generation
    flags, `args`: the command line's."""
    local = Path(args.target).expanduser().is_dir()
    name = Path(args.target).name if local else args.target  # a folder's name, or the hub id
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
