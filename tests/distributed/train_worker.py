"""One training run for the multi-process tests; started by a launcher (local_launch.py) or alone.

Writes, from the main process, a JSON file with the global loss of every optimizer step, the
compiled calls of every rank, a checksum of the parameters on every rank and the gathered
evaluation targets. With --plain it runs the same training as the plain PyTorch loop a user
would write without Kiln (one process, the global batch), the oracle for parity tests.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_models import Regressor, tiny_llama  # noqa: E402

from kiln import Accelerator, ParallelismConfig, TorchDynamoPlugin  # noqa: E402
from kiln.compile.regions import compiled_regions  # noqa: E402
from kiln.parallel.deepspeed import DeepSpeedPlugin  # noqa: E402
from kiln.parallel.fsdp import FullyShardedDataParallelPlugin  # noqa: E402
from kiln.plugins import DataLoaderConfiguration  # noqa: E402
from kiln.utils import DummyOptim, DummyScheduler, set_seed  # noqa: E402


class Progress:
    """Where the loop is: registered for checkpointing so a resumed run knows what to skip."""

    def __init__(self):
        self.epoch = self.batches = self.steps = 0

    def state_dict(self):
        return {"epoch": self.epoch, "batches": self.batches, "steps": self.steps}

    def load_state_dict(self, state):
        self.epoch, self.batches, self.steps = state["epoch"], state["batches"], state["steps"]


class Stream(torch.utils.data.IterableDataset):
    """0, 1, ..., n-1 as a stream with no length."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return ((torch.tensor(float(i)),) for i in range(self.n))


def training_data(args):
    """The dataset and the model: the toy regressor, or a tiny Llama whose gradient norm is well above 1."""
    generator = torch.Generator().manual_seed(1)
    if args.model == "llama":
        tokens = torch.randint(0, 97, (args.samples, 16), generator=generator)
        return TensorDataset(tokens, tokens.clone())
    if args.model == "llama-next":  # labels already shifted, so a slice of a sequence holds its own
        tokens = torch.randint(0, 97, (args.samples, 17), generator=generator)
        return TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())
    x, y = torch.randn(args.samples, 3, 8, generator=generator), torch.randn(args.samples, 3, generator=generator)
    return TensorDataset(x, y)


def build_model(args):
    return tiny_llama(layers=3, width=64, init_std=0.08) if args.model.startswith("llama") else Regressor()


def model_loss(args, model, inputs, targets, positions=None):
    if args.model == "llama":
        return {"loss": model(input_ids=inputs, labels=targets, use_cache=False)["loss"]}
    if args.model == "llama-next":  # as Accelerate's nd_parallel example: labels shifted, positions given
        positions = positions if positions is not None else sequence_positions(inputs)
        return {"loss": model(input_ids=inputs, labels=targets, shift_labels=targets, position_ids=positions,
                              use_cache=False)["loss"]}
    return model(inputs, targets)


def sequence_positions(inputs):
    return torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs).clone()


def build_optimizer(args, model):
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr)


def plain_loop(args) -> None:
    """What a user writes without Kiln, on one process over the global batch: no compile, no wrapper."""
    torch.manual_seed(0)
    model = build_model(args)
    optimizer = build_optimizer(args, model)
    scheduler = None if args.constant_lr else torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(training_data(args), batch_size=args.global_batch, drop_last=True)
    losses, norms, window = [], [], 0.0
    batches = [batch for _ in range(args.epochs) for batch in loader]
    for index, (inputs, targets) in enumerate(batches):
        loss = model_loss(args, model, inputs, targets)["loss"] / args.grad_accum
        loss.backward()
        window += loss.item()
        if (index + 1) % args.grad_accum:
            continue
        max_norm = args.clip if args.clip is not None else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(window)
        window = 0.0
    if args.save_weights:
        torch.save(model.state_dict(), args.save_weights)
    state = model.state_dict()
    with open(args.out, "w") as handle:
        json.dump({"losses": losses, "grad_norms": norms, "keys": sorted(state),
                   "checksum": sum(t.double().sum().item() for t in state.values())}, handle)


