"""What every HTTP run shares: the client, the model id, the record and the progress display."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from rich.progress import Progress

from app.bench.client import RequestResult, Round, chat_body, run_round
from app.bench.record import Record

PROMPT = "Count from 1 to 100."  # the customer's prompt: short, so decode dominates


@dataclass
class Ctx:
    client: httpx.AsyncClient
    model: str
    record: Record
    progress: Progress
    timeout: float
    logprobs: bool = False  # ask for logprobs so every token has its own arrival time

    async def chat_round(self, concurrency: int, max_tokens: int, prompt: str = PROMPT) -> Round:
        """``concurrency`` identical greedy chat requests sent at once, ignore_eos set."""
        body = chat_body(self.model, prompt, max_tokens, logprobs=self.logprobs)
        return await run_round(self.client, [body] * concurrency, self.timeout)

    async def warm_up(self, concurrency: int, rounds: int, max_tokens: int, where: str) -> dict:
        """Warm-up rounds (they fill the expert cache); their failures are recorded too."""
        results: list[RequestResult] = []
        for _ in range(rounds):
            results += (await self.chat_round(concurrency, max_tokens)).results
        return {"rounds": rounds, "max_tokens": max_tokens, "failed_requests": self.fail_warmups(results, where)}

    def fail_warmups(self, results: list[RequestResult], where: str) -> int:
        """Records each failed warm-up request (as '<where> warm-up'); returns how many failed."""
        failed = [r for r in results if not r.ok]
        for r in failed:
            self.record.fail(f"{where} warm-up", r.error, status=r.status)
        return len(failed)
