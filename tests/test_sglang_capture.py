"""04's SGLang client without a server: the layer ids in SGLang's convention, the params it refuses, the checks of a
reply, verify-hidden's SGLang recompute's refusals (tests/test_sglang_engine.py runs both on the real engine)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch

from eagle3data.core.errors import UserInputError
from eagle3data.core.params import load_params
from eagle3data.core.profiles import aux_layers
from eagle3data.generate.backends.retries import ResponseError
from eagle3data.hidden.engines.sglang_capture import aux_command, final_command, reply_rows, sglang_layer_ids

CI = Path(__file__).resolve().parents[1] / "params" / "ci.yaml"


def cfg(arch: str) -> SimpleNamespace:
    return SimpleNamespace(architectures=[arch])


def test_layer_ids_are_hf_indices_minus_one_except_deepseeks_first_id_rule():
    assert sglang_layer_ids(aux_layers(30), cfg("LlamaForCausalLM")) == [1, 14, 26]  # HF [2, 15, 27], probed: X -> X+1
    assert sglang_layer_ids(aux_layers(61), cfg("KimiK25ForConditionalGeneration")) == [1, 29, 57]  # first id 1: +1
    assert sglang_layer_ids(aux_layers(61), None) == [1, 29, 57]
    custom = SimpleNamespace(num_layers=30, hf_indices=(3, 15, 27), layer_outputs=(2, 14, 26))
    assert sglang_layer_ids(custom, cfg("LlamaForCausalLM")) == [2, 14, 26]
    assert sglang_layer_ids(custom, cfg("DeepseekV3ForCausalLM")) == [3, 15, 27]  # read as HF indices as they are
    low = SimpleNamespace(num_layers=30, hf_indices=(1, 15, 27), layer_outputs=(0, 14, 26))
    with pytest.raises(UserInputError, match="cannot be named"):
        sglang_layer_ids(low, cfg("DeepseekV3ForCausalLM"))


def test_params_refuse_a_final_state_sglang_cannot_give_and_a_missing_server():
    with pytest.raises(UserInputError, match="after the norm only: final_state is 'both'"):
        load_params(CI, {"hidden.backend": "sglang", "hidden.sglang": {"launch": True}})
    with pytest.raises(UserInputError, match="two servers"):
        load_params(CI, {"hidden.backend": "sglang", "hidden.final_state": "post_norm",
                         "hidden.sglang": {"base_url": "http://127.0.0.1:1"}})
    with pytest.raises(UserInputError, match="needs a `hidden.sglang` section"):
        load_params(CI, {"hidden.backend": "sglang", "hidden.final_state": "post_norm"})
    p = load_params(CI, {"hidden.backend": "sglang", "hidden.final_state": "post_norm",
                         "hidden.sglang": {"launch": True, "server": {"port": 0}}})
    layers = aux_layers(30)
    aux, final = aux_command(p, layers, cfg("LlamaForCausalLM")), final_command(p)
    for cmd in (aux, final):  # the radix cache is off on both, whatever server.radix_cache says
        assert "--disable-radix-cache" in cmd.argv and cmd.env == {"SGLANG_USE_CPU_ENGINE": "1"}
    assert aux.argv[-7:] == ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                             "--return-aux-hidden-state-layer-ids", "1", "14", "26"]
    assert final.argv[-1] == "--enable-return-hidden-states" and "--enable-return-aux-hidden-states" not in final.argv


def reply(n: int, width: int, **meta) -> bytes:
    rows = [[0.5] * width for _ in range(n)]
    return orjson.dumps({"text": "", "output_ids": [7], "meta_info": {"prompt_tokens": n, "cached_tokens": 0,
                                                                     "hidden_states": [rows, [0.1] * width], **meta}})


def test_a_reply_is_taken_only_when_it_holds_exactly_the_samples_rows():
    assert reply_rows(reply(5, 6), 5, 6).shape == (5, 6)  # the prefill block; the decode step's row is not a state
    with pytest.raises(ResponseError, match="cached_tokens 3: a radix-cache hit"):
        reply_rows(reply(5, 6, cached_tokens=3), 5, 6)
    with pytest.raises(ResponseError, match="prompt_tokens 4 for the 5 ids sent"):
        reply_rows(reply(5, 6, prompt_tokens=4), 5, 6)
    with pytest.raises(ResponseError, match=r"shape \[5, 2\], expected \[5, 6\]"):
        reply_rows(reply(5, 2), 5, 6)  # the other pass's server
    with pytest.raises(ResponseError, match="no meta_info.hidden_states"):
        reply_rows(orjson.dumps({"meta_info": {"prompt_tokens": 5, "cached_tokens": 0}}), 5, 6)
    bad = orjson.loads(reply(2, 3))
    bad["meta_info"]["hidden_states"][0][1][2] = None
    with pytest.raises(ResponseError):
        reply_rows(orjson.dumps(bad), 2, 3)
    with pytest.raises(ResponseError, match="not JSON"):
        reply_rows(b"{", 2, 3)


def test_print_engine_command_gives_both_passes_servers_and_01s(capsys):
    from eagle3data.cli import print_engine_command

    p = load_params(CI, {"hidden.backend": "sglang", "hidden.final_state": "post_norm",
                         "hidden.sglang": {"launch": True}, "generate.backend": "sglang",
                         "generate.sglang": {"launch": True}})
    assert print_engine_command(p, "04_extract_hidden") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# pass 1 (aux states):" and out[2] == "# pass 2 (final state, after the norm):"
    assert out[1].endswith("--return-aux-hidden-state-layer-ids 1 14 26") and "-m sglang.launch_server" in out[1]
    assert out[3].endswith("--disable-radix-cache --enable-return-hidden-states")
    assert print_engine_command(p, "01_generate") == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("SGLANG_USE_CPU_ENGINE=1 ") and "--disable-radix-cache" not in line  # 01 keeps its cache


def test_the_sglang_recompute_refuses_in_one_line_naming_the_pass_and_the_server(tmp_path):
    """verify-hidden's `sglang` backend (verify/sglang.py): a server that does not answer is one VerifyError naming the
    pass and its URL, and the scratch folder is gone after `close()`; a sequence `prepare` was not given is refused;
    a store SGLang cannot have made (a pre-norm state), or a run without `hidden.sglang`, is refused up front."""
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.verify.checks import VerifyError
    from eagle3data.hidden.verify.sglang import sglang_backend

    p = load_params(CI, {"output_root": str(tmp_path), "hidden.backend": "sglang", "hidden.final_state": "post_norm",
                         "hidden.sglang": {"base_url": "http://127.0.0.1:9", "final_url": "http://127.0.0.1:10",
                                           "max_retries": 0}})
    hidden_dir(p).mkdir(parents=True)
    info = {"states": ["aux_low", "aux_mid", "aux_high", "post_norm"], "dtype": "bfloat16", "hidden_size": 8,
            "hf_indices": [2, 15, 27]}
    redo = sglang_backend(p, info, cfg("LlamaForCausalLM"), aux_layers(30))()
    with pytest.raises(VerifyError, match=r"^recompute via SGLang, aux pass \(server http://127.0.0.1:9\): .*"
                                          "unreachable") as e:
        redo.prepare([[1, 2, 3], [1, 2, 3]])
    assert "\n" not in str(e.value)
    with pytest.raises(VerifyError, match="a sequence of 3 ids that prepare\\(\\) was not given"):
        redo.run(torch.tensor([[1, 2, 3]]))
    redo.close()
    assert not list(hidden_dir(p).iterdir())
    with pytest.raises(VerifyError, match=r"holds \['aux_low', 'aux_mid', 'aux_high', 'pre_norm'\]"):
        sglang_backend(p, {**info, "states": ["aux_low", "aux_mid", "aux_high", "pre_norm"]}, None, aux_layers(30))
    with pytest.raises(VerifyError, match="needs the run's `hidden.sglang` section"):
        sglang_backend(load_params(CI), info, None, aux_layers(30))


HEALTHY = """import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
print(sys.argv[2], flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_relaunch_on_the_same_log_is_not_taken_for_dead_by_the_last_launchs_shutdown(tmp_path):
    """A launched server's log is appended to, and SGLang's normal shutdown writes "SIGQUIT received": a second launch
    on the same log (verify-hidden after 04's own verify, a rerun of 04) reads only its own lines for a dead scheduler."""
    import sys

    from eagle3data.core.errors import UserInputError as Refused
    from eagle3data.generate.backends.sglang_server import SGLangServer
    from eagle3data.generate.backends.vllm_server import EngineCommand, free_port

    log = tmp_path / "engine" / "sglang_verify_aux.log"
    log.parent.mkdir()
    log.write_text("[earlier launch] SIGQUIT received. signum=None, frame=None. It usually means one child failed.\n")
    port = free_port("127.0.0.1")
    ok = EngineCommand([sys.executable, "-c", HEALTHY, str(port), "up"], {}, f"http://127.0.0.1:{port}", log, 60)
    with SGLangServer(ok, progress=False) as srv:
        assert srv.dead_reason() is None
    port = free_port("127.0.0.1")
    dead = EngineCommand([sys.executable, "-c", "import sys, time; print(sys.argv[1], flush=True); time.sleep(60)",
                          "Scheduler hit an exception"], {}, f"http://127.0.0.1:{port}", log, 60)
    with pytest.raises(Refused, match="died before it was healthy \\(Scheduler hit an exception\\)"):
        SGLangServer(dead, progress=False).start()
