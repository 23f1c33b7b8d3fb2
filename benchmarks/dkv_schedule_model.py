"""A model of the dK/dV kernel's launch on a Hopper GPU: load balance and L2 reuse.

  python -m benchmarks.dkv_schedule_model

For the causal head_dim 128 backward at the GQA rows of the sweep (and MHA beside them), with
the kv head's query-head group walked by one CTA or split over `group_parts` CTAs:
- `makespan`: list scheduling of the grid (CTAs in launch order, heads fastest, each to the
  first SM free; a CTA's cost is the query blocks its keys see times the heads it walks, plus a
  fixed cost), as a ratio to the mean load per SM: what the causal CTAs' imbalance costs;
- `miss`: the share of the steps whose (query head, query block) tiles (q, dO and the dQ
  part: 64 KiB) are not in an LRU cache of the L2's size, the SMs stepping in lockstep: how
  much the CTAs running at once share their reads.
A model, not a measurement (benchmarks/NOTES.md session 39 says what it was used for).
"""

from __future__ import annotations

import argparse
import collections
import heapq

NUM_SMS = 132
L2_BYTES = 50 << 20
FIXED_STEPS = 4  # a CTA's prologue and epilogue, in steps (session 23's ~4 key blocks)


def cta_walks(seq: int, batch: int, heads_q: int, heads_kv: int, group_parts: int = 1,
              block_q: int = 64, keys_per_cta: int = 128) -> list[list[tuple[int, int, int]]]:
  """Each CTA's steps in launch order, a step being (batch, query head, query block)."""
  walked = heads_q // heads_kv // group_parts
  num_q_blocks = seq // block_q
  walks = []
  for b in range(batch):
    for tile in range(seq // keys_per_cta):
      first_block = tile * keys_per_cta // block_q  # (causal: the first block seeing the keys)
      for head_part in range(heads_kv * group_parts):
        walks.append([(b, head_part * walked + g, qi) for g in range(walked)
                      for qi in range(first_block, num_q_blocks)])
  return walks


def makespan(walks, num_sms: int = NUM_SMS) -> float:
  """The last SM's finish over the mean load, the CTAs list-scheduled in launch order."""
  free = [0] * num_sms
  end = 0
  for walk in walks:
    start = heapq.heappop(free)
    end = max(end, start + len(walk) + FIXED_STEPS)
    heapq.heappush(free, start + len(walk) + FIXED_STEPS)
  return end / (sum(len(w) + FIXED_STEPS for w in walks) / num_sms)


def miss_share(walks, num_sms: int = NUM_SMS, cache_bytes: int = L2_BYTES,
               step_bytes: int = 64 << 10) -> float:
  """The share of steps missing an LRU cache of `cache_bytes`, each SM one step a tick."""
  cache = collections.OrderedDict()
  capacity = cache_bytes // step_bytes
  pending = iter(walks)
  running = [next(pending, None) for _ in range(num_sms)]
  position = [0] * num_sms
  steps = misses = 0
  while any(walk is not None for walk in running):
    for sm, walk in enumerate(running):
      if walk is None:
        continue
      key = walk[position[sm]]
      steps += 1
      if key in cache:
        cache.move_to_end(key)
      else:
        misses += 1
        cache[key] = None
        if len(cache) > capacity:
          cache.popitem(last=False)
      position[sm] += 1
      if position[sm] == len(walk):
        running[sm], position[sm] = next(pending, None), 0
  return misses / steps


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.parse_args(argv)
  print("shape                 parts  makespan  miss")
  for seq, batch in ((4096, 4), (16384, 1)):
    for heads_q, heads_kv, parts in ((16, 16, 1), (32, 8, 1), (32, 8, 2), (32, 8, 4)):
      walks = cta_walks(seq, batch, heads_q, heads_kv, parts)
      print(f"b{batch} N{seq:<6} h{heads_q}/{heads_kv:<5} {parts:5d}  {makespan(walks):8.3f}"
            f"  {miss_share(walks):.3f}")


if __name__ == "__main__":
  main()
