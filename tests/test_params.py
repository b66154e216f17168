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
