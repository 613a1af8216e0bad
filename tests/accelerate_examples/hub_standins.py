"""Small local stand-ins, under the Hub names Accelerate's example scripts load, so that the scripts
run offline and in seconds: a tiny `bert-base-cased`, a tiny `HuggingFaceTB/SmolLM-360M` (and the same
under `NousResearch/Hermes-3-Llama-3.1-8B`), MRPC-, wikitext- and TinyStories-shaped datasets, and the
`glue` metric.

Must not depend on Kiln or Accelerate: the same folder serves the real Accelerate's runs and Kiln's.

The scripts call `from_pretrained("bert-base-cased")`, `load_dataset("nyu-mll/glue", "mrpc")` and
`evaluate.load("glue", "mrpc")`; transformers, datasets and evaluate each look for a local folder
of that name (relative to the working directory) before the Hub, so `write_standins(folder)` and
running the scripts with `cwd=folder` is all it takes. The datasets are data files plus a README
whose `configs:` section names the config (`mrpc`, `wikitext-2-v1`); the metric is a local evaluate
module (`glue/glue.py`), the one kind of local script evaluate loads.
"""

import json
import random
from pathlib import Path

import torch

# Cased words of the generated sentences; each has one word-piece of its own in the vocabulary.
WORDS = ("The company said Tuesday its shares rose after profits fell sharply in the third quarter "
         "while analysts expected revenue to grow by percent last year officials reported new sales "
         "Bank Court Government agreed decision talks market index closed higher lower prices "
         "million billion dollars since deal early weeks months police arrested two men").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PUNCTUATION = [".", ","]

MRPC_ROWS = {"train": 288, "validation": 72, "test": 16}  # 288: automatic_gradient_accumulation's batch is 256
WIKITEXT_ROWS = {"train": 500, "validation": 48, "test": 16}  # its script selects the first 500 train rows


def write_standins(folder: Path, seed: int = 0) -> Path:
    """Write every stand-in under `folder` (the scripts' working directory); returns `folder`."""
    folder = Path(folder)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    train_pairs = write_mrpc(folder / "nyu-mll" / "glue", rng)
    write_bert(folder / "bert-base-cased", train_pairs)
    write_causal_lm(folder / "HuggingFaceTB" / "SmolLM-360M")
    write_wikitext(folder / "Salesforce" / "wikitext", rng)
    write_glue_metric(folder / "glue")
    # examples/torch_native_parallelism: a Llama under the 8B's name (its heads split over 2 processes)
    write_causal_lm(folder / "NousResearch" / "Hermes-3-Llama-3.1-8B", vocab_multiple=8)
    write_tiny_stories(folder / "roneneldan" / "TinyStories", rng)
    return folder


def write_bert(path: Path, pairs: list[dict]) -> None:
    """A 2-layer BERT of width 32, random weights, and a WordPiece tokenizer over WORDS. Dropout is
    off so that runs whose batches agree compute the same numbers (no draw from the global RNG);
    the classifier head is left out, as in the real checkpoint, so the script's seed initializes it."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + PUNCTUATION + list(dict.fromkeys(WORDS))) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=False, model_max_length=128)
    tokenizer.save_pretrained(path)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(config).eval()
    _center_pooler(model, tokenizer, pairs)
    # The classifier head that from_pretrained adds is drawn with this std: small, so that the
    # scripts' learning rate (2e-5, warming up over 100 steps) moves predictions within a few steps.
    model.config.initializer_range = 0.002
    model.save_pretrained(path)


@torch.no_grad()
def _center_pooler(model, tokenizer, pairs: list[dict]) -> None:
    """Random BERT weights give every sentence nearly the same pooled output (the [CLS] token's own
    embedding dominates), so a random classifier answers one class for all. Shift and scale the
    pooler so that its inputs have mean 0 and std 1 over these pairs: predictions then differ from
    pair to pair, and the metrics show it when training changes them."""
    batch = tokenizer([p["sentence1"] for p in pairs], [p["sentence2"] for p in pairs], padding=True,
                      return_tensors="pt")
    first_token = model.bert(**batch).last_hidden_state[:, 0]
    dense = model.bert.pooler.dense
    logits = first_token @ dense.weight.T
    mean, std = logits.mean(0), logits.std(0)
    dense.weight.div_(std[:, None])
    dense.bias.copy_(-mean / std)


def write_causal_lm(path: Path, vocab_multiple: int = 1) -> None:
    """A 2-layer Llama of width 32 (SmolLM's architecture) and a word-level tokenizer with an EOS
    token, which the script also uses for padding; `vocab_multiple` pads the vocabulary with unused
    tokens to a multiple (as real checkpoints do), so FSDP2 splits the embedding evenly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    words = ["<|endoftext|>", "<unk>"] + PUNCTUATION + list(dict.fromkeys(WORDS))
    words += [f"<unused{i}>" for i in range(-len(words) % vocab_multiple)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>",
                                        bos_token="<|endoftext|>", model_max_length=256)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)


