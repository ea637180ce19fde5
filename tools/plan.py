"""Plan a Trident run before renting it: every split, schedule and layout that fits, ranked by step time.

    python tools/plan.py --preset llama3-8b --num-gpus 64
    python tools/plan.py --preset llama3-70b --num-gpus 512 --use-distributed-optimizer --dry-run 1 --json
    python tools/plan.py --hf-config config.json --seq-length 4096 --global-batch-size 256 --num-gpus 32
    python tools/plan.py --num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 512 \\
        --max-position-embeddings 512 --vocab-size 4095 --global-batch-size 16 --num-gpus 4 --profile-local
    python tools/plan.py --preset llama3-8b --num-gpus 64 --from-timeline runs/timeline

Megatron's model flags describe the model (or ``--preset`` / ``--hf-config``); ``--num-gpus``,
``--gpus-per-node``, ``--gpu`` and the bandwidth flags describe the cluster. ``python tools/plan.py
--help`` lists them; the logic lives in ``planner/``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.cli import main
from pretrain_gpt import forward_step

if __name__ == "__main__":
    sys.exit(main(forward_step_func=forward_step))
