"""Benchmark verify-hidden against plain reading of the same store, in the same run; writes outputs/bench/verify.json.

Baseline: iterate the store through `HiddenReader` and turn every sample's states into float32
(the least a consumer does with them). Ours: `verify_store` without recompute (the head at its
default positions, every per-sample figure, the ids and mask against the records). Rounds
alternate and the best of each counts (the CPU is shared). The verification's own split (setup:
records, mix, head tensors and moments, the exact plan; head: the GEMMs and logit z's; the rest:
per-sample figures and the reading) comes from its summary; `streaming_vs_plain_read` compares the
streamed pass alone (verify less its setup) with the read less opening the reader. Also measured:
the recompute cost per sample (`--recompute all` minus none, per sample), the cost per position of
the whole head and of the logit z for this model and for a Kimi-sized one (hidden 7168, vocab
163840; the whole head timed on a tenth of the vocabulary and scaled: the matmul and the softmax
are linear in it), a Kimi head's moments (once per checkpoint), and the detection power of the
floors (`power`).

Stores: the embedded run's (`outputs/embedded/hidden`, from `make run`, verified as hard links under
outputs/bench/verify_embedded so the run itself is left as it was; without one, the nbval
fixture records are extracted once into outputs/bench/verify_run), and `long_store`: the embedded
prompts generated at 2048 new tokens and extracted once into outputs/bench/verify_long (about
7 minutes the first time), whose samples are longer, and `large_params`: a store of 1.75 GB (109
stdlib modules as code-review prompts, about 2,800 tokens each; about 34 minutes the first time). `per_byte`: what
the large store costs beyond the embedded one, verify against the read (both stores in every round, `interleaved`):
the per-byte ratio that a store much larger than a verification's fixed work (setup, the whole
head's one GEMM) reaches, and the store size at which the whole verification reaches 0.5x.
`from_storage`: each store again, with its state files evicted from the page cache before each
read and each verification (`evict`), as a store of many GB is read. `reduction_floor`: the
per-byte cost of converting and reducing every row against converting it, the bound of this
design's figures.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "bench"


def store_params():
    from eagle3data.core.provenance import params_of_run

    real = REPO / "outputs" / "embedded"
    if (real / "hidden" / "index.json").exists():
        return params_of_run(linked_copy(real, OUT / "verify_embedded" / real.name)), "outputs/embedded (make run)"
    return fixture_params()


def linked_copy(run: Path, dst: Path) -> Path:
    """The run's folder as hard links under outputs/bench, made afresh: verify writes its lines, summary and index entry
    there (each by an atomic replace, so a link's target, the user's run, is never written), not into the run."""
    shutil.rmtree(dst, ignore_errors=True)

    def link(src: str, to: str) -> None:
        try:
            os.link(src, to)
        except OSError:  # another file system: a copy
            shutil.copy2(src, to)

    shutil.copytree(run, dst, copy_function=link)
    return dst


# the stores the committed figures and the limits were measured on (bf16; 04's default for layout shards is int8 since
# 2026-12-05, whose verify figures are not measured yet: BENCH_VERIFY_STORAGE=int8 measures them)
STORAGE = os.environ.get("BENCH_VERIFY_STORAGE", "bf16")
SUFFIX = "" if STORAGE == "bf16" else f"_{STORAGE}"  # another storage: stores of its own


def fixture_params():
    """The nbval fixture records, extracted once into outputs/bench/verify_run (the store the limits come from)."""
    from eagle3data.core.params import load_params
    from eagle3data.hidden.extract import run_extract

    root = OUT / ("verify_run" + SUFFIX)
    p = load_params(REPO / "tests" / "fixtures" / "nbval.yaml",
                    {"output_root": str(root), "hidden.probe_batches": 0, "hidden.verify_after": False,
                     "hidden.storage": STORAGE})
    if not (p.run_dir / "hidden" / "index.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(REPO / "tests" / "fixtures" / "runs" / "nbval" / "records", p.run_dir / "records")
        run_extract(p, progress=False)
    return p, "tests/fixtures/runs/nbval (extracted here)"


def long_params():
    """The embedded prompts at 2048 new tokens (SmolLM2 greedy; a record ends where the model stops), generated and
    extracted once into outputs/bench/verify_long: longer samples (3.2x the tokens of make run's), so the per-sample
    and per-run costs weigh less against the bytes, as they do in a real store."""
    from eagle3data.core.params import load_params
    from eagle3data.generate.run import run_generate
    from eagle3data.hidden.extract import run_extract

    root = OUT / ("verify_long" + SUFFIX)
    p = load_params(REPO / "params" / "embedded.yaml",
                    {"output_root": str(root), "generate.sampling.max_new_tokens": 2048, "hidden.probe_batches": 0,
                     "hidden.verify_after": False, "hidden.storage": STORAGE})
    if not (p.run_dir / "hidden" / "index.json").exists():
        run_generate(p, progress=False)  # resumable: a stopped run goes on where it was
        run_extract(p, progress=False)
    return p, "outputs/bench/verify_long (embedded prompts, 2048 new tokens, extracted here)"


LARGE_PROMPTS = 110  # modules of the standard library of at least LARGE_PROMPT_CHARS, one prompt each (3.11: 110)
LARGE_PROMPT_CHARS = 10_000  # about 2,800 SmolLM2 tokens of Python source: a long-context prompt (code review)


def large_params():
    """A store of 1.75 GB (bf16), written once into outputs/bench/verify_large: one code-review prompt per module of this
    Python's standard library (at most LARGE_PROMPTS, first by name, each cut to LARGE_PROMPT_CHARS), answered greedily
    in 32 new tokens and extracted. Prompt-heavy long samples, as SWE-agent-style data is: a store large enough that
    a verification's fixed work no longer decides the whole-store ratio, measured rather than extrapolated."""
    import sysconfig

    import yaml

    from eagle3data.core.params import load_params
    from eagle3data.generate.run import run_generate
    from eagle3data.hidden.extract import run_extract

    root = OUT / ("verify_large" + SUFFIX)
    data = root / "prompts" / "stdlib_review.jsonl"
    if not data.exists():
        lib = Path(sysconfig.get_paths()["stdlib"])
        mods = [f for f in sorted(lib.glob("*.py")) if f.stat().st_size >= LARGE_PROMPT_CHARS][:LARGE_PROMPTS]
        rows = [{"sample_id": i, "messages": [{"role": "user", "content": (
            f"Review this Python module ({f.name}) and name its most serious bug risk:\n\n```python\n"
            + f.read_text(encoding="utf-8", errors="replace")[:LARGE_PROMPT_CHARS] + "\n```")}]}
            for i, f in enumerate(mods)]
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    raw = yaml.safe_load((REPO / "params" / "embedded.yaml").read_text(encoding="utf-8"))
    raw.update(run_name="stdlib_review", output_root=str(root),
               datasets=[{"name": "stdlib_review", "path": str(data)}])
    raw["generate"]["sampling"]["max_new_tokens"] = 32
    raw["hidden"].update(probe_batches=0, verify_after=False, storage=STORAGE)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    p = load_params(root / "params.yaml")
    if not (p.run_dir / "hidden" / "index.json").exists():
        run_generate(p, progress=False)
        run_extract(p, progress=False)
    return p, (f"outputs/bench/verify_large (stdlib modules of at least {LARGE_PROMPT_CHARS:,} characters as "
               "code-review prompts, 32 new tokens, extracted here)")


def reduction_floor(hdir: Path, rounds: int = 5) -> dict:
    """The per-byte floor of the verification's reductions on this CPU: the shards' states turned into float32 (the
    plain read's work) against the same states converted and reduced (2-norm and first element per row) in cache-sized blocks
    as `chunk_figures` does them; best of `rounds`."""
    import torch
    from safetensors.torch import load_file

    from eagle3data.hidden.verify.checks import REDUCE_BYTES

    shards = [t["hidden_states"] for t in (load_file(str(f)) for f in sorted((hdir / "shards").glob("*.safetensors")))]

    def plain() -> None:
        for hs in shards:
            for a in range(0, len(hs), 1024):
                hs[a:a + 1024].float()

    def reduce() -> None:
        for hs in shards:
            t, s, h = hs.shape
            step = max(1, REDUCE_BYTES // (4 * s * h))
            buf = torch.empty(min(t, step), s, h)
            for a in range(0, t, step):
                x = buf[:min(step, t - a)]
                x.copy_(hs[a:a + step])
                torch.linalg.vector_norm(x, dim=-1)
                x[:, :, 0].clone()

    best = {}
    for name, fn in (("float32_s", plain), ("reduce_s", reduce)):
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best[name] = round(min(times), 4)
    return {**best, "plain_over_reduce": round(best["float32_s"] / best["reduce_s"], 3)}


def measure(p, cfg, scratch: Path, rounds: int = 5) -> dict:
    """verify_store without recompute against plain reading of the same store, rounds alternating, best of each."""
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store.reader import HiddenReader
    from eagle3data.hidden.verify.run import DEFAULT_POSITIONS, verify_store

    hdir = hidden_dir(p)
    tokens = plain_read(hdir)  # warm the page cache for both sides
    verify_store(p, config=cfg, recompute=0, positions=DEFAULT_POSITIONS, out=scratch)  # and the head's moments
    base, ours, runs, opens = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        HiddenReader(hdir)
        opens.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain_read(hdir)
        base.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = verify_store(p, config=cfg, recompute=0, positions=DEFAULT_POSITIONS, out=scratch)
        ours.append(time.perf_counter() - t0)
        runs.append(res.summary)
    s = runs[min(range(rounds), key=lambda i: ours[i])]
    rest_s = min(ours) - s["setup_seconds"] - s["head_seconds"]
    info = HiddenReader(hdir).info
    return {
        "samples": s["samples"], "tokens": tokens, "store_bytes": int(info.get("shard_file_bytes") or 0),
        "head_positions": s["head"], "verify_ok": bool(res.ok),
        "plain_read_s": round(min(base), 4), "verify_s": round(min(ours), 4),
        "speed_vs_plain_read": round(min(base) / min(ours), 4),
        "speed_vs_plain_read_per_round": [round(b / o, 4) for b, o in zip(base, ours)],
        "verify_split_s": {"setup": s["setup_seconds"], "head": s["head_seconds"], "figures_and_reading": round(rest_s, 4)},
        "speed_vs_plain_read_without_head": round(min(base) / max(min(ours) - s["head_seconds"], 1e-9), 4),
        # the streamed pass alone: the verification less its setup (records, mix, head, moments, the exact plan: once
        # per verify, whatever the store's size) against the plain read less opening the reader (its index)
        "streaming_vs_plain_read": round((min(base) - min(opens)) / max(min(ours) - s["setup_seconds"], 1e-9), 4),
        "reader_open_s": round(min(opens), 4),
        "rounds": {"plain_read_s": [round(x, 4) for x in base], "verify_s": [round(x, 4) for x in ours],
                   "reader_open_s": [round(x, 4) for x in opens]},
        "_rest_s": rest_s, "_read_s_per_token": min(base) / tokens, "_verify_s": min(ours),
    }


def evict(hdir: Path) -> None:
    """Drop the store's state files from the page cache (POSIX_FADV_DONTNEED: clean pages no process maps), so the
    next read of them comes from storage, as a store of many GB does. The records, index and head stay cached."""
    from eagle3data.core.readahead import advise

    advise(os.POSIX_FADV_DONTNEED, *(x for sub in ("shards", "samples") for x in (hdir / sub).rglob("*") if x.is_file()))


def timed_rounds(stores: list, scratch: Path, rounds: int, cold: bool = False) -> list[dict]:
    """Per store (`(params, config)`): the plain read's and verify_store's (without recompute) times over `rounds`,
    the stores alternating within every round so that a slower spell of the shared CPU falls on all of them; `cold`:
    the store's files evicted from the page cache before each read and each verification (`evict`)."""
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.verify.run import DEFAULT_POSITIONS, verify_store

    got = [{"plain_read_s": [], "verify_s": []} for _ in stores]
    for _ in range(rounds):
        for (p, cfg), g in zip(stores, got):
            hdir = hidden_dir(p)
            for key, run in (("plain_read_s", lambda: plain_read(hdir)),
                             ("verify_s", lambda: verify_store(p, config=cfg, recompute=0, positions=DEFAULT_POSITIONS,
                                                               out=scratch))):
                if cold:
                    evict(hdir)
                t0 = time.perf_counter()
                res = run()
                g[key].append(time.perf_counter() - t0)
            g["samples"] = res.summary["samples"]
    return got


def from_storage(p, cfg, scratch: Path, warm_read_s: float, rounds: int = 5) -> dict:
    """verify_store without recompute against plain reading, each with the store's files evicted from the page cache
    first (`evict`), rounds alternating, best of each: the two as they run on a store read from disk."""
    g = timed_rounds([(p, cfg)], scratch, rounds, cold=True)[0]
    base, ours = g["plain_read_s"], g["verify_s"]
    return {"plain_read_s": round(min(base), 4), "verify_s": round(min(ours), 4),
            "speed_vs_plain_read": round(min(base) / min(ours), 4),
            "speed_vs_plain_read_per_round": [round(b / o, 4) for b, o in zip(base, ours)],
            # eviction worked where the read from storage is slower than the warm one (a RAM disk would not be)
            "cold_over_warm_read": round(min(base) / warm_read_s, 2),
            "rounds": {"plain_read_s": [round(x, 4) for x in base], "verify_s": [round(x, 4) for x in ours]}}


def interleaved(stores: list, scratch: Path, rounds: int = 9) -> list[dict]:
    """Plain read and verify of each store (`timed_rounds`, the page cache and the head's moments warmed first): per
    store its bytes, samples, best times and rounds."""
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store.reader import HiddenReader

    timed_rounds(stores, scratch, 1)  # warm
    out = []
    for (p, _), g in zip(stores, timed_rounds(stores, scratch, rounds)):
        out.append({"store_bytes": int(HiddenReader(hidden_dir(p)).info.get("shard_file_bytes") or 0),
                    "samples": g["samples"], "plain_read_s": min(g["plain_read_s"]), "verify_s": min(g["verify_s"]),
                    "rounds": {k: g[k] for k in ("plain_read_s", "verify_s")}})
    return out


def per_byte(small: dict, large: dict) -> dict:
    """What the larger store costs beyond the smaller one, verify against the plain read (both from `interleaved`):
    the per-byte speed, which is the ratio a store far larger than the head and the run's fixed work tends to (the
    work done once per verification is the intercept of its line), and, from the two lines, the store size at which
    the whole verification reaches 0.5x. The larger store also has more samples, so its slope carries their
    per-sample work too (a bound from above on verify's per-byte cost)."""
    db = large["store_bytes"] - small["store_bytes"]

    def line(key: str) -> tuple[float, float]:  # (seconds per byte, seconds at zero bytes)
        slope = (large[key] - small[key]) / db
        return slope, small[key] - slope * small["store_bytes"]

    (v_slope, v_fixed), (r_slope, r_fixed) = line("verify_s"), line("plain_read_s")
    rs, rl = small["rounds"], large["rounds"]
    per_round = [(b2 - b1) / (v2 - v1) for b1, v1, b2, v2 in  # round i of one store against round i of the other
                 zip(rs["plain_read_s"], rs["verify_s"], rl["plain_read_s"], rl["verify_s"]) if v2 > v1]
    half = (0.5 * v_fixed - r_fixed) / (r_slope - 0.5 * v_slope) if r_slope > 0.5 * v_slope else None
    return {"speed_vs_plain_read": round(r_slope / v_slope, 4) if v_slope > 0 else None,
            "speed_vs_plain_read_per_round": [round(x, 4) for x in per_round],
            "extra_bytes": db, "extra_samples": large["samples"] - small["samples"],
            "verify_s_per_gb": round(v_slope * 1e9, 4), "plain_read_s_per_gb": round(r_slope * 1e9, 4),
            "verify_fixed_s": round(v_fixed, 4), "plain_read_fixed_s": round(r_fixed, 4),
            "store_bytes_for_half_speed": None if half is None else int(max(half, 0))}


def plain_read(hdir: Path) -> int:
    from eagle3data.hidden.store.reader import HiddenReader

    n = 0
    for smp in HiddenReader(hdir):
        n += smp["hidden_states"].float().shape[0]
    return n


def head_cost(positions: int = 512, vocab_part: int = 16384, hidden: int = 7168, vocab: int = 163840,
              rounds: int = 3) -> float:
    """Seconds per head position on this CPU (float32, the verification's own kernels: one GEMM of `positions`,
    log-softmax, argmax), timed on `vocab_part` rows of the vocabulary and scaled (each is linear in it)."""
    import torch

    w = torch.randn(min(vocab_part, vocab), hidden)
    x = torch.randn(positions, hidden)

    def once() -> None:
        logits = torch.nn.functional.linear(x, w)
        logits.argmax(1)
        torch.log_softmax(logits, dim=-1)

    once()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best * (vocab / min(vocab_part, vocab)) / positions


def z_cost(hidden: int = 7168, positions: int = 4096, rounds: int = 3, dtype: str = "bfloat16") -> float:
    """Seconds per logit-z position on this CPU (`Head.logit_z`'s kernels: the GEMM by the covariance factor in
    `dtype`, bfloat16 as verify runs it, the row norms, the target rows' dot products and the mean logit in float32)."""
    import torch

    factor, mean = torch.randn(hidden, hidden).to(getattr(torch, dtype)), torch.randn(hidden)
    x, rows = torch.randn(positions, hidden), torch.randn(positions, hidden)

    def once() -> None:
        torch.linalg.vector_norm((x.to(factor.dtype) @ factor).float(), dim=-1)
        (x * rows).sum(-1) - x @ mean

    once()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best / positions


def moments_cost(hidden: int = 7168, vocab: int = 163840, vocab_part: int = 16384) -> float:
    """Seconds for `Head.moments` of a head this size, once per verification: the centred covariance GEMM (timed
    on `vocab_part` rows and scaled: linear in the vocabulary) plus the float64 eigendecomposition (timed whole)."""
    import torch

    w = torch.randn(vocab_part, hidden)
    t0 = time.perf_counter()
    c = w - w.mean(0)
    cov = (c.T @ c).double()
    gemm = (time.perf_counter() - t0) * vocab / vocab_part
    t0 = time.perf_counter()
    torch.linalg.eigh(cov / vocab_part)
    return gemm + time.perf_counter() - t0


def main() -> int:
    import torch

    from eagle3data.hidden.capture import load_config
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store.format import stored_bytes_per_token
    from eagle3data.hidden.store.reader import HiddenReader
    from eagle3data.hidden.verify.run import DEFAULT_POSITIONS, verify_store
    from eagle3data.core.params.hidden import Z_OUT_FLOOR, Z_PROMPT_FLOOR
    from eagle3data.hidden.verify.checks import EXACT_RUN_FLOOR, HEAD_FLOPS_PER_BYTE
    from eagle3data.hidden.verify.command import BACKENDS

    load_start = os.getloadavg()
    p, where = store_params()
    cfg = load_config(p)
    info = HiddenReader(hidden_dir(p)).info
    scratch = OUT / "verify_lines.jsonl"
    m = measure(p, cfg, scratch)
    lp, long_where = long_params()
    lcfg = load_config(lp)
    ml = measure(lp, lcfg, scratch)
    m["from_storage"] = from_storage(p, cfg, scratch, m["plain_read_s"])
    ml["from_storage"] = from_storage(lp, lcfg, scratch, ml["plain_read_s"])
    gp, large_where = large_params()
    gcfg = load_config(gp)
    mg = measure(gp, gcfg, scratch)
    mg["from_storage"] = from_storage(gp, gcfg, scratch, mg["plain_read_s"])
    t0 = time.perf_counter()
    full = verify_store(p, config=cfg, backend=BACKENDS["hf"](p, info, cfg), recompute="all",
                        positions=DEFAULT_POSITIONS, out=scratch)
    with_all = time.perf_counter() - t0
    n = full.summary["samples"]
    hidden, vocab = int(cfg.get_text_config().hidden_size), int(cfg.get_text_config().vocab_size)
    this_head = head_cost(hidden=hidden, vocab=vocab, vocab_part=vocab)
    kimi = head_cost()
    this_z, kimi_z = z_cost(hidden), z_cost()
    this_z32, kimi_z32 = z_cost(hidden, dtype="float32"), z_cost(dtype="float32")
    kimi_moments = moments_cost()
    token_bytes = stored_bytes_per_token(info)
    fixture = fixture_params()  # the store the limits come from (extracted once), for its power beside this one's
    private = ("_rest_s", "_read_s_per_token", "_verify_s")
    figures = {
        "store": where, "bytes_per_token": token_bytes,
        "positions_cap": DEFAULT_POSITIONS, "exact_run_floor": EXACT_RUN_FLOOR, "z_out_floor": Z_OUT_FLOOR,
        "z_prompt_floor": Z_PROMPT_FLOOR, "head_flops_per_byte": HEAD_FLOPS_PER_BYTE, "goal": ">= 0.5",
        **{k: v for k, v in m.items() if k not in private},
        "long_store": {"store": long_where, **{k: v for k, v in ml.items() if k not in private}},
        # the 1.75 GB store: the whole-store ratio where the fixed work is a few percent of the read
        "large_store": {"store": large_where, **{k: v for k, v in mg.items() if k not in private}},
        # the 1.75 GB store beyond the embedded one: the per-byte ratio a store much larger than the fixed work reaches
        "per_byte": per_byte(*interleaved([(p, cfg), (gp, gcfg)], scratch)),
        # the per-byte floor of this design: converting and reducing every row, against converting it (the plain read)
        "reduction_floor": reduction_floor(hidden_dir(lp)),
        "verify_ok": bool(m["verify_ok"] and ml["verify_ok"] and mg["verify_ok"] and full.ok),
        "recompute_s_per_sample": round((with_all - m["_verify_s"]) / n, 4),
        "recompute_s_per_sample_inside_verify": round(full.summary["recompute_seconds"] / n, 4),
        "recompute_over_verify_per_sample": round((with_all - m["_verify_s"]) / m["_verify_s"], 3),
        "recompute_tokens_per_s": round(m["tokens"] / max(full.summary["recompute_seconds"], 1e-9), 1),
        "head_ms_per_position_cpu": round(1e3 * this_head, 3),
        "kimi_head_ms_per_position_cpu": round(1e3 * kimi, 3),
        "kimi_over_this_head": round(kimi / this_head, 2),
        "z_ms_per_position_cpu": round(1e3 * this_z, 4),
        "kimi_z_ms_per_position_cpu": round(1e3 * kimi_z, 4),
        "z_ms_per_position_cpu_float32": round(1e3 * this_z32, 4),
        "kimi_z_ms_per_position_cpu_float32": round(1e3 * kimi_z32, 4),
        "head_over_z_per_position": round(this_head / this_z, 1),
        "kimi_head_over_z_per_position": round(kimi / kimi_z, 1),
        "kimi_moments_s_cpu": round(kimi_moments, 1),
        # at the floors, how long a sample must be (tokens) for verify to reach 0.5x plain reading on this CPU:
        # n * (stats per token) + floor positions * head per position <= 2 * n * read per token
        "tokens_per_sample_for_half_speed": _break_even(m["_read_s_per_token"], m["_rest_s"] / m["tokens"],
                                                        (Z_OUT_FLOOR + Z_PROMPT_FLOOR) * this_z),
        "power": power(p, cfg),
        "power_fixture": power(fixture[0], cfg) if where != fixture[1] else "the store above",
        "torch_threads": torch.get_num_threads(), "load_average_at_start": load_start,
        "load_average": os.getloadavg(),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"verify{SUFFIX}.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    return 0


def power(p, cfg, draws: int = 20000) -> dict:
    """The detection power of the floors, from this store: every output and prompt position (the prompt ones after
    the prefix another sample shares, as verify draws them) of each clean sample, of the sample shifted by one
    position, and of the sample with the next sample's states (the output part: a swap; the prompt part: a prompt
    from another sample), through the whole head and the logit z.

    run_head_top1: the measured top-1 rates, and for the run floor K the binomial false-fail (a clean run at
    TOP1_CLEAN_MISS) and miss (a broken run at 10% top-1, and at the worst measured) of top1_limit(K).
    head_logit_z / prompt_logit_z: K positions drawn (with replacement) `draws` times per sample (all of them once
    where the sample has no more than K, as verify takes them); the worst sample's share below the limit (clean: a
    false failure) and at or above it (broken: a miss)."""
    import torch

    from eagle3data.core.models import resolve_model_path
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store.reader import HiddenReader
    from eagle3data.core.params.hidden import Z_OUT_FLOOR, Z_PROMPT_FLOOR
    from eagle3data.hidden.verify.checks import (EXACT_RUN_FLOOR, MIN_OUT_Z, MIN_PROMPT_Z, TOP1_ALPHA, TOP1_CLEAN_MISS,
                                                 binom_tail, top1_limit, unique_starts)
    from eagle3data.hidden.verify.head import load_head

    head = load_head(resolve_model_path(p.model.path), cfg)
    rd = HiddenReader(hidden_dir(p))
    fin = rd.states.index("post_norm") if "post_norm" in rd.states else rd.states.index("pre_norm")
    post_of = (lambda hs: hs[:, fin].float()) if rd.states[fin] == "post_norm" else (lambda hs: head.norm(hs[:, fin]))
    samples = list(rd)
    shared = unique_starts({i: smp["input_ids"].tolist() for i, smp in enumerate(samples)})

    def figs(post, ids, at):
        if not at:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0)
        rows = torch.tensor(at, dtype=torch.long)
        logits = torch.nn.functional.linear(post[rows], head.lm_head)
        tgt = ids[rows + 1].long()
        return ((logits.argmax(1) != tgt).long(), torch.log_softmax(logits, -1).gather(1, tgt[:, None])[:, 0],
                head.logit_z(post[rows], tgt))

    got: dict[str, list] = {"clean_out": [], "clean_prompt": [], "shift_out": [], "swap_out": [], "other_prompt": []}
    for i, smp in enumerate(samples):
        ids, m = smp["input_ids"], smp["loss_mask"].tolist()
        n = len(m)
        out_at = [t for t in range(n - 1) if m[t + 1]]
        prompt_at = [t for t in range(shared[i], n - 1) if not m[t + 1]]  # after the prefix another shares
        post = post_of(smp["hidden_states"])
        got["clean_out"].append(figs(post, ids, out_at))
        got["clean_prompt"].append(figs(post, ids, prompt_at))
        got["shift_out"].append(figs(torch.roll(post, -1, 0), ids, out_at))
        other = post_of(samples[(i + 1) % len(samples)]["hidden_states"])
        k = min(len(other), n)
        mixed = post.clone()
        mixed[:k] = other[:k]
        got["swap_out"].append(figs(mixed, ids, [t for t in out_at if t < k]))
        got["other_prompt"].append(figs(mixed, ids, [t for t in prompt_at if t < k]))
    rates = {}
    for name, parts in got.items():
        miss = torch.cat([a for a, _, _ in parts])
        z = torch.cat([c for _, _, c in parts])
        per = [float(c.mean()) for _, _, c in parts if len(c)]
        rates[name] = {"positions": len(miss), "top1": round(1 - float(miss.float().mean()), 4),
                       "logprob_median": round(float(torch.cat([b for _, b, _ in parts]).median()), 3),
                       "z_quantiles_1_5_50_95": [round(float(torch.quantile(z, q)), 2) for q in (0.01, 0.05, 0.5, 0.95)],
                       "z_mean_per_sample": [min(per), max(per)] if per else None}
    broken = 0.10
    measured_broken = max(rates["shift_out"]["top1"], rates["swap_out"]["top1"])
    lim = top1_limit(EXACT_RUN_FLOOR)
    g = torch.Generator().manual_seed(0)

    def worst(parts, limit: float, below: bool, k: int) -> float:
        out = 0.0
        for _, _, z in parts:
            if len(z) == 0:
                continue
            if len(z) <= k:  # verify takes every position of a sample this short: one mean, no draw
                mean = z.mean()[None]
            else:  # with replacement: more spread than verify's draw without (Hoeffding), so conservative
                mean = z[torch.randint(len(z), (draws, k), generator=g)].mean(1)
            out = max(out, float(((mean < limit) if below else (mean >= limit)).float().mean()))
        return out

    def z_power(clean, broken_parts, limit, floor):
        return {"K": floor, "limit": limit, "draws_per_sample": draws,
                "worst_clean_false_fail": worst(clean, limit, True, floor),
                "worst_broken_miss": max(worst(b, limit, False, floor) for b in broken_parts),
                "by_K": {k: {"worst_clean_false_fail": worst(clean, limit, True, k),
                             "worst_broken_miss": max(worst(b, limit, False, k) for b in broken_parts)}
                         for k in (4, 8, 16, 32, 64)}}

    return {"rates": rates, "run_head_top1": {
        "K": EXACT_RUN_FLOOR, "fail_at_misses": lim, "clean_miss_rate_assumed": TOP1_CLEAN_MISS,
        "broken_top1_assumed": broken, "broken_top1_measured_worst": measured_broken,
        "false_fail": float(f"{binom_tail(EXACT_RUN_FLOOR, TOP1_CLEAN_MISS, lim):.3g}"), "alpha": TOP1_ALPHA,
        "miss": float(f"{1 - binom_tail(EXACT_RUN_FLOOR, 1 - broken, lim):.3g}"),
        "miss_at_measured_broken": float(f"{1 - binom_tail(EXACT_RUN_FLOOR, 1 - measured_broken, lim):.3g}"),
        "by_K": {k: {"fail_at_misses": top1_limit(k),
                     "false_fail": float(f"{binom_tail(k, TOP1_CLEAN_MISS, top1_limit(k)):.3g}"),
                     "miss": float(f"{1 - binom_tail(k, 1 - broken, top1_limit(k)):.3g}")} for k in (4, 8, 16, 32)}},
        "head_logit_z": z_power(got["clean_out"], (got["shift_out"], got["swap_out"]), MIN_OUT_Z, Z_OUT_FLOOR),
        "prompt_logit_z": z_power(got["clean_prompt"], (got["other_prompt"],), MIN_PROMPT_Z, Z_PROMPT_FLOOR)}


def _break_even(read_tok: float, figures_tok: float, floors_s: float) -> int | None:
    """Tokens per sample from which the floors' head work (`floors_s` seconds per sample) keeps verify at >= 0.5x
    plain reading (None: the per-token figures alone cost more than twice the reading)."""
    spare = 2 * read_tok - figures_tok
    return None if spare <= 0 else int(floors_s / spare) + 1


if __name__ == "__main__":
    raise SystemExit(main())
