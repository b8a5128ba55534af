"""Stream-loop probe: what a pipeline cycle costs above its compute when the host drives it.

Two parts, printed as plain text (the H200 run of 2026-12-04:
benchmarks/results/2026-12-04-stream-loop-probe-h200.txt).

1. gloo round trip: two CPU processes send 16 bytes back and forth 3,000 times (the first 300
   dropped); p10 / p50 / p90 / p99 in microseconds, with the next receive posted ahead
   ("late=0") and posted only when needed ("late=1"). This part needs no GPU.
2. One process, n + 1 CUDA streams (stream 0 the draft, 1..n the stages), each stage's compute a
   spin kernel of F seconds (`torch.cuda._sleep`), hand-offs by CUDA events as in the staircase
   (stage s waits for stage s-1 of the cycle before; the draft waits for every stage). Per
   (n, F, mode): the cycle time, cycle - F (the overhead; 0 is ideal) and the host's time per
   cycle. Modes: -2 / -1 the host waits on the last stage's event 2 / 1 cycles late; 0 every
   cycle enqueued ahead eagerly; 1 one CUDA graph per cycle; 8 one graph per 8 cycles.

Part 2 needs CUDA: without a GPU, `python benchmarks/stream_loop_probe.py` runs part 1 and says
it skipped part 2. `--cycles` sets part 2's cycle count (default 400), `--gloo-iters` part 1's
round trips (default 3000), `--port` the first TCP port of the gloo rendezvous (two are used).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def gloo_round_trip(rank: int, late: int, iters: int, port: int) -> None:
    """One of two processes: 16-byte ping-pong over gloo; rank 0 prints the percentiles."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + late}", rank=rank,
                            world_size=2)
    send = torch.zeros(16, dtype=torch.uint8)
    recv = send.clone()
    other = 1 - rank
    times = []
    pending = None if late else dist.irecv(recv, other, tag=1)
    for _ in range(iters):
        t0 = time.perf_counter()
        if late:  # the receive is posted when it is needed
            if rank == 0:
                s = dist.isend(send, 1, tag=1)
                dist.irecv(recv, 1, tag=1).wait()
                s.wait()
            else:
                dist.irecv(recv, 0, tag=1).wait()
                dist.isend(send, 0, tag=1).wait()
        elif rank == 0:  # the next receive is posted as soon as one completes
            s = dist.isend(send, 1, tag=1)
            pending.wait()
            pending = dist.irecv(recv, 1, tag=1)
            s.wait()
        else:
            pending.wait()
            pending = dist.irecv(recv, 0, tag=1)
            dist.isend(send, 0, tag=1).wait()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        kept = sorted(times[iters // 10:])
        print(f"gloo rtt late={late} p10/50/90/99 us",
              [round(kept[int(len(kept) * f)] * 1e6) for f in (0.1, 0.5, 0.9, 0.99)], flush=True)
    time.sleep(1)
    os._exit(0)  # skip the process group's teardown (the peer may already be gone)


def _cycle(n, spin, streams, events, k, token):
    """Enqueue cycle k: stream 0 (the draft) waits for every stage of cycle k - 1, stage s for
    stage s - 1; each spins `spin` clock cycles and records its event of cycle k."""
    cuda = torch.cuda
    for s in range(n + 1):
        stream = streams[s]
        waits = [events[k - 1][j] for j in range(1, n + 1)] if s == 0 else [events[k - 1][s - 1]]
        for e in waits:
            stream.wait_event(e)
        with cuda.stream(stream):
            cuda._sleep(spin)
            if s == 0:
                token.add_(1)
            events[k][s].record(stream)


def stream_loop(n: int, F: float, cycles: int, mode: int, clocks_per_s: float) -> None:
    """Time `cycles` cycles of n stages plus a draft at F seconds of compute each (see the
    module docstring for `mode`) and print one line."""
    cuda = torch.cuda
    spin = int(F * clocks_per_s)
    streams = [cuda.Stream() for _ in range(n + 1)]
    token = torch.zeros(1, device="cuda", dtype=torch.long)
    if mode > 0:  # one graph holds `mode` cycles
        events = [[cuda.Event() for _ in range(n + 1)] for _ in range(mode + 1)]
        for s in streams:
            s.wait_stream(cuda.current_stream())
        graph = cuda.CUDAGraph()
        fork = cuda.Event()
        with cuda.graph(graph, stream=streams[0]):
            fork.record(streams[0])
            for s in streams[1:]:
                s.wait_event(fork)
            for s in range(n + 1):
                events[0][s].record(streams[s])
            for k in range(1, mode + 1):
                _cycle(n, spin, streams, events, k, token)
            for s in range(1, n + 1):  # join every stream back into the capture stream
                streams[0].wait_event(events[mode][s])
        graph.replay()
        cuda.synchronize()
        cycles = cycles // mode * mode
        t0 = time.perf_counter()
        for _ in range(cycles // mode):
            graph.replay()
    else:
        events = [[cuda.Event() for _ in range(n + 1)] for _ in range(cycles + 1)]
        for s in range(n + 1):
            events[0][s].record(streams[s])
        cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(1, cycles + 1):
            _cycle(n, spin, streams, events, k, token)
            if mode < 0:  # the host waits for the last stage of cycle k + 1 + mode
                events[k + 1 + mode][n].synchronize()
    host = time.perf_counter() - t0
    cuda.synchronize()
    wall = time.perf_counter() - t0
    print(f"n={n} F={F * 1e6:.0f} mode={mode}: cycle {wall / cycles * 1e6:.1f} "
          f"cycle-F {(wall / cycles - F) * 1e6:.1f} host {host / cycles * 1e6:.1f} us", flush=True)


def spin_clock_rate() -> float:
    """Clock cycles of torch.cuda._sleep per second on this GPU."""
    cuda = torch.cuda
    cuda._sleep(10 ** 6)  # warm up
    a, b = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    a.record()
    cuda._sleep(10 ** 7)
    b.record()
    b.synchronize()
    return 1e10 / a.elapsed_time(b)  # 1e7 cycles in elapsed_time milliseconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=400)
    ap.add_argument("--gloo-iters", type=int, default=3000)
    ap.add_argument("--port", type=int, default=29555)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    for late in (0, 1):
        mp.spawn(gloo_round_trip, args=(late, args.gloo_iters, args.port), nprocs=2)
    if not torch.cuda.is_available():
        print("no CUDA device: the stream loop (part 2) needs one; skipped", flush=True)
        return
    cps = spin_clock_rate()
    print(torch.__version__, cps, flush=True)
    for F in (6e-4, 2e-4):
        for n in (4, 8):
            for mode in (-2, -1, 0, 1, 8):
                try:
                    stream_loop(n, F, args.cycles, mode, cps)
                except Exception as exc:  # one failing mode is a line, not the end
                    print(n, F, mode, "ERR", repr(exc)[:300], flush=True)


if __name__ == "__main__":
    main()
