import resource
import time

import psutil
import torch
from diffusers import FluxTransformer2DModel

import ddo_blocks
from ddo_blocks.tiny import flux_inputs

GiB = 1024**3
cfg = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
           num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
           axes_dims_rope=(16, 56, 56))
t0 = time.time()
with torch.device("meta"):
    m = FluxTransformer2DModel(**cfg)
m = m.to_empty(device="cuda").to(torch.bfloat16)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.02)
m.eval()
nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
print(f"built {nbytes/GiB:.2f} GiB in {time.time()-t0:.1f}s", flush=True)
x = flux_inputs(m, height=64, width=64, text_len=512, device="cuda")

def timeit(n=5):
    with torch.no_grad():
        m(**x); torch.cuda.synchronize()
        ts = []
        for _ in range(n):
            t = time.perf_counter(); out = m(**x)[0]; torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2], ts, out

med, ts, ref = timeit()
print(f"resident step {med:.4f}s {['%.4f'%t for t in ts]}", flush=True)
t = time.time(); m.to("cpu"); torch.cuda.synchronize(); torch.cuda.empty_cache(); print(f"to cpu {time.time()-t:.1f}s rss {psutil.Process().memory_info().rss/GiB:.1f} GiB", flush=True)
for preset, budget in [("one_shot_fast", "8GiB"), ("one_shot_fast", "2GiB"), ("low_ram_safe", "8GiB")]:
    t = time.perf_counter()
    h = ddo_blocks.offload(m, preset=preset, vram_budget=budget, device="cuda", component="transformer")
    setup = time.perf_counter() - t
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        torch.cuda.synchronize(); t = time.perf_counter(); first = m(**x)[0]; torch.cuda.synchronize(); first_s = time.perf_counter() - t
    med2, ts2, out = timeit()
    r = h.report()
    stream = r["plan"]["streamed_bytes"]
    link = r["roofline"]["link_gb_s"] * 1e9
    roof = max(med, stream / link)
    print(f"{preset} {budget}: setup {setup:.1f}s first {first_s:.3f}s step {med2:.4f}s roofline {roof:.4f}s ratio {med2/roof:.3f} "
          f"exact {torch.equal(out, ref.to(out.device)) if False else torch.equal(out.cpu(), ref.cpu())} "
          f"streamed {stream/GiB:.2f} GiB slots {r['plan']['slots']} predicted {r['plan']['predicted_step_s']:.4f} "
          f"peak_alloc {torch.cuda.max_memory_allocated()/GiB:.2f} GiB rss {psutil.Process().memory_info().rss/GiB:.1f} GiB "
          f"maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024**2:.1f} GiB link {link/1e9:.1f}", flush=True)
    print(r, flush=True)
    t = time.perf_counter(); h.remove(); print(f"remove {time.perf_counter()-t:.1f}s", flush=True)
