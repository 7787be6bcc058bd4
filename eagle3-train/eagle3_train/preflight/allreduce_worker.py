"""One torchrun process of the preflight's all-reduce (allreduce.py starts them): a correctness
all-reduce (the first collective, where NCCL builds its communicator and a peer-to-peer hang shows),
then `iters` timed all-reduces of `mb` MB. Rank 0 prints the result as one JSON line.

    python -m torch.distributed.run --nproc-per-node 8 -m eagle3_train.preflight.allreduce_worker --mb 256 --iters 20
"""

from __future__ import annotations

import argparse
import json
import os
import time

READY = "preflight-allreduce-ready"
RESULT = "preflight-allreduce-result"
# Test hook (never set by the pipeline): "1" makes the last rank sleep before the first
# collective, as a peer-to-peer hang does; "p2p" does so only while NCCL_P2P_DISABLE is not 1,
# which is the hang the P2P fallback cures.
HANG_ENV = "EAGLE3_PREFLIGHT_HANG"


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, required=True)
    p.add_argument("--iters", type=int, required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    # the pid: torchrun starts each worker in its own session, so a launcher that finds the run
    # hung kills the workers by pid (killing torchrun alone would leave them holding the GPUs)
    print(f"{READY} {rank} {os.getpid()}", flush=True)

    hang = os.environ.get(HANG_ENV, "")
    if rank == world - 1 and (hang == "1" or (hang == "p2p" and os.environ.get("NCCL_P2P_DISABLE") != "1")):
        time.sleep(3600)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    probe = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    correct = bool((probe == world * (world + 1) / 2).all())
    x = torch.ones(max(1, int(args.mb * 1e6 / 4)), dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: buffers and algorithm chosen before the clock starts
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    sync()
    seconds = time.perf_counter() - start
    if rank == 0:
        print(RESULT, json.dumps({"world": world, "backend": dist.get_backend(), "bytes": x.numel() * 4,
                                  "iters": args.iters, "seconds": seconds, "correct": correct}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
