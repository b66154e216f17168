"""Params: every shipped file validates; unknown keys and bad values name the file and key."""

from pathlib import Path

import pytest

from eagle3data.core.params import ParamsError, load_params

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_params_files_validate(path):
    p = load_params(path)
    assert p.run_name and p.datasets


def test_unknown_key_is_an_error_naming_file_and_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text((REPO / "params" / "ci.yaml").read_text().replace("batch_size: 4", "batch_sise: 4"))
    with pytest.raises(ParamsError) as e:
        load_params(f)
    assert str(f) in str(e.value) and "unknown key `generate.batch_sise`" in str(e.value)


def test_overrides_are_parsed_and_validated():
    p = load_params(REPO / "params" / "ci.yaml", {"generate.sampling.max_new_tokens": "7", "datasets.0.limit": "1"})
    assert p.generate.sampling.max_new_tokens == 7 and p.datasets[0].limit == 1
    with pytest.raises(ParamsError, match="generate.sampling.max_new_tokens"):
        load_params(REPO / "params" / "ci.yaml", {"generate.sampling.max_new_tokens": "-1"})
    with pytest.raises(ParamsError, match="unknown profile"):
        load_params(REPO / "params" / "ci.yaml", {"profile": "llama"})


def test_verify_positions_below_the_floors_are_refused():
    """04's verification at a cap below the floors its logit-z limits were measured at fails clean samples: a params
    error naming the key (also through `-p`), unless 04 verifies nothing."""
    ci = REPO / "params" / "ci.yaml"
    assert load_params(ci, {"hidden.verify_positions": "0"}).hidden.verify_positions == 0
    assert load_params(ci, {"hidden.verify_positions": "64"}).hidden.verify_positions == 64
    for k in ("1", "32", "63"):
        with pytest.raises(ParamsError, match=r"`hidden.verify_positions`: Value error, must be 0 \(every position\) "
                                              r"or at least 64"):
            load_params(ci, {"hidden.verify_positions": k})
    unverified = load_params(ci, {"hidden.verify_positions": 8, "hidden.verify_after": False})
    assert unverified.hidden.verify_positions == 8  # no verification of its own to judge at it


# targets no single GPU holds: 04 through a transformers forward would load ~1T parameters in one process
LARGER_THAN_ONE_GPU = {"kimi-k2.5"}


def test_every_params_file_for_a_target_larger_than_one_gpu_extracts_through_an_engine():
    files = sorted((REPO / "params").glob("*.yaml"))
    big = []
    for f in files:
        p = load_params(f)
        if p.profile in LARGER_THAN_ONE_GPU:
            big.append(f.name)
            assert p.hidden.backend != "hf", f"{f.name}: hidden.backend hf for {p.profile}: 04 needs a serving engine"
            v = p.hidden.vllm
            assert v is not None and v.server.tensor_parallel_size > 1, f"{f.name}: no multi-GPU engine settings"
    assert {"kimi_sglang.yaml", "kimi_openrouter.yaml", "kimi_vllm.yaml"} <= set(big)
