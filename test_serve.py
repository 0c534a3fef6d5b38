"""Tests for serve.py, as a program would use it: the server on 127.0.0.1 (an ephemeral port),
called with OpenAI's own Python client (the `openai` package, which nobody here wrote) and, for
what that client cannot send, raw HTTP. The oracle is a fresh `specexec.generate` on the same
request, in float64 (no near-tie between two logits can flip an argmax)."""

import functools
import http.client
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import specexec
from conftest import tiny_model
from specexec_app import cli, serve
from specexec_app.chat import Chat
from test_cli import start_cli

HERE = Path(__file__).resolve().parent
EOS = 2
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer():
    """One word a token: the 64 ids of the tiny models, a chat template, </s> the EOS."""
    words = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    words += [f"w{i}" for i in range(len(words), 64)]
    model = models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>"
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer


TOKENIZER = word_tokenizer()
TARGET, DRAFT = tiny_model("llama", 0, init=0.4), tiny_model("llama", 1, init=0.4)


class WatchedChat(Chat):
    """A Chat that tells the test how each turn ended (`turns`: tokens emitted, the exception's
    type or None), waits at `gate` before each turn (`waiting` set meanwhile) and, with `pause`,
    sleeps that long after each target pass (a client then has time to leave)."""

    def __init__(self, **options):
        super().__init__(TARGET, DRAFT, **options)
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.turns, self.pause = [], 0
        self.gate.set()

    def generate(self, input_ids, *, eos_token_id=None, on_tokens=None):
        self.waiting.set()
        self.gate.wait()
        self.waiting.clear()
        emitted = []

        def watched(tokens):
            emitted.extend(tokens)
            time.sleep(self.pause)
            on_tokens(tokens)

        try:
            result = super().generate(input_ids, eos_token_id=eos_token_id, on_tokens=watched)
        except BaseException as error:
            self.turns.append((len(emitted), type(error)))
            raise
        self.turns.append((len(emitted), None))
        return result


