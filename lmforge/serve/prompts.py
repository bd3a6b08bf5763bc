"""A request's prompt made off the event loop: its JSON body parsed, its chat template rendered, its
text tokenized.

Each of these takes time that grows with the request (a 1 MB body, a slow template), and on the
event loop it would hold every other request, /health included, for that long. They run on a few
worker threads instead: a render waits there for one of lmforge.chat_sandbox's child processes (no
more threads wait so than there are children, so that slow renders leave threads for everything
else), and tokenizing lets other threads run (`encode_batch`: the `tokenizers` library releases the
GIL there, not in `encode`). If the client disconnects first, its work is given up: not started if
it still waits for a thread, its render killed if one runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from fastapi import Request

from lmforge.serve.chat import ChatFormat, tokenizer_errors
from lmforge.serve.protocol import APIError

T = TypeVar("T")


class PromptWork:
    """The worker threads, and the lock every tokenizer call holds: a raw prompt is read with
    special-token text as those tokens (`reading_special_tokens` flips a flag on the tokenizer),
    a chat message's never, so two prompts must not be tokenized at once."""

    def __init__(self, tokenizer, chat: ChatFormat, threads: int = 2):
        self.tokenizer, self.chat = tokenizer, chat
        renders = chat.limits.workers if chat.sandbox is not None else 0
        self.executor = ThreadPoolExecutor(renders + threads, thread_name_prefix="lmforge-prompt")
        self.renders = asyncio.Semaphore(max(1, renders))
        self.lock = threading.Lock()

    @contextmanager
    def tokenizing(self, param: str):
        with self.lock, tokenizer_errors(param):
            yield

    async def run(self, request: Request, work: Callable[[threading.Event], T]) -> T:
        """work(cancel) on a worker thread; a 499 if the client disconnects first (`cancel` is
        then set)."""
        cancel = threading.Event()
        job = asyncio.get_running_loop().run_in_executor(self.executor, _call, work, cancel)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task was cancelled (the server stops)
            cancel.set()
            job.cancel()
            raise
        finally:
            gone.cancel()
        if not job.done():
            cancel.set()
            job.cancel()
            raise APIError(499, "the client closed the connection")
        return job.result()

    async def body(self, request: Request, parse: Callable[[bytes], T]) -> T:
        raw = await request.body()
        return await self.run(request, lambda _: parse(raw))

    async def texts(
        self, request: Request, prompts: Sequence[str | list[int]], param: str = "prompt"
    ) -> list[list[int]]:
        return await self.run(request, lambda _: [self.encode_text(p, param) for p in prompts])

    async def chat_ids(
        self, request: Request, messages: Sequence[tuple[str, str] | dict], tools=None
    ) -> list[int]:
        async with self.renders:
            return await self.run(
                request,
                lambda cancel: self.chat.encode(messages, cancel, self.tokenizing, tools=tools),
            )

    def encode_text(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, list):
            return prompt
        # The whole model input, written by the client: special-token text is those tokens, as vLLM
        # and TGI read a raw prompt (a chat message's never is: lmforge.serve.chat).
        with self.tokenizing(param), self.tokenizer.reading_special_tokens():
            ids = self.tokenizer.encode_batch([prompt], add_bos=self.tokenizer.add_bos_token)[0]
        if not ids:
            raise APIError(400, "the prompt is empty: give it some text", param=param)
        return ids

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _call(work: Callable[[threading.Event], T], cancel: threading.Event) -> T:
    try:
        return work(cancel)
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 (as an Exception, the app answers it in JSON: a 500 with its name)
        raise RuntimeError(f"{type(e).__name__}: {e}") from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
