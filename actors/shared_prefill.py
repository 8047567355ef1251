"""One prefill per prompt: a group's completions copy their prompt's KV from the first one computed.

vLLM shares prompt KV between requests only through its prefix cache, which holds full blocks
(never under 32 tokens on the CPU; 128 by default). A GRPO group's n completions of a shorter
prompt each compute the whole prompt again: n prefills where one would do, and on short
completions most of the tokens an engine step runs (docs/benchmarks.md). This connector uses
vLLM's KV-connector API (its hook for KV that comes from elsewhere) to let a waiting request whose
prompt and cache salt equal those of a running request that has computed them copy that request's
prompt blocks, and compute only its last prompt token (whose logits give its first token). The
copy is exact: the same cache rows.

The first request of a prompt leads; the others wait for it (the scheduler asks again next step)
until its first token is out, so its prompt KV is in the cache. A leader that finished or was
preempted before they were scheduled leads nothing: they compute their prompts themselves.

vLLM keeps one worker-side connector per process, and an actor process may build more than one
engine: so the copies are made on the scheduler's side, which the in-process engine core runs in
this process, on the caches of its own engine (`attach`), once a step is scheduled and before it
runs. The worker-side instance does nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

PromptKey = tuple[str | None, tuple[int, ...]]


def _key(request: Request) -> PromptKey:
    return request.cache_salt, tuple(request.prompt_token_ids or ())


class SharedPrefill(KVConnectorBase_V1):
    """The scheduler's instance plans and makes the copies; `enabled` off makes it a no-op."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # One cache group of plain attention, whose new blocks vLLM does not zero (it does for Mamba
        # states and mixed-precision caches, and would undo a copy): where the copies are sound.
        self.enabled = (bool(self._kv_transfer_config.get_from_extra_config("share", True))
                        and len(kv_cache_config.kv_cache_groups) == 1 and not kv_cache_config.needs_kv_cache_zeroing)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._caches: list[tuple[torch.Tensor, int]] = []  # each cache and its blocks' dimension
        self._leaders: dict[PromptKey, Request] = {}  # the request each prompt copies from
        self._src: list[int] = []  # this step's copies: block src[i] into dst[i], in every cache
        self._dst: list[int] = []
        self.copied_tokens = 0  # prompt tokens not computed again

    def attach(self, kv_caches: list[torch.Tensor]) -> None:
        """The engine's KV caches (one per layer), which the copies go into."""
        for i, cache in enumerate(kv_caches):
            # Blocks lead the CPU's layout ([blocks, heads, block, 2 x head]); K and V lead the GPU's.
            dims = [d for d in (0, 1) if cache.dim() > d and cache.shape[d] == self._num_blocks]
            if not dims:
                raise ValueError(f"KV cache {i} of shape {tuple(cache.shape)} has no dimension of "
                                 f"{self._num_blocks} blocks to copy prompts along")
            self._caches.append((cache, dims[0]))

    def on_new_request(self, request: Request) -> None:
        if self.enabled:
            self._leaders.setdefault(_key(request), request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        leader = self._leaders.get(_key(request)) if self.enabled and self._caches else None
        if leader is None or leader is request or leader.is_finished() or leader.num_preemptions > 0:
            # None, or its blocks are gone or hold other KV: this one computes its prompt. It leads no
            # one: were it to finish at its first token, the rest would wait a step per completion.
            return 0, False
        if leader.num_output_tokens == 0:
            return None, False  # its prompt is not computed yet: ask again next step
        return max(request.num_prompt_tokens - 1 - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        leader = self._leaders[_key(request)]
        assert self._kv_cache_manager is not None, "the scheduler binds its KV-cache manager first"
        src = self._kv_cache_manager.get_block_ids(leader.request_id)[0]
        dst = blocks.get_block_ids()[0]
        end = request.num_prompt_tokens - 1  # the copied tokens end here; the last is computed
        first, last = (end - num_external_tokens) // self._block_size, (end - 1) // self._block_size
        self._src += src[first:last + 1]
        self._dst += dst[first:last + 1]
        self.copied_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._src:
            device = self._caches[0][0].device  # one engine's caches share a device
            src, dst = torch.tensor(self._src, device=device), torch.tensor(self._dst, device=device)
            for cache, dim in self._caches:
                # Whole blocks, whatever the kernel's layout within one: rows past the copied
                # prompt are the leader's, and the request overwrites them before it reads them.
                cache.index_copy_(dim, dst, cache.index_select(dim, src))
            self._src, self._dst = [], []
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        key = _key(request)
        if self._leaders.get(key) is request:
            del self._leaders[key]
        return False, None

    # The worker's side: the copies are made above.

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