class Running:
    """A server on 127.0.0.1 (a free port) in this process, its log lines kept, and a client."""

    def __init__(self, api_key=None, size=32, **options):
        self.chat, self.log = WatchedChat(max_new_tokens=12, **options), []
        args = SimpleNamespace(host="127.0.0.1", port=0, chat_template="auto", api_key=api_key)
        self.server = serve.Server(self.chat, TOKENIZER, "tiny", [EOS], args, size, self.log.append)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.client = self.client_with(api_key or "none")

    def client_with(self, key):
        url = f"http://127.0.0.1:{self.port}/v1"
        return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)

    def raw(self, method, path, body=b"", headers=None):
        """One request as bytes: (status, the reply's JSON)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        status, data = response.status, response.read()
        connection.close()
        return status, json.loads(data)

    def close(self):
        self.server.shutdown()
        self.server.stop()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Torch on one thread, as `--threads 1`: these models' passes are too small to share, and
    two threads on a busy machine wait for each other (docs/results.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def running():
    """The server most tests share: trees of 8 nodes 4 deep (auto decodes these tiny models
    plainly: their passes cost compute, not the weights' transfer)."""
    server = Running(budget=8, max_depth=4)
    yield server
    server.close()


def fresh(prompt, max_tokens=12, **sampling):
    """Oracle: what a fresh `generate` writes for a chat (messages) or a prompt (text):
    (text, finish_reason, prompt tokens, new tokens)."""
    if isinstance(prompt, str):
        ids = TOKENIZER(prompt)["input_ids"]
    else:
        ids = list(TOKENIZER.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"])
    tokens, _ = specexec.generate(
        TARGET, DRAFT, ids, eos_token_id=[EOS], max_new_tokens=max_tokens, **sampling
    )
    finish = "stop" if tokens[-1] == EOS else "length"
    return TOKENIZER.decode(tokens, skip_special_tokens=True), finish, ids, tokens


def user(text):
    return [{"role": "user", "content": text}]


def wait_for(condition, seconds=30):
    """Whether `condition()` came true within `seconds` (checked every 10 ms)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


# ---- answers: what generate writes ----


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 3}])
def test_a_chat_completion_and_its_stream_write_what_generate_writes(running, sampling):
    messages = user("w7 w8 w9 w10")
    text, finish, ids, tokens = fresh(messages, 12, **sampling)
    reply = running.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, **sampling
    )
    assert reply.choices[0].message.content == text and text
    assert reply.choices[0].finish_reason == finish and reply.model == "tiny"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(tokens))
    figures = reply.model_extra["specexec"]
    assert figures["trees"] == {"8x4": figures["target_passes"]}
    stream = running.client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=12, stream=True, **sampling
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == finish
    assert chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].model_extra["specexec"]["target_passes"] == figures["target_passes"]


def test_a_completion_takes_its_prompt_as_it_is_and_the_models_list_names_the_model(running):
    text, finish, ids, _ = fresh("w20 w21 w22", 9)
    reply = running.client.completions.create(model="tiny", prompt="w20 w21 w22", max_tokens=9)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (text, finish)
    assert reply.usage.prompt_tokens == len(ids) == 3  # no template around it
    pieces = running.client.completions.create(
        model="tiny", prompt="w20 w21 w22", max_tokens=9, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in pieces) == text
    assert [model.id for model in running.client.models.list()] == ["tiny"]


def test_a_second_turn_feeds_only_its_new_tokens(running):
    """A chat app resends the whole conversation: the caches hold the first turn and its answer,
    and the second turn reuses them, as far as the two token lists agree (the oracle: the token
    lists themselves); a conversation that starts otherwise reuses no more than it shares."""
    first = user("w30 w31 w32")
    text, _, ids, tokens = fresh(first)
    reply = running.client.chat.completions.create(model="tiny", messages=first, max_tokens=12)
    assert reply.choices[0].message.content == text
    second = first + [{"role": "assistant", "content": text}] + user("w33 w34")
    text2, _, ids2, _ = fresh(second)
    reply = running.client.chat.completions.create(model="tiny", messages=second, max_tokens=12)
    assert reply.choices[0].message.content == text2
    held = (ids + tokens)[:-1]  # what the caches hold after the first turn
    shared = next((i for i, (a, b) in enumerate(zip(held, ids2)) if a != b), len(held))
    assert reply.model_extra["specexec"]["reused_tokens"] == min(shared, len(ids2) - 1)
    assert shared > len(ids)  # the first answer's tokens too
    other = user("w40 w41")
    reply = running.client.chat.completions.create(model="tiny", messages=other, max_tokens=12)
    assert reply.choices[0].message.content == fresh(other)[0]
    assert reply.model_extra["specexec"]["reused_tokens"] == 1  # <|user|> alone


def test_a_stop_string_ends_the_answer_before_it(running):
    messages = user("w7 w8 w9 w10")
    text, *_ = fresh(messages, 12)
    stop = text.split()[3]
    cut = text[: text.index(stop)]
    for stream in (False, True):
        reply = running.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, stop=[stop, "w99"], stream=stream
        )
        if stream:
            chunks = list(reply)
            answer = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            answer, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert (answer, finish) == (cut, "stop")


# ---- bad requests ----


def chat_body(**fields):
    return {"model": "tiny", "messages": user("w7 w8"), **fields}


BAD = [  # (body: a dict as JSON, or bytes as they are; status; param)
    (b'{"model": "tiny", "messages": [', 400, None),  # malformed JSON
    (b"[1, 2]", 400, None),  # not an object
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "w7 \xff"}]}', 400, None),
    (chat_body(messages=[{"role": "user", "content": "w7 \udc80"}]), 400, "messages"),  # lone
    (chat_body(messages=[{"role": "user", "content": "w7 \x00"}]), 400, "messages"),  # control
    ({"model": "tiny"}, 400, "messages"),
    (chat_body(messages="w7 w8"), 400, "messages"),
    (chat_body(messages=[]), 400, "messages"),
    (chat_body(messages=[{"role": "user", "content": 7}]), 400, "messages"),
    (chat_body(messages=[{"content": "w7"}]), 400, "messages"),
    (chat_body(messages=["w7"]), 400, "messages"),
    ({"messages": user("w7")}, 400, "model"),
    (chat_body(model=7), 400, "model"),
    (chat_body(model="gpt-4o"), 404, "model"),
    (chat_body(max_tokens=-1), 400, "max_tokens"),
    (chat_body(max_tokens=0), 400, "max_tokens"),
    (chat_body(max_tokens=10**9), 400, "max_tokens"),
    (chat_body(max_completion_tokens="12"), 400, "max_completion_tokens"),
    (chat_body(max_tokens=True), 400, "max_tokens"),
    (chat_body(max_tokens=2.5), 400, "max_tokens"),
    (chat_body(temperature="hot"), 400, "temperature"),
    (chat_body(temperature=-1), 400, "temperature"),
    (chat_body(top_p=0), 400, "top_p"),
    (chat_body(seed=-1), 400, "seed"),
    (chat_body(stop=5), 400, "stop"),
    (chat_body(stop=["w7", 7]), 400, "stop"),
    (chat_body(stop=[""]), 400, "stop"),
    (chat_body(stream="yes"), 400, "stream"),
    (chat_body(messages=user(" ".join(["w9"] * 200))), 400, "messages"),  # past the context
    ({"model": "tiny", "prompt": ["w7"]}, 400, "prompt"),
]


def test_bad_requests_get_openais_error_object_and_one_log_line(running):
    for body, status, param in BAD:
        path = "/v1/completions" if "prompt" in str(body) else "/v1/chat/completions"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        before = len(running.log)
        got, reply = running.raw("POST", path, data, {"Content-Type": "application/json"})
        assert got == status, (body, reply)
        assert list(reply) == ["error"], reply
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"}, reply
        assert error["type"] == "invalid_request_error" and error["message"], reply
        assert error["param"] == param, (body, reply)
        assert len(running.log) == before + 1 and f" {status}: " in running.log[-1]
    wrong = [("GET", "/v1/chat/completions", 404), ("POST", "/v2", 404)]
    wrong += [("PUT", "/v1/completions", 405), ("DELETE", "/v1/models", 405)]
    for method, path, status in wrong:
        got, reply = running.raw(method, path)
        assert got == status and reply["error"]["message"], (method, path, reply)
    got, reply = running.raw("POST", "/v1/completions", b"", {"Content-Length": str(1 << 30)})
    assert got == 413 and reply["error"]["type"] == "invalid_request_error"
    # through OpenAI's client, the error as it raises it; and the server goes on
    with pytest.raises(openai.NotFoundError) as refused:
        running.client.chat.completions.create(model="gpt-4o", messages=user("w7"))
    assert refused.value.code == "model_not_found" and refused.value.param == "model"
    with pytest.raises(openai.BadRequestError) as refused:
        running.client.chat.completions.create(model="tiny", messages=user("w7"), max_tokens=-5)
    assert refused.value.param == "max_tokens"
    messages = user("w11 w12")
    reply = running.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    assert reply.choices[0].message.content == fresh(messages, 6)[0]


def test_a_client_that_leaves_a_stream_stops_its_generation(running):
    """It reads the first chunk and closes its connection: the generation ends at a write that
    fails, well before its 100 tokens (each target pass slowed, so that the server has time to
    notice), and the next request is answered right."""
    running.chat.pause, turns = 0.05, len(running.chat.turns)
    try:
        body = json.dumps(chat_body(max_tokens=100, stream=True, messages=user("w50 w51")))
        connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=60)
        connection.request("POST", "/v1/chat/completions", body)
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        response.close()  # it holds the socket too
        connection.close()
        assert wait_for(lambda: len(running.chat.turns) > turns, 60)
    finally:
        running.chat.pause = 0
    emitted, ended_by = running.chat.turns[turns]
    assert issubclass(ended_by, OSError) and emitted < 60, (emitted, ended_by)  # a failed write
    assert wait_for(lambda: any(" 499: the client left" in line for line in running.log))
    messages = user("w50 w51")
    reply = running.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    assert reply.choices[0].message.content == fresh(messages)[0]
    assert running.chat.turns[-1] == (len(fresh(messages)[3]), None)


# ---- many clients ----


def test_sixteen_clients_at_once_are_each_answered_exactly(running):
    """16 threads, each its own conversation, half of them sampled with a seed: every answer is
    generate's on that request; none lost."""

    def ask(i):
        messages = user(f"w{10 + i} w{30 + i} w{12 + i}")
        sampling = {"temperature": 0.8, "seed": i} if i % 2 else {}
        stream = i % 4 == 3
        reply = running.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, stream=stream, **sampling
        )
        if stream:
            return messages, sampling, "".join(c.choices[0].delta.content or "" for c in reply)
        return messages, sampling, reply.choices[0].message.content

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(ask, range(16)))
    for messages, sampling, answer in answers:
        assert answer == fresh(messages, 8, **sampling)[0], (messages, sampling)


