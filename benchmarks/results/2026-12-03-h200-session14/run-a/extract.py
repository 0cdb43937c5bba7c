"""Compact GPU lanes from a torch profiler trace: kernels and memcpys (ts, dur, name, stream, bytes)."""
import gzip, json, sys
src, dst = sys.argv[1], sys.argv[2]
t = json.load(open(src))
rows = []
for e in t["traceEvents"]:
    if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
        a = e.get("args") or {}
        rows.append([e["cat"][4:7] if e["cat"] != "kernel" else "k", round(float(e["ts"]), 2), round(float(e.get("dur", 0)), 2),
                     e.get("name", "")[:48], a.get("stream"), a.get("bytes")])
    elif e.get("ph") == "X" and e.get("name") == "ddo_call":
        rows.append(["call", float(e["ts"]), float(e["dur"]), "ddo_call", None, None])
json.dump(rows, gzip.open(dst, "wt"))
print(len(rows), "events")
