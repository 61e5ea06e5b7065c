"""The Trainer against the shortest correct hand-written loop, same model, data and steps, on the CPU.

Both run the character GPT of `gpuwise train` for the same steps on the same batches; the ratio of wall
times is the Trainer's overhead (target: <= 1.03). Runs alternate, and the medians are compared.

    python benchmarks/trainer_overhead.py
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from gpuwise.models.gpt import GPT, GPTConfig
from gpuwise.optim import param_groups
from gpuwise.training.config import TrainConfig
from gpuwise.training.data import CharText
from gpuwise.training.loss import model_loss
from gpuwise.training.trainer import Trainer, cosine_with_warmup

STEPS, BATCH, SEQ = 40, 16, 64
DATA = CharText(seq=SEQ)
CFG = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=DATA.vocab_size, block_size=SEQ)


def hand_loop() -> float:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(TrainConfig(steps=STEPS, batch=BATCH)))
    t = time.perf_counter()
    for step in range(STEPS):
        x, y = DATA.batch(step, BATCH)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return time.perf_counter() - t


def trainer_loop() -> float:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    trainer = Trainer(model, opt, DATA, TrainConfig(steps=STEPS, batch=BATCH, log_every=10), loss_fn=model_loss)
    t = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - t


def main() -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {STEPS} steps of batch {BATCH} x {SEQ}")
    hand_loop(), trainer_loop()  # warm up both
    hand, ours = [], []
    for _ in range(5):
        hand.append(hand_loop())
        ours.append(trainer_loop())
    h, o = statistics.median(hand), statistics.median(ours)
    print(f"hand-written loop: {h:.3f} s, Trainer: {o:.3f} s (medians of 5), ratio {o / h:.3f}")


if __name__ == "__main__":
    main()
