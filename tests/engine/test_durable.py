"""Durable endpoints: published checkpoints written to disk and restored after a restart
that lost the tensors, exactly (reuse checked against a recomputation); a torn, tampered
or mismatched file is refused with EndpointLost and never loaded; files follow the store."""

from __future__ import annotations

import json
import struct

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle.checks import JournalChecker
from ninfer.sim.harness import Harness

PROMPT = tuple((i * 17 + 3) % 97 for i in range(1, 45))


def _turn(h, prompt, session="s", max_tokens=5):
    rid = h.submit(prompt, session, max_tokens=max_tokens)
    h.run()
    h.check()
    r = h.request(rid)
    assert r.state == "Finished"
    return r


def _lost(h):
    return {e.endpoint: e.reason for e in h.journal.read() if e.kind == "EndpointLost"}


@pytest.fixture(params=["mtp", "none"])
def durable(request, tmp_path):
    h = Harness(EngineConfig(spec=request.param, prefill_chunk=8, check_reuse=True),
                num_blocks=200, files_dir=tmp_path / "endpoints")
    yield h, tmp_path / "endpoints"
    h.engine.files.close()


def test_a_restart_that_loses_tensors_restores_endpoints_from_disk(durable):
    h, folder = durable
    first = _turn(h, PROMPT)
    h.engine.files.flush()
    assert len(list(folder.glob("*.safetensors"))) == len(h.engine.store.endpoints) >= 1
    h.restart(keep_tensors=False)  # a fresh model: its pools hold nothing
    h.check()
    assert not _lost(h) and h.engine.store.endpoints
    nxt = _turn(h, PROMPT + tuple(first.outputs) + (7, 8))  # check_reuse compares the parts
    assert nxt.plan.kind == "PrivateEndpoint"
    assert nxt.plan.reuse_base == len(PROMPT) + len(first.outputs) - 1
    JournalChecker().feed_all(h.journal.read())


def _only_file(folder, h):
    h.engine.files.flush()
    (cp,) = h.engine.store.checkpoint_ids()
    return h.engine.files.path(cp)


def _damage_tail(path):
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # one tensor byte
    path.write_bytes(bytes(raw))


def _other_identity(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"]["model"] = "another-model"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + n
    # tensor offsets are relative to the data section, which follows the header
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[start:])


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "damaged"),
    (_damage_tail, "checksum mismatch"),
    (_other_identity, "model 'another-model'"),
    (lambda p: p.unlink(), "no checkpoint file"),
])
def test_a_torn_or_mismatched_file_is_lost_never_loaded(durable, damage, reason):
    h, folder = durable
    rid = h.submit(PROMPT, None, max_tokens=3, shared_prefix=20)  # one shared endpoint
    h.run()
    assert h.request(rid).state == "Finished"
    path = _only_file(folder, h)
    damage(path)
    h.restart(keep_tensors=False)
    h.check()
    (why,) = _lost(h).values()
    assert reason in why
    assert not path.exists() and not h.engine.store.endpoints
    again = _turn(h, PROMPT, session=None)
    assert again.plan.kind == "Root"  # the conversation goes on without it


def test_files_follow_the_store(durable):
    h, folder = durable
    first = _turn(h, PROMPT)
    old = set(h.engine.store.checkpoint_ids())
    _turn(h, PROMPT + tuple(first.outputs) + (1,))  # supersedes the latest point
    h.engine.files.flush()
    files = {p.name for p in folder.glob("*.safetensors")}
    assert files == {h.engine.files.path(c).name for c in h.engine.store.checkpoint_ids()}
    assert not old & h.engine.store.checkpoint_ids()
    for endpoint in list(h.engine.store.endpoints):
        h.engine.evict(endpoint)
    h.engine.files.flush()
    assert not list(folder.glob("*.safetensors"))


def test_orphan_files_are_pruned_at_start(durable):
    h, folder = durable
    _turn(h, PROMPT)
    h.engine.files.flush()
    (folder / "stray-0000.safetensors").write_bytes(b"x")
    (folder / ".half-written.safetensors.tmp").write_bytes(b"x")
    h.restart(keep_tensors=False)
    names = {p.name for p in folder.iterdir()}
    assert names == {h.engine.files.path(c).name for c in h.engine.store.checkpoint_ids()}


def test_files_are_private(durable):
    h, folder = durable
    _turn(h, PROMPT)
    h.engine.files.flush()
    files = list(folder.glob("*.safetensors"))
    assert files
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o600
