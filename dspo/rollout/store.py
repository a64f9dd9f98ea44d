"""The collective transfers' TCPStore, as another local process sees it (issue 39; issue 53, point 2).

Any process on the host can connect to the loopback store port, list its keys (`TCPStore.list_keys`) and read them.
So no key name may reveal the run's secret (it used to be the prefix of every key: a reader recovered it and signed
its own push headers): the group's prefix and each push's key are HMACs of the secret, and each push header carries
an HMAC-SHA256 of the secret, which the engine process checks. A reader sees names it cannot invert, cannot predict the
next push's key, and cannot sign a header. What it can still do: delete or overwrite a key it sees (the current push
header, the group's rendezvous), which stalls or ends the run but sets no weights (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import socket


def derived(secret: str, label: str) -> str:
    """A name derived from the run's secret: the same in both processes, and telling nothing about the secret."""
    return hmac.new(secret.encode(), label.encode(), hashlib.sha256).hexdigest()[:32]


def loopback_listener() -> socket.socket:
    """A listening TCP socket on 127.0.0.1 and a free port, for the TCPStore to serve on (nothing beyond this host)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener


def keyed_store(store, secret: str):
    """Every key under the run's secret: without it, another process on the host cannot find the group's keys."""
    import torch.distributed as dist

    return dist.PrefixStore(f"dspo/{derived(secret, 'group')}/", store)


def push_key(secret: str, sequence: int) -> str:
    """The store key of push `sequence`'s header (unpredictable without the secret: no header can be planted ahead)."""
    return f"dspo/push/{derived(secret, f'push|{sequence}')}"


def sign(secret: str, sequence: int, header: str) -> str:
    """HMAC-SHA256 of push `sequence`'s header under the run's secret."""
    return hmac.new(secret.encode(), f"{sequence}|{header}".encode(), hashlib.sha256).hexdigest()


def verified_header(secret: str, sequence: int, value: str) -> tuple[int, int, int]:
    """(completed rounds, version, changed) of a signed push header; PermissionError if it was not signed with the
    run's secret (a forged or replayed push)."""
    header, _, signature = value.rpartition(",")
    if not hmac.compare_digest(signature, sign(secret, sequence, header)):
        raise PermissionError(
            f"weight push {sequence} was refused: its header is not signed with this run's secret (another process "
            "on this host wrote to the weight-transfer store)"
        )
    completed, version, changed = (int(v) for v in header.split(","))
    return completed, version, changed
