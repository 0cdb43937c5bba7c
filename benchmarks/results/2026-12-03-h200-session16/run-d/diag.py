"""Session 16 diagnosis: the linear row on a 10 GiB card gave an image unlike the resident one.
Which phase differs: the latents the VAE decodes, or the decode itself (cuDNN's choice of
algorithm under memory pressure)?"""
import time

import torch

import ddo_blocks
from benchmarks.pipeline import _fill_card, full_size_components
from diffusers import FluxPipeline

dev = torch.device("cuda")
t0 = time.perf_counter()
pipe = FluxPipeline(**full_size_components("cuda"))
print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
call = dict(prompt="a watercolor of a lighthouse at dusk", height=1024, width=1024, num_inference_steps=28,
            max_sequence_length=512, guidance_scale=3.5, output_type="pt")
seen = []
decode = pipe.vae.decode


def recording(z, *a, **k):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = decode(z, *a, **k)
    torch.cuda.synchronize()
    seen.append((z.detach().clone().cpu(), out[0].detach().clone().cpu(), time.perf_counter() - t,
                 torch.cuda.mem_get_info()[0]))
    return out


pipe.vae.decode = recording


def gen():
    return pipe(generator=torch.Generator("cpu").manual_seed(0), **call).images.cpu()


pipe.to(dev)
ref_img = gen()
ref_img2 = gen()
ref_z, ref_dec, ref_s, ref_free = seen[-1]
print(f"resident: twice equal {torch.equal(ref_img, ref_img2)}, decode {ref_s:.3f} s, free {ref_free / 2**30:.2f} GiB",
      flush=True)
pipe.to("cpu")
filler = _fill_card(dev, 10)
seen.clear()
off = ddo_blocks.offload_pipeline(pipe, vram_budget=7382518528, device=dev)
print("policies:", {n: p.describe() for n, p in off.policies.items()}, flush=True)
for i in range(3):
    img = gen()
    z, dec, s, free = seen[-1]
    print(f"linear gen{i + 1}: image equal {torch.equal(img, ref_img)}, latents equal {torch.equal(z, ref_z)}, "
          f"decode equal {torch.equal(dec, ref_dec)} ({s:.3f} s, free at its end {free / 2**30:.2f} GiB), "
          f"max |decode diff| {(dec.float() - ref_dec.float()).abs().max().item():.3g}", flush=True)
# the same latents decoded again: with the offload attached after empty_cache, and without it
for label, prep in (("attached, empty_cache", torch.cuda.empty_cache),
                    ("removed, the VAE alone on the 10 GiB card", lambda: (off.remove(), pipe.vae.to(dev)))):
    prep()
    torch.cuda.empty_cache()
    with torch.no_grad():
        again = recording(ref_z.to(dev), return_dict=False)
    z, dec, s, free = seen[-1]
    print(f"decode of the reference latents, {label}: equal {torch.equal(dec, ref_dec)} ({s:.3f} s, free "
          f"{free / 2**30:.2f} GiB)", flush=True)
# under pressure on purpose: hold most of the free memory, decode the reference latents again
del filler
torch.cuda.empty_cache()
pipe.vae.to(dev)
for leave in (6.0, 3.0, 2.6):
    free, _ = torch.cuda.mem_get_info()
    hold = torch.empty(max(0, free - int(leave * 2**30)), dtype=torch.uint8, device=dev)
    with torch.no_grad():
        recording(ref_z.to(dev), return_dict=False)
    z, dec, s, f2 = seen[-1]
    print(f"decode with {leave} GiB free: equal {torch.equal(dec, ref_dec)} ({s:.3f} s)", flush=True)
    del hold
    torch.cuda.empty_cache()
