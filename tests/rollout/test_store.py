"""Issue 53 (2): a second local process that lists and reads the weight-transfer store (any local user can connect
to its loopback port) learns nothing that lets it write a push header the engine process accepts. Before, every key
was under `dspo/<secret>/`: `list_keys()` gave the secret away, and a header signed with it passed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dspo.rollout.store import push_key
from dspo.rollout.transfer import CollectiveTransfer, sign, verified_header

ATTACKER = r"""
import datetime, json, sys
import torch.distributed as dist
from dspo.rollout.store import sign

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=10))
keys = store.list_keys()
values = [store.get(key).decode(errors="replace") for key in keys]
# every piece of every key name and value is a guess at the secret; each signs headers for the next pushes
guesses = {p for key in keys for p in key.split("/") if p} | {p for value in values for p in value.split(",")}
forged = [f"9,99,1,{sign(guess, n, '9,99,1')}" for guess in guesses for n in (1, 2, 3)]
print(json.dumps({"keys": keys, "forged": forged}))
"""


def test_a_process_that_lists_and_reads_the_store_cannot_forge_a_push():
    transfer = CollectiveTransfer("gloo")
    transfer.allocate([("w", torch.zeros(2))])
    try:
        header = "3,7,1"  # push 1 announced, as `send` announces it
        transfer._store.set(push_key(transfer.secret, 1), f"{header},{sign(transfer.secret, 1, header)}")
        out = subprocess.run(
            [sys.executable, "-c", ATTACKER, str(transfer.port)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr[-2000:]
        seen = json.loads(out.stdout)
        assert seen["keys"] and not [key for key in seen["keys"] if transfer.secret in key]
        assert not [key for key in seen["keys"] if key.endswith(push_key(transfer.secret, 2))]  # not predictable
        for forged in seen["forged"]:
            for sequence in (1, 2, 3):
                with pytest.raises(PermissionError, match="not signed with this run's secret"):
                    verified_header(transfer.secret, sequence, forged)
    finally:
        transfer.close()
