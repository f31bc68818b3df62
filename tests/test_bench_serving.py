"""``benchmarks/bench_serving.py``'s bound arithmetic and its argument checks, against values
worked out by hand (the engine runs themselves are measurements, not tests)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "bench_serving.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("s, bound", [(0.0, 1.0), (0.5, 4 / 3), (0.8, 2 / 1.2), (1.0, 2.0)],
                         ids=["none-skipped", "half", "80pct", "all"])
def test_attention_bound_is_two_over_two_minus_s(s, bound):
    assert bench.attention_bound(s) == pytest.approx(bound)


@pytest.mark.parametrize("f, bound, step", [
    (1.0, 4 / 3, 4 / 3),               # all of the step is attention: the step gains what attention gains
    (0.0, 2.0, 1.0),                   # no attention: nothing to gain
    (0.5, 4 / 3, 1 / (1 - 0.5 * 0.25)),  # half the step, attention 4/3: 1 / 0.875
    (0.25, 2.0, 1 / (1 - 0.25 * 0.5)),
], ids=["all-attention", "no-attention", "half-at-4/3", "quarter-at-2"])
def test_step_bound_is_amdahl_of_the_attention_bound(f, bound, step):
    assert bench.step_bound(f, bound) == pytest.approx(step)


def test_unknown_inputs_give_no_bound():
    assert bench.attention_bound(None) is None and bench.step_bound(None, 1.5) is None and bench.step_bound(0.3, None) is None


def test_phase_timings_takes_the_least_disturbed_repeat_and_sums_counts():
    runs = [{"window": {"decode": [2.0, 0.5, 8]}, "decoded": 8, "counts": {"decode": [10, 40]}},
            {"window": {"decode": [1.5, 0.4, 8]}, "decoded": 8, "counts": {"decode": [30, 40]}}]
    t = bench.phase_timings(runs, "decode")
    assert (t["wall"], t["attn"], t["walls"]) == (1.5, 0.4, [2.0, 1.5])
    assert t["sparsity"] == pytest.approx(40 / 80)


@pytest.mark.parametrize("text, parsed", [("2048:1", [(2048, 1)]), ("2048:1, 8192:4", [(2048, 1), (8192, 4)]),
                                          ("4096", [(4096, 1)])], ids=["one", "two", "default-n"])
def test_workloads_parse(text, parsed):
    assert bench.parse_workloads(text) == parsed


@pytest.mark.parametrize("text", ["2048x1", "8:1", "2048:0", ","], ids=["bad-separator", "too-short", "no-seqs", "empty"])
def test_bad_workloads_are_refused_with_the_expected_form(text):
    with pytest.raises(SystemExit, match="LEN"):
        bench.parse_workloads(text)


def _child(walls, load=1.0):
    return {"init_s": 5.0, "layers": [30, 30], "load_during": [load],
            "workloads": [{"name": "2048x1", "num_seqs": 1, "prompt_tokens": 2042,
                           "runs": [{"window": {"decode": [w, 0.5, 32]}, "decoded": 32, "counts": {"decode": [10, 40]}}
                                    for w in walls]}]}


def test_rounds_pool_every_repeat_and_the_best_is_taken_over_all():
    """Round 1's repeats 2.1 / 2.0 s, round 2's 1.8 / 1.9 s: the pooled config's decode is round 2's 1.8 s, and the
    sparsity counts all four runs."""
    pooled = bench.pool_rounds(_child([2.1, 2.0], load=1.5), _child([1.8, 1.9], load=0.5))
    t = bench.phase_timings(pooled["workloads"][0]["runs"], "decode")
    assert (t["wall"], t["walls"]) == (1.8, [2.1, 2.0, 1.8, 1.9])
    assert t["sparsity"] == pytest.approx(40 / 160) and pooled["load_during"] == [1.5, 0.5]


def test_rounds_of_other_workloads_are_refused():
    other = _child([1.0])
    other["workloads"][0]["name"] = "8000x1"
    with pytest.raises(ValueError, match="different workloads"):
        bench.pool_rounds(_child([1.0]), other)


def test_the_v_tile_fraction_is_the_kernels_union_count_and_absent_where_not_counted():
    """Counts [skipped, visited, v_tested, v_skipped] (the compiled CPU kernel's): 40 of 80 tiles skipped per head,
    6 of 20 (KV head, tile) pairs with V unread; an older two-count record has no V fraction."""
    counted = [{"window": {"decode": [1.0, 0.5, 8]}, "decoded": 8, "counts": {"decode": [40, 80, 20, 6]}}]
    t = bench.phase_timings(counted, "decode")
    assert t["sparsity"] == pytest.approx(0.5) and t["v_sparsity"] == pytest.approx(0.3)
    old = [{"window": {"decode": [1.0, 0.5, 8]}, "decoded": 8, "counts": {"decode": [40, 80]}}]
    assert bench.phase_timings(old, "decode")["v_sparsity"] is None


def test_decode_is_timed_by_the_median_step_of_all_repeats_so_one_preempted_step_does_not_move_it():
    # 8 steps of 0.10 s (attention 0.03 s) per repeat; one step of each repeat was preempted (1 s, 0.5 s), so the
    # least disturbed repeat's sum (1.2 s) is still 50 % over the steady 0.8 s
    steady = [(0.10, 0.03)] * 7
    runs = [{"window": {"decode": [1.7, 0.24, 8]}, "decode_steps": [(1.0, 0.03)] + steady, "decoded": 8,
             "counts": {"decode": [10, 40]}},
            {"window": {"decode": [1.2, 0.24, 8]}, "decode_steps": steady + [(0.5, 0.03)], "decoded": 8,
             "counts": {"decode": [10, 40]}}]
    t = bench.phase_timings(runs, "decode")
    assert t["wall"] == pytest.approx(0.8) and t["attn"] == pytest.approx(0.24)
    assert t["walls"] == [1.7, 1.2]  # every repeat's sum is still reported


def test_prefill_stays_the_least_disturbed_repeat_even_where_decode_steps_are_recorded():
    runs = [{"window": {"prefill": [3.0, 1.0, 2]}, "decode_steps": [(0.1, 0.03)], "decoded": 1, "counts": {}},
            {"window": {"prefill": [2.5, 0.9, 2]}, "decode_steps": [(0.1, 0.03)], "decoded": 1, "counts": {}}]
    t = bench.phase_timings(runs, "prefill")
    assert (t["wall"], t["attn"]) == (2.5, 0.9)


def test_model_sections_keep_the_checkpoints_curves_and_targets_and_switch_skipping_off(tmp_path):
    """--section model: plugin-sparse serves the checkpoint's own curves (both kinds, its target classes) at the
    run's targets; plugin-dense the same classes with every a at 1e-9 (lambda ~ 0: nothing skipped)."""
    import json

    from sparse_attn.config.parse import parse_sparse_attention_config

    section = {"config_groups": {"group_0": {
        "algorithm": "skip_softmax", "targets": ["Gemma3Attention"],
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 4.0, "b": 9.0},
                                   "decode": {"a": 0.006, "b": 9.1}},
        "sliding_window_threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                                  "prefill": {"a": 5.4, "b": 9.2}, "decode": {"a": 0.09, "b": 10.1}},
        "target_sparsity": {"prefill": 0.5, "decode": 0.5}}}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "sparse_attention_config": section}))
    dense, sparse = bench.model_sections(tmp_path, (0.7, 0.6))
    got = parse_sparse_attention_config(sparse).group
    assert got.targets == ("Gemma3Attention",) and dict(got.target_sparsity) == {"prefill": 0.7, "decode": 0.6}
    assert (got.fits["prefill"].a, got.fits["decode"].b, got.window_fits["decode"].a) == (4.0, 9.1, 0.09)
    off = parse_sparse_attention_config(dense).group
    assert off.targets == ("Gemma3Attention",)
    assert {f.a for f in (*off.fits.values(), *off.window_fits.values())} == {1e-9}


