#!/usr/bin/env python3
"""Hugging Face Trainer with dos.torch.AdamW: a tiny Llama, checkpoints, resume.

    DOS_SOCKET=/run/dos/dosd.sock python3 hf_trainer.py --workdir /tmp/hf

The model is a Llama-architecture LlamaForCausalLM built from a LlamaConfig (random weights,
nothing downloaded), trained on counting sequences. The optimizer and its scheduler are handed to
the Trainer as `optimizers=(opt, scheduler)`; build the model on its device first, then the
optimizer. The Trainer saves `model.safetensors` through `model.state_dict()` (which waits for a
step still in flight) and `optimizer.pt` through `opt.state_dict()`; `train(resume_from_checkpoint=)`
loads both back. framework_common.py says what is checked.
"""
import inspect
import os
import sys

import torch

import dos.torch
from framework_common import compare_saved, cpu_state, parse_args, report

VOCAB, SEQ, BATCH = 64, 32, 8


def make_model(device, seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(device)


class CountingSequences(torch.utils.data.Dataset):
    """Tokens counting upwards modulo VOCAB with a random start and stride."""

    def __init__(self, n, seed=3):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def training_args(**kw):
    """TrainingArguments with the options this transformers version knows."""
    from transformers import TrainingArguments
    known = inspect.signature(TrainingArguments).parameters
    return TrainingArguments(**{k: v for k, v in kw.items() if k in known})


def train(args, seed, output_dir, resume_from=None):
    from transformers import Trainer

    class RecordingTrainer(Trainer):
        """Records each optimizer step's loss, unrounded (the Trainer's logs round it)."""
        losses = {}

        def compute_loss(self, model, inputs, *a, **kw):
            out = super().compute_loss(model, inputs, *a, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            self.losses[self.state.global_step + 1] = float(loss.detach().mean())  # a vector under DataParallel
            return out

    model = make_model(args.device, seed)
    opt = dos.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, socket=args.socket,
                          client_name="hf-trainer-example", model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2.0 * args.steps))
    targs = training_args(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=BATCH,
        save_strategy="steps", save_steps=args.save_at, save_safetensors=True,
        logging_steps=args.save_at, report_to="none", seed=0, data_seed=0, max_grad_norm=1.0,
        use_cpu=args.device.type == "cpu", no_cuda=args.device.type == "cpu",
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    trainer = RecordingTrainer(model=model, args=targs,
                               train_dataset=CountingSequences(args.steps * BATCH),
                               optimizers=(opt, sched))
    RecordingTrainer.losses = {}
    trainer.train(resume_from_checkpoint=resume_from)
    return dict(RecordingTrainer.losses), cpu_state(model)


def main():
    args = parse_args(__doc__)
    from safetensors.torch import load_file
    first_dir = os.path.join(args.workdir, "run")
    first, final = train(args, seed=0, output_dir=first_dir)
    saved = load_file(os.path.join(first_dir, f"checkpoint-{args.steps}", "model.safetensors"))
    equal, problems = compare_saved(saved, final)
    resumed, _ = train(args, seed=1, output_dir=os.path.join(args.workdir, "resumed"),
                       resume_from=os.path.join(first_dir, f"checkpoint-{args.save_at}"))
    return report("hf_trainer", args, equal, problems, first, resumed,
                  extra={"saved_tensors": len(saved)})


if __name__ == "__main__":
    sys.exit(main())
