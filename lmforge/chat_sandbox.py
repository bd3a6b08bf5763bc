"""Chat templates rendered in child processes, under a time and an output-size limit.

A chat template is code from a model folder. Jinja's sandbox keeps it from Python's internals, but
not from looping: two nested `range(100000)` loops run for hours, and a loop in a thread cannot be
stopped from outside (it holds the GIL the server needs too). Each render therefore runs in a child
process (`python -c` importing this module; no fork of a process with threads and a model) that the
parent kills once `timeout` seconds have passed, or once the caller stops waiting (a client that
left). The child's address space is capped, so a template that builds a giant string fails there
with MemoryError, and a render that writes more than `max_chars` characters is refused.

`workers` children render at once; a caller waits for a free one (its wait is not counted in its
time), and a killed child is started again for the next render. Messages and pieces travel as one
JSON line each way. A child whose parent died exits at the end of its input, or, stuck in a render,
at its CPU-time limit (set before each render).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmforge.chat_render import Piece, TemplateRefused, TemplateRender, TemplateTooLong
from lmforge.errors import UserError

log = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # seconds a child may take to start (import Jinja) on a loaded machine
MIN_MEMORY = 1 << 30  # the least address space a child gets: Python and Jinja need ~100 MB of it


@dataclass(frozen=True)
class RenderLimits:
    timeout: float = 5.0  # seconds one prompt's render may take (`--template-timeout`)
    max_chars: int = 4 << 20  # characters it may write (`--max-template-chars`)
    workers: int = 2  # renders at once, each in a child process


class TemplateLimit(TemplateRefused):
    """A render stopped at a limit; the message is the whole line, naming the limit."""


class RenderCancelled(Exception):
    """The caller stopped waiting; the render was killed."""


class _Child:
    """One child process and the thread that reads its replies."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.replies: queue.Queue[bytes | None] = queue.Queue()
        self.loaded: set[str] = set()  # the templates this child has built (Sandbox keys)
        self.ready = False  # it said so, once started

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, limits: RenderLimits) -> None:
        # the lmforge this process runs, in the child too
        root = str(Path(__file__).resolve().parent.parent)
        memory = max(MIN_MEMORY, 64 * limits.max_chars)
        code = f"import sys; sys.path.insert(0, {root!r}); from lmforge.chat_sandbox import _child; _child({memory})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.replies, self.loaded, self.ready = queue.Queue(), set(), False
        threading.Thread(
            target=_read_lines,
            args=(self.proc.stdout, self.replies),
            daemon=True,
            name="lmforge-template-reader",
        ).start()

    def start(self, limits: RenderLimits) -> None:
        """Running and ready for a job, started (again) where it is not."""
        if not self.alive:
            self.spawn(limits)
        if not self.ready:
            reply = self._reply(time.monotonic() + START_TIMEOUT, None)
            if reply != {"ready": True}:
                self.kill()
                why = (
                    f"did not start within {START_TIMEOUT:g} s"
                    if reply is None
                    else "exited as it started"
                )
                raise RuntimeError(
                    f"the chat template renderer (a child process) {why}: see the log above"
                )
            self.ready = True

    def kill(self) -> None:
        if self.proc is not None:
            _kill(self.proc)
        self.proc = None

    def _reply(self, deadline: float, cancel: threading.Event | None) -> dict | None:
        """The child's next reply; None if time ran out; RenderCancelled if `cancel` was set
        first."""
        while (left := deadline - time.monotonic()) > 0:
            if cancel is not None and cancel.is_set():
                raise RenderCancelled
            try:
                line = self.replies.get(timeout=min(left, 0.05))
            except queue.Empty:
                continue
            if line is None:  # the child died: killed by the kernel (memory, CPU time) or crashed
                code = self.proc.wait() if self.proc is not None else None
                self.kill()
                return {
                    "refused": f"the chat template's renderer died (exit status {code}) on these messages"
                }
            return json.loads(line)
        return None

    def render(
        self,
        key: str,
        template: TemplateRender,
        messages: list[dict],
        generation_prompt: bool,
        limits: RenderLimits,
        cancel: threading.Event | None,
        retry: bool = True,
        tools: list | None = None,
    ) -> list[Piece]:
        job = {
            "key": key,
            "messages": messages,
            "tools": tools,
            "generation_prompt": generation_prompt,
            "max_chars": limits.max_chars,
            "timeout": limits.timeout,
        }
        if key not in self.loaded:
            job["template"] = {
                "source": template.source,
                "variables": template.variables,
                "specials": template.specials,
            }
        try:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # it died since it was last asked: once more, from a new one
            self.kill()
            if not retry:
                raise RuntimeError(
                    "the chat template renderer exits as soon as it starts: see the log"
                ) from None
            self.start(limits)
            return self.render(
                key, template, messages, generation_prompt, limits, cancel, False, tools
            )
        self.loaded.add(key)
        try:
            reply = self._reply(time.monotonic() + limits.timeout, cancel)
        except RenderCancelled:
            self.kill()
            raise
        if reply is None:
            self.kill()
            raise TemplateLimit(
                f"the model's chat template took longer than {limits.timeout:g} s to render these "
                "messages and was stopped (the limit: --template-timeout)"
            )
        if "limit" in reply:
            raise TemplateLimit(reply["limit"])
        if "refused" in reply:
            raise TemplateRefused(reply["refused"])
        return [(p, in_span) for p, in_span in reply["pieces"]]


