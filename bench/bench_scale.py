"""The seeds' workload through the documented command: 01 -> 02 -> 03 -> 05 online at N/10 and N prompts.

The seeds regenerated ~88,000 prompts (8 datasets, ~228M tokens) through an API; a user of the API path
runs 01 -> 03 and the online hand-offs from a machine without a GPU. This bench is that user at two sizes:

- **Prompts**: eight datasets (b1 ... b8 as in params/kimi_openrouter.yaml), each made from the published
  format fixtures (tests/fixtures/formats: glaive's tool calls, ShareGPT's multi-turn, unicode, ...) read by
  the project's own loaders and written as `format: prompts` files, every row made unique.
- **The API**: tests/loopback.py as its own process, OpenAI-compatible, answering every request with a new
  reasoning + content answer of 8-17.6 KB (~2,400 tokens of the Qwen3 vocabulary on average), billed one
  token per word (the way the words are one token each), after `--latency` seconds.
- **The run**: profile qwen3 (the real Qwen3 vocabulary, tests/qwen3_vocab.py), `generate.backend: openai`
  with 2,000 requests in flight and the key only in the environment, `hidden.enabled: false`,
  `export.formats: [speculators_online, specforge_online]`; each stage is `python -m eagle3data run
  params.yaml --only NN`, the documented command, timed, its peak RSS polled (the stage's kernel: the
  ipykernel process papermill starts; and the largest process of the tree).

`--kill 01,02,03,05` first SIGKILLs each of those stages' kernel `--kill-after` seconds in (as the OOM killer
would; 01's kill is a stop mid-generation) and runs it again: the rerun resumes. Checks after the chain: every stage exit 0, 02's lines and 03's verdicts one per key, both online hand-offs hold every key of the mix exactly once
(handoff.json `keys` against the mix manifest and the files' own ids), and the key is in no file of the run.

Writes outputs/bench/scale.json: per size and stage wall seconds, tokens, seconds per million tokens,
peak RSS; per stage the growth ratios N against N/10 (time per token, peak RSS). Run:
    .venv/bin/python bench/bench_scale.py                        # 8,800 and 88,000 prompts (about 1.5 h)
    .venv/bin/python bench/bench_scale.py --sizes 800,8000       # quicker
    .venv/bin/python bench/bench_scale.py --prepare-only --sizes 8800   # the prompts and params only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO / "tests"))

KEY_ENV = "EAGLE3DATA_SCALE_KEY"
FIXTURES = REPO / "tests" / "fixtures" / "formats"
# the eight families of the seeds, each from its published format's fixture
DATASETS = (
    ("b1_glaive", "glaive_function_calling_v2.json", "glaive"),
    ("b2_opencodeinstruct", "opencodeinstruct.jsonl", "opencodeinstruct"),
    ("b3_magicoder", "magicoder_oss_instruct.jsonl", "magicoder"),
    ("b4_mixturethoughts", "mixture_of_thoughts.jsonl", "mixture_of_thoughts"),
    ("b5_openthoughts", "openthoughts_114k.jsonl", "openthoughts"),
    ("b6_ultrachat", "ultrachat_200k.jsonl", "ultrachat"),
    ("b7_sharegpt", "sharegpt.json", "sharegpt"),
    ("b8_sweagent", "swe_agent_trajectories.jsonl", "swe_agent"),
)
STAGES = ("01", "02", "03", "05")


def make_prompts(folder: Path, n: int, seed: int = 0) -> dict[str, Path]:
    """`n` prompts over the eight datasets (n // 8 each), `format: prompts`, each row unique."""
    from eagle3data.prompts.load import load_prompts

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    out: dict[str, Path] = {}
    for name, fixture, fmt in DATASETS:
        base = load_prompts(FIXTURES / fixture, name, fmt).prompts
        path = folder / f"{name}.jsonl"
        with open(path, "wb") as f:
            for i in range(n // len(DATASETS)):
                row = base[i % len(base)].as_row()
                msgs = [dict(m) for m in row["messages"]]
                last = max(j for j, m in enumerate(msgs) if m.get("role") == "user")
                msgs[last]["content"] = f"{msgs[last].get('content') or ''} (case {i}, seed {rng.getrandbits(32):08x})"
                row.update(sample_id=i, messages=msgs)
                row.pop("conversation", None)
                f.write(orjson.dumps(row) + b"\n")
        out[name] = path
    return out


def model_folder(root: Path, tokenizer_dir: Path) -> Path:
    """The target's folder as 05 reads it: the Qwen3 tokenizer, a Qwen3-shaped config.json and a checkpoint
    holding only a (small) tied embedding, whose name SpecForge's online config points its head at; no weights
    are loaded on this path (the trainer's machine has the real ones)."""
    import torch
    from safetensors.torch import save_file

    out = root / "model"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(tokenizer_dir, out)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 28, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16"}, indent=2))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 64, dtype=torch.bfloat16)}, str(out / "model.safetensors"))
    return out


def write_params(root: Path, n: int, files: dict[str, Path], port: int, tokenizer_dir: Path) -> Path:
    import yaml

    params = {
        "run_name": f"scale_n{n}", "output_root": str(root / "outputs"), "profile": "qwen3",
        "model": {"name": "Qwen/Qwen3-scale", "path": str(tokenizer_dir), "dtype": "bfloat16", "device": "cpu",
                  "max_context": 32768},
        "datasets": [{"name": name, "path": str(p), "format": "prompts"} for name, p in files.items()],
        "generate": {"backend": "openai", "concurrency": 2000, "timeout_s": 600, "cost_cap_usd": 1.0e6,
                     "openai": {"base_url": f"http://127.0.0.1:{port}/api/v1", "api_key_env": KEY_ENV,
                                "model": "qwen3-scale", "check_credit": False,
                                "reasoning": {"enabled": True, "exclude": False}},
                     "sampling": {"max_new_tokens": 8192, "temperature": 1.0, "top_p": 0.95, "seed": 0}},
        "hidden": {"enabled": False},
        "export": {"formats": ["speculators_online", "specforge_online"]},
    }
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def start_server(latency: float, seed: int, tokenizer_dir: Path) -> tuple[subprocess.Popen, int]:
    """The loopback API: a new answer per request, completion billed per word, the prompt billed as templated."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "loopback.py"), "--kind", "openai", "--latency",
                             str(latency), "--body-min", "8000", "--body-max", "17600", "--fresh", "--bill-words",
                             "--bill-prompt-with", "qwen3", str(tokenizer_dir), "--seed", str(seed), "--port", "0"],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "lib")))
    line = proc.stdout.readline()
    m = re.match(r"PORT (\d+)", line or "")
    if not m:
        proc.kill()
        raise SystemExit(f"the loopback server did not start: {line!r}")
    return proc, int(m.group(1))


class TreePeak:
    """Peak RSS of a process tree, polled: the kernel's (ipykernel) and the largest single process's."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every = pid, every_s
        self.kernel = 0
        self.largest = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                for p in [root, *root.children(recursive=True)]:
                    try:
                        rss = p.memory_info().rss
                        self.largest = max(self.largest, rss)
                        if any("ipykernel" in a for a in p.cmdline()):
                            self.kernel = max(self.kernel, rss)
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
            self._stop.wait(self.every)

    def __enter__(self) -> "TreePeak":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def run_stage(params: Path, stage: str, env: dict[str, str], log: Path) -> dict:
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3data", "run", str(params), "--only", stage],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        with TreePeak(proc.pid) as peak:
            rc = proc.wait()
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 2), "peak_rss_kernel_gib": round(peak.kernel / 2**30, 3),
            "peak_rss_largest_gib": round(peak.largest / 2**30, 3)}


