"""What a stage holds per record or prompt, by tracemalloc: the figures docs/running.md quotes for issue 59.

    python bench/held_bytes.py 01 --prompts 88000        # 01's plan and jobs on bench_scale's prompt files
    python bench/held_bytes.py 03 --run outputs/bench/scale/n8800   # 03 on a bench_scale run (copied first)

01: `plan_run` (template=False, as the HTTP path plans) and the engine's jobs over `bench_scale.make_prompts`'
eight datasets; prints the bytes a prompt held after the plan and its peak. 03: `run_audit` on a copy of a
`bench_scale.py` size folder (its journals and 02's lines); prints the bytes a record held at the stage's end
(the result and 02's index) and its peak, and the largest holders. Python objects only (tracemalloc): the
RSS `bench_scale.py` polls is more (the interpreter, numpy buffers, a fragmented heap).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def held_01(n: int) -> None:
    import bench_scale

    from eagle3data.core.params import load_params
    from eagle3data.generate.plan import plan_run
    from eagle3data.generate.run import _jobs

    with tempfile.TemporaryDirectory() as tmp:
        files = bench_scale.make_prompts(Path(tmp) / "prompts", n)
        p = load_params(REPO / "params" / "ci.yaml", {
            "output_root": str(Path(tmp) / "out"),
            "datasets": [{"name": k, "path": str(f), "format": "prompts"} for k, f in files.items()]})
        tracemalloc.start()
        plan = plan_run(p, None, None, template=False)
        jobs = _jobs(p, plan)
        gc.collect()
        cur, peak = tracemalloc.get_traced_memory()
        print(f"01: {len(jobs):,} prompts planned: {cur / len(jobs):,.0f} B a prompt held, peak {peak / len(jobs):,.0f}")


def held_03(run: Path, top: int) -> None:
    import yaml

    from eagle3data.audit.run import run_audit
    from eagle3data.core.models import tokenizer_for
    from eagle3data.core.params import load_params

    with tempfile.TemporaryDirectory() as tmp:
        src = yaml.safe_load((run / "params.yaml").read_text())
        dst = Path(tmp) / "outputs"
        shutil.copytree(Path(src["output_root"]) / src["run_name"], dst / src["run_name"],
                        ignore=shutil.ignore_patterns("export", "hidden"))
        p = load_params(run / "params.yaml", {"output_root": str(dst)})
        tok = tokenizer_for(p)
        tracemalloc.start(3)
        t0 = time.perf_counter()
        res = run_audit(p, progress=False, tokenizer=tok)
        n = res.summary()["records"]
        gc.collect()
        cur, peak = tracemalloc.get_traced_memory()
        print(f"03: {n:,} records in {time.perf_counter() - t0:.0f} s: {cur / n:,.0f} B a record held at the end, "
              f"peak {peak / n:,.0f}")
        for st in tracemalloc.take_snapshot().statistics("traceback")[:top]:
            print(f"  {st.size / n:,.0f} B a record: {st.traceback.format()[-2].strip()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["01", "03"])
    ap.add_argument("--prompts", type=int, default=88000)
    ap.add_argument("--run", default=str(REPO / "outputs" / "bench" / "scale" / "n8800"),
                    help="a bench_scale.py size folder (its params.yaml)")
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    if a.stage == "01":
        held_01(a.prompts)
    else:
        held_03(Path(a.run), a.top)


if __name__ == "__main__":
    main()