class Sandbox:
    """Renders chat templates in `limits.workers` child processes, started at the first render
    (or `start`)."""

    def __init__(self, limits: RenderLimits | None = None):
        self.limits = limits or RenderLimits()
        self._children = [_Child() for _ in range(max(1, self.limits.workers))]
        self._free: queue.Queue[_Child] = queue.Queue()
        for child in self._children:
            self._free.put(child)
        self._keys: weakref.WeakKeyDictionary[TemplateRender, str] = weakref.WeakKeyDictionary()
        self._count = itertools.count()
        weakref.finalize(self, _kill_all, self._children)

    def start(self) -> None:
        """Start every child now, side by side (a server does, so that its first chat does not
        wait for one)."""
        children = [self._free.get() for _ in self._children]
        try:
            for child in children:
                if not child.alive:
                    child.spawn(self.limits)
            for child in children:
                child.start(self.limits)
        finally:
            for child in children:
                self._free.put(child)

    def pieces(
        self,
        template: TemplateRender,
        messages: Sequence[dict],
        generation_prompt: bool,
        cancel: threading.Event | None = None,
        tools: list | None = None,
    ) -> list[Piece]:
        """`template.pieces(messages, generation_prompt, spans=False, tools=tools)`, in a child:
        TemplateRefused where the template fails or refuses, TemplateLimit past a limit,
        RenderCancelled once `cancel` is set."""
        if (key := self._keys.get(template)) is None:
            key = self._keys[template] = str(next(self._count))
        child = self._free.get()
        try:
            child.start(self.limits)
            return child.render(
                key, template, list(messages), generation_prompt, self.limits, cancel, tools=tools
            )
        finally:
            self._free.put(child)

    def close(self) -> None:
        _kill_all(self._children)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    try:
        proc.stdin.close()  # its stdout is the reader thread's, closed there at the end
    except OSError:
        pass


def _kill_all(children: list[_Child]) -> None:
    for child in children:
        child.kill()


def _read_lines(stream, replies: queue.Queue) -> None:
    with stream:
        for line in stream:
            replies.put(line)
    replies.put(None)


# -- the child ---------------------------------------------------------------------------------


def _child(memory: int) -> None:
    """Read jobs (one JSON line each) from stdin, answer each with one JSON line on stdout, until
    stdin ends."""
    import signal

    # Ctrl+C reaches the whole process group: the parent stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout = sys.stderr  # nothing a library prints may corrupt the replies
    resource = _limit(memory)
    templates: dict[str, TemplateRender] = {}
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        # a child whose parent died mid-render stops itself, a little past the timeout
        if resource is not None:
            used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
            _, hard = resource.getrlimit(resource.RLIMIT_CPU)
            soft = int(used + job["timeout"]) + 10
            resource.setrlimit(
                resource.RLIMIT_CPU,
                (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard),
            )
        out.write(json.dumps(_answer(job, templates)) + "\n")
        out.flush()


def _answer(job: dict, templates: dict[str, TemplateRender]) -> dict:
    try:
        if "template" in job:
            templates[job["key"]] = TemplateRender(**job["template"])
        template = templates[job["key"]]
        template.max_chars = job["max_chars"]
        pieces = template.pieces(
            job["messages"], job["generation_prompt"], spans=False, tools=job.get("tools")
        )
        return {"pieces": pieces}
    except TemplateTooLong as e:
        return {"limit": str(e)}
    except (TemplateRefused, UserError) as e:
        return {"refused": str(e)}
    except MemoryError:  # outside the render itself (the reply): the address space cap
        return {"refused": "MemoryError: the chat template's render ran out of memory"}


def _limit(memory: int):
    """Cap the address space at `memory` bytes; the resource module, or None where there is none
    (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ValueError, OSError):  # macOS does not enforce it; a hard limit below ours
        pass
    return resource