def kill_mid(params: Path, stage: str, env: dict[str, str], log: Path, after_s: float) -> dict:
    """Start the stage, SIGKILL its kernel after `after_s` seconds (as the OOM killer would), let `run` fail."""
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3data", "run", str(params), "--only", stage],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.PIPE, text=True)
        t0, killed = time.time(), None
        while proc.poll() is None and killed is None:
            time.sleep(0.2)
            if time.time() - t0 < after_s:
                continue
            for c in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if any("ipykernel" in a for a in c.cmdline()):
                        c.kill()
                        killed = c.pid
                except psutil.Error:
                    pass
        err = proc.communicate()[1]
    err = err.strip()
    return {"killed_pid": killed, "after_s": after_s, "rc": proc.returncode, "error": err[-400:],
            # the kernel died mid-way (not after the stage ended) and `run` said so in its one line
            "killed_mid": killed is not None and proc.returncode != 0 and "SIGKILL" in err}


def kill_after(spec: str, stage: str, size_index: int) -> float:
    """Seconds into `stage` the kill comes: `spec` is one number for every stage and size, or
    `01=15/60,02=45/240,...`: per stage, one value per size (the last one repeats)."""
    if "=" not in spec:
        return float(spec)
    for item in spec.split(","):
        st, _, vals = item.partition("=")
        if st.strip() == stage:
            v = [float(x) for x in vals.split("/")]
            return v[min(size_index, len(v) - 1)]
    raise SystemExit(f"--kill-after {spec!r} names no time for stage {stage}")


