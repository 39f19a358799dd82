"""The training script's output on tm-slurm's terminal (tm_slurm/output.py): lines split and cut,
the agent's rate, the controller's prints; no process but a pipe."""
import io
import os
import threading
import time

from tm_slurm import output as O
from tm_slurm.control import codec
from tm_slurm.messages import Output


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_are_complete_whatever_the_chunks():
    ls = O.Lines()
    assert ls.feed(b"one\ntw") == [b"one"]
    assert ls.feed(b"o\n\nthree") == [b"two", b""]
    assert ls.end() == [b"three"] and ls.end() == []


def test_a_long_line_is_cut_with_a_marker_and_its_rest_dropped():
    ls = O.Lines(cap=8)
    assert ls.feed(b"0123456789") == [b"01234567" + O.CUT]       # cut before its newline came
    assert ls.feed(b"more of it\nnext\n") == [b"next"]
    assert ls.feed(b"abcdefghij\nok\n") == [b"abcdefgh" + O.CUT, b"ok"]
    ls.feed(b"x" * 20)
    assert ls.end() == []                                        # already shown, cut
    assert len(O.Lines().feed(b"y" * 100_000 + b"\n")[0]) == O.MAX_LINE + len(O.CUT)


def test_a_carriage_return_redraws_the_line_as_a_terminal_does():
    ls = O.Lines(cap=16)
    # a progress bar redrawn in place a hundred times: held small, shown once, its last state
    for i in range(100):
        assert ls.feed(b"\r%3d%%" % i) == []
    assert len(ls.part) <= 5
    assert ls.feed(b"\n") == [b" 99%"]
    assert ls.feed(b"windows\r\n") == [b"windows"]              # a CRLF is no redraw
    assert ls.feed(b"half\r") == [] and ls.feed(b"\n") == [b"half"]


def test_skipped_output_keeps_only_where_a_line_ends():
    ls = O.Lines(cap=16)
    ls.skip(b"not streamed\nhalf a li")
    assert ls.feed(b"ne\nmine\n") == [b"half a line", b"mine"]     # promoted mid-line: all of it
    ls = O.Lines(cap=8)
    ls.skip(b"a standby's rehearsal\nand the start of a long line")
    assert ls.feed(b" ending here\npromoted\n") == [b"promoted"]   # never half of one


def test_streamed_ranks():
    assert O.streamed("0")(0) and not O.streamed("0")(1) and not O.streamed("0")(None)
    assert O.streamed("0,8")(8) and not O.streamed("0,8")(4)
    assert O.streamed("all")(7) and not O.streamed("all")(None)     # a rehearsing standby
    assert not O.streamed("none")(0)


def test_the_forwarder_batches_lines_a_worker_every_flush():
    clock = Clock()
    f = O.Forwarder("node1", clock=clock)
    f.add(0, 0, [b"a", b"b"])
    f.add(1, 1, [b"c"])
    assert f.due() == [Output("node1", 0, 0, ("a", "b")), Output("node1", 1, 1, ("c",))]
    f.add(0, 0, [b"d"])
    assert f.due() == []                                  # within FLUSH_S of the last batch
    clock.t += O.FLUSH_S
    assert f.due() == [Output("node1", 0, 0, ("d",))]
    f.add(0, 0, [b"\xff\xfeok"])
    f.add(1, 1, [b"e"])
    assert f.ended(0) == [Output("node1", 0, 0, ("\ufffd\ufffdok",))]       # at once; bytes as text
    assert f.held == {(1, 1): [b"e"]}


LINE = b"x" * 99                                          # 100 bytes with its newline


def sent(msgs):
    return [(m.local, len(m.lines), m.dropped) for m in msgs]


def test_a_window_passes_its_budget_in_whole_lines_and_counts_the_rest_after_them():
    clock = Clock()
    f = O.Forwarder("node1", budget=300, window=1.0, clock=clock)
    f.add(0, 0, [LINE] * 5)                               # three pass, two do not
    assert sent(f.due()) == [(0, 3, 0)]
    clock.t += 0.5
    f.add(0, 0, [LINE] * 4)
    f.add(1, 3, [LINE])
    clock.t += 0.2
    assert f.due() == []                                  # nothing more in this window
    clock.t += 0.3                                        # its end: the count of what it dropped
    f.add(0, 0, [LINE] * 2)                               # and the next window's lines after it
    assert sent(f.due()) == [(0, 0, 600), (1, 0, 100), (0, 2, 0)]
    clock.t += 5.0                                        # quiet: nothing is sent
    assert f.due() == []


def test_a_worker_that_ends_has_its_last_lines_shown_whatever_the_budget():
    clock = Clock()
    f = O.Forwarder("node1", budget=300, window=1.0, clock=clock)
    f.add(0, 0, [LINE] * 3)                               # the budget, spent
    f.add(0, 0, [b"flood %d" % i for i in range(1000)])
    f.add(0, 0, [b"Traceback (most recent call last):", b"ValueError: nan loss"])
    m, tail = f.ended(0)
    assert len(m.lines) == 3 and m.dropped == sum(len(b"flood %d" % i) + 1 for i in range(982))
    assert tail.lines[-3:] == ("flood 999", "Traceback (most recent call last):", "ValueError: nan loss")
    assert len(tail.lines) == O.TAIL and tail.dropped == 0 and f.ended(0) == []
    f.add(1, 4, [LINE] * 2)                               # dropped, then lines shown after them:
    clock.t += 1.0
    f.add(1, 4, [b"shown"])                               # no tail of the older ones
    assert sent(f.ended(1)) == [(1, 0, 200), (1, 1, 0)] and f.ended(1) == []


