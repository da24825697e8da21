"""The resolved identity of a loaded model: what exactly answered a request.

A name like "smollm2-135m" says little; two files with that name can hold different weights, a
different tokenizer or a different chat template, and each changes the answer. So every loaded
model carries content hashes of all three, and the server returns them with every response
(and the prefix cache keys on `revision`, so a cache never serves another model's KV):

    identity = ModelIdentity.resolve("smollm2-135m", [gguf_path], tokenizer)
    identity.revision            # "sha256:<hex>" of the weights file(s) bytes
    identity.tokenizer_hash      # sha256 of the serialized tokenizer definition
    identity.chat_template_hash  # sha256 of the template text ("" when the model has none)

Quantization is part of what answers, so it is part of the revision: a model with int8
weights or a non-float32 KV cache has the revision
    "sha256:<hex>;quantization=int8-w-perchannel,kv=int8"
(`with_quantization`; the weights' descriptor comes from configs.quant_config, the KV part
from the engine's kv_dtype), while the float model with a float32 KV cache keeps the bare
content hash. Every response carries the revision and the prefix cache keys on it, so
neither a comparison nor a cached page ever mixes a quantized and an unquantized model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from models.errors import ModelLoadError

if TYPE_CHECKING:
    from models.tokenizer import Tokenizer

_CHUNK_BYTES = 1 << 20
_FALLBACK_ENGINE_VERSION = "0.0.0+unknown"


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    name: str  # what the user asked for: a preset name or the path given
    revision: str  # "sha256:<hex>" of the weights file(s), see file_content_hash
    tokenizer_hash: str  # Tokenizer.sha256
    chat_template_hash: str  # ChatTemplate.sha256, "" without a template
    engine_version: str  # pagedjax's installed version
    quantization: str = "none"  # weights: configs.quant_config descriptor
    kv_dtype: str = "float32"  # the KV cache's element type (set by the engine)
    # Speculative decoding, e.g. "ngram:k=4" (set by the engine; configs/spec_config.py).
    # Not part of the revision: speculation never changes what is sampled.
    speculative: str = "off"
    # LoRA: the adapter a response came from (engine.lora.adapters.request_identity); "" = base
    adapter: str = ""
    adapter_hash: str = ""  # "sha256:<hex>" of the adapter's files

    @classmethod
    def resolve(
        cls, name: str, weight_paths: Sequence[str | os.PathLike], tokenizer: Tokenizer
    ) -> ModelIdentity:
        """Identity of a model loaded from `weight_paths` with `tokenizer` (hashes the weights)."""
        return cls(
            name=name,
            revision=file_content_hash(weight_paths),
            tokenizer_hash=tokenizer.sha256,
            chat_template_hash=tokenizer.chat_template_sha256 or "",
            engine_version=engine_version(),
        )

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @property
    def content_revision(self) -> str:
        """The weights files' hash alone (the revision without its quantization part)."""
        return self.revision.split(REVISION_SEPARATOR, 1)[0]

    def with_quantization(
        self, quantization: str | None = None, kv_dtype: str | None = None
    ) -> ModelIdentity:
        """This identity with the weights' quantization descriptor and/or the KV dtype
        replaced, and the revision rewritten to name both (bare when both are default)."""
        quantization = self.quantization if quantization is None else quantization
        kv_dtype = self.kv_dtype if kv_dtype is None else kv_dtype
        return dataclasses.replace(
            self,
            revision=quantized_revision(self.content_revision, quantization, kv_dtype),
            quantization=quantization,
            kv_dtype=kv_dtype,
        )


REVISION_SEPARATOR = ";"


def quantized_revision(content_revision: str, quantization: str, kv_dtype: str) -> str:
    """`"sha256:<hex>;quantization=<descriptor>,kv=<dtype>"`, or the bare content revision
    for float weights with a float32 KV cache."""
    if quantization == "none" and kv_dtype == "float32":
        return content_revision
    return f"{content_revision}{REVISION_SEPARATOR}quantization={quantization},kv={kv_dtype}"


def file_content_hash(paths: Sequence[str | os.PathLike] | str | os.PathLike) -> str:
    """`"sha256:<hex>"`: a content revision of a checkpoint's weights file(s).

    One file: the sha256 of its bytes, the same hex `sha256sum FILE` prints, so a revision can be
    checked by hand; the file's name plays no part. Several files (sharded safetensors): the
    sha256 of `sha256sum`'s listing of them ("<hex>  <base name>\n" per file, sorted by name),
    so the order the caller lists them in does not matter but re-sharding does.

    Every byte is read (in 1 MiB chunks; no sampling, so any changed weight changes the
    revision): about 0.1-0.3 s for SmolLM2's 100 MB GGUF, about 2 s per GB. Hash once per load.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ModelLoadError("file_content_hash: no weight files given")
    if len(paths) == 1:
        return f"sha256:{_sha256_of_file(paths[0])}"
    listing = "".join(
        f"{_sha256_of_file(p)}  {os.path.basename(p)}\n"
        for p in sorted(paths, key=os.path.basename)
    )
    return f"sha256:{hashlib.sha256(listing.encode()).hexdigest()}"


def _sha256_of_file(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the weights to hash them ({e.strerror})") from e
    return digest.hexdigest()


def engine_version() -> str:
    """pagedjax's installed version, or a marker when it runs from a tree that is not installed."""
    try:
        return importlib.metadata.version("pagedjax")
    except importlib.metadata.PackageNotFoundError:
        return _FALLBACK_ENGINE_VERSION
