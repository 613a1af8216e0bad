"""Sequence classification in the shape of transformers' `run_glue_no_trainer.py`, on Kiln.

The Accelerate calls are those of the real script, in its order: `Accelerator()` takes no
accumulation setting (the loop accumulates by hand, so `sync_gradients` stays True), evaluation
uses `gather` and trims the last batch's duplicates itself, and the metrics are logged nested
(`{"glue": {"accuracy": ..., "f1": ...}}`). Only the imports name `kiln`. As with
`accelerate launch`, compilation comes from the environment (KILN_DYNAMO_BACKEND=aot_eager,
KILN_DYNAMO_USE_REGIONAL_COMPILATION=true). Nothing is downloaded: a tiny BERT from a config with
random weights, and generated token-id sentences whose label is which half of the vocabulary
their words come from. The last line printed is `RESULT {json}` for the tests.
"""

import argparse
import json
import logging
import math
import os
import random

import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, SchedulerType, get_scheduler

from kiln import Accelerator
from kiln.logging import get_logger
from kiln.utils import set_seed

logger = get_logger(__name__)

PAD, CLS, SEP = 0, 2, 3  # words are 4..vocab_size-1


def parse_args():
    parser = argparse.ArgumentParser(description="Fine-tune a tiny BERT on a generated two-class task")
    parser.add_argument("--task_name", type=str, default=None)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_train_examples", type=int, default=48)
    parser.add_argument("--num_eval_examples", type=int, default=22)
    parser.add_argument("--max_length", type=int, default=16)
    parser.add_argument("--pad_to_max_length", action="store_true")
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=32)
    parser.add_argument("--num_hidden_layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear",
                        choices=["linear", "cosine", "constant", "constant_with_warmup"])
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--report_to", type=str, default="all")
    return parser.parse_args()


def generate_sentences(count, rng, vocab_size):
    """Separable on purpose: label 1 sentences use words from the lower half of the vocabulary,
    label 0 sentences from the upper half."""
    middle = 4 + (vocab_size - 4) // 2
    examples = []
    for _ in range(count):
        label = rng.randint(0, 1)
        words = range(4, middle) if label else range(middle, vocab_size)
        examples.append({"sentence": [rng.choice(words) for _ in range(rng.randint(5, 12))], "label": label})
    return examples


def pad_collator(pad_to_multiple_of=None):
    """DataCollatorWithPadding for token-id lists: pads to the batch's longest (rounded up)."""
    def collate(features):
        length = max(len(f["input_ids"]) for f in features)
        if pad_to_multiple_of:
            length = math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of
        input_ids = torch.full((len(features), length), PAD, dtype=torch.long)
        attention_mask = torch.zeros((len(features), length), dtype=torch.long)
        for row, f in enumerate(features):
            input_ids[row, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
            attention_mask[row, :len(f["input_ids"])] = 1
        labels = torch.tensor([f["labels"] for f in features], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return collate


def accuracy_and_f1(predictions, references):
    """What `evaluate.load("glue", "mrpc")` computes: accuracy, and F1 of the positive class."""
    predictions, references = torch.cat(predictions), torch.cat(references)
    true_pos = ((predictions == 1) & (references == 1)).sum().item()
    false_pos = ((predictions == 1) & (references == 0)).sum().item()
    false_neg = ((predictions == 0) & (references == 1)).sum().item()
    f1 = 2 * true_pos / (2 * true_pos + false_pos + false_neg) if true_pos else 0.0
    return {"accuracy": (predictions == references).float().mean().item(), "f1": f1}


def main():
    args = parse_args()

    accelerator = (
        Accelerator(log_with=args.report_to, project_dir=args.output_dir) if args.with_tracking else Accelerator()
    )
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
    )
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        logger.info("main process of this machine")

    if args.seed is not None:
        set_seed(args.seed)

    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    rng = random.Random(args.seed)
    raw_datasets = {"train": generate_sentences(args.num_train_examples, rng, args.vocab_size),
                    "validation": generate_sentences(args.num_eval_examples, rng, args.vocab_size)}
    num_labels = 2

    config = BertConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                        num_hidden_layers=args.num_hidden_layers, num_attention_heads=4,
                        intermediate_size=2 * args.hidden_size, max_position_embeddings=64,
                        hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                        num_labels=num_labels, pad_token_id=PAD)
    model = BertForSequenceClassification(config)
    model.config.label2id = {"upper": 0, "lower": 1}
    model.config.id2label = {i: label for label, i in model.config.label2id.items()}

    def preprocess_function(examples):
        result = {"input_ids": []}
        for words in examples["sentence"]:
            ids = [CLS, *words][: args.max_length - 1] + [SEP]
            if args.pad_to_max_length:
                ids = ids + [PAD] * (args.max_length - len(ids))
            result["input_ids"].append(ids)
        result["labels"] = examples["label"]
        return [dict(zip(result, values)) for values in zip(*result.values())]

    with accelerator.main_process_first():
        processed_datasets = {
            split: preprocess_function({"sentence": [e["sentence"] for e in examples],
                                        "label": [e["label"] for e in examples]})
            for split, examples in raw_datasets.items()
        }

    train_dataset = processed_datasets["train"]
    eval_dataset = processed_datasets["validation"]
    for index in random.sample(range(len(train_dataset)), 3):
        logger.info(f"Sample {index} of the training set: {train_dataset[index]}.")

    if accelerator.mixed_precision == "fp8":
        pad_to_multiple_of = 16
    elif accelerator.mixed_precision != "no":
        pad_to_multiple_of = 8
    else:
        pad_to_multiple_of = None
    data_collator = pad_collator(pad_to_multiple_of)

    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)

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
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.max_train_steps,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

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
        accelerator.init_trackers("glue_no_trainer", experiment_config)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
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
        if args.with_tracking:
            total_loss = 0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            first_batch = resume_step
        else:
            active_dataloader = train_dataloader
            first_batch = 0
        for step, batch in enumerate(active_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            if args.with_tracking:
                total_loss += loss.detach().float()
            train_losses.append([epoch, first_batch + step, loss.item()])
            loss = loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
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
        samples_seen = 0
        all_predictions, all_references = [], []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather((predictions, batch["labels"]))
            # If we are in a multiprocess environment, the last batch has duplicates
            if accelerator.num_processes > 1:
                if step == len(eval_dataloader) - 1:
                    predictions = predictions[: len(eval_dataloader.dataset) - samples_seen]
                    references = references[: len(eval_dataloader.dataset) - samples_seen]
                else:
                    samples_seen += references.shape[0]
            all_predictions.append(predictions.cpu())
            all_references.append(references.cpu())
        eval_metric = accuracy_and_f1(all_predictions, all_references)
        logger.info(f"epoch {epoch}: {eval_metric}")
        eval_history.append({"epoch": epoch, "step": completed_steps, **eval_metric,
                             "evaluated": sum(len(p) for p in all_predictions)})

        if args.with_tracking:
            accelerator.log(
                {
                    "accuracy" if args.task_name is not None else "glue": eval_metric,
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
            # For the tests: the trained model's logits on the first eval examples.
            probe = data_collator(eval_dataset[:8])
            with torch.no_grad():
                logits = unwrapped_model(**{k: v.to(accelerator.device) for k, v in probe.items()}).logits
            torch.save({"inputs": probe, "logits": logits.cpu()}, os.path.join(args.output_dir, "probe.pt"))

    if args.output_dir is not None:
        all_results = {f"eval_{k}": v for k, v in eval_metric.items()}
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump(all_results, f)

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
