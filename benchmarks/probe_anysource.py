"""gloo point-to-point round trip: a receive posted for a known sender against one from any rank.

The distributed runtime's stages receive their units from any rank (their stop comes from another
rank than their data: spd.distributed.protocol). This probe times a ping-pong of 64 floats
between ranks 0 and 1 of a 3-rank gloo group, the receive posted ahead each time, alternating
the two kinds so a shared machine's load hits both alike.

    python benchmarks/probe_anysource.py --round-trips 200 --repeats 4
"""
from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, trips: int, repeats: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    times: dict[str, list[float]] = {"known sender": [], "any sender": []}
    for _ in range(repeats):
        for kind in times:
            peer = 1 - rank
            src = None if kind == "any sender" else peer
            buf = torch.zeros(64)
            dist.barrier()
            t0 = time.perf_counter()
            if rank < 2:
                work = dist.irecv(buf, src, tag=9)
                for i in range(trips):
                    if rank == 0:
                        dist.isend(buf.clone(), peer, tag=9).wait()
                    work.wait()
                    if i < trips - 1:  # the next receive, posted before the reply goes out
                        work = dist.irecv(buf, src, tag=9)
                    if rank == 1:
                        dist.isend(buf.clone(), peer, tag=9).wait()
            times[kind].append((time.perf_counter() - t0) / trips * 1e6)
    dist.barrier()
    if rank == 0:
        out.put(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round-trips", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(port, args.round_trips, args.repeats, out), nprocs=3,
                       start_method="spawn")
    times = out.get()
    print("gloo round trip on 127.0.0.1 (CPU), microseconds, each repeat:")
    for kind, xs in times.items():
        print(f"  {kind:<13} median {statistics.median(xs):8.0f}   "
              + " ".join(f"{x:.0f}" for x in xs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
