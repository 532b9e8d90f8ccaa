"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` as JSON in, engine request out.

``parse_completion`` / ``parse_chat`` turn a request body into ``(prompt ids, SamplingParams,
stream)`` or raise ``ValueError`` naming the field (HTTP 400, OpenAI's error object). The chat
prompt follows the K3 (Kimi) template, ``<|im_system|>system<|im_middle|>…<|im_end|>`` per
message then ``<|im_assistant|>assistant<|im_middle|>``; with the K3 tokenizer the markers are its
special ids (and ``<|im_end|>`` ends generation), with the byte tokenizer they are plain text.
"""

from __future__ import annotations

import random
import time
from typing import Any

from k3jax.serve.params import SamplingParams, as_tuple

ROLES = ("system", "user", "assistant", "tool")
_UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "suffix", "tools", "functions", "best_of")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _sampling(body: dict, tokenizer, end_ids: tuple[int, ...], max_tokens_key: str) -> SamplingParams:
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, 0, [], {}):
            raise ValueError(f"{key} is not supported by this server")
    if body.get("n", 1) != 1:
        raise ValueError(f"n={body.get('n')!r}: only n=1 is supported")
    max_tokens = body.get(max_tokens_key, body.get("max_tokens", 16))
    stop = as_tuple(body.get("stop"), "stop")
    if not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop={body.get('stop')!r} must be a string or a list of strings")
    ids = as_tuple(body.get("stop_token_ids"), "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos={ignore_eos!r} must be a boolean")
    seed = body.get("seed")
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
        top_k=body.get("top_k", 0), stop=stop, stop_token_ids=ids + (() if ignore_eos else end_ids),
        seed=random.getrandbits(32) if seed is None else seed)  # no seed: a fresh draw per request


def _stream_flag(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"stream={stream!r} must be a boolean")
    return stream


def parse_completion(body: Any, tokenizer) -> tuple[list[int], SamplingParams, bool]:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = [int(t) for t in tokenizer.encode(prompt)]
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")
    if not ids:
        raise ValueError("prompt must not be empty")
    return ids, _sampling(body, tokenizer, (tokenizer.eos_id,), "max_tokens"), _stream_flag(body)


def parse_chat(body: Any, tokenizer) -> tuple[list[int], SamplingParams, bool]:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with role in {ROLES} and string content")
    ids, end = chat_prompt(tokenizer, messages)
    return ids, _sampling(body, tokenizer, end, "max_completion_tokens"), _stream_flag(body)


def chat_prompt(tokenizer, messages: list[dict]) -> tuple[list[int], tuple[int, ...]]:
    """The K3 chat template's token ids, and the ids that end the assistant's turn."""
    special = getattr(tokenizer, "special", {})
    marks = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
    mark = (lambda s: [special[s]]) if all(m in special for m in marks) else \
        (lambda s: [int(t) for t in tokenizer.encode(s)])
    opener = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
              "tool": "<|im_system|>"}
    text = lambda s: [int(t) for t in tokenizer.encode(s)]
    ids: list[int] = []
    for m in messages:
        ids += mark(opener[m["role"]]) + text(m["role"]) + mark("<|im_middle|>") + text(m["content"]) + mark("<|im_end|>")
    ids += mark("<|im_assistant|>") + text("assistant") + mark("<|im_middle|>")
    end = (special["<|im_end|>"], tokenizer.eos_id) if "<|im_end|>" in special else (tokenizer.eos_id,)
    return ids, end


def completion_body(rid: str, model: str, text: str, reason: str | None, usage: dict | None, *,
                    chat: bool, chunk: bool, first: bool = False) -> dict:
    """A response (``chunk=False``) or one streamed chunk, in the endpoint's shape."""
    if chat:
        if chunk:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
