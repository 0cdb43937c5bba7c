import time, torch, ddo_blocks, gc
torch.manual_seed(0)
def build():
    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(64)]).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters(): p.normal_(0, 0.02)
    return m.eval().requires_grad_(False)
x = torch.randn(4, 2048, dtype=torch.bfloat16)
ddo_blocks.offload(torch.nn.Linear(8, 8), device="cpu").remove()  # the first offload imports diffusers
for codec in ["off", "fixed", "tiered", "off", "fixed", "tiered"]:
    m = build(); gc.collect()
    with torch.no_grad(): ref = m(x)
    t = time.perf_counter()
    h = ddo_blocks.offload(m, vram_budget="min", device="cpu", codec=codec, units="block")
    s = time.perf_counter() - t
    with torch.no_grad(): ok = torch.equal(m(x), ref)
    r = h.report(); c = r["codec"] if codec != "off" else {}
    print(f"{codec:6s} setup {s:.3f} s, ratio {c.get('ratio')}, host {r['plan']['host_slab_bytes']/2**20:.1f} MiB, exact {ok}")
    h.remove()
