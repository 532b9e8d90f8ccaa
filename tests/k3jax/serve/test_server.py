"""The OpenAI-compatible server end to end, through the ``openai`` client and raw ``httpx``,
against a server on localhost: completions and chat, streamed and whole, the same tokens as the
engine alone; bad input gets OpenAI's error object; a client leaving mid-stream frees its pages
while another request keeps streaming."""

import json
import threading

import pytest

httpx = pytest.importorskip("httpx")  # the test extra (setup.cfg) installs both clients
openai = pytest.importorskip("openai")

from k3jax.data.tokenizer import ByteTokenizer
from k3jax.serve import SamplingParams
from k3jax.serve.openai_api import chat_prompt
from k3jax.serve.server import Server

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def served(make_engine):
    engine = make_engine(decode=TOK.decode)
    server = Server(engine, TOK, "tiny").start()
    yield engine, server.url
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _expected(make_engine, prompt_ids, max_tokens):
    (ids,) = make_engine(False).generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      stop_token_ids=(TOK.eos_id,)))
    return TOK.decode([t for t in ids if t != TOK.eos_id])


def test_completion_whole_and_streamed(client, make_engine):
    want = _expected(make_engine, list(b"abc"), 4)
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0)
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


class SpecialBytes:
    """Bytes, with the five K3 chat markers as single ids (16..20), as the K3 tokenizer has them."""

    vocab_size, eos_id, bos_id, pad_id = 256, 3, 2, 0
    special = {m: 16 + i for i, m in enumerate(("<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                                                 "<|im_middle|>", "<|im_end|>"))}
    encode, decode = TOK.encode, TOK.decode


def test_chat_with_the_k3_template_streamed(make_engine):
    tok = SpecialBytes()
    engine = make_engine(decode=tok.decode)
    server = Server(engine, tok, "tiny").start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "hi"}]
        ids, end = chat_prompt(tok, messages)
        assert len(ids) == 20 and end == (20, 3)
        (want,) = make_engine(False).generate([ids], SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=end))
        want = tok.decode([t for t in want if t not in end])
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert whole.choices[0].message.content == want
        assert whole.usage.prompt_tokens_details.cached_tokens > 0  # the second call resumed the first
    finally:
        server.stop()


def test_chat_template_shape():
    ids, end = chat_prompt(TOK, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert TOK.decode(ids) == ("<|im_system|>system<|im_middle|>s<|im_end|><|im_user|>user<|im_middle|>u<|im_end|>"
                               "<|im_assistant|>assistant<|im_middle|>")
    assert end == (TOK.eos_id,)


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), "must not be empty"),
    ("/v1/completions", json.dumps({"prompt": "x" * 40}).encode(), "must fit the context"),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature"),
    ("/v1/completions", json.dumps({"prompt": "x", "top_p": 2}).encode(), "top_p"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "3"}).encode(), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 2}).encode(), "n=2"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), "messages"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "x", "content": "y"}]}).encode(), "role"),
])
def test_bad_input_is_a_400_with_an_openai_error(served, path, body, fragment):
    r = httpx.post(served[1] + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="x", top_p=0)


def test_unknown_route_is_a_404(served):
    assert httpx.get(served[1] + "/v1/nothing", timeout=60).status_code == 404
    assert httpx.get(served[1] + "/v1/models", timeout=60).json()["data"][0]["id"] == "tiny"


def test_client_leaving_mid_stream_frees_its_pages(served, make_engine):
    engine, url = served
    want = _expected(make_engine, list(b"keep"), 8)
    body = {"prompt": "gone", "max_tokens": 27, "temperature": 0, "stream": True, "ignore_eos": True}
    result = {}

    def other():  # runs alongside: must be unaffected
        result["text"] = httpx.post(url + "/v1/completions", json={"prompt": "keep", "max_tokens": 8,
                                                                    "temperature": 0}, timeout=120).json()
    cancelled = engine.stats["cancelled"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
        thread = threading.Thread(target=other)  # submitted while the stream is running
        thread.start()
        engine.wake.acquire()  # pause the engine loop (after its step) while the client goes away
    engine.wake.release()  # the server's next writes fail: the engine cancels the request
    thread.join(timeout=120)
    assert result["text"]["choices"][0]["text"] == want
    for _ in range(400):
        if not engine.busy:
            break
        threading.Event().wait(0.05)
    assert engine.stats["cancelled"] == cancelled + 1
    assert not engine.busy and all(s is None for s in engine.slots)
    owned_by_index = {n.page for n in engine.index.nodes()}
    assert len(engine.alloc.free_pages) + len(owned_by_index) == engine.budget.num_pages - 1
