"""The training script's output on `tm-slurm run`'s terminal, as torchrun and `srun --label` show
it: each line of a streamed rank (`output.ranks`, rank 0 by default) led by `[rank<r>]: `.

An agent reads each worker's stdout and stderr (one pipe, whose write end is the worker's only)
into the worker's log file, every byte, and sends the complete lines of the streamed ranks to the
controller (messages.Output), which prints them (Console). Everything on the way is bounded: a
line is cut at MAX_LINE bytes, an agent forwards at most BUDGET bytes each WINDOW_S and counts
what it drops (a worker's last TAIL lines are sent when it exits, whatever the budget), and
the controller's prints wait for a slow terminal on a thread of their own; no queue grows with
what a worker prints. The agent imports this module: no torch here.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, TextIO

from .messages import Output

MAX_LINE = 4096                 # bytes of one line forwarded; the rest of it only in the log file
CUT = f" [tm-slurm: line cut at {MAX_LINE} bytes]".encode()
CHUNK = 1 << 16                 # one read of a pipe: what a default pipe holds
DRAIN = 1 << 20                 # read at most this much of an exited worker's pipe at once
BUDGET = 128 << 10              # bytes an agent forwards each WINDOW_S, all its workers together:
WINDOW_S = 4.0                  # 32 KiB/s, a start-up banner or a traceback whole
FLUSH_S = 0.1                   # an agent sends its workers' lines this often: few messages
TAIL = 20                       # a worker's last lines, sent when it exits whatever the budget
QUEUED = 1 << 20                # characters the controller holds for a terminal that reads slowly


def streamed(spec: str) -> Callable[[int | None], bool]:
    """Whether a rank's lines are forwarded, by `output.ranks` as config.py normalizes it ("all",
    "none" or "0,8"). A worker without a rank (a rehearsing standby) never is."""
    if spec in ("all", "none"):
        every = spec == "all"
        return lambda rank: every and rank is not None
    chosen = frozenset(int(r) for r in spec.split(","))
    return lambda rank: rank in chosen


def _redrawn(b: bytes) -> bytes:
    """What a terminal would show of `b`: a carriage return (not the last byte, which may be half
    of a CRLF) starts the line over. A progress bar redrawn in place is then its last state, not
    every frame of it, nor a line that grows until it is cut."""
    return b[b.rfind(b"\r", 0, len(b) - 1) + 1:]


class Lines:
    """Complete lines out of a byte stream. A line longer than `cap` is cut there, with a marker,
    and the rest of it, up to its newline, dropped: what is held stays under `cap` bytes whatever
    a worker prints."""

    def __init__(self, cap: int = MAX_LINE):
        self.cap = cap
        self.part = b""                 # the unfinished line
        self.cutting = False            # inside a line already cut: drop up to its newline

    def feed(self, data: bytes) -> list[bytes]:
        *done, rest = (self.part + data).split(b"\n")
        out = []
        for line in done:
            if self.cutting:
                self.cutting = False    # the end of the cut line
                continue
            out.append(self._cap(_redrawn(line).rstrip(b"\r")))
        self.part = b"" if self.cutting else _redrawn(rest)
        if len(self.part) > self.cap:
            out.append(self.part[:self.cap] + CUT)
            self.part, self.cutting = b"", True
        return out

    def skip(self, data: bytes) -> None:
        """`data` is not forwarded (its rank is not streamed): only where a line ends is kept, so
        that a standby promoted mid-line does not show half of one. Nothing is split."""
        i = data.rfind(b"\n")
        if i >= 0:
            self.part, self.cutting = b"", False
        self.part += data[i + 1:]
        if len(self.part) > self.cap:
            self.part, self.cutting = b"", True

    def end(self) -> list[bytes]:
        """The last line, unfinished when the stream ended (a worker that died mid-print)."""
        part, self.part = self.part, b""
        return [self._cap(part)] if part and not self.cutting else []

    def _cap(self, line: bytes) -> bytes:
        return line if len(line) <= self.cap else line[:self.cap] + CUT


class Pipe:
    """The agent's end of one worker's stdout and stderr: every byte goes to the worker's log
    file, and the complete lines come out when the worker's rank is streamed."""

    def __init__(self, fd: int, log: Path, warn: Callable[[OSError], None]):
        os.set_blocking(fd, False)      # the agent's loop must never wait on a worker's output
        self.fd, self.warn = fd, warn
        self.log = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self.lines = Lines()
        self.ended = False              # end of file: for the owner to close
        self.closed = False
        self.log_failed = False

    def read(self, streamed: bool, limit: int = CHUNK) -> list[bytes]:
        """What has arrived, up to `limit` bytes: its complete lines if `streamed`. At the end of
        the file (the worker and whatever inherited its pipe are gone) its last line too, and
        `ended` is set."""
        out: list[bytes] = []
        got = 0
        while got < limit and not self.ended:
            try:
                data = os.read(self.fd, CHUNK)
            except BlockingIOError:
                break
            if not data:
                out += self.lines.end() if streamed else []
                self.ended = True
                break
            got += len(data)
            self._log(data)
            if streamed:
                out += self.lines.feed(data)
            else:
                self.lines.skip(data)
        return out

    def note(self, text: str) -> None:
        """Something the worker did not print itself (its crash report's traceback): for the log
        file only."""
        self._log(text.encode(errors="replace") + (b"" if text.endswith("\n") else b"\n"))

    def _log(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self.log, data):]
        except OSError as e:
            # the worker must not block on a full disk: what cannot be written is lost, said once
            if not self.log_failed:
                self.log_failed = True
                self.warn(e)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            os.close(self.log)


