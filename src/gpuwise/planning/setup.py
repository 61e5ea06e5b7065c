"""What the user wants to run: ``Request`` holds what they gave (None: not given), ``resolve`` decides the rest once,
and the ``Setup`` it returns holds every choice.

>>> resolve(Request(batch=32, micro_batch=4, gpus=2)).grad_accum
4
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal, get_args

from gpuwise.errors import GpuwiseError
from gpuwise.precision import PRECISIONS, Precision, PrecisionSpec

if TYPE_CHECKING:  # not imported at run time: the CLI validates a Setup before it loads torch
    import torch

Task = Literal["train", "finetune-lora", "infer", "decode"]  # decode: one generation step over a filled KV cache
Optimizer = Literal["adamw", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "lion"]  # capture/optimizers.py
Checkpointing = Literal["none", "full", "selective"]  # selective: torchtitan's op-level policy (transforms/)
Sharding = Literal["ddp", "zero1", "zero2", "fsdp"]
# How attention runs (sources/: zoo.py, hf.py): eager, the math path (q @ k^T, softmax, @ v: the s x s scores kept);
# sdpa, PyTorch's scaled_dot_product_attention; flash, FlashAttention-2 (transformers' "flash_attention_2"); flex,
# FlexAttention (transformers' "flex_attention"); gpuwise, gpuwise.ops.attention (the built-in GPT and Llama). flash and
# flex are captured through SDPA, whose CPU flash kernel keeps what the CUDA kernels keep (the output and logsumexp)
Attention = Literal["sdpa", "eager", "flash", "flex", "gpuwise"]
QLoRARecipe = Literal["peft", "plain"]
# weight-only formats of inference (transforms/quantize.py: storage as the libraries lay it out); bf16 and fp16 hold the
# weights as the step computes (the default)
Weights = Literal["bf16", "fp16", "fp8", "int8", "int4", "nf4"]
# --task decode's KV cache storage (vLLM's --kv-cache-dtype: auto is the model's dtype; fp8 is fp8_e4m3 on CUDA);
# planning/cost/kv_cache.py sizes it
KvDtype = Literal["auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"]
Loss = Literal["standard", "chunked", "fused"]  # gpuwise.models.loss
Offload = Literal["none", "optimizer", "params"]  # parallel/sharding.py: ZeRO-Offload, FSDP2's CPUOffloadPolicy

MAX_BATCH = 1 << 20
MAX_ACCUM = 1 << 16
MAX_AUDIO_SECONDS = 3600  # an hour of audio a sample


def _choice(field: str, value: str, kind: object) -> None:
    allowed = get_args(kind)
    if value not in allowed:
        raise GpuwiseError(f"--{field.replace('_', '-')} {value!r} is not one of {', '.join(allowed)}",
                           f"pass --{field.replace('_', '-')} {allowed[0]}")


def data_parallel(gpus: int, tp: int, pp: int, cp: int) -> int:
    """The data-parallel degree of ``gpus`` GPUs split ``tp x pp x cp`` ways; they must divide it."""
    group = tp * pp * cp
    if gpus % group:
        raise GpuwiseError(f"--gpus {gpus} is not a multiple of --tp {tp} x --pp {pp} x --cp {cp} = {group}",
                           f"pass --gpus {group * max(gpus // group, 1)}")
    return gpus // group


def _positive(field: str, value: int | None, limit: int) -> None:
    if value is not None and not 1 <= value <= limit:
        raise GpuwiseError(f"--{field.replace('_', '-')} {value} is outside 1..{limit}",
                           f"pass a whole number from 1 to {limit}")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One training or inference step as the user would run it.

    >>> Setup(micro_batch=8, precision="bf16-mixed").compute_dtype
    torch.bfloat16
    """

    task: Task = "train"
    micro_batch: int = 1  # samples per GPU per forward; the global batch is micro_batch x grad_accum x dp
    seq: int | None = None  # tokens; None = the model's default
    image_size: int | None = None  # pixels per side; None = the model's default
    audio_seconds: float | None = None  # a speech model's clip length (hf_audio.py); None = its default
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    optimizer_in_backward: bool = False  # each parameter steps as soon as its gradient is ready (no accumulation)
    checkpointing: Checkpointing = "none"
    grad_accum: int = 1
    gpus: int = 1
    sharding: Sharding = "ddp"
    lora_rank: int = 16  # used by finetune-lora
    qlora: bool = False  # finetune-lora with the frozen base stored in 4 bits (NF4 + double quantisation)
    lora_targets: str | None = None  # finetune-lora: which layers (transforms/); None = every linear in the blocks
    lora_dropout: float = 0.0  # finetune-lora: PEFT's lora_dropout on each adapter's input
    # --qlora: "peft" as Hugging Face PEFT's prepare_model_for_kbit_training leaves the model (every weight not in
    # 4 bits up-cast to fp32, gradient checkpointing on unless --checkpointing says otherwise), or "plain": loaded
    # in the compute dtype and used as it is (litgpt, torchtune, Unsloth, PEFT without that call)
    qlora_recipe: QLoRARecipe = "peft"
    # None: the model's own (an --hf-config's attn_implementation, else sdpa); ``source.attention(setup)`` (zoo.py,
    # hf.py) names the implementation it runs, the one the cost model prices
    attention: Attention | None = None
    # a decoder LM's training loss: logits up-cast whole (transformers), torchtune's chunked cross-entropy, or a
    # fused linear + cross-entropy as Liger runs it (gpuwise.models.loss)
    loss: Loss = "standard"
    # --task decode: tokens already in each sequence's KV cache; the step feeds one more (None: the model's default
    # sequence length)
    context: int | None = None
    weights: Weights | None = None  # inference: the blocks' linear layers quantised (quantize.py); None: as computed
    kv_dtype: KvDtype | None = None  # --task decode: the KV cache stored in this dtype; None: as computed (auto)
    # Model parallelism (planning/parallel/): --gpus is the total, data-parallel over gpus / (tp x pp x cp).
    tp: int = 1  # tensor parallel: Megatron's column/row-parallel block, heads and vocabulary split tp ways
    pp: int = 1  # pipeline parallel, 1F1B: each stage holds layers / pp blocks, stage i keeps pp - i micro-batches
    cp: int = 1  # context parallel: ring attention over the sequence split cp ways
    # expert parallel (torchtitan's EP): the routed experts split ep ways over the data- and context-parallel ranks
    # (ep divides dp_shard x cp; --gpus is unchanged), tokens exchanged by all-to-all (planning/parallel/)
    ep: int = 1
    # the busiest expert's routed tokens over its balanced share (a capacity factor, Switch Transformer sec. 2.2)
    moe_imbalance: float = 1.0
    sp: bool = False  # sequence parallel with --tp: norms and the residual stream split along the sequence too
    nodes: int = 1  # HSDP: --sharding fsdp shards within each node and replicates across nodes
    offload: Offload = "none"  # model states in host memory: the optimizer's (ZeRO-Offload), or all (FSDP2)
    # each block through torch.compile (AOTAutograd's graphs, inductor's fusion): training, or an inference forward
    compile: bool = False
    stage: int | None = None  # the pipeline stage a capture is of; None: the worst one (the planner picks it)

    def __post_init__(self) -> None:
        _choice("task", self.task, Task)
        _choice("precision", self.precision, Precision)
        _choice("optimizer", self.optimizer, Optimizer)
        _choice("checkpointing", self.checkpointing, Checkpointing)
        _choice("sharding", self.sharding, Sharding)
        if self.attention is not None:
            _choice("attention", self.attention, Attention)
        if self.attention == "flash" and self.spec.compute not in ("fp16", "bf16"):
            raise GpuwiseError(f"--attention flash runs FlashAttention-2, which takes fp16 and bf16 only, not "
                               f"--precision {self.precision}", "pass --precision bf16-mixed, or --attention sdpa")
        _choice("loss", self.loss, Loss)
        if self.spec.float8 and self.task != "train":
            raise GpuwiseError(f"--precision fp8 is float8 training (torchao's Float8Linear), not --task {self.task}",
                               "use --precision bf16-mixed" + (" (--weights fp8 stores inference weights in fp8)"
                                                               if not self.training else ""))
        if self.loss != "standard" and not self.training:
            raise GpuwiseError(f"--loss {self.loss} has no meaning for --task {self.task}",
                               "drop --loss, or plan --task train")
        _positive("micro_batch", self.micro_batch, MAX_BATCH)
        _positive("seq", self.seq, 1 << 24)
        _positive("image_size", self.image_size, 1 << 14)
        if self.audio_seconds is not None and not (math.isfinite(self.audio_seconds)
                                                   and 0 < self.audio_seconds <= MAX_AUDIO_SECONDS):
            raise GpuwiseError(f"--audio-seconds {self.audio_seconds:g} is outside (0, {MAX_AUDIO_SECONDS}]",
                               "pass the clip length in seconds, e.g. --audio-seconds 10")
        _positive("grad_accum", self.grad_accum, MAX_ACCUM)
        _positive("gpus", self.gpus, 1 << 16)
        _positive("lora_rank", self.lora_rank, 1 << 14)
        self._check_inference()
        if self.qlora and self.task != "finetune-lora":
            raise GpuwiseError("--qlora quantises the frozen base of a LoRA fine-tune", "add --task finetune-lora")
        self._check_lora()
        self._check_parallel()
        if self.compile and self.task == "decode":
            raise GpuwiseError("--compile with --task decode is not simulated: a compiled step updates the KV cache in "
                               "place, which the traced graph would copy whole", "drop --compile (a decode step reads "
                               "the weights and the cache: fusion changes little), or plan --task infer --compile")
        if not self.training:
            for flag, bad in (("--batch above --micro-batch (accumulation)", self.grad_accum != 1),
                              (f"--checkpointing {self.checkpointing}", self.checkpointing != "none"),
                              ("--sharding", self.sharding != "ddp"), ("--gpus", self.gpus != 1)):
                if bad:
                    raise GpuwiseError(f"{flag} has no meaning for --task {self.task}",
                                       f"drop {flag.split()[0]}, or plan --task train")
        if self.optimizer_in_backward:
            if not self.training:
                raise GpuwiseError(f"--optimizer-in-backward has no meaning for --task {self.task}",
                                   "drop --optimizer-in-backward, or plan --task train")
            if self.grad_accum > 1:
                raise GpuwiseError(f"--optimizer-in-backward steps every micro-batch, so it cannot accumulate "
                                   f"{self.grad_accum} of them", "pass --micro-batch equal to --batch / --gpus, "
                                   "or drop --optimizer-in-backward")
            if self.gpus > 1:
                raise GpuwiseError(f"--optimizer-in-backward is planned on one GPU, not {self.gpus} (stepping "
                                   "inside a sharded or bucketed reduction is not modelled)",
                                   "drop --gpus and --sharding, or drop --optimizer-in-backward")
        if self.sharding != "ddp" and self.gpus == 1:
            raise GpuwiseError(f"--sharding {self.sharding} shards over GPUs but --gpus is 1",
                               "add --gpus N with N > 1")

    def _check_inference(self) -> None:
        """--context and --weights: a decode step's cache, and weight-only quantisation, for inference only."""
        _positive("context", self.context, 1 << 24)
        if self.context is not None and self.task != "decode":
            raise GpuwiseError(f"--context is the KV cache of a decode step, not of --task {self.task}",
                               "add --task decode, or drop --context (--seq sizes the other tasks)")
        if self.task == "decode" and self.seq is not None:
            raise GpuwiseError("--seq has no meaning for --task decode: the step feeds one token per sequence",
                               f"pass --context {self.seq} (the tokens already in the KV cache)")
        if self.kv_dtype is not None:
            _choice("kv_dtype", self.kv_dtype, KvDtype)
            if self.task != "decode":
                raise GpuwiseError(f"--kv-dtype {self.kv_dtype} is the KV cache of a decode step, not of --task "
                                   f"{self.task}", "add --task decode, or drop --kv-dtype")
        if self.weights is None:
            return
        if self.weights == "q4_k_m":
            raise GpuwiseError("--weights q4_k_m (llama.cpp) is ranked by gpuwise recommend --serve, not simulated",
                               "pass --weights int4 (AWQ/GPTQ) or nf4 (bitsandbytes)")
        _choice("weights", self.weights, Weights)
        if self.training:
            raise GpuwiseError(f"--weights {self.weights} quantises an inference model, not --task {self.task}",
                               "plan --task infer or --task decode, or for a 4-bit fine-tune --task finetune-lora "
                               "--qlora")
        if self.weights in ("bf16", "fp16") and self.weights != self.spec.compute:
            raise GpuwiseError(f"--weights {self.weights} is not how --precision {self.precision} computes",
                               f"pass --precision {self.weights if self.weights == 'bf16' else 'fp16-mixed'}, "
                               "or drop --weights")

    @property
    def quantized(self) -> bool:
        """Weight-only quantisation: the blocks' linear layers stored in fewer bits than the step computes in."""
        return self.weights not in (None, "bf16", "fp16")

    def _check_lora(self) -> None:
        _choice("qlora_recipe", self.qlora_recipe, QLoRARecipe)
        for flag, given in (("--lora-targets", self.lora_targets is not None), ("--lora-dropout", self.lora_dropout)):
            if given and self.task != "finetune-lora":
                raise GpuwiseError(f"{flag} applies to LoRA fine-tuning", "add --task finetune-lora")
        if self.qlora_recipe != "peft" and not self.qlora:
            raise GpuwiseError(f"--qlora-recipe {self.qlora_recipe} applies to --qlora", "add --qlora")
        if not 0 <= self.lora_dropout < 1:
            raise GpuwiseError(f"--lora-dropout {self.lora_dropout:g} is outside [0, 1)",
                               "pass e.g. --lora-dropout 0.05")
        if self.lora_targets is not None:
            from gpuwise.planning.transforms.targets import check_targets

            check_targets(self.lora_targets)

    def _check_parallel(self) -> None:
        for name in ("tp", "pp", "cp", "nodes"):
            _positive(name, getattr(self, name), 1 << 12)
        _choice("offload", self.offload, Offload)
        if self.parallel and not self.training:
            flags = " ".join(f"--{k} {n}" for k, n in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)) if n > 1)
            raise GpuwiseError(f"{flags}: tensor/pipeline/context parallelism is planned for training, not --task "
                               f"{self.task}", "for serving a model that does not fit one GPU use --weights int8|nf4, "
                               "or gpuwise recommend --serve")
        data_parallel(self.gpus, self.tp, self.pp, self.cp)
        self._check_experts()
        if self.cp > 1 and self.attention in ("eager", "gpuwise"):
            raise GpuwiseError(f"--cp {self.cp} runs ring attention through SDPA's flash kernel (torchtitan's "
                               f"context_parallel), not --attention {self.attention}",
                               "pass --attention sdpa (or flash), or drop --cp")
        if self.sp and self.tp == 1:
            raise GpuwiseError("--sequence-parallel splits the sequence over the --tp group", "add --tp N")
        if self.stage is not None and not 0 <= self.stage < self.pp:
            raise ValueError(f"stage {self.stage} is outside 0..{self.pp - 1}")  # the planner's, never the user's
        if self.nodes > 1:
            if self.sharding != "fsdp":
                raise GpuwiseError(f"--nodes {self.nodes} plans HSDP, which shards with fsdp, not {self.sharding}",
                                   "add --sharding fsdp, or drop --nodes")
            if self.dp % self.nodes:
                fit = [m for m in range(2, self.dp + 1) if self.dp % m == 0]
                raise GpuwiseError(f"HSDP replicates over --nodes {self.nodes}, which does not divide the "
                                   f"data-parallel degree {self.dp}",
                                   f"pass --nodes {' or '.join(map(str, fit[:4]))}" if fit else "drop --nodes")
        if self.offload != "none":
            if not self.training:
                raise GpuwiseError(f"--offload {self.offload} moves training state to the host; --task "
                                   f"{self.task} has none", "drop --offload")
            if self.offload == "params" and self.sharding != "fsdp":
                raise GpuwiseError("--offload params offloads FSDP's sharded parameters (CPUOffloadPolicy)",
                                   "add --sharding fsdp (with --gpus N), or pass --offload optimizer")
            if self.offload == "optimizer" and self.sharding == "ddp" and self.dp > 1:
                raise GpuwiseError("--offload optimizer runs ZeRO-Offload, which shards the optimizer first",
                                   "add --sharding zero2 (or fsdp)")
            if self.optimizer_in_backward:
                raise GpuwiseError("--offload and --optimizer-in-backward both move the optimizer step",
                                   "drop one of them")
            if self.optimizer in ("adamw8bit", "paged-adamw8bit"):
                raise GpuwiseError(f"--offload {self.offload} runs the optimizer step on the host (DeepSpeed's CPU "
                                   f"Adam, FSDP2's CPU step), where bitsandbytes' {self.optimizer} cannot run",
                                   "pass --optimizer adamw, or drop --offload")

    def _check_experts(self) -> None:
        """--ep and --moe-imbalance, as far as the setup alone can tell (the model's experts: parallel.rank.check)."""
        _positive("ep", self.ep, 1 << 12)
        f = self.moe_imbalance
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1:
            raise GpuwiseError(f"--moe-imbalance {f} is not a finite number of at least 1 (the busiest expert's "
                               "tokens over its balanced share)", "pass e.g. --moe-imbalance 1.25, or drop it")
        if self.ep == 1:
            return
        if self.task != "train":
            raise GpuwiseError(f"--ep {self.ep}: expert parallelism is planned for --task train, not --task "
                               f"{self.task}", "drop --ep" + (" (LoRA freezes the experts)"
                                                              if self.task == "finetune-lora" else ""))
        group = self.dp // self.nodes * self.cp  # torchtitan: ep divides dp_shard x cp
        if group % self.ep:
            fit = [m for m in range(2, group + 1) if group % m == 0]
            raise GpuwiseError(f"--ep {self.ep} does not divide the {group} data-parallel"
                               + (" x context-parallel" if self.cp > 1 else "") + " GPUs it borrows"
                               + (" (within a node under --nodes)" if self.nodes > 1 else ""),
                               f"pass --ep {' or '.join(map(str, fit[:4]))}" if fit
                               else "add --gpus: expert parallelism splits the data-parallel GPUs")

    @property
    def dp(self) -> int:
        """The data-parallel degree: the GPUs over the tensor, pipeline and context-parallel group."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def pipeline_bubble(self) -> float:
        """The share of a step each pipeline stage idles under 1F1B: (pp - 1) of the (m + pp - 1) slots, m the
        micro-batches of a step (Narayanan et al. 2021, sec. 2.2); 0 without --pp. The one place that decides."""
        return (self.pp - 1) / (self.grad_accum + self.pp - 1)

    @property
    def shard_gpus(self) -> int:
        """The GPUs the model states are sharded over: the data-parallel group (with the context-parallel ranks,
        which hold the same parameters: torchtitan's ``dp_shard_cp`` mesh), within a node under HSDP."""
        return self.dp // self.nodes * self.cp

    @property
    def parallel(self) -> bool:
        """Tensor, pipeline or context parallelism: a capture of one GPU's slice of the model."""
        return self.tp * self.pp * self.cp > 1

    @property
    def peft_qlora(self) -> bool:
        """QLoRA as PEFT's prepare_model_for_kbit_training leaves it: the weights not in 4 bits in fp32."""
        return self.task == "finetune-lora" and self.qlora and self.qlora_recipe == "peft"

    @property
    def training(self) -> bool:
        return self.task not in ("infer", "decode")

    @property
    def spec(self) -> PrecisionSpec:
        return PRECISIONS[self.precision]

    @property
    def mixed(self) -> bool:
        """Autocast over fp32 weights."""
        return self.spec.autocast

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.spec.compute_dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """Trainable weights: fp32 under autocast (they are the master copy), else the compute dtype."""
        return self.spec.weight_dtype

    @property
    def input_dtype(self) -> torch.dtype:
        """Floating-point inputs arrive as the model's weights are stored: autocast casts them from fp32 in
        training; a frozen (inference) model holds its weights in the compute dtype; QLoRA as PEFT prepares it
        holds every weight outside the 4-bit layers in fp32 (a ViT's patch embedding, say), so its inputs are fp32."""
        if self.peft_qlora:
            import torch

            return torch.float32
        return self.spec.weight_dtype if self.training else self.spec.compute_dtype

    @property
    def batch(self) -> int:
        """The global batch: samples per optimizer step over every GPU."""
        return self.micro_batch * self.grad_accum * self.dp

    @staticmethod
    def recipe_defaults(given: dict) -> dict:
        """The options a CLI gathered (None: not given), with what the recipe implies where the user said nothing:
        ``--qlora`` as PEFT runs it turns gradient checkpointing on (prepare_model_for_kbit_training's
        ``use_gradient_checkpointing=True``), unless ``--checkpointing`` was given."""
        peft = given.get("qlora") and given.get("qlora_recipe") in (None, "peft")
        if peft and given.get("checkpointing") is None and given.get("task") == "finetune-lora":
            return {**given, "checkpointing": "full"}
        return given

    @classmethod
    def for_batch(cls, *, batch: int | None = None, micro_batch: int | None = None, gpus: int = 1,
                  **rest) -> Setup:
        """The one translation from what people give (a global ``--batch``, a per-GPU ``--micro-batch``, or
        both) to a Setup: the accumulation is what is left, ``batch / (micro_batch x data-parallel GPUs)``.

        >>> Setup.for_batch(batch=32, micro_batch=4, gpus=2).grad_accum
        4
        """
        _positive("batch", batch, 1 << 30)
        _positive("micro_batch", micro_batch, MAX_BATCH)
        _positive("gpus", gpus, 1 << 16)
        if batch is None:
            return cls(micro_batch=micro_batch or 1, gpus=gpus, **rest)
        dp = data_parallel(gpus, rest.get("tp", 1), rest.get("pp", 1), rest.get("cp", 1))
        micro = micro_batch or batch // dp
        if micro == 0 or batch % (micro * dp):
            per = " ".join(([f"over {dp} data-parallel GPUs"] if dp > 1 else [])
                           + ([f"in micro-batches of {micro}"] if micro_batch else []))
            raise GpuwiseError(f"--batch {batch} does not split evenly {per}",
                               f"pass a --batch that is a multiple of {micro * dp if micro else dp}")
        return cls(micro_batch=micro, grad_accum=batch // (micro * dp), gpus=gpus, **rest)

    def describe(self) -> str:
        replicas = f"{self.dp} GPUs" if self.dp == self.gpus else f"{self.dp} data-parallel groups"
        split = ([f"micro-batch {self.micro_batch}"] + ([f"{self.grad_accum} accumulation"] if self.grad_accum > 1
                                                        else []) + ([replicas] if self.dp > 1 else []))
        parts = [self.task, f"batch {self.batch}" + (f" ({' x '.join(split)})" if len(split) > 1 else "")]
        parts.append(self.precision)
        if self.training:
            parts += [self.optimizer + (" in backward" if self.optimizer_in_backward else ""),
                      f"checkpointing {self.checkpointing}"]
        if self.task == "finetune-lora":
            lora = f"{'QLoRA' if self.qlora else 'LoRA'} rank {self.lora_rank}"
            if self.lora_targets is not None:
                lora += f" on {self.lora_targets}"
            if self.lora_dropout:
                lora += f", dropout {self.lora_dropout:g}"
            if self.qlora:
                lora += " (PEFT: fp32 outside the 4-bit layers)" if self.qlora_recipe == "peft" else " (plain)"
            parts.append(lora)
        if self.task == "decode":
            parts.append(f"{self.context:,} tokens cached" if self.context is not None else "default context cached")
        if self.kv_dtype not in (None, "auto"):
            parts.append(f"{self.kv_dtype} KV cache")
        if self.quantized:
            parts.append(f"{self.weights} weights")
        if self.gpus > 1:
            hsdp = f" (HSDP: {self.nodes} nodes x {self.shard_gpus})" if self.nodes > 1 else ""
            model = [f"{k} {n}" + (" (+sp)" if k == "tp" and self.sp else "")
                     for k, n in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)) if n > 1]
            ep = f" (ep {self.ep})" if self.ep > 1 else ""
            if not model:  # data parallel only: "8 GPUs fsdp"
                parts.append(f"{self.gpus} GPUs {self.sharding}{hsdp}{ep}")
            else:  # "16 GPUs: fsdp 2 x tp 8"
                data = [f"{self.sharding} {self.dp}{hsdp}"] if self.dp > 1 else []
                over_cp = self.dp == 1 and self.sharding != "ddp" and self.cp > 1  # states sharded over the cp ranks
                parts.append(f"{self.gpus} GPUs: " + " x ".join(data + model)
                             + (f", {self.sharding} over the {self.cp} cp ranks" if over_cp else "") + ep)
        if self.offload != "none":
            parts.append(f"{self.offload} offloaded to the host")
        if self.moe_imbalance != 1:
            parts.append(f"MoE imbalance {self.moe_imbalance:g}")
        if self.compile:
            parts.append("compiled blocks")
        if self.loss != "standard":
            parts.append({"chunked": "chunked cross-entropy", "fused": "fused linear + cross-entropy"}[self.loss])
        return " · ".join(p for p in parts if p)


