"""Usage: (a package: ``benchmarks/collectives/probe.py MODE`` runs its modules, one a mode)"""


def start_rank():
    """This torchrun rank's GPU and NCCL process group: ``(device, rank, world, say)``, ``say`` printing on rank 0
    only."""
    import os

    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    return device, rank, world, (print if rank == 0 else (lambda *a, **k: None))
