"""make test-latest's selection (tests/latest_selection.py): what a newer release can change is run."""

from latest_selection import select, versions

PINNED = "torch==2.13.0+cpu\ntransformers==5.25.0\npeft==0.21.2\nhuggingface-hub==2.5.0\ntorchao==0.18.0\n"


def _files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_lora.py").write_text("from peft import LoraConfig\n")
    (tmp_path / "test_fp8.py").write_text("mixed_precision = 'fp8'\n")
    (tmp_path / "test_plain.py").write_text("import torch\n")
    (tmp_path / "helper.py").write_text("import peft\n")  # not a test file
    return [str(tmp_path)]


def test_the_same_releases_run_nothing_and_a_new_peft_runs_the_files_that_reach_it(tmp_path):
    paths = _files(tmp_path)
    assert versions(PINNED)["huggingface_hub"] == "2.5.0"
    assert select(versions(PINNED), versions(PINNED), paths) == ([], [])
    files, differences = select(versions(PINNED), versions(PINNED.replace("peft==0.21.2", "peft==0.22.0")), paths)
    assert files == [str(tmp_path / "sub" / "test_lora.py")] and differences == ["peft 0.21.2 -> 0.22.0"]
    files, _ = select(versions(PINNED), versions(PINNED.replace("peft==0.21.2", "peft==0.22.0")
                                                 .replace("torchao==0.18.0", "torchao==0.19.0")), paths)
    assert sorted(files) == sorted([str(tmp_path / "sub" / "test_lora.py"), str(tmp_path / "test_fp8.py")])


def test_a_new_transformers_or_a_library_gone_runs_every_test_file(tmp_path):
    paths = _files(tmp_path)
    newer = PINNED.replace("transformers==5.25.0", "transformers==5.26.0")
    assert len(select(versions(PINNED), versions(newer), paths)[0]) == 3
    gone = PINNED.replace("huggingface-hub==2.5.0\n", "")
    files, differences = select(versions(PINNED), versions(gone), paths)
    assert len(files) == 3 and differences == ["huggingface_hub 2.5.0 -> None"]