def test_model_sections_refuse_a_checkpoint_without_a_section(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SystemExit, match="has no sparse_attention_config; calibrate it first"):
        bench.model_sections(tmp_path, (0.5, 0.5))


@pytest.mark.parametrize("argv, shown", [
    (["--model", "/data/m", "--plot", "/data/run.png", "--repeats", "2"],
     ["--model", "CKPT", "--plot", "PNG", "--repeats", "2"]),
    (["--workdir=/data/w", "--results=/data/r.md"], ["--workdir=DIR", "--results=FILE"]),
], ids=["separate-values", "equals-values"])
def test_the_reported_command_shows_no_path_of_this_machine(argv, shown):
    assert bench._placeholders(argv) == shown


def _engine_output(prefill_s, decode_step_s, attn_share, counts=(0, 0, 0, 0), tokens=(7, 8, 9)):
    """One config's child output as the engine run writes it: one workload of one 2048-token sequence, two repeats,
    4 decode steps each."""
    run = {"window": {"prefill": [prefill_s, prefill_s * attn_share, 1],
                      "decode": [decode_step_s * 4, decode_step_s * 4 * attn_share, 4]},
           "decode_steps": [[decode_step_s, decode_step_s * attn_share]] * 4, "decoded": 4,
           "tokens": [list(tokens)], "counts": {"prefill": list(counts), "decode": list(counts)}}
    return {"init_s": 1.0, "layers": [30], "load_during": [1.0, 1.0, 1.0], "worker_threads": [1, "{0}"],
            "plugin_tree": None,
            "workloads": [{"name": "2048x1", "num_seqs": 1, "prompt_tokens": 2048, "runs": [run, dict(run)]}]}


