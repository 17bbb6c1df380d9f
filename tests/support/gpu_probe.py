"""A torchrun rank for the Slurm tests' two-GPU job: it writes down which GPU it would drive.

The test cluster's GPUs are fake (no CUDA), so NCCL training cannot run on them; this rank is
started by the training launcher's own command (`train_dist.torchrun_command`) and picks its GPU
with the training ranks' own rule (`train_dist.local_gpu`), then records it in $PROBE_DIR.
"""

import json
import os
import sys
from pathlib import Path

from eagleflow.train import dist as train_dist

out = Path(os.environ["PROBE_DIR"]) / f"rank{os.environ['RANK']}.json"
out.write_text(
    json.dumps(
        {
            "rank": int(os.environ["RANK"]),
            "world": int(os.environ["WORLD_SIZE"]),
            "pid": os.getpid(),
            "gpu": train_dist.local_gpu(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
        }
    )
)
sys.exit(0)
