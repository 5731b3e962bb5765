"""A DataLoader's sampling, re-expressed so that ddp_kit can shard it: the dataset to split, whether
it is shuffled, and the seed; or a one-line refusal of what cannot be split over ranks without
changing what is sampled (replacement, weights, num_samples, batch samplers, DistributedSampler)."""
from __future__ import annotations

from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from ..errors import UserError
from . import check_sized


def loader_sampling(loader: DataLoader, default_seed: int) -> tuple[Dataset, bool, int]:
    """(dataset to shard, shuffle, seed) that reproduce `loader`'s sampling; refuses what cannot be sharded.
    The seed is the loader's (or its sampler's) generator's, else `default_seed`."""
    check_sized(loader.dataset)
    yourself = "shard it yourself by run.rank and run.world_size and use that DataLoader without run.prepare"
    if loader.batch_size is None:
        if loader.batch_sampler is not None:
            raise UserError(f"the DataLoader has a batch_sampler ({type(loader.batch_sampler).__name__}): ddp_kit "
                            f"builds the batches itself to split each one over ranks",
                            f"pass batch_size (the global batch) and shuffle instead, or {yourself}")
        raise UserError("the DataLoader has batch_size=None (no batching): ddp_kit splits whole batches over ranks",
                        "pass batch_size (the global batch)")
    sampler = loader.sampler
    generator = getattr(sampler, "generator", None) or loader.generator
    seed = generator.initial_seed() % 2**63 if generator is not None else default_seed
    kind = type(sampler)
    if kind is SequentialSampler:
        return loader.dataset, False, seed
    if kind is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return loader.dataset, True, seed
    if kind is SubsetRandomSampler:
        return Subset(loader.dataset, [int(i) for i in sampler.indices]), True, seed
    if isinstance(sampler, DistributedSampler):
        raise UserError(f"the DataLoader already has a {kind.__name__}: run.prepare shards a plain DataLoader itself "
                        f"(its batch_size is the global batch)",
                        "pass a plain DataLoader with shuffle=True/False; ddp_kit shards it")
    per_rank = ("draw on each rank yourself (num_samples // run.world_size, a generator seeded with seed + run.rank) "
                "and use that DataLoader without run.prepare")
    if isinstance(sampler, WeightedRandomSampler):
        how = "by weight, with replacement" if sampler.replacement else "by weight"
        raise UserError(f"the DataLoader's sampler {kind.__name__} draws {how}: ddp_kit cannot split that over ranks "
                        f"without changing what is sampled", per_rank)
    if kind is RandomSampler:  # with replacement, or not one whole epoch
        what, how = (("replacement=True", "with replacement") if sampler.replacement else
                     (f"num_samples={sampler.num_samples}",
                      f"{sampler.num_samples} samples per epoch from {len(sampler.data_source)}"))
        raise UserError(f"the DataLoader's sampler RandomSampler({what}) draws {how}: ddp_kit cannot split that "
                        f"over ranks without changing what is sampled", f"use shuffle=True, or {per_rank}")
    raise UserError(f"the DataLoader's sampler {kind.__name__} is not one ddp_kit can shard (it shards "
                    f"SequentialSampler, RandomSampler and SubsetRandomSampler)",
                    f"use shuffle=True/False, or {yourself}")
