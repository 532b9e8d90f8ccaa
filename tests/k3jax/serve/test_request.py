"""A request's text stream: stop strings end the output before them, deltas never show a partial
stop string or a partial UTF-8 character, and the deltas add up to the final text."""

from k3jax.data.tokenizer import ByteTokenizer
from k3jax.serve import SamplingParams
from k3jax.serve.request import Request


def _run(text: str, **params):
    tok = ByteTokenizer()
    req = Request([1], SamplingParams(**{"max_tokens": 64, **params}), tok.decode)
    deltas = []
    for t in text.encode():
        done = req.push(int(t))
        deltas.append(req.events.get())
        if done:
            break
    return req, deltas


def test_stop_string_ends_the_output_before_it():
    req, deltas = _run("hello STOP world", stop=("STOP", "xyz"))
    assert req.text == "hello " and req.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == "hello "
    assert all("S" not in d.text for d in deltas)  # "S", "ST", "STO" were held back, never shown


def test_partial_utf8_is_held_back_and_deltas_add_up():
    req, deltas = _run("né ok")
    assert "\ufffd" not in "".join(d.text for d in deltas)
    assert "".join(d.text for d in deltas) == "né ok" == req.text


def test_stop_token_and_length():
    req, deltas = _run("ab\x03cd", stop_token_ids=(3,))
    assert req.finish_reason == "stop" and req.generated == [97, 98, 3] and req.text == "ab"
    req, _ = _run("abcdef", max_tokens=2)
    assert req.finish_reason == "length" and req.generated == [97, 98]
