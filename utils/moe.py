"""Mixture of experts, measured: a training step's bytes by category, the all-to-all's bytes, the EP ranks' launcher.

Introduced in notebook 14 (mixture of experts). The layer itself (router, SwiGLU experts, dispatch by sorting,
combine, expert parallelism by ``all_to_all_single``) is plain torch in the notebook, and its launched copy is
``utils.expert_parallel_ranks``; this module holds the instruments around it:

* ``measure_hf_moe_step``: one AdamW training step of a tiny transformers MoE (Mixtral, Qwen3-MoE or OLMoE built
  from a config, random weights, nothing downloaded) on the CPU, measured to the byte by category with torch's
  ``MemTracker``, with the tokens each expert received in every layer (what a calculator must be given);
* ``AllToAllLog``: counts the bytes every ``torch.distributed.all_to_all_single`` call hands to each rank and gets
  from each, read from the tensors passed to the collective, not from a formula;
* ``SavedActivationBytes``: the bytes autograd saves for backward, parameters left out even when FSDP2 has just
  all-gathered them into storages of their own;
* ``ExpertParallelConfig`` and ``launch_expert_parallel``: start the gloo ranks of ``utils.expert_parallel_ranks``
  (a fork server: one fresh Python imports torch once and forks the ranks) and read each rank's record back;
* ``grouped_mm_support``, ``token_centres`` and ``clustered_tokens``: whether this torch runs ``F.grouped_mm`` on
  the CPU, and tokens drawn from a few clusters of unequal size, so that a router loads its experts unequally.

Known limitations: the ranks run on the CPU with gloo, so bytes and split sizes are exact and no speed is
meaningful; ``measure_hf_moe_step`` measures fp32 training on the CPU only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .checks import non_negative_int, positive_int
from .parallel import LaunchError, find_free_port

HF_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")


# --- what a step holds, by category: a tiny transformers MoE ------------------------------------------------------

def hf_moe_config(family: str, **overrides: Any) -> Any:
    """A small transformers config of an MoE family: 2 layers, width 32, 8 experts of width 48, 2 per token.

    Args:
        family: ``"mixtral"``, ``"qwen3_moe"`` or ``"olmoe"``.
        **overrides: any config field (``num_experts_per_tok=1``, ``norm_topk_prob=True`` ...).

    Returns:
        The transformers config (``MixtralConfig``, ``Qwen3MoeConfig`` or ``OlmoeConfig``).

    Raises:
        ValueError: an unknown family.
    """
    import transformers

    if family not in HF_FAMILIES:
        raise ValueError(f"unknown MoE family {family!r}: expected one of {HF_FAMILIES}")
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "mixtral":
        config = dict(common, intermediate_size=48, num_local_experts=8)
        return transformers.MixtralConfig(**(config | overrides))
    if family == "qwen3_moe":
        config = dict(common, intermediate_size=64, moe_intermediate_size=48, num_experts=8, head_dim=8)
        return transformers.Qwen3MoeConfig(**(config | overrides))
    config = dict(common, intermediate_size=48, num_experts=8, eos_token_id=0, pad_token_id=1)   # in the vocabulary
    return transformers.OlmoeConfig(**(config | overrides))


@dataclass(frozen=True)
class HfMoeStep:
    """One measured training step of a transformers MoE (``measure_hf_moe_step``).

    Attributes:
        family: ``"mixtral"``, ``"qwen3_moe"`` or ``"olmoe"``.
        config: the transformers config, as a dict (``to_dict()``).
        batch, seq: sequences and tokens per sequence of the step.
        num_parameters: every parameter element, experts included.
        num_expert_parameters: the elements of the experts' weights (every ``mlp.experts`` tensor).
        num_tensors: parameter tensors (AdamW keeps a 4-byte step counter for each).
        tokens_per_expert: one list per MoE layer: the (token, slot) pairs each expert received in the measured
            step's forward (read from the router's indices in a no-grad forward of the same weights and batch).
        state_bytes: ``{"parameters", "gradients", "optimizer"}`` read from the tensors after ``optimizer.step()``.
        peak_bytes: MemTracker's peak of the step (everything it follows: model, optimizer state, batch).
        peak_by_category: that peak by MemTracker's category (Parameter, Buffer, Gradient, Activation, Temp,
            Optstate, Other).
        marks: by category at "forward" (the loss computed), "backward" (after ``loss.backward()``), "step"
            (after ``optimizer.step()``) and "end" (after ``zero_grad(set_to_none=True)``).
    """

    family: str
    config: dict
    batch: int
    seq: int
    num_parameters: int
    num_expert_parameters: int
    num_tensors: int
    tokens_per_expert: list[list[int]]
    state_bytes: dict[str, int]
    peak_bytes: int
    peak_by_category: dict[str, int]
    marks: dict[str, dict[str, int]]


def measure_hf_moe_step(family: str = "mixtral", *, batch: int = 2, seq: int = 16, seed: int = 0,
                        padded: bool = False, **overrides: Any) -> HfMoeStep:
    """Train a tiny transformers MoE one step on the CPU and measure it to the byte, by category.

    Why it exists: an MoE holds every expert's weights, gradients and AdamW state, and its activations depend on
    the tokens each expert received; a prediction of either (notebook 14's, a calculator's) needs a step
    measured exactly, with the routing that produced it. The model is built from ``hf_moe_config(family,
    **overrides)`` (random weights, its default ``experts_implementation``), trained in fp32 with
    ``AdamW(foreach=False)``: one warm-up step first (AdamW's state exists, as in any step after the first),
    then the measured step, ``loss = model(input_ids=..., labels=...).loss``, ``loss.backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``, under torch's ``MemTracker``
    (``utils.measure_memory_by_category``), which follows the model, the optimizer and the batch from the start.

    Args:
        family: ``"mixtral"``, ``"qwen3_moe"`` or ``"olmoe"``.
        batch: sequences per step.
        seq: tokens per sequence.
        seed: the weights' and the tokens' seed.
        padded: the last sequence ends in ``seq // 4`` pad tokens (``attention_mask`` 0, label -100).
        **overrides: config fields for ``hf_moe_config`` (e.g. ``num_local_experts=4`` for Mixtral,
            ``num_experts=16`` for the others, ``num_experts_per_tok=1``, ``output_router_logits=True`` to
            add the auxiliary loss to the loss).

    Returns:
        An ``HfMoeStep``.

    Raises:
        ValueError: an unknown family, or a batch or sequence length that is not a positive int.

    Example:
        >>> step = measure_hf_moe_step("qwen3_moe", batch=2, seq=16)
        >>> step.state_bytes, step.peak_by_category["Activation"], step.tokens_per_expert[0]

    Known limitations:
        fp32 on the CPU only (no autocast, no GPU); MemTracker files everything ``optimizer.step()`` allocates as
        "Optstate", the step's temporaries included.
    """
    import warnings

    import transformers

    from .memory_by_category import measure_memory_by_category

    positive_int("batch", batch)
    positive_int("seq", seq)
    config = hf_moe_config(family, **overrides)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[-1, seq - seq // 4:] = 0
        inputs["labels"][mask == 0] = -100
        inputs["attention_mask"] = mask

    def step(mark: Any = None) -> None:
        loss = model(**inputs).loss
        if mark:
            mark("forward")
        loss.backward()
        del loss
        if mark:
            mark("backward")
        optimizer.step()
        if mark:
            mark("step")
        optimizer.zero_grad(set_to_none=True)
        if mark:
            mark("end")

    step()                                             # warm-up: AdamW's state exists from here on
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    counts: list[list[int]] = []
    handles = [r.register_forward_hook(lambda m, a, out: counts.append(
        torch.bincount(out[2].flatten(), minlength=m.num_experts).tolist())) for r in routers]
    try:
        with torch.no_grad():                          # the routing of the measured step: same weights, same batch
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    state: dict[str, int] = {}

    def measured_step(mark: Any) -> None:
        loss = model(**inputs).loss
        mark("forward")
        loss.backward()
        del loss
        mark("backward")
        optimizer.step()
        mark("step")
        state.update(state_bytes_by_part({"model": list(model.parameters())}, optimizer)["model"])
        optimizer.zero_grad(set_to_none=True)
        mark("end")

    peaks = measure_memory_by_category(measured_step, model, optimizer, *inputs.values())
    parameters = dict(model.named_parameters())
    experts = sum(p.numel() for name, p in parameters.items() if ".experts." in name)
    return HfMoeStep(family=family, config=config.to_dict(), batch=batch, seq=seq,
                     num_parameters=sum(p.numel() for p in parameters.values()), num_expert_parameters=experts,
                     num_tensors=len(parameters), tokens_per_expert=counts, state_bytes=state,
                     peak_bytes=peaks.peak_bytes, peak_by_category=peaks.peak_by_category, marks=peaks.marks)


# --- counting what the collectives carry and what autograd keeps ----------------------------------------------------

class AllToAllLog:
    """Count the bytes each ``torch.distributed.all_to_all_single`` call sends to every rank and receives from it.

    Why it exists: the all-to-all's volume is set by the routing, which changes every step, so it must be
    counted from what was really handed to the collective. Inside the ``with`` block every call (the layer's
    own, and the ones its backward makes) goes through a wrapper that reads, for each peer, the bytes of the
    slice of the input tensor sent to it and of the slice of the output tensor filled from it
    (``narrow(...).nbytes``), then calls the real collective.

    Attributes:
        phase: a label stored with each call (set it to ``"backward"`` before ``loss.backward()``).
        calls: one dict per call: ``phase``, ``dtype``, ``sent`` and ``received`` (bytes per peer, by rank).

    Example:
        >>> with AllToAllLog() as log:
        ...     out = model(x); log.phase = "backward"; out.sum().backward()
        >>> log.sent_bytes(), log.sent_bytes("backward")

    Known limitations:
        Only ``all_to_all_single`` called through ``torch.distributed`` (not ``all_to_all`` on lists, not the
        functional collectives); a process group must exist when a call is made.
    """

    def __init__(self, phase: str = "forward") -> None:
        self.phase = phase
        self.calls: list[dict[str, Any]] = []
        self._original: Any = None

    def __enter__(self) -> "AllToAllLog":
        import torch.distributed as dist

        self._original = dist.all_to_all_single
        dist.all_to_all_single = self._counted
        return self

    def __exit__(self, *exc_info: object) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self._original

    def _counted(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                 input_split_sizes: Sequence[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
        import torch.distributed as dist

        world = dist.get_world_size(group)
        self.calls.append({"phase": self.phase, "dtype": str(input.dtype).replace("torch.", ""),
                           "sent": _slice_bytes(input, input_split_sizes, world),
                           "received": _slice_bytes(output, output_split_sizes, world)})
        return self._original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def sent_bytes(self, phase: str | None = None, *, to_self: bool = False) -> int:
        """Bytes this rank sent in ``phase`` (None: every phase), to the other ranks only unless ``to_self``."""
        import torch.distributed as dist

        me = dist.get_rank() if dist.is_initialized() else None
        return sum(b for call in self.calls if phase in (None, call["phase"])
                   for peer, b in enumerate(call["sent"]) if to_self or peer != me)


def _slice_bytes(tensor: torch.Tensor, split_sizes: Sequence[int] | None, world: int) -> list[int]:
    """The bytes of each rank's slice of ``tensor`` along dim 0 (equal slices when no sizes are given)."""
    sizes = list(split_sizes) if split_sizes else [tensor.shape[0] // world] * world
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [tensor.narrow(0, start, size).nbytes for start, size in zip(starts, sizes)]


class SavedActivationBytes:
    """The bytes autograd saves for backward inside the block, each storage once, parameters left out.

    Why not ``utils.track_saved_tensors(exclude=model)``: FSDP2 all-gathers a sharded parameter into a storage
    of its own just before forward, which no list made beforehand contains. Here a saved tensor is a parameter
    (not counted) when it is an ``nn.Parameter`` or shares its storage with a parameter of ``modules`` at the
    moment it is saved (views of expert weights, FSDP2's gathered ones).

    Args:
        modules: the model (or its parts) whose parameters are not activations.

    Attributes:
        bytes: bytes of the distinct storages saved so far.
        storages: how many.

    Example:
        >>> with SavedActivationBytes(model) as saved:
        ...     loss = model(x).square().mean()
        >>> saved.bytes

    Known limitations:
        Each saved tensor re-reads the modules' parameter storages (cheap for the notebook's models, slow for
        big ones); tensors kept alive by other means than autograd are not counted.
    """

    def __init__(self, *modules: nn.Module) -> None:
        self.modules = modules
        self.bytes = 0
        self.storages = 0
        self._seen: set[int] = set()
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or isinstance(tensor, nn.Parameter):
            return tensor
        parameters = {p.untyped_storage().data_ptr() for m in self.modules for p in m.parameters()
                      if not hasattr(p, "to_local")}
        parameters |= {p.to_local().untyped_storage().data_ptr() for m in self.modules for p in m.parameters()
                       if hasattr(p, "to_local")}
        if key not in parameters:
            self._seen.add(key)
            self.bytes += storage.nbytes()
            self.storages += 1
        return tensor

    def __enter__(self) -> "SavedActivationBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.__exit__(*exc_info)


def local_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` on this rank.

    Why: a rank's memory is its storages, not the logical tensors: a DTensor (FSDP2's shard) counts its local
    piece, with the padding FSDP2 stores; views of one storage count once.

    Args:
        tensors: an iterable of tensors (None entries, e.g. missing gradients, are skipped).

    Returns:
        Bytes.

    Example:
        >>> local_bytes(p.grad for p in model.parameters())
    """
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes_by_part(parts: dict[str, Sequence[nn.Parameter]], optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state of each named group of parameters, on this rank.

    DTensors (FSDP2's shards) count their local shard; a storage shared by several tensors counts once.

    Args:
        parts: name -> parameters (e.g. ``{"experts": [...], "rest": [...]}``).
        optimizer: the optimizer holding their state.

    Returns:
        ``{name: {"parameters": B, "gradients": B, "optimizer": B}}``.
    """
    result = {}
    for name, parameters in parts.items():
        parameters = list(parameters)
        state = [v for p in parameters for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        result[name] = {"parameters": local_bytes(parameters), "gradients": local_bytes(p.grad for p in parameters),
                        "optimizer": local_bytes(state)}
    return result


# --- the data and the kernels ----------------------------------------------------------------------------------------

def token_centres(clusters: int, width: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``clusters`` random centres for ``clustered_tokens``: draw them once, then sample many batches around them.

    Args:
        clusters: how many kinds of token.
        width: features per token.
        generator: the random generator (seeded by the caller).

    Returns:
        A ``(clusters, width)`` fp32 tensor of standard normal values.

    Example:
        >>> centres = token_centres(4, 64, generator=torch.Generator().manual_seed(0))
        >>> batch = clustered_tokens(512, centres)
    """
    positive_int("clusters", clusters)
    positive_int("width", width)
    return torch.randn(clusters, width, generator=generator)


def clustered_tokens(num_tokens: int, centres: torch.Tensor, *, spread: float = 0.5,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Tokens drawn around ``centres``, the i-th centre with weight 1 / (i + 1): some kinds of token are common.

    Real text is not uniform, and a router sends similar tokens to the same experts: unequal clusters give the
    experts unequal loads, as in training.

    Args:
        num_tokens: rows.
        centres: ``(clusters, width)`` (``token_centres``).
        spread: the standard deviation around a centre (the centres' own is 1).
        generator: the random generator (seeded by the caller).

    Returns:
        A ``(num_tokens, width)`` fp32 tensor.
    """
    positive_int("num_tokens", num_tokens)
    if not isinstance(centres, torch.Tensor) or centres.dim() != 2:
        raise ValueError(f"centres must be a (clusters, width) tensor, got {type(centres).__name__} "
                         f"{tuple(getattr(centres, 'shape', ()))}")
    weights = 1.0 / torch.arange(1, len(centres) + 1, dtype=torch.float32)
    which = torch.multinomial(weights, num_tokens, replacement=True, generator=generator)
    return centres[which] + spread * torch.randn(num_tokens, centres.shape[1], generator=generator)


def grouped_mm_support() -> str | None:
    """Whether this torch runs ``torch.nn.functional.grouped_mm`` on the CPU in fp32, forward and backward.

    Why: ``F.grouped_mm`` appeared in torch 2.10 and its CPU kernel has its own limits (rows whose stride is a
    multiple of 16 bytes, no broadcast output gradient); notebook 14 times it against a loop only where it runs,
    and says why not elsewhere. The probe multiplies a 6-row input by 2 experts and compares with the loop.

    Returns:
        None when it runs and agrees with the loop; otherwise the reason, one line.

    Example:
        >>> missing = grouped_mm_support()
        >>> print("grouped GEMM: " + ("yes" if missing is None else missing))
    """
    import torch.nn.functional as F

    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm (torch >= 2.10 has it)"
    try:
        x = torch.randn(6, 8, requires_grad=True)                 # rows of 32 bytes: the kernel wants multiples of 16
        w = torch.randn(2, 4, 8).transpose(1, 2).requires_grad_()  # (E, C, F) views of (E, F, C), as the layer's
        out = F.grouped_mm(x, w, offs=torch.tensor([2, 6], dtype=torch.int32))
        out.backward(torch.ones(6, 4))
        reference = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
        if not torch.allclose(out, reference, atol=1e-5):
            return "F.grouped_mm's CPU result differs from the loop's on this torch"
    except (RuntimeError, NotImplementedError) as error:
        return f"F.grouped_mm does not run fp32 on this CPU with torch {torch.__version__}: {error}".splitlines()[0]
    return None


# --- expert parallelism on CPU ranks: the configuration and the launcher ---------------------------------------------

@dataclass(frozen=True)
class ExpertParallelConfig:
    """What the expert-parallel ranks build and run (``utils.expert_parallel_ranks``).

    Attributes:
        world_size: ranks; each holds ``num_experts / world_size`` experts and is also a data-parallel rank.
        width: the residual stream, C.
        ffn: each expert's hidden width, F.
        num_experts: E.
        top_k: experts per token, k.
        tokens_per_rank: each rank's tokens per step (its own batch, data parallelism).
        clusters: the token clusters of ``clustered_tokens`` (unequal loads).
        seed: every rank builds the same weights and batches from it.
        collective_timeout_s: a collective waiting longer raises.
    """

    world_size: int = 4
    width: int = 16
    ffn: int = 32
    num_experts: int = 8
    top_k: int = 2
    tokens_per_rank: int = 32
    clusters: int = 4
    seed: int = 0
    collective_timeout_s: int = 60


def check_expert_parallel_config(config: ExpertParallelConfig) -> ExpertParallelConfig:
    """Return ``config`` if the experts split over its ranks; a ValueError that says what was expected otherwise.

    Checked: every field a positive int (the seed >= 0), at least 2 ranks, ``num_experts`` divisible by
    ``world_size`` (each rank holds the same experts' count), ``top_k <= num_experts``.
    """
    for item in fields(config):
        (non_negative_int if item.name == "seed" else positive_int)(item.name, getattr(config, item.name))
    if config.world_size < 2:
        raise ValueError(f"world_size = {config.world_size}: expert parallelism needs at least 2 ranks")
    if config.num_experts % config.world_size:
        raise ValueError(f"{config.num_experts} experts cannot be split over {config.world_size} ranks: expected "
                         f"num_experts divisible by world_size (each rank holds the same number of experts)")
    if config.top_k > config.num_experts:
        raise ValueError(f"top_k = {config.top_k} experts per token, but there are {config.num_experts}: expected "
                         "top_k <= num_experts")
    return config


@dataclass
class ExpertParallelRun:
    """What ``launch_expert_parallel`` returns: each rank's record (by rank), the launch's wall time, the folder."""

    ranks: list[dict]
    seconds: float
    out: Path
    config: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)


# One fresh Python imports torch and FSDP2 once, then forks the ranks from itself (utils.expert_parallel_ranks's
# serve_ranks): never a fork of the caller, which may be a Jupyter kernel with threads running
_SERVER_BOOT = ("import sys\n"
                "sys.path.insert(0, sys.argv[1])\n"
                "from utils.expert_parallel_ranks import serve_ranks\n"
                "sys.exit(serve_ranks(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))\n")


def script_arguments(config: ExpertParallelConfig, out: Path | str) -> list[str]:
    """The command-line arguments of ``python -m utils.expert_parallel_ranks`` for ``config``."""
    return [f"--out={out}"] + [f"--{name.replace('_', '-')}={value}" for name, value in asdict(config).items()
                               if name != "world_size"]


def _failure(out: Path, code: int) -> LaunchError:
    failure = out / "failure.json"
    if failure.exists():
        record = json.loads(failure.read_text())
        log = (out / f"rank{record['rank']}.log").read_text().splitlines()
        return LaunchError(f"rank {record['rank']} failed (exit code {record['code']}); the end of its log:\n"
                           + "\n".join(log[-25:]), record["code"], "\n".join(log))
    log = (out / "server.log").read_text()
    return LaunchError(f"the fork server failed (exit code {code}) before its ranks did:\n{log[-2000:]}", code, log)


def launch_expert_parallel(config: ExpertParallelConfig, out: Path | str, *,
                           timeout_s: float = 300.0) -> ExpertParallelRun:
    """Start ``config.world_size`` CPU ranks (gloo) of ``utils.expert_parallel_ranks`` and read their records back.

    Every argument is checked first, so bad input is a ValueError before any process starts. One fresh Python
    imports torch and FSDP2 once and forks the ranks (each told its rank as torchrun tells it: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); each writes ``<out>/rank<r>.json`` and its output to
    ``<out>/rank<r>.log``. A failing rank stops the others at once; past ``timeout_s`` every rank is killed.

    Args:
        config: the model and the run.
        out: a folder for the records and logs (created).
        timeout_s: seconds before every rank is killed.

    Returns:
        An ``ExpertParallelRun``: per rank, the difference from one process, the bytes by category, the
        all-to-all calls with the bytes sent to and received from each rank, the split sizes, the routing.

    Raises:
        ValueError: a configuration the experts cannot be split into (``check_expert_parallel_config``).
        LaunchError: a rank failed (the end of its log in the message) or the launch timed out.

    Example:
        >>> run = launch_expert_parallel(ExpertParallelConfig(world_size=4), "build/ep")
        >>> run.ranks[0]["state_bytes"]["experts"], run.ranks[0]["all_to_all"][0]["sent"]
    """
    check_expert_parallel_config(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / "failure.json", *out.glob("rank*.json")]:
        stale.unlink(missing_ok=True)
    environment = {**os.environ, "WORLD_SIZE": str(config.world_size), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    root = str(Path(__file__).resolve().parent.parent)
    began = time.perf_counter()
    with open(out / "server.log", "w") as log:      # the server and its ranks form a session, killed together
        server = subprocess.Popen([sys.executable, "-c", _SERVER_BOOT, root, str(config.world_size), str(out),
                                   *script_arguments(config, out)], stdout=log, stderr=subprocess.STDOUT,
                                  env=environment, start_new_session=True)
    try:
        while server.poll() is None:
            if time.perf_counter() - began > timeout_s:
                raise LaunchError(f"the ranks did not finish in {timeout_s} s and were killed", None, "")
            time.sleep(0.05)
        if server.returncode != 0:
            raise _failure(out, server.returncode)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(config.world_size)]
    return ExpertParallelRun(ranks=ranks, seconds=time.perf_counter() - began, out=out, config=config)
