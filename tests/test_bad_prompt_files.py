"""Bad prompt files as users have them (issue 22, item 4): a Windows-1252 line in a UTF-8 JSONL,
a whole file in Windows-1252 or UTF-16, a `.json` array cut off by a partial download, datasets
of the wrong format or with every row bad (all named at once, before any work), and a dataset
folder with several configs and no `subset`."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3data.core.params import load_params
from eagle3data.generate.plan import _check_prompt_sets
from eagle3data.preflight import ready_problems
from eagle3data.prompts.load import check_source, load_prompts
from eagle3data.prompts.files import PromptDataError

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "formats"


def _row(i: int, text: str = "hi") -> dict:
    return {"sample_id": i, "messages": [{"role": "user", "content": f"{text} {i}"}]}


def _line(i: int, text: str = "hi") -> bytes:
    return json.dumps(_row(i, text)).encode() + b"\n"  # ASCII, as json.dumps writes by default


def _prompts_cmd(path: Path, fmt: str = "prompts", *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3data", "prompts", str(path), "--format", fmt, *extra],
                          cwd=REPO, capture_output=True, text=True)


def _params(tmp_path: Path, datasets: list[dict]):
    return load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path / "out"), "datasets": datasets})


def test_a_windows_1252_line_in_the_first_64_kib_is_one_rejected_row_and_the_rest_loads(tmp_path):
    bad = json.dumps(_row(3, "café – “quoted”"), ensure_ascii=False).encode("cp1252") + b"\n"
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(_line(1) + _line(2) + bad + _line(4) + _line(5))  # the bad line is at byte ~150
    assert check_source(str(f)) is None
    ps = load_prompts(f)
    assert [p.sample_id for p in ps.prompts] == [1, 2, 4, 5]
    at = bad.index("é".encode("cp1252"))
    reason = "not UTF-8 (looks like Windows-1252): re-save the file as UTF-8"
    assert ps.skipped == [f"{f}:3: {reason} (byte {at} of the line)"]
    assert ps.reason_counts()[0][0] == reason
    res = _prompts_cmd(f)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5 rows -> 4 prompts; 1 rejected" in res.stdout and f"{f}:3: {reason}" in res.stdout
    # also the first line, and past the first 64 KiB
    f.write_bytes(bad + b"".join(_line(i) for i in range(10, 1500)) + bad.replace(b'": 3', b'": 2'))
    ps = load_prompts(f)
    assert len(ps.prompts) == 1490 and [r.where for r in ps.rejected] == [f"{f}:1", f"{f}:1492"]
    # a `.json` array: the row holding the bytes is rejected alone
    arr = tmp_path / "mixed.json"
    arr.write_bytes(b"[" + json.dumps(_row(1)).encode() + b",\n" + bad.strip() + b",\n"
                    + json.dumps(_row(2)).encode() + b"]")
    ps = load_prompts(arr)
    assert [p.sample_id for p in ps.prompts] == [1, 2]
    assert ps.skipped == [f"{arr} row 2: {reason} (byte {at} of the row)"]


def test_a_whole_file_in_windows_1252_or_utf_16_is_named_with_its_encoding_and_the_fix(tmp_path):
    rows = [_row(i, "naïve café – “q”") for i in range(3)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    legacy = "is Windows-1252 (or Latin-1) text, not UTF-8: re-save it as UTF-8"
    cases = {"cp1252.jsonl": (text.encode("cp1252"), legacy),
             "utf16.jsonl": (text.encode("utf-16"), "is UTF-16 text, not UTF-8: re-save it as UTF-8"),  # with a BOM
             "utf16le.jsonl": (text.encode("utf-16-le"), "is UTF-16 text, not UTF-8: re-save it as UTF-8"),  # none
             "utf16.json": (json.dumps(rows, ensure_ascii=False).encode("utf-16"), "is UTF-16 text, not UTF-8"),
             "latin1.json": (json.dumps(rows[:1], ensure_ascii=False).replace("–", "-").replace("“", '\\"')
                             .replace("”", '\\"').encode("latin-1"), legacy)}
    for name, (data, words) in cases.items():
        f = tmp_path / name
        f.write_bytes(data)
        why = check_source(str(f))
        assert why and why.startswith(f"{f}: {words}") and "binary" not in why, (name, why)
        with pytest.raises(PromptDataError) as e:
            load_prompts(f)
        assert str(e.value) == why
        res = _prompts_cmd(f)
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [f"error: {why}"] and not res.stdout, \
            (name, res.stdout, res.stderr)
    # real binary files stay binary
    binaries = {"zeros.jsonl": bytes(4096), "packed.jsonl": gzip.compress(text.encode()),
                "random.json": bytes((i * 7919 + 13) % 256 for i in range(8192))}
    for name, data in binaries.items():
        (tmp_path / name).write_bytes(data)
        why = check_source(str(tmp_path / name))
        assert why and "file, not JSON text" in why and ("binary" in why or "gzip" in why), (name, why)
    parquet = tmp_path / "data.jsonl"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert check_source(str(parquet)) == f"{parquet}: is a parquet file, not JSON text (rename it to .parquet)"


def test_a_json_array_cut_off_is_called_cut_off(tmp_path):
    rows = json.loads((FIX / "sharegpt.json").read_text())
    whole = json.dumps(rows, indent=1)
    f = tmp_path / "partial.json"
    for cut in (whole.index("QWJ3kLm_0") + 4, len(whole) // 2, len(whole) - 3):  # in a string, mid-way, at the end
        f.write_text(whole[:cut])
        why = check_source(str(f), "sharegpt")
        assert why and why.startswith(f"{f}: the file is cut off (truncated: a partial download?)"), why
        assert "at at" not in why and "line" in why and "column" in why, why
        with pytest.raises(PromptDataError) as e:
            load_prompts(f, format="sharegpt")
        assert str(e.value) == why
        res = _prompts_cmd(f, "sharegpt")
        assert res.returncode == 2 and res.stderr.strip() == f"error: {why}" and not res.stdout, res.stdout + res.stderr
    # larger than what the preflight reads: the file's last bytes say it is not closed
    big = tmp_path / "big.json"
    big.write_text(json.dumps([_row(i, "x" * 500) for i in range(4000)])[:-40])
    assert big.stat().st_size > 2 << 20
    why = check_source(str(big))
    assert why == f"{big}: the file is cut off (truncated: a partial download?): it ends at byte " \
                  f"{big.stat().st_size} before the JSON array is closed"
    f.write_text('[{"sample_id": 1, "messages": [{"role": "user", "content": "a\tb"}]}]')  # not cut: no "at at"
    why = check_source(str(f))
    assert why and "not valid JSON (Invalid control character at line 1 column" in why and "cut off" not in why, why


def test_the_preflight_names_every_bad_dataset_at_once_with_the_format_it_looks_like(tmp_path):
    wrong_format = FIX / "sharegpt.json"  # a JSON array of ShareGPT rows, given as format openai
    all_bad = tmp_path / "all_bad.jsonl"  # every reply kept: `prompts` rows must end with a user turn
    all_bad.write_text("".join(json.dumps({"sample_id": i, "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}) + "\n" for i in range(300)))
    datasets = [{"name": "good", "path": "builtin:b1_glaive"},
                {"name": "sg", "path": str(wrong_format), "format": "openai"},
                {"name": "replies", "path": str(all_bad)}]
    probs = ready_problems(_params(tmp_path, datasets), ["01_generate"])
    assert probs == [
        f"datasets.1 (sg, format openai): {wrong_format}: the first rows are not format `openai`: format `openai` "
        "reads `messages`; the row has conversations, id; it looks like format sharegpt or openthoughts",
        f"datasets.2 (replies, format prompts): {all_bad}: the first 200 rows are all rejected as format `prompts` "
        f"(first: {all_bad}:1: field `messages` must end with a user or tool turn, ends with 'assistant'); "
        "it looks like format openai or ultrachat or mixture_of_thoughts"], probs
    res = subprocess.run([sys.executable, "-m", "eagle3data", "run", "params/ci.yaml", "--only", "01",
                          "-p", "output_root", str(tmp_path / "out"), "-p", "datasets", json.dumps(datasets)],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"error: {'; '.join(probs)}", res.stderr
    assert not (tmp_path / "out" / "ci").exists()  # nothing started
    # a file whose first rows are good passes: the preflight reads a bounded sample, not the whole file
    late = tmp_path / "late.jsonl"
    late.write_bytes(b"".join(_line(i) for i in range(250)) + b"{cut\n" * 300)
    assert check_source(str(late)) is None and len(load_prompts(late).rejected) == 300


def test_a_dataset_folder_with_several_configs_and_no_subset_lists_them(tmp_path):
    repo = tmp_path / "Mixture-of-Thoughts"
    rows = [json.loads(line) for line in (FIX / "mixture_of_thoughts.jsonl").open()]
    for config in ("math", "code"):
        (repo / config).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), repo / config / "train-00000-of-00001.parquet")
    (repo / "README.md").write_text("---\nlicense: apache-2.0\nconfigs:\n"
                                    "- config_name: math\n  data_files:\n  - split: train\n    path: math/train-*\n"
                                    "- config_name: code\n  data_files:\n  - split: train\n    path: code/train-*\n"
                                    "---\n# Mixture-of-Thoughts\n")
    want = (f"{repo}: the dataset has 2 configs and no `subset` is set: set the dataset's `subset` param to one of "
            "math, code")
    assert check_source(str(repo), "mixture_of_thoughts") == want
    with pytest.raises(PromptDataError) as e:  # the `datasets` library's own error, caught and said the same way
        load_prompts(repo, format="mixture_of_thoughts")
    assert str(e.value) == want
    params = _params(tmp_path, [{"name": "mot", "path": str(repo), "format": "mixture_of_thoughts"}])
    probs = ready_problems(params, ["01_generate"])
    assert probs == [f"datasets.0 (mot, format mixture_of_thoughts): {want}"]
    res = _prompts_cmd(repo, "mixture_of_thoughts")
    assert res.returncode == 2 and res.stderr.strip() == f"error: {want}" and not res.stdout, res.stdout + res.stderr
    assert "one of math, code" in check_source(str(repo), "mixture_of_thoughts", subset="all")
    assert check_source(str(repo), "mixture_of_thoughts", subset="code") is None
    assert len(load_prompts(repo, format="mixture_of_thoughts", subset="code").prompts) == len(rows)


def _openthoughts_repo(tmp_path: Path, names: tuple[str, str], suffix: str) -> tuple[Path, list[dict]]:
    """A downloaded repository laid out as OpenThoughts-114k's: config `names[0]` holds the prompts
    (data/), `names[1]` rows of another shape (metadata/), README configs without a `default:` flag."""
    repo = tmp_path / f"OpenThoughts-{names[0]}-{suffix}"
    rows = [json.loads(line) for line in (FIX / "openthoughts_114k.jsonl").open()]
    meta = [{"problem": f"p{i}", "deepseek_reasoning": "r", "domain": "math"} for i in range(5)]
    for folder, table in (("data", rows), ("metadata", meta)):
        (repo / folder).mkdir(parents=True)
        f = repo / folder / f"train-00000-of-00001.{suffix}"
        if suffix == "parquet":
            pq.write_table(pa.Table.from_pylist(table), f)
        else:
            f.write_text("".join(json.dumps(r) + "\n" for r in table))
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        f"- config_name: {names[0]}\n  data_files:\n  - split: train\n    path: data/train-*\n"
        f"- config_name: {names[1]}\n  data_files:\n  - split: train\n    path: metadata/train-*\n"
        "---\n# OpenThoughts-114k\n")
    return repo, rows


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_a_dataset_folder_with_a_default_config_reads_it_and_says_so(tmp_path, suffix, capsys):
    """Issue 43 item 3: `datasets.load_dataset` reads the config named `default` when none is named;
    so does the loader (the `metadata` config's rows are not read as prompts), and the preview names it."""
    repo, rows = _openthoughts_repo(tmp_path, ("default", "metadata"), suffix)
    assert check_source(str(repo), "openthoughts") is None
    ps = load_prompts(repo, format="openthoughts")
    assert (ps.rows, len(ps.prompts), ps.config) == (len(rows), len(rows), "default"), ps.skipped
    assert "config 'default' of default, metadata (its default config" in ps.summary()[0]
    res = _prompts_cmd(repo, "openthoughts")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{repo} (format openthoughts, config 'default' of default, metadata (its default config, as `datasets` " \
           f"reads it; set `subset` for another)): {len(rows)} rows -> {len(rows)} prompts" in res.stdout, res.stdout
    params = _params(tmp_path, [{"name": "ot", "path": str(repo), "format": "openthoughts"}])
    assert ready_problems(params, ["01_generate"]) == []
    _check_prompt_sets(params, {"ot": ps})  # what 01 prints before it starts
    assert capsys.readouterr().out == f"prompts ot: {ps.config_note}\n"
    # another config by name is read instead (and these rows are not of the format: all rejected)
    why = check_source(str(repo), "openthoughts", subset="metadata")
    assert why.startswith(f"{repo / 'metadata' / f'train-00000-of-00001.{suffix}'}") and "reads `conversations`" in why
    # without a config named (or flagged) default the refusal lists them, as before
    other, _ = _openthoughts_repo(tmp_path, ("main", "metadata"), suffix)
    want = (f"{other}: the dataset has 2 configs and no `subset` is set: set the dataset's `subset` param to one of "
            "main, metadata")
    assert check_source(str(other), "openthoughts") == want
    res = _prompts_cmd(other, "openthoughts")
    assert res.returncode == 2 and res.stderr.strip() == f"error: {want}" and not res.stdout, res.stdout + res.stderr
    assert len(load_prompts(other, format="openthoughts", subset="main").prompts) == len(rows)
