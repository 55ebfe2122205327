"""`ft bench smoke`: the semantic smoke test, one question with one exact answer.

A fast server that answers wrongly is broken, not fast: greedy decoding, the answer compared
with the expected one exactly (after trimming whitespace) or, with ``contains``, as a whole word.
"""

from __future__ import annotations

import re

from app.bench.client import chat_body, stream_request
from app.bench.context import Ctx


def passes(answer: str, expected: str, match: str) -> bool:
    if match == "exact":
        return answer.strip() == expected
    return re.search(rf"(?<!\w){re.escape(expected)}(?!\w)", answer) is not None


async def run(ctx: Ctx, *, prompt: str, expected: str, match: str, max_tokens: int) -> None:
    task = ctx.progress.add_task("smoke", total=1)
    res = await stream_request(ctx.client, *chat_body(ctx.model, prompt, max_tokens, ignore_eos=False), ctx.timeout)
    ctx.progress.advance(task)
    passed = res.ok and passes(res.text, expected, match)
    ctx.record.points.append({"prompt": prompt, "expected": expected, "match": match, "answer": res.text,
                              "passed": passed, **res.as_dict()})
    if not res.ok:
        ctx.record.fail("smoke", res.error, status=res.status)
    elif not passed:
        ctx.record.fail("smoke", f"wrong answer {res.text!r}, expected {expected!r} ({match})")
