"""Encoder-decoder training with `generate` in evaluation, in the shape of transformers'
`run_summarization_no_trainer.py`, on Kiln.

The Accelerate calls are those of the real script, in its order: evaluation generates with the
unwrapped (here: compiled in place) model, pads the generated tokens and the labels across
processes along dim 1 and gathers both with `gather_for_metrics`. Like the real script it never
calls `accelerator.end_training()`. Only the imports name `kiln`, and the compile settings are
passed as a `TorchDynamoPlugin` (the real script gets them from `accelerate launch`). Nothing is
downloaded: a tiny BART from a config with random weights, a word-level toy tokenizer, and
generated "documents" whose "summary" names their topic. ROUGE is computed by hand on words.
The last line printed is `RESULT {json}` for the tests.
"""

import argparse
import json
import logging
import math
import os
import random
from collections import Counter

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import BartConfig, BartForConditionalGeneration, SchedulerType, get_scheduler

from kiln import Accelerator, TorchDynamoPlugin
from kiln.logging import get_logger
from kiln.utils import set_seed

logger = get_logger(__name__)


class ToyTokenizer:
    """Words `w4` ... `w{n-1}` are ids 4 ... n-1; ids 0-3 are <s>, <pad>, </s>, <unk> as in BART."""

    bos_token_id, pad_token_id, eos_token_id, unk_token_id = 0, 1, 2, 3
    special_ids = (0, 1, 2, 3)

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text, max_length):
        ids = [int(w[1:]) if w[1:].isdigit() and 4 <= int(w[1:]) < self.vocab_size else self.unk_token_id
               for w in text.split()]
        return [self.bos_token_id, *ids[: max_length - 2], self.eos_token_id]

    def __call__(self, text_target=None, texts=None, max_length=None, padding=False, truncation=True):
        input_ids = [self.encode(t, max_length) for t in (texts if texts is not None else text_target)]
        if padding == "max_length":
            input_ids = [ids + [self.pad_token_id] * (max_length - len(ids)) for ids in input_ids]
        return {"input_ids": input_ids,
                "attention_mask": [[int(i != self.pad_token_id) for i in ids] for ids in input_ids]}

    def batch_decode(self, sequences, skip_special_tokens=True):
        return [" ".join(f"w{i}" for i in ids if not (skip_special_tokens and i in self.special_ids))
                for ids in np.asarray(sequences).tolist()]


def parse_args():
    parser = argparse.ArgumentParser(description="Train a tiny BART to summarise generated documents")
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_train_examples", type=int, default=64)
    parser.add_argument("--num_eval_examples", type=int, default=8)
    parser.add_argument("--max_source_length", type=int, default=20)
    parser.add_argument("--max_target_length", type=int, default=8)
    parser.add_argument("--val_max_target_length", type=int, default=None)
    parser.add_argument("--num_beams", type=int, default=1)  # the real default None fails in transformers 5 generate
    parser.add_argument("--pad_to_max_length", action="store_true")
    parser.add_argument("--ignore_pad_token_for_loss", type=bool, default=True)
    parser.add_argument("--source_prefix", type=str, default=None)
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--d_model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear",
                        choices=["linear", "cosine", "constant", "constant_with_warmup"])
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--report_to", type=str, default="all")
    parser.add_argument("--dynamo_backend", type=str, default="aot_eager")
    args = parser.parse_args()
    if args.val_max_target_length is None:
        args.val_max_target_length = args.max_target_length
    return args


def generate_documents(count, rng, vocab_size, topics=4):
    """A document is 8-18 words of one topic (a block of the vocabulary); its summary, the first
    three words of that block."""
    block = (vocab_size - 4) // topics
    documents = []
    for _ in range(count):
        first = 4 + block * rng.randrange(topics)
        words = [f"w{first + rng.randrange(block)}" for _ in range(rng.randint(8, 18))]
        documents.append({"document": " ".join(words), "summary": " ".join(f"w{first + i}" for i in range(3))})
    return documents


def seq2seq_collator(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=None):
    """DataCollatorForSeq2Seq for token-id lists: inputs padded with the pad id, labels with
    `label_pad_token_id`, each to its own longest (rounded up); the model shifts the labels."""
    def pad(rows, value):
        length = max(len(r) for r in rows)
        if pad_to_multiple_of:
            length = math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of
        return torch.tensor([r + [value] * (length - len(r)) for r in rows], dtype=torch.long)

    def collate(features):
        return {"input_ids": pad([f["input_ids"] for f in features], tokenizer.pad_token_id),
                "attention_mask": pad([f["attention_mask"] for f in features], 0),
                "labels": pad([f["labels"] for f in features], label_pad_token_id)}
    return collate


