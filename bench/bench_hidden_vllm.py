"""04 through vLLM's CPU build vs 04 through the HF forward, in one run; writes outputs/bench/hidden_vllm.json.

Both extract the embedded mix (`bench_hidden.ensure_records`: make run's records, else a smaller
embedded run generated once) into fresh stores, the same params but `hidden.backend`. The vLLM server
(`hidden_command`: extract_hidden_states, the project's CPU connector, float32, enforce-eager) is
started once before the passes (its start-up time is reported apart) and serves every vLLM pass; the
HF model is loaded once. Passes alternate (hf, vllm, hf, vllm, ...) and each one's best counts (the
CPU is shared). Figures: tokens/s of the capture (stats `seconds`) and of the whole `run_extract`
(mix, plan, merge, and 04's own verify: the head checks and `verify_recompute` samples per shard
recomputed by each path's own backend, the vLLM one through the same server), their ratios
vLLM/HF, and the client's CPU on the vLLM path (the
engine's `process_time`: requests, reading and checking files, the post-norm): CPU-seconds per
sample, and as a share of the capture's wall time (`vllm_client_cpu_over_capture`: the cores the
client keeps busy while the server works; it must stay well under the client's cores for the
client never to be what a GPU server waits on). A figure on
a 2-core CPU to report, not a goal: vLLM's place is the GPU node that runs targets HF cannot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "bench"
sys.path.insert(0, str(Path(__file__).parent))
from bench_hidden import ensure_records  # noqa: E402


def params(run_root: Path, hidden_out: Path, backend: str, base_url: str | None = None):
    from eagle3data.core.params import load_params

    over = {"output_root": str(run_root), "run_name": "embedded", "hidden.probe_batches": 0,
            "hidden.validate_after": False, "hidden.out_dir": str(hidden_out), "hidden.backend": backend}
    if backend == "vllm":
        over["hidden.vllm"] = {"base_url": base_url, "concurrency": 16} if base_url else {"launch": True}
    return load_params(REPO / "params" / "embedded.yaml", over)


def one_pass(p, model=None) -> dict:
    from eagle3data.hidden.extract import run_extract

    shutil.rmtree(p.hidden.out_dir, ignore_errors=True)
    t0 = time.perf_counter()
    res = run_extract(p, progress=False, model=model)
    wall = time.perf_counter() - t0
    s = res.stats
    assert res.merged and not s.get("failed"), s
    return {"tokens": s["tokens"], "samples": s["extracted"], "capture_s": s["seconds"], "wall_s": round(wall, 3),
            "capture_tokens_per_s": round(s["tokens"] / s["seconds"], 1), "wall_tokens_per_s": round(s["tokens"] / wall, 1),
            "client_cpu_s": s.get("engine_cpu_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from eagle3data.core.models import model_for
    from eagle3data.generate.backends.vllm_server import VLLMServer
    from eagle3data.hidden.capture import layer_plan, load_config
    from eagle3data.hidden.engines.vllm_capture import hidden_command

    run_root, records = ensure_records()
    scratch = OUT / "hidden_vllm_scratch"
    launch = params(run_root, scratch / "vllm", "vllm")
    if not Path(hidden_command(launch, layer_plan(launch, load_config(launch))).argv[0]).exists():
        print("no engine venv (.engine/): run `make engine` first; nothing measured")
        return 0
    load = os.getloadavg()
    t0 = time.perf_counter()
    with VLLMServer(hidden_command(launch, layer_plan(launch, load_config(launch))), progress=False) as srv:
        start_s = round(time.perf_counter() - t0, 1)
        hf_p = params(run_root, scratch / "hf", "hf")
        vl_p = params(run_root, scratch / "vllm", "vllm", srv.base_url)
        model = model_for(hf_p)
        one_pass(vl_p)  # warm-up of both (first-call costs), not counted
        one_pass(hf_p, model)
        runs = []
        for _ in range(args.rounds):
            runs.append({"backend": "hf", **one_pass(hf_p, model)})
            runs.append({"backend": "vllm", **one_pass(vl_p)})
    best = {b: max((r for r in runs if r["backend"] == b), key=lambda r: r["capture_tokens_per_s"]) for b in ("hf", "vllm")}
    hf, vl = best["hf"], best["vllm"]
    figures = {
        "records": records, "samples": hf["samples"], "tokens": hf["tokens"],
        "hf_capture_tokens_per_s": hf["capture_tokens_per_s"], "vllm_capture_tokens_per_s": vl["capture_tokens_per_s"],
        "vllm_vs_hf_capture": round(vl["capture_tokens_per_s"] / hf["capture_tokens_per_s"], 3),
        "hf_wall_tokens_per_s": hf["wall_tokens_per_s"], "vllm_wall_tokens_per_s": vl["wall_tokens_per_s"],
        "vllm_vs_hf_wall": round(vl["wall_tokens_per_s"] / hf["wall_tokens_per_s"], 3),
        "vllm_client_cpu_ms_per_sample": round(1000 * vl["client_cpu_s"] / vl["samples"], 2),
        "vllm_client_cpu_s_per_sample": round(vl["client_cpu_s"] / vl["samples"], 5),
        "vllm_client_cpu_over_capture": round(vl["client_cpu_s"] / vl["capture_s"], 4),
        "vllm_server_start_s": start_s, "load_average_1_5_15": [round(x, 2) for x in load],
        "cpus": os.cpu_count(), "runs": runs,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "hidden_vllm.json").write_text(json.dumps(figures, indent=2))
    shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps({k: v for k, v in figures.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