def test_a_full_queue_answers_503_and_drops_nobody():
    """Two may wait: one request generating (held at the gate) and two waiting, a fourth is
    answered 503 at once, with the error object; the three are then answered, each exact."""
    running = Running(size=2)
    prompts = [user(f"w{20 + i} w{40 + i}") for i in range(3)]

    def ask(messages):
        reply = running.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8
        )
        return reply.choices[0].message.content

    running.chat.gate.clear()
    with ThreadPoolExecutor(max_workers=3) as pool:
        try:
            first = pool.submit(ask, prompts[0])
            assert running.chat.waiting.wait(30)  # the first holds the generation
            rest = [pool.submit(ask, messages) for messages in prompts[1:]]
            assert wait_for(lambda: running.server.slots._value == 0)  # the two wait for it
            with pytest.raises(openai.InternalServerError) as refused:
                ask(user("w9"))
            assert refused.value.status_code == 503
            assert refused.value.body["message"] and refused.value.body["type"] == "server_error"
        finally:
            running.chat.gate.set()
        answers = [future.result(timeout=60) for future in [first, *rest]]
    running.close()
    assert answers == [fresh(messages, 8)[0] for messages in prompts]


# ---- who may ask ----


def test_an_api_key_is_asked_of_every_request():
    running = Running(api_key="sesame")
    try:
        for key in ("wrong", "sesame2", "Bearer sesame"):
            with pytest.raises(openai.AuthenticationError) as refused:
                running.client_with(key).models.list()
            assert refused.value.code == "invalid_api_key"
        status, reply = running.raw("POST", "/v1/chat/completions", json.dumps(chat_body()))
        assert status == 401 and reply["error"]["type"] == "invalid_request_error"
        assert [model.id for model in running.client.models.list()] == ["tiny"]
        reply = running.client.chat.completions.create(
            model="tiny", messages=user("w7 w8"), max_tokens=6
        )
        assert reply.choices[0].message.content == fresh(user("w7 w8"), 6)[0]
    finally:
        running.close()


