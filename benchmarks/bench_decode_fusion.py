"""What fusing a CPU decode step could save: the 30 post-attention blocks of SmolLM2 with packed
weights (residual add + RMSNorm, the packed gate/up matmul, silu * up, the packed down matmul)
for one decode row, run eagerly as the engine runs them and through `torch.compile` (inductor,
which needs a C++ compiler at run time), side by side in one process. The packed matmuls are
the same calls in both; the difference is the per-op overhead of the small ops around them.

    python benchmarks/bench_decode_fusion.py
"""

from __future__ import annotations

import time

import torch

from ragkv import LLM


def timed(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    llm = LLM("smollm2-135m-instruct", max_model_len=2048, quantization="gguf")
    layers = llm.engine.model.layers
    hidden = llm.engine.model_config.hidden_size

    def blocks(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in layers:
            h, residual = layer.post_attention_layernorm.forward_add(x, residual)
            x = layer.mlp.forward(h)
        return x, residual

    x, residual = torch.randn(1, hidden), torch.randn(1, hidden)
    mid = torch.randn(1, layers[0].mlp.intermediate)
    matmuls = timed(lambda: [(layer.mlp.gate_up_proj.forward(x), layer.mlp.down_proj.forward(mid))
                             for layer in layers])
    eager = timed(lambda: blocks(x, residual))
    print(f"{len(layers)} post-attention blocks, 1 decode row, ms per step:")
    print(f"  eager (as the engine runs them)   {eager:6.2f}")
    print(f"  their packed matmuls alone        {matmuls:6.2f}")
    compiled = torch.compile(blocks, dynamic=False)
    start = time.perf_counter()
    compiled(x, residual)
    print(f"  torch.compile                     {timed(lambda: compiled(x, residual)):6.2f}"
          f"  (compiled in {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
