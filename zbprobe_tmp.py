import os, sys, gc, torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from dtrain.parallel.weight_gradients import WeightGradStore
from dtrain.parallel.pipeline_parallel import _make_graphed, _Graphable, PipelineParallel
variant = sys.argv[1]
torch.manual_seed(0)
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
def mk():
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.GELU())]).to(dev)
x = torch.randn(256, 1024, device=dev)
def why(e):
    chain = []
    while e is not None:
        chain.append(type(e).__name__ + ": " + str(e).splitlines()[0]); e = e.__context__
    return " <- ".join(chain)
if variant in ("F", "G"):
    model = mk(); store = WeightGradStore(); store.attach(model)
    n = 4 if variant == "F" else 1
    try:
        for k in range(n):
            with store.deferring(k):
                m = model if variant == "F" else _Graphable(model, None, 4)
                torch.cuda.make_graphed_callables(m, (torch.zeros(64, 1024, device=dev).requires_grad_(),), num_warmup_iters=3, allow_unused_input=True)
        print(variant, "OK")
    except Exception as e:
        print(variant, "FAIL", why(e))
elif variant in ("H", "H2"):
    model = mk(); store = WeightGradStore(); store.attach(model)
    pool_graphs = []
    try:
        for k in range(4):
            sx = torch.zeros(64, 1024, device=dev).requires_grad_()
            with store.deferring(k):
                side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        out = model(sx)
                        torch.autograd.grad(out, [sx], torch.ones_like(out))
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                fg, bg = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                pool = torch.cuda.graph_pool_handle()
                with torch.cuda.graph(fg, pool=pool):
                    sy = model(sx)
                sg = torch.empty_like(sy)
                with torch.cuda.graph(bg, pool=pool):
                    gx = torch.autograd.grad(sy, [sx], sg)
                pool_graphs.append((fg, bg, sy, sg, gx))
            store.take(k)
        for fg, bg, *_ in pool_graphs:
            fg.replay(); bg.replay()
        torch.cuda.synchronize()
        print(variant, "OK")
    except Exception as e:
        print(variant, "FAIL", why(e))
elif variant in ("A2", "A3", "A4"):
    model = mk(); store = WeightGradStore(); store.attach(model)
    try:
        mods = [_Graphable(model, None, 4) for _ in range(4)]
        for k in range(4):
            sample = (torch.zeros(64, 1024, device=dev).requires_grad_(),)
            with store.deferring(k):
                torch.cuda.make_graphed_callables(mods[k], sample, num_warmup_iters=0 if variant == "A3" else 3, allow_unused_input=True)
            if variant == "A2":
                e = store.take(k); store._pending[("kept", k)] = e[-len(e) // 4:]; gc.collect()
            if variant == "A4":
                e = store.take(k); gc.collect()
        print(variant, "OK", store.pending())
    except Exception as e:
        print(variant, "FAIL", why(e))
elif variant in ("A", "B", "C"):
    model = mk(); store = WeightGradStore(); store.attach(model)
    keep = []
    def eager():
        for mb in range(4):
            xi = x[:64].detach().requires_grad_()
            y = model(xi)
            if variant == "B":
                y.backward(torch.ones_like(y))
            else:
                with store.deferring(mb):
                    y.backward(torch.ones_like(y))
            if variant == "C":
                keep.append(y)
        for mb in range(4):
            store.flush(mb)
    eager()
    torch.cuda.synchronize(); gc.collect()
    mods = tuple(_Graphable(model, None, 4) for _ in range(4))
    samples = tuple((torch.zeros(64, 1024, device=dev).requires_grad_(),) for _ in range(4))
    try:
        g = _make_graphed(mods, samples, tuple(store.deferring(k) for k in range(4)))
        print(variant, "OK", store.pending())
    except Exception as e:
        print(variant, "FAIL", why(e))
else:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=dev)
    sched = {"D": "zb-h1", "E": "1f1b", "V": "zb-v"}[variant]
    torch.manual_seed(1); pipe = PipelineParallel(mk(), dist.group.WORLD, num_microbatches=4, schedule=sched, graphs=True)
    torch.manual_seed(1); ref = PipelineParallel(mk(), dist.group.WORLD, num_microbatches=4, schedule=sched)
    try:
        for i in range(3):
            for q in list(pipe.parameters()) + list(ref.parameters()):
                q.grad = None
            loss = pipe.train_step(x, x, F.mse_loss)
            want = ref.train_step(x, x, F.mse_loss)
        torch.cuda.synchronize()
        err = max((a.grad - b.grad).abs().max().item() for a, b in zip(pipe.parameters(), ref.parameters()))
        print(variant, "OK", loss.item(), want.item(), "grad err", err, len(pipe._graphed or {}), len(pipe._recorded_w))
    except Exception as e:
        import traceback
        print(variant, "FAIL", why(e))
        tb = traceback.extract_tb(e.__context__.__traceback__ if e.__context__ else e.__traceback__)
        print(variant, "FAIL at", [f"{f.name}:{f.lineno}" for f in tb][-6:])
    dist.destroy_process_group()
