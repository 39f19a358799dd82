"""The job's key-value store (docs/design.md §9): what torch's TCPStore was for the job (group
rendezvous for gloo/NCCL, the per-step commit vote, the switch point), served over a protocol of
its own that nobody without the job secret can use.

torch's TCPStore answers anyone who reaches its port (in torch 2.13 even `list_keys()`), so one
connection of another user could read, overwrite and delete the job's keys, and thousands of idle
ones stalled its one thread. Here a connection is nobody until it has answered a challenge with
the secret within `AUTH_S`; until then it may send 64 bytes and no more, and the oldest of too
many unauthenticated connections (per peer address and in all) is dropped to make room. After
that every frame carries an HMAC under a key of that session. Nothing is listed, values and the
whole store are capped, and one process with one thread serves every connection without blocking
on any of them: `server.py` (no torch: it starts in ~0.1 s), `client.py` (a `torch.distributed.Store`,
so PrefixStore and ProcessGroupGloo/NCCL use it as they used TCPStore), `wire.py` (both sides).
"""
