import torch, json
dev = torch.device("cuda", 0)
piece = 48 << 20
slab = torch.empty((1 << 30) + (8 << 20), dtype=torch.uint8, pin_memory=True).fill_(1)
dst = torch.empty(piece * 4 + 4096, dtype=torch.uint8, device=dev)
s = torch.cuda.Stream(dev)
def rate(off, n=40, size=piece):
    with torch.cuda.stream(s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(s)
        for k in range(n):
            o = off + (k % 20) * size
            dst[(k % 4) * piece:(k % 4) * piece + size].copy_(slab[o:o + size], non_blocking=True)
        b.record(s)
    torch.cuda.synchronize()
    return n * size / (a.elapsed_time(b) / 1e3) / 1e9
out = {}
for off in (0, 64, 256, 4096, 4096 + 64, 1 << 20):
    rate(off, 8)
    out[str(off)] = max(rate(off) for _ in range(3)); print(off, out[str(off)], flush=True)
out["0_size+64"] = max(rate(0, size=piece + 64) for _ in range(3))
print(json.dumps(out))
