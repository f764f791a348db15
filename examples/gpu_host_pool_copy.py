"""Measure device <-> host-pool page copies, pinned against pageable host pools (needs CUDA).

hicache-draft pins its host pools when CUDA is available; this script shows what that buys for the
engine's L1 <-> L2 copies of whole pages, target and draft alike, with the same page views the
controller and the backends use (``HostPool.page_view``). It prints GB/s and the pinned/pageable ratio
for each direction, measured in the same run on the same pages.

    python examples/gpu_host_pool_copy.py [--pages 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hicache_draft import Attention, HostPool, Layout, PoolKind, PoolSpec


def _spec(layout: Layout) -> PoolSpec:
    # a Llama-3.1-8B-like rank: 32 layers, 8 KV heads of 128, bf16, 64-token pages (8 MiB per page)
    return PoolSpec(kind=PoolKind.KV, attention=Attention.MHA, layers=32, page_size=64, dtype=torch.bfloat16,
                    layout=layout, kv_heads=8, head_dim=128)


def _time(fn: Callable[[], None], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: this measurement needs a GPU")
    layout = Layout.PAGE_FIRST_DIRECT
    spec = _spec(layout)
    pinned = HostPool(spec, args.pages)
    pageable = HostPool(spec, args.pages, pin=False)
    assert pinned.raw.is_pinned() and not pageable.raw.is_pinned()
    device = HostPool.wrap(spec, torch.empty_like(pinned.buffer, device="cuda").normal_())
    nbytes = spec.page_nbytes * args.pages
    slots = [p * spec.page_size for p in range(args.pages)]
    print(f"{args.pages} pages of {spec.page_nbytes >> 20} MiB ({nbytes >> 20} MiB), layout {layout.value}")
    for direction in ("device->host", "host->device"):
        rates = {}
        for name, pool in (("pinned", pinned), ("pageable", pageable)):

            def run(pool: HostPool = pool, direction: str = direction) -> None:
                for s in slots:  # one copy per contiguous region (K and V halves of a page)
                    for host, dev in zip(pool.page_regions(s), device.page_regions(s), strict=True):
                        if direction == "device->host":
                            host.copy_(dev, non_blocking=True)
                        else:
                            dev.copy_(host, non_blocking=True)

            run()
            rates[name] = nbytes / _time(run, args.rounds) / 1e9
        print(f"{direction:13s} pinned {rates['pinned']:6.1f} GB/s  pageable {rates['pageable']:6.1f} GB/s  "
              f"ratio {rates['pinned'] / rates['pageable']:.1f}x")
    torch.cuda.synchronize()
    ok = all(torch.equal(pinned.page_view(s).cuda(), device.page_view(s)) for s in slots[:4])
    print(f"round trip byte-exact: {ok}")


if __name__ == "__main__":
    main()