def unique_lines(run_dir: Path) -> dict:
    """Nothing doubled: 01's journals, 02's lines and 03's verdicts one line per key."""
    from eagle3data.core.reader import SampleKey

    out = {}
    for name, files in (("journal", sorted((run_dir / "records").glob("*.jsonl"))),
                        ("reconstruct", sorted((run_dir / "reconstruct").glob("*.jsonl"))),
                        ("verdicts", [run_dir / "audit" / "verdicts.jsonl"])):
        keys = [SampleKey.of(orjson.loads(line)) for p in files if p.exists() for line in open(p, "rb")]
        out[name] = {"lines": len(keys), "unique": len(set(keys)) == len(keys)}
    return out


def run_tokens(run_dir: Path) -> dict[str, int | None]:
    """Records and tokens (prompt + output, 02's rebuilt ids) of the run, from 02's lines (None before 02)."""
    n = tokens = 0
    for p in sorted((run_dir / "reconstruct").glob("*.jsonl")):
        with open(p, "rb") as f:
            for line in f:
                r = orjson.loads(line)
                n += 1
                tokens += len(r["input_ids"])
    return {"records": n, "tokens": tokens} if n else {"records": None, "tokens": None}


def check_handoffs(run_dir: Path) -> dict:
    """Every key of the mix exactly once in both online hand-offs (their manifests and their files)."""
    out: dict = {}
    exp = run_dir / "export"
    mix_keys = None
    mix = run_dir / "hidden" / "mix.json"
    for fmt in ("speculators_online", "specforge_online"):
        h = json.loads((exp / fmt / "handoff.json").read_text())
        keys = h["keys"]
        res = {"rows": h["rows"], "unique": len(set(keys)) == len(keys)}
        if fmt == "specforge_online":
            ids = [orjson.loads(line)["id"] for line in open(exp / fmt / "prompts.jsonl", "rb")]
            res["file_rows_equal_manifest"] = ids == keys
        else:
            from datasets import load_from_disk

            res["file_rows_equal_manifest"] = len(load_from_disk(str(exp / fmt))) == len(keys)
        out[fmt] = res
        mix_keys = keys if mix_keys is None else mix_keys
    out["same_keys_in_both"] = (json.loads((exp / "speculators_online" / "handoff.json").read_text())["keys"]
                                == json.loads((exp / "specforge_online" / "handoff.json").read_text())["keys"])
    if mix.exists():
        out["mix_file"] = str(mix)
    return out


def key_in_files(run_dir: Path, key: str) -> list[str]:
    hits = []
    needle = key.encode()
    for p in run_dir.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                tail = b""
                while block := f.read(1 << 24):
                    if needle in tail + block:
                        hits.append(str(p))
                        break
                    tail = block[-len(needle):]
    return hits


