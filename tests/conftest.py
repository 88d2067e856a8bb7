"""Tiny random-weight checkpoints of every supported family, written with save_pretrained and
loaded by ragkv through its real loader; HF transformers loads the same directory as the
reference."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Check the scheduler's invariants after every step, in-process and in served subprocesses.
os.environ.setdefault("RAGKV_DEBUG_CHECKS", "1")
# Tests compare against float32 references on the CPU; only GPU tests (marked `gpu`) ask for
# CUDA by name. Without a GPU, Triton kernels run through Triton's interpreter.
os.environ.setdefault("RAGKV_DEVICE", "cpu")
# Engines with sequential positions load their model's calibrated recompute profile from the
# profile directory: the tests' is empty, so a profile a developer calibrated never changes
# what a test computes (tests of profiles point it elsewhere).
os.environ.setdefault("RAGKV_PROFILE_DIR", tempfile.mkdtemp(prefix="ragkv-test-profiles-"))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ.get("TRITON_INTERPRET") == "1":
    # Its import makes Triton's interpreter work with NumPy >= 2.4 (_patch_interpreter),
    # before any test's kernels (the quantized ones included) run.
    import ragkv.model.backends.triton_kernels  # noqa: F401
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

VOCAB = 4096
_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama_linear_bias": ("LlamaConfig", {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "attention_bias": True, "mlp_bias": True}),
    "llama3": ("LlamaConfig", {
        "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                            "rope_theta": 500000.0}}),
    "yarn": ("LlamaConfig", {
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 128, "rope_theta": 10000.0}}),
    "dynamic": ("LlamaConfig", {
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    # Every layer sees the last 24 positions.
    "mistral_window": ("MistralConfig", {"sliding_window": 24}),
    # Two sliding layers (window 16, RoPE base 10k) and a full one (1M), Gemma's norms,
    # scaled embedding, attention scale and final soft-capping.
    "gemma3": ("Gemma3TextConfig", {
        "num_hidden_layers": 3, "head_dim": 32, "num_key_value_heads": 1,
        "sliding_window": 16, "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}}}),
}
FAMILIES["llama_gqa3"] = ("LlamaConfig", {  # SmolLM2's shape in small: 3 KV groups
    "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
    "intermediate_size": 131})  # split 66 + 65 over two ranks
MAIN_FAMILIES = ["llama", "llama_linear_bias", "llama3", "yarn", "mistral", "qwen2", "qwen3",
                 "mistral_window", "gemma3"]


def write_checkpoint(path: str, family: str, seed: int = 0) -> str:
    import transformers

    from ragkv.model.builtin import save_builtin_tokenizer

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Spread the weights (and make biases and norm scales non-trivial) so that the next-token
    # distribution is peaked enough for greedy decoding to be a sharp test.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)
    model.save_pretrained(path)
    save_builtin_tokenizer(path)
    return path


@functools.cache
def _checkpoint(root: str, family: str) -> str:
    path = os.path.join(root, family)
    if not os.path.isdir(path):
        write_checkpoint(path, family)
    return path


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="session")
def checkpoint(ckpt_root):
    """checkpoint(family) -> path of that family's tiny checkpoint (written once)."""
    return lambda family: _checkpoint(ckpt_root, family)


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def hf_model():
    return _hf_model


def random_prompt(n: int, seed: int, low: int = 10) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (n,), generator=gen).tolist()


@contextlib.contextmanager
def running_server(model: str, *args: str, env: dict | None = None):
    """A real `ragkv serve` process on a free loopback port; yields its base URL."""
    with server_process(model, *args, env=env) as (base, _):
        yield base


@contextlib.contextmanager
def server_process(model: str, *args: str, env: dict | None = None, log_path: str | None = None):
    """Like `running_server`, yielding (base URL, the Popen); with `log_path` the server's
    output goes to that file (readable while it runs) instead of a pipe."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ragkv", "serve", model, "--port", str(port),
         "--log-level", "warning", *args],
        env={**os.environ, **(env or {})}, stdout=log or subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                output = (pathlib.Path(log_path).read_text() if log_path
                          else proc.stdout.read().decode())
                raise RuntimeError(f"server exited: {output[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up")
            time.sleep(0.3)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not None:
            log.close()


def server_integrity(base: str, key: str | None) -> dict:
    """`/debug/integrity` of a test server; fails the test unless the report is ok."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{base}/debug/integrity", timeout=30, headers=headers)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["ok"], report
    return report


def server_wait_idle(base: str, key: str | None, timeout: float = 30) -> dict:
    """The integrity report once nothing runs or waits (or when the timeout is up)."""
    deadline = time.monotonic() + timeout
    while True:
        report = server_integrity(base, key)
        idle = report["num_running"] == 0 and report["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


@pytest.fixture
def redis_server():
    """A real `redis-server` on a free loopback port, without persistence; yields a handle
    with `.url`, `.stop()` and `.start()` (same port, empty again). Skips when redis-server
    is not installed, unless RAGKV_REQUIRE_REDIS=1 (CI installs it)."""
    from dependencies import missing
    from redis_server import RedisServer

    binary = RedisServer.find()
    if binary is None:
        missing("redis-server (or the redis package)",
                "apt-get install redis-server; pip install -e '.[test]'", "RAGKV_REQUIRE_REDIS")
    server = RedisServer(binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()
