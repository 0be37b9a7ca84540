"""The processes of a tensor-parallel run: rank 0 (the caller: the server or a bench)
spawns N-1 followers on this host (`python -m ninfer.model.ranks`), all meet at a loopback
rendezvous on a free port, and each opens its shard of the model. A follower runs
`tensor_parallel.follow` until rank 0 stops it or is gone; it exits with it either way (the
rendezvous' connections close, its wait for the next command fails)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger("ninfer.model.ranks")

DEFAULT_TIMEOUT = 30.0  # seconds a collective may wait for another rank
FOREVER = timedelta(days=365)  # a follower waits this long for rank 0's next command


@dataclass
class Ranks:
    """This process's place in a run, its process groups and (on rank 0) the followers."""

    rank: int
    world: int
    wire: object                 # tensor_parallel.Wire
    followers: list[subprocess.Popen]

    def close(self) -> None:
        """The followers stopped (asked already, or killed after a grace period)."""
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


def join(rank: int, world: int, port: int, *, device: str = "cpu",
         timeout: float = DEFAULT_TIMEOUT) -> object:
    """Join the rendezvous at 127.0.0.1:port and make the run's groups (a `Wire`)."""
    import torch
    import torch.distributed as dist

    from .tensor_parallel import Wire
    cuda = torch.device(device).type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if cuda \
        else dist.group.WORLD
    commands = dist.new_group(backend="gloo", timeout=FOREVER)
    return Wire(rank, world, commands, control, dist.group.WORLD)


def launch(world: int, open_kwargs: dict, *, timeout: float = DEFAULT_TIMEOUT,
           threads: int = 1) -> Ranks:
    """Rank 0: spawn the followers with the same model options, then join them."""
    port = free_port()
    followers = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for rank in range(1, world):
        spec = json.dumps({"rank": rank, "world": world, "port": port, "timeout": timeout,
                           "threads": threads, "open": open_kwargs})
        followers.append(subprocess.Popen([sys.executable, "-m", "ninfer.model.ranks", spec],
                                          env=env))
    try:
        wire = join(0, world, port, device=open_kwargs.get("device", "cpu"), timeout=timeout)
    except BaseException:
        for p in followers:
            p.kill()
        raise
    ranks = Ranks(0, world, wire, followers)
    atexit.register(ranks.close)
    return ranks


def _follower(spec: dict) -> int:
    import torch

    from .runtime import open_model
    from .tensor_parallel import Executor, follow
    torch.set_num_threads(spec["threads"])
    rank, world = spec["rank"], spec["world"]
    options = spec["open"]
    wire = join(rank, world, spec["port"], device=options.get("device", "cpu"),
                timeout=spec["timeout"])
    ranks = Ranks(rank, world, wire, [])
    opened = open_model(**options, ranks=ranks)
    try:
        follow(Executor(opened.model, rank), wire)
    except Exception as exc:  # rank 0 is gone, or a collective timed out
        log.error("rank %d stops: %r", rank, exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninfer.model.ranks",
                                     description="a tensor-parallel follower (spawned by rank 0)")
    parser.add_argument("spec", help="JSON: rank, world, port, timeout, threads, open")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    return _follower(json.loads(args.spec))


if __name__ == "__main__":
    os._exit(main())  # no teardown of a process group whose peers may be gone