def test_report_only_renders_the_bound_table_from_a_workdirs_engine_outputs(tmp_path, capsys):
    """The whole report path of a --decode-timing steps run, no engine started: the three configs' outputs of an
    earlier run in --workdir give the bound table, its summary.json and the results file, with the numbers worked
    out by hand (native 1.0 s prefill and 50 ms decode steps; own dense 1.25 s / 62.5 ms; at target 1.0 s / 50 ms
    with half the V tiles of a KV group unread)."""
    import json

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30,
                                                  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                                                  "max_position_embeddings": 8192}))
    work = tmp_path / "work"
    work.mkdir()
    (work / "prompts.json").write_text("[]")
    (work / "native.json").write_text(json.dumps(_engine_output(1.0, 0.05, 0.4)))
    (work / "plugin-dense.json").write_text(json.dumps(_engine_output(1.25, 0.0625, 0.5)))
    (work / "plugin-sparse.json").write_text(json.dumps(_engine_output(1.0, 0.05, 0.4, counts=(60, 100, 50, 25),
                                                                       tokens=(7, 8, 0))))
    results = tmp_path / "results.md"
    assert bench.main(["--report-only", "--workdir", str(work), "--model", str(ckpt), "--workloads", "2048:1",
                       "--decode-tokens", "4", "--results", str(results), "--prefill-target", "0.5",
                       "--decode-target", "0.5"]) == 0
    table = json.loads((work / "summary.json").read_text())["bound_table"]
    decode = next(r for r in table if r["phase"] == "decode")
    assert decode["s"] == pytest.approx(0.5) and decode["s_head"] == pytest.approx(0.6)
    assert decode["attention_bound"] == pytest.approx(4 / 3)
    # attention: 4 x 62.5 ms x 0.5 own dense against 4 x 50 ms x 0.4 at target
    assert decode["attention_achieved"] == pytest.approx(0.125 / 0.08)
    assert decode["step_achieved"] == pytest.approx(1.25)
    text = results.read_text()
    command = next(line for line in text.splitlines() if line.startswith("Command:"))
    assert "--report-only" not in command and "Reported afterwards" in text
    assert "| 2048 tok x 1 | decode | 20.0 | 16.0 (0.80x) | 20.0 (1.00x) |" in text
    assert "| plugin-sparse | 2048 tok x 1 |" in text and "2/3 |" in text  # greedy tokens equal to native's


def test_report_only_without_an_earlier_runs_outputs_says_so(tmp_path):
    import json

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192}))
    with pytest.raises(SystemExit, match=r"no engine output native\.json in --workdir .* run without --report-only"):
        bench.main(["--report-only", "--workdir", str(tmp_path / "empty"), "--model", str(ckpt),
                    "--workloads", "2048:1"])


@pytest.mark.parametrize("cores, threads, places", [("0", "1", "{0}"), ("0-1", "2", "{0,1}"), ("2,0-1", "3", "{0,1,2}")],
                         ids=["one-core", "range", "list-and-range"])
def test_worker_cores_are_the_engines_threads_exactly(cores, threads, places):
    """--worker-cores 0-1 runs the engine's OpenMP threads on cores 0 and 1 (it had kept one back for a scheduler,
    as `vllm serve` does, so 0-1 ran one thread); without it, what `vllm serve`'s worker gets."""
    assert bench.worker_env(cores) == {"OMP_NUM_THREADS": threads, "OMP_PLACES": places, "OMP_PROC_BIND": "true"}
    from compat import launch

    assert bench.worker_env(None) == launch.served_cpu_worker_env()


def test_the_report_says_where_the_worker_threads_came_from():
    results = {"native": {"worker_threads": [2, "{0,1}"]}, "plugin-dense": {"worker_threads": [2, "{0,1}"]}}
    assert bench.env_threads(results, "0-1") == "2 on cores {0,1} (--worker-cores 0-1)"
    assert bench.env_threads(results) == "2 on cores {0,1} (what vllm serve's worker gets here)"