def test_a_flood_never_grows_what_the_forwarder_holds():
    clock = Clock()
    f = O.Forwarder("node1", clock=clock)
    for i in range(1000):                                 # 1000 x 64 KiB in 10 s
        f.add(0, 0, [b"z" * 1023] * 64)
        clock.t += 0.01
        held = sum(len(x) + 1 for lines in f.held.values() for x in lines)
        assert held <= O.BUDGET and len(f.dropped) <= 1 and sum(map(len, f.tails.values())) <= O.TAIL
        if i % 10 == 0:
            f.due()
    msgs = f.due() + f.ended(0)
    shown = sum(len(x) + 1 for m in msgs for x in m.lines)
    assert shown <= O.BUDGET * (10 / O.WINDOW_S + 1) + O.TAIL * 1024


def test_the_output_message_crosses_the_wire():
    m = Output("node1", 0, 3, ("é", "a\tb"), 12)
    assert codec.loads(codec.prepare(m).encode()) == m


def test_a_pipe_logs_every_byte_and_gives_lines_of_a_streamed_rank(tmp_path):
    r, w = os.pipe()
    warned = []
    p = O.Pipe(r, tmp_path / "node1.w0.log", warn=warned.append)
    assert p.read(True) == []                             # nothing yet: no wait
    os.write(w, b"hello\nwor")
    assert p.read(True) == [b"hello"]
    os.write(w, b"ld\n" + b"q" * 10_000 + b"\nlast words")
    os.close(w)
    got = p.read(True, O.DRAIN)
    assert got == [b"world", b"q" * O.MAX_LINE + O.CUT, b"last words"] and p.ended
    p.close()
    assert (tmp_path / "node1.w0.log").read_bytes() == b"hello\nworld\n" + b"q" * 10_000 + b"\nlast words"
    assert not warned


def test_a_pipe_of_a_rank_not_streamed_only_logs(tmp_path):
    r, w = os.pipe()
    p = O.Pipe(r, tmp_path / "w.log", warn=print)
    os.write(w, b"rank 1\n" * 1000)
    os.close(w)
    assert p.read(False, O.DRAIN) == [] and p.ended
    assert (tmp_path / "w.log").read_bytes() == b"rank 1\n" * 1000


def test_the_console_prefixes_each_line_with_its_rank(tmp_path):
    out = io.StringIO()
    c = O.Console(tmp_path / "logs", out=out, err=io.StringIO())
    c.show(Output("node1", 0, 0, ("step 1 loss 2.5", "")))
    c.show(Output("node2", 1, 8, (), 4096))
    c.close()
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["[rank0]: step 1 loss 2.5", "[rank0]: "]
    assert lines[2].startswith("[rank8]: tm-slurm: 4096 bytes of output not shown") \
        and str(tmp_path / "logs" / "node2.w1.log") in lines[2]


def test_the_script_error_is_shown_once_and_another_in_one_line(tmp_path):
    err = io.StringIO()
    c = O.Console(tmp_path, out=io.StringIO(), err=err)
    tb = "Traceback (most recent call last):\n  File \"train.py\", line 9\nValueError: bad shape\n"
    for rank in range(8):                                 # every rank fails alike
        c.script_error(f"node{rank + 1}", rank, 12, tb)
    c.script_error("node3", 2, 12, "Traceback ...\nKeyError: 'x'\n")
    for i in range(10):                                   # a few different ones, then no more
        c.script_error("node4", 3, None, f"RuntimeError: {i}")
    c.close()
    text = err.getvalue()
    assert text.startswith("tm-slurm: the training script failed on rank 0 at step 12 (node node1):\n"
                           + tb)
    assert text.count("ValueError: bad shape") == 1
    others = text.splitlines()[4:]
    assert others[0] == ("tm-slurm: the training script also failed on rank 2 at step 12 (node node3): "
                         "KeyError: 'x'")
    assert len(others) == O.Console.OTHER_ERRORS and others[-1].endswith("(node node4): RuntimeError: 1")


class Stuck(io.StringIO):
    """A terminal nobody reads (paused, a pager): a write waits until `go` is set."""

    def __init__(self):
        super().__init__()
        self.go = threading.Event()

    def write(self, s):
        self.go.wait()
        return super().write(s)


def test_a_terminal_that_does_not_read_never_holds_the_controller(tmp_path):
    out = Stuck()
    c = O.Console(tmp_path, out=out, err=io.StringIO(), limit=10_000)
    t0 = time.monotonic()
    for i in range(1000):                                 # ~25 KB: over the limit
        c.show(Output("node1", 0, 0, (f"line {i:04d}",)))
    assert time.monotonic() - t0 < 1.0
    assert c.queued <= 10_000 and c.dropped > 0
    out.go.set()
    c.close()
    text = out.getvalue()
    assert "[rank0]: line 0000" in text and "characters of output not shown" in text
