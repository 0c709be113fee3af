# The 64k variant cells: each variant's own ms and its time over lora_lab's, Liger's and the floor's, per repetition.
import sys
sys.path.insert(0, "benchmarks")
import bench_loss, loss_panel_table
from lora_lab.lab import measure
D = "outputs/gpu/session_logs/session19/loss64k/"
rows = loss_panel_table.load([D + "call1", D + "call3_qwen05b", D + "call3_gemma_frozen"])
def ci(r): return f"{r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
print("| head | N | head mode | variant | variant ms | variant / lora_lab | variant / Liger | variant / floor | extra peak GiB variant / lora_lab / Liger |")
print("|---|---|---|---|---|---|---|---|---|")
for shape, tokens, head in bench_loss.cells_of(rows):
    mine = [r for r in rows if (r["shape"], r["tokens"], r["head"]) == (shape, tokens, head)]
    ok = {}
    for r in mine:
        if r["status"] == "ok":
            ok.setdefault(r["method"], []).append(r)
    med = {m: measure.summarize(r["ms"] for r in rs)["median"] for m, rs in ok.items()}
    for v in ("lora_lab_fwdgrad_lowmem", "lora_lab_fwdgrad_r4096"):
        if v not in ok:
            continue
        s = measure.summarize(r["ms"] for r in ok[v])
        rat = {b: bench_loss._time_ratio(mine, med, v, b) for b in ("lora_lab", "liger", "gemm_floor")}
        pk = [ok[m][0].get("peak_extra_gib") for m in (v, "lora_lab", "liger")]
        print(f"| {shape} | {tokens} | {head} | {v.replace('lora_lab_fwdgrad_', '')} | {s['median']:.2f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}] | "
              + " | ".join(ci(rat[b]) for b in ("lora_lab", "liger", "gemm_floor"))
              + " | " + " / ".join(f"{p:.2f}" for p in pk) + " |")
