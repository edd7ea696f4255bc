"""Load the target and capture the requested hidden states, without ever running the LM head."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from dspark_cache.format.layers import EMBEDDING_LAYER, stores_last
from dspark_cache.producer.config import device_problem
from dspark_cache.producer.device.checkpoint import TargetError, resolve_checkpoint
from dspark_cache.producer.hub import first_line
from dspark_cache.producer.pipeline.tensors import torch_dtype
from dspark_cache.producer.device.masks import CausalMasks, masks_match

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetInfo:
    """What the plan and the manifest need, read from the config alone (no weights)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    fingerprint: str = ""  # checkpoint.fingerprint: the manifest's target_fingerprint
    revision: str | None = None  # the hub commit that is loaded (None: a local directory)


def resolve_device(arg: str) -> torch.device:
    """``auto`` = CUDA when present; under torchrun each rank takes ``cuda:LOCAL_RANK``.

    The chosen CUDA device is made current (``torch.cuda.set_device``), so anything that asks for
    "the current device" (streams, events, pinned-memory bookkeeping) lands on this rank's GPU
    and not on GPU 0.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    problem = device_problem(arg)  # the command line checks this while parsing; this covers API callers
    if problem:
        raise TargetError(problem)
    if arg == "auto":
        arg = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(arg)
    if device.type != "cuda":
        return device
    if device.index is not None and under_torchrun:
        raise TargetError(f"--device {arg} under torchrun would put every rank on GPU {device.index}; pass "
                          "--device cuda (or auto) and each rank takes cuda:LOCAL_RANK")
    if not torch.cuda.is_available():
        raise TargetError(f"--device {arg} was given but no CUDA device is visible; use --device cpu")
    if device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    if device.index >= torch.cuda.device_count():
        raise TargetError(f"--device {arg}: only {torch.cuda.device_count()} CUDA devices are visible")
    torch.cuda.set_device(device)
    return device


def read_target_info(path: str, trust_remote_code: bool = False, allow_pickle: bool = False) -> TargetInfo:
    """The target's facts and the fingerprint of its checkpoint, before any weight is loaded.

    A hub id is pinned to one commit here, and :class:`TargetRunner` loads that commit: what was
    fingerprinted is what is loaded, even if the repository moves on meanwhile.
    """
    from transformers import AutoConfig

    checkpoint = resolve_checkpoint(path, allow_pickle)
    try:
        config = AutoConfig.from_pretrained(
            path, revision=checkpoint.revision, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise TargetError(f"cannot read the config of target model {path!r}: {first_line(exc)}") from exc
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return TargetInfo(
        model_type=str(getattr(config, "model_type", "")),
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        fingerprint=checkpoint.fingerprint,
        revision=checkpoint.revision,
    )


def check_loaded(path: str, loading: dict[str, Any]) -> None:
    """Refuse a target that loaded with weights missing or of the wrong shape: transformers fills
    those at random and only warns, and every hidden state computed from them would be noise.
    (A tied ``lm_head`` is the embedding itself, never missing.)"""
    problems = []
    for key, what in (
        ("missing_keys", "missing from the checkpoint"),
        ("mismatched_keys", "of another shape"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in loading.get(key) or ())
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            problems.append(f"{len(names)} weights {what} ({shown})")
    if problems:
        raise TargetError(f"target model {path} is incomplete: {'; '.join(problems)}; transformers would "
                          "initialise them at random. Repair or re-download the checkpoint")


def _first_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a tensor-parallel ``DTensor`` (a collective over its group), else ``tensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed tensors has no sharded ones either
        return tensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a ``DTensor`` (no communication), else ``tensor``."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def output_device(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    """Where a (possibly layer-spread) decoder leaves its output: the device of its last parameter,
    the final norm's for a decoder whose layers ``device_map="auto"`` spread over several GPUs."""
    last = None
    for last in module.parameters():
        pass
    return last.device if last is not None else fallback