class Forwarder:
    """An agent's lines on their way to the controller, in one Output a worker every FLUSH_S.
    At most BUDGET bytes of them pass each WINDOW_S: a flood shows as whole runs of lines, and
    what a window dropped is counted after its last line shown. A worker's last dropped lines
    (TAIL of them) are sent when it exits, whatever the budget: its last words, a traceback.
    What is held stays under BUDGET bytes and a few counts."""

    def __init__(self, node: str, budget: int = BUDGET, window: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.node, self.budget, self.window, self.clock = node, budget, window, clock
        self.tokens, self.window_end = 0, 0.0
        self.held: dict[tuple[int, int], list[bytes]] = {}     # (local, rank) -> lines
        self.dropped: dict[tuple[int, int], int] = {}           # bytes, this window
        self.tails: dict[tuple[int, int], deque[bytes]] = {}   # the last dropped, none shown since
        self.ready: list[Output] = []       # closed by their window's end: lines, then the count
        self.flush_at = 0.0

    def add(self, local: int, rank: int, lines: list[bytes]) -> None:
        now = self.clock()
        if now >= self.window_end:
            self._close_window()
            self.tokens, self.window_end = self.budget, now + self.window
        key = (local, rank)
        for i, line in enumerate(lines):
            if len(line) + 1 > self.tokens:
                rest = lines[i:]
                self.dropped[key] = self.dropped.get(key, 0) + sum(map(len, rest)) + len(rest)
                self.tails.setdefault(key, deque(maxlen=TAIL)).extend(rest[-TAIL:])
                return
            self.tokens -= len(line) + 1
            self.held.setdefault(key, []).append(line)
        self.tails.pop(key, None)       # older than what is shown now

    def due(self) -> list[Output]:
        """The messages to send now."""
        now = self.clock()
        if now >= self.window_end:
            self._close_window()
        if now < self.flush_at or not (self.held or self.ready):
            return []
        self.flush_at = now + FLUSH_S
        out, self.ready = self.ready, []
        return out + [self._take(k, 0) for k in sorted(self.held)]

    def ended(self, local: int) -> list[Output]:
        """Worker `local` exited: all that is held of it, what it dropped, then its last dropped
        lines."""
        out = [m for m in self.ready if m.local == local]
        self.ready = [m for m in self.ready if m.local != local]
        for key in sorted(k for k in {*self.held, *self.dropped, *self.tails} if k[0] == local):
            tail = tuple(self.tails.pop(key, ()))
            # (a count already sent, at the end of a window, included the tail: not shown then)
            dropped = max(0, self.dropped.pop(key, 0) - sum(map(len, tail)) - len(tail))
            if key in self.held or dropped:
                out.append(self._take(key, dropped))
            if tail:
                out.append(Output(self.node, *key, _text(tail)))
        return out

    def _close_window(self) -> None:
        """A window ended: what it dropped of each worker follows that worker's lines held."""
        self.ready += [self._take(k, self.dropped.pop(k)) for k in sorted(self.dropped)]

    def _take(self, key: tuple[int, int], dropped: int) -> Output:
        return Output(self.node, *key, _text(self.held.pop(key, ())), dropped)


def _text(lines) -> tuple[str, ...]:
    return tuple(x.decode("utf-8", "replace") for x in lines)


def prefixed(m: Output, log_dir: Path) -> str:
    """An Output as the controller prints it."""
    head = f"[rank{m.rank}]: "
    text = "".join(f"{head}{line}\n" for line in m.lines)
    if m.dropped:
        text += (f"{head}tm-slurm: {m.dropped} bytes of output not shown (over {BUDGET >> 10} KiB "
                 f"in {WINDOW_S:g} s from {m.node}); all of it is in "
                 f"{log_dir / f'{m.node}.w{m.local}.log'}\n")
    return text


class Console:
    """What the controller prints for the user: the streamed ranks' lines on its stdout, the
    training script's own error on its stderr, once. Written by a thread of its own: a terminal
    that reads slowly (paused, or piped into a pager) holds that thread, never the control loop;
    what exceeds QUEUED characters waiting is dropped, and said so."""

    OTHER_ERRORS = 3                    # different script errors summarized after the first

    def __init__(self, log_dir: Path, out: TextIO | None = None, err: TextIO | None = None,
                 limit: int = QUEUED):
        self.log_dir, self.limit = log_dir, limit
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.queue: deque[tuple[TextIO, str]] = deque()
        self.queued = self.dropped = 0
        self.cv = threading.Condition()
        self.thread: threading.Thread | None = None
        self.closing = False
        self.errors: set[str] = set()   # the last lines of the script errors shown

    def show(self, m: Output) -> None:
        self._put(self.out, prefixed(m, self.log_dir))

    def script_error(self, node: str, rank: int | None, step: int | None, error: str) -> None:
        """The first script error whole; another kind (its last line differs) in one line, a few
        times; the same again not at all: every rank of a job usually fails alike."""
        last = error.strip().splitlines()[-1] if error.strip() else "?"
        where = (f"on rank {rank}" if rank is not None else "on a standby") + \
            (f" at step {step}" if step is not None else "") + f" (node {node})"
        if not self.errors:
            self._put(self.err, f"tm-slurm: the training script failed {where}:\n{error.rstrip()}\n")
        elif last not in self.errors and len(self.errors) <= self.OTHER_ERRORS:
            self._put(self.err, f"tm-slurm: the training script also failed {where}: {last}\n")
        self.errors.add(last)

    def _put(self, stream: TextIO, text: str) -> None:
        if not text:
            return
        with self.cv:
            if self.queued + len(text) > self.limit:
                self.dropped += len(text)
                return
            self.queue.append((stream, text))
            self.queued += len(text)
            self.cv.notify()
        if self.thread is None:
            self.thread = threading.Thread(target=self._write, name="console", daemon=True)
            self.thread.start()

    def _write(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.closing:
                    self.cv.wait()
                if not self.queue:
                    return
                stream, text = self.queue.popleft()
                self.queued -= len(text)
                dropped, self.dropped = self.dropped, 0
            if dropped:
                text = f"tm-slurm: {dropped} characters of output not shown (the terminal was " \
                       f"not keeping up); every rank's is in {self.log_dir}\n" + text
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass                    # a closed terminal or pipe: nothing more can be shown

    def close(self, timeout: float = 2.0) -> None:
        """Print what is queued (within `timeout`: a terminal may never read it)."""
        with self.cv:
            self.closing = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout)