def plain_deepspeed_loop(args) -> None:
    """DeepSpeed's own loop over the complete config in --ds-config, on one process and without Kiln:
    the engine builds the config's optimizer and scheduler, as `deepspeed.initialize` users write it."""
    from ports import free_port

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(name, value)
    import deepspeed

    torch.manual_seed(0)
    model = build_model(args)
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=args.ds_config)
    loader = DataLoader(training_data(args), batch_size=args.global_batch, drop_last=True)
    losses, lrs, window = [], [], 0.0
    for index, (inputs, targets) in enumerate(loader):
        loss = model_loss(args, engine, inputs, targets)["loss"]
        engine.backward(loss)  # divides by the accumulation steps itself
        engine.step()  # steps the optimizer and the scheduler at the end of each accumulation window
        window += loss.item() / args.grad_accum
        if (index + 1) % args.grad_accum == 0:
            losses.append(window)
            lrs.append(scheduler.get_last_lr()[0])
            window = 0.0
    if args.save_weights:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # ZeRO-3's partitions, whole
            torch.save({name: value.detach().clone() for name, value in model.state_dict().items()},
                       args.save_weights)
    with open(args.out, "w") as handle:
        json.dump({"losses": losses, "lrs": lrs}, handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-batch", type=int, default=6)
    parser.add_argument("--precision", default="no")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--eval-samples", type=int, default=10)
    parser.add_argument("--eval-stream", action="store_true", help="evaluate on an IterableDataset")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--save-at", type=int, default=0, help="save_state after this many steps, then stop")
    parser.add_argument("--keep-training", action="store_true", help="after --save-at, train on to the end")
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--stateful", action="store_true")
    parser.add_argument("--split-batches", action="store_true", help="the loader's batch is the global batch")
    parser.add_argument("--constant-lr", action="store_true", help="no scheduler")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--fsdp-mixed-precision", default=None, help="FSDP2's own parameter dtype (opt-in)")
    parser.add_argument("--fsdp-plugin", type=json.loads, default={},
                        help="more FullyShardedDataParallelPlugin fields, as JSON (Accelerate's names)")
    parser.add_argument("--parallelism", type=json.loads, default=None, help="ParallelismConfig fields, as JSON")
    parser.add_argument("--hf-tp-plan", action="store_true",
                        help="load the model with transformers' tp_plan='auto' on the accelerator's tp mesh")
    parser.add_argument("--empty-off-main", action="store_true",
                        help="every process but the main one builds its model on the meta device (no values)")
    parser.add_argument("--zero-stage", type=int, default=None, help="train with DeepSpeed at this ZeRO stage")
    parser.add_argument("--save-model", default=None)
    parser.add_argument("--teacher", action="store_true", help="also prepare a frozen model and distil from it")
    parser.add_argument("--poison-step", type=int, default=0,
                        help="put an inf into rank 0's gradients (its shard only) before this optimizer step")
    parser.add_argument("--model", choices=["regressor", "llama", "llama-next"], default="regressor")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--clip", type=lambda v: None if v == "none" else float(v), default=1.0,
                        help="max gradient norm the loop clips to; 'none': the loop does not clip")
    parser.add_argument("--ds-config", type=json.loads, default=None, help="a DeepSpeed config, as JSON")
    parser.add_argument("--save-weights", default=None, help="torch.save the final full state dict here")
    parser.add_argument("--plain", action="store_true", help="the plain PyTorch loop, without Kiln")
    parser.add_argument("--plain-deepspeed", action="store_true",
                        help="DeepSpeed's own engine loop over --ds-config (complete, no \"auto\"), without Kiln")
    parser.add_argument("--config-optimizer", action="store_true",
                        help="DummyOptim and DummyScheduler for the --ds-config's optimizer and scheduler sections")
    parser.add_argument("--precompile", action="store_true", help="precompiled regions (TorchDynamoPlugin(precompile=True))")
    parser.add_argument("--outer-graph", action="store_true", help="TorchDynamoPlugin(outer_graph=True)")
    args = parser.parse_args()
    if args.plain:
        plain_loop(args)
        return
    if args.plain_deepspeed:
        plain_deepspeed_loop(args)
        return

    set_seed(0)
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, dynamic=False,
                               use_regional_compilation=True, precompile=args.precompile or None,
                               outer_graph=args.outer_graph)
    acc = Accelerator(dynamo_plugin=plugin, mixed_precision=args.precision,
                      gradient_accumulation_steps=args.grad_accum,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=args.stateful,
                                                                split_batches=args.split_batches),
                      fsdp_plugin=FullyShardedDataParallelPlugin(
                          activation_checkpointing=args.activation_checkpointing,
                          mixed_precision=args.fsdp_mixed_precision, **args.fsdp_plugin) if args.fsdp else None,
                      deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.ds_config, zero_stage=args.zero_stage,
                                                       gradient_clipping=args.clip)
                      if args.zero_stage is not None else None,
                      parallelism_config=ParallelismConfig(**args.parallelism) if args.parallelism else None)
    # Tensor-parallel processes share batches: the batch divides over the data-parallel ones only.
    readers = acc.parallelism_config.data_parallel_size if acc.parallelism_config else acc.num_processes
    per_process = args.global_batch if args.split_batches else args.global_batch // readers
    loader = DataLoader(training_data(args), batch_size=per_process, shuffle=args.shuffle, drop_last=True)
    eval_data = TensorDataset(torch.arange(args.eval_samples, dtype=torch.float32))
    if args.eval_stream:
        eval_data = Stream(args.eval_samples)
    eval_loader = DataLoader(eval_data, batch_size=4 if args.split_batches else 3)
    if args.empty_off_main and not acc.is_main_process:
        with torch.device("meta"):
            model = build_model(args)
    elif args.hf_tp_plan:  # the same weights, saved, then loaded split by transformers itself
        saved = os.path.join(os.path.dirname(args.out), "pretrained")
        if acc.is_main_process:
            build_model(args).save_pretrained(saved)
        acc.wait_for_everyone()
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(saved, tp_plan="auto", device_mesh=acc.torch_device_mesh["tp"])
        model.loss_type = "ForCausalLM"
    else:
        model = build_model(args)
    optimizer = build_optimizer(args, model)
    # Halving the rate each step makes a scheduler that did not reach the optimizer change the losses.
    # A prepared scheduler ticks once per process per optimizer step (as in Accelerate), so the
    # schedule is sized in ticks, the way Accelerate scripts size theirs.
    ticks = 1 if args.split_batches else acc.num_processes
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=ticks, gamma=0.5 if not args.constant_lr else 1.0)
    if args.config_optimizer:  # the engine builds both from the config; "auto" values come from these
        optimizer = DummyOptim(model.parameters(), lr=args.lr, weight_decay=0.1)
        # As Accelerate scripts count it: the unprepared loader's batches (ticks) over the accumulation.
        scheduler = DummyScheduler(optimizer, total_num_steps=len(loader) * args.epochs // args.grad_accum,
                                   warmup_num_steps=2)
    model, optimizer, loader, eval_loader, scheduler = acc.prepare(model, optimizer, loader, eval_loader, scheduler)
    teacher = None
    if args.teacher:  # frozen: every strategy must take it alongside the trained model
        teacher = Regressor().requires_grad_(False)
        teacher = acc.prepare(teacher)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    report = None
    if args.resume_from:
        report = dataclasses.asdict(acc.load_state(args.resume_from))

    losses, skipped, lrs, window = [], [], [], 0.0
    while progress.epoch < args.epochs:
        skip = progress.batches if (args.resume_from and not args.stateful and losses == []) else 0
        batches = acc.skip_first_batches(loader, skip) if skip else loader
        for inputs, targets in batches:
            with acc.accumulate(model):
                positions = sequence_positions(inputs) if args.model == "llama-next" else None
                # Context parallel: each process of a cp group keeps a slice of every sequence, for
                # forward and backward alike (elsewhere the context does nothing).
                sliced = [inputs, targets, positions] if positions is not None else []
                with acc.maybe_context_parallel(buffers=sliced, buffer_seq_dims=[1] * len(sliced),
                                                no_restore_buffers=set(sliced)):
                    outputs = model_loss(args, model, inputs, targets, positions)
                    loss = outputs["loss"]
                    if teacher is not None:
                        with torch.no_grad():
                            hint = teacher(inputs)["prediction"]
                        loss = loss + 0.1 * torch.nn.functional.mse_loss(outputs["prediction"], hint)
                    acc.backward(loss)
                window += acc.reduce(loss.detach(), "mean").item() / args.grad_accum
                if acc.sync_gradients and progress.steps + 1 == args.poison_step and acc.process_index == 0:
                    grad = next(p.grad for p in model.parameters() if p.grad is not None)
                    (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
                if acc.sync_gradients and args.clip is not None:
                    acc.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress.batches += 1
            if acc.sync_gradients:
                skipped.append(acc.optimizer_step_was_skipped)
                losses.append(window)
                lrs.append(scheduler.get_last_lr()[0])
                window = 0.0
                progress.steps += 1
                if progress.steps == args.save_at:
                    acc.save_state(os.path.join(os.path.dirname(args.out), "ckpt"))
                    if not args.keep_training:
                        break
        if progress.steps == args.save_at and not args.keep_training:
            break
        progress.epoch += 1
        progress.batches = 0

    seen = []
    for (values,) in eval_loader:
        seen.append(acc.gather_for_metrics(values))
    calls = sum(r.calls for r in compiled_regions(acc.unwrap_model(model)))
    precompiled_calls = sum(r.precompiled_calls for r in compiled_regions(acc.unwrap_model(model)))
    # Signatures this process compiled ahead of time (not loaded): which local process compiles a
    # signature and which loads it is a race, so a test reads every process's count.
    compiled_ahead = sum(r.precompiled.stats.compiled for r in compiled_regions(acc.unwrap_model(model))
                         if r.precompiled is not None)
    regions = acc.compile_report().regions
    notes = [n for r in regions for n in r.precompile_notes]
    kinds = [r.kind for r in regions]
    units = [name for name, m in acc.unwrap_model(model).named_modules()
             if type(m).__name__.startswith("FSDP")]  # FSDP2 gives each sharded module a class FSDP<Class>
    first = next(acc.unwrap_model(model).parameters())
    placements = [str(p) for p in getattr(first, "placements", ())]
    mesh = acc.torch_device_mesh
    ranks = acc.gather(torch.tensor([[acc.data_parallel_rank, acc.data_parallel_shard_rank]])).tolist()
    full = acc.get_state_dict(model)  # consolidated, plain keys, on every process
    checksum = sum(t.double().sum().item() for t in full.values())
    if args.save_model:
        acc.save_model(model, args.save_model)
    if args.save_weights and acc.is_main_process:
        torch.save(full, args.save_weights)
    all_calls = acc.gather(torch.tensor([calls])).tolist()
    all_precompiled = acc.gather(torch.tensor([precompiled_calls])).tolist()
    all_compiled_ahead = acc.gather(torch.tensor([compiled_ahead])).tolist()
    all_checksums = acc.gather(torch.tensor([checksum], dtype=torch.float64)).tolist()
    all_skipped = [[bool(x) for x in row] for row in acc.gather(torch.tensor([skipped], dtype=torch.int64)).tolist()]
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump({"losses": losses, "calls": all_calls, "precompiled_calls": all_precompiled, "kinds": kinds,
                       "precompile_notes": notes, "compiled_ahead": all_compiled_ahead,
                       "checksums": all_checksums, "skipped": all_skipped,
                       "eval": torch.cat(seen).tolist(), "processes": acc.num_processes,
                       "distributed_type": str(acc.distributed_type.value), "keys": sorted(full), "lrs": lrs,
                       "load_report": report, "fsdp_units": units, "placements": placements,
                       "mesh": list(mesh.mesh_dim_names) if mesh is not None else None, "dp_ranks": ranks},
                      handle)
    acc.end_training()


if __name__ == "__main__":
    main()