class TargetRunner:
    """The frozen target's base model with capture hooks on the requested layers."""

    def __init__(
        self,
        path: str,
        layer_ids: list[int],
        num_layers: int,
        device: torch.device,
        compute_dtype: torch.dtype | str,
        cache_dtype: torch.dtype | str,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        distributed_config: Any = None,
        device_map: str | None = None,
        revision: str | None = None,
        allow_pickle: bool = False,
    ) -> None:
        """``distributed_config``: transformers' ``DistributedConfig`` for a model-parallel group (each
        rank loads only its shards; the caller has joined the group); ``device_map="auto"``: one
        process spreads the layers over every visible GPU (accelerate). Neither: all on ``device``.
        ``revision``: the hub commit :func:`read_target_info` pinned; ``allow_pickle``: pickle weights
        may load (they run code), else safetensors only."""
        from transformers import AutoModelForCausalLM
        # The format names dtypes by safetensors code ("BF16", CACHE_DTYPES' values); torch needs its own.
        compute_dtype, cache_dtype = torch_dtype(compute_dtype), torch_dtype(cache_dtype)
        if compute_dtype.itemsize == 1:
            raise TargetError(
                f"--compute-dtype {compute_dtype} is a storage format, not one a target computes in; "
                "use bf16, fp16 or fp32 (or auto)"
            )
        if cache_dtype.itemsize == 1:
            # FP8 caches: the forward hands out the states as computed; the pipeline quantises them
            # (with their scales) after the non-finite check. The weights keep the compute dtype.
            cache_dtype = compute_dtype
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress lines say more, in fewer lines
        # Weights go straight to this rank's device: no full copy of the model in host RAM per rank.
        kwargs: dict[str, Any] = {"dtype": compute_dtype, "trust_remote_code": trust_remote_code,
                                  "revision": revision, "output_loading_info": True}
        if not allow_pickle:
            kwargs["use_safetensors"] = True
        if distributed_config is not None:
            # Each rank reads its slice of every weight from the checkpoint, onto cuda:LOCAL_RANK (or the
            # CPU): the full weights never exist on one rank. transformers refuses a device_map here.
            kwargs["distributed_config"] = distributed_config
        else:
            kwargs["device_map"] = device_map or {"": device}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        try:
            model, loading = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except OSError as exc:  # no weights of an allowed kind, a damaged file
            raise TargetError(f"cannot load the weights of target model {path}: {first_line(exc)}") from exc
        check_loaded(path, loading)
        model.eval().requires_grad_(False)
        self.model = model
        self.base = model.get_decoder()
        if device_map is not None:  # inputs are moved by accelerate's hooks; outputs land here
            device = output_device(self.base, device)
        self.hidden_size = int(self.text_config(model).hidden_size)
        self.masks = CausalMasks(self.text_config(model), compute_dtype)
        self.masks_without_waiting = masks_match(
            self.base, self.masks, int(model.get_input_embeddings().weight.shape[0]), device
        )
        self.device = device
        self.cache_dtype = cache_dtype
        self.layer_ids = list(layer_ids)
        self.final_id = num_layers - 1
        self.stores_last = stores_last(layer_ids, num_layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [self._hook_module(i) for i in layer_ids if i != self.final_id]

    @staticmethod
    def text_config(model: Any) -> Any:
        """The text config (a multimodal target's language model's)."""
        return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    @property
    def weight_bytes(self) -> int:
        """Bytes of the target's weights this rank holds: its shards under a model-parallel group."""
        return sum(local_tensor(p).numel() * p.element_size() for p in self.model.parameters())

    def _hook_module(self, layer_id: int) -> Any:
        module = (
            self.base.get_input_embeddings() if layer_id == EMBEDDING_LAYER else self.base.layers[layer_id]
        )

        def hook(_module: Any, _args: Any, output: Any) -> None:
            # Under a TP plan the residual stream leaves each layer whole on every rank (row-wise
            # projections all-reduce); a plan that leaves it a DTensor shard is gathered here (every
            # rank of the group runs the same hooks, so the gather is a matched collective).
            state = full_tensor(_first_tensor(output))
            if state.shape[-1] != self.hidden_size:
                raise TargetError(
                    f"layer {layer_id} of the target returns states {state.shape[-1]} wide, not "
                    f"hidden_size {self.hidden_size}: its tensor-parallel plan leaves them split; "
                    "run without --tp-size/--ep-size (or with --device-map auto)"
                )
            self._captured[layer_id] = state

        return module.register_forward_hook(hook)

    def target_weights(self) -> dict[str, torch.Tensor]:
        """``embed_tokens.weight`` and ``lm_head.weight`` [V, H] in the cache dtype (as NeMo).

        Under a model-parallel group the sharded ones are gathered: every rank of the group must call this.
        """
        embed = full_tensor(self.model.get_input_embeddings().weight)
        head = full_tensor(self.model.get_output_embeddings().weight)
        return {
            "embed_tokens.weight": embed.detach().to("cpu", self.cache_dtype).clone(),
            "lm_head.weight": head.detach().to("cpu", self.cache_dtype).clone(),
        }

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(target_hidden [B,T,len(ids)*H], last [B,T,H] or None)`` in the cache dtype, on device.

        ``last`` is None when the final state is one of the ids: it is then the last H columns.
        """
        # Batches are right-padded and the target is causal, so no real token ever attends to a
        # pad: the padding mask changes nothing we keep, and dropping it lets attention take its
        # fused causal path instead of materialising a [B, 1, T, T] mask.
        del attention_mask
        final = self._decode(input_ids)
        b, t, h = final.shape
        hidden = torch.empty((b, t, h * len(self.layer_ids)), dtype=self.cache_dtype, device=final.device)
        for slot, layer_id in enumerate(self.layer_ids):
            source = final if layer_id == self.final_id else self._captured[layer_id]
            hidden[..., slot * h : (slot + 1) * h].copy_(source)
        self._captured.clear()
        return hidden, final.to(self.cache_dtype) if self.stores_last else None

    @torch.inference_mode()
    def compute_only(self, input_ids: torch.Tensor) -> None:
        """The forward of a rank that writes nothing (a model-parallel partner): the same decoder
        forward, hooks and collectives as :meth:`forward`, without assembling the outputs."""
        self._decode(input_ids)
        self._captured.clear()

    def _decode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder over a causal batch, capture hooks armed; returns the post-final-norm state
        (HF ``hidden_states[N]``). The causal masks are ours (see masks.py), so the forward never
        waits for the device."""
        self._captured.clear()
        masks = self.masks.mapping(*input_ids.shape, input_ids.device) if self.masks_without_waiting else None
        return full_tensor(
            self.base(input_ids=input_ids, attention_mask=masks, use_cache=False).last_hidden_state
        )
