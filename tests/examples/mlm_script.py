"""Masked-LM training in the shape of transformers' `run_mlm_no_trainer.py`, on Kiln.

The Accelerate calls are those of the real script, in its order; only the imports name `kiln`
instead of `accelerate`, and the compile settings are passed as a `TorchDynamoPlugin` (the real
script gets them from `accelerate launch`). Nothing is downloaded: the model is a tiny BERT built
from a config with random weights, the "texts" are generated token ids. The last line printed is
`RESULT {json}`: every training loss, the eval numbers and the compiled calls, for the tests.
"""

import argparse
import json
import logging
import math
import os
import random
from itertools import chain

import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForMaskedLM, SchedulerType, get_scheduler

from kiln import Accelerator, DistributedType, TorchDynamoPlugin
from kiln.logging import get_logger
from kiln.utils import set_seed

logger = get_logger(__name__)

PAD, MASK, CLS, SEP = 0, 1, 2, 3  # the special ids of the toy vocabulary; words are 4..vocab_size-1


def parse_args():
    parser = argparse.ArgumentParser(description="Train a tiny masked language model on generated texts")
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_train_texts", type=int, default=48)
    parser.add_argument("--num_eval_texts", type=int, default=12)
    parser.add_argument("--max_seq_length", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=32)
    parser.add_argument("--num_hidden_layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--mlm_probability", type=float, default=0.15)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear",
                        choices=["linear", "cosine", "constant", "constant_with_warmup"])
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--checkpointing_steps", type=str, default=None,
                        help="save the state every n optimizer steps, or 'epoch' at the end of each epoch")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--report_to", type=str, default="all")
    parser.add_argument("--dynamo_backend", type=str, default="aot_eager")
    return parser.parse_args()


def generate_texts(count, rng, vocab_size):
    """Token-id "texts" with structure to learn: a motif of three words, drawn with Zipf-like
    frequencies, repeated to a random length."""
    words = range(4, vocab_size)
    weights = [1 / rank for rank in range(1, len(words) + 1)]
    texts = []
    for _ in range(count):
        motif = rng.choices(words, weights=weights, k=3)
        texts.append((motif * 8)[: rng.randint(6, 20)])
    return texts


