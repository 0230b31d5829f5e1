"""Sends a workload's requests to an OpenAI-compatible endpoint (async httpx), at most
``concurrency`` at a time, each streamed so first-token and inter-token times are the
client's own measurements."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdflow.bench.workloads.base import RequestResult, WorkRequest

PROGRESS_MIN_REQUESTS = 8


@dataclass(kw_only=True, slots=True, frozen=True)
class Target:
    """An API root (``http://host:port``, no ``/v1``), the model name, and a key if any."""

    url: str
    model: str
    api_key: str | None = None


def payload(target: Target, req: WorkRequest) -> dict:
    body = {"model": target.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": req.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if req.stop:
        body["stop"] = req.stop
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.return_token_ids:
        body["return_token_ids"] = True
    return body


async def send(client: httpx.AsyncClient, target: Target, req: WorkRequest, t0: float) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False, sent_at_s=start - t0)
    chunk_times: list[float] = []
    try:
        async with client.stream("POST", "/v1/completions", json=payload(target, req)) as answer:
            if answer.status_code != 200:
                body = (await answer.aread()).decode(errors="replace")
                result.error = f"HTTP {answer.status_code}: {_message(body)}"
                return result
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.ok = result.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = _message(data)
                    break
                if chunk.get("choices"):
                    chunk_times.append(time.perf_counter() - start)
                    choice = chunk["choices"][0]
                    result.text += choice.get("text") or ""
                    result.token_ids += choice.get("token_ids") or []
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    _take_usage(result, chunk["usage"])
            else:
                result.error = result.error or "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if chunk_times:
        result.ttft_s, result.latency_s = chunk_times[0], chunk_times[-1]
        result.itl_s = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return result


def _take_usage(result: RequestResult, usage: dict) -> None:
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.completion_tokens = usage.get("completion_tokens", 0)
    result.num_draft_tokens = usage.get("num_draft_tokens")
    result.num_accepted_draft_tokens = usage.get("num_accepted_draft_tokens")
    result.num_verify_steps = usage.get("num_verify_steps")
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def _message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:300]


def _client(target: Target, concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(base_url=target.url, headers=headers, limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=10.0))


def _bar(progress: bool, total: int, label: str) -> Progress:
    console = Console(stderr=True)
    show = progress and total >= PROGRESS_MIN_REQUESTS and console.is_terminal
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not show)


async def drive(
    target: Target, requests: list[WorkRequest], *, concurrency: int, timeout_s: float,
    progress: bool = True, label: str = "requests",
) -> tuple[list[RequestResult], float]:
    """Results in request order and the wall time from the first send to the last answer.
    Requests with ``arrival_s`` wait for it (trace replay, Poisson load) before queueing."""
    bar = _bar(progress, len(requests), label)
    gate = asyncio.Semaphore(concurrency)
    async with _client(target, concurrency, timeout_s) as client:
        with bar:
            task = bar.add_task(label, total=len(requests))
            t0 = time.perf_counter()

            async def one(req: WorkRequest) -> RequestResult:
                if req.arrival_s is not None:
                    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
                async with gate:
                    result = await send(client, target, req, t0)
                bar.advance(task)
                return result

            results = await asyncio.gather(*(one(r) for r in requests))
            wall = time.perf_counter() - t0
    return list(results), wall


async def drive_turns(
    target: Target, first: list[WorkRequest], follow_up: Callable[[WorkRequest, RequestResult], WorkRequest | None],
    *, concurrency: int, timeout_s: float, progress: bool = True, label: str = "requests", total: int = 0,
) -> tuple[list[WorkRequest], list[RequestResult], float]:
    """Closed loop: ``first`` are ready at the start; each answer may make a next request
    (``follow_up``), ready once that answer is back, or from its ``arrival_s`` (seconds
    after the start) when it has one: a user's think time. At most ``concurrency`` in
    flight, ready requests sent in the order they became ready (were due). Returns the
    requests in the order they were sent, their results, and the wall time. ``total``:
    the expected count, for the progress bar only."""
    # (ready at, the order they came in, request); no arrival_s: ready when it came.
    ready: list[tuple[float, int, WorkRequest]] = []
    came = itertools.count()
    for req in first:
        heapq.heappush(ready, _ready_entry(req, next(came), 0.0))
    sent, results = [], []
    in_flight = 0
    changed = asyncio.Condition()
    bar = _bar(progress, total or len(first), label)
    async with _client(target, concurrency, timeout_s) as client:
        with bar:
            task = bar.add_task(label, total=total or len(first))
            t0 = time.perf_counter()

            def can_go() -> bool:  # a request is ready, or none is in flight to make one
                return bool(ready) or in_flight == 0

            async def sender() -> None:
                nonlocal in_flight
                while True:
                    async with changed:
                        await changed.wait_for(can_go)
                        if not ready:  # nothing ready and nothing in flight: every conversation ended
                            return
                        if (due := ready[0][0] - (time.perf_counter() - t0)) > 0:  # the user still thinks
                            with contextlib.suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(changed.wait(), due)
                            continue
                        req, slot = heapq.heappop(ready)[2], len(sent)
                        sent.append(req)
                        results.append(None)
                        in_flight += 1
                    after = None
                    try:
                        results[slot] = result = await send(client, target, req, t0)
                        bar.advance(task)
                        after = follow_up(req, result)
                    finally:  # a follow-up that raises still lets the other senders finish
                        async with changed:
                            in_flight -= 1
                            if after is not None:
                                heapq.heappush(ready, _ready_entry(after, next(came), time.perf_counter() - t0))
                            changed.notify_all()

            await asyncio.gather(*(sender() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
    return sent, results, wall


def _ready_entry(req: WorkRequest, order: int, now_s: float) -> tuple[float, int, WorkRequest]:
    return (now_s if req.arrival_s is None else req.arrival_s, order, req)
