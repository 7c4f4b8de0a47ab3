"""A Hugging Face Trainer that survives preemption, bit for bit: one line more than usual.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/hf_trainer.py \\
        --steps 200 --output-dir hf-out

`slurmddp.integrations.transformers.train(trainer)` replaces ``trainer.train()``: on a stop the
Trainer saves its own checkpoint and the job is requeued; the next run resumes from the newest
checkpoint in ``--output-dir`` (the Trainer restores model, optimizer, scheduler, RNG and data
position). With ``--snapshot-every N`` that state is also kept in the nodes' memory every N
steps (within 2% of the training's time), and a rank killed resumes from the newest snapshot
instead of the last checkpoint. The model is a tiny GPT-2 built from its config: nothing
downloads. Every rank prints ``RESULT {...}`` with a digest of its final parameters.
"""

import argparse
import hashlib
import json
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from slurmddp.integrations.transformers import train


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences: the same data on every run."""

    def __init__(self, n: int = 512, length: int = 16) -> None:
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Masked(Tokens):
    """Random augmentation: a token in eight replaced by a random one, as each sample is read."""

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i].clone()
        where = torch.rand(ids.shape) < 0.125
        ids[where] = torch.randint(0, 64, (int(where.sum()),))
        return {"input_ids": ids, "labels": self.ids[i]}


class Pace(TrainerCallback):
    """Extra seconds per step (so a test can preempt mid-training) and a line every N steps."""

    def __init__(self, step_time: float, log_every: int) -> None:
        self.step_time, self.log_every = step_time, log_every

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.step_time)
        if state.is_world_process_zero and state.global_step % self.log_every == 0:
            print(f"step {state.global_step} ", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--output-dir", default="hf-out")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--augment", action="store_true", help="random token replacement")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="keep a snapshot in the nodes' memory every N steps (0: none)")
    p.add_argument("--snapshot-budget", type=lambda v: None if v == "none" else float(v),
                   default=0.02, help="the fraction of the training's time snapshots may take "
                   "(spaced wider if they would take more); none: every N steps whatever they cost")
    opts = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = TrainingArguments(
        output_dir=opts.output_dir, max_steps=opts.steps, per_device_train_batch_size=8,
        learning_rate=1e-3, save_strategy="no", report_to=[], logging_strategy="no",
        use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=opts.workers,
    )
    data = Masked() if opts.augment else Tokens()
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data,
                      callbacks=[Pace(opts.step_time, opts.log_every)])
    train(trainer, snapshot_every=opts.snapshot_every, snapshot_budget=opts.snapshot_budget)

    flat = torch.cat([q.detach().cpu().flatten() for q in trainer.model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    rank = trainer.args.process_index
    result = {"rank": rank, "steps": trainer.state.global_step, "digest": digest,
              "finite": bool(flat.isfinite().all())}
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
