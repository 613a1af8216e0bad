"""The main job: train a small causal language model with regional compilation, and say what happened.

A GPT-2 (or Llama) model built from a transformers config with random weights learns generated
arithmetic sentences on the CPU (or a GPU when there is one). It prints progress while it trains
and a summary at the end: steps, loss, seconds spent compiling, graphs, and the compiled blocks.

    python examples/train_lm.py                      # inductor, regional, about 2 minutes on 2 cores
    python examples/train_lm.py --backend aot_eager  # quick check of the logic, no code generation
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arithmetic_text import CharTokenizer, generate_text  # noqa: E402

from kiln import Accelerator, TorchDynamoPlugin  # noqa: E402
from kiln.utils import set_seed  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", choices=["auto", "no", "bf16", "fp16"], default="auto",
                        help="auto: bf16 on a GPU, fp32 on a CPU (most CPUs emulate bf16, 10x slower)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--full", action="store_true", help="compile the whole model instead of its blocks")
    parser.add_argument("--precompile", action="store_true",
                        help="precompiled regions: a second run loads them with no Dynamo trace")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", default="out/train_lm", help="where the trained weights go")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if args.model == "gpt2":
        config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                            vocab_size=vocab_size, n_positions=args.seq, bos_token_id=None,
                            eos_token_id=None, pad_token_id=None)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.width,
                             intermediate_size=4 * args.width, num_attention_heads=args.heads,
                             num_key_value_heads=max(1, args.heads // 2), vocab_size=vocab_size,
                             max_position_embeddings=args.seq, bos_token_id=None,
                             eos_token_id=None, pad_token_id=None)
        model = LlamaForCausalLM(config)
    # transformers picks the loss through a logger.warning_once that breaks a graph; name it.
    model.loss_type = "ForCausalLM"
    return model


def build_loader(args: argparse.Namespace) -> tuple[DataLoader, CharTokenizer]:
    micro_batches = args.steps * args.grad_accum
    text = generate_text(characters=(micro_batches * args.batch + 64) * args.seq, seed=args.seed)
    tokenizer = CharTokenizer(text)
    ids = torch.tensor(tokenizer.encode(text))
    windows = ids[: (len(ids) // args.seq) * args.seq].view(-1, args.seq)
    # drop_last keeps every batch the same shape, so nothing recompiles at the end of the epoch.
    loader = DataLoader(TensorDataset(windows), batch_size=args.batch, shuffle=True, drop_last=True)
    return loader, tokenizer


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.precision == "auto":
        args.precision = "bf16" if torch.cuda.is_available() else "no"
    set_seed(args.seed)
    plugin = TorchDynamoPlugin(backend=args.backend, mode=args.mode, fullgraph=True, dynamic=False,
                               use_regional_compilation=not args.full, precompile=args.precompile or None)
    accelerator = Accelerator(dynamo_plugin=plugin, mixed_precision=args.precision,
                              gradient_accumulation_steps=args.grad_accum)
    loader, tokenizer = build_loader(args)
    model = build_model(args, tokenizer.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    schedule = lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    params = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"kiln demo: {args.model} {args.layers} layers x {args.width} ({params / 1e6:.2f} M parameters), "
        f"{'fp32' if args.precision == 'no' else args.precision} on {accelerator.device}, {args.backend} "
        f"{'full' if args.full else 'regional'} compile, {args.steps} steps of "
        f"{args.grad_accum} x {args.batch} x {args.seq} tokens"
    )
    accelerator.print("step 1 compiles the model first; on a CPU with inductor that takes a minute or so ...")

    model.train()
    step_seconds: list[float] = []
    losses: list[float] = []
    window_loss = 0.0
    step_start = time.perf_counter()
    for (input_ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            accelerator.backward(loss)
            window_loss += loss.item() / args.grad_accum
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step_seconds.append(time.perf_counter() - step_start)
        losses.append(window_loss)
        window_loss = 0.0
        step = len(losses)
        if step == 1:
            accelerator.print(f"step 1 done in {step_seconds[0]:.1f} s (compile included)")
        if step % args.log_every == 0 or step == args.steps:
            recent = statistics.median(step_seconds[-args.log_every:])
            accelerator.print(f"step {step:4d}/{args.steps}  loss {losses[-1]:.3f}  "
                              f"lr {scheduler.get_last_lr()[0]:.2e}  {recent * 1000:.0f} ms/step")
        if step == args.steps:
            break
        step_start = time.perf_counter()

    report = accelerator.compile_report()
    steady = statistics.median(step_seconds[1:]) if len(step_seconds) > 1 else 0.0
    compile_seconds = step_seconds[0] - steady
    accelerator.save_model(model, args.out)
    summary = {
        "steps": len(losses),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "compile_seconds": compile_seconds,
        "steady_ms": steady * 1000,
        "graphs": report.graphs,
        "regions": [(r.name, r.instances) for r in report.regions],
        "silent_regions": report.silent_regions,
    }
    accelerator.print("\n== summary ==")
    accelerator.print(f"steps            {summary['steps']}")
    accelerator.print(f"loss             {losses[0]:.3f} first, {losses[-1]:.3f} last "
                      f"(mean of last 10: {statistics.mean(losses[-10:]):.3f})")
    accelerator.print(f"compiling        {compile_seconds:.1f} s (first step minus a steady step; "
                      f"Dynamo's own count: {report.compile_seconds:.1f} s)")
    accelerator.print(f"steady step      {steady * 1000:.0f} ms")
    accelerator.print(f"graphs           {report.graphs}")
    for region in report.regions:
        how = f"{region.ran}, {region.traces} Dynamo trace(s) in this run"
        if region.precompiled_loaded:
            how += f", {region.precompiled_loaded} precompiled artifact(s) loaded in {region.precompile_load_seconds:.1f} s"
        accelerator.print(f"compiled region  {region.name}: {region.instances} instance(s) share "
                          f"{region.graphs or region.precompiled_loaded} graph(s), ran compiled "
                          f"{region.compiled_calls} times ({how})")
    if report.silent_regions:
        accelerator.print(f"WARNING: these regions never ran compiled code: {report.silent_regions}")
    accelerator.print(f"weights          {args.out}/ (safetensors, plain keys)")
    accelerator.print("\n== compile report ==")
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
