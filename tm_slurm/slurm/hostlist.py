"""Slurm hostlists: `node[1-3,5],gpu[01-02],login` <-> ["node1", "node2", "node3", "node5", ...].

Behaviour follows Slurm 22.05's own `scontrol show hostnames` / `scontrol show hostlist`
(checked against the real binaries; see tests/slurm/test_cli_backend.py):

- `expand` keeps order and duplicates, preserves zero padding (`gpu[01-02]` -> gpu01, gpu02;
  the width of a range is the width of its low bound: `n[8-011]` -> n8 .. n11, `n[08-11]` ->
  n08 .. n11), and expands several bracket groups in one name as a cartesian product, first
  group outermost (`a[1-2]b[3-4]` -> a1b3 a1b4 a2b3 a2b4). Like Slurm 22.05 it rejects text
  after the last `]` of a name (`n[1-3]x`), nested or unbalanced brackets, empty brackets,
  descending (`[3-1]`) and non-numeric ranges, each with a ValueError naming the problem.
- `compress` is what `scontrol show hostlist` prints: order preserving, consecutive names that
  share a prefix (everything before the trailing digits) go in one bracket, runs of
  consecutive numbers of a compatible width become `lo-hi`; a lone numbered name stays bare
  (`node1`, not `node[1]`). `compress(names, sort=True)` sorts first (by prefix, then number)
  and drops duplicates, which gives the shortest form. `expand(compress(x)) == x` for every
  list of valid host names (and `sorted(set(x))`-equivalent with sort=True).
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

MAX_HOSTS = 1_000_000          # refuse to expand absurd ranges (a typo like node[1-99999999])

_TRAILING_DIGITS = re.compile(r"^(.*?)(\d+)$")
_BAD_NAME = re.compile(r"[\[\],\s]")


def _split_top(text: str) -> list[str]:
    """Split on commas (and whitespace) that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"invalid hostlist {text!r}: nested brackets are not supported")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"invalid hostlist {text!r}: unbalanced ']'")
        if depth == 0 and (ch == "," or ch.isspace()):
            if cur:
                parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if depth != 0:
        raise ValueError(f"invalid hostlist {text!r}: unbalanced '['")
    if cur:
        parts.append("".join(cur))
    return parts


def _range_values(spec: str, whole: str) -> list[str]:
    """`1,3-5,08-10` -> ["1", "3", "4", "5", "08", "09", "10"]."""
    out: list[str] = []
    if not spec:
        raise ValueError(f"invalid hostlist {whole!r}: empty brackets")
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"invalid hostlist {whole!r}: bad range {item!r} (expected N or N-M)")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"invalid hostlist {whole!r}: descending range {item!r}")
        if b - a + 1 + len(out) > MAX_HOSTS:
            raise ValueError(f"invalid hostlist {whole!r}: range {item!r} is larger than {MAX_HOSTS}")
        width = len(lo)
        out.extend(f"{n:0{width}d}" for n in range(a, b + 1))
    return out


def _expand_one(name: str, whole: str) -> list[str]:
    if "[" not in name:
        if "]" in name:
            raise ValueError(f"invalid hostlist {whole!r}: unbalanced ']'")
        return [name]
    # literal [range] literal [range] ... ; nothing may follow the last ']'
    pieces = re.split(r"\[([^\[\]]*)\]", name)
    literals, ranges = pieces[0::2], pieces[1::2]
    if literals[-1]:
        raise ValueError(f"invalid hostlist {whole!r}: text {literals[-1]!r} after ']' in {name!r} "
                         "(Slurm 22.05 rejects suffixes after a bracket group too)")
    if any("[" in lit or "]" in lit for lit in literals):
        raise ValueError(f"invalid hostlist {whole!r}: unbalanced brackets in {name!r}")
    results = [literals[0]]
    for spec, lit in zip(ranges, literals[1:]):
        values = _range_values(spec, whole)
        if len(results) * len(values) > MAX_HOSTS:
            raise ValueError(f"invalid hostlist {whole!r}: more than {MAX_HOSTS} hosts")
        results = [r + v + lit for r in results for v in values]
    return results


def expand(hostlist: str | Iterable[str]) -> list[str]:
    """Expand a Slurm hostlist expression into host names (order and duplicates kept).

    Accepts a string (`"node[1-3],login"`) or an iterable of such strings. An empty string
    or `(null)` (how scontrol prints "no nodes") gives [].
    """
    if not isinstance(hostlist, str):
        return [h for part in hostlist for h in expand(part)]
    text = hostlist.strip()
    if not text or text in ("(null)", "None", "N/A"):
        return []
    out: list[str] = []
    for name in _split_top(text):
        out.extend(_expand_one(name, text))
        if len(out) > MAX_HOSTS:
            raise ValueError(f"invalid hostlist {text[:80]!r}: more than {MAX_HOSTS} hosts")
    return out


def _split_name(name: str) -> tuple[str, str | None]:
    m = _TRAILING_DIGITS.match(name)
    return (m.group(1), m.group(2)) if m else (name, None)


def _fmt_range(lo: int, hi: int, width: int) -> str:
    a = f"{lo:0{width}d}"
    return a if lo == hi else f"{a}-{hi:0{width}d}"


def compress(names: Sequence[str] | Iterable[str], sort: bool = False) -> str:
    """Compress host names into a Slurm hostlist string (the inverse of `expand`).

    sort=False (default) gives exactly what `scontrol show hostlist` prints (order kept);
    sort=True sorts by (prefix, number) and removes duplicates first.
    """
    names = [n.strip() for n in names]
    for n in names:
        if not n or _BAD_NAME.search(n):
            raise ValueError(f"invalid host name {n!r} (empty, or contains brackets, commas or spaces)")
    if sort:
        def key(n: str):
            p, d = _split_name(n)
            return (p, d is not None, int(d) if d is not None else 0, len(d or ""), n)
        names = sorted(set(names), key=key)

    # groups: [prefix, [[lo, hi, width], ...]] or [name, None] for names without a number
    groups: list[list] = []
    for n in names:
        prefix, digits = _split_name(n)
        if digits is None:
            groups.append([n, None])
            continue
        value, width = int(digits), len(digits)
        last = groups[-1] if groups else None
        if last is not None and last[1] is not None and last[0] == prefix:
            lo, hi, w = last[1][-1]
            if value == hi + 1 and f"{value:0{w}d}" == digits:
                last[1][-1][1] = value
            else:
                last[1].append([value, value, width])
        else:
            groups.append([prefix, [[value, value, width]]])

    out = []
    for prefix, ranges in groups:
        if ranges is None:
            out.append(prefix)
        elif len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            out.append(prefix + _fmt_range(*ranges[0]))
        else:
            out.append(f"{prefix}[{','.join(_fmt_range(*r) for r in ranges)}]")
    return ",".join(out)
