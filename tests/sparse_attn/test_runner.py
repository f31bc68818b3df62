"""sparse_attn.calibration.runner with a fake engine (no vLLM).

The fake stands in for ``vllm.LLM``: ``generate`` and ``collective_rpc``. Its workers
record counts through the real :class:`sparse_attn.stats.WorkerStats` (what the adapter
does in counting mode), so ``collective_rpc`` returns real snapshots, one per worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from sparse_attn.workloads.prompts import CalibrationSample
from sparse_attn.calibration.fit import CalibrationError, SampleCounts, pool
from sparse_attn.calibration.runner import PHASES, Measurement, candidate_scales, measure, merge_worker_counts
from sparse_attn.stats import WorkerStats

RPC = "sparse_attn_stats"
SCALES = [0.1, 1.0, 10.0, 100.0]


# ------------------------------------------------------------ candidates ---- #
@pytest.mark.parametrize("max_kv_len,num", [(2064, 24), (100, 4), (32768, 10)], ids=["demo", "short", "long"])
def test_candidate_scales_are_geometric_up_to_the_longest_launch(max_kv_len, num):
    scales = candidate_scales(max_kv_len, num=num)
    assert len(scales) == num
    assert scales[0] == pytest.approx(1e-2) and scales[-1] == pytest.approx(0.95 * max_kv_len)
    ratios = [b / a for a, b in zip(scales, scales[1:])]
    assert all(r == pytest.approx(ratios[0]) for r in ratios) and ratios[0] > 1
    # the largest candidate is still a usable lambda (< 1) at the longest launch
    assert scales[-1] / max_kv_len < 1


@pytest.mark.parametrize("max_kv_len,num,match", [(0, 24, "too short"), (2048, 1, "at least 2"), (2048, True, "at least 2")],
                         ids=["no_tokens", "one_candidate", "bool"])
def test_candidate_scales_rejects(max_kv_len, num, match):
    with pytest.raises(CalibrationError, match=match):
        candidate_scales(max_kv_len, num=num)


# ------------------------------------------------------------ fake engine ---- #
@dataclass
class _Launch:
    phase: str
    kv_len: int
    skipped: list[int]  # per candidate, summed over this worker's heads
    tiles: int


class FakeLLM:
    """``generate`` runs a prefill and ``max_tokens - 1`` decode steps per prompt on every worker;
    worker ``w`` serves ``heads[w]`` heads (tensor parallel) and counts per candidate like the
    adapter: a candidate whose ``lambda = c / kv_len`` is >= 1 at a launch records nothing there."""

    def __init__(self, scales, heads=(2, 1), layers=2, windowed_layers=0, window=64):
        self.scales = list(scales)
        self.heads = heads
        self.layers = layers
        #: layers with a sliding window of ``window`` tokens: they count at c / min(kv_len, window)
        self.windowed_layers, self.window = windowed_layers, window
        self.workers = [WorkerStats(layers_installed=layers, layers_total=layers, owner_classes=("LlamaAttention",),
                                    install={"rank": rank, "installed": layers}) for rank in range(len(heads))]
        self.rpc_calls: list[tuple[str, dict]] = []
        self.params_seen: list = []
        for w in self.workers:  # warm-up launches (profiling) that calibration must discard
            w.add_candidates("prefill", [7] * len(self.scales), [9] * len(self.scales))

    @staticmethod
    def skipped_per_head(phase, kv_len, c, tiles, kind="global"):
        """Deterministic, phase-, length- and kind-dependent (windowed layers sparser at one c), increasing in c."""
        shift = 2.0 if kind == "windowed" else 0.0
        frac = min(1.0, max(0.0, (math.log(c) + shift + (4.0 if phase == "decode" else 2.0)) / 10.0 + 200.0 / kv_len))
        return int(frac * tiles)

    def launches(self, kv_len, new_tokens):
        tiles_prefill = -(-kv_len // 64) * (-(-kv_len // 64) + 1) // 2
        out = [("prefill", kv_len, tiles_prefill)]
        out += [("decode", kv_len + t, -(-(kv_len + t) // 64)) for t in range(1, new_tokens)]
        return out

    def generate(self, prompts, params, use_tqdm=True):
        assert len(prompts) == 1 and use_tqdm is False
        self.params_seen.append(params)
        prompt = prompts[0]
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else list(range(len(prompt.split())))
        for w, stats in zip(range(len(self.heads)), self.workers):
            for phase, kv_len, tiles in self.launches(len(ids), params.max_tokens):
                for kind, n, norm in (("global", self.layers, kv_len),
                                      ("windowed", self.windowed_layers, min(kv_len, self.window))):
                    for _ in range(n):
                        usable = [c / norm < 1.0 for c in self.scales]
                        skipped = [self.heads[w] * self.skipped_per_head(phase, kv_len, c, tiles, kind) if ok else 0
                                   for c, ok in zip(self.scales, usable)]
                        stats.add_candidates(phase, skipped, [self.heads[w] * tiles if ok else 0 for ok in usable], kind=kind)
        # the fields compat.offline.generate reads of a vllm RequestOutput
        return [SimpleNamespace(prompt_token_ids=list(ids), prompt_logprobs=None,
                                outputs=[SimpleNamespace(token_ids=[], text="", logprobs=None)])]

    def collective_rpc(self, method, kwargs=None):
        self.rpc_calls.append((method, dict(kwargs or {})))
        assert method == RPC
        return [w.snapshot(reset=bool((kwargs or {}).get("reset"))) for w in self.workers]

    def expected(self, kv_len, new_tokens, phase, kind="global"):
        """Independent reference: the counts of all workers, heads, layers (of ``kind``) and steps."""
        skipped, visited = [0] * len(self.scales), [0] * len(self.scales)
        layers = self.layers if kind == "global" else self.windowed_layers
        for ph, kv, tiles in self.launches(kv_len, new_tokens):
            if ph != phase:
                continue
            norm = kv if kind == "global" else min(kv, self.window)
            for j, c in enumerate(self.scales):
                if c / norm < 1.0:
                    skipped[j] += sum(self.heads) * layers * self.skipped_per_head(ph, kv, c, tiles, kind)
                    visited[j] += sum(self.heads) * layers * tiles
        return SampleCounts(tuple(skipped), tuple(visited), kv_len)


class _Progress:
    def __init__(self):
        self.n, self.postfix = 0, None

    def update(self, n):
        self.n += n

    def set_postfix(self, **kw):
        self.postfix = kw


def _samples():
    return [CalibrationSample(prompt_token_ids=tuple(range(300)), task="qa", target_len=512, num_tokens=300),
            CalibrationSample(prompt_token_ids=tuple(range(5)), task="qa", target_len=8, num_tokens=5),  # shorter than most scales
            CalibrationSample(prompt_token_ids=tuple(range(80)), task="niah", target_len=128, num_tokens=80)]


def test_measure_refuses_a_sample_without_token_ids():
    """calibrate measures check_lengths' token-id samples (compat.offline.generate takes token ids)."""
    with pytest.raises(CalibrationError, match="sample 0 \\(niah\\) has no token ids"):
        measure(FakeLLM(SCALES), [CalibrationSample(prompt="a b c", task="niah")], SCALES, decode_tokens=1, stats_rpc=RPC,
                sampling_params=SimpleNamespace(max_tokens=2))


