"""Three scripts in the shape of transformers' Accelerate examples (masked LM, GLUE, summarization),
each run end to end in fresh processes: a full run, a run stopped after a checkpoint, and a fresh
process resuming from that checkpoint, which must continue the full run's losses exactly.

All nine runs start once per module, two at a time (about 60 s on two idle cores), whichever tests
are selected; each test then reads the runs it needs. Whole script runs in fresh processes, like
Accelerate's own examples: they run in that lane (make test-accelerate-examples), not in make test."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.accelerate_examples]  # two script runs at a time
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests/examples"

# constant_with_warmup: the stopped run passes --max_train_steps, which a linear schedule would
# stretch into a different learning rate at every step (the real scripts do the same).
COMMON = ["--lr_scheduler_type", "constant_with_warmup", "--num_warmup_steps", "2"]
COMPILE_FROM_ENV = {"KILN_DYNAMO_BACKEND": "aot_eager", "KILN_DYNAMO_USE_REGIONAL_COMPILATION": "true"}

# steps: optimizer steps of the full run; stop_at: the checkpoint the stopped run ends on, in the
# second epoch, so that the resume parses step_k and skips batches of a shuffled epoch. The masked LM
# trains with dropout: its resume must also restore the RNG that dropout draws from.
CASES = {
    "mlm": dict(script="mlm_script.py", args=["--checkpointing_steps", "3", "--dropout", "0.1"], env={}, steps=12,
                stop_at=9,
                regions={"BertLayer"}, auto="AutoModelForMaskedLM"),
    "glue": dict(script="glue_script.py", args=["--checkpointing_steps", "6", "--with_tracking", "--report_to",
                                                "tensorboard"],
                 env=COMPILE_FROM_ENV, steps=24, stop_at=18, regions={"BertLayer"},
                 auto="AutoModelForSequenceClassification"),
    "summarization": dict(script="summarization_script.py", args=["--checkpointing_steps", "4", "--pad_to_max_length"],
                          env={}, steps=16, stop_at=12, regions={"BartEncoderLayer", "BartDecoderLayer"},
                          auto="AutoModelForSeq2SeqLM"),
}


class Run:
    """One script run in a fresh process; `result` is its RESULT line, once it has finished."""

    def __init__(self, case, out_dir, *extra, after=None):
        self.case, self.out_dir, self.extra, self.after = case, out_dir, extra, after
        self.process = self.result = self.stdout = self.stderr = self.error = None
        self.seconds = 0.0

    def start(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_COMPILE_CACHE_DIR"}
        # One thread each: two runs share the CPU, and every run sums in the same order.
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **self.case["env"])
        args = [sys.executable, str(EXAMPLES / self.case["script"]), "--output_dir", str(self.out_dir),
                *COMMON, *self.case["args"], *self.extra]
        self.started = time.monotonic()
        self.process = subprocess.Popen(args, cwd=self.out_dir.parent, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def finish(self):
        self.stdout, self.stderr = self.process.communicate(timeout=600)
        self.seconds = time.monotonic() - self.started
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        if self.process.returncode != 0 or not lines:
            self.error = f"exit {self.process.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-12000:]}"
        else:
            self.result = json.loads(lines[-1][len("RESULT "):])

    def get(self):
        """The RESULT dict; a run that failed fails the test that needs it, with its output."""
        if self.error is not None:
            pytest.fail(f"{self.case['script']} {' '.join(self.extra)} failed: {self.error}", pytrace=False)
        return self.result

    def losses(self):
        return {(epoch, batch): loss for epoch, batch, loss in self.get()["train_losses"]}


def run_all(runs, workers=2):
    """Run the runs, two at a time (this CPU has two cores); a run waits for its `after` run."""
    pending, active = list(runs), []
    while pending or active:
        ready = [r for r in pending if r.after is None or r.after.result is not None or r.after.error is not None]
        while ready and len(active) < workers:
            run = ready.pop(0)
            pending.remove(run)
            if run.after is not None and run.after.error is not None:
                run.error = f"not run: the run it resumes from failed ({run.after.error[:200]})"
                continue
            run.start()
            active.append(run)
        if not active:
            assert not pending, "runs wait for runs that never start"
            continue
        done = next((r for r in active if r.process.poll() is not None), None)
        if done is None:
            time.sleep(0.05)
            continue
        done.finish()
        active.remove(done)


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """For each case: a full run, one stopped at `stop_at`, and a fresh one resuming there."""
    runs = {}
    for name, case in CASES.items():
        base = tmp_path_factory.mktemp(name)
        stopped = Run(case, base / "stopped", "--max_train_steps", str(case["stop_at"]))
        runs[name] = {
            "case": case, "name": name, "base": base,
            "full": Run(case, base / "full"), "stopped": stopped,
            "resumed": Run(case, base / "resumed", "--resume_from_checkpoint",
                           str(base / "stopped" / f"step_{case['stop_at']}"), after=stopped),
        }
    # The longest first, so the two workers finish together.
    order = [runs["summarization"]["full"], runs["summarization"]["stopped"], runs["summarization"]["resumed"],
             runs["glue"]["full"], runs["glue"]["stopped"], runs["glue"]["resumed"],
             runs["mlm"]["full"], runs["mlm"]["stopped"], runs["mlm"]["resumed"]]
    run_all(order)
    for name, group in runs.items():
        times = ", ".join(f"{kind} {run.seconds:.1f}s" for kind, run in group.items() if isinstance(run, Run))
        print(f"{name}: {times}")
    return runs


@pytest.fixture(params=list(CASES))
def runs(request, all_runs):
    return all_runs[request.param]


def _assert_continues(resumed, full, where):
    # `not <=`: a NaN on either side is a mismatch (a `>` comparison with NaN is always False).
    mismatched = {key: (loss, full[key]) for key, loss in resumed.items() if not abs(loss - full[key]) <= 1e-5}
    assert not mismatched, f"{where}: (resumed, uninterrupted) losses differ at {mismatched}"


def test_full_run_trains_every_step_and_saves_each_checkpoint(runs):
    result = runs["full"].get()
    assert result["completed_steps"] == runs["case"]["steps"]
    losses = result["train_losses"]
    first_epoch = [loss for epoch, _, loss in losses if epoch == 0]
    last_epoch = [loss for epoch, _, loss in losses if epoch == 1]
    assert sum(last_epoch) / len(last_epoch) < sum(first_epoch) / len(first_epoch), losses
    assert [entry["epoch"] for entry in result["eval"]] == [0, 1]
    args = runs["case"]["args"]
    every = int(args[args.index("--checkpointing_steps") + 1])
    for step in range(every, runs["case"]["steps"] + 1, every):
        assert (runs["base"] / "full" / f"step_{step}").is_dir(), step


def test_two_processes_of_one_script_train_alike_until_the_stop(runs):
    """Same script, same seed, two fresh processes: the same losses, although `set_seed` comes after
    `Accelerator()`, as in every Accelerate example."""
    full, stopped = runs["full"].losses(), runs["stopped"].losses()
    assert runs["stopped"].get()["completed_steps"] == runs["case"]["stop_at"]
    assert (runs["base"] / "stopped" / f"step_{runs['case']['stop_at']}").is_dir()
    _assert_continues(stopped, full, "the stopped run, before its stop")


def test_resumed_run_continues_the_full_run(runs):
    full, resumed, stopped = runs["full"].losses(), runs["resumed"].losses(), runs["stopped"].losses()
    assert "Resumed from checkpoint: " in runs["resumed"].stdout
    assert runs["resumed"].get()["completed_steps"] == runs["case"]["steps"]
    assert sorted(resumed) == sorted(set(full) - set(stopped)), "the resumed run trains on the batches the stop left"
    _assert_continues(resumed, full, f"resumed from step_{runs['case']['stop_at']}")
    final_full, final_resumed = runs["full"].get()["eval"][-1], runs["resumed"].get()["eval"][-1]
    for key, value in final_full.items():
        if isinstance(value, float):
            assert final_resumed[key] == pytest.approx(value, abs=1e-5), key
        else:
            assert final_resumed[key] == value, key


def test_mlm_with_dropout_resumes_with_the_same_random_draws(all_runs):
    group = all_runs["mlm"]
    assert "--dropout" in group["case"]["args"]
    full, resumed = group["full"].losses(), group["resumed"].losses()
    stop_at = group["case"]["stop_at"]
    assert len(resumed) == len(full) - stop_at * 2  # two batches per optimizer step
    _assert_continues(resumed, full, f"dropout 0.1, resumed from step_{stop_at}")


def test_save_pretrained_folder_loads_and_gives_the_trained_outputs(runs):
    import transformers

    runs["full"].get()
    folder = runs["base"] / "full"
    model = getattr(transformers, runs["case"]["auto"]).from_pretrained(folder).eval()
    probe = torch.load(folder / "probe.pt")
    with torch.no_grad():
        logits = model(**probe["inputs"]).logits
        torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=1e-5)
        if "generated" in probe:
            generated = model.generate(probe["inputs"]["input_ids"], attention_mask=probe["inputs"]["attention_mask"],
                                       **probe["gen_kwargs"])
            assert generated.tolist() == probe["generated"].tolist()


def test_compiled_code_ran_in_every_region(runs):
    for kind in ("full", "stopped", "resumed"):
        regions = runs[kind].get()["compile"]
        assert set(regions) == runs["case"]["regions"], regions
        for name, region in regions.items():
            assert region["instances"] == 2, (kind, name, region)
            assert region["compiled_calls"] > 0, (kind, name, region)
            if runs["name"] != "summarization":  # generate() there may use up the recompile limit
                assert region["eager_calls"] == 0, (kind, name, region)
    if runs["name"] != "summarization":  # that script, like the real one, never calls end_training
        assert "calls compiled/eager" in runs["full"].stdout, "end_training prints the compile report"


def test_glue_nested_metrics_reach_tensorboard(all_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    group = all_runs["glue"]
    for kind in ("full", "resumed"):
        evals = group[kind].get()["eval"]
        events = EventAccumulator(str(group["base"] / kind / "glue_no_trainer"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"glue/accuracy", "glue/f1", "train_loss", "epoch", "step"} <= tags, tags
        for metric in ("accuracy", "f1"):
            logged = {event.step: event.value for event in events.Scalars(f"glue/{metric}")}
            assert logged == pytest.approx({entry["step"]: entry[metric] for entry in evals}, abs=1e-6), metric
