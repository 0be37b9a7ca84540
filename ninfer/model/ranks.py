"""The processes of a tensor-parallel run: rank 0 (the caller: the server or a bench)
spawns N-1 followers on this host (`python -m ninfer.model.ranks`), all meet at a loopback
rendezvous on a free port (the process groups), each follower connects to rank 0's command
channel (`channel.py`), and each opens its shard of the model when rank 0 says so. A follower runs
`tensor_parallel.follow` until rank 0 stops it or is gone; it exits with it either way (the
rendezvous' connections close, its wait for the next command fails)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from .channel import Listening, connect

log = logging.getLogger("ninfer.model.ranks")

DEFAULT_TIMEOUT = 30.0  # seconds a collective may wait for another rank
STARTUP = 300.0  # seconds rank 0 waits for the followers to start and connect


@dataclass
class Ranks:
    """This process's place in a run, its process groups and (on rank 0) the followers."""

    rank: int
    world: int
    wire: object                 # tensor_parallel.Wire
    followers: list[subprocess.Popen]

    def open(self, factory: str, options: dict, local: Callable[[], object]):
        """Rank 0: a fresh model on every rank, `factory` ("module:function", called as
        `function(ranks, **options)`) on the followers and `local()` here; the
        `ShardedModel` over them."""
        from .tensor_parallel import open_sharded
        return open_sharded(self.wire, factory, options, local)

    def close(self) -> None:
        """Rank 0: the followers asked to stop, and killed after a grace period."""
        if self.followers:
            self.wire.stop()
        for p in self.followers:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.followers = []
        import torch.distributed as dist
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _groups(rank: int, world: int, port: int, device: str, timeout: float):
    """Join the process group rendezvous at 127.0.0.1:port: (control, compute)."""
    import torch
    import torch.distributed as dist
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # one GPU per rank, in rank order (NCCL needs it set)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if cuda \
        else dist.group.WORLD
    return control, dist.group.WORLD


def launch(world: int, *, timeout: float = DEFAULT_TIMEOUT, threads: int = 1,
           device: str = "cpu") -> Ranks:
    """Rank 0: spawn the followers, then join them (`Ranks.open` opens a model on all)."""
    from .tensor_parallel import Wire
    port, listening = free_port(), Listening()
    followers = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for rank in range(1, world):
        spec = json.dumps({"rank": rank, "world": world, "port": port, "timeout": timeout,
                           "threads": threads, "device": device, "commands": listening.port})
        follower = subprocess.Popen([sys.executable, "-m", "ninfer.model.ranks", spec],
                                    env=env, stdin=subprocess.PIPE, text=True)
        follower.stdin.write(listening.token + "\n")  # not in its command line
        follower.stdin.close()
        followers.append(follower)
    try:
        control, compute = _groups(0, world, port, device, timeout)
        channel = listening.accept(world - 1, timeout=STARTUP, send_timeout=timeout)
    except BaseException:
        for p in followers:
            p.kill()
        raise
    ranks = Ranks(0, world, Wire(0, world, channel, control, compute), followers)
    atexit.register(ranks.close)
    return ranks


def factory(name: str) -> Callable:
    """The function "module:function" names."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _follower(spec: dict) -> int:
    import torch

    from .tensor_parallel import Wire, follow
    torch.set_num_threads(spec["threads"])
    rank, world = spec["rank"], spec["world"]
    control, compute = _groups(rank, world, spec["port"], spec["device"], spec["timeout"])
    token = sys.stdin.readline().strip()
    wire = Wire(rank, world, connect(spec["commands"], rank, token), control, compute)
    ranks = Ranks(rank, world, wire, [])
    try:
        follow(wire, lambda name, options: factory(name)(ranks, **options))
    except Exception as exc:  # rank 0 is gone, or a collective timed out
        log.error("rank %d stops: %r", rank, exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninfer.model.ranks",
                                     description="a tensor-parallel follower (spawned by rank 0)")
    parser.add_argument("spec", help="JSON: rank, world, port, timeout, threads, device, "
                                     "commands (the command channel's port)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    return _follower(json.loads(args.spec))


if __name__ == "__main__":
    os._exit(main())  # no teardown of a process group whose peers may be gone