def test_measure_sums_workers_per_sample_and_phase():
    llm = FakeLLM(SCALES)
    progress = _Progress()
    params = SimpleNamespace(max_tokens=4)  # prefill + 3 decode steps
    m = measure(llm, _samples(), SCALES, decode_tokens=3, stats_rpc=RPC, progress=progress, sampling_params=params)
    assert llm.params_seen == [params] * 3
    # the first RPC resets the warm-up counts; one reset per sample after it
    assert llm.rpc_calls == [(RPC, {"reset": True})] * 4
    assert m.scales == SCALES and m.layers_installed == [2, 2] and m.layers_total == [2, 2]
    assert m.owner_classes == ["LlamaAttention"]
    assert m.installs == [{"rank": 0, "installed": 2}, {"rank": 1, "installed": 2}], "each worker's summary, rank order"
    for phase in PHASES:
        assert m.samples[phase] == [llm.expected(300, 4, phase), llm.expected(5, 4, phase), llm.expected(80, 4, phase)]
    assert m.samples["prefill"][1].visited[2:] == (0, 0)  # c >= kv_len: no data, as serving runs it dense
    assert progress.n == 3 and progress.postfix == {"tokens": 80, "decode_steps": 3}
    assert m.points == {phase: pool(SCALES, m.samples[phase]) for phase in PHASES}
    report = m.counts_report()
    assert report["scales"] == SCALES
    assert report["samples"]["decode"][0] == {"kv_len": 300, "task": _samples()[0].task,
                                             "skipped": list(m.samples["decode"][0].skipped),
                                             "visited": list(m.samples["decode"][0].visited)}
    assert [s.task for s in m.samples["prefill"]] == [s.task for s in _samples()]


