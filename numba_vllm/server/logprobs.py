"""Logprobs in the OpenAI answers, from the engine's per-position dicts (`engine/logprobs.py`).

Completions (the legacy shape, which lm-evaluation-harness reads):
    {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
     "text_offset": [int]}
one entry per token: with `echo`, the prompt's tokens first (the first has no logprob: None), then
the output's; `text_offset` is where each token's text begins in the choice's text.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
with the top `top_logprobs` tokens, most likely first.
vLLM's `prompt_logprobs` extension: the choice's `prompt_logprobs`, one entry per prompt token (None
for the first), each {token id: {"logprob", "rank", "decoded_token"}}.
A token's text is its `decoded_token` (special tokens included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def completion_logprobs(
    token_ids: Sequence[int], dicts: Sequence[dict | None], decode: Callable[[int], str], offset: int = 0
) -> dict:
    """The completions logprobs object of tokens `token_ids` with their dicts (None: no logprob, as for
    the first prompt token); `decode(id)` names a token that has no dict; `offset`: text before them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, d in zip(token_ids, dicts, strict=True):
        text = decode(token) if d is None else _text(d[token].decoded_token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if d is None else d[token].logprob)
        out["top_logprobs"].append(None if d is None else {_text(lp.decoded_token): lp.logprob for lp in d.values()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def join_completion_logprobs(a: dict | None, b: dict) -> dict:
    """Two completions logprobs objects, one after the other (b's offsets already continue a's)."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def chat_logprobs(token_ids: Sequence[int], dicts: Sequence[dict], top: int) -> dict:
    """The chat logprobs object of the sampled tokens `token_ids` with their dicts, `top` alternatives each."""
    content = []
    for token, d in zip(token_ids, dicts, strict=True):
        ranked = sorted((lp.rank, t) for t, lp in d.items() if lp.rank is not None and lp.rank <= top)[:top]
        content.append({**_chat_entry(d[token]), "top_logprobs": [_chat_entry(d[t]) for _, t in ranked]})
    return {"content": content}


def prompt_logprobs_field(dicts: list[dict | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: the engine's dicts as JSON (ids as keys)."""
    return [None if d is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()} for d in dicts]  # fmt: skip


def _chat_entry(lp) -> dict:
    text = _text(lp.decoded_token)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def _text(decoded: str | None) -> str:
    return "" if decoded is None else decoded


class ChoiceLogprobs:
    """What one HTTP request's choices add for logprobs and echo, non-streamed or chunk by chunk.

    chat: the chat shape, with `top` alternatives a token; otherwise completions, with `echo_texts`
    (each prompt's text, when `echo`) put before the output with the prompt's logprobs, and
    `echo_only` (echo with max_tokens 0): the one sampled token left out of the answer.
    `wanted`: whether the request asked for logprobs of its output at all.
    """

    def __init__(self, chat: bool, wanted: bool, top: int, prompts: list[list[int]], n: int, echo_texts: list[str] | None,
                 echo_only: bool, decode: Callable[[int], str], prompt_field: bool = False):  # fmt: skip
        """Choice i is sequence i % n of prompt i // n (`n` sequences a prompt); `prompt_field`: the
        request asked for vLLM's `prompt_logprobs` field."""
        self.chat, self.wanted, self.top, self.n, self.prompt_field = chat, wanted, top, n, prompt_field
        self.prompts, self.echo_texts, self.echo_only, self.decode = prompts, echo_texts, echo_only, decode
        self.offsets = [0] * (len(prompts) * n)  # text already in each choice (completions' text_offset)

    def prefix(self, i: int, prompt_logprobs: list | None) -> tuple[str, dict | None]:
        """Choice i's echoed prompt (text, logprobs), or ("", None) without echo."""
        if self.echo_texts is None:
            return "", None
        text = self.echo_texts[i // self.n]
        logprobs = None
        if self.wanted and prompt_logprobs is not None:
            logprobs = completion_logprobs(self.prompts[i // self.n], prompt_logprobs, self.decode, self.offsets[i])
        self.offsets[i] += len(text)
        return text, logprobs

    def output(self, i: int, text: str, token_ids: list[int], dicts: list | None) -> tuple[str, list[int], dict | None]:
        """Choice i's new output (text, ids, logprobs): nothing with echo_only."""
        if self.echo_only:
            return "", [], None
        logprobs = None
        if self.wanted and dicts is not None:
            if self.chat:
                logprobs = chat_logprobs(token_ids, dicts, self.top)
            else:
                logprobs = completion_logprobs(token_ids, dicts, self.decode, self.offsets[i])
        self.offsets[i] += len(text)
        return text, token_ids, logprobs