class MaskingCollator:
    """Stacks fixed-length examples and masks `mlm_probability` of the word tokens: those become
    [MASK] in `input_ids`, and `labels` are -100 everywhere else.

    The mask of an example depends on (seed, epoch, its tokens) only, not on the global RNG:
    a prepared dataloader reads a batch ahead and a resumed run skips batches, so a collator
    drawing from the global RNG would mask the batches after a resume differently."""

    def __init__(self, mlm_probability, seed):
        self.mlm_probability = mlm_probability
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __call__(self, features):
        input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
        special = torch.tensor([f["special_tokens_mask"] for f in features], dtype=torch.bool)
        chosen = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, feature in enumerate(features):
            seed = hash((self.seed, self.epoch, tuple(feature["input_ids"]))) % 2**62  # int tuples: same hash anywhere
            generator = torch.Generator().manual_seed(seed)
            chosen[row] = torch.rand(input_ids.shape[1], generator=generator) < self.mlm_probability
        chosen &= ~special
        # At least one masked word per row: a short last batch (one process keeps it short, as the
        # plain loop does) whose rows drew none would have no label at all, a 0/0 = NaN loss.
        empty = ~chosen.any(dim=1) & (~special).any(dim=1)
        first_word = (~special).int().argmax(dim=1)
        chosen[empty, first_word[empty]] = True
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
        input_ids = torch.where(chosen, torch.full_like(input_ids, MASK), input_ids)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def main():
    args = parse_args()

    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = args.report_to
        accelerator_log_kwargs["project_dir"] = args.output_dir
    dynamo_plugin = TorchDynamoPlugin(backend=args.dynamo_backend, use_regional_compilation=True)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              dynamo_plugin=dynamo_plugin, **accelerator_log_kwargs)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
    )
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        logger.info("main process of this machine")

    set_seed(args.seed)

    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    rng = random.Random(args.seed)
    raw_datasets = {"train": generate_texts(args.num_train_texts, rng, args.vocab_size),
                    "validation": generate_texts(args.num_eval_texts, rng, args.vocab_size)}

    config = BertConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                        num_hidden_layers=args.num_hidden_layers, num_attention_heads=4,
                        intermediate_size=2 * args.hidden_size, max_position_embeddings=64,
                        hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                        pad_token_id=PAD)
    logger.info("Training new model from scratch")
    model = BertForMaskedLM(config)

    max_seq_length = args.max_seq_length

    def tokenize_function(texts):
        ids = [[CLS, *text, SEP] for text in texts]
        return {"input_ids": ids, "special_tokens_mask": [[1] + [0] * (len(t) - 2) + [1] for t in ids]}

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = (len(concatenated["input_ids"]) // max_seq_length) * max_seq_length
        result = {k: [t[i: i + max_seq_length] for i in range(0, total_length, max_seq_length)]
                  for k, t in concatenated.items()}
        return [dict(zip(result, values)) for values in zip(*result.values())]

    with accelerator.main_process_first():
        tokenized_datasets = {split: tokenize_function(texts) for split, texts in raw_datasets.items()}
    with accelerator.main_process_first():
        tokenized_datasets = {split: group_texts(examples) for split, examples in tokenized_datasets.items()}

    train_dataset = tokenized_datasets["train"]
    eval_dataset = tokenized_datasets["validation"]
    for index in random.sample(range(len(train_dataset)), 3):
        logger.info(f"Sample {index} of the training set: {train_dataset[index]}.")

    train_collator = MaskingCollator(args.mlm_probability, args.seed)
    eval_collator = MaskingCollator(args.mlm_probability, args.seed + 1)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=train_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=eval_collator, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps
        if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    # The real script still tests DistributedType.TPU, which Accelerate 1.x no longer has.
    if accelerator.distributed_type == DistributedType.XLA:
        model.tie_weights()

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    if args.with_tracking:
        experiment_config = vars(args)
        experiment_config["lr_scheduler_type"] = experiment_config["lr_scheduler_type"].value
        accelerator.init_trackers("mlm_no_trainer", experiment_config)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Num Epochs = {args.num_train_epochs}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")
    completed_steps = 0
    starting_epoch = 0
    resume_step = None

    if args.resume_from_checkpoint:
        checkpoint_path = args.resume_from_checkpoint
        path = os.path.basename(args.resume_from_checkpoint)
        accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
        accelerator.load_state(checkpoint_path)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            # need to multiply `gradient_accumulation_steps` to reflect real steps
            resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // args.gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)

    train_losses = []  # [epoch, batch index in the epoch, loss] of every batch trained on
    eval_history = []
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        train_collator.set_epoch(epoch)
        if args.with_tracking:
            total_loss = 0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            first_batch = resume_step
        else:
            active_dataloader = train_dataloader
            first_batch = 0
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                if args.with_tracking:
                    total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            train_losses.append([epoch, first_batch + step, loss.item()])

            if accelerator.sync_gradients:
                completed_steps += 1

            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                    output_dir = f"step_{completed_steps}"
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)

            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        eval_history.append({"epoch": epoch, "eval_loss": eval_loss.item(), "perplexity": perplexity})

        if args.with_tracking:
            accelerator.log(
                {
                    "perplexity": perplexity,
                    "eval_loss": eval_loss,
                    "train_loss": total_loss.item() / len(train_dataloader),
                    "epoch": epoch,
                    "step": completed_steps,
                },
                step=completed_steps,
            )

        if args.checkpointing_steps == "epoch":
            output_dir = f"epoch_{epoch}"
            if args.output_dir is not None:
                output_dir = os.path.join(args.output_dir, output_dir)
            accelerator.save_state(output_dir)

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
        )
        if accelerator.is_main_process:
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump({"perplexity": perplexity}, f)
            # For the tests: the trained model's logits on one eval batch, to compare with the saved folder.
            probe = next(iter(DataLoader(eval_dataset, collate_fn=eval_collator, batch_size=4)))
            with torch.no_grad():
                logits = unwrapped_model(**{k: v.to(accelerator.device) for k, v in probe.items()}).logits
            torch.save({"inputs": probe, "logits": logits.cpu()}, os.path.join(args.output_dir, "probe.pt"))

    accelerator.wait_for_everyone()
    accelerator.end_training()

    report = accelerator.compile_report().as_dict()
    accelerator.print("RESULT " + json.dumps({
        "train_losses": train_losses,
        "eval": eval_history,
        "completed_steps": completed_steps,
        "compile": {r["name"]: {"compiled_calls": r["compiled_calls"], "eager_calls": r["eager_calls"],
                                "graphs": r["graphs"], "instances": r["instances"],
                                "recompiles": r["recompiles"], "graph_breaks": r["graph_breaks"]}
                    for r in report["regions"]},
    }))


if __name__ == "__main__":
    main()
