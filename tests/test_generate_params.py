"""Every params file under params/ validates; the Kimi files hold the settings the issue asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3data.core.params import ParamsError, load_params

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_params_file_validates(path):
    p = load_params(path)
    assert p.run_name and p.datasets


def test_kimi_files_carry_budgets_routing_and_caps():
    sg = load_params(REPO / "params" / "kimi_sglang.yaml")
    orr = load_params(REPO / "params" / "kimi_openrouter.yaml")
    for p in (sg, orr):
        assert p.profile == "kimi-k2.5" and p.model.trust_remote_code
        assert [d.name for d in p.datasets] == ["b1_glaive", "b2_opencodeinstruct", "b3_magicoder",
                                               "b4_mixturethoughts", "b5_openthoughts", "b6_ultrachat",
                                               "b7_sharegpt", "b8_sweagent"]
        assert all(d.token_budget == 10_000_000 for d in p.datasets)
        assert p.generate.concurrency == 2000
    assert sg.generate.backend == "sglang" and sg.generate.sglang.check_model
    o = orr.generate.openai
    assert orr.generate.backend == "openai" and o.model == "moonshotai/kimi-k2.5"
    assert o.api_key_env == "OPENROUTER_API_KEY" and orr.generate.cost_cap_usd
    assert o.provider.quantizations == ["int4"] and o.reasoning.exclude is False


def test_api_key_is_not_a_parameter():
    with pytest.raises(ParamsError, match="unknown key `generate.openai.api_key`"):
        load_params(REPO / "params" / "kimi_openrouter.yaml", {"generate.openai.api_key": "sk-x"})
