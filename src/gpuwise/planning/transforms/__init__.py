"""Changes applied to a model from outside, as the real training or serving script would, shared by plan and train:
LoRA adapters (lora.py, on the layers targets.py's grammar names), QLoRA's 4-bit base (qlora.py), activation
checkpointing of every block (checkpointing.py), weight-only quantisation (quantize.py), float8 training (float8.py)
and torch.compile (compiled.py).
"""