def test_measure_keeps_windowed_layers_counts_apart():
    """Counts of sliding-window layers (taken at c / min(kv_len, w)) go to their own kind, per sample and
    phase; the global curve's counts are those of the global layers alone."""
    llm = FakeLLM(SCALES, layers=1, windowed_layers=3, window=64)
    m = measure(llm, _samples(), SCALES, decode_tokens=3, stats_rpc=RPC, sampling_params=SimpleNamespace(max_tokens=4))
    assert m.kinds == ("global", "windowed")
    for phase in PHASES:
        assert m.samples[phase] == [llm.expected(n, 4, phase) for n in (300, 5, 80)]
        assert m.by_kind["windowed"][phase] == [llm.expected(n, 4, phase, "windowed") for n in (300, 5, 80)]
    # c = 100 >= w = 64: no windowed data at kv 300 although 100 / 300 < 1
    assert m.by_kind["windowed"]["prefill"][0].visited[3] == 0 and m.samples["prefill"][0].visited[3] > 0
    report = m.counts_report()
    assert report["samples_windowed"]["prefill"][0]["visited"] == list(m.by_kind["windowed"]["prefill"][0].visited)
    assert m.kind_points("windowed") == {p: pool(SCALES, m.by_kind["windowed"][p]) for p in PHASES}


def test_a_model_without_windows_has_no_windowed_kind():
    m = measure(FakeLLM(SCALES), _samples()[:1], SCALES, decode_tokens=0, stats_rpc=RPC,
                sampling_params=SimpleNamespace(max_tokens=1))
    assert m.kinds == ("global",) and "samples_windowed" not in m.counts_report()


def test_spread_by_task_pools_each_kind_at_the_scale():
    """At a candidate scale the pooled value is that kind's tiles skipped / visited; min..max over its prompts."""
    scales = [1.0, 2.0, 4.0]
    m = Measurement(scales=scales)
    m.samples["prefill"] = [SampleCounts(skipped=(10, 20, 30), visited=(100, 100, 100), task="qa"),
                            SampleCounts(skipped=(30, 60, 90), visited=(100, 100, 100), task="qa"),
                            SampleCounts(skipped=(5, 5, 5), visited=(50, 50, 50), task="niah")]
    spread = m.spread_by_task("prefill", 2.0)
    assert spread["qa"] == {"n": 2, "pooled": pytest.approx(80 / 200), "min": pytest.approx(0.2), "max": pytest.approx(0.6)}
    assert spread["niah"]["pooled"] == pytest.approx(0.1) and spread["niah"]["n"] == 1
    # between candidates: linear in ln(scale), as the fit interpolates
    assert m.spread_by_task("prefill", 2.0 ** 1.5)["qa"]["pooled"] == pytest.approx(0.5)


def test_measure_without_decode_has_no_decode_samples():
    llm = FakeLLM(SCALES)
    m = measure(llm, _samples()[:1], SCALES, decode_tokens=0, stats_rpc=RPC, sampling_params=SimpleNamespace(max_tokens=1))
    assert m.samples["decode"] == [] and m.samples["prefill"] == [llm.expected(300, 1, "prefill")]
    assert set(m.points) == {"prefill"}


def test_merge_worker_counts_rejects_a_worker_with_another_grid():
    a, b = WorkerStats(), WorkerStats()
    a.add_candidates("prefill", [1, 2], [3, 3])
    b.add_candidates("prefill", [1, 2, 3], [3, 3, 3])
    with pytest.raises(ValueError, match=r"\[2, 3\] candidate_skipped entries, expected 2"):
        merge_worker_counts([a.snapshot(), b.snapshot()], 2)
