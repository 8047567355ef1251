"""The share of reference samples that the official DPH-RL scripts train as policy gradient.

The official trainer appends its 256 preserved samples after the 2,048 rollouts of a step, splits
the batch into contiguous chunks, one per data-parallel rank, and each rank's chunk into contiguous
mini-batches (`ppo_mini_batch_size` x n / ranks samples). With dynamic batch sizes (the fork's
default, left on by the js and alpha scripts) a mini-batch's micro-batches are token-balanced
partitions of its samples, each kept in index order, and a micro-batch's loss is decided by its
first sample's type. So on the rank where rollouts end and preserved samples begin, a mini-batch
holding both trains its preserved samples as policy gradient wherever a rollout heads their
micro-batch: at A = +1 against pi_0 (`losses.reference_pg`).

`official_pg_share` counts the preserved samples in such mixed mini-batches: the share when every
micro-batch of a mixed mini-batch holds a rollout (it has far fewer micro-batches than rollouts at
the scripts' token budget), an upper bound otherwise. At the scripts' settings it is 0.375 on 8
GPUs and 0.125 on 16.
"""

from __future__ import annotations


def official_pg_share(n_fresh: int = 2048, n_reference: int = 256, ranks: int = 8,
                      mini_batch: int = 64 * 16) -> float:
    """Preserved samples in mini-batches that also hold rollouts, over all preserved samples.
    Defaults: the scripts' 128 prompts x 16 rollouts, one 256-sample chunk, ppo_mini_batch_size 64."""
    total = n_fresh + n_reference
    if total % ranks or mini_batch % ranks:
        raise ValueError(f"{total} samples and mini-batches of {mini_batch} do not split over {ranks} ranks")
    per_rank, per_mini = total // ranks, mini_batch // ranks
    mixed = 0
    for rank in range(ranks):
        for start in range(rank * per_rank, (rank + 1) * per_rank, per_mini):
            end = min(start + per_mini, (rank + 1) * per_rank)
            fresh = max(0, min(end, n_fresh) - start)
            if 0 < fresh < end - start:
                mixed += end - start - fresh
    return mixed / n_reference