@dataclass(frozen=True, kw_only=True)
class Request:
    """What the user gave, flag by flag, before anything is decided: None is "not given" (a flag's default is the
    Setup's, never restated here). ``batch`` is the global batch; ``gpus`` None is the parallel degrees' product.

    >>> resolve(Request(task="finetune-lora", qlora=True)).checkpointing   # PEFT's recipe turns it on
    'full'
    """

    task: str | None = None
    batch: int | None = None
    micro_batch: int | None = None
    gpus: int | None = None
    seq: int | None = None
    image_size: int | None = None
    audio_seconds: float | None = None
    precision: str | None = None
    optimizer: str | None = None
    optimizer_in_backward: bool | None = None
    checkpointing: str | None = None
    sharding: str | None = None
    lora_rank: int | None = None
    qlora: bool | None = None
    lora_targets: str | None = None
    lora_dropout: float | None = None
    qlora_recipe: str | None = None
    attention: str | None = None
    loss: str | None = None
    compile: bool | None = None
    weights: str | None = None
    context: int | None = None
    kv_dtype: str | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    moe_imbalance: float | None = None
    sp: bool | None = None
    nodes: int | None = None
    offload: str | None = None


def resolve(request: Request) -> Setup:
    """The one translation from what the user gave to the run: flags that mean nothing for the task are refused,
    ``--gpus`` defaults to ``tp x pp x cp x ep``, the recipe's implications apply (``Setup.recipe_defaults``), and the
    global batch splits into micro-batch x accumulation x data-parallel (``Setup.for_batch``). Raises GpuwiseError,
    one line and its fix, before anything loads torch."""
    r = request
    training_only = [f for f, v in (("--optimizer", r.optimizer), ("--optimizer-in-backward", r.optimizer_in_backward),
                                    ("--checkpointing", r.checkpointing)) if v not in (None, False)]
    if r.task in ("infer", "decode") and training_only:
        raise GpuwiseError(f"{training_only[0]} has no meaning for --task {r.task}", f"drop {training_only[0]}")
    lora_given = lora_flags(r)
    if lora_given and r.task != "finetune-lora":
        raise GpuwiseError(f"{lora_given[0].split()[0]} applies to LoRA fine-tuning", "add --task finetune-lora")
    for name in ("tp", "pp", "cp", "ep"):  # before the --gpus they make
        _positive(name, getattr(r, name), 1 << 12)
    gpus = r.gpus or (r.tp or 1) * (r.pp or 1) * (r.cp or 1) * (r.ep or 1)
    given = {f.name: getattr(r, f.name) for f in fields(r) if f.name not in ("batch", "micro_batch", "gpus")}
    given = {k: v if v is not False else None for k, v in Setup.recipe_defaults(given).items()}
    return Setup.for_batch(batch=r.batch, micro_batch=r.micro_batch, gpus=gpus,
                           **{k: v for k, v in given.items() if v is not None})


def largest_micro_batch(per_rank: int, limit: int) -> int:
    """The largest micro-batch of at most ``limit`` samples that divides ``per_rank`` (0 if ``limit`` < 1): the one rule
    for splitting a process's batch into micro-batch x accumulation, used by the remedies, recommend, ``train``'s
    automatic choice and its OOM retry."""
    return next((m for m in range(min(limit, per_rank), 0, -1) if per_rank % m == 0), 0)


def lora_flags(request: Request) -> list[str]:
    """The LoRA fine-tuning flags ``request`` gives, as typed (``--lora-rank 8``; ``--qlora`` bare), in one order:
    what ``resolve`` refuses without --task finetune-lora and ``gpuwise train`` refuses as plan only."""
    r = request
    given = (("--qlora", r.qlora or None), ("--lora-rank", r.lora_rank), ("--lora-targets", r.lora_targets),
             ("--lora-dropout", r.lora_dropout), ("--qlora-recipe", r.qlora_recipe))
    return [flag if flag == "--qlora" else f"{flag} {value}" for flag, value in given if value is not None]
