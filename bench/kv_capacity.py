"""How many concurrent requests fit in an 80 GB KV budget: one pool for every layer (baseline),
two pools at SGLang's fixed r = 0.8, and two pools at swaserve's auto ratio, each against the
bound (full KV for all T tokens in full layers + W + I + P tokens in SWA layers).

    python bench/kv_capacity.py [--json] [--kv-cache-gb 80] [--seq-lens 4096 32768 131072]
"""

from __future__ import annotations

import sys

from swaserve.cluster.kv_capacity import main

if __name__ == "__main__":
    sys.exit(main())
