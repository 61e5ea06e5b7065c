"""The built-in zoo's models (gpuwise.models) as a source: ``--model NAME``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpuwise.errors import GpuwiseError
from gpuwise.models import ZooModel
from gpuwise.planning.setup import Attention, Setup
from gpuwise.planning.sources.base import Built, Decoder, check_decode

# --attention -> the built-in models' attn_impl (models/common.py): flash and flex run as SDPA, whose CPU flash kernel
# keeps what the CUDA flash kernels keep (the output and logsumexp); the Setup still names the kernel priced
_RUNS_AS = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa", "flex": "sdpa", "gpuwise": "gpuwise"}


@dataclass(frozen=True, kw_only=True)
class ZooSource:
    zoo: ZooModel

    @property
    def name(self) -> str:
        return self.zoo.name

    @property
    def max_positions(self) -> int | None:
        """The longest sequence its learned positions allow (None: rotary or no positions)."""
        return self.zoo.max_seq

    @property
    def decoder(self) -> Decoder | None:
        """The KV-cache dimensions of a decoder-only language model (None for the others)."""
        c = self.zoo.config
        if self.zoo.family != "decoder":
            return None
        width = getattr(c, "dim", None) or c.n_embd
        return Decoder(layers=c.n_layer, heads=c.n_head, kv_heads=getattr(c, "n_kv_head", c.n_head),
                       head_dim=width // c.n_head)

    @property
    def n_layer(self) -> int | None:
        return self.zoo.n_layer

    layer_kinds = None  # the zoo's stacks are of identical blocks

    def check(self, setup: Setup) -> None:
        z = self.zoo
        if setup.audio_seconds is not None:
            raise GpuwiseError(f"--audio-seconds applies to speech models (--hf-config), not {z.name}",
                               "drop --audio-seconds")
        if setup.task == "decode":
            check_decode(z.name, self.decoder is not None, self.context(setup), z.max_seq)
        if setup.attention not in (None, "sdpa") and not hasattr(z.config, "attn_impl"):
            raise GpuwiseError(f"--attention {setup.attention} applies to the GPT and Llama models, not {z.name}",
                               "drop --attention")
        if setup.loss != "standard" and z.family != "decoder":
            raise GpuwiseError(f"--loss {setup.loss} applies to decoder language models (GPT, Llama, a causal LM "
                               f"--hf-config), not {z.name}", "drop --loss")
        if setup.seq is not None and z.inputs != "tokens":
            raise GpuwiseError(f"--seq does not apply to {z.name}, which takes {z.inputs}",
                               "use --image-size for image models" if z.inputs == "image" else "drop --seq")
        if setup.image_size is not None and z.inputs != "image":
            raise GpuwiseError(f"--image-size does not apply to {z.name}, which takes {z.inputs}",
                               "use --seq for language models" if z.inputs == "tokens" else "drop --image-size")
        if setup.seq is not None and z.max_seq is not None and setup.seq > z.max_seq:
            raise GpuwiseError(f"--seq {setup.seq} is longer than {z.name}'s {z.max_seq} learned positions",
                               f"pass --seq {z.max_seq} or less")
        if setup.image_size is not None and z.name.startswith("vit") and setup.image_size != z.default_image_size:
            raise GpuwiseError(f"{z.name} has learned positions for {z.default_image_size}px images only",
                               f"pass --image-size {z.default_image_size}")
        if setup.image_size is not None and setup.image_size < 32:
            raise GpuwiseError(f"--image-size {setup.image_size} is too small for {z.name}",
                               "pass --image-size 32 or more")

    def attention(self, setup: Setup) -> Attention:
        """The attention implementation ``setup`` runs: --attention, else SDPA (the built-in models call it)."""
        return setup.attention or "sdpa"

    def tokens(self, setup: Setup) -> int:
        """Tokens (or images, or samples) per micro-batch element; a decode step feeds one token per sequence."""
        if setup.task == "decode":
            return 1
        return (setup.seq or self.zoo.default_seq) if self.zoo.inputs == "tokens" else 1

    def context(self, setup: Setup) -> int:
        """--task decode: the tokens already cached (default: the model's default sequence, within its positions)."""
        default = self.zoo.default_seq or 1
        return setup.context or (min(default, self.zoo.max_seq - 1) if self.zoo.max_seq else default)

    def build(self, setup: Setup, batch: int, n_layer: int | None) -> Built:
        z = self.zoo
        impl = _RUNS_AS[self.attention(setup)]
        if impl != "sdpa":
            z = replace(z, config=replace(z.config, attn_impl=impl))
        if setup.loss != "standard":
            z = replace(z, config=replace(z.config, loss=setup.loss))
        model = z.instantiate(n_layer)
        decode = setup.task == "decode"
        seq = 1 if decode else setup.seq
        inputs, targets = z.make_inputs(batch, seq=seq, image_size=setup.image_size, dtype=setup.input_dtype)
        kv, pos = None, 0
        if decode:  # a static cache (gpt-fast's): room for the N tokens cached and the one this step adds
            pos = self.context(setup)
            kv = model.kv_cache_shape(batch, pos + 1)
        elif not setup.training and z.family == "decoder":
            kv = model.kv_cache_shape(batch, setup.seq or z.default_seq)

        def run(model, inputs, targets, kv_cache):
            if targets is not None:
                return model(*inputs, targets)
            return model(*inputs, kv_cache=kv_cache, pos=pos) if kv_cache is not None else model(*inputs)

        return Built(model=model, inputs=inputs, targets=targets if setup.training else None, run=run,
                     kv_cache_shape=kv)
