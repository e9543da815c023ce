"""A CPU stand-in for `sgl_kernel`, first on a CPU SGLang server's path (sglang 0.5.23).

PyPI's sgl_kernel wheels hold CUDA objects only (sm90/sm100), and their `__init__` loads them,
so on a machine without a GPU `import sgl_kernel` fails. sglang's CPU path
(`SGLANG_USE_CPU_ENGINE=1`) imports a few `*_cpu` ops from it. This package answers those
imports: the op the CPU path calls is implemented in plain torch below; the ops that are imported
but never called on a CPU server without speculative decoding raise if they ever are. Every other
submodule (`sgl_kernel.scalar_type`, ...) still comes from the real package's Python files, whose
directory is added to this package's path.

Without `torch.ops.sgl_kernel.convert_weight_packed` sglang's Intel AMX backend stays off
(srt/utils/common.py `_is_intel_amx_backend_available`), so the server runs the plain torch
layers on every processor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _entry in sys.path:
    _real = Path(_entry or ".").resolve() / "sgl_kernel"
    if _real != _HERE and (_real / "__init__.py").is_file():
        __path__.append(str(_real))  # noqa: F821  (the package's own __path__)
        break


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    Called on every allocation (srt/mem_cache/allocation.py 746, imported at 45-46); the same
    computation as the Triton kernel `assign_req_to_token_pool` there (692-723): request b's
    slots `out_cache_loc[o_b : o_b + n_b]`, where n_b = end_offset[b] - start_offset[b] and o_b
    is the sum of the earlier requests' n, go to
    `req_to_token[req_pool_indices[b], start_offset[b] : end_offset[b]]`.

    Args:
        req_pool_indices: [B] row of each request in `req_to_token`.
        req_to_token: [rows, pool_len] table, written in place.
        start_offset, end_offset: [B] first and past-the-last position written per request.
        out_cache_loc: [sum n_b] the new slots, request after request.
        pool_len: Row length of `req_to_token` (the kernel's stride; checked here).
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token rows hold {req_to_token.shape[1]} slots, not {pool_len}")
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends, strict=True):
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start]
        offset += end - start


def _not_on_cpu(name: str, caller: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} (imported by sglang {caller}) has no CPU stand-in: Ember's CPU "
            "server runs without speculative decoding or KV-cache moves between layers"
        )

    op.__name__ = name
    return op


# Imported at module load but not called by a CPU server without speculative decoding:
copy_all_layer_kv_cache_cpu = _not_on_cpu(
    "copy_all_layer_kv_cache_cpu", "kernels/ops/kvcache/cache_move.py 9-10"
)
build_tree_kernel_efficient_cpu = _not_on_cpu(
    "build_tree_kernel_efficient_cpu", "kernels/ops/speculative/spec_tree.py 39-42"
)
verify_tree_greedy_cpu = _not_on_cpu(
    "verify_tree_greedy_cpu", "kernels/ops/speculative/spec_tree.py 43"
)
assign_draft_cache_locs_contiguous_cpu = _not_on_cpu(
    "assign_draft_cache_locs_contiguous_cpu", "kernels/ops/speculative/cache_locs.py 29"
)
assign_extend_cache_locs_cpu = _not_on_cpu(
    "assign_extend_cache_locs_cpu", "kernels/ops/speculative/cache_locs.py 30"
)
fill_accept_out_cache_loc_cpu = _not_on_cpu(
    "fill_accept_out_cache_loc_cpu", "kernels/ops/speculative/eagle.py 10"
)
fill_bonus_tokens_cpu = _not_on_cpu("fill_bonus_tokens_cpu", "kernels/ops/speculative/eagle.py 10")