def test_flags_refuse_another_machines_address_without_a_key(capsys, monkeypatch):
    monkeypatch.delenv("SPECEXEC_API_KEY", raising=False)
    for argv, message in [
        (["--serve", "--host", "0.0.0.0"], "--host 0.0.0.0 lets other machines in"),
        (["--serve", "--host", "192.168.1.5", "--api-key", ""], "give --api-key"),
        (["--serve", "--prompt", "x"], "--serve takes its prompts from requests"),
        (["--serve", "--chat"], "not with --chat"),
        (["--serve", "--port", "70000"], "--port 70000: a port is 0 to 65535"),
    ]:
        with pytest.raises(SystemExit) as exit:
            cli.handled(functools.partial(cli.parse_args, argv))  # as `python specexec.py` does
        err = capsys.readouterr().err.splitlines()
        assert exit.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        assert message in err[0], err
    assert cli.parse_args(["--serve", "--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"
    monkeypatch.setenv("SPECEXEC_API_KEY", "from-env")
    assert cli.parse_args(["--serve", "--host", "0.0.0.0"]).api_key == "from-env"


# ---- the command line ----


@pytest.mark.skipif(
    not (HERE / "models" / "target" / "config.json").exists(), reason="models/ not trained yet"
)
def test_the_command_line_serves_the_pair_and_stops_on_ctrl_c():
    """`python specexec.py --serve --port 0`: it says where it listens, answers a chat, a
    completion and the README's client line, and Ctrl-C ends it cleanly (exit 130, its last line,
    no traceback)."""
    process = start_cli("--serve", "--port", "0", "--max-new-tokens", "6", "--threads", "1")
    try:
        line = process.stderr.readline().decode()
        assert line.startswith("serve: 'target' at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split(";")[0]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="target", messages=user("def add(a, b):"))
        assert reply.usage.completion_tokens == 6 and reply.choices[0].message.content
        figures = reply.model_extra["specexec"]  # budget auto: what it chose, pass by pass
        assert (
            figures["target_passes"] >= 2
            and sum(figures["trees"].values()) == figures["target_passes"]
        )
        reply = client.completions.create(model="target", prompt="def add(a, b):")
        assert reply.model_extra["specexec"]["reused_tokens"] > 0  # the same text, untemplated
        readme = (HERE / "README.md").read_text()  # its client line, as written but the port
        line = re.search(r"`(OpenAI\(base_url=.*?\))`", readme).group(1)
        reply = eval(line.replace("http://127.0.0.1:8000/v1", url), {"OpenAI": openai.OpenAI})
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 6
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
        err = process.stderr.read().decode()
    finally:
        process.kill()
    assert "Traceback" not in err and err.splitlines()[-1] == "serve: stopped", err
