"""Started by the launcher tests: reports what this process was given, then optionally dies."""

import json
import os
import sys
import time

import torch.distributed as dist

from kiln import Accelerator

mode = sys.argv[1]
out = sys.argv[2]
acc = Accelerator()
if mode == "report":
    seen = {k: v for k, v in os.environ.items() if k.startswith("KILN_")}
    record = {"rank": acc.process_index, "world": acc.num_processes, "type": acc.distributed_type.value,
              "precision": acc.mixed_precision, "env": seen,
              "dynamo": None if acc.dynamo_plugin is None else acc.dynamo_plugin.backend,
              "zero_stage": getattr(acc.strategy, "zero_stage", None)}
    with open(f"{out}.{acc.process_index}", "w") as handle:
        json.dump(record, handle)
elif mode == "die":
    if acc.process_index == 1:
        os._exit(3)  # a crash, no clean shutdown
    time.sleep(1)
    for _ in range(1000):
        dist.barrier()  # waits for the dead rank
        time.sleep(0.1)
acc.end_training()
