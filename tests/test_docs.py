"""Every code block in the README and the user guide (docs/) runs or is checked.

Python blocks run page by page in one namespace, in a temporary folder, on the CPU with
backend="aot_eager" in place of "inductor" (the same logic without minutes of gcc); a page whose
blocks are fragments starts from the prelude below (a model, an optimizer and a loader, as the
text assumes). Shell blocks are checked line by line without starting anything long: `kiln`
command lines are parsed by Kiln's own parser and `kiln launch` lines resolved into the command
they would run; `make` targets, `pip install` requirements and extras, and scripts must exist.
Blocks without a language are output, shown as printed.
"""

import re
import shlex
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

PRELUDE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from kiln import Accelerator, DataLoaderConfiguration, ProjectConfiguration, TorchDynamoPlugin

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, use_cache=False))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
_tokens = torch.randint(0, 64, (16, 16))
loader = torch.utils.data.DataLoader([{"input_ids": t, "labels": t} for t in _tokens], batch_size=4)
'''
# docs/parity.md shows the plain PyTorch loop itself, on a model that returns its loss.
PARITY_PRELUDE = '''
import torch
torch.manual_seed(0)
_net = torch.nn.Linear(8, 1)
model = lambda inputs, targets: torch.nn.functional.mse_loss(_net(inputs).squeeze(-1), targets)
model.parameters = _net.parameters
optimizer = torch.optim.SGD(_net.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16)), batch_size=4)
device_type, accumulation_steps, max_norm = "cpu", 2, 1.0
'''


def blocks(page: Path, languages: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang in languages]


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, ("python",))], ids=page_id)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    exec(PARITY_PRELUDE if page.name == "parity.md" else PRELUDE, namespace)
    for body in blocks(page, ("python",)):
        code = body.replace('backend="inductor"', 'backend="aot_eager"')
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                exec(compile(code, f"{page_id(page)} block", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"a Python block of {page_id(page)} failed:\n{body}") from error
        kiln_warnings = [str(w.message) for w in caught if w.category.__name__.startswith("Kiln")]
        assert not kiln_warnings, f"a Python block of {page_id(page)} warns: {kiln_warnings}\n{body}"


def shell_lines(body: str) -> list[list[str]]:
    """Each command of a shell block as words: continuations joined, comments and VAR=value dropped."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words:
            commands.append(words)
    return commands


def check_make(words: list[str]) -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    assert set(words[1:]) <= targets, f"no such make target: {words}"


def check_pip(words: list[str]) -> None:
    assert words[1] == "install", words
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    args = iter(words[2:])
    for arg in args:
        if arg == "-r":
            assert (ROOT / next(args)).is_file(), words
        elif arg == "-e":
            continue
        else:
            match = re.fullmatch(r"(\.|kiln-torch)(?:\[([\w,]+)\])?", arg)
            assert match, f"install line names something other than this project: {words}"
            assert set(filter(None, (match.group(2) or "").split(","))) <= extras, words


def check_kiln(words: list[str]) -> None:
    from kiln.cli import build_parser
    from kiln.cli.launch import build_command
    from kiln.cli.settings import BY_NAME, load_config_file, resolve

    args = build_parser().parse_args(words[1:])
    if words[1] in ("launch", "config"):
        flags = {name: value for name, value in vars(args).items() if name in BY_NAME}
        config_file = getattr(args, "config_file", None)
        config = load_config_file(config_file) if config_file and Path(config_file).is_file() else {}
        settings = resolve(flags, config)
        if words[1] == "launch":
            assert build_command(settings, args.script, args.script_args)[-1 - len(args.script_args)] == args.script


def check_script(words: list[str]) -> None:
    assert (ROOT / words[1]).is_file(), f"no such script: {words}"


CHECKS = {"make": check_make, "pip": check_pip, "kiln": check_kiln, "bash": check_script, "python": check_script}


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, ("bash",))], ids=page_id)
def test_shell_blocks_name_what_exists_and_parse(page):
    for body in blocks(page, ("bash",)):
        for words in shell_lines(body):
            assert words[0] in CHECKS, f"{page_id(page)}: a command the docs test cannot check: {words}"
            CHECKS[words[0]](words)


def test_every_code_block_has_a_language_the_test_knows_or_is_output():
    for page in PAGES:
        for lang, _ in FENCE.findall(page.read_text()):
            assert lang in ("", "python", "bash"), f"{page_id(page)}: a ```{lang} block nothing checks"


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text) < 6000  # the rest lives in docs/
    for link in re.findall(r"\]\(([^)#]+)", text):
        assert link.startswith("http") or (ROOT / link).exists(), link
    for page in PAGES:  # and the guide's own links
        for link in re.findall(r"\]\(([^)#]+)", page.read_text()):
            assert link.startswith("http") or (page.parent / link).exists(), (page_id(page), link)