def one_size(n: int, args, tokenizer_dir: Path, size_index: int = 0) -> dict:
    root = Path(args.root) / f"n{n}"
    if root.exists() and not args.keep:
        shutil.rmtree(root)
    files = make_prompts(root / "prompts", n)
    server, port = start_server(args.latency, n, tokenizer_dir)
    params = write_params(root, n, files, port, model_folder(root, tokenizer_dir))
    run_dir = root / "outputs" / f"scale_n{n}"
    res: dict = {"prompts": n, "params": str(params), "stages": {}}
    if args.prepare_only:
        (root / "READY").write_text(str(params) + "\n")
        print(f"prepared {params} (server pid {server.pid}, port {port}: left running)")
        return res
    key = f"sk-scale-{os.urandom(12).hex()}"
    env = dict(os.environ, **{KEY_ENV: key, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"})
    log = root / "run.log"
    try:
        kills = [k for k in args.kill.split(",") if k]
        for st in args.stages.split(","):
            if st in kills:
                after = kill_after(args.kill_after, st, size_index)
                res.setdefault("kills", {})[st] = k = kill_mid(params, st, env, log, after)
                print(f"  n={n} stage {st}: kernel killed after {after} s: rc {k['rc']}, mid-way: {k['killed_mid']}",
                      flush=True)
            r = run_stage(params, st, env, log)
            res["stages"][st] = r
            print(f"  n={n} stage {st}: rc {r['rc']} in {r['seconds']} s, kernel peak {r['peak_rss_kernel_gib']} GiB",
                  flush=True)
            if r["rc"] != 0:
                res["failed"] = st
                break
    finally:
        server.terminate()
        server.wait(30)
    res.update(run_tokens(run_dir))
    for st, r in res["stages"].items():
        r["s_per_mtok"] = round(r["seconds"] / (res["tokens"] / 1e6), 3) if res["tokens"] else None
    if "05" in res["stages"] and "failed" not in res:
        res["handoffs"] = check_handoffs(run_dir)
    res["unique"] = unique_lines(run_dir)
    res["key_in_files"] = key_in_files(run_dir, key)
    (root / "READY").write_text(str(params) + "\n")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8800,88000", help="prompt counts, the smaller first")
    ap.add_argument("--root", default=str(REPO / "outputs" / "bench" / "scale"))
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--latency", type=float, default=0.5)
    ap.add_argument("--keep", action="store_true", help="keep an existing folder (resume)")
    ap.add_argument("--kill", default="", help="stages (e.g. 02,03,05) whose kernel is SIGKILLed mid-way first, "
                                               "then run again: the run must complete with nothing doubled")
    ap.add_argument("--kill-after", default="01=15/60,02=45/240,03=45/240,05=30/150",
                    help="seconds into the stage the kill comes: one number, or per stage one value per size "
                         "(the default suits 8,800 and 88,000 prompts on 2 cores: mid-way through each)")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench" / "scale.json"))
    args = ap.parse_args()
    from qwen3_vocab import qwen3_tokenizer_dir

    tokenizer_dir = qwen3_tokenizer_dir()
    load0 = os.getloadavg()[0]
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {str(n): one_size(n, args, tokenizer_dir, i) for i, n in enumerate(sizes)}
    out = {"sizes": results, "load_1min_at_start": round(load0, 2), "cpus": os.cpu_count(),
           "machine": _cpu_name(), "commit": _commit()}
    if len(sizes) == 2 and not args.prepare_only:
        small, big = (results[str(s)] for s in sizes)
        growth = {}
        for st in small["stages"]:
            a, b = small["stages"][st], big["stages"].get(st)
            if b and a.get("s_per_mtok") and b.get("s_per_mtok"):
                growth[st] = {"time_per_token": round(b["s_per_mtok"] / a["s_per_mtok"], 3),
                              "peak_rss": round(b["peak_rss_kernel_gib"] / max(a["peak_rss_kernel_gib"], 1e-9), 3)}
        if small["tokens"] and big["tokens"]:
            chain_a = sum(r["seconds"] for r in small["stages"].values()) / small["tokens"]
            chain_b = sum(r["seconds"] for r in big["stages"].values()) / big["tokens"]
            growth["chain"] = {"time_per_token": round(chain_b / chain_a, 3)}
        out["growth"] = growth
        out["largest"] = big
        out["max_peak_rss_kernel_gib"] = max(r["peak_rss_kernel_gib"] for s in results.values()
                                             for r in s["stages"].values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "sizes"}, indent=2))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
