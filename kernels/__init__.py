"""Fused linear -> log-prob (+ entropy) kernels: Triton on GPU, a chunked torch path with the same semantics.

    logp, entropy = fused_logprobs(hidden, lm_head.weight, targets, temperature, mask, with_entropy=True)

The [N, V] logits are never materialised: vocabulary blocks, online log-sum-exp in fp32, and a
backward that recomputes each block's logits. It installs as `dph_async.kernels` (pyproject.toml's
package-dir mapping): the top-level name `kernels` is Hugging Face's, which transformers probes.
"""

from dph_async.kernels.fused import default_block_v, fused_logprobs

__all__ = ["default_block_v", "fused_logprobs"]