def _sentence(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(5, 10))]


def mrpc_rows(count: int, rng: random.Random) -> list[dict]:
    """MRPC's columns. Label 1 ("equivalent"): sentence2 is sentence1 with one word changed; label
    0: an unrelated sentence. Half are 1 (MRPC has two thirds), so that always answering 1
    does not score best."""
    rows = []
    for idx in range(count):
        first = _sentence(rng)
        label = int(rng.random() < 0.5)
        if label:
            second = list(first)
            second[rng.randrange(len(second))] = rng.choice(WORDS)
        else:
            second = _sentence(rng)
        rows.append({"sentence1": " ".join(first) + " .", "sentence2": " ".join(second) + " .",
                     "label": label, "idx": idx})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _write_dataset_card(folder: Path, config_name: str, splits: dict[str, str]) -> None:
    """The README's `configs:` section is how datasets maps a config name to data files."""
    files = "".join(f"  - split: {split}\n    path: {file}\n" for split, file in splits.items())
    (folder / "README.md").write_text(f"---\nconfigs:\n- config_name: {config_name}\n  data_files:\n{files}---\n"
                                      "Generated stand-in for tests; not the real data set.\n")


def write_mrpc(folder: Path, rng: random.Random) -> list[dict]:
    """The train, validation and test splits; returns the train rows."""
    rows = {split: mrpc_rows(count, rng) for split, count in MRPC_ROWS.items()}
    for split, split_rows in rows.items():
        _write_jsonl(folder / "mrpc" / f"{split}.jsonl", split_rows)
    _write_dataset_card(folder, "mrpc", {split: f"mrpc/{split}.jsonl" for split in MRPC_ROWS})
    return rows["train"]


def write_wikitext(folder: Path, rng: random.Random) -> None:
    """wikitext's one `text` column, with its empty lines (the script filters them out): most are
    empty here, so that the 500 rows the script selects make a few dozen steps."""
    for split, count in WIKITEXT_ROWS.items():
        rows = [{"text": "" if rng.random() < 0.9 else " ".join(_sentence(rng) + _sentence(rng)) + " ."}
                for _ in range(count)]
        _write_jsonl(folder / "wikitext-2-v1" / f"{split}.jsonl", rows)
    _write_dataset_card(folder, "wikitext-2-v1", {split: f"wikitext-2-v1/{split}.jsonl" for split in WIKITEXT_ROWS})


def write_tiny_stories(folder: Path, rng: random.Random, rows: int = 400) -> None:
    """TinyStories' one `text` column (the default config's train split), enough words that the
    script packs a few dozen sequences of 32 tokens from the half of it that it reads."""
    stories = [{"text": " ".join(_sentence(rng) + _sentence(rng) + _sentence(rng)) + " ."} for _ in range(rows)]
    _write_jsonl(folder / "data" / "train.jsonl", stories)
    _write_dataset_card(folder, "default", {"train": "data/train.jsonl"})


GLUE_METRIC = '''"""Stand-in for the Hub's `glue` metric: the `mrpc` config's accuracy and F1 (of class 1)."""

import datasets
import evaluate


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name != "mrpc":
            raise KeyError(f"this stand-in has the mrpc config only, not {self.config_name!r}")
        return evaluate.MetricInfo(
            description="accuracy and F1 of binary predictions",
            citation="",
            inputs_description="predictions and references: lists of 0/1",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        true_positive = sum(1 for p, r in pairs if p == 1 and r == 1)
        predicted, actual = sum(1 for p, _ in pairs if p == 1), sum(1 for _, r in pairs if r == 1)
        f1 = 2 * true_positive / (predicted + actual) if predicted + actual else 0.0
        return {"accuracy": float(sum(1 for p, r in pairs if p == r) / len(pairs)), "f1": float(f1)}
'''


def write_glue_metric(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "glue.py").write_text(GLUE_METRIC)
