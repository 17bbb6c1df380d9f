"""train_draft on several processes: the torchrun launch, rank handling and the ranks' agreement.

`train.gpus: N` (N >= 2) trains with N processes under torchrun, one per GPU, speculators' DDP
over NCCL; `train.processes: N` with `train.gpus: 0` does the same on the CPU over gloo (slower
than one process: it checks this path where there is no GPU). The job's own process
(`launch`) checks the inputs, starts `python -m torch.distributed.run --standalone
--nproc-per-node N -m eagleflow.train.dist SPEC`, forwards SIGTERM/SIGINT to torchrun (which
passes them to every rank once), and re-raises the error rank 0 reported, by its class
(TrainingInterrupted keeps its "rerun to resume" message). Every rank (`main`) runs the same
`train_draft`; rank 0 alone writes eagleflow's files (history, checkpoint state, best weights,
summary, metrics); speculators' checkpointer saves on rank 0 between barriers. After each step
the ranks add up their tokens (`sum_over_ranks`) and ask whether any of them got a stop signal
(`any_rank`), so all of them stop at the same step.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from eagleflow.errors import EagleflowError, TrainError, TrainingInterrupted

log = logging.getLogger(__name__)


def in_worker() -> bool:
    """True inside a torchrun rank (torchrun sets LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ and "EAGLEFLOW_TRAIN_SPEC" in os.environ


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def world() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def _all_reduce_sum(value: float) -> float:
    """`value` summed over the ranks; one process: `value`."""
    d = _dist()
    if d is None:
        return value
    import torch
    from speculators.train.distributed import get_local_rank

    device = "cpu" if d.get_backend() == "gloo" else f"cuda:{get_local_rank()}"
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    d.all_reduce(t)
    return float(t.item())


def sum_over_ranks(count: int) -> int:
    """A per-rank count (a step's tokens) summed over the ranks."""
    return int(_all_reduce_sum(count))


def any_rank(flag: bool) -> bool:
    """Whether any rank has `flag` set (a stop signal): every rank gets the same answer."""
    return _all_reduce_sum(1.0 if flag else 0.0) > 0


def local_gpu() -> str | None:
    """The GPU this rank drives: the LOCAL_RANK-th of the job's CUDA_VISIBLE_DEVICES (the ones
    Slurm or the ssh profile assigned), or None where none are set."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return visible[local] if local < len(visible) else None


def torchrun_command(procs: int, module: str = "eagleflow.train.dist") -> list[str]:
    """torchrun on this node with `procs` ranks of `module` (one per GPU for GPU training)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={procs}",
        "-m",
        module,
    ]


def init(settings: dict) -> dict:
    """Join the process group (gloo on the CPU, NCCL on GPUs, through speculators' own setup)
    and return the settings with this rank's device."""
    import speculators.train.distributed as sd

    if settings["cpu"]:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        sd._local_rank = int(os.environ["LOCAL_RANK"])
        sd._rank, sd._world_size = dist.get_rank(), dist.get_world_size()
        sd._is_distributed = True
        sd._init_sp_process_groups(sd._rank, sd._world_size, 1)
        return dict(settings)
    sd.maybe_setup_distributed()
    log.info("rank %d: cuda:%d, GPU %s of the job's", rank(), sd.get_local_rank(), local_gpu())
    return {**settings, "device": f"cuda:{sd.get_local_rank()}"}


def shutdown() -> None:
    import speculators.train.distributed as sd

    if _dist() is not None:
        sd._is_distributed = True  # speculators' teardown also resets its topology state
        sd.maybe_destroy_distributed()


def launch(spec: dict, settings: dict) -> dict:
    """Run train_draft under torchrun with settings["processes"] ranks; returns the summary."""
    procs = int(settings["processes"])
    with tempfile.TemporaryDirectory(prefix="eagleflow-train-") as tmp:
        spec_path, error_path = Path(tmp) / "spec.json", Path(tmp) / "error.json"
        spec_path.write_text(json.dumps({**spec, "error_file": str(error_path)}))
        cmd = torchrun_command(procs)
        env = dict(os.environ, EAGLEFLOW_TRAIN_SPEC=str(spec_path))
        try:
            sys.stderr.flush()
            out = sys.stderr if sys.stderr.fileno() >= 0 else None
        except (AttributeError, OSError, io.UnsupportedOperation):
            out = None  # (pytest's capture): the ranks write to this process's own stderr
        log.info(
            "train: %d processes (%s) under torchrun", procs, "gloo" if settings["cpu"] else "nccl"
        )
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        old = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                old[s] = signal.signal(s, lambda signum, _f: proc.send_signal(signum))
        try:
            rc = proc.wait()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if error_path.is_file():
            err = json.loads(error_path.read_text())
            cls = {"TrainingInterrupted": TrainingInterrupted}.get(err["type"], TrainError)
            raise cls(err["message"])
        if rc != 0:
            raise TrainError(
                f"torchrun with {procs} training processes exited with status {rc}; the ranks' "
                "errors are above in this log"
            )
    return json.loads(Path(spec["out_summary"]).read_text())


def main() -> int:
    """One rank: the spec's entry (train.train_draft) with the job's arguments; rank 0 reports
    a user error by class. The entry is named in the spec, so this module imports nothing of the
    training module that launches it."""
    import importlib

    local = os.environ.get("LOCAL_RANK", "?")
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s rank {local}: %(message)s",
    )
    spec = json.loads(Path(os.environ["EAGLEFLOW_TRAIN_SPEC"]).read_text())
    module, name = spec["entry"].split(":")
    train_draft = getattr(importlib.import_module(module), name)
    try:
        train_draft(
            spec["inputs"],
            spec["train_cfg"],
            spec["checkpoint_dir"],
            spec["out_summary"],
            spec["out_metrics"],
            spec["trust_remote_code"],
        )
    except EagleflowError as e:
        log.error("%s", e)
        if rank() == 0 or not Path(spec["error_file"]).exists():
            tmp = Path(spec["error_file"] + f".{os.getpid()}")
            tmp.write_text(json.dumps({"type": type(e).__name__, "message": str(e)}))
            os.replace(tmp, spec["error_file"])
        return 1
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
