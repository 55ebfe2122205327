"""One streamed request with exact client-side timings, and rounds of concurrent requests.

Times are `time.perf_counter()` seconds, relative to the moment the request was sent. Tokens are
counted from the server's `usage` (asked for with `stream_options.include_usage`); with
``logprobs=True`` each chunk also says how many tokens it carries, so every token has its own
arrival time (a token whose text is empty, e.g. a special token, sends no chunk otherwise). A chat
chunk carries a token whichever channel the server's parsers put it on (content, reasoning_content,
tool_calls); ``text`` keeps the content only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestResult:
    """What one request did. ``error`` set means it failed (its figures are not used)."""

    sent_at: float  # perf_counter seconds when the request was sent (absolute)
    ttft_s: float | None = None  # first token, seconds after sending
    end_s: float | None = None  # last token / finish chunk, seconds after sending
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix cache); None: not reported
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    status: int | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list)  # seconds after sending, one per token seen

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e_tok_s(self) -> float | None:
        """Completion tokens over the whole request time (TTFT included)."""
        if not self.ok or not self.completion_tokens or not self.end_s:
            return None
        return self.completion_tokens / self.end_s

    @property
    def steady_tok_s(self) -> float | None:
        """Steady decode: tokens after the first over the time after the first (SPEC's definition)."""
        if not self.ok or not self.completion_tokens or self.completion_tokens < 2:
            return None
        span = (self.end_s or 0.0) - (self.ttft_s or 0.0)
        return (self.completion_tokens - 1) / span if span > 0 else None

    def as_dict(self, keep_text: bool = False, keep_times: bool = False) -> dict:
        """The record's row: every field, the two rates and `text_sha256` (the first 16 hex digits of the output
        text's SHA-256: two greedy runs streamed the same text where they agree); the text itself with keep_text,
        the token arrival times with keep_times."""
        d = asdict(self)
        d["e2e_tok_s"], d["steady_tok_s"] = self.e2e_tok_s, self.steady_tok_s
        d["text_sha256"] = hashlib.sha256(self.text.encode()).hexdigest()[:16]
        if not keep_text:
            d.pop("text")
        if not keep_times:
            d.pop("token_times")
        return d


def chat_body(model: str, prompt: str | list[dict], max_tokens: int, *, ignore_eos: bool = True,
              logprobs: bool = False) -> tuple[str, dict]:
    """(path, JSON body) of a greedy streamed chat completion. prompt: one user message's text, or the
    whole conversation (a list of messages)."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = _greedy_stream(model, max_tokens, ignore_eos, messages=messages)
    if logprobs:
        body["logprobs"], body["top_logprobs"] = True, 0
    return "/v1/chat/completions", body


def completion_body(model: str, prompt: str, max_tokens: int, *, ignore_eos: bool = True,
                    logprobs: bool = False) -> tuple[str, dict]:
    """(path, JSON body) of a greedy streamed text completion (no chat template: exact prompt sizes).
    logprobs: ask for the sampled tokens' logprobs (logprobs=0), so every token has its own arrival time."""
    body = _greedy_stream(model, max_tokens, ignore_eos, prompt=prompt)
    if logprobs:
        body["logprobs"] = 0
    return "/v1/completions", body


def _greedy_stream(model: str, max_tokens: int, ignore_eos: bool, **fields) -> dict:
    """The body both routes share: greedy, streamed, usage in the last chunk; `fields` the route's input."""
    body = {"model": model, **fields, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_tokens(choice: dict) -> tuple[str, int | None]:
    """(text, tokens this chunk carries when logprobs say so, else None; 1 for a chat chunk whose token went
    to reasoning_content or tool_calls, which leaves the answer's text empty)."""
    if "delta" in choice:  # chat
        delta = choice["delta"]
        text = delta.get("content") or ""
        content = (choice.get("logprobs") or {}).get("content")
        if content is not None:
            return text, len(content)
        # NOTE: a thinking model's first tokens are reasoning: without this its TTFT was the first answer token's
        return text, (1 if not text and (delta.get("reasoning_content") or delta.get("tool_calls")) else None)
    text = choice.get("text") or ""
    tokens = (choice.get("logprobs") or {}).get("tokens")
    return text, (len(tokens) if tokens is not None else None)


async def stream_request(client: httpx.AsyncClient, path: str, body: dict, timeout: float,
                         result: RequestResult | None = None) -> RequestResult:
    """Send one streamed request and time it. Never raises for server or network errors: they
    end up in ``result.error`` (a failed request is recorded, not dropped). result: the object to
    fill as tokens arrive (a caller that watches the stream while it runs passes its own; its
    sent_at is set at the send); default a new one."""
    res = result if result is not None else RequestResult(sent_at=time.perf_counter())
    res.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, timeout=timeout) as r:
            res.status = r.status_code
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {_message(raw)}"
                return res
            async for line in r.aiter_lines():
                now = time.perf_counter() - res.sent_at
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    # NOTE: read on to the body's end, never break here: httpx closes a connection whose body was
                    # left unread, so every round opened new ones, and the request that found the one idle
                    # connection (a stats poll's) reached the server alone, ahead of the round (session 40: bs6's
                    # first measured round ran as two cohorts, 1 and 5, at 60 % of the second's rate)
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    res.completion_tokens = chunk["usage"].get("completion_tokens")
                    res.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in chunk.get("choices") or []:
                    text, count = _chunk_tokens(choice)
                    # NOTE: a role-only opening chunk carries no token; one that carries a token
                    # has text or logprobs, and the finish chunk ends the timing.
                    if not text and not count and choice.get("finish_reason") is None:
                        continue
                    if res.ttft_s is None and (text or count):
                        res.ttft_s = now
                    if text or count:
                        res.token_times.extend([now] * (count if count is not None else 1))
                        res.end_s = now
                    res.text += text
                    if choice.get("finish_reason") is not None:
                        res.finish_reason = choice["finish_reason"]
                        res.end_s = now
                        if res.ttft_s is None:
                            res.ttft_s = now  # every token was silent: the finish is the first sign
    except (TimeoutError, httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if res.completion_tokens is None and res.token_times:
        res.completion_tokens = len(res.token_times)  # no usage: count the token chunks (too few if some sent none)
    if res.end_s is None:
        res.error = "the stream ended without a token or a finish reason"
    return res


def _message(raw: str) -> str:
    try:
        body = json.loads(raw)
        return str(body.get("error", {}).get("message") or body)[:500]
    except (ValueError, AttributeError):
        return raw[:500]


@dataclass
class Round:
    """Requests sent at the same moment; wall_s = first send to last token."""

    results: list[RequestResult]
    wall_s: float

    @property
    def ok_results(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens or 0 for r in self.ok_results)

    @property
    def aggregate_tok_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s > 0 and self.ok_results else None


async def run_round(client: httpx.AsyncClient, requests: list[tuple[str, dict]], timeout: float) -> Round:
    """Send every request at once (separate concurrent streams) and wait for all of them."""
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_request(client, p, b, timeout) for p, b in requests))
    ends = [r.sent_at + r.end_s for r in results if r.ok and r.end_s is not None]
    wall = (max(ends) if ends else time.perf_counter()) - start
    return Round(list(results), wall)