def rouge_scores(predictions, references):
    """ROUGE-1, ROUGE-2 and ROUGE-L F-measures over words, averaged over examples (as `evaluate`'s rouge)."""
    def ngrams(words, n):
        return Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))

    def f_measure(overlap, predicted, reference):
        if not overlap:
            return 0.0
        precision, recall = overlap / predicted, overlap / reference
        return 2 * precision * recall / (precision + recall)

    def lcs(a, b):
        table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i, x in enumerate(a):
            for j, y in enumerate(b):
                table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
        return table[-1][-1]

    totals = Counter()
    for prediction, reference in zip(predictions, references):
        p, r = prediction.split(), reference.split()
        for n in (1, 2):
            pn, rn = ngrams(p, n), ngrams(r, n)
            totals[f"rouge{n}"] += f_measure(sum((pn & rn).values()), sum(pn.values()), sum(rn.values()))
        totals["rougeL"] += f_measure(lcs(p, r), len(p), len(r))
    return {key: totals[key] / max(1, len(predictions)) for key in ("rouge1", "rouge2", "rougeL")}


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

    if args.seed is not None:
        set_seed(args.seed)

    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    rng = random.Random(args.seed)
    raw_datasets = {"train": generate_documents(args.num_train_examples, rng, args.vocab_size),
                    "validation": generate_documents(args.num_eval_examples, rng, args.vocab_size)}

    tokenizer = ToyTokenizer(args.vocab_size)
    config = BartConfig(vocab_size=args.vocab_size, d_model=args.d_model, encoder_layers=args.layers,
                        decoder_layers=args.layers, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=2 * args.d_model, decoder_ffn_dim=2 * args.d_model,
                        max_position_embeddings=64, dropout=args.dropout, attention_dropout=args.dropout,
                        activation_dropout=args.dropout, bos_token_id=tokenizer.bos_token_id,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        decoder_start_token_id=tokenizer.eos_token_id, forced_eos_token_id=tokenizer.eos_token_id)
    model = BartForConditionalGeneration(config)
    if model.config.decoder_start_token_id is None:
        raise ValueError("Make sure that `config.decoder_start_token_id` is correctly defined")

    prefix = args.source_prefix if args.source_prefix is not None else ""
    max_target_length = args.max_target_length
    padding = "max_length" if args.pad_to_max_length else False

    def preprocess_function(examples):
        inputs = [prefix + doc for doc in examples["document"]]
        model_inputs = tokenizer(texts=inputs, max_length=args.max_source_length, padding=padding, truncation=True)
        labels = tokenizer(text_target=examples["summary"], max_length=max_target_length, padding=padding,
                           truncation=True)
        if padding == "max_length" and args.ignore_pad_token_for_loss:
            labels["input_ids"] = [
                [(l if l != tokenizer.pad_token_id else -100) for l in label] for label in labels["input_ids"]
            ]
        model_inputs["labels"] = labels["input_ids"]
        return [dict(zip(model_inputs, values)) for values in zip(*model_inputs.values())]

    def columns(examples):
        return {key: [e[key] for e in examples] for key in ("document", "summary")}

    with accelerator.main_process_first():
        train_dataset = preprocess_function(columns(raw_datasets["train"]))
        max_target_length = args.val_max_target_length
        eval_dataset = preprocess_function(columns(raw_datasets["validation"]))

    for index in random.sample(range(len(train_dataset)), 1):
        logger.info(f"Sample {index} of the training set: {train_dataset[index]}.")

    label_pad_token_id = -100 if args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    if accelerator.mixed_precision == "fp8":
        pad_to_multiple_of = 16
    elif accelerator.mixed_precision != "no":
        pad_to_multiple_of = 8
    else:
        pad_to_multiple_of = None
    data_collator = seq2seq_collator(tokenizer, label_pad_token_id=label_pad_token_id,
                                     pad_to_multiple_of=pad_to_multiple_of)

    def postprocess_text(preds, labels):
        return [pred.strip() for pred in preds], [label.strip() for label in labels]

    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "LayerNorm.weight", "layer_norm.weight"]
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
        accelerator.init_trackers("summarization_no_trainer", experiment_config)

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
        gen_kwargs = {"max_length": args.val_max_target_length, "num_beams": args.num_beams}
        all_preds, all_labels = [], []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                generated_tokens = accelerator.unwrap_model(model).generate(
                    batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    **gen_kwargs,
                )
                generated_tokens = accelerator.pad_across_processes(
                    generated_tokens, dim=1, pad_index=tokenizer.pad_token_id
                )
                labels = batch["labels"]
                if not args.pad_to_max_length:
                    # If we did not pad to max length, we need to pad the labels too
                    labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=tokenizer.pad_token_id)

                generated_tokens, labels = accelerator.gather_for_metrics((generated_tokens, labels))
                generated_tokens = generated_tokens.cpu().numpy()
                labels = labels.cpu().numpy()

                if args.ignore_pad_token_for_loss:
                    # Replace -100 in the labels as we can't decode them.
                    labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
                if isinstance(generated_tokens, tuple):
                    generated_tokens = generated_tokens[0]
                decoded_preds = tokenizer.batch_decode(generated_tokens, skip_special_tokens=True)
                decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)

                decoded_preds, decoded_labels = postprocess_text(decoded_preds, decoded_labels)
                all_preds += decoded_preds
                all_labels += decoded_labels
        result = rouge_scores(all_preds, all_labels)
        result = {k: round(v * 100, 4) for k, v in result.items()}
        logger.info(result)
        eval_history.append({"epoch": epoch, "step": completed_steps, **result, "evaluated": len(all_preds),
                             "predictions": all_preds[:2]})

        if args.with_tracking:
            result["train_loss"] = total_loss.item() / len(train_dataloader)
            result["epoch"] = epoch
            result["step"] = completed_steps
            accelerator.log(result, step=completed_steps)

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
            all_results = {f"eval_{k}": v for k, v in result.items()}
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump(all_results, f)
            # For the tests: the trained model's generations and teacher-forced logits on 4 eval examples.
            probe = data_collator(eval_dataset[:4])
            probe = {k: v.to(accelerator.device) for k, v in probe.items()}
            with torch.no_grad():
                generated = unwrapped_model.generate(probe["input_ids"], attention_mask=probe["attention_mask"],
                                                     **gen_kwargs)
                logits = unwrapped_model(**probe).logits
            torch.save({"inputs": {k: v.cpu() for k, v in probe.items()}, "gen_kwargs": gen_kwargs,
                        "generated": generated.cpu(), "logits": logits.cpu()},
                       os.path.join(args.output_dir, "probe.pt"))

    # The real script ends here, without `accelerator.end_training()`.
    accelerator.print(accelerator.compile_report().table())  # for people; end_training would print it
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
